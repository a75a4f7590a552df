"""torchao's low-bit AdamW (8-bit, 4-bit, FP8) as optimizer states memlab counts.

Expected numbers: the state torchao 0.18 itself allocates after one real step on this CPU (every
state tensor's bytes, a tensor subclass counted by its inner tensors: codes, block scales, code
table), against :func:`memlab.step.low_bit.torchao_state_bytes`, the layout read off torchao's
source (``adam.py:75`` floor and divisibility, ``subclass_*bit.py`` zeros).
"""
import pytest
import torch
from hf_families import BATCH, SEQ
from test_hf_lora import LLAMA as LLAMA_HF

from memlab.core.torch_private import profiler_memory_events
from memlab.hf.config import load_config
from memlab.hf.estimate import estimate_hf
from memlab.hf.measure import measure_hf
from memlab.hf.shape import decoder_shape
from memlab.hf.simulate import simulate_hf
from memlab.lenses.estimate import estimate_step
from memlab.lenses.measure import allocator_peak, measure_step
from memlab.lenses.simulate import simulate_step
from memlab.models.gpt_unet import get_config, tiny_llama
from memlab.step.low_bit import (
    TORCHAO,
    TORCHAO_LAYOUTS,
    TORCHAO_STEP_BYTES,
    torchao_adamw,
    torchao_state_bytes,
    torchao_update_bytes,
)
from memlab.step.training_step import StepConfig

pytest.importorskip("torchao")

#: both sides of the 4096-element floor, a size no block divides (4160 = 65 * 64), a vector, 3-d
SHAPES = [(64, 128), (100,), (65, 64), (4096,), (3, 32, 256), (48, 48)]


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes ``t`` holds: its storage, or a torchao subclass's inner tensors (``__tensor_flatten__``)."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        return sum(_tensor_bytes(getattr(t, name)) for name in t.__tensor_flatten__()[0])
    return t.numel() * t.element_size()


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", TORCHAO)
def test_the_layout_is_torchaos_own_state_after_one_step(kind, dtype):
    params = [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in SHAPES]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torchao_adamw(params, kind)
    opt.step()
    for p, shape in zip(params, SHAPES, strict=True):
        state = opt.state[p]
        moments = _tensor_bytes(state["exp_avg"]) + _tensor_bytes(state["exp_avg_sq"])
        assert moments == torchao_state_bytes([p.numel()], kind, dtype.itemsize), shape
        assert _tensor_bytes(state["step"]) == TORCHAO_STEP_BYTES and state["step"].device.type == "cpu"


@pytest.mark.parametrize("kind", [k if k == "torchao-adamw-4bit" else pytest.param(k, marks=pytest.mark.slow)
                                  for k in TORCHAO])  # 4-bit (the largest scratch) by default
def test_the_compiled_update_allocates_what_the_layout_says(kind):
    """The allocator's events over one steady compiled step of one tensor (torchao's own, on this CPU):
    their running peak is :func:`torchao_update_bytes` for a 1-d and 2-d quantised tensor, and a few
    scalars (under 16 B) for one torchao keeps in full precision."""
    for shape in [(4096,), (1024, 256), (48, 48)]:
        p = torch.nn.Parameter(torch.randn(shape))
        p.grad = torch.randn_like(p)
        opt = torchao_adamw([p], kind)
        opt.step()
        peak, _ = allocator_peak(profiler_memory_events(opt.step))
        assert torchao_update_bytes(p.numel(), kind) <= peak <= torchao_update_bytes(p.numel(), kind) + 16, shape


LLAMA = tiny_llama()  # 2 layers, d_model 64: tensors on both sides of the 4096-element floor
#: by default memlab's tiny llama in bf16 with the 4-bit update (the largest scratch; every lens compiles
#: torchao's update once per tensor shape, seconds each on two cores); the other kinds and the tiny GPT
#: under ``make test-slow``
GPT_CASES = [pytest.param(kind, model, precision, id=f"{kind}-{getattr(model, 'name', model)}-{precision}",
                          marks=[] if model is LLAMA and kind == "torchao-adamw-4bit" else [pytest.mark.slow])
             for kind in TORCHAO for model, precision in (("tiny", "fp32"), (LLAMA, "bf16"))]


@pytest.mark.parametrize("kind, model, precision", GPT_CASES)
def test_memlabs_gpt_runs_torchaos_state_in_every_lens(kind, model, precision):
    """Measured: torchao's real optimizer, compiled by torchao itself (peak from the allocator's events
    over the tracked state). The held state is the layout plus one fp32 step counter per tensor (on the
    CPU the host is the device); the simulation (torchao's subclasses on fake tensors) equals the
    measured peak, and the estimate, which counts the layout, is within 2%."""
    step = StepConfig(model=model, seq=64, batch=4, precision=precision, optimizer=kind)
    numels = (get_config(model) if isinstance(model, str) else model).param_numels()
    state = torchao_state_bytes(numels, kind, 4)  # autocast: fp32 weights
    measured = measure_step(step)
    assert measured.by_category["optimizer"] == state + TORCHAO_STEP_BYTES * len(numels)
    sim, est = simulate_step(step, target="cpu"), estimate_step(step, target="cpu")
    assert sim.category_peaks()["optimizer"] == measured.by_category["optimizer"]
    assert est.by_category["optimizer"] == state
    assert abs(sim.peak_bytes - measured.peak_bytes) <= 0.005 * measured.peak_bytes
    assert abs(est.peak_bytes - measured.peak_bytes) <= 0.02 * measured.peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["torchao-adamw-4bit", "torchao-adamw-8bit"])
def test_stepped_in_backward_each_update_peaks_in_its_own_block(kind):
    """One torchao optimizer per tensor, stepped in its gradient's hook: the 4-bit update of a block's
    MLP matrix (26 bytes an element) is the peak, with the block's activations alive; the simulation
    equals the measured step and the estimate, which puts that scratch in the block's backward, is
    within 2% (4-bit: -216 B; 8-bit: +0.6%)."""
    step = StepConfig(model="tiny", seq=64, batch=4, precision="fp32", optimizer=kind, optimizer_in_backward=True)
    measured = measure_step(step)
    sim, est = simulate_step(step, target="cpu"), estimate_step(step, target="cpu")
    assert abs(sim.peak_bytes - measured.peak_bytes) <= 0.005 * measured.peak_bytes
    assert abs(est.peak_bytes - measured.peak_bytes) <= 0.02 * measured.peak_bytes


#: by default FP8 in bf16 (no compiled scratch: the quickest); the others under ``make test-slow``
HF_CASES = [pytest.param("torchao-adamw-8bit", "fp32", marks=pytest.mark.slow),
            pytest.param("torchao-adamw-4bit", "pure-bf16", marks=pytest.mark.slow), ("torchao-adamw-fp8", "bf16")]


def _hf_id(case) -> str:
    kind, precision = case.values if hasattr(case, "values") else case
    return f"{kind}-{precision}"


@pytest.mark.parametrize("kind, precision", HF_CASES, ids=[_hf_id(c) for c in HF_CASES])
def test_a_hugging_face_decoders_run_counts_torchaos_state(kind, precision):
    """transformers' Llama (two layers), its real step with torchao's optimizer on this CPU: the held
    state is the layout (moments of tensors torchao keeps whole in the weights' dtype: 16-bit under
    pure-bf16) plus the step counters; the simulation equals it, the estimate is within 2%."""
    kw = dict(seq=SEQ, batch=BATCH, precision=precision, optimizer=kind)
    measured = measure_hf(LLAMA_HF, **kw)
    numels = decoder_shape(load_config(LLAMA_HF)).param_numels()
    state = torchao_state_bytes(numels, kind, 2 if precision == "pure-bf16" else 4)
    assert measured.by_category["optimizer"] == state + TORCHAO_STEP_BYTES * len(numels)
    sim, est = simulate_hf(LLAMA_HF, target="cpu", **kw), estimate_hf(LLAMA_HF, target="cpu", **kw)
    assert sim.category_peaks()["optimizer"] == measured.by_category["optimizer"]
    assert est.by_category["optimizer"] == state
    assert abs(sim.peak_bytes - measured.peak_bytes) <= 0.005 * measured.peak_bytes
    assert abs(est.peak_bytes - measured.peak_bytes) <= 0.02 * measured.peak_bytes


def test_the_states_account_for_torchaos_published_llama2_7b_savings():
    """torchao's README (pytorch/ao torchao/optim/README.md, "Fine-tune Llama2-7B on Alpaca", torchtune
    52d1b838, full BF16, A100): peak memory allocated (torchtune's get_memory_stats,
    ``max_memory_allocated / 1024**3``: GiB) 51.6 with PyTorch's fused AdamW, 39.1 with ao 8-bit, 33.2
    with ao 4-bit. Held all step, the state alone moves the peak: fused AdamW's two bf16 moments
    (4 B a parameter) less the 8-bit layout is 12.35 GiB against the published 12.5 (-1.2%), the 8-bit
    less the 4-bit layout 6.08 GiB against 5.9 (+3.1%; the 4-bit update's scratch is not in a difference)."""
    llama2 = dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                  max_position_embeddings=4096, tie_word_embeddings=False)
    numels = decoder_shape(llama2).param_numels()
    fused = 2 * 2 * sum(numels)
    eight, four = (torchao_state_bytes(numels, k, 2) for k in ("torchao-adamw-8bit", "torchao-adamw-4bit"))
    assert abs((fused - eight) / 2**30 - (51.6 - 39.1)) <= 0.02 * (51.6 - 39.1)
    assert abs((eight - four) / 2**30 - (39.1 - 33.2)) <= 0.04 * (39.1 - 33.2)


def test_the_layouts_blocks_are_torchaos_defaults():
    """The block of each layout is the default of torchao's own class (adam.py:319, 352, 385), so a
    plain ``AdamW4bit(params)`` keeps the layout counted; the Trainer's 4-bit passes 256."""
    import inspect

    import torchao.optim as ao
    classes = {"torchao-adamw-8bit": ao.AdamW8bit, "torchao-adamw-4bit": ao.AdamW4bit, "torchao-adamw-fp8": ao.AdamWFp8}
    for kind, cls in classes.items():
        assert inspect.signature(cls.__init__).parameters["block_size"].default == TORCHAO_LAYOUTS[kind][0]
    assert TORCHAO_LAYOUTS["torchao-adamw-4bit-256"][0] == 256
