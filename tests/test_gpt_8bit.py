"""bitsandbytes' 8-bit AdamW, plain and paged, as a run field of memlab's own GPT
(``StepConfig(model=GPTConfig(...), optimizer="adamw-8bit")``) in every lens.

Expected numbers: the measured step on this CPU with bitsandbytes' real ``AdamW8bit`` /
``PagedAdamW8bit`` (their state allocated by bitsandbytes itself; on CPU the paged one falls back
to ordinary tensors, bitsandbytes 0.50 ``optim/optimizer.py:375-382``), and the layout of
Dettmers et al. 2022 with bitsandbytes' block of 256 and its 4096-element floor
(:func:`memlab.step.low_bit.adam_state_bytes`), checked against that allocation here.
"""
from dataclasses import replace

import pytest

from memlab.core.errors import InputError
from memlab.lenses.estimate import estimate_step
from memlab.lenses.measure import measure_step
from memlab.lenses.simulate import simulate_step
from memlab.models.gpt_unet import get_config, tiny_llama
from memlab.step.low_bit import adam_state_bytes
from memlab.step.training_step import StepConfig

pytest.importorskip("bitsandbytes")

LLAMA = tiny_llama()  # 2 layers, d_model 64: tensors on both sides of bitsandbytes' 4096-element floor
#: memlab's tiny llama by default (both sides of the 4096-element floor, paged, in backward); the
#: tiny GPT's twins under ``make test-slow``
SLOW = pytest.mark.slow
CASES = [pytest.param("tiny", "fp32", "adamw-8bit", False, marks=SLOW),
         pytest.param("tiny", "bf16", "adamw-8bit", False, marks=SLOW),
         (LLAMA, "fp32", "adamw-8bit", False), (LLAMA, "bf16", "adamw-8bit", False),
         pytest.param("tiny", "fp32", "paged-adamw-8bit", False, marks=SLOW),
         (LLAMA, "bf16", "paged-adamw-8bit", False),
         # torchtune's single-device full fine-tune: paged 8-bit AdamW stepped in backward
         (LLAMA, "fp32", "paged-adamw-8bit", True), pytest.param("tiny", "bf16", "adamw-8bit", True, marks=SLOW)]


def _numels(model) -> list[int]:
    cfg = get_config(model) if isinstance(model, str) else model
    return cfg.param_numels()


def _id(case) -> str:
    m, p, o, b = case.values if hasattr(case, "values") else case
    return f"{getattr(m, 'name', m)}-{p}-{o}{'-in-bwd' if b else ''}"


@pytest.mark.parametrize("model, precision, optimizer, in_backward", CASES, ids=[_id(c) for c in CASES])
def test_simulation_equals_the_measured_step_and_the_estimate_is_within_2_percent(model, precision, optimizer,
                                                                                   in_backward):
    step = StepConfig(model=model, seq=64, batch=4, precision=precision, optimizer=optimizer,
                      optimizer_in_backward=in_backward)
    measured = measure_step(step)
    # bitsandbytes' own allocation is the layout's (one optimizer, or one per tensor in backward)
    state = adam_state_bytes(_numels(model), "adamw-8bit", per_tensor=in_backward)
    assert measured.category_peaks()["optimizer"] == state
    sim, est = simulate_step(step, target="cpu"), estimate_step(step, target="cpu")
    if optimizer == "paged-adamw-8bit":
        # unified memory: the uint8 moments of each tensor of 1e5 elements or more (bitsandbytes 0.50
        # get_state_buffer) leave the device for the host in both lenses; smaller tensors' state and every
        # block maximum stay (the tiny llama has no such tensor, the tiny GPT 14 of its 52). On this CPU the real
        # PagedAdamW8bit keeps it all in ordinary memory, so the measured peak holds it
        unified = sum(2 * n for n in _numels(model) if n >= 100_000)
        assert sim.category_peaks()["optimizer"] == est.by_category["optimizer"] == state - unified
        assert sim.host_by_category["optimizer"] == est.host_by_category["optimizer"] == unified
        sim_peak, est_peak = sim.peak_bytes + unified, est.peak_bytes + unified
        assert any("ordinary tensors" in n for n in measured.notes)
    else:
        assert sim.by_category["optimizer"] == est.by_category["optimizer"] == state
        sim_peak, est_peak = sim.peak_bytes, est.peak_bytes
    assert sim_peak == measured.peak_bytes
    assert abs(est_peak - measured.peak_bytes) <= 0.02 * measured.peak_bytes


def test_the_8bit_state_is_the_only_difference_from_adamw():
    """Held all step, the state moves every moment alike: the measured peak falls by fused AdamW's
    8 bytes a parameter and its fp32 step counter per tensor (``state_steps``), less the 8-bit
    layout's bytes (bitsandbytes keeps its step as a Python int)."""
    step = StepConfig(model=LLAMA, seq=64, batch=4, precision="fp32")
    eight = measure_step(replace(step, optimizer="adamw-8bit")).peak_bytes
    n = _numels(LLAMA)
    assert measure_step(step).peak_bytes - eight == 8 * sum(n) + 4 * len(n) - adam_state_bytes(n, "adamw-8bit")


@pytest.mark.parametrize("fields, needle", [
    (dict(model="unet-small", seq=32, batch=2), "allowed: adamw, sgd"),
    (dict(zero=1, world_size=2), "zero=0"),
    (dict(zero=3, world_size=2, offload="all"), "zero=0")])
def test_what_8bit_adamw_cannot_run_is_bad_input(fields, needle):
    with pytest.raises(InputError, match=needle):
        StepConfig(**{"seq": 16, "batch": 2, "optimizer": "adamw-8bit", **fields})


def test_the_estimate_refuses_8bit_state_scaled_by_a_parameter_count():
    with pytest.raises(InputError, match="per tensor"):
        estimate_step(StepConfig(seq=16, batch=2, optimizer="adamw-8bit"), trainable_params=1000)


@pytest.mark.slow
@pytest.mark.parametrize("name, state", [("adamw_bnb_8bit", "adamw-8bit"),
                                         # transformers' OptimizerNames: torchao's AdamW4bit, block 256
                                         ("adamw_torch_4bit", "torchao-adamw-4bit-256")])
def test_the_cli_runs_a_low_bit_adamw_name_as_the_step_in_every_lens(name, state, capsys):
    """``--optimizer NAME`` (Hugging Face's name: bitsandbytes' 8-bit AdamW, torchao's 4-bit) on
    memlab's GPT: a field of the step, simulated and measured, not only estimated; the simulation
    equals the measured step."""
    import json

    from memlab.app.cli import main
    peaks = {}
    for lens in ("estimate", "simulate", "measure"):
        argv = [lens, "--model", "tiny", "--seq", "32", "--batch", "2", "--optimizer", name, "--json"]
        assert main(argv + (["--target", "cpu"] if lens != "measure" else [])) == 0, capsys.readouterr().err
        out = json.loads(capsys.readouterr().out)
        assert out["config"]["optimizer"] == state
        peaks[lens] = out["peak_bytes"]
    assert peaks["simulate"] == peaks["measure"]
    assert abs(peaks["estimate"] - peaks["measure"]) <= 0.02 * peaks["measure"]


def test_the_time_lens_steps_the_8bit_state():
    """The optimizer pass of an 8-bit step is bitsandbytes' kernel per tensor: 16 bytes an element
    (fp32 weight and gradient read, weight written, two 1-byte moments read and written;
    :func:`memlab.time.step_time.optimizer_pass`), one launch a tensor, against fused AdamW's passes."""
    from memlab.time.step_time import ADAMW_BYTES, engine_time, parameter_tensors
    step = StepConfig(model="gpt2-small", seq=256, batch=2, precision="bf16")
    cfg = get_config("gpt2-small")
    eight = engine_time(replace(step, optimizer="paged-adamw-8bit"), 2e12, deepspeed=False, hidden=0.0)
    assert (eight.hbm_bytes, eight.launches) == (16 * cfg.num_params(), parameter_tensors(cfg))
    assert engine_time(step, 2e12, deepspeed=False, hidden=0.0).hbm_bytes == ADAMW_BYTES * cfg.num_params()
