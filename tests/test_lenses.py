"""The three lenses agree: the estimate with the simulation per category (to the byte where
both peak at the same moment), the simulation with the measurement to the byte."""
import itertools

import pytest
import torch

from memlab.lenses.estimate import estimate_step
from memlab.lenses.measure import measure_step
from memlab.lenses.simulate import simulate_step
from memlab.models.gpt_unet import build_model, get_config
from memlab.step.states import model_state_bytes
from memlab.step.training_step import StepConfig
from memlab.step.zero import zero_formula

# Held out: none of these shapes were used to write the formula (it was derived on tiny at
# seq 64/128/256 with batch 2/4/8).
GRID = [StepConfig(model=get_config("tiny", d_model=192, n_head=6, n_layer=3, vocab_size=1500),
                   seq=s, batch=b, precision=p, checkpointing=c, attention=a)
        for (p, c, a), (s, b) in itertools.product(
            [("fp32", "none", "naive"), ("fp32", "none", "sdpa"), ("bf16", "none", "naive"),
             ("bf16", "selective", "naive"), ("fp32", "full", "sdpa"), ("pure-bf16", "none", "sdpa"),
             ("bf16", "full", "naive"), ("fp16", "none", "sdpa")],
            [(96, 3), (200, 2)])]


STATES = ("parameters", "gradients", "optimizer")


def _rest(rep) -> int:
    """The bytes of a report's peak that are not model states (activations, temporaries,
    other, workspace): what a bound on a total that is mostly model states cannot see."""
    return rep.peak_bytes - sum(rep.by_category[c] for c in STATES)


@pytest.mark.parametrize("step", GRID,
                         ids=lambda s: f"{s.precision}-{s.checkpointing}-{s.attention}-s{s.seq}b{s.batch}")
def test_estimate_matches_simulate_per_category(step):
    """The formula against the tracked fake step, category by category. Without full
    checkpointing both peak at the same moment and agree to 256 bytes in every category
    (achieved: 168 bytes in all, AdamW's step counters). With full checkpointing the
    estimate's peak moment is not the simulation's: the total is within 1.5% (achieved
    1.17%) and the bytes that are not model states within 20% (achieved 9.6-18%), a known
    gap of the recomputed block's moment, bounded here so it cannot grow unseen."""
    sim = simulate_step(step)
    est = estimate_step(step)
    assert est.by_category["parameters"] == sim.by_category["parameters"]
    assert abs(est.by_category["optimizer"] - sim.by_category["optimizer"]) <= 256
    if step.model_config.checkpointing != "full":
        for category, simulated in sim.by_category.items():
            assert abs(est.by_category[category] - simulated) <= 256, category
        assert abs(est.peak_bytes - sim.peak_bytes) <= 256
    else:
        assert est.peak_bytes == pytest.approx(sim.peak_bytes, rel=0.015)
        assert _rest(est) == pytest.approx(_rest(sim), rel=0.20)


LLAMA = get_config("tiny", mlp="swiglu", norm="rmsnorm", position="rope", bias=False,
                   tie_embeddings=False, name="tiny-llama")


@pytest.mark.parametrize("step, total, rest", [
    (StepConfig(model=LLAMA, seq=96, batch=2), 0.015, 0.01),                 # 1.01%, 0.76%
    (StepConfig(model=LLAMA, seq=96, batch=2, precision="bf16", checkpointing="full"),
     0.005, 0.05),                                                           # 0.06%, 4.1%
    (StepConfig(seq=96, batch=4, micro_batches=2), 0.01, 0.03),              # 0.48%, 2.3%
    (StepConfig(model="unet-small", seq=32, batch=4), 0.05, 0.06),           # 3.8%, 5.1%
], ids=["llama-like", "llama-like-bf16-full", "accumulation", "unet"])
def test_estimate_of_other_shapes_per_category(step, total, rest):
    """Other block shapes, accumulation and the UNet: the total and the bytes that are not
    model states, each with a bound near what is achieved (in the comments)."""
    sim, est = simulate_step(step), estimate_step(step)
    assert est.by_category["parameters"] == sim.by_category["parameters"]
    assert est.peak_bytes == pytest.approx(sim.peak_bytes, rel=total)
    assert _rest(est) == pytest.approx(_rest(sim), rel=rest)


@pytest.mark.parametrize("kw", [dict(), dict(checkpointing="full", precision="bf16"),
                                dict(precision="fp16"), dict(micro_batches=2)])
def test_simulate_equals_measure_to_the_byte(kw):
    step = StepConfig(seq=64, batch=4, **kw)
    real, fake = measure_step(step), simulate_step(step)
    assert fake.peak_bytes == real.peak_bytes
    assert fake.by_category == real.by_category


def test_measure_matches_estimate_on_the_default_step():
    step = StepConfig()
    real, est = measure_step(step), estimate_step(step)
    for category, measured in real.by_category.items():  # achieved: 168 bytes in all
        assert abs(est.by_category[category] - measured) <= 256, category


def test_gpt2_xl_simulates_and_fits_an_a100_40gb():
    # its speed is a benchmark's claim (benchmarks/), not a timed test's
    # a GPU preset means the CUDA target for that card: the allocator's 512-byte blocks
    rep = simulate_step(StepConfig(model="gpt2-xl", seq=1024, batch=1), budget="A100-40GB")
    assert rep.fits and rep.device == "cuda (fake)"
    with torch.device("meta"):
        numels = [p.numel() for p in build_model(get_config("gpt2-xl")).parameters()]
    assert sum(numels) == get_config("gpt2-xl").num_params()
    assert rep.by_category["parameters"] == sum(-(-4 * n // 512) * 512 for n in numels)
    cpu = simulate_step(StepConfig(model="gpt2-xl", seq=1024, batch=1), budget="A100-40GB", target="cpu")
    assert cpu.by_category["parameters"] == 4 * get_config("gpt2-xl").num_params()


def test_simulated_oom_on_a_small_card():
    rep = simulate_step(StepConfig(model="gpt2-xl", seq=1024, batch=4), budget="T4-16GB")
    assert rep.fits is False and rep.oom is not None


def test_zero_stages_divide_model_states():
    psi = 10**9
    s0 = model_state_bytes(psi, precision="bf16", zero=0, world_size=8)
    s1 = model_state_bytes(psi, precision="bf16", zero=1, world_size=8)
    s2 = model_state_bytes(psi, precision="bf16", zero=2, world_size=8)
    s3 = model_state_bytes(psi, precision="bf16", zero=3, world_size=8)
    # stage 0: plain PyTorch autocast (fp32 weights and gradients, two fp32 moments)
    assert s0["parameters"] == 4 * psi and s0["gradients"] == 4 * psi
    # ZeRO under DeepSpeed's bf16 mode: 2 + 2 + 12 bytes (ZeRO paper, sec. 5.1) partitioned
    assert s0["optimizer"] == 8 * psi and s1["optimizer"] == (8 + 4) * psi / 8
    assert s1["parameters"] == 2 * psi and s1["gradients"] == 2 * psi
    assert s2["gradients"] == 2 * psi / 8
    assert s3["parameters"] == 2 * psi / 8
    off = model_state_bytes(psi, precision="bf16", zero=3, world_size=8, offload="all")
    assert off["optimizer"] == 0 and off["parameters"] == 0 and off["host"] > 0


def test_adding_checkpointing_or_precision_never_raises_the_estimate():
    base = StepConfig(model="gpt2-small", seq=1024, batch=8)
    e0 = estimate_step(base).peak_bytes
    assert estimate_step(base, precision="bf16").peak_bytes < e0
    assert estimate_step(base, checkpointing="full").peak_bytes < e0
    assert estimate_step(base, zero=2, world_size=4).peak_bytes < e0


def test_zero_formula_reproduces_the_papers_figure_1():
    """Rajbhandari et al. 2020 ("ZeRO"), figure 1: a 7.5B-parameter model with mixed-precision
    Adam (K = 12) on N_d = 64 GPUs holds 120 GB of model states per GPU without ZeRO, 31.4 GB
    with P_os, 16.6 GB with P_os+g and 1.9 GB with P_os+g+p."""
    psi, n = 7.5e9, 64
    totals = [sum(zero_formula(psi, stage, n).values()) / 1e9 for stage in range(4)]
    assert totals == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.05)
    s1 = zero_formula(psi, 1, n)
    assert s1["parameters"] == 2 * psi and s1["gradients"] == 2 * psi and s1["optimizer"] == 12 * psi / n
    with pytest.raises(ValueError, match="stage must be 0-3"):
        zero_formula(psi, 4, n)
    with pytest.raises(ValueError, match="world_size >= 1"):
        zero_formula(psi, 1, 0)
