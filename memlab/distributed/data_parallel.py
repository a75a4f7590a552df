"""Data parallelism, measured on real ranks: the three collectives and one DDP step.

Lesson 09's primer before ZeRO. Every rank holds a full replica of the model and sees its own
slice of the batch; after backward the ranks all-reduce their gradients (sum, then divide by
the number of ranks), so every replica takes the same optimizer step as one process on the
whole batch would (Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training", sec. 3). ZeRO (:mod:`memlab.step.zero`) is built from the same collectives:
reduce-scatter leaves each rank one shard of the sum, all-gather puts the shards back together.

>>> coll = measure_collectives(world_size=2)      # what each rank holds before and after
>>> ddp = measure_ddp(StepConfig(seq=64, batch=4), world_size=2)
>>> ddp[0]["bytes"]                                # full replicas: parameters, gradients, Adam

Workers run on ranks started by :func:`memlab.distributed.ranks.run_ranks`, placed by
:func:`memlab.core.hardware.place_ranks` (one GPU per rank, or CPU ranks on gloo).
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from memlab.core.hardware import Placement, rank_device
from memlab.distributed.ranks import run_ranks
from memlab.step.training_step import StepConfig, build_trainer, make_batch


def collectives_worker(rank: int, world_size: int, n: int = 4) -> dict:
    """Each rank starts from ``x = [0, 1, .., n-1] + 10 * rank`` and runs the three collectives
    of data parallelism on it: all-reduce (every rank gets the sum), reduce-scatter (rank r
    gets shard r of the sum) and all-gather (every rank gets every rank's shard). Returns the
    lists each rank held, and the bytes of each result."""
    device = rank_device()
    x = torch.arange(n * world_size, dtype=torch.float32, device=device) + 10 * rank
    summed = x.clone()
    dist.all_reduce(summed)
    shard = torch.empty(n, device=device)
    # torch 2.13 renamed the tensor forms *_single and deprecates the old names (torch >= 2.6
    # is supported: older releases have only those)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter(shard, x.clone())
    gathered = torch.empty(n * world_size, device=device)
    all_gather(gathered, shard)
    return {"rank": rank, "backend": dist.get_backend(), "x": x.tolist(),
            "all_reduce": summed.tolist(), "reduce_scatter": shard.tolist(),
            "all_gather": gathered.tolist(),
            "bytes": {"all_reduce": summed.nbytes, "reduce_scatter": shard.nbytes,
                      "all_gather": gathered.nbytes}}


def measure_collectives(world_size: int = 2, *, n: int = 4, placement: Placement | None = None,
                        timeout: float = 120.0) -> list[dict]:
    """Run :func:`collectives_worker` on ``world_size`` ranks; results ordered by rank."""
    return run_ranks(collectives_worker, world_size, kwargs={"n": n}, placement=placement,
                     timeout=timeout)


def ddp_worker(rank: int, world_size: int, step: StepConfig) -> dict:
    """One AdamW step of ``step``'s model under ``DistributedDataParallel``: every rank builds
    the same model (same seed), takes its slice of one global batch of ``step.batch *
    world_size`` sequences and runs forward, backward (DDP all-reduces the gradients in
    buckets, averaged) and the optimizer step. Then the same global batch runs in this
    process alone on a fresh copy of the model: the largest gradient difference says whether
    the all-reduce gave every rank the one-process gradient. ``bytes``: what this rank holds
    after the step (parameters, gradients, Adam's moments), each a full replica."""
    device = rank_device()
    big = replace(step, batch=step.batch * world_size)
    inputs, targets = make_batch(big, device, seed=0)          # one global batch, same everywhere
    mine = slice(rank * step.batch, (rank + 1) * step.batch)
    trainer = build_trainer(step, device)
    model = trainer.model
    ref = build_trainer(step, device).model                     # same seed: the same weights
    ref.load_state_dict(model.state_dict())
    ddp = DDP(model, gradient_as_bucket_view=True)              # buckets are the gradients
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    ddp(inputs[mine], targets[mine]).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    opt.step()
    ref(inputs, targets).backward()                            # one process, the whole batch
    diff = max((g - p.grad).abs().max().item() for g, p in zip(grads, ref.parameters(), strict=True))
    scale = max(p.grad.abs().max().item() for p in ref.parameters())
    params = list(model.parameters())
    nbytes = {"parameters": sum(p.nbytes for p in params),
              "gradients": sum(p.grad.nbytes for p in params),
              "optimizer": sum(t.nbytes for s in opt.state.values() for t in s.values()
                               if torch.is_tensor(t) and t.dim() > 0)}
    return {"rank": rank, "rows": [mine.start, mine.stop],
            "num_params": sum(p.numel() for p in params),
            "max_grad_diff": diff / scale, "bytes": nbytes}


def measure_ddp(step: StepConfig, world_size: int = 2, *, placement: Placement | None = None,
                timeout: float = 300.0) -> list[dict]:
    """Run :func:`ddp_worker` on ``world_size`` ranks; results ordered by rank."""
    return run_ranks(ddp_worker, world_size, kwargs={"step": step}, placement=placement,
                     timeout=timeout)


__all__ = ["collectives_worker", "measure_collectives", "ddp_worker", "measure_ddp"]
