"""ZeRO's tracked peaks: what the tracker is told of a DeepSpeed engine, and the stage-0 and
stage-1 peaks of real DeepSpeed ranks against expectations derived without DeepSpeed (issue 27,
item 12: stage 0 was measured without Adam's moments, its peak in the optimizer step)."""
from types import SimpleNamespace

import pytest
import torch

from memlab.distributed.deepspeed_zero import track_engine
from memlab.tracking.tracker import MemoryTracker


def _stepped(n_in: int = 64, n_out: int = 32):
    model = torch.nn.Linear(n_in, n_out, bias=False)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, n_in)).sum().backward()
    opt.step()  # Adam's moments exist from here on
    return model, opt


@pytest.mark.parametrize("wrapped", [False, True], ids=["stage-0-torch-optimizer", "zero-wrapper"])
def test_track_engine_registers_adams_moments(wrapped):
    """At stage 0 DeepSpeed's engine.optimizer is torch's AdamW itself; at stages 1-3 a wrapper
    whose .optimizer is. Either way the moments are optimizer state from the first op on."""
    model, opt = _stepped()
    engine = SimpleNamespace(module=model, optimizer=SimpleNamespace(optimizer=opt) if wrapped else opt)
    n = sum(p.numel() for p in model.parameters())
    with MemoryTracker(device="cpu") as tracker:
        track_engine(tracker, engine, 0, [])
        held = tracker.by_category()
    # two fp32 moments per parameter, and AdamW's 0-dim fp32 step count per parameter tensor
    assert held["optimizer"] == 2 * 4 * n + 4 * len(list(model.parameters()))
    assert held["parameters"] == 4 * n and held["gradients"] == 4 * n


@pytest.mark.slow
@pytest.mark.distributed
def test_stage_0_and_1_peaks_on_two_ranks_against_plain_torch_and_the_zero_formula():
    """Stage 0 in fp32 is torch's AdamW on the whole model: its tracked peak holds the same
    activations and Adam state as memlab's plain PyTorch step of that model. Stage 1 holds the
    fp32 master and moments of Rajbhandari et al. 2020, sec. 5.1, (4 + 8) psi / N."""
    from memlab.distributed.deepspeed_zero import measure_zero
    from memlab.lenses.measure import measure_step
    from memlab.step.training_step import StepConfig
    from memlab.step.zero import zero_formula

    small = dict(seq=128, batch=4)
    z0, z1 = measure_zero([StepConfig(zero=z, world_size=2, **small) for z in (0, 1)], timeout=600)
    plain = measure_step(StepConfig(**small), device="cpu")
    assert plain.by_category["activations"] > 0.3 * plain.peak_bytes  # the peak is in backward
    for key in ("activations", "optimizer", "parameters"):
        assert z0.by_category[key] == pytest.approx(plain.by_category[key], rel=1e-3), key
    assert z0.peak_bytes == pytest.approx(plain.peak_bytes, rel=0.01)
    psi = StepConfig(**small).model_config.num_params()
    master_and_moments = zero_formula(psi, 1, 2, param_bytes=4, grad_bytes=4, k=4 + 8)["optimizer"]
    assert z1.by_category["optimizer"] == pytest.approx(master_and_moments, rel=0.005)


@pytest.mark.slow
@pytest.mark.distributed
def test_memlabs_gpt_simulated_and_estimated_against_real_deepspeed():
    """memlab's GPT on 2 gloo ranks at ZeRO-1, 2 and 3, its buffers a tenth of the peak: the
    simulation within 1% of each stage's tracked peak (achieved -0.00%, -0.66%; ZeRO-3 -0.00%
    within 0.5%), the estimate
    within [-2%, +3%] (+1.98%, +1.34%; ZeRO-3 +2.1%, before -11.7%). Stages 1-2's bucket lives in
    backward only and ZeRO-2's partition comes with its first flush (memlab.step.states.ModelStates).
    At ZeRO-3 the model's 3.7M gathered elements are over the prefetch bucket (2**20) and under
    ``stage3_max_live_parameters`` (4 * 2**20): the forward gathers it whole a bucket at a time and
    keeps it to backward; the estimate counts a bucket's flat buffer still in flight at the loss,
    where the real step holds half of one (memlab.step.zero3_gathers.gathered_in_closed_form)."""
    from memlab.distributed.deepspeed_zero import measure_zero
    from memlab.lenses.estimate import estimate_step
    from memlab.lenses.simulate import simulate_step
    from memlab.step.training_step import StepConfig

    steps = [StepConfig(seq=128, batch=4, zero=z, world_size=2) for z in (1, 2, 3)]
    for step, real in zip(steps, measure_zero(steps, timeout=600), strict=True):
        peak = max(r.peak_bytes for r in real.per_rank)
        # ZeRO-3: DeepSpeed's coordinator replayed (memlab.step.zero3_gathers), -0.00% (before: -11.7%)
        rel = 0.005 if step.zero == 3 else 0.01
        assert simulate_step(step, target="cpu").peak_bytes == pytest.approx(peak, rel=rel), step.zero
        assert -0.02 <= estimate_step(step, target="cpu").peak_bytes / peak - 1 <= 0.03, step.zero
