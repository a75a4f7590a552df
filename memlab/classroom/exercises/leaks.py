"""Lesson 03: fix the leaking training loop."""
from __future__ import annotations

import pathlib
from typing import Callable

from memlab.classroom.exercises.common import CheckResult, fail, require
from memlab.core.hardware import resolve_budget
from memlab.core.units import fmt_bytes
from memlab.techniques.leaks import TOLERANCE, watch_steps


def check_leak_fixed(script_or_fn: Callable[[], object] | str | pathlib.Path, *,
                     budget: int | str, past_step: int, tolerance: int = TOLERANCE) -> CheckResult:
    """The checker of lesson 03's leak exercise: run the learner's fixed loop under the
    ``budget`` the buggy one ran out of, require more than ``past_step`` optimizer steps, no
    out-of-memory, and growth per step within ``tolerance`` bytes. Returns a passed
    :class:`CheckResult`; raises ``CheckFailed`` saying, in measured terms,
    what still grows."""
    name = "leak fix"
    # a path or a script's text is an answer too, so only the stub's None is "not written yet"
    require(name, "train", script_or_fn, "your fixed loop", call=False)
    growth = watch_steps(script_or_fn, budget=budget)
    grows = growth.per_step > tolerance
    if growth.oom is not None or grows:
        what = ", ".join(f"{c} +{fmt_bytes(v)}" for c, v in growth.per_step_by_category().items()
                         if v > 0) or "nothing measurable"
        why = (f"ran out of memory in step {growth.oom_step} under {fmt_bytes(resolve_budget(budget))}"
               if growth.oom is not None else f"ran {growth.steps} steps")
        fail(name, f"{why}; live memory still grows {fmt_bytes(growth.per_step)} per step "
                   f"({what}). Find what keeps a tensor (or its graph) from one step to the next.")
    if growth.steps <= max(past_step, 2):
        fail(name, f"the loop ran {growth.steps} optimizer steps; run it past step {past_step} "
                   f"(the buggy loop ran out of memory there)")
    return CheckResult(name, {"steps": growth.steps, "growth_per_step": growth.per_step,
                              "live_after_last_step": growth.live_after[-1]},
                       [f"{growth.steps} steps under {fmt_bytes(resolve_budget(budget))}, past "
                        f"step {past_step} where the buggy loop ran out of memory",
                        f"growth per step {fmt_bytes(growth.per_step)} (tolerance "
                        f"{fmt_bytes(tolerance)}): steady state"])
