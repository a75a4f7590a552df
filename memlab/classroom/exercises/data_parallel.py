"""Lesson 09: average the gradients of data-parallel replicas with an all-reduce."""
from __future__ import annotations

import threading
from typing import Callable

import torch

from memlab.classroom.exercises.common import CheckResult, fail, rel_diff, require, tiny_model
from memlab.models.gpt_unet import get_config

DP_TOLERANCE = 1e-5  # the two halves' gradients add in another order than one batch's


class ThreadRanks:
    """``world_size`` ranks as threads of this process, with an in-place ``all_reduce(tensor)``
    (sum, like ``torch.distributed.all_reduce``): each rank's call waits at a barrier until
    every rank has called it, then all receive the sum. Enough to run a learner's
    gradient-averaging function on every replica at once, without starting processes."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=30)
        self.slots: list[torch.Tensor | None] = [None] * world_size
        self.calls = [0] * world_size

    def all_reduce_for(self, rank: int) -> Callable[[torch.Tensor], None]:
        def all_reduce(tensor: torch.Tensor, *args, **kwargs) -> None:
            self.calls[rank] += 1
            self.slots[rank] = tensor.detach().clone()
            self.barrier.wait()
            total = sum(self.slots)
            self.barrier.wait()  # everyone has read the slots before anyone writes again
            with torch.no_grad():
                tensor.copy_(total)
        return all_reduce


def check_gradient_average(average_gradients: Callable, *, world_size: int = 2) -> CheckResult:
    """``average_gradients(model, all_reduce, world_size)`` runs on every rank after backward
    and must leave each parameter's ``.grad`` equal to the gradient one process computes on
    the whole batch, using only ``all_reduce(tensor)`` (an in-place sum over the ranks).
    Checked on the tiny GPT, ``world_size`` replicas as threads: each rank's gradients against
    the one-process gradients within :data:`DP_TOLERANCE`."""
    name = "data-parallel gradient average"
    require(name, "average_gradients", average_gradients,
            "a function (model, all_reduce, world_size) that calls all_reduce(p.grad) for each "
            "parameter and divides by world_size")
    cfg = get_config("tiny")
    g = torch.Generator().manual_seed(0)
    batch = 2 * world_size
    inputs = torch.randint(0, cfg.vocab_size, (batch, 16), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (batch, 16), generator=g)
    ref = tiny_model()
    ref(inputs, targets).backward()
    ref_grads = [p.grad for p in ref.parameters()]
    ranks = ThreadRanks(world_size)
    models = [tiny_model() for _ in range(world_size)]
    errors: list[BaseException | None] = [None] * world_size

    def run(rank: int) -> None:
        part = slice(rank * 2, (rank + 1) * 2)
        try:
            models[rank](inputs[part], targets[part]).backward()
            average_gradients(models[rank], ranks.all_reduce_for(rank), world_size)
        except threading.BrokenBarrierError as e:
            errors[rank] = e
        except Exception as e:  # the learner's code: report it
            errors[rank] = e
            ranks.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real:
        fail(name, f"average_gradients raised {type(real[0]).__name__}: {real[0]}")
    if any(errors):
        fail(name, "the ranks called all_reduce a different number of times and waited for each "
                   "other forever: every rank must all-reduce the same tensors in the same order")
    if ranks.calls[0] == 0:
        fail(name, "all_reduce was never called: each rank still holds the gradient of its own "
                   "half of the batch; all_reduce(p.grad) sums them over the ranks")
    diffs = [rel_diff([p.grad for p in m.parameters()], ref_grads) for m in models]
    if max(diffs) > DP_TOLERANCE:
        summed = rel_diff([p.grad / world_size for p in models[0].parameters()], ref_grads)
        if summed < DP_TOLERANCE:
            fail(name, f"the gradients are {world_size}x the one-process gradients: all_reduce "
                       f"sums over the ranks; divide by world_size to average")
        fail(name, f"rank gradients differ from the one-process gradients by up to "
                   f"{max(diffs):.1e} (allowed {DP_TOLERANCE:g}): all-reduce every parameter's "
                   f".grad, then divide by world_size")
    return CheckResult(name, {"max_grad_diff": max(diffs), "all_reduce_calls": ranks.calls[0]},
                       [f"every rank's gradients equal the one-process gradients within "
                        f"{max(diffs):.1e} (allowed {DP_TOLERANCE:g})",
                        f"{ranks.calls[0]} all-reduce calls per rank (DDP groups them into "
                        f"buckets: fewer, larger messages)"])
