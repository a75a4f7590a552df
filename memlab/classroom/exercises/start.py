"""Lessons 00 and 01: read a step of your own; the model states of any model."""
from __future__ import annotations

from typing import Callable

from memlab.classroom.exercises.common import CheckResult, call_learner, fail, require
from memlab.core.units import fmt_bytes
from memlab.lenses.estimate import estimate_step
from memlab.lenses.measure import measure_step
from memlab.models.gpt_unet import get_config
from memlab.step.states import model_state_bytes
from memlab.step.training_step import StepConfig
from memlab.techniques.sweeps import category_max

MAX_TOKENS = 4096  # seq x batch a CPU measures in a few seconds on the tiny model
STATES = ("parameters", "gradients", "optimizer")


def check_first_step(my_step: StepConfig, largest: str, *, device: str = "cpu") -> CheckResult:
    """Lesson 00: ``my_step`` is a step of the learner's choosing (at most
    :data:`MAX_TOKENS` tokens on a CPU), ``largest`` their prediction of the category that
    holds the most bytes at its peak. Checked: the estimate and the measurement agree within 5%,
    and the prediction names the measured largest category."""
    name = "your first step"
    require(name, "my_step", my_step, "ml.StepConfig(model='tiny', seq=..., batch=...)", call=False)
    require(name, "largest", largest, "the category you expect to be largest, e.g. 'optimizer'",
            call=False)
    if not isinstance(my_step, StepConfig):
        fail(name, f"my_step should be an ml.StepConfig, got {type(my_step).__name__}")
    if device == "cpu" and my_step.seq * my_step.batch > MAX_TOKENS:
        fail(name, f"seq x batch = {my_step.seq * my_step.batch} tokens; keep it at most "
                   f"{MAX_TOKENS} on a CPU (ml.estimate_step takes any size)")
    rep = measure_step(my_step, device=device)
    est = estimate_step(my_step, target="cuda" if device == "cuda" else "cpu")
    cats = {c: v for c, v in rep.by_category.items() if v}
    top = max(cats, key=cats.get)
    gap = abs(est.peak_bytes - rep.peak_bytes) / rep.peak_bytes
    lines = [f"measured peak {fmt_bytes(rep.peak_bytes)}, estimate {fmt_bytes(est.peak_bytes)} "
             f"({gap:.1%} apart)"]
    if gap > 0.05:
        fail(name, f"estimate and measurement are {gap:.0%} apart on this step; "
                   f"tell your teacher: the lenses should agree within 5%")
    if largest != top:
        shares = ", ".join(f"{c} {fmt_bytes(v)}" for c, v in sorted(cats.items(), key=lambda kv: -kv[1]))
        fail(name, f"you predicted {largest!r}, but at the peak {top!r} holds the most: {shares}. "
                   f"A long sequence or a large batch makes activations the largest; a short one leaves "
                   f"the optimizer's 8 bytes per parameter on top")
    lines.append(f"at the peak {top} holds the most ({fmt_bytes(cats[top])}): as you predicted")
    return CheckResult(name, {"peak_bytes": rep.peak_bytes, "estimate_bytes": est.peak_bytes}, lines)


def check_state_bytes(state_bytes: Callable, *, device: str = "cpu") -> CheckResult:
    """Lesson 01: ``state_bytes(n, optimizer)`` returns the bytes of fp32 model states
    (parameters + gradients + optimizer state) of ``n`` parameters for ``"adamw"`` and
    ``"sgd"`` (with momentum). Checked against :func:`memlab.step.states.model_state_bytes` for
    GPT-2 XL and llama-3-8b, and against the tiny model's measured categories, within 0.5%."""
    name = "model states"
    require(name, "state_bytes", state_bytes, "def state_bytes(n, optimizer): bytes of model states")
    lines = []
    for opt in ("adamw", "sgd"):
        step = StepConfig(model="tiny", seq=16, batch=1, optimizer=opt)
        rep = measure_step(step, device=device)
        n = step.model_config.num_params()
        measured = sum(category_max(rep, c) for c in STATES)
        cases = [("tiny (measured)", n, measured)] + [
            (m, get_config(m).num_params(),
             sum(model_state_bytes(get_config(m).num_params(), optimizer=opt)[c] for c in STATES))
            for m in ("gpt2-xl", "llama-3-8b")]
        for label, count, want in cases:
            got = call_learner(name, f"state_bytes({count}, {opt!r})", state_bytes, count, opt)
            if not isinstance(got, (int, float)):
                fail(name, f"state_bytes({count}, {opt!r}) returned {type(got).__name__}, not a number")
            if abs(got - want) > 0.005 * want:
                fail(name, f"{label}, {opt}: you said {got / count:.2f} B/param, the model keeps "
                           f"{want / count:.2f} (parameters 4 + gradients 4 + "
                           f"{'Adam m and v, 8' if opt == 'adamw' else 'one momentum buffer, 4'})")
        lines.append(f"{opt}: {want / count:.0f} B/param, {fmt_bytes(want)} for {label} "
                     f"({count / 1e9:.2f} B parameters)")
    return CheckResult(name, {}, lines)
