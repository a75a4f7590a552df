"""Ranks without other processes: a fake process group for simulating one rank of a job.

A fake process group (``torch.testing._internal.distributed.fake_pg``) makes this process
rank 0 of ``world_size`` ranks; every collective returns at once and exchanges nothing. The
shapes each rank holds are then those of a real job (sharded parameters, gathered weights),
which is what the simulations of ZeRO-3/FSDP2 and tensor parallelism track; the values are
not (averaged gradients, gathered weights), so it serves bytes and configs, never losses.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from .errors import InputError
from .hardware import place_ranks


def default_backend(world_size: int = 1) -> str:
    """The backend :func:`~memlab.hardware.place_ranks` gives ``world_size`` ranks here: NCCL
    when every rank can have its own GPU, gloo (CPU) otherwise."""
    return place_ranks(world_size).backend


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """This process as rank 0 of ``world_size`` ranks on a fake process group, destroyed on
    exit. Refuses to run inside a job that already has a process group."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"world_size must be a positive integer, got {world_size!r}")
    if dist.is_initialized():
        raise RuntimeError("a process group already exists in this process; a fake one needs "
                           "its own (run the simulation outside a distributed job)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


__all__ = ["default_backend", "fake_process_group"]
