"""Measure: one real steady-state training step, tracked.

:func:`measure_step` builds the model (:func:`~memlab.step.build_trainer`), runs one
untracked warm-up step so the optimizer state exists, then tracks the next step with
:class:`~memlab.tracking.MemoryTracker`. On CUDA the report also carries the caching
allocator's own figures: its ``max_memory_allocated`` less the tracked tensors becomes the
``workspace`` category (cuBLAS/cuDNN workspaces, block rounding), so that the categories add
up to what the allocator says. Tensors on another device than the step's (offloaded state,
``save_on_cpu`` activations) are reported as host memory (``host_bytes``).
"""
from __future__ import annotations

import contextlib
import gc
import time
import traceback

import torch

from .hardware import pick_device, resolve_budget
from .step import MemoryReport, StepConfig, Trainer, batch_to, build_trainer, make_batch, resolve_step
from .tracking import CATEGORIES, MemoryTracker, OOMInfo, requested_bytes


def run_tracked_step(trainer: Trainer, batch: tuple, budget_bytes: int | None, *,
                     cuda_history: bool = False, warmup: bool | str = True) -> tuple[MemoryTracker, float, int, int]:
    """Warm up, then one tracked step; an OOM is caught, memory released, and recorded.

    ``warmup``: ``True`` runs a whole untracked step first, ``"optimizer"`` only creates the
    optimizer state (same steady state, half the work: used by the simulation).

    Returns the tracker, the tracked step's seconds, and live bytes before and after it.
    """
    if warmup == "optimizer":
        trainer.warm_up_optimizer()
    elif warmup:
        trainer.step(batch)
    on_cuda = trainer.device.type == "cuda"
    tracker = MemoryTracker(None if on_cuda else budget_bytes, cuda=on_cuda, cuda_history=cuda_history,
                            device=trainer.device)
    with _cuda_budget(budget_bytes if on_cuda else None), tracker:
        tracker.track_model(trainer.model)
        tracker.track_optimizer(trainer.optimizer)
        tracker.track_tensors(batch, "other")
        tracker.reset_peak()
        before = tracker.live_bytes
        start = time.perf_counter()
        try:
            trainer.step(batch)
        except torch.OutOfMemoryError as e:
            # A real allocator OOM inside an op was recorded by the tracker (op, module,
            # phase, categories, the allocator's figures); one outside any op was not.
            if tracker.oom is None:
                message = str(e).split("\n")[0]
                tracker.oom = OOMInfo("unknown", "unknown", "unknown", requested_bytes(message),
                                      tracker.live_bytes, budget_bytes or 0, message,
                                      tracker.by_category())
            elif not tracker.oom.budget_bytes:
                tracker.oom.budget_bytes = budget_bytes or 0
            _release(e, trainer)
        seconds = time.perf_counter() - start
        if on_cuda:
            torch.cuda.synchronize()
        gc.collect()
        after = tracker.live_bytes
    return tracker, seconds, before, after


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
def _cuda_budget(budget_bytes: int | None):
    """Emulate a smaller card: cap this process's share of the real GPU, restore after."""
    if budget_bytes is None:
        yield
        return
    # The cap applies when the allocator asks the driver for a new segment: blocks it cached
    # in an earlier step (the warm-up) would be reused under any cap. Return them first.
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total))
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def measure_step(step: StepConfig | None = None, *, device: str | None = "cpu",
                 budget: int | str | None = None, cuda_history: bool = False,
                 snapshot_path: str | None = None, **overrides) -> MemoryReport:
    """Run one real steady-state step and report its peak by category.

    ``budget`` (bytes, ``"512MiB"``, or a GPU preset such as ``"T4-16GB"``) makes the step a
    simulated device on CPU and a real reduced memory fraction on CUDA; a step that does not
    fit comes back with ``fits == False`` and ``oom`` filled, memory released.
    """
    step = resolve_step(step, **overrides)
    dev = pick_device(device)
    trainer = build_trainer(step, dev)
    batch = batch_to(make_batch(step, dev), step)
    return measure_trainer(trainer, batch, budget=budget, cuda_history=cuda_history,
                           snapshot_path=snapshot_path)


def measure_trainer(trainer: Trainer, batch: tuple, *, budget: int | str | None = None,
                    cuda_history: bool = False, snapshot_path: str | None = None) -> MemoryReport:
    """:func:`measure_step` for a trainer you built (with hooks or tweaks of your own):
    a warm-up step, then one tracked step, reported."""
    budget_bytes = resolve_budget(budget)
    tracker, seconds, before, after = run_tracked_step(trainer, batch, budget_bytes,
                                                       cuda_history=cuda_history or bool(snapshot_path))
    if snapshot_path and tracker.snapshot is not None:
        tracker.dump_snapshot(snapshot_path)
    report = MemoryReport("measure", trainer.step_config, trainer.device.type, tracker.peak_bytes,
                          tracker.peak_by_category(), budget_bytes, seconds, tracker.oom,
                          tracker.timeline, tracker.cuda_stats, before, after,
                          host_bytes=tracker.host_peak_bytes,
                          host_by_category=tracker.host_peak_by_category())
    return add_workspace(report)


def add_workspace(report: MemoryReport) -> MemoryReport:
    """Make a CUDA report add up to the allocator: its ``max_memory_allocated`` less the
    tracked peak becomes the ``workspace`` category (bytes no tensor accounts for: cuBLAS
    and cuDNN workspaces, 512-byte block rounding), ``peak_bytes`` becomes the allocator's
    peak, and ``tracked_peak_bytes`` keeps the tracker's. Reports without allocator figures
    (CPU, fake tensors) are returned unchanged."""
    allocated = report.allocator.get("max_memory_allocated")
    if allocated is None or report.tracked_peak_bytes is not None:
        return report
    report.tracked_peak_bytes = report.peak_bytes
    workspace = max(0, allocated - report.peak_bytes)
    report.by_category = {c: int(report.by_category.get(c, 0)) for c in CATEGORIES}
    report.by_category["workspace"] += workspace
    report.peak_bytes += workspace
    return report


def time_step(step: StepConfig | None = None, *, device: str | None = "cpu", repeats: int = 3,
              **overrides) -> float:
    """Median seconds of an untracked steady-state step (for compute-cost ratios)."""
    step = resolve_step(step, **overrides)
    trainer = build_trainer(step, pick_device(device))
    batch = batch_to(make_batch(step, trainer.device), step)
    trainer.step(batch)
    return time_steps({"step": (trainer, batch)}, repeats)["step"]


def time_steps(runs: dict[str, tuple[Trainer, tuple]], repeats: int = 3) -> dict[str, float]:
    """Median seconds of untracked steps per named (trainer, batch), one step of each in
    turn, so that whatever else loads the machine falls on all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, (trainer, batch) in runs.items():
            start = time.perf_counter()
            trainer.step(batch)
            if trainer.device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


__all__ = ["measure_step", "measure_trainer", "time_step", "time_steps", "run_tracked_step",
           "add_workspace"]
