"""Any model: memlab's lenses on a training step the learner wrote.

:func:`track_step` measures one step of the learner's own code (``step_fn()``) on their own
model and optimizer, with the tracker and report that :func:`memlab.measure_step` uses:
categories, the timeline, an OOM under a budget explained, the CUDA allocator's figures and
an optional snapshot. :func:`tracking` is the same for code that is not a function (a
``with`` block). :func:`simulate_model` runs the learner's ``build_fn()`` and
``step_fn(model, optimizer)`` under ``FakeTensorMode`` with a target device's autocast lists,
kernels and workspaces (:mod:`memlab.policy`), so an 8B Hugging Face model is "trained" with
no GPU and no weights.

The step functions run the learner's code as written; memlab registers the model and the
optimizer, runs one untracked warm-up (so that the optimizer state exists, as in steady
state), then tracks one step. On fake tensors the step runs on the fake *CPU* device (see
:mod:`memlab.lenses.simulate`), so a ``step_fn`` for :func:`simulate_model` takes its autocast
device from the model (``next(model.parameters()).device.type``), not a hard-coded ``"cuda"``.
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn as nn

from memlab.core.errors import InputError
from memlab.core.hardware import resolve_budget
from memlab.core.torch_private import FakeTensorMode
from memlab.core.units import fmt_bytes
from memlab.lenses.measure import add_workspace, allocator_step, run_tracked_step
from memlab.policy import emulate, resolve_target
from memlab.step.low_bit import moment_bytes
from memlab.step.training_step import MemoryReport
from memlab.tracking.tracker import CATEGORIES, MemoryTracker, OOMInfo


@dataclass(frozen=True)
class ModelStep:
    """What a report says about a step memlab did not build (the learner's own model):
    stands where :class:`~memlab.step.training_step.StepConfig` stands in a :class:`MemoryReport`."""

    name: str
    num_params: int
    trainable_params: int
    seq: int | None = None
    batch: int | None = None
    precision: str = "as written"
    checkpointing: str = "as written"

    @property
    def model_config(self) -> "ModelStep":
        return self  # a report reads .name and .checkpointing from here

    @property
    def checkpointing_used(self) -> str:
        """The checkpointing as the caller stated it (``"as written"`` when not)."""
        return self.checkpointing

    def describe(self) -> dict:
        """The step as the JSON report's ``config``: the model's name and parameter counts, and
        what the caller stated.

        A dict because it is the JSON report's ``config``.
        """
        return {"model": self.name, "num_params": self.num_params,
                "trainable_params": self.trainable_params, "seq": self.seq, "batch": self.batch,
                "precision": self.precision, "checkpointing": self.checkpointing}


def model_step(model: nn.Module, **known) -> ModelStep:
    """A :class:`ModelStep` for ``model``: its class name and parameter counts, with any of
    ``seq``, ``batch``, ``precision``, ``checkpointing`` the caller knows."""
    params = list(model.parameters())
    return ModelStep(type(model).__name__, sum(p.numel() for p in params),
                     sum(p.numel() for p in params if p.requires_grad), **known)


class _NoOptimizer:
    """Stands for ``optimizer=None``: no state; releasing memory clears the model's grads."""

    def __init__(self, model: nn.Module):
        self.model, self.param_groups, self.state = model, [], {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)


class _FnTrainer:
    """The trainer interface :func:`memlab.lenses.measure.run_tracked_step` drives, around a step
    function of the learner's."""

    def __init__(self, model: nn.Module, optimizer, device: torch.device, step_fn: Callable[[], object]):
        self.model, self.device, self.step_fn = model, device, step_fn
        self.optimizer = optimizer if optimizer is not None else _NoOptimizer(model)

    def step(self, batch: tuple) -> None:
        self.step_fn()

    def warm_up_optimizer(self) -> None:
        """Create the optimizer state without a forward pass: zero gradients, one step.
        (With zero gradients AdamW moves a weight only by its decay, ``lr * wd * w``.)"""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        if self.optimizer.param_groups:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def state_bytes_per_param(optimizer) -> int:
    """Optimizer state bytes per fp32 trainable parameter that ``optimizer`` will hold:
    8 for Adam/AdamW (two moments), 4 for SGD with momentum, 0 for plain SGD and for an
    optimizer memlab does not know (then the guard counts no state)."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return moment_bytes("adamw")
    if isinstance(optimizer, torch.optim.SGD):
        return moment_bytes("sgd") if optimizer.defaults.get("momentum", 0) else 0
    return 0


def _states_refused(model: nn.Module, optimizer, info: ModelStep, device: str,
                    budget_bytes: int, lens: str = "measure") -> MemoryReport | None:
    """The guard where the size is known: parameters, gradients and optimizer state of the
    model as built. A ``fits: false`` report at phase ``build`` when they exceed the budget."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    grads = sum(p.numel() * p.element_size() for p in trainable)
    held = sum(t.numel() * t.element_size() for s in getattr(optimizer, "state", {}).values()
               for t in s.values() if isinstance(t, torch.Tensor))
    opt = held or state_bytes_per_param(optimizer) * sum(p.numel() for p in trainable)
    need = params + grads + opt
    if need <= budget_bytes:
        return None
    cats = dict.fromkeys(CATEGORIES, 0)
    cats.update(parameters=params, gradients=grads, optimizer=opt)
    msg = (f"Out of memory before the step: parameters {fmt_bytes(params)}, gradients "
           f"{fmt_bytes(grads)} and optimizer state {fmt_bytes(opt)} need {fmt_bytes(need)}; "
           f"budget {fmt_bytes(budget_bytes)}, so {fmt_bytes(need - budget_bytes)} short. "
           f"Not run: no activation could fit.")
    oom = OOMInfo("model states", info.name, "build", need, need, budget_bytes, msg, cats)
    report = MemoryReport(lens, info, device, need, cats, budget_bytes, None, oom)
    report.notes.append("refused before running: peak_bytes are the model states, counted")
    return report


def _device_of(model: nn.Module, device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def track_step(step_fn: Callable[[], object], *, model: nn.Module, optimizer=None,
               budget: int | str | None = None, device: str | torch.device | None = None,
               warmup: bool = True, snapshot_path: str | None = None, compiled: bool = False,
               **known) -> MemoryReport:
    """Measure one step of your own code: ``step_fn()`` runs forward, backward and the
    optimizer step on ``model`` (and ``optimizer``).

    ``warmup`` runs one untracked step first so the optimizer state exists (steady state).
    ``budget`` (bytes, ``"512MiB"`` or a GPU preset) makes the step a smaller device: on CPU
    the tracker refuses the op that crosses it, on CUDA the process's memory fraction is
    capped; an OOM comes back in ``report.oom``, explained, memory released. When the model
    states alone exceed the budget the step is not run (a ``build``-phase OOM).
    ``snapshot_path`` (CUDA) writes the allocator history for pytorch.org/memory_viz.
    ``known`` (``seq``, ``batch``, ``precision``, ``checkpointing``) labels the report.
    ``compiled``: the step runs compiled code, which refuses a dispatch mode (torchao's optimizer
    update): measured from the allocator's events over the tracked state
    (:func:`memlab.lenses.measure.allocator_step`), its growth under ``activations``.

    Args:
        step_fn: one training step of your code, called with no arguments.
        model, optimizer: what ``step_fn`` trains (their bytes are parameters, gradients, optimizer).
        budget, device, warmup, snapshot_path, compiled, known: as above.

    Returns:
        A :class:`MemoryReport` (lens ``"measure"``).

    Raises:
        InputError: a budget or device that is not allowed.
    """
    if not callable(step_fn):
        raise InputError(f"step_fn must be a function running one training step, got {type(step_fn).__name__}")
    dev = _device_of(model, device)
    info = model_step(model, **known)
    budget_bytes = resolve_budget(budget)
    if compiled:
        if budget_bytes is not None or snapshot_path:
            raise InputError("a compiled step is measured from the allocator's events; allowed: budget=None, "
                             "no snapshot")
        return _allocator_report(step_fn, model, optimizer, dev, info)
    if budget_bytes is not None:
        refused = _states_refused(model, optimizer, info, dev.type, budget_bytes)
        if refused is not None:
            return refused
    trainer = _FnTrainer(model, optimizer, dev, step_fn)
    tracker, seconds, before, after = run_tracked_step(
        trainer, (), budget_bytes, cuda_history=bool(snapshot_path), warmup=warmup)
    if snapshot_path and tracker.snapshot is not None:
        tracker.dump_snapshot(snapshot_path)
    return add_workspace(_report("measure", info, dev.type, tracker, budget_bytes, seconds,
                                 before, after))


def _allocator_report(step_fn: Callable[[], object], model: nn.Module, optimizer, dev: torch.device,
                      info: ModelStep) -> MemoryReport:
    """:func:`track_step` of a compiled step: :func:`memlab.lenses.measure.allocator_step`'s peak."""
    before, held, growth, left, seconds = allocator_step(step_fn, model, optimizer, (), dev)
    by_category = {c: int(held.get(c, 0)) for c in CATEGORIES}
    by_category["activations"] += growth
    report = MemoryReport("measure", info, dev.type, before + growth, by_category, None, seconds,
                          live_before=before, live_after=before + left)
    report.notes.append(f"compiled code in the step: the peak is the allocator's (profiler memory events) over "
                        f"the tracked state; the step's growth, {growth:,} B, is under activations")
    return report


def _report(lens: str, info: ModelStep, device: str, tracker: MemoryTracker,
            budget_bytes: int | None, seconds: float | None, before: int, after: int) -> MemoryReport:
    return MemoryReport(lens, info, device, tracker.peak_bytes, tracker.peak_by_category(),
                        budget_bytes, seconds, tracker.oom, tracker.timeline, tracker.cuda_stats,
                        before, after, host_bytes=tracker.host_peak_bytes,
                        host_by_category=tracker.host_peak_by_category())


class Tracking:
    """What :func:`tracking` yields; ``report`` is filled when the block ends."""

    def __init__(self, tracker: MemoryTracker):
        self.tracker = tracker
        self.report: MemoryReport | None = None


@contextlib.contextmanager
def tracking(model: nn.Module, optimizer=None, *, budget: int | str | None = None,
             **known) -> Iterator[Tracking]:
    """Track whatever the ``with`` block runs, for code that is not a function:

    >>> with memlab.lenses.your_model.tracking(model, opt, budget="2GiB") as t:
    ...     loss = model(**batch).loss; loss.backward(); opt.step(); opt.zero_grad()
    >>> print(t.report)

    Run it on a step in steady state (after a first step). An out-of-memory error inside the
    block (the budget's or the device's) is caught and explained in ``t.report.oom``; any
    other error propagates. No memory fraction is capped: on CUDA the budget is the tracker's.
    """
    dev = _device_of(model, None)
    budget_bytes = resolve_budget(budget)
    tracker = MemoryTracker(budget_bytes, cuda=dev.type == "cuda", device=dev)
    handle = Tracking(tracker)
    start = time.perf_counter()
    with tracker:
        tracker.track_model(model)
        if optimizer is not None:
            tracker.track_optimizer(optimizer)
        tracker.reset_peak()
        before = tracker.live_bytes
        try:
            yield handle
        except torch.OutOfMemoryError as e:
            if tracker.oom is None:
                phase = tracker.timeline[-1].phase if tracker.timeline else "unknown"
                tracker.oom = OOMInfo("unknown", "unknown", phase, 0, tracker.live_bytes,
                                      budget_bytes or 0, str(e).split("\n")[0], tracker.by_category())
            e.__traceback__ = None
            (optimizer or _NoOptimizer(model)).zero_grad(set_to_none=True)
    handle.report = add_workspace(_report("measure", model_step(model, **known), dev.type, tracker,
                                          budget_bytes, time.perf_counter() - start, before,
                                          tracker.live_bytes))


def simulate_model(build_fn: Callable[[], tuple[nn.Module, object]],
                   step_fn: Callable[[nn.Module, object], object], *, target: str = "cuda",
                   budget: int | str | None = None, **known) -> MemoryReport:
    """Simulate one step of your own model on fake tensors: no memory, no weights, no GPU.

    ``build_fn()`` returns ``(model, optimizer)`` and runs under ``FakeTensorMode`` (e.g.
    ``AutoModelForCausalLM.from_config(cfg)`` and its AdamW); ``step_fn(model, optimizer)``
    runs one training step on inputs it makes. ``target="cuda"`` counts bytes as a GPU would
    (CUDA's autocast lists, kernels, workspaces, 512-byte blocks; a GPU preset ``budget``
    picks the card's cuBLAS workspace); ``"cpu"`` as this CPU (equal to :func:`track_step`).
    The optimizer state is created first (zero gradients, one step), then one step is
    tracked. ``known`` labels the report (``seq``, ``batch``, ``precision``, ...). Under a
    ``budget`` that the model states alone exceed, the step is not run (a ``build`` OOM).

    Args:
        build_fn: returns ``(model, optimizer)``, called under fake tensors.
        step_fn: ``step_fn(model, optimizer)`` runs one training step.
        target, budget, known: as above.

    Returns:
        A :class:`MemoryReport` (lens ``"simulate"``).

    Raises:
        InputError: ``build_fn`` returned something else, or a target or budget not allowed.
    """
    tgt = resolve_target(target, budget)
    budget_bytes = resolve_budget(budget)
    start = time.perf_counter()
    # One mode for building and running: mixing fake modes is not supported.
    with FakeTensorMode(allow_non_fake_inputs=False), emulate(tgt):
        built = build_fn()
        if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module)):
            raise InputError(f"build_fn must return (model, optimizer), got {type(built).__name__}")
        model, optimizer = built
        info = model_step(model, **known)
        refused = (_states_refused(model, optimizer, info, f"{tgt.name} (fake)", budget_bytes, "simulate")
                   if budget_bytes is not None else None)
        if refused is not None:
            return refused
        # bound now: the closure's names are deleted below
        trainer = _FnTrainer(model, optimizer, torch.device("cpu"), functools.partial(step_fn, model, optimizer))
        tracker, _, before, after = run_tracked_step(trainer, (), budget_bytes, warmup="optimizer",
                                                     accounting=tgt.accounting())
        report = _report("simulate", info, f"{tgt.name} (fake)", tracker, budget_bytes, None,
                         before, after)
        del trainer, tracker, model, optimizer, built
    report.step_seconds = time.perf_counter() - start
    report.notes.append("step_seconds is the wall time of the whole simulation")
    return report


__all__ = ["ModelStep", "model_step", "track_step", "tracking", "Tracking", "simulate_model",
           "state_bytes_per_param"]
