"""Devices: GPU presets (the card profiles of :mod:`memlab.core.cards`) and budgets, picking a device,
placing ranks on devices.

Sizes and their units live in :mod:`memlab.core.units`."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from memlab.core.cards import CARDS
from memlab.core.errors import InputError
from memlab.core.units import parse_size

# Memory of one device of each card profile (:mod:`memlab.core.cards`: capability, kernels,
# workspace), as ``nvidia-smi`` reports it. A process can use a little less: the CUDA
# context takes a few hundred MiB before the first tensor.
GPU_PRESETS: dict[str, int] = {name: card.memory for name, card in CARDS.items()}


def resolve_budget(budget: int | str | None) -> int | None:
    """A device budget in bytes from bytes, a size string or a GPU preset name.

    Args:
        budget: bytes, a size string (``"512MiB"``), a GPU preset (``"A100-40GB"``) or ``None``.

    Returns:
        Bytes, or ``None`` for no budget.

    Raises:
        InputError: an unknown preset or a malformed or negative size.
    """
    if budget is None:
        return None
    if isinstance(budget, str) and budget in GPU_PRESETS:
        return GPU_PRESETS[budget]
    if isinstance(budget, str) and "-" in budget and not budget.strip().startswith("-"):
        raise InputError(f"unknown GPU preset {budget!r}; allowed: {', '.join(GPU_PRESETS)}")
    return parse_size(budget)


def pick_device(device: str | None = None) -> torch.device:
    """``cuda`` when asked for or available, else ``cpu``; an unknown name is an error."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise InputError(f"unknown device {device!r}; allowed: cpu, cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("device 'cuda' was asked for but torch sees no CUDA GPU; use --device cpu")
    return torch.device(device)


@dataclass(frozen=True)
class Placement:
    """Where the ranks of a multi-process run go: one backend for all, a device per rank.

    ``reason`` is one line a lesson prints, so a learner sees why the ranks run where they do.
    """

    world_size: int
    backend: str                # "nccl" (one GPU per rank) or "gloo" (CPU ranks)
    devices: tuple[str, ...]    # per rank: "cuda:0", "cuda:1", ... or "cpu"
    reason: str

    @property
    def device_type(self) -> str:
        """``"cuda"`` for NCCL ranks, ``"cpu"`` for gloo ranks."""
        return "cuda" if self.backend == "nccl" else "cpu"

    def device(self, rank: int) -> torch.device:
        """The device of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise InputError(f"rank {rank} is outside 0-{self.world_size - 1}")
        return torch.device(self.devices[rank])

    def rank_env(self) -> dict[str, str]:
        """Environment a rank sets before it imports DeepSpeed or touches CUDA.

        CPU ranks run DeepSpeed's CPU accelerator and see no GPU at all: a GPU that is there
        but not theirs would otherwise draw DeepSpeed (which picks ``cuda:LOCAL_RANK``) or a
        stray ``.cuda()`` onto a device ordinal that does not exist.
        """
        if self.backend == "nccl":
            return {"DS_ACCELERATOR": "cuda"}
        return {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}

    def __str__(self) -> str:
        return self.reason


def visible_gpus() -> int:
    """CUDA GPUs torch can use here (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def place_ranks(world_size: int, gpus: int | None = None, *, shrink: bool = False) -> Placement:
    """Decide where ``world_size`` ranks run: the one place memlab makes that choice.

    ``gpus`` is how many CUDA GPUs the ranks may use (default: all torch sees; ``0`` asks
    for CPU ranks). With at least one GPU per rank: NCCL, rank ``r`` on ``cuda:r``. With
    fewer, NCCL cannot run (two ranks cannot share a GPU) and the ranks run on the CPU with
    gloo and DeepSpeed's CPU accelerator. ``shrink=True`` instead runs as many ranks as there
    are GPUs (at least one), for lessons whose point is the GPU itself (offload).

    Args:
        world_size: ranks to place; gpus, shrink: as above.

    Returns:
        A :class:`~memlab.core.hardware.Placement` (backend, device per rank, world size).

    Raises:
        InputError: ``world_size`` below 1 or ``gpus`` below 0.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"world_size must be a positive integer, got {world_size!r}")
    if gpus is None:
        gpus = visible_gpus()
    elif isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        raise InputError(f"gpus must be an integer >= 0 (0: CPU ranks), got {gpus!r}")
    if gpus >= world_size:
        return Placement(world_size, "nccl", tuple(f"cuda:{r}" for r in range(world_size)),
                         f"{world_size} rank(s) on {gpus} GPU(s): NCCL, one GPU per rank")
    if shrink and gpus >= 1:
        return Placement(gpus, "nccl", tuple(f"cuda:{r}" for r in range(gpus)),
                         f"{gpus} GPU(s) for {world_size} ranks: running {gpus} rank(s), one per "
                         f"GPU (NCCL), so that device and host are two real memories")
    why = ("no CUDA GPU" if gpus == 0 and visible_gpus() == 0 else
           "CPU ranks asked for" if gpus == 0 else
           f"{gpus} GPU(s) for {world_size} ranks and NCCL needs one GPU per rank")
    return Placement(world_size, "gloo", ("cpu",) * world_size,
                     f"{why}: the {world_size} ranks run on the CPU (gloo, DeepSpeed's CPU "
                     f"accelerator, CPU tensors)")


def rank_device() -> torch.device:
    """This rank's device, read from its process group: its GPU under NCCL, else the CPU.

    Workers ask this instead of ``torch.cuda.is_available()``: CPU ranks on a GPU machine
    must stay on the CPU (see :func:`place_ranks`).
    """
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

