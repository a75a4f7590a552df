"""What the tensor- and pipeline-parallel runs share: the rank's device and threads, the
step a worker builds, and :class:`ParallelResult`, the per-rank numbers of a run."""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..errors import InputError
from ..step import MemoryReport, StepConfig


def is_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is a DTensor shard (its bytes on this rank are ``p.to_local()``)."""
    return hasattr(p, "to_local")


def local_bytes(p: torch.Tensor) -> int:
    """Bytes of ``p`` held on this rank."""
    q = p.to_local() if is_sharded(p) else p
    return q.numel() * q.element_size()


def rank_device() -> torch.device:
    """This rank's device: its GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def worker_step(model: str, seq: int, batch: int, attention: str, tie: bool | None = None,
                 micro_batches: int = 1) -> StepConfig:
    """The step a worker builds from its plain keyword arguments (``tie`` overrides the
    model's weight tying)."""
    step = StepConfig(model=model, seq=seq, batch=batch, attention=attention,
                      micro_batches=micro_batches)
    if tie is not None and step.model_config.tie_embeddings != tie:
        step = replace(step, model=replace(step.model_config, tie_embeddings=tie))
    return step


def default_backend(ranks: int) -> str:
    """NCCL when every rank can have its own GPU, gloo (CPU) otherwise."""
    return "nccl" if torch.cuda.device_count() >= ranks else "gloo"


def set_rank_threads(world_size: int) -> None:
    """Ranks on one CPU share its cores: one rank per core keeps the timing honest."""
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))


@dataclass
class ParallelResult:
    """What a multi-rank run measured: ``per_rank`` holds each rank's numbers."""

    kind: str
    step: StepConfig
    per_rank: list[dict]

    def report(self, schedule: str | None = None, m: int | None = None) -> MemoryReport:
        """The per-rank peaks as a :class:`MemoryReport` (``per_rank`` filled); for a
        pipeline, of the run with ``schedule`` and ``m`` (default: the last one measured)."""
        ranks = []
        for r in self.per_rank:
            src = r
            if "runs" in r:
                runs = [x for x in r["runs"] if (schedule is None or x["schedule"] == schedule)
                        and (m is None or x["m"] == m) and "peak_bytes" in x]
                if not runs:
                    raise InputError(f"no tracked run with schedule={schedule!r}, m={m!r}")
                src = runs[-1]
            ranks.append(MemoryReport("measure", self.step, "cpu", src["peak_bytes"],
                                      src["by_category"], notes=[f"rank {r['rank']}"]))
        top = max(ranks, key=lambda r: r.peak_bytes)
        return MemoryReport("measure", self.step, top.device, top.peak_bytes,
                            dict(top.by_category), per_rank=ranks,
                            notes=[f"{self.kind}, {len(ranks)} ranks; peak of the largest rank"])
