"""The simulation of a whole Hugging Face run (memlab.hf.simulate) against the real step and the estimate.

Small configs of today's families (tests/hf_families.py): ``simulate_hf`` on target ``cpu``
equals ``measure_hf`` (the real ``transformers`` class, real peft adapters, real bitsandbytes
``AdamW8bit`` and ``Linear4bit`` on this CPU) within 0.5% for 4 micro-batches, LoRA r=8 with
dropout 0.1, 8-bit AdamW and QLoRA. Shipped 8B configs at seq 4096 on target ``cuda``: the
estimate and the simulation agree within 3% for every option (the full 32/36-layer matrix is
``slow``; two layers of the same config, every width unchanged, run by default). The CLI's
``simulate --hf-config`` takes every flag ``estimate`` takes and lands within 3% of it.
"""
import functools
import json

import pytest

bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

from hf_families import BATCH, SEQ  # noqa: E402
from test_hf_lora import CONFIGS  # noqa: E402
from test_hf_run_options import _step  # noqa: E402

from memlab.app.cli import main  # noqa: E402
from memlab.core.errors import InputError  # noqa: E402
from memlab.hf import config as hf  # noqa: E402
from memlab.hf.estimate import estimate_hf  # noqa: E402
from memlab.hf.measure import measure_hf  # noqa: E402
from memlab.hf.simulate import simulate_hf  # noqa: E402
from memlab.lenses.your_model import track_step  # noqa: E402
from memlab.step.fine_tune_config import LoraConfig, QuantConfig  # noqa: E402
from memlab.step.low_bit import adam_state_bytes, quantized_weight_bytes  # noqa: E402

MOE_TARGETS = {"mixtral": "q_proj,k_proj,v_proj,o_proj", "qwen3_moe": "q_proj,k_proj,v_proj,o_proj",
               "gpt_oss": "q_proj,k_proj,v_proj,o_proj", "deepseek_v3": "q_a_proj,kv_a_proj_with_mqa,o_proj"}


def _run(name: str, option: str) -> dict:
    lora = LoraConfig(rank=8, dropout=0.1, targets=MOE_TARGETS.get(name, "all-linear"))
    return {"accumulation": dict(batch=4, micro_batches=4), "lora": dict(batch=BATCH, lora=lora),
            "8bit": dict(batch=BATCH, optimizer="adamw-8bit"),
            "qlora": dict(batch=BATCH, lora=lora, quantization=QuantConfig(bits=4, compute_dtype="bf16"))}[option]


@functools.lru_cache(maxsize=None)
def _measured(name: str, option: str):
    import torch
    torch.manual_seed(0)
    if option == "accumulation":  # the learner's own loop (tests/test_hf_run_options.py), not memlab's
        model, opt = hf.build_fn(CONFIGS[name])()
        step = _step(4, "fp32", 4)
        return track_step(lambda: step(model, opt), model=model, optimizer=opt)
    return measure_hf(CONFIGS[name], seq=SEQ, precision="fp32", **_run(name, option))


OPTIONS = ("accumulation", "lora", "8bit", "qlora")
FAST = [("llama", o) for o in OPTIONS] + [("gpt2", "qlora")]
# LoRA on the attention of each mixture of experts: frozen experts, whose routed inputs the real
# grouped GEMM does not keep (mixtral was 11.8% high, deepseek_v3 5.6%, gpt_oss 7.4% while the fake
# experts ran transformers' grouped_mm_fallback op, which saves its input always)
SLOW = [(n, o) for n in ("qwen3", "gemma2", "phi3", "gpt2", "mixtral", "deepseek_v3") for o in OPTIONS
        if (n, o) not in FAST] + [("qwen3_moe", "lora"), ("gpt_oss", "lora")]


def _check_equal(name: str, option: str) -> None:
    real = _measured(name, option)
    sim = simulate_hf(CONFIGS[name], seq=SEQ, precision="fp32", target="cpu", **_run(name, option))
    assert sim.peak_bytes == pytest.approx(real.peak_bytes, rel=0.005), (sim.by_category, real.by_category)


@pytest.mark.parametrize("name,option", FAST)
def test_simulation_equals_the_real_step(name, option):
    """Fake tensors, the real step's peak within 0.5% (on these it lands to the byte)."""
    _check_equal(name, option)


@pytest.mark.slow
@pytest.mark.parametrize("name,option", SLOW)
def test_simulation_equals_the_real_step_on_every_family(name, option):
    _check_equal(name, option)


def test_8bit_and_4bit_state_are_bitsandbytes_layout():
    """The fake 8-bit moments and the packed base hold low_bit's bytes (second source: the
    formulas of Dettmers et al., bitsandbytes' block sizes), and the real step's state the same."""
    from memlab.hf.shape import decoder_shape
    s = decoder_shape(CONFIGS["llama"])
    sim = simulate_hf(CONFIGS["llama"], seq=SEQ, target="cpu", **_run("llama", "8bit"))
    assert sim.by_category["optimizer"] == adam_state_bytes(s.param_numels(), "adamw-8bit") \
        == _measured("llama", "8bit").by_category["optimizer"]
    q = simulate_hf(CONFIGS["llama"], seq=SEQ, target="cpu", **_run("llama", "qlora"))
    lin = [io for i in range(s.n_layer) for v in s.linears(i).values() for io in v]
    packed = sum((i * o + 1) // 2 for i, o in lin)               # two NF4 values a byte (the Parameter)
    rest = 2 * (s.num_params() - sum(i * o for i, o in lin))  # embeddings, norms, head in bf16
    adapters = sum(4 * 8 * (i + o) for i, o in lin)             # fp32 A and B, r = 8
    # each weight's state: the maxima (uint8, double quantised), their fp32 maxima and offset, and
    # its own copies of the NF4 code (16 fp32) and the nested maxima's map (256 fp32)
    stats = sum(-(-i * o // 64) + 4 * -(-i * o // 64 // 256) + 4 + 4 * (16 + 256) for i, o in lin)
    assert stats == sum(quantized_weight_bytes(o, i) - (i * o + 1) // 2 for i, o in lin)
    assert q.by_category["parameters"] == packed + rest + adapters + stats == \
        _measured("llama", "qlora").by_category["parameters"]


def test_paged_state_is_host_bytes_from_1e5_elements():
    """Paged 8-bit AdamW: AdamW8bit's state, the uint8 moments of each tensor of 1e5 elements or more off
    the device timeline, on the host (bitsandbytes 0.50 ``get_state_buffer``); a LoRA run's adapters are
    all smaller, so their state stays on the device."""
    cfg = {**CONFIGS["llama"], "vocab_size": 1024}  # embedding and head of 1024 x 128 = 131,072 elements
    kw = dict(seq=SEQ, batch=BATCH, target="cpu")
    plain = simulate_hf(cfg, optimizer="adamw-8bit", **kw)
    paged = simulate_hf(cfg, optimizer="paged-adamw-8bit", **kw)
    unified = 2 * 2 * 1024 * 128
    assert paged.host_by_category["optimizer"] == unified
    assert paged.by_category["optimizer"] == plain.by_category["optimizer"] - unified
    assert paged.peak_bytes == plain.peak_bytes - unified
    lora = simulate_hf(cfg, optimizer="paged-adamw-8bit", lora=LoraConfig(rank=8), **kw)
    assert lora.host_by_category["optimizer"] == 0 < lora.by_category["optimizer"]


# ---- shipped 8B configs at seq 4096, target cuda: the estimate against the simulation
L16 = LoraConfig(rank=16, dropout=0.1)
RUNS = {"plain": dict(batch=1), "accumulation": dict(batch=4, micro_batches=4), "lora": dict(batch=1, lora=L16),
        "8bit": dict(batch=1, optimizer="adamw-8bit"), "qlora": dict(batch=1, lora=L16, quantization=QuantConfig()),
        "zero1": dict(batch=1, zero=1, world_size=8), "zero2": dict(batch=1, zero=2, world_size=8),
        "zero3": dict(batch=1, zero=3, world_size=8),
        "zero2-offload": dict(batch=1, zero=2, world_size=8, offload="optimizer"),
        "lora-zero2": dict(batch=1, zero=2, world_size=8, lora=L16)}


def _agree(name: str, option: str, layers: int | None) -> None:
    cfg = hf.shipped_config(name)
    if layers:
        cfg["num_hidden_layers"] = layers
    kw = dict(seq=4096, precision="bf16", checkpointing="full", target="cuda", **RUNS[option])
    sim, est = simulate_hf(cfg, **kw), estimate_hf(cfg, **kw)
    assert est.peak_bytes == pytest.approx(sim.peak_bytes, rel=0.03), (est.by_category, sim.by_category)
    assert est.host_bytes == pytest.approx(sim.host_bytes, rel=0.01, abs=2**20)


@pytest.mark.parametrize("option", ["plain", "accumulation", "qlora", "zero3", "zero2-offload"])
def test_8b_estimate_agrees_with_the_simulation_on_two_layers(option):
    _agree("llama-3.1-8b", option, 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-8b"])
@pytest.mark.parametrize("option", list(RUNS))
def test_8b_estimate_agrees_with_the_simulation(name, option):
    _agree(name, option, None)


@pytest.mark.parametrize("name", ["gpt2", "mixtral"])
def test_small_zero3_estimate_holds_the_flat_buffer_the_simulation_replays(name):
    """ZeRO-3 on 2 ranks at the small configs: the root's prefetch takes the whole model, and the
    forward holds its flat buffer beside the copies until the last parameter is fetched
    (memlab.step.zero3_gathers.gathered_in_closed_form); the simulation replays the coordinator
    within 0.012% of real DeepSpeed (tests/test_hf_zero.py, which runs Llama by default: there the
    loss's backward happens to hold as much). Achieved +0.27% and -0.54%; without the flat buffer
    -3.6% and -6.0%."""
    kw = dict(seq=SEQ, batch=BATCH, zero=3, world_size=2, target="cpu")
    sim, est = simulate_hf(CONFIGS[name], **kw), estimate_hf(CONFIGS[name], **kw)
    assert -0.02 <= est.peak_bytes / sim.peak_bytes - 1 <= 0.03, (est.notes[0], est.by_category, sim.by_category)


@pytest.mark.parametrize("batch", [1, 4])
def test_first_gradient_hook_holds_a_tied_heads_gradient(batch):
    """ZeRO-2's first gradient hook (the final norm's weight's) on Gemma 2, whose head is tied:
    the head's weight gradient waits in autograd's buffer for the embedding's backward beside the
    norm backward's five fp32 tokens x hidden tensors. The simulation is held to real DeepSpeed
    within 0.5% (tests/test_hf_zero.py); at 2 sequences the gradient weighs two of those tensors,
    so the seven counted before matched there and read -1.2% and +1.2% at 1 and 4. Achieved
    -0.11% and +0.16%."""
    kw = dict(seq=SEQ, batch=batch, zero=2, world_size=2, target="cpu")
    sim, est = simulate_hf(CONFIGS["gemma2"], **kw), estimate_hf(CONFIGS["gemma2"], **kw)
    assert "first gradient hook" in est.notes[0]
    assert abs(est.peak_bytes / sim.peak_bytes - 1) <= 0.004, (est.by_category, sim.by_category)


def test_simulation_refuses_what_the_estimate_refuses():
    with pytest.raises(InputError, match="LoRA under ZeRO-3"):
        simulate_hf(CONFIGS["llama"], seq=SEQ, batch=BATCH, zero=3, world_size=2, lora=LoraConfig())
    with pytest.raises(InputError, match="into 3 micro-batches"):
        simulate_hf(CONFIGS["llama"], seq=SEQ, batch=4, micro_batches=3)


# ---- the CLI: simulate takes what estimate takes
def _files(tmp_path):
    sft = tmp_path / "sft.yaml"
    sft.write_text("per_device_train_batch_size: 1\ngradient_accumulation_steps: 2\nbf16: true\n"
                   "gradient_checkpointing: true\nmax_length: 1024\noptim: adamw_torch\n")
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                              "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}}))
    return sft, ds


def _cli_agrees(config: str, tmp_path, capsys) -> None:
    sft, ds = _files(tmp_path)
    flags = ["--hf-config", config, "--load-in-4bit", "--lora-rank", "16", "--training-args", str(sft),
             "--deepspeed", str(ds), "--world-size", "8", "--json"]
    assert main(["estimate", *flags]) == 0
    est = json.loads(capsys.readouterr().out)
    assert main(["simulate", *flags]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["lens"] == "simulate" and sim["config"]["zero"] == 2 and sim["config"]["micro_batches"] == 2
    assert sim["config"]["quantization"]["bits"] == 4 and sim["config"]["lora"]["rank"] == 16
    assert est["peak_bytes"] == pytest.approx(sim["peak_bytes"], rel=0.03)


def test_cli_simulates_qlora_with_trainer_and_deepspeed_configs_on_two_layers(tmp_path, capsys):
    cfg = dict(hf.shipped_config("qwen3-8b"), num_hidden_layers=2)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    _cli_agrees(str(path), tmp_path, capsys)


@pytest.mark.slow
def test_cli_simulates_qwen3_8b_qlora_with_trainer_and_deepspeed_configs(tmp_path, capsys):
    """The issue's command, simulate beside estimate."""
    _cli_agrees("qwen3-8b", tmp_path, capsys)
