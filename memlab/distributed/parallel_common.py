"""What the tensor- and pipeline-parallel runs share: the rank's device and threads, the
step a worker builds, and :class:`ParallelResult`, the per-rank numbers of a run."""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from memlab.core.errors import InputError
from memlab.core.hardware import rank_device
from memlab.models.gpt_unet import GPTConfig
from memlab.step.training_step import MemoryReport, StepConfig


def is_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is a DTensor shard (its bytes on this rank are ``p.to_local()``)."""
    return hasattr(p, "to_local")


def local_bytes(p: torch.Tensor) -> int:
    """Bytes of ``p`` held on this rank."""
    q = p.to_local() if is_sharded(p) else p
    return q.numel() * q.element_size()


def worker_step(model: str | GPTConfig, seq: int, batch: int, attention: str,
                tie: bool | None = None, micro_batches: int = 1) -> StepConfig:
    """The step a worker builds from its plain keyword arguments (``model``: a preset name
    or a config; ``tie`` overrides the model's weight tying)."""
    step = StepConfig(model=model, seq=seq, batch=batch, attention=attention,
                      micro_batches=micro_batches)
    if tie is not None and step.model_config.tie_embeddings != tie:
        step = replace(step, model=replace(step.model_config, tie_embeddings=tie))
    return step


def set_rank_threads(world_size: int) -> None:
    """Ranks on one CPU share its cores: their share each, never more threads than this
    process was given (``OMP_NUM_THREADS``), keeps the timing honest."""
    if rank_device().type == "cpu":
        share = max(1, (os.cpu_count() or 1) // world_size)
        torch.set_num_threads(min(share, torch.get_num_threads()))


@dataclass
class ParallelResult:
    """What a multi-rank run measured: ``per_rank`` holds each rank's numbers."""

    kind: str
    step: StepConfig
    per_rank: list[dict]
    device: str = "cpu"

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
            ranks.append(MemoryReport("measure", self.step, self.device, src["peak_bytes"],
                                      src["by_category"], notes=[f"rank {r['rank']}"]))
        top = max(ranks, key=lambda r: r.peak_bytes)
        return MemoryReport("measure", self.step, top.device, top.peak_bytes,
                            dict(top.by_category), per_rank=ranks,
                            notes=[f"{self.kind}, {len(ranks)} ranks; peak of the largest rank"])
