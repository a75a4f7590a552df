"""Targets: the device a step is predicted for (its autocast policy, its card's kernels and
workspaces, its allocator's blocks), and the tracker's accounting for a CUDA target."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from memlab.core.cards import CARDS, REFERENCE_CARD, Card, detect_card, get_card
from memlab.core.errors import InputError
from memlab.policy.autocast import CPU_AUTOCAST, CUDA_AUTOCAST, AutocastPolicy
from memlab.policy.kernels import (
    DTYPE_NAMES,
    layer_norm_stat_bytes,
    sdpa_backend,
    sdpa_backward_workspace,
    sdpa_lse_bytes,
)
from memlab.policy.workspaces import CUDA_BLOCK_BYTES, MATMUL_THREADS, conv_workspace
from memlab.tracking.tracker import DeviceAccounting

TARGETS = ("cuda", "cpu")


@dataclass(frozen=True)
class Target:
    """A device the step is predicted for: its autocast policy, kernels and allocator."""

    name: str
    autocast: AutocastPolicy
    block_bytes: int = 1
    card: Card | None = None    # the GPU a CUDA target is for (its kernels and workspaces)

    @property
    def capability(self) -> tuple[int, int] | None:
        """The card's compute capability (``None`` for the CPU)."""
        return None if self.card is None else self.card.capability

    @property
    def is_cuda(self) -> bool:
        return self.name == "cuda"

    def resident_workspace(self) -> int:
        """Workspace bytes allocated before the step and kept through it."""
        if not self.is_cuda:
            return 0
        return MATMUL_THREADS * self.card.cublas_workspace()

    def block(self, nbytes: int) -> int:
        """Bytes the device's allocator takes for a tensor of ``nbytes``."""
        b = self.block_bytes
        return nbytes if b <= 1 or nbytes == 0 else -(-nbytes // b) * b

    def accounting(self) -> DeviceAccounting:
        """The tracker's view of this device (see :class:`TargetAccounting`)."""
        return TargetAccounting(self) if self.is_cuda else DeviceAccounting()


def get_target(name: str = "cuda", budget: int | str | None = None,
               card: Card | str | None = None) -> Target:
    """The target named ``cuda`` or ``cpu``. A CUDA target is for one card: ``card`` (a
    :class:`~memlab.core.cards.Card` or a preset name such as ``"T4-16GB"``), else the GPU preset
    given as the budget, else the reference H200 (sm90). The card decides the attention
    kernels and the cuBLAS workspace."""
    if name not in TARGETS:
        raise InputError(f"target={name!r}; allowed: {', '.join(TARGETS)}")
    if name == "cpu":
        return Target("cpu", CPU_AUTOCAST)
    if isinstance(card, str):
        card = get_card(card)
    if card is None:
        card = CARDS.get(budget, CARDS[REFERENCE_CARD]) if isinstance(budget, str) else CARDS[REFERENCE_CARD]
    return Target("cuda", CUDA_AUTOCAST, CUDA_BLOCK_BYTES, card)


def resolve_target(target: str | Target | None, budget: int | str | None = None,
                   card: Card | str | None = None, device: str | None = None) -> Target:
    """The target a lens predicts for, when the caller may not have named one.

    An explicit ``target`` (``"cpu"``, ``"cuda"`` or a :class:`Target`) wins. Without one the
    target follows what was asked for: a ``card`` (or a GPU preset given as ``budget``)
    means the CUDA target for that card; otherwise ``device`` (``"cuda"``/``"cpu"``, default:
    the device this process would use, :func:`memlab.core.cards.detect_card`) decides: a CUDA
    GPU present means the CUDA target for its card, none means the CPU target. So the CPU
    lessons, which name no card, are predicted with the CPU's rules on a CPU machine.
    """
    if isinstance(target, Target):
        return target
    if target is not None:
        return get_target(target, budget, card)
    if card is not None or (isinstance(budget, str) and budget in CARDS):
        return get_target("cuda", budget, card)
    if device == "cpu":
        return get_target("cpu")
    present = detect_card() if device in (None, "cuda") else None
    if present is None:
        return get_target("cpu")
    return get_target("cuda", card=present)


# --------------------------------------------------------------------------------------
# The tracker's accounting for a CUDA target
# --------------------------------------------------------------------------------------
_aten = torch.ops.aten


class TargetAccounting(DeviceAccounting):
    """Bytes as the CUDA caching allocator would hold them for a step run on fake CPU
    tensors: 512-byte blocks, the cuBLAS workspaces, per-call cuDNN and flash-backward
    workspaces, and CUDA's attention log-sum-exp."""

    def __init__(self, target: Target):
        self.target = target

    def block_bytes(self, nbytes: int) -> int:
        return self.target.block(nbytes)

    def resident_workspace(self) -> int:
        return self.target.resident_workspace()

    def output_bytes(self, func, outputs: list, index: int, nbytes: int) -> int:
        if func is _aten._scaled_dot_product_flash_attention_for_cpu.default and index == 1:
            out, lse = outputs[0], outputs[1]
            b, h, s = lse.shape
            backend = sdpa_backend(self.target, out.element_size(), out.shape[-1],
                                   dtype=DTYPE_NAMES.get(out.dtype))
            return sdpa_lse_bytes(backend, b, h, s)
        if func is _aten.native_layer_norm.default and index in (1, 2):
            return outputs[index].numel() * layer_norm_stat_bytes(self.target, outputs[0].element_size())
        return nbytes

    def op_workspace(self, func, args, kwargs, out) -> int:
        if func is _aten.convolution.default:
            x, w, y = args[0], args[1], out
        elif func is _aten.convolution_backward.default:
            x, w, y = args[1], args[2], args[0]  # input, weight, gradient of the output
        else:
            x = None
        if x is not None:
            forward = func is _aten.convolution.default
            stride, transposed = (args[3], args[6]) if forward else (args[4], args[7])
            # a transposed convolution's lowering is its forward twin's: channels of its
            # output, positions of its input
            lowered, positions = (y, x) if transposed else (x, y)
            return conv_workspace(lowered.shape[1], tuple(w.shape[2:]), tuple(positions.shape[2:]),
                                  tuple(stride), x.element_size())
        if func is _aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
            q, k = args[1], args[2]
            b, h, s, d = q.shape
            backend = sdpa_backend(self.target, q.element_size(), d, dtype=DTYPE_NAMES.get(q.dtype))
            return sdpa_backward_workspace(backend, b, h, s, d, k.shape[1], q.element_size())
        return 0


__all__ = ["TARGETS", "Target", "TargetAccounting", "get_target", "resolve_target"]
