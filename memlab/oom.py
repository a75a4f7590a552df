"""The CUDA caching allocator, read from the outside: its out-of-memory message, and the
fragmentation that ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` removes.

PyTorch keeps freed CUDA blocks *reserved* (cached) for reuse instead of returning them to the
driver (PyTorch docs, *CUDA semantics*, "Memory management"). Its OOM message says so: of the
memory this process holds, how much is *allocated* (live tensors) and how much is *reserved
but unallocated* (cached blocks too small or too split up for the request).
:func:`read_oom` turns that message, or memlab's simulated one, into numbers.
:func:`fragmentation` provokes the classic case in a fresh process, once with the default
allocator and once with expandable segments.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python -m memlab.oom fragment
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import torch

from .errors import InputError
from .units import MiB, parse_size

# "2.00 GiB", "20.00 MiB", "512 bytes": c10's format_size; "0 B": memlab's fmt_bytes
_SIZE = r"([0-9.]+ ?(?:bytes|B|KiB|MiB|GiB|TiB))"
# the allocator's message (CUDACachingAllocator.cpp, "CUDA out of memory. Tried to allocate
# ...") and memlab's simulated one (tracking.py), field by field; every field is optional
_FIELDS = {
    # CUDA's and the tracker's "Tried to allocate 2.50 GiB", the CPU allocator's "you tried
    # to allocate 1125899906842624 bytes"
    "requested": r"[Tt]ried to allocate " + _SIZE,
    "total": r"total capacity of " + _SIZE,
    "free": r"of which " + _SIZE + r" is free",
    "process": r"this process has " + _SIZE + r" memory in use",
    "allowed": _SIZE + r" allowed;",
    "allocated": r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch",
    "reserved_unallocated": r"and " + _SIZE + r" is reserved by PyTorch but unallocated",
    # the simulated device (memlab.tracking): "X already in use; budget Y, so Z short"
    "in_use": _SIZE + r" already in use",
    "budget": r"budget " + _SIZE,
    "short": r"so " + _SIZE + r" short",
}


def read_oom(message: str) -> dict[str, int]:
    """The sizes in an out-of-memory message, in bytes.

    From a real CUDA OOM: ``requested`` (the block asked for), ``total`` and ``free`` (the
    card, as the driver sees it), ``process`` (this process, PyTorch or not), ``allowed``
    (the cap of ``set_per_process_memory_fraction``), ``allocated`` (live tensors) and
    ``reserved_unallocated`` (cached by the allocator, not handed out). From memlab's
    simulated device: ``requested``, ``in_use``, ``budget`` and ``short``. Raises InputError
    when the message is neither.
    """
    if not isinstance(message, str):
        raise InputError(f"message must be a string, got {type(message).__name__}")
    out = {}
    for key, pattern in _FIELDS.items():
        m = re.search(pattern, message)
        if m:
            out[key] = parse_size(m.group(1))
    if "requested" not in out:
        raise InputError(f"not an out-of-memory message (no 'Tried to allocate'): {message[:120]!r}")
    return out


def requested_bytes(message: str) -> int:
    """The bytes an allocator's OOM message says it tried to allocate (:func:`read_oom`'s
    ``requested``), or 0 when the message has none."""
    try:
        return read_oom(message)["requested"]
    except InputError:
        return 0


# --------------------------------------------------------------------------------------
# Fragmentation, provoked on purpose (CUDA only)
# --------------------------------------------------------------------------------------
def fragment_once(big_mib: int = 1024, piece_mib: int = 60, request_mib: int = 200,
                  cap_mib: int = 1100) -> dict:
    """In this process (fresh, nothing else on the GPU): cap it at ``cap_mib``, make one
    ``big_mib`` block and free it (the allocator keeps it reserved), carve it into
    ``piece_mib`` tensors, free every other one, then ask for ``request_mib``.

    The default allocator splits the cached block to serve the pieces; the holes left are each
    smaller than the request and the segment, still partly in use, cannot be returned, so
    the request needs a new segment the cap does not allow: OOM while most of the cap is
    free. With expandable segments the allocator unmaps the free pages of the holes (in
    20 MiB granules: pieces are multiples of it) and maps the request behind the last piece.
    """
    if not torch.cuda.is_available():
        raise InputError("fragmentation needs a CUDA GPU: the caching allocator is CUDA's")
    dev = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction(cap_mib * MiB / total, dev)
    u8 = dict(dtype=torch.uint8, device=dev)
    big = torch.empty(big_mib * MiB, **u8)
    del big
    pieces = [torch.empty(piece_mib * MiB, **u8) for _ in range(big_mib // piece_mib)]
    del pieces[1::2]
    out = {"expandable": "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
           "cap_bytes": cap_mib * MiB, "request_bytes": request_mib * MiB,
           "allocated_before": torch.cuda.memory_allocated(dev),
           "reserved_before": torch.cuda.memory_reserved(dev), "oom": None}
    try:
        extra = torch.empty(request_mib * MiB, **u8)
        out["fits"] = True
        del extra
    except torch.OutOfMemoryError as e:
        out["fits"], out["oom"] = False, str(e).split("\n")[0]
    out["reserved_after"] = torch.cuda.memory_reserved(dev)
    return out


def fragmentation(expandable: bool, timeout: float = 120.0, **sizes) -> dict:
    """:func:`fragment_once` in a fresh Python process, with or without
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (read when CUDA starts, so it needs
    its own process; the notebook's allocator stays as it is)."""
    env = dict(os.environ)
    conf = [c for c in env.get("PYTORCH_CUDA_ALLOC_CONF", "").split(",")
            if c and not c.startswith("expandable_segments")]
    env["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(conf + [f"expandable_segments:{expandable}"])
    args = [sys.executable, "-m", "memlab.oom", "fragment"]
    for key, value in sizes.items():
        args += [f"--{key.replace('_', '-')}", str(int(value))]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the fragmentation run failed: {done.stderr.strip()[-600:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m memlab.oom",
                                 description="provoke allocator fragmentation (CUDA), print JSON")
    sub = ap.add_subparsers(dest="command", required=True)
    frag = sub.add_parser("fragment", help="one fragmentation run in this process")
    for name, default in (("big-mib", 1024), ("piece-mib", 60), ("request-mib", 200),
                          ("cap-mib", 1100)):
        frag.add_argument(f"--{name}", type=int, default=default)
    args = ap.parse_args(argv)
    try:
        out = fragment_once(args.big_mib, args.piece_mib, args.request_mib, args.cap_mib)
    except ValueError as e:
        print(f"memlab.oom: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["read_oom", "requested_bytes", "fragment_once", "fragmentation"]
