"""Leaks: memory that grows step over step, found by the tracker.

A training loop in steady state holds the same bytes after every optimizer step: parameters,
gradients, optimizer state. Memory that is still there one step later and was not before is
a leak, and the classic three are one line each: ``total_loss += loss`` (the sum keeps every
step's graph: its nodes and the loss tensors, though ``backward()`` has already freed each step's
saved activations, so the growth is small: lesson 03 measures it), an evaluation without
``torch.no_grad()`` whose result is kept (its graph too), a list that keeps each step's
outputs. :func:`watch_steps` runs a loop of the learner's under
:class:`~memlab.tracking.tracker.MemoryTracker` and reads the live bytes, by category, right after
every ``optimizer.step()`` (a global optimizer hook: the loop needs no change), so the growth
per step is measured in bytes and named by category; lesson 03's exercise is checked with it
(:func:`memlab.classroom.exercises.check_leak_fixed`).
"""
from __future__ import annotations

import gc
import pathlib
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook

from memlab.core.errors import InputError
from memlab.core.hardware import resolve_budget
from memlab.core.units import fmt_bytes
from memlab.step.training_step import StepConfig, build_trainer, make_batch
from memlab.tracking.tracker import CATEGORIES, MemoryTracker, OOMInfo

#: Growth per step below this is not a leak (a Python float list, a step counter's bytes).
TOLERANCE = 1024


@dataclass
class StepGrowth:
    """Live bytes after each optimizer step of a loop, and what ended it.

    ``live_after[k]`` and ``by_category_after[k]`` are read right after step ``k + 1``'s
    ``optimizer.step()``; ``oom`` (and ``oom_step``, 1-based) when the loop ran out of memory.
    """

    live_after: list[int] = field(default_factory=list)
    by_category_after: list[dict[str, int]] = field(default_factory=list)
    oom: OOMInfo | None = None
    oom_step: int | None = None

    @property
    def steps(self) -> int:
        """Optimizer steps completed."""
        return len(self.live_after)

    def _span(self) -> tuple[int, int]:
        """The steps growth is read between: from the end of the second step (the first
        creates the optimizer state, and a loop's variables are first bound during it) to
        the end of the last; from the first when there are only two."""
        return (1 if self.steps >= 3 else 0), self.steps - 1

    @property
    def per_step(self) -> float:
        """Mean growth of live bytes per step in steady state (see :meth:`_span`)."""
        a, b = self._span()
        return (self.live_after[b] - self.live_after[a]) / (b - a) if b > a else 0.0

    def per_step_by_category(self) -> dict[str, float]:
        """Mean growth per step of each category that grows (or shrinks)."""
        a, b = self._span()
        if b <= a:
            return {}
        first, last = self.by_category_after[a], self.by_category_after[b]
        return {c: (last[c] - first[c]) / (b - a) for c in CATEGORIES if last[c] != first[c]}

    def describe(self) -> str:
        """One line: steps, growth per step and in which categories, how it ended."""
        cats = ", ".join(f"{c} {fmt_bytes(v)}" for c, v in self.per_step_by_category().items()
                         if abs(v) >= 1)
        line = (f"{self.steps} optimizer steps; live memory grows {fmt_bytes(self.per_step)} "
                f"per step" + (f" ({cats})" if cats else ""))
        if self.oom is not None:
            line += f"; out of memory in step {self.oom_step}: {self.oom.message}"
        return line

    __str__ = describe


def _as_callable(script_or_fn: Callable[[], object] | str | pathlib.Path) -> Callable[[], object]:
    """A loop to run: a function of no arguments, Python source, or the path of a .py file."""
    if callable(script_or_fn):
        return script_or_fn
    if isinstance(script_or_fn, pathlib.Path) or (isinstance(script_or_fn, str)
                                                  and script_or_fn.endswith(".py")
                                                  and "\n" not in script_or_fn):
        path = pathlib.Path(script_or_fn)
        if not path.is_file():
            raise InputError(f"no such script {str(path)!r}; allowed: a function, Python source, "
                             f"or a .py file")
        source, name = path.read_text(), str(path)
    elif isinstance(script_or_fn, str):
        source, name = script_or_fn, "<training script>"
    else:
        raise InputError(f"cannot run a {type(script_or_fn).__name__}; allowed: a function, "
                         f"Python source, or a .py file")
    code = compile(source, name, "exec")
    return lambda: exec(code, {"__name__": "__main__"})


def watch_steps(script_or_fn: Callable[[], object] | str | pathlib.Path, *,
                budget: int | str | None = None) -> StepGrowth:
    """Run a training loop (a function of no arguments, Python source or a .py path) under
    the tracker and read live bytes after every ``optimizer.step()``.

    Every module that runs forward is registered, so its parameters count as parameters;
    optimizers register themselves at their first step. Under a ``budget`` the op that
    crosses it raises a simulated OOM, which ends the loop and is reported (``oom``,
    ``oom_step``); its memory is released.
    """
    run = _as_callable(script_or_fn)
    growth = StepGrowth()
    tracker = MemoryTracker(resolve_budget(budget), cuda=False)
    seen: set[int] = set()

    def register(module, args):
        if id(module) not in seen:
            seen.add(id(module))
            tracker.track_model(module)

    def after_step(opt, args, kwargs):
        growth.live_after.append(tracker.live_bytes)
        growth.by_category_after.append(tracker.by_category())

    hooks = [register_module_forward_pre_hook(register)]
    try:
        with tracker:
            hooks.append(register_optimizer_step_post_hook(after_step))
            try:
                run()
            except torch.OutOfMemoryError as e:
                if tracker.oom is None:
                    raise
                growth.oom, growth.oom_step = tracker.oom, growth.steps + 1
                traceback.clear_frames(e.__traceback__)
                e.__traceback__ = None
    finally:
        for h in hooks:
            h.remove()
        gc.collect()
    return growth


def tiny_setup(seq: int = 64, batch: int = 4, seed: int = 0):
    """What the leak examples train: memlab's tiny GPT, its AdamW, and ``batch_at(i)``
    giving step ``i``'s (inputs, targets)."""
    step = StepConfig(model="tiny", seq=seq, batch=batch)
    trainer = build_trainer(step, "cpu", seed=seed)
    return trainer.model, trainer.optimizer, lambda i: make_batch(step, "cpu", seed=i)


__all__ = ["TOLERANCE", "StepGrowth", "watch_steps", "tiny_setup"]
