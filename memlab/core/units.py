"""Bytes and their units: the binary sizes (``KiB`` ... ``YiB``), the one size
parser memlab has (:func:`parse_size`: a budget on the command line, a size in an allocator's
out-of-memory message) and the one formatter (:func:`fmt_bytes`).

The bottom layer: it imports nothing from memlab but :class:`~memlab.core.errors.InputError`.
"""
from __future__ import annotations

import re
from decimal import Decimal

from memlab.core.errors import InputError

KiB = 2**10
MiB = 2**20
GiB = 2**30
TiB = 2**40
PiB = 2**50
EiB = 2**60
ZiB = 2**70
YiB = 2**80

# Decimal units are SI (GB = 10^9 B, as card vendors write them); binary ones IEC.
# "bytes" is how c10's format_size writes a size under 1 KiB ("512 bytes").
SIZE_UNITS: dict[str, int] = {"": 1, "B": 1, "BYTES": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9,
                              "TB": 10**12, "PB": 10**15, "EB": 10**18, "KIB": KiB, "MIB": MiB,
                              "GIB": GiB, "TIB": TiB, "PIB": PiB, "EIB": EiB, "ZIB": ZiB, "YIB": YiB}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")
# fmt_bytes's ladder, largest first: a typo of a config (100,000 layers) reads in EiB, not as
# "23844841218.55 GiB"; past YiB the number grows
_BINARY = (("YiB", YiB), ("ZiB", ZiB), ("EiB", EiB), ("PiB", PiB), ("TiB", TiB), ("GiB", GiB),
           ("MiB", MiB), ("KiB", KiB))


def parse_size(value: int | float | str) -> int:
    """Bytes from ``1073741824``, ``"512MiB"``, ``"1.5GiB"``, ``"40GB"`` (GB = 10^9 B) or
    ``"512 bytes"``; case and a space before the unit do not matter.

    Args:
        value: bytes, or a number with a unit.

    Returns:
        The size in bytes.

    Raises:
        InputError: a negative or malformed size.
    """
    if isinstance(value, bool):
        raise InputError(f"budget {value!r} is not a size")
    if isinstance(value, (int, float)):
        if value < 0:
            raise InputError(f"budget {value!r} is negative; give a size >= 0 "
                             f"such as 536870912, '512MiB' or '40GB'")
        return int(value)
    m = _SIZE.match(str(value))
    if not m or m.group(2).upper() not in SIZE_UNITS:
        raise InputError(f"malformed size {value!r}; expected a number with an optional unit (B, KB, "
                         f"MB, GB, TB, PB, EB, KiB, MiB, GiB, TiB, PiB, EiB, ZiB, YiB), e.g. '512MiB' or '40GB'")
    # exact decimal arithmetic, then whole bytes: '1.15KB' is 1150, not 1149 (float's 1149.99...)
    return int(Decimal(m.group(1)) * SIZE_UNITS[m.group(2).upper()])


def binary_unit(nbytes: float, smallest: str = "B") -> tuple[int, str]:
    """The largest binary unit not above ``|nbytes|`` (YiB at most, ``smallest`` at least):
    ``(size, name)``, so that ``nbytes / size`` reads as a number of ``name``."""
    floor = {"B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB}
    if smallest not in floor:
        raise InputError(f"smallest={smallest!r}; allowed: {', '.join(floor)}")
    for name, size in _BINARY:
        if abs(nbytes) >= size or size == floor[smallest]:
            return size, name
    return 1, "B"


def fmt_bytes(n: float) -> str:
    """Human-readable bytes in the largest binary unit not above them: ``14.26 MiB``,
    ``5.00 TiB``, ``13.23 EiB``.

    Args:
        n: bytes.

    Returns:
        The size with its unit, e.g. ``"14.26 MiB"``.
    """
    size, unit = binary_unit(n)
    if size == 1:
        return f"{'-' if n < 0 else ''}{int(abs(n))} B"
    return f"{n / size:.2f} {unit}"


__all__ = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB", "SIZE_UNITS", "parse_size", "binary_unit",
           "fmt_bytes"]
