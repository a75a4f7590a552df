"""Precisions and their element sizes: the one table every formula reads.

``fp32``: everything in 4 bytes. ``bf16``/``fp16``: autocast; the weights (and their
gradients) stay fp32 and matmuls compute in 2 bytes. ``pure-bf16``: the model itself is cast
to bf16, no autocast. DeepSpeed's 16-bit mode runs like ``pure-bf16`` (see
:mod:`memlab.step.states`).
"""
from __future__ import annotations

from memlab.core.errors import InputError

#: precision -> (bytes of a stored weight and its gradient, autocast's bytes or None when off)
SIZES: dict[str, tuple[int, int | None]] = {"fp32": (4, None), "bf16": (4, 2), "fp16": (4, 2),
                                             "pure-bf16": (2, None)}
PRECISIONS = tuple(SIZES)


def check_precision(precision: str) -> str:
    """``precision`` if it is one memlab knows, else an InputError naming the allowed ones."""
    if precision not in SIZES:
        raise InputError(f"precision={precision!r}; allowed: {', '.join(SIZES)}")
    return precision


def precision_bytes(precision: str) -> tuple[int, int, int | None]:
    """``(parameter, compute, autocast)`` bytes per element of a precision: autocast's size
    is ``None`` when autocast is off (fp32, pure-bf16), and matmuls compute in it when on."""
    param, autocast = SIZES[check_precision(precision)]
    return param, autocast or param, autocast


__all__ = ["PRECISIONS", "SIZES", "check_precision", "precision_bytes"]
