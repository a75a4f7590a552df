"""Lesson 07: write the estimator of a GPT step's peak, checked against the simulation."""
from __future__ import annotations

from typing import Callable

from memlab.classroom.exercises.common import CheckResult, call_learner, fail, require
from memlab.core.units import fmt_bytes
from memlab.lenses.estimate import estimate_step
from memlab.lenses.simulate import simulate_step
from memlab.models.gpt_unet import get_config
from memlab.step.training_step import StepConfig

ESTIMATOR_TOLERANCE = 0.05  # the closed form of the lesson lands within ~3% of the simulation
KEYS = ("parameters", "gradients", "optimizer", "activations", "logits")
#: (model, overrides, seq, batch): GPT-2 XL and a Llama-shaped model (llama-7b's widths, 8 of its
#: 32 layers, so that the fake run takes seconds), at a batch whose peak is at the loss and one
#: whose peak is at the end of backward
CASES = (("gpt2-xl", {}, 1024, 8), ("llama-7b", {"n_layer": 8}, 1024, 8),
         ("llama-7b", {"n_layer": 8}, 1024, 1))


def _moment(step: StepConfig) -> str:
    """Where in the step the peak is (the estimate's note; the simulation has no such note)."""
    return estimate_step(step).notes[0].removeprefix("peak moment: ")


def _gap_message(got: dict, sim, cfg, seq: int, batch: int) -> str:
    """Which of the learner's terms is furthest from what the simulated peak holds."""
    cats = sim.by_category
    rest = sum(v for c, v in cats.items() if c not in KEYS[:3])  # activations, loss tensors, ...
    pairs = {c: (got[c], cats[c]) for c in KEYS[:3]}
    pairs["activations + logits"] = (got["activations"] + got["logits"], rest)
    term, (said, there) = max(pairs.items(), key=lambda kv: abs(kv[1][0] - kv[1][1]))
    why = {"gradients": "with zero_grad(set_to_none=True) gradients do not exist until backward "
                        "makes them: none at the loss, all of them (4 B/param) at its end",
           "parameters": "fp32 weights are 4 B/param, at every moment",
           "optimizer": "AdamW's two fp32 moments are 8 B/param, at every moment",
           "activations + logits": (
               f"at the loss every layer's activations are alive (n_layer x one layer), and the "
               f"loss holds t x V x 4 B = {fmt_bytes(4 * seq * batch * cfg.vocab_size)} three "
               f"times at its backward (logits, log-softmax, its gradient); after backward, none")}
    return (f"{term}: you count {fmt_bytes(said)}, the simulated peak "
            f"(at the {_moment(sim.step)}) holds {fmt_bytes(there)}. {why[term]}")


def check_estimator(estimate_peak: Callable, *, tolerance: float = ESTIMATOR_TOLERANCE) -> CheckResult:
    """``estimate_peak(cfg, seq, batch)`` returns the bytes at the peak of one fp32 AdamW step
    (SDPA attention) by term, a dict with the keys :data:`KEYS`. Checked on :data:`CASES`: the
    sum within ``tolerance`` of :func:`memlab.lenses.simulate.simulate_step`'s peak; a miss names the
    term furthest from what the simulated peak holds."""
    name = "write the estimator"
    require(name, "estimate_peak", estimate_peak,
            "def estimate_peak(cfg, seq, batch): a dict of bytes for " + ", ".join(KEYS))
    lines, worst = [], 0.0
    for model, over, seq, batch in CASES:
        cfg = get_config(model, **over)
        got = call_learner(name, f"estimate_peak({cfg.name}, {seq}, {batch})", estimate_peak,
                           cfg, seq, batch)
        if not isinstance(got, dict) or set(got) != set(KEYS):
            fail(name, f"estimate_peak should return a dict with the keys {', '.join(KEYS)}, got "
                       f"{sorted(got) if isinstance(got, dict) else type(got).__name__}")
        sim = simulate_step(StepConfig(model=cfg, seq=seq, batch=batch, attention="sdpa"))
        total = sum(got.values())
        err = (total - sim.peak_bytes) / sim.peak_bytes
        label = f"{cfg.name} ({cfg.n_layer} layers) seq {seq} batch {batch}"
        if abs(err) > tolerance:
            fail(name, f"{label}: you estimate {fmt_bytes(total)}, the simulation peaks at "
                       f"{fmt_bytes(sim.peak_bytes)} ({err:+.0%}, allowed {tolerance:.0%}). "
                       + _gap_message(got, sim, cfg, seq, batch))
        worst = max(worst, abs(err))
        lines.append(f"{label}: {fmt_bytes(total)} vs simulated {fmt_bytes(sim.peak_bytes)} "
                     f"({err:+.1%}; peak at the {_moment(sim.step)})")
    return CheckResult(name, {"worst_error": worst}, lines)
