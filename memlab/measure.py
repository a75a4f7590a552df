"""One training step, and the report that every lens (estimate, simulate, measure) returns.

A *step* is what an optimizer loop does once in steady state: forward, backward (over
``micro_batches`` slices of the batch when accumulating), ``optimizer.step()`` and
``zero_grad(set_to_none=True)``. :func:`measure_step` builds the model, runs one untracked
warm-up step so the optimizer state exists, then tracks the next step with
:class:`~memlab.tracking.MemoryTracker`.
"""
from __future__ import annotations

import contextlib
import gc
import json
import time
import traceback
from importlib import resources
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from pathlib import Path

import torch
import torch.nn as nn

from .hardware import fmt_bytes, pick_device, resolve_budget
from .models import GPTConfig, UNetConfig, build_model, get_config
from .tracking import CATEGORIES, DeviceAccounting, Event, MemoryTracker, OOMInfo

PRECISIONS = ("fp32", "bf16", "fp16", "pure-bf16")
OPTIMIZERS = ("adamw", "sgd")
OFFLOADS = ("none", "optimizer", "all")


@dataclass(frozen=True)
class StepConfig:
    """Everything that decides the memory of one training step.

    ``model`` is a preset name or a config; ``attention`` and ``checkpointing`` override the
    model's own when given. ``zero``, ``world_size`` and ``offload`` describe data-parallel
    sharding: the single-process lenses account for them by formula.
    """

    model: str | GPTConfig | UNetConfig = "tiny"
    seq: int = 256
    batch: int = 8
    precision: str = "fp32"
    checkpointing: str | None = None
    attention: str | None = None
    optimizer: str = "adamw"
    micro_batches: int = 1
    zero: int = 0
    world_size: int = 1
    offload: str = "none"

    def __post_init__(self) -> None:
        for name in ("seq", "batch", "micro_batches", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name.replace('_', ' ')} must be a positive integer, got {value!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}; allowed: {', '.join(PRECISIONS)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r}; allowed: {', '.join(OPTIMIZERS)}")
        if self.offload not in OFFLOADS:
            raise ValueError(f"offload={self.offload!r}; allowed: {', '.join(OFFLOADS)}")
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage {self.zero!r} is outside 0-3")
        if self.batch % self.micro_batches:
            raise ValueError(f"batch {self.batch} is not divisible into {self.micro_batches} "
                             f"micro-batches; choose a divisor of the batch")
        cfg = self.model_config  # validates the preset name and the overrides
        limit = cfg.block_size if isinstance(cfg, GPTConfig) else 4096
        if self.seq > limit:
            raise ValueError(f"seq {self.seq} exceeds the model's block size; allowed: 1-{limit}")

    @property
    def model_config(self) -> GPTConfig | UNetConfig:
        cfg = get_config(self.model) if isinstance(self.model, str) else self.model
        over = {}
        if self.checkpointing is not None:
            over["checkpointing"] = self.checkpointing
        if self.attention is not None and isinstance(cfg, GPTConfig):
            over["attention"] = self.attention
        if isinstance(cfg, UNetConfig):
            over["image_size"] = self.seq
        return replace(cfg, **over) if over else cfg

    def describe(self) -> dict:
        cfg = self.model_config
        d = {k: v for k, v in asdict(self).items() if k != "model"}
        d["model"] = cfg.name
        d["model_config"] = asdict(cfg)
        d["checkpointing"] = cfg.checkpointing
        d["attention"] = getattr(cfg, "attention", None)
        d["num_params"] = cfg.num_params()
        return d


@dataclass
class MemoryReport:
    """Bytes of one step by category at its peak, from one lens."""

    lens: str
    step: StepConfig
    device: str
    peak_bytes: int
    by_category: dict[str, int]
    budget_bytes: int | None = None
    step_seconds: float | None = None
    oom: OOMInfo | None = None
    timeline: list[Event] = field(default_factory=list, repr=False)
    allocator: dict[str, int] = field(default_factory=dict)
    live_before: int | None = None
    live_after: int | None = None
    per_rank: list["MemoryReport"] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool | None:
        if self.oom is not None:
            return False
        if self.budget_bytes is None:
            return None
        return self.peak_bytes <= self.budget_bytes

    @property
    def headroom_bytes(self) -> int | None:
        return None if self.budget_bytes is None else self.budget_bytes - self.peak_bytes

    def to_dict(self) -> dict:
        """The JSON shape of the CLI (keys fixed by the project's contract)."""
        d = {
            "lens": self.lens,
            "config": self.step.describe(),
            "seq": self.step.seq,
            "batch": self.step.batch,
            "device": self.device,
            "peak_bytes": self.peak_bytes,
            "by_category": {c: int(self.by_category.get(c, 0)) for c in CATEGORIES},
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            "step_seconds": self.step_seconds,
        }
        if self.oom is not None:
            d["oom"] = {"op": self.oom.op, "module": self.oom.module, "phase": self.oom.phase,
                        "requested_bytes": self.oom.requested_bytes, "message": self.oom.message}
        if self.allocator:
            d["allocator"] = dict(self.allocator)
        if self.per_rank is not None:
            d["per_rank"] = [r.to_dict() for r in self.per_rank]
        if self.notes:
            d["notes"] = list(self.notes)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=_json_default)

    def table(self) -> str:
        """A readable table of the categories, the peak and the verdict."""
        cfg = self.step.model_config
        lines = [f"{self.lens} | {cfg.name} | seq {self.step.seq} batch {self.step.batch} | "
                 f"{self.step.precision} | ckpt {cfg.checkpointing} | {self.device}"]
        for c in CATEGORIES:
            lines.append(f"  {c:<12} {fmt_bytes(self.by_category.get(c, 0)):>12}")
        lines.append(f"  {'peak':<12} {fmt_bytes(self.peak_bytes):>12}")
        if self.budget_bytes is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(f"  {'budget':<12} {fmt_bytes(self.budget_bytes):>12}  -> {verdict}")
        if self.oom is not None:
            lines.append(f"  OOM: {self.oom.message}")
        for name, value in self.allocator.items():
            lines.append(f"  {name:<24} {fmt_bytes(value):>12}")
        if self.step_seconds is not None:
            lines.append(f"  step time   {self.step_seconds * 1e3:10.1f} ms")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _json_default(o):
    if is_dataclass(o):
        return asdict(o)
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


# --------------------------------------------------------------------------------------
# Building and running a step
# --------------------------------------------------------------------------------------
def _corpus_tokens() -> torch.Tensor:
    # package data, so that a wheel install outside the repository finds it too
    data = resources.files("memlab").joinpath("data", "corpus.txt").read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def make_batch(step: StepConfig, device: torch.device | str = "cpu", seed: int = 0) -> tuple:
    """Inputs for one step: token windows from the package's ``data/corpus.txt`` for the GPT, noisy images
    and timesteps for the UNet. Contents do not change memory; shapes do."""
    cfg = step.model_config
    g = torch.Generator().manual_seed(seed)
    if isinstance(cfg, UNetConfig):
        x = torch.randn(step.batch, cfg.channels, step.seq, step.seq, generator=g)
        t = torch.randint(0, 1000, (step.batch,), generator=g)
        return x.to(device), t.to(device), torch.randn(x.shape, generator=g).to(device)
    tokens = _corpus_tokens() % cfg.vocab_size
    starts = torch.randint(0, len(tokens) - step.seq - 1, (step.batch,), generator=g)
    idx = torch.stack([tokens[s:s + step.seq] for s in starts.tolist()])
    tgt = torch.stack([tokens[s + 1:s + step.seq + 1] for s in starts.tolist()])
    return idx.to(device), tgt.to(device)


def build_optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    """AdamW (two moments per parameter) or SGD with momentum (one), as fused kernels.

    Fused kernels update each parameter in one pass without full-size temporaries (the
    ``foreach`` default on CUDA adds up to 4 bytes per parameter at the optimizer step), and
    they are what large-model training uses (nanoGPT's ``configure_optimizers``, say).
    """
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, fused=True)
    raise ValueError(f"optimizer={name!r}; allowed: {', '.join(OPTIMIZERS)}")


def autocast_for(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The forward context for a precision: autocast for ``bf16``/``fp16``, else nothing."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision == "fp16":
        return torch.autocast(device.type, dtype=torch.float16)
    return contextlib.nullcontext()


@dataclass
class Trainer:
    """A model, its optimizer and the precision machinery, ready for :meth:`step`."""

    step_config: StepConfig
    device: torch.device
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    fake: bool = False  # under FakeTensorMode: no data-dependent branches

    def warm_up_optimizer(self) -> None:
        """Create the optimizer (and loss-scaler) state without a forward/backward pass."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.scale(torch.ones((), device=self.device))

    def step(self, batch: tuple) -> torch.Tensor:
        """One optimizer step over ``micro_batches`` slices; returns the detached loss."""
        k = self.step_config.micro_batches
        total = None
        for micro in zip(*(t.chunk(k) for t in batch)):
            with autocast_for(self.step_config.precision, self.device):
                loss = self.model(*micro) / k
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
            del loss
        if self.scaler and self.fake:
            # GradScaler.step skips the update when it finds inf/nan, which needs real values;
            # fake tensors have none, so take the no-overflow path (same memory).
            self.scaler.unscale_(self.optimizer)
            self.optimizer.step()
            self.scaler._per_optimizer_states.clear()
        elif self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total


def build_trainer(step: StepConfig, device: torch.device | str = "cpu", seed: int = 0,
                  fake: bool = False) -> Trainer:
    """Model + optimizer for ``step`` on ``device``; ``fake=True`` under FakeTensorMode."""
    device = torch.device(device)
    torch.manual_seed(seed)
    # Build in the target dtype rather than calling model.to(): that fails under fake mode.
    dtype = torch.bfloat16 if step.precision == "pure-bf16" else torch.get_default_dtype()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(step.model_config)
    finally:
        torch.set_default_dtype(previous)
    scaler = torch.amp.GradScaler(device.type) if step.precision == "fp16" else None
    return Trainer(step, device, model, build_optimizer(model, step.optimizer), scaler, fake)


def _batch_to(batch: tuple, step: StepConfig) -> tuple:
    if step.precision == "pure-bf16":
        return tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in batch)
    return batch


def run_tracked_step(trainer: Trainer, batch: tuple, budget_bytes: int | None, *,
                     cuda_history: bool = False, warmup: bool | str = True,
                     accounting: DeviceAccounting | None = None) -> tuple[MemoryTracker, float, int, int]:
    """Warm up, then one tracked step; an OOM is caught, memory released, and recorded.

    ``warmup``: ``True`` runs a whole untracked step first, ``"optimizer"`` only creates the
    optimizer state (same steady state, half the work: used by the simulation).
    ``accounting``: count bytes as a target device would (the simulation's ``target``).

    Returns the tracker, the tracked step's seconds, and live bytes before and after it.
    """
    if warmup == "optimizer":
        trainer.warm_up_optimizer()
    elif warmup:
        trainer.step(batch)
    on_cuda = trainer.device.type == "cuda"
    tracker = MemoryTracker(None if on_cuda else budget_bytes, cuda=on_cuda, cuda_history=cuda_history,
                            accounting=accounting)
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
            if tracker.oom is None:  # a real allocator OOM on CUDA
                tracker.oom = OOMInfo("unknown", "unknown", "unknown", 0, tracker.live_bytes,
                                      budget_bytes or 0, str(e).split("\n")[0],
                                      tracker.by_category())
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
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total))
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def _resolve_step(step: StepConfig | None, **overrides) -> StepConfig:
    step = step or StepConfig()
    return replace(step, **overrides) if overrides else step


def measure_step(step: StepConfig | None = None, *, device: str | None = "cpu",
                 budget: int | str | None = None, cuda_history: bool = False,
                 snapshot_path: str | None = None, **overrides) -> MemoryReport:
    """Run one real steady-state step and report its peak by category.

    ``budget`` (bytes, ``"512MiB"``, or a GPU preset such as ``"T4-16GB"``) makes the step a
    simulated device on CPU and a real reduced memory fraction on CUDA; a step that does not
    fit comes back with ``fits == False`` and ``oom`` filled, memory released.
    """
    step = _resolve_step(step, **overrides)
    dev = pick_device(device)
    trainer = build_trainer(step, dev)
    batch = _batch_to(make_batch(step, dev), step)
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
    return MemoryReport("measure", trainer.step_config, trainer.device.type, tracker.peak_bytes,
                        tracker.peak_by_category(), budget_bytes, seconds, tracker.oom,
                        tracker.timeline, tracker.cuda_stats, before, after)


def time_step(step: StepConfig | None = None, *, device: str | None = "cpu", repeats: int = 3,
              **overrides) -> float:
    """Median seconds of an untracked steady-state step (for compute-cost ratios)."""
    step = _resolve_step(step, **overrides)
    trainer = build_trainer(step, pick_device(device))
    batch = _batch_to(make_batch(step, trainer.device), step)
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


__all__ = ["StepConfig", "MemoryReport", "Trainer", "build_trainer", "make_batch",
           "measure_step", "measure_trainer", "time_step", "time_steps", "run_tracked_step", "autocast_for",
           "build_optimizer", "PRECISIONS", "OPTIMIZERS", "OFFLOADS"]
