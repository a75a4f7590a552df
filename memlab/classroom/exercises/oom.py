"""Lesson 02: fix the out-of-memory step."""
from __future__ import annotations

from memlab.classroom.exercises.common import CheckResult, fail, require
from memlab.core.errors import InputError
from memlab.core.hardware import resolve_budget
from memlab.core.units import fmt_bytes
from memlab.lenses.measure import measure_step
from memlab.step.training_step import StepConfig


def check_oom_fix(fixed: StepConfig, original: StepConfig, budget: int | str, *,
                  device: str = "cpu") -> CheckResult:
    """The learner's ``fixed`` step (``replace(original, ...)``) trains the same model on the
    same sequence length and now fits ``budget``, measured."""
    name = "fix the OOM"
    require(name, "fixed", fixed, "replace(STEP, ...) changed so that the step fits the budget", call=False)
    if resolve_budget(budget) is None:
        raise InputError("check_oom_fix needs the lesson's budget, e.g. '120MiB' or 'T4-16GB'")
    if not isinstance(fixed, StepConfig):
        fail(name, f"expected a StepConfig such as replace(STEP, checkpointing='full'), got "
                    f"{type(fixed).__name__}")
    if fixed.model_config.name != original.model_config.name or fixed.seq != original.seq:
        fail(name, f"the fix trains {fixed.model_config.name} at seq {fixed.seq}, the lesson "
                    f"{original.model_config.name} at seq {original.seq}: keep the model and the "
                    f"sequence, change how the step runs (or its batch)")
    rep = measure_step(fixed, budget=budget, device=device)
    if not rep.fits:
        fail(name, f"still out of memory: {rep.oom.message} The culprit is "
                    f"{rep.oom.culprit}: checkpointing, a smaller micro-batch or 16-bit "
                    f"activations shrink activations; precision='pure-bf16' also halves model states")
    lines = [f"peak {fmt_bytes(rep.peak_bytes)} within the budget {fmt_bytes(rep.budget_bytes)} "
             f"(headroom {fmt_bytes(rep.headroom_bytes)})"]
    samples = fixed.batch
    if samples < original.batch:
        lines.append(f"note: each optimizer step now sees {samples} samples instead of "
                     f"{original.batch}; micro_batches keeps the batch (gradient accumulation)")
    return CheckResult(name, {"peak_bytes": rep.peak_bytes, "budget_bytes": rep.budget_bytes,
                              "batch": samples}, lines)


