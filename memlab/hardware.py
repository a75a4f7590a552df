"""Sizes and devices: parse ``"512MiB"``/``"40GB"``, GPU presets, pick a device, format bytes."""
from __future__ import annotations

import re

import torch

from .errors import InputError

MiB = 2**20
GiB = 2**30

# Total memory of each card as ``nvidia-smi`` reports it (MiB). A process can use a little
# less: the CUDA context takes a few hundred MiB before the first tensor.
GPU_PRESETS: dict[str, int] = {
    "T4-16GB": 15360 * MiB,
    "RTX4090-24GB": 24564 * MiB,
    "A100-40GB": 40960 * MiB,
    "A100-80GB": 81920 * MiB,
    "H100-80GB": 81559 * MiB,
    "H200-141GB": 143771 * MiB,
}

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_size(value: int | float | str) -> int:
    """Bytes from ``1073741824``, ``"512MiB"``, ``"1.5GiB"`` or ``"40GB"`` (GB = 10^9 B)."""
    if isinstance(value, bool):
        raise InputError(f"budget {value!r} is not a size")
    if isinstance(value, (int, float)):
        if value < 0:
            raise InputError(f"budget {value!r} is negative; give a size >= 0 "
                             f"such as 536870912, '512MiB' or '40GB'")
        return int(value)
    m = _SIZE.match(str(value))
    if not m or m.group(2).upper() not in _UNITS:
        raise InputError(f"malformed size {value!r}; expected a number with an optional unit "
                         f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '512MiB' or '40GB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def resolve_budget(budget: int | str | None) -> int | None:
    """A device budget in bytes from bytes, a size string or a GPU preset name."""
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


def fmt_bytes(n: float) -> str:
    """Human-readable bytes in binary units: ``14.26 MiB``."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"
