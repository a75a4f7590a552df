"""Measure: one real steady-state training step, tracked.

Before anything is allocated, :func:`measure_step` checks that the step fits this machine
(:func:`memlab.lenses.guard.preflight`: refused with :class:`HostMemoryError`, or a ``fits: false``
report at phase ``build`` under a budget). It then builds the model
(:func:`~memlab.step.training_step.build_trainer`), runs one untracked warm-up step so the optimizer state
exists, and tracks the next step with :class:`~memlab.tracking.tracker.MemoryTracker`. On CUDA the
report also carries the caching allocator's own figures: its growth over the step beyond the
tracked tensors' becomes the ``workspace`` category (cuBLAS/cuDNN workspaces, block
rounding; :func:`add_workspace`), and the step time is read after
``torch.cuda.synchronize``. Tensors on another
device than the step's (offloaded state, ``save_on_cpu`` activations) are reported as host
memory (``host_bytes``).
"""
from __future__ import annotations

import contextlib
import gc
import time
import traceback
from typing import Callable

import torch

from memlab.core.cards import detect_card
from memlab.core.errors import InputError
from memlab.core.hardware import pick_device, resolve_budget
from memlab.core.torch_private import profiler_memory_events
from memlab.core.units import fmt_bytes
from memlab.lenses.guard import HostMemoryError, preflight
from memlab.step.low_bit import PAGED, TORCHAO
from memlab.step.training_step import (
    MemoryReport,
    StepConfig,
    Trainer,
    batch_to,
    build_trainer,
    make_batch,
    resolve_step,
)
from memlab.time.step_time import report_time
from memlab.tracking.oom_messages import requested_bytes
from memlab.tracking.tracker import CATEGORIES, DeviceAccounting, MemoryTracker, OOMInfo, is_host_oom

#: what the measured peak holds of a paged state (the simulation and the estimate count it as host bytes)
PAGED_NOTE_CPU = ("paged 8-bit AdamW on a CPU: bitsandbytes keeps its state in ordinary tensors "
                  "(0.50 optim/optimizer.py:375-382, get_state_buffer), counted in this peak; simulate and "
                  "estimate count it as host bytes, as CUDA's unified memory holds it")
PAGED_NOTE_CUDA = ("paged 8-bit AdamW on CUDA: the state of tensors of 1e5 elements or more is in unified "
                   "memory (get_paged), outside the caching allocator, but the tracker counts every state "
                   "tensor on the device; simulate and estimate count it as host bytes")


def run_tracked_step(trainer: Trainer, batch: tuple, budget_bytes: int | None, *,
                     cuda_history: bool = False, warmup: bool | str = True,
                     accounting: DeviceAccounting | None = None) -> tuple[MemoryTracker, float, int, int]:
    """Warm up, then one tracked step; an OOM (the budget's, the CUDA allocator's, or the host
    allocator failing) is caught, explained in ``tracker.oom``, and its memory released.

    ``warmup``: ``True`` runs a whole untracked step first, ``"optimizer"`` only creates the
    optimizer state (same steady state, half the work: used by the simulation, and under a
    budget so that the budget covers every real op).
    ``accounting``: count bytes as a target device would (the simulation's ``target``).

    Returns the tracker, the tracked step's seconds, and live bytes before and after it.
    """
    on_cuda = trainer.device.type == "cuda"
    tracker = MemoryTracker(None if on_cuda else budget_bytes, cuda=on_cuda, cuda_history=cuda_history,
                            device=trainer.device, accounting=accounting)
    try:
        if warmup == "optimizer":
            trainer.warm_up_optimizer()
        elif warmup:
            trainer.step(batch)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not (isinstance(e, torch.OutOfMemoryError) or is_host_oom(e)):
            raise
        tracker.oom = _explain(e, tracker, budget_bytes, "warm-up")
        _release(e, trainer)
        return tracker, 0.0, 0, 0
    with cuda_budget(budget_bytes if on_cuda else None), tracker:
        tracker.track_model(trainer.model)
        tracker.track_optimizer(trainer.optimizer)
        tracker.track_tensors(batch, "other")
        tracker.reset_peak()
        before = tracker.live_bytes
        start = time.perf_counter()
        try:
            trainer.step(batch)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not (isinstance(e, torch.OutOfMemoryError) or is_host_oom(e)):
                raise
            # A real allocator OOM inside an op (CUDA's, or the host's malloc failing) was
            # recorded by the tracker (op, module, phase, categories, the allocator's
            # figures); one outside any op was not.
            if tracker.oom is None:
                phase = tracker.timeline[-1].phase if tracker.timeline else "unknown"
                tracker.oom = _explain(e, tracker, budget_bytes, phase)
            else:
                if not tracker.oom.budget_bytes:
                    tracker.oom.budget_bytes = budget_bytes or 0
                if is_host_oom(e):
                    tracker.oom.message = _host_message(tracker.oom)
            _release(e, trainer)
        if on_cuda:  # kernels run asynchronously: the step ends when the device is done
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        gc.collect()
        after = tracker.live_bytes
    return tracker, seconds, before, after


def _explain(error: BaseException, tracker: MemoryTracker, budget_bytes: int | None,
             phase: str) -> OOMInfo:
    """An :class:`OOMInfo` for an allocator that refused outside any tracked op (the warm-up,
    or between ops); the budget's OOMs and those inside an op explain themselves."""
    message = str(error).strip().split("\n")[0]
    oom = OOMInfo("unknown", "unknown", phase, requested_bytes(message), tracker.live_bytes,
                  budget_bytes or 0, message, tracker.by_category())
    if is_host_oom(error):
        oom.message = _host_message(oom)
    return oom


def _host_message(oom: OOMInfo) -> str:
    """The host allocator's refusal, said as an OOM: where, how much, what was live."""
    where = oom.phase if oom.op == "unknown" else f"{oom.op} ({oom.module}, {oom.phase})"
    return (f"Host out of memory: the CPU allocator could not allocate "
            f"{fmt_bytes(oom.requested_bytes)} in {where}, with {fmt_bytes(oom.live_bytes)} of "
            f"tensors live; the step's memory was released. Allocator: {oom.message}")


def _release(error: BaseException, trainer: Trainer) -> None:
    """Drop everything a failed step still holds: frames in the traceback keep activations
    alive (in a notebook, ``sys.last_traceback`` would keep them forever)."""
    traceback.clear_frames(error.__traceback__)
    error.__traceback__ = None
    trainer.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def cuda_budget(budget_bytes: int | None):
    """Emulate a smaller card: cap this process's share of the real GPU, restore it after.

    A cap already in place (an instructor splitting one GPU between students with
    ``torch.cuda.set_per_process_memory_fraction``) stays the ceiling and comes back after
    the step, so a budgeted measurement never lifts it.
    """
    if budget_bytes is None:
        yield
        return
    # The cap applies when the allocator asks the driver for a new segment: blocks it cached
    # in an earlier step (the warm-up) would be reused under any cap. Return them first.
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    # the getter is recent (pytorch/pytorch#140620); without it the cap cannot be read
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    previous = getter(0) if getter is not None else 1.0
    torch.cuda.set_per_process_memory_fraction(min(previous, budget_bytes / total), 0)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(previous, 0)
        torch.cuda.empty_cache()


def measure_step(step: StepConfig | None = None, *, device: str | None = "cpu",
                 budget: int | str | None = None, cuda_history: bool = False,
                 snapshot_path: str | None = None, **overrides) -> MemoryReport:
    """Run one real steady-state step and report its peak by category.

    ``budget`` (bytes, ``"512MiB"``, or a GPU preset such as ``"T4-16GB"``) makes the step a
    simulated device on CPU and a real reduced memory fraction on CUDA; a step that does not
    fit comes back with ``fits == False`` and ``oom`` filled, memory released; one whose
    model and optimizer state alone exceed the budget, at phase ``build`` without building.
    A step this machine cannot hold raises :class:`HostMemoryError` before anything is
    allocated (:mod:`memlab.lenses.guard` states the rule).

    Args:
        step: the step (``None``: ``StepConfig()``); ``overrides`` replace its fields.
        device: ``"cpu"``, ``"cuda"`` or ``None`` (the GPU if there is one).
        budget: as above.
        cuda_history, snapshot_path: record the CUDA allocator's history (and write it there).

    Returns:
        A :class:`MemoryReport` (lens ``"measure"``).

    Raises:
        InputError: a field, preset, device or budget that is not allowed.
        HostMemoryError: the step does not fit this machine.
    """
    step = resolve_step(step, lens="measure", **overrides)
    dev = pick_device(device)
    refused = preflight(step, dev, resolve_budget(budget))
    if refused is not None:
        return refused
    trainer = build_trainer(step, dev)
    batch = batch_to(make_batch(step, dev), step)
    return measure_trainer(trainer, batch, budget=budget, cuda_history=cuda_history,
                           snapshot_path=snapshot_path)


def measure_trainer(trainer: Trainer, batch: tuple, *, budget: int | str | None = None,
                    cuda_history: bool = False, snapshot_path: str | None = None) -> MemoryReport:
    """:func:`measure_step` for a trainer you built (with hooks or tweaks of your own):
    a warm-up step, then one tracked step, reported. Under a budget the warm-up only creates
    the optimizer state, so that every op of the step runs under the budget."""
    budget_bytes = resolve_budget(budget)
    # torchao's low-bit AdamW compiles its per-tensor update (torch.compile(fullgraph=True), torchao 0.18
    # optim/adam.py:142), which refuses to run under any dispatch mode: the step is measured as compiled
    if trainer.step_config.compile or trainer.step_config.optimizer in TORCHAO:
        if budget_bytes is not None or cuda_history or snapshot_path:
            raise InputError("a compiled step is measured from the allocator's events, without a budget "
                             "or a CUDA history (the tracker, a dispatch mode, would run it eagerly); "
                             "allowed: budget=None, no snapshot")
        return measure_compiled(trainer, batch)
    tracker, seconds, before, after = run_tracked_step(
        trainer, batch, budget_bytes, cuda_history=cuda_history or bool(snapshot_path),
        warmup=True if budget_bytes is None else "optimizer")
    if snapshot_path and tracker.snapshot is not None:
        tracker.dump_snapshot(snapshot_path)
    report = MemoryReport("measure", trainer.step_config, trainer.device.type, tracker.peak_bytes,
                          tracker.peak_by_category(), budget_bytes, seconds, tracker.oom,
                          tracker.timeline, tracker.cuda_stats, before, after,
                          host_bytes=tracker.host_peak_bytes,
                          host_by_category=tracker.host_peak_by_category())
    card = detect_card() if trainer.device.type == "cuda" else None
    report.time = report_time(trainer.step_config, card)  # the prediction beside step_seconds
    if trainer.step_config.optimizer in PAGED:
        report.notes.append(PAGED_NOTE_CPU if trainer.device.type == "cpu" else PAGED_NOTE_CUDA)
    return add_workspace(report)


def allocator_peak(events: list[tuple[int, int]]) -> tuple[int, int]:
    """The highest running sum of allocator events ``(time, bytes)`` over the start, and the
    sum at the end (what the step left allocated)."""
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak, live


def allocator_step(step_fn: Callable[[], object], model: torch.nn.Module, optimizer, tensors: tuple,
                   device: torch.device) -> tuple[int, dict[str, float], int, int, float]:
    """A step whose ops no dispatch mode may see (compiled code): two warm-up calls of ``step_fn``
    (compile, then steady), the state held before the step tracked (``model``, ``optimizer``,
    ``tensors`` as ``other``), then one step whose peak is read from the allocator's events
    (:func:`memlab.core.torch_private.profiler_memory_events` on CPU; on CUDA ``max_memory_allocated``).
    Returns ``(held bytes, held by category, the step's growth to its peak, what it left, seconds)``."""
    step_fn()
    step_fn()
    gc.collect()
    holder = MemoryTracker(device=device)
    with holder:
        holder.track_model(model)
        holder.track_optimizer(optimizer)
        holder.track_tensors(tensors, "other")
        before, held = holder.live_bytes, holder.by_category()
    start = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize()
        at_start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step_fn()
        torch.cuda.synchronize()
        growth, left = torch.cuda.max_memory_allocated() - at_start, torch.cuda.memory_allocated() - at_start
    else:
        growth, left = allocator_peak(profiler_memory_events(step_fn))
    return before, held, growth, left, time.perf_counter() - start


def measure_compiled(trainer: Trainer, batch: tuple) -> MemoryReport:
    """A compiled step (``StepConfig.compile``, :mod:`memlab.step.compiled`, or torchao's compiled
    optimizer update) measured by :func:`allocator_step`. The step's growth is reported as
    ``activations``: inside compiled code activations, gradients and temporaries are not told apart."""
    before, held, growth, left, seconds = allocator_step(lambda: trainer.step(batch), trainer.model,
                                                         trainer.optimizer, batch, trainer.device)
    by_category = {c: int(held.get(c, 0)) for c in CATEGORIES}
    by_category["activations"] += growth
    report = MemoryReport("measure", trainer.step_config, trainer.device.type, before + growth, by_category,
                          None, seconds, live_before=before, live_after=before + left)
    budget = trainer.step_config.activation_memory_budget
    budget = "default" if budget is None else budget
    what = (f"compiled with inductor (activation_memory_budget {budget})" if trainer.step_config.compile else
            f"{trainer.step_config.optimizer}: torchao compiles each tensor's update (adam.py:142)")
    report.notes.append(f"{what}: "
                        f"the peak is the allocator's (profiler memory events) over the tracked state; "
                        f"the step's growth, {fmt_bytes(growth)}, is under activations (activations, "
                        f"gradients and temporaries are not told apart inside compiled code); step_seconds "
                        f"includes the profiler's overhead")
    card = detect_card() if trainer.device.type == "cuda" else None
    report.time = report_time(trainer.step_config, card)
    return report


def add_workspace(report: MemoryReport) -> MemoryReport:
    """Make a CUDA report say what the allocator saw during the step: its growth over the
    step (``max_memory_allocated - memory_allocated_at_start``) beyond the tracked tensors'
    growth (``tracked peak - live_before``) becomes the ``workspace`` category (bytes no
    tensor accounts for: cuBLAS and cuDNN workspaces, in-kernel buffers, 512-byte block
    rounding), added to ``peak_bytes``; ``tracked_peak_bytes`` keeps the tracker's.

    Bytes allocated *before* the step that no tracked tensor holds (a learner's leftover
    tensors, an earlier step's cuBLAS workspace) are not this step's workspace: they are
    said in a note, not counted. Reports without allocator figures (CPU, fake tensors) are
    returned unchanged."""
    allocated = report.allocator.get("max_memory_allocated")
    if allocated is None or report.tracked_peak_bytes is not None:
        return report
    at_start = int(report.allocator.get("memory_allocated_at_start", 0))
    tracked_start = int(report.live_before or 0) if at_start else 0
    report.tracked_peak_bytes = report.peak_bytes
    workspace = max(0, (allocated - at_start) - (report.peak_bytes - tracked_start))
    report.by_category = {c: int(report.by_category.get(c, 0)) for c in CATEGORIES}
    report.by_category["workspace"] += workspace
    report.peak_bytes += workspace
    untracked = at_start - tracked_start
    if at_start and untracked > 0:
        report.notes.append(f"{fmt_bytes(untracked)} were allocated before the step by no tracked "
                            f"tensor (earlier cuBLAS workspaces, leftover tensors): not counted")
    return report


def time_step(step: StepConfig | None = None, *, device: str | None = "cpu", repeats: int = 3,
              **overrides) -> float:
    """Median seconds of an untracked steady-state step (for compute-cost ratios).

    Args:
        step: the step (``None``: ``StepConfig()``); ``overrides`` replace its fields.
        device: as in :func:`measure_step`.
        repeats: timed steps after one warm-up.

    Returns:
        The median step time in seconds.

    Raises:
        InputError: a field or device that is not allowed.
        HostMemoryError: the step does not fit this machine.
    """
    step = resolve_step(step, lens="measure", **overrides)
    dev = pick_device(device)
    preflight(step, dev)
    trainer = build_trainer(step, dev)
    batch = batch_to(make_batch(step, trainer.device), step)
    trainer.step(batch)
    return time_steps({"step": (trainer, batch)}, repeats)["step"]


def time_steps(runs: dict[str, tuple[Trainer, tuple]], repeats: int = 3, *,
               fastest: bool = False) -> dict[str, float]:
    """Median seconds of untracked steps per named (trainer, batch), one step of each in
    turn, so that whatever else loads the machine falls on all of them alike; ``fastest``:
    the fastest step instead (a round another process slowed drops out of every run)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, (trainer, batch) in runs.items():
            start = time.perf_counter()
            trainer.step(batch)
            if trainer.device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: min(t) if fastest else sorted(t)[len(t) // 2] for name, t in times.items()}


__all__ = ["measure_step", "measure_trainer", "measure_compiled", "allocator_peak", "allocator_step", "time_step",
           "time_steps",
           "run_tracked_step",
           "add_workspace", "cuda_budget", "is_host_oom", "HostMemoryError", "InputError"]
