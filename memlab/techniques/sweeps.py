"""Sweeps and the readings lessons take off a report: run a lens over one field of a step,
read a category's peak or the activations each module keeps, count a step's FLOPs.

Everything here runs real steps through the lenses (:func:`memlab.lenses.measure.measure_step` by
default), so what a lesson asserts is measured, not assumed.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

import torch

from memlab.core.errors import InputError
from memlab.core.quiet import progress_wanted
from memlab.lenses.estimate import estimate_step
from memlab.lenses.guard import preflight
from memlab.lenses.measure import measure_step
from memlab.lenses.simulate import simulate_step
from memlab.step.training_step import MemoryReport, StepConfig
from memlab.time.flops import count_step_flops
from memlab.tracking.tracker import CATEGORIES, Event

LENSES = ("estimate", "simulate", "measure")


def lens_fn(lens: str) -> Callable[..., MemoryReport]:
    """The function behind a lens name: ``estimate_step``, ``simulate_step`` or ``measure_step``."""
    if lens == "measure":
        return measure_step
    if lens == "estimate":
        return estimate_step
    if lens == "simulate":
        return simulate_step
    raise InputError(f"lens={lens!r}; allowed: {', '.join(LENSES)}")


def sweep(step: StepConfig, param: str, values: Sequence, lens: str = "measure", *,
          budget: int | str | None = None, progress: bool | None = None, **kwargs) -> list[MemoryReport]:
    """One report per value of a :class:`StepConfig` field (``seq``, ``batch``, ...).

    ``kwargs`` go to the lens function (e.g. ``device="cuda"`` for measure); a tqdm bar shows
    progress where someone watches it (``progress=None``: :func:`memlab.core.quiet.progress_wanted`,
    so not under nbval or on the site, where it would stay frozen at 0%).
    """
    if param not in StepConfig.__dataclass_fields__:
        raise InputError(f"param={param!r} is not a StepConfig field; "
                         f"allowed: {', '.join(StepConfig.__dataclass_fields__)}")
    fn = lens_fn(lens)
    from tqdm.auto import tqdm
    out = []
    for v in tqdm(list(values), desc=f"{lens} {param}", disable=not progress_wanted(progress), leave=False):
        out.append(fn(replace(step, **{param: v}), budget=budget, **kwargs))
    return out


def category_max(report: MemoryReport, category: str) -> int:
    """Most bytes of one category alive at any op of the step
    (:meth:`MemoryReport.category_peaks`, for one category named by a learner). The peak's
    breakdown can miss a category: at a small batch the peak sits in the optimizer step,
    after activations are freed and before gradients are; this finds activations at the end
    of forward, gradients at the end of backward."""
    if category not in CATEGORIES:
        raise InputError(f"unknown category {category!r}; allowed: {', '.join(CATEGORIES)}")
    return report.category_peaks()[category]


def activations_by_module(report: MemoryReport,
                          key: Callable[[Event], str] | None = None) -> dict[str, int]:
    """Bytes each module keeps for backward: every rise of the ``activations`` category in
    forward goes to the module whose op made it (a tensor is an activation when it was made
    in forward and is still alive when forward ends, so with one forward the parts sum to
    the category's largest value; with ``k`` micro-batches, to ``k`` forwards' worth).
    Labels come from ``key(event)``, called with every forward op's timeline event in order
    (its ``module``, ``op``); by default the model's direct child of ``event.module``
    (``down.0`` of ``UNet.down.0.conv1``, ``UNet`` for its own ops, ``Global`` outside the
    model). Labels appear in the order they first kept bytes."""
    if not report.timeline:
        raise InputError(f"the {report.lens!r} lens keeps no timeline; use measure or simulate")
    key = key or _direct_child
    i = CATEGORIES.index("activations")
    out: dict[str, int] = {}
    before = 0
    for e in report.timeline:
        now = e.by_category[i]
        if e.phase == "forward":
            label = key(e)  # on every op: a key may follow the order modules ran in
            if now > before:  # forward only adds activations (a drop is the step's end)
                out[label] = out.get(label, 0) + now - before
        before = now
    return out


def _direct_child(event: Event) -> str:
    parts = event.module.split(".")
    if len(parts) == 1:
        return parts[0]
    # a ModuleList index belongs to its list: "down.0", not "down"
    return ".".join(parts[1:3]) if len(parts) > 2 and parts[2].isdigit() else parts[1]


def step_flops(step: StepConfig, *, device: str = "cpu") -> int:
    """Floating-point operations of one steady-state training step (forward, backward and
    any recomputation), counted on a real step on ``device`` by
    :func:`memlab.time.flops.count_step_flops` (``FlopCounterMode``'s formulas, the CPU's fused
    attention included): a compute cost that, unlike wall-clock time, does not depend on
    what else the machine is doing. The parts and the closed form: :mod:`memlab.time.flops`."""
    preflight(step, device)
    return count_step_flops(step, fake=False, device=device).total


def relative_error(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """``||got - ref|| / ||ref||`` over all tensors together (the norm of the flattened lists)."""
    num = sum(((g - r).float() ** 2).sum() for g, r in zip(got, ref, strict=True))
    den = sum((r.float() ** 2).sum() for r in ref)
    return float((num / den).sqrt())


__all__ = ["LENSES", "activations_by_module", "category_max", "lens_fn", "relative_error",
           "step_flops", "sweep"]
