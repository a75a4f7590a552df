"""Measure: one real steady-state training step, tracked.

:func:`measure_step` first checks that the step fits this machine
(:func:`memlab.guard.preflight`: refused with :class:`HostMemoryError` before anything is
allocated, or a ``fits: false`` report at phase ``build`` under a budget), then builds the
model (:func:`~memlab.step.build_trainer`), runs one untracked warm-up step so the optimizer
state exists, and tracks the next step with :class:`~memlab.tracking.MemoryTracker`. On CUDA
the report also carries the caching allocator's own figures.
"""
from __future__ import annotations

import contextlib
import gc
import re
import time
import traceback

import torch

from .errors import HostMemoryError, InputError
from .guard import preflight
from .hardware import fmt_bytes, pick_device, resolve_budget
from .step import MemoryReport, StepConfig, Trainer, batch_to, build_trainer, make_batch, resolve_step
from .tracking import MemoryTracker, OOMInfo

# What torch's CPU allocator says when malloc fails (Linux/macOS: "can't allocate memory",
# Windows: "not enough memory"); both name DefaultCPUAllocator.
_HOST_OOM = re.compile(r"DefaultCPUAllocator|can't allocate memory|not enough memory")


def is_host_oom(error: BaseException) -> bool:
    """Whether ``error`` is the host allocator failing (``RuntimeError ... DefaultCPUAllocator:
    can't allocate memory``) rather than a bug."""
    return (isinstance(error, RuntimeError) and not isinstance(error, torch.OutOfMemoryError)
            and bool(_HOST_OOM.search(str(error))))


def run_tracked_step(trainer: Trainer, batch: tuple, budget_bytes: int | None, *,
                     cuda_history: bool = False, warmup: bool | str = True) -> tuple[MemoryTracker, float, int, int]:
    """Warm up, then one tracked step; an OOM (the budget's, the CUDA allocator's, or the host
    allocator failing) is caught, explained in ``tracker.oom``, and its memory released.

    ``warmup``: ``True`` runs a whole untracked step first, ``"optimizer"`` only creates the
    optimizer state (same steady state, half the work: used by the simulation, and under a
    budget so that the budget covers every real op).

    Returns the tracker, the tracked step's seconds, and live bytes before and after it.
    """
    on_cuda = trainer.device.type == "cuda"
    tracker = MemoryTracker(None if on_cuda else budget_bytes, cuda=on_cuda, cuda_history=cuda_history)
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
    with _cuda_budget(budget_bytes if on_cuda else None), tracker:
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
            if tracker.oom is None:  # not the budget's: the CUDA or the host allocator's
                phase = tracker.timeline[-1].phase if tracker.timeline else "unknown"
                tracker.oom = _explain(e, tracker, budget_bytes, phase)
            _release(e, trainer)
        seconds = time.perf_counter() - start
        if on_cuda:
            torch.cuda.synchronize()
        gc.collect()
        after = tracker.live_bytes
    return tracker, seconds, before, after


def _explain(error: BaseException, tracker: MemoryTracker, budget_bytes: int | None,
             phase: str) -> OOMInfo:
    """An :class:`OOMInfo` for an allocator that refused (the budget's OOMs explain themselves)."""
    first = str(error).strip().split("\n")[0]
    asked = re.search(r"allocate (\d+) bytes", first)
    requested = int(asked.group(1)) if asked else 0
    if is_host_oom(error):
        first = (f"Host out of memory: the CPU allocator could not allocate "
                 f"{fmt_bytes(requested)} in the {phase} ({fmt_bytes(tracker.live_bytes)} of "
                 f"tensors live); the step's memory was released. Allocator: {first}")
    return OOMInfo("unknown", "unknown", phase, requested, tracker.live_bytes, budget_bytes or 0,
                   first, tracker.by_category())


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
    fit comes back with ``fits == False`` and ``oom`` filled, memory released; one whose
    model and optimizer state alone exceed the budget, at phase ``build`` without building.
    A step this machine cannot hold raises :class:`HostMemoryError` before anything is
    allocated (:mod:`memlab.guard` states the rule).
    """
    step = resolve_step(step, **overrides)
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
    tracker, seconds, before, after = run_tracked_step(
        trainer, batch, budget_bytes, cuda_history=cuda_history or bool(snapshot_path),
        warmup=True if budget_bytes is None else "optimizer")
    if snapshot_path and tracker.snapshot is not None:
        tracker.dump_snapshot(snapshot_path)
    return MemoryReport("measure", trainer.step_config, trainer.device.type, tracker.peak_bytes,
                        tracker.peak_by_category(), budget_bytes, seconds, tracker.oom,
                        tracker.timeline, tracker.cuda_stats, before, after)


def time_step(step: StepConfig | None = None, *, device: str | None = "cpu", repeats: int = 3,
              **overrides) -> float:
    """Median seconds of an untracked steady-state step (for compute-cost ratios)."""
    step = resolve_step(step, **overrides)
    dev = pick_device(device)
    preflight(step, dev)
    trainer = build_trainer(step, dev)
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
           "is_host_oom", "HostMemoryError", "InputError"]
