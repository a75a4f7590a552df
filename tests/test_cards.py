"""Card profiles: detection from patched device properties, the kernels and workspaces each
capability has, and the lenses following the card."""
from types import SimpleNamespace

import pytest
import torch

from memlab.core import cards
from memlab.core.cards import CARDS, detect_card, get_card
from memlab.core.errors import InputError
from memlab.core.hardware import GPU_PRESETS, resolve_budget
from memlab.lenses.estimate import estimate_step
from memlab.policy import get_target, resolve_target, sdpa_backend
from memlab.step.training_step import StepConfig

MiB, GiB = 2**20, 2**30


def props(name: str, gib: float, cap: tuple[int, int]):
    """What torch.cuda.get_device_properties returns, as far as detection reads it."""
    return SimpleNamespace(name=name, total_memory=int(gib * GiB), major=cap[0], minor=cap[1])


# (device name as torch reports it, GiB torch reports, capability, expected profile)
DEVICES = [
    ("Tesla T4", 14.75, (7, 5), "T4-16GB"),
    ("Tesla V100-SXM2-16GB", 15.77, (7, 0), "V100-16GB"),
    ("Tesla V100-SXM2-32GB", 31.74, (7, 0), "V100-32GB"),
    ("NVIDIA GeForce RTX 3090", 23.69, (8, 6), "RTX3090-24GB"),
    ("NVIDIA GeForce RTX 4090", 23.64, (8, 9), "RTX4090-24GB"),
    ("NVIDIA L4", 22.05, (8, 9), "L4-24GB"),
    ("NVIDIA A10G", 22.06, (8, 6), "A10G-24GB"),
    ("NVIDIA A100-SXM4-40GB", 39.39, (8, 0), "A100-40GB"),
    ("NVIDIA A100-SXM4-80GB", 79.15, (8, 0), "A100-80GB"),
    ("NVIDIA A100 80GB PCIe", 79.15, (8, 0), "A100-80GB"),
    ("NVIDIA H100 80GB HBM3", 79.10, (9, 0), "H100-80GB"),
    ("NVIDIA H200", 139.81, (9, 0), "H200-141GB"),
]


@pytest.mark.parametrize("name, gib, cap, expected", DEVICES)
def test_a_device_maps_to_its_profile_with_its_own_memory(name, gib, cap, expected):
    card = detect_card(props(name, gib, cap), env={})
    assert card.name == expected
    assert card.memory == int(gib * GiB) and card.capability == cap and card.gpus == 1
    assert card.bf16_native == (cap >= (8, 0))
    assert card.precision == ("bf16" if cap >= (8, 0) else "fp16")


def test_no_gpu_means_no_card(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert detect_card(env={}) is None
    # the lenses then predict for the CPU when nothing names a card
    assert resolve_target(None).name == "cpu"


def test_the_present_gpu_is_read_from_torch(monkeypatch):
    """One and two patched GPUs: torch's device count makes Kaggle's 2 x T4 profile."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: props("Tesla T4", 14.75, (7, 5)))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("MEMLAB_CARD", raising=False)
    assert detect_card().name == "T4-16GB"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    two = detect_card()
    assert two.name == "2xT4-16GB" and two.gpus == 2 and two.total_memory == 2 * two.memory
    # the target of a lens left to choose is the CUDA target for that card
    tgt = resolve_target(None)
    assert tgt.name == "cuda" and tgt.card.capability == (7, 5)
    assert resolve_target(None, device="cpu").name == "cpu"
    assert resolve_target("cpu").name == "cpu"


def test_an_unknown_gpu_gets_a_profile_from_its_properties():
    card = detect_card(props("NVIDIA RTX PRO 6000 Blackwell", 94.97, (12, 0)), env={})
    assert card.name == "RTXPRO6000Blackwell-102GB"
    assert card.capability == (12, 0) and card.bf16_native and card.memory == int(94.97 * GiB)
    assert card.sdpa_kernels(2, "bf16")[0] == "flash"


@pytest.mark.parametrize("cap, bf16, fp16, fp32", [
    # sdp_utils.cpp: flash sm80+ for 16-bit; efficient fp16/fp32 below sm80, and bf16 from sm80
    ((7, 0), ("math",), ("efficient", "math"), ("efficient", "math")),
    ((7, 5), ("math",), ("efficient", "math"), ("efficient", "math")),
    ((8, 0), ("flash", "efficient", "math"), ("flash", "efficient", "math"), ("efficient", "math")),
    ((8, 6), ("flash", "efficient", "math"), ("flash", "efficient", "math"), ("efficient", "math")),
    ((8, 9), ("flash", "efficient", "math"), ("flash", "efficient", "math"), ("efficient", "math")),
    ((9, 0), ("flash", "efficient", "math"), ("flash", "efficient", "math"), ("efficient", "math")),
])
def test_attention_kernels_follow_the_capability(cap, bf16, fp16, fp32):
    card = cards.Card("x", 16 * GiB, cap)
    assert card.sdpa_kernels(2, "bf16") == bf16
    assert card.sdpa_kernels(2, "fp16") == fp16
    assert card.sdpa_kernels(4) == fp32


def test_cublas_workspace_per_capability():
    # CublasHandlePool.cpp: 32 MiB on sm90, 8 MiB + 128 KiB elsewhere; cuBLASLt 1 MiB
    assert get_card("H200-141GB").cublas_workspace(env={}) == 33 * MiB
    assert get_card("H100-80GB").cublas_workspace(env={}) == 33 * MiB
    for name in ("T4-16GB", "V100-16GB", "A100-80GB", "RTX4090-24GB", "L4-24GB"):
        assert get_card(name).cublas_workspace(env={}) == 9 * MiB + 128 * 1024


def test_every_preset_is_a_card_and_a_budget():
    assert set(GPU_PRESETS) == set(CARDS)
    assert {"T4-16GB", "2xT4-16GB", "V100-16GB", "V100-32GB", "RTX3090-24GB", "RTX4090-24GB",
            "L4-24GB", "A10G-24GB", "A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB"} <= set(CARDS)
    for name, card in CARDS.items():
        assert resolve_budget(name) == card.memory
        assert 15 * GiB <= card.memory <= 141 * GiB
        assert get_target("cuda", name).card is card
    with pytest.raises(InputError, match="unknown GPU preset 'T5-16GB'; allowed: T4-16GB"):
        get_card("T5-16GB")


def test_a_rehearsal_names_the_smaller_card_and_switches_flash_off():
    h200 = props("NVIDIA H200", 139.81, (9, 0))
    t4 = detect_card(h200, env={"MEMLAB_CARD": "T4-16GB"})
    assert t4.name == "T4-16GB" and t4.rehearsal == "NVIDIA H200"
    assert t4.memory == 15360 * MiB and not t4.bf16_native
    assert t4.sdpa_kernels(2, "fp16") == ("efficient", "math")
    assert "rehearsed on NVIDIA H200" in t4.describe()
    with pytest.raises(InputError, match="can only shrink"):
        detect_card(props("Tesla T4", 14.75, (7, 5)), env={"MEMLAB_CARD": "A100-80GB"})
    with pytest.raises(InputError, match="needs 2 GPUs"):
        detect_card(h200, env={"MEMLAB_CARD": "2xT4-16GB"})


def test_sm75_attention_in_the_estimate():
    """On a T4, fp16 attention runs the memory-efficient kernel (LSE padded to 32 rows) and
    bf16 the math composite, which keeps fp32 q, k, v and the fp32 probabilities: the bf16
    step's activations exceed the fp16 one's by exactly that, per layer."""
    b, s, cfg = 4, 256, "gpt2-small"
    fp16 = estimate_step(StepConfig(model=cfg, seq=s, batch=b, precision="fp16"), card="T4-16GB")
    bf16 = estimate_step(StepConfig(model=cfg, seq=s, batch=b, precision="bf16"), card="T4-16GB")
    h200 = estimate_step(StepConfig(model=cfg, seq=s, batch=b, precision="bf16"), card="H200-141GB")
    L, a, d = 12, 12, 64
    probs = 4 * b * a * s * s                     # fp32 softmax output
    qkv = 3 * (4 - 2) * b * s * a * d             # q, k, v in fp32 instead of 16 bits
    lse_eff = 4 * b * a * (-(-s // 32) * 32)      # efficient kernel's log-sum-exp (fp16)
    extra = L * (probs + qkv - lse_eff)
    assert bf16.by_category["activations"] - fp16.by_category["activations"] == extra
    assert sdpa_backend(get_target("cuda", card="T4-16GB"), 2, d, dtype="bf16") == "math"
    assert sdpa_backend(get_target("cuda", card="T4-16GB"), 2, d, dtype="fp16") == "efficient"
    assert sdpa_backend(get_target("cuda", card="A100-40GB"), 2, d, dtype="bf16") == "flash"
    # the H200 card keeps flash for bf16: far less than the T4's math kernel
    assert h200.by_category["activations"] < bf16.by_category["activations"]


def test_sm75_simulation_runs_the_math_kernel_as_the_estimate_counts_it():
    """The simulation on a T4 dispatches bf16 attention to the math composite (fp16 keeps a
    fused kernel): its peak agrees with the estimate's math-kernel rule within 0.1%, both
    without workspace (the simulation's includes the allocator's unsplit blocks, which a
    formula cannot know: memlab.policy.caching_allocator)."""
    from memlab.lenses.simulate import simulate_step
    for precision in ("bf16", "fp16"):
        step = StepConfig(model="tiny", seq=256, batch=4, precision=precision)
        sim = simulate_step(step, card="T4-16GB")
        est = estimate_step(step, card="T4-16GB")
        tensors = [r.peak_bytes - r.by_category["workspace"] for r in (sim, est)]
        assert abs(tensors[0] / tensors[1] - 1) < 0.001, precision
    bf16 = simulate_step(StepConfig(model="tiny", seq=256, batch=4, precision="bf16"), card="T4-16GB")
    fp16 = simulate_step(StepConfig(model="tiny", seq=256, batch=4, precision="fp16"), card="T4-16GB")
    assert bf16.by_category["activations"] > 1.3 * fp16.by_category["activations"]


def test_kaggle_two_t4s_run_the_rank_lessons_on_nccl_one_rank_per_gpu(monkeypatch):
    """2 x T4: detection gives the 2-GPU profile, and place_ranks puts the rank lessons' two
    ranks on NCCL, rank r on cuda:r (offload's shrink keeps both); one T4 sends them to CPU."""
    from memlab.core.hardware import place_ranks
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: props("Tesla T4", 14.75, (7, 5)))
    monkeypatch.delenv("MEMLAB_CARD", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    card = detect_card()
    for place in (place_ranks(2), place_ranks(2, gpus=card.gpus), place_ranks(2, shrink=True)):
        assert place.backend == "nccl" and place.devices == ("cuda:0", "cuda:1")
        assert place.rank_env() == {"DS_ACCELERATOR": "cuda"}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    one = detect_card()
    assert one.gpus == 1 and place_ranks(2, gpus=one.gpus).backend == "gloo"
    assert place_ranks(2, shrink=True).devices == ("cuda:0",)


def test_the_a10g_profile_says_its_figures_are_the_a10s():
    """NVIDIA publishes no A10G datasheet, and the A10G's tensor throughput is not the A10's:
    the profile times it with the NVIDIA A10 datasheet's dense figures (FP32 31.2, TF32 62.5,
    FP16/BF16 125 TFLOPS; 600 GB/s; PCIe Gen4 x16 64 GB/s both ways) and its source says so."""
    sp = cards.SPEEDS["A10G-24GB"]
    assert sp.datasheet.startswith("NVIDIA A10 datasheet") and "the A10's figures" in sp.datasheet
    assert "none is published for the A10G" in sp.datasheet
    assert dict(sp.tflops) == {"fp32": 31.2, "tf32": 62.5, "bf16": 125, "fp16": 125}
    assert (sp.hbm, sp.nvlink, sp.pcie) == (600e9, 0, 32e9)   # PCIe: one direction
