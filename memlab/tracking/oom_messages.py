"""The CUDA caching allocator, read from the outside: its out-of-memory message, and the
fragmentation that ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` removes.

PyTorch keeps freed CUDA blocks *reserved* (cached) for reuse instead of returning them to the
driver (PyTorch docs, *CUDA semantics*, "Memory management"). Its OOM message says so: of the
memory this process holds, how much is *allocated* (live tensors) and how much is *reserved
but unallocated* (cached blocks too small or too split up for the request).
:func:`read_oom` turns that message, or memlab's simulated one, into numbers.
:func:`fragmentation` provokes the classic case in a fresh process, once with the default
allocator and once with expandable segments.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python -m memlab.tracking.oom_messages fragment

:func:`parse_oom` reads every format torch has printed (before 1.5, 1.5 to 2.0, 2.1, 2.2+),
Apple's MPS allocator's, the host allocator's, DeepSpeed's and NCCL's into an
:class:`OOMMessage`; :func:`explain_oom` says what the numbers mean (``memlab oom`` on the
command line, :func:`explain_last` in a notebook), each rule from the allocator's or the
driver's behaviour: the segment a request needs (:func:`segment_bytes`), Windows' shared GPU
memory, memory other processes hold, expandable segments by torch version, MPS's watermark.
Real messages from public threads, with what each thread says of its run, are in
``tests/data/oom_messages``.

Over 500 lines because the message's formats, their reading, what each cause means and the
experiment that provokes the fragmentation case are one subject: the allocator seen from
outside; callers (the CLI, the callbacks, the tracker) import the reading and the
explanation from this one module.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import traceback
from dataclasses import asdict, dataclass, field
from importlib import resources

import torch

from memlab.core.errors import InputError
from memlab.core.units import GiB, MiB, fmt_bytes, parse_size

# --------------------------------------------------------------------------------------
# The message, read: every format torch (and DeepSpeed, NCCL) has printed
# --------------------------------------------------------------------------------------
# "2.00 GiB", "20.00 MiB", "512 bytes": c10's format_size (two decimals, GiB at most);
# "0 B": memlab's fmt_bytes
_SIZE = r"([0-9]+(?:\.[0-9]+)? ?(?:bytes|B|KiB|MiB|GiB|TiB))"
# NVML's NVML_VALUE_NOT_AVAILABLE is 2^64 - 1 bytes: format_size prints it as
# "17179869184.00 GiB" when the driver cannot say what a process uses. No card is that large.
_NOT_AVAILABLE = 2**63
#: c10's format_size prints two decimals in B, KiB, MiB or GiB (never above GiB): a printed
#: size is off by at most half a hundredth of a GiB
ROUNDING_BYTES = GiB // 200

# The segment a request needs from the driver when no cached block serves it: torch's
# c10/cuda/CUDACachingAllocator.cpp (kSmallSize, kSmallBuffer, kMinLargeAlloc, kLargeBuffer,
# kRoundLarge; get_allocation_size). memlab.policy.caching_allocator replays the same rules but
# sits a layer above this module (it imports the tracker, which imports this one), so the four
# constants are repeated here; tests/test_oom.py checks both agree.
_SMALL_SIZE = 1 << 20        # requests up to 1 MiB come from the small pool ...
_SMALL_BUFFER = 2 << 20      # ... which grows by 2 MiB segments
_MIN_LARGE_ALLOC = 10 << 20  # requests of 1 to 10 MiB get a whole ...
_LARGE_BUFFER = 20 << 20     # ... 20 MiB segment, split afterwards
_ROUND_LARGE = 2 << 20       # larger requests: rounded up to 2 MiB
#: free memory within this of the segment is not taken as proof the driver could have served
#: it: cudaMemGetInfo's "free" is read after the failure, and the driver's own allocations
#: (page tables, context growth, other processes) come from the same pool. A heuristic, not
#: a driver constant.
DRIVER_SLACK = 64 << 20


def segment_bytes(request: int) -> int:
    """Bytes the caching allocator asks ``cudaMalloc`` for when no cached block fits a
    ``request``: 2 MiB for at most 1 MiB, 20 MiB below 10 MiB, else the request rounded up to
    2 MiB (``get_allocation_size`` in CUDACachingAllocator.cpp; requests first rounded to 512 B).

    Args:
        request: the bytes the message says it tried to allocate.
    Returns:
        the segment size in bytes (0 for 0).
    """
    if request <= 0:
        return 0
    n = -(-request // 512) * 512
    if n <= _SMALL_SIZE:
        return _SMALL_BUFFER
    if n < _MIN_LARGE_ALLOC:
        return _LARGE_BUFFER
    return -(-n // _ROUND_LARGE) * _ROUND_LARGE


#: PYTORCH_MPS_HIGH_WATERMARK_RATIO's default (torch docs, "MPS Environment Variables"):
#: "max allowed" in an MPS message is this ratio times the device's recommendedMaxWorkingSetSize
MPS_HIGH_WATERMARK_DEFAULT = 1.7

#: What :func:`parse_oom` recognises, in the order a mixed log is read (the first kind present
#: wins): memlab's simulated device, the CUDA caching allocator (every era), Apple's MPS
#: allocator, the host allocator, NCCL, the CUDA runtime outside the caching allocator,
#: DeepSpeed's launcher.
KINDS = ("simulated", "cuda", "mps", "host", "nccl", "cuda-runtime", "deepspeed")


def _pattern(text: str) -> str:
    """A literal phrase as a regex whose spaces match any run of whitespace (messages come
    wrapped, indented, or with ``[rank0]:`` prefixes removed)."""
    return r"\s+".join(text.split(" "))


def _bytes(text: str) -> int:
    return parse_size(text.replace(" ", ""))


@dataclass
class OOMMessage:
    """The numbers in one out-of-memory message, in bytes (``None``: the message has no such
    field). ``kind`` is one of :data:`KINDS`; ``era`` the CUDA format: ``"2.1+"`` ("GPU 0 has
    a total capacity of ..."), ``"pre-2.1"`` ("(GPU 0; T total capacity; A already allocated;
    F free; R reserved in total by PyTorch)") or ``"pre-1.5"`` (its "C cached" field).

    Both CUDA eras give the same numbers: ``allocated`` (live tensors), ``reserved`` (all that
    PyTorch's cache holds, live or not) and ``reserved_unallocated`` (cached, not handed out);
    the era that prints one of the last two gives the other by difference.
    """

    kind: str
    era: str | None = None
    device: int | None = None
    requested: int | None = None
    total: int | None = None
    free: int | None = None
    allowed: int | None = None
    allocated: int | None = None
    reserved: int | None = None
    reserved_unallocated: int | None = None
    private_pools: int | None = None
    #: this process as the driver (NVML) sees it: PyTorch's cache plus CUDA context, cuBLAS
    #: and NCCL buffers; ``None`` also when NVML printed "not available"
    process: int | None = None
    #: other processes on the card: (pid, bytes), as NVML listed them
    other_processes: tuple[tuple[int, int], ...] = ()
    #: the allocator's advice in the message: "expandable_segments" or "max_split_size_mb"
    hint: str | None = None
    #: the torch releases that print this format: "< 1.5", "1.5 to 2.0", "2.1", "2.2+"
    torch_versions: str | None = None
    #: MPS: Metal memory of this process outside PyTorch's MPS allocator ("other allocations")
    other_allocations: int | None = None
    #: MPS: the pool the request was for ("private" or "shared")
    pool: str | None = None
    # the host allocator: errno and its text
    errno: int | None = None
    error_text: str | None = None
    # memlab's simulated device
    in_use: int | None = None
    budget: int | None = None
    short: int | None = None
    # DeepSpeed's see_memory_usage (GB there is 2^30 bytes) and launcher
    ds_allocated: int | None = None
    ds_max_allocated: int | None = None
    ds_reserved: int | None = None
    ds_max_reserved: int | None = None
    host_used: int | None = None
    host_percent: float | None = None
    return_code: int | None = None
    #: the traceback went through ZeRO-3's parameter gathering (DeepSpeed frames)
    zero3_gather: bool = False
    nccl_version: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def other_bytes(self) -> int:
        """Bytes the driver lists for other processes on this card."""
        return sum(b for _, b in self.other_processes)

    @property
    def non_pytorch(self) -> int | None:
        """Bytes this process holds outside PyTorch's cache (CUDA context, cuBLAS, NCCL)."""
        if self.process is None or self.reserved is None:
            return None
        return max(0, self.process - self.reserved)

    @property
    def segment(self) -> int | None:
        """Bytes ``cudaMalloc`` was asked for (:func:`segment_bytes` of the request)."""
        return None if self.requested is None else segment_bytes(self.requested)

    @property
    def held_outside(self) -> int | None:
        """The card's memory in use that is not this process's: ``total - free - process``
        when the message gives this process's figure (torch 2.1+), else ``total - free -
        reserved`` (which also counts this process's CUDA context and libraries)."""
        if self.total is None or self.free is None:
            return None
        own = self.process if self.process is not None else self.reserved
        if own is None:
            return None
        return max(0, self.total - self.free - own)

    @property
    def beyond_card(self) -> bool:
        """PyTorch holds more than the card has: Windows' WDDM driver pages device memory out
        to shared system memory, so allocations can exceed the dedicated memory."""
        held = max(self.allocated or 0, self.reserved or 0)
        return self.total is not None and held > self.total + ROUNDING_BYTES

    def sizes(self) -> dict[str, int]:
        """The fields that are sizes and present, as ``{name: bytes}``."""
        names = ("requested", "total", "free", "process", "allowed", "allocated",
                 "reserved_unallocated", "other_allocations", "in_use", "budget", "short")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


def _clean(text: str) -> str:
    """One line: launchers' ``[rank0]:`` prefixes dropped, whitespace collapsed."""
    lines = [re.sub(r"^\s*\[(?:rank|RANK)\s*\d+\]:?\s?", "", line) for line in text.splitlines()]
    return " ".join(" ".join(lines).split())


def _find(pattern: str, text: str, flags: int = 0) -> re.Match | None:
    return re.search(pattern, text, flags)


def _read_cuda(text: str, out: OOMMessage) -> None:  # noqa: C901 one match per figure of CUDA's message
    """The caching allocator's message (CUDACachingAllocator.cpp), either era; ``text`` starts
    at its "out of memory. Tried to allocate"."""
    if m := _find(r"Tried to allocate " + _SIZE, text):
        out.requested = _bytes(m.group(1))
    elif _find(r"Tried to allocate more than 1EB", text):
        out.notes.append("the request was over 1 EiB: a shape or dtype mistake, not a full card")
    if m := _find(r"GPU (\d*) ?has a total capac(i?)ty of " + _SIZE, text):
        # torch 2.1 printed "capacty" and suggested max_split_size_mb; 2.2 fixed the word and
        # suggests expandable_segments (the two templates in CUDACachingAllocator.cpp's history)
        out.era, out.total = "2.1+", _bytes(m.group(3))
        out.device = int(m.group(1)) if m.group(1) else None
        out.torch_versions = "2.2+" if m.group(2) else "2.1"
        if m := _find(r"of which " + _SIZE + r" is free", text):
            out.free = _bytes(m.group(1))
        if m := _find(_pattern("Of the allocated memory ") + _SIZE + _pattern(" is allocated by PyTorch"), text):
            out.allocated = _bytes(m.group(1))
        if m := _find(r"with " + _SIZE + _pattern(" allocated in private pools"), text):
            out.private_pools = _bytes(m.group(1))
        if m := _find(r"and " + _SIZE + _pattern(" is reserved by PyTorch but unallocated"), text):
            out.reserved_unallocated = _bytes(m.group(1))
        if out.allocated is not None and out.reserved_unallocated is not None:
            out.reserved = out.allocated + out.reserved_unallocated
    elif m := _find(r"\(GPU (\d+); " + _SIZE + r" total capacity", text):
        out.era, out.device, out.total = "pre-2.1", int(m.group(1)), _bytes(m.group(2))
        out.torch_versions = "1.5 to 2.0"
        if m := _find(_SIZE + r" already allocated", text):
            out.allocated = _bytes(m.group(1))
        if m := _find(r"; " + _SIZE + r" free", text):
            out.free = _bytes(m.group(1))
        if m := _find(_SIZE + _pattern(" reserved in total by PyTorch"), text):
            out.reserved = _bytes(m.group(1))
            if out.allocated is not None:
                out.reserved_unallocated = max(0, out.reserved - out.allocated)
        elif m := _find(_SIZE + r" cached\)", text):
            # torch < 1.5: "cached" was the cache's free blocks (it is below "already allocated"
            # in messages of the time, so it cannot be the whole cache)
            out.era, out.reserved_unallocated = "pre-1.5", _bytes(m.group(1))
            out.torch_versions = "< 1.5"
            if out.allocated is not None:
                out.reserved = out.allocated + out.reserved_unallocated
    if m := _find(_SIZE + r" allowed;", text):
        out.allowed = _bytes(m.group(1))
    if m := _find(_pattern("this process has ") + _SIZE + _pattern(" memory in use"), text):
        size = _bytes(m.group(1))
        if size >= _NOT_AVAILABLE:
            out.notes.append("the driver could not report this process's memory (NVML: not available)")
        else:
            out.process = size
    for m in re.finditer(r"Process (\d+) has " + _SIZE + _pattern(" memory in use"), text):
        size = _bytes(m.group(2))
        if size < _NOT_AVAILABLE:
            out.other_processes += ((int(m.group(1)), size),)
    if "expandable_segments" in text:
        out.hint = "expandable_segments"
    elif "max_split_size_mb" in text:
        out.hint = "max_split_size_mb"


# MPSAllocator.mm's format_size printed "KB/MB/GB" before torch used c10's "KiB/MiB/GiB"; both
# are powers of 1024: the same 16 GB Mac prints "max allowed: 18.13 GB" in one era
# (github.com/pinokiocomputer/pinokio/issues/941) and "18.13 GiB" in the other
# (github.com/Comfy-Org/ComfyUI/issues/8984).
_MPS_SIZE = r"([0-9]+(?:\.[0-9]+)?) ?(bytes|KB|MB|GB|KiB|MiB|GiB)"


def _mps_bytes(number: str, unit: str) -> int:
    return _bytes(number + ("bytes" if unit == "bytes" else unit[0] + "iB"))


def _read_mps(text: str, out: OOMMessage) -> None:
    """The MPS allocator's message (aten/src/ATen/mps/MPSAllocator.mm): "MPS backend out of
    memory (MPS allocated: A, other allocations: O[, max allowed: L]). Tried to allocate R on
    private|shared pool."."""
    for name, label in (("allocated", "MPS allocated"), ("other_allocations", "other allocations"),
                        ("allowed", "max allowed"), ("requested", "Tried to allocate")):
        if m := _find(label + r":? " + _MPS_SIZE, text):
            setattr(out, name, _mps_bytes(m.group(1), m.group(2)))
    if m := _find(r" on (private|shared) pool", text):
        out.pool = m.group(1)


def _read_deepspeed(text: str, out: OOMMessage) -> None:
    """DeepSpeed's ``see_memory_usage`` lines (runtime/utils.py: MA/CA in GB of 2^30 bytes) and
    its launcher's ``exits with return code = -9`` (launcher/launch.py)."""
    found = list(re.finditer(r"MA ([0-9.]+) GB Max_MA ([0-9.]+) GB CA ([0-9.]+) GB Max_CA ([0-9.]+) GB", text))
    if found:
        m = found[-1]  # the last report before the failure
        out.ds_allocated, out.ds_max_allocated, out.ds_reserved, out.ds_max_reserved = (
            int(float(g) * GiB) for g in m.groups())
    found = list(re.finditer(r"CPU Virtual Memory: used = ([0-9.]+) GB, percent = ([0-9.]+)%", text))
    if found:
        out.host_used, out.host_percent = int(float(found[-1].group(1)) * GiB), float(found[-1].group(2))
    if m := _find(r"exits with return code = (-?\d+)", text):
        out.return_code = int(m.group(1))
    if _find(r"partitioned_param_coordinator|fetch_sub_module|__all_gather_params|"
             r"_all_gather_params|allgather_fn", text):
        out.zero3_gather = True


def parse_oom(message: str) -> OOMMessage:
    """Read an out-of-memory message, or a whole traceback or log containing one, into an
    :class:`OOMMessage`. The last CUDA allocator message counts when a log repeats one per
    rank. Raises :class:`~memlab.core.errors.InputError` when no format of :data:`KINDS` is in it.

    Args:
        message: the text as printed (``str(error)``, a pasted traceback, a launcher's log).
    Returns:
        the message's numbers, in bytes.
    """
    if not isinstance(message, str):
        raise InputError(f"message must be a string, got {type(message).__name__}")
    text = _clean(message)
    cuda = list(re.finditer(r"(?i:out of memory)\. Tried to allocate", text))
    if "Simulated device out of memory" in text:
        out = OOMMessage("simulated")
        if m := _find(r"Tried to allocate " + _SIZE, text):
            out.requested = _bytes(m.group(1))
        for name, pattern in (("in_use", _SIZE + r" already in use"), ("budget", r"budget " + _SIZE),
                              ("short", r"so " + _SIZE + r" short")):
            if m := _find(pattern, text):
                setattr(out, name, _bytes(m.group(1)))
    elif cuda:
        out = OOMMessage("cuda")
        _read_cuda(text[cuda[-1].start():], out)
    elif "MPS backend out of memory" in text:
        out = OOMMessage("mps")
        _read_mps(text[text.rindex("MPS backend out of memory"):], out)
    elif m := _find(r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory): you tried to "
                    r"allocate (\d+) ?(bytes|GB)", text):
        # "you tried to allocate %dGB. Buy new RAM!" (whole GiB) before pytorch/pytorch#20618
        out = OOMMessage("host", requested=int(m.group(1)) * (GiB if m.group(2) == "GB" else 1))
        if e := _find(r"Error code (\d+) \(([^)]*)\)", text):
            out.errno, out.error_text = int(e.group(1)), e.group(2)
    elif _find(r"NCCL", text) and _find(r"Cuda failure (?:\d+ )?'out of memory'", text):
        out = OOMMessage("nccl")
        if m := _find(r"NCCL version ([0-9][0-9.]*[0-9])", text):
            out.nccl_version = m.group(1)
        # include/alloc.h: "Failed to CUDA calloc %ld bytes" right after the CUDA failure
        if m := _find(r"Failed to CUDA (?:calloc|malloc) (\d+) bytes", text):
            out.requested = int(m.group(1))
    elif _find(r"CUDA error: out of memory", text):
        out = OOMMessage("cuda-runtime")
    elif _find(r"exits with return code = -9|MA [0-9.]+ GB Max_MA", text):
        out = OOMMessage("deepspeed")
    else:
        raise InputError(f"not an out-of-memory message (none of: CUDA's 'out of memory. Tried "
                         f"to allocate', 'MPS backend out of memory', 'DefaultCPUAllocator', NCCL's "
                         f"'Cuda failure 'out of memory'', 'CUDA error: out of memory', DeepSpeed's "
                         f"'exits with return code = -9'): {message[:120]!r}")
    _read_deepspeed(text, out)
    return out


def read_oom(message: str) -> dict[str, int]:
    """The sizes in an out-of-memory message, in bytes: :meth:`OOMMessage.sizes` of
    :func:`parse_oom`, for a message that asked for a size.

    From a real CUDA OOM (either era): ``requested`` (the block asked for), ``total`` and
    ``free`` (the card, as the driver sees it), ``process`` (this process, PyTorch or not),
    ``allowed`` (the cap of ``set_per_process_memory_fraction``), ``allocated`` (live tensors)
    and ``reserved_unallocated`` (cached by the allocator, not handed out). From MPS:
    ``requested``, ``allocated``, ``other_allocations`` and ``allowed``. From memlab's
    simulated device: ``requested``, ``in_use``, ``budget`` and ``short``. From the host
    allocator: ``requested``. Raises InputError when the message is none of these.
    """
    parsed = parse_oom(message)
    if parsed.requested is None:
        raise InputError(f"not an out-of-memory message with a size (no 'Tried to allocate'): "
                         f"{message[:120]!r}")
    return parsed.sizes()


def requested_bytes(message: str) -> int:
    """The bytes an allocator's OOM message says it tried to allocate (:func:`read_oom`'s
    ``requested``), or 0 when the message has none."""
    try:
        return read_oom(message)["requested"]
    except InputError:
        # a fragment of a message ("Tried to allocate 20.00 MiB (GPU 0)") still names its size
        m = re.search(r"[Tt]ried to allocate " + _SIZE, message) if isinstance(message, str) else None
        return _bytes(m.group(1)) if m else 0


# --------------------------------------------------------------------------------------
# Real messages shipped as package data (data/oom_messages/), and their arithmetic
# --------------------------------------------------------------------------------------
OOM_MESSAGE_DIR = ("data", "oom_messages")  # under the package: <name>.txt, "# key: value" header lines


@dataclass(frozen=True)
class RecordedOOM:
    """A real out-of-memory message copied verbatim from a public thread: ``text`` as printed,
    ``source`` (the thread's address), ``card`` (the GPU it ran on, as the thread names it)."""

    name: str
    source: str
    card: str
    text: str

    @property
    def message(self) -> OOMMessage:
        """The message's numbers (:func:`parse_oom`)."""
        return parse_oom(self.text)


def recorded_oom_names() -> list[str]:
    """The names of the shipped messages (``data/oom_messages/<name>.txt``), sorted."""
    folder = resources.files("memlab").joinpath(*OOM_MESSAGE_DIR)
    return sorted(f.name[:-4] for f in folder.iterdir() if f.name.endswith(".txt"))


def recorded_oom(name: str = "a100-40gb-inference") -> RecordedOOM:
    """A shipped real OOM message: its header lines (``# source: ...``, ``# card: ...``) and
    the message below them, verbatim.

    Args:
        name: one of :func:`recorded_oom_names`.

    Returns:
        The message and where it comes from.

    Raises:
        InputError: an unknown name (the message lists the shipped ones).
    """
    names = recorded_oom_names()
    if name not in names:
        raise InputError(f"no recorded OOM message {name!r}; shipped: {', '.join(names)}")
    raw = resources.files("memlab").joinpath(*OOM_MESSAGE_DIR, f"{name}.txt").read_text()
    header, body = {}, []
    for line in raw.splitlines():
        if not body and line.startswith("#"):
            key, _, value = line[1:].partition(":")
            header[key.strip()] = value.strip()
        else:
            body.append(line)
    return RecordedOOM(name, header.get("source", ""), header.get("card", ""), "\n".join(body).strip())


@dataclass(frozen=True)
class OOMBalance:
    """The arithmetic of a 2.1+ CUDA message: why the request did not fit, and where the
    card's memory was.

    ``used`` is the card's memory in use as the driver saw it (``total - free``); ``accounted``
    what the message attributes: this process (PyTorch's ``allocated`` and
    ``reserved_unallocated``, and ``non_pytorch``: CUDA context, cuBLAS, NCCL) plus the other
    processes it lists. The two agree to within ``rounding``, the most the printed figures'
    rounding can move their difference. ``short`` is how much more than ``free`` was asked for.
    """

    requested: int
    free: int
    used: int
    allocated: int
    reserved_unallocated: int
    non_pytorch: int
    other_processes: int
    rounding: int

    @property
    def accounted(self) -> int:
        return self.allocated + self.reserved_unallocated + self.non_pytorch + self.other_processes

    @property
    def short(self) -> int:
        return self.requested - self.free

    @property
    def fits_with_cache(self) -> bool:
        """Whether the request fits the free memory plus PyTorch's unused cache: what
        ``expandable_segments:True`` could at best add (it remaps the cache's free pages)."""
        return self.requested <= self.free + self.reserved_unallocated


def oom_balance(message: str | OOMMessage) -> OOMBalance:
    """The arithmetic of a CUDA OOM message of torch 2.1 or later ("GPU 0 has a total capacity
    of ... of which ... is free. Including non-PyTorch memory, this process has ...").

    Args:
        message: the text, or :func:`parse_oom`'s reading of it.

    Returns:
        The balance of the card's memory at the failure.

    Raises:
        InputError: the message lacks a figure the balance needs (older formats print no
            per-process figure, some builds no "this process").
    """
    m = message if isinstance(message, OOMMessage) else parse_oom(message)
    need = ("requested", "total", "free", "allocated", "reserved_unallocated", "process")
    missing = [n for n in need if getattr(m, n) is None]
    if m.kind != "cuda" or missing:
        raise InputError(f"a balance needs a CUDA message of torch 2.1+ with {', '.join(need)}; "
                         f"this {m.kind} message lacks {', '.join(missing) or 'the CUDA format'}")
    # printed: total, free, this process and each other process; allocated and the cache are
    # inside this process's figure
    rounding = ROUNDING_BYTES * (3 + len(m.other_processes))
    return OOMBalance(m.requested, m.free, m.total - m.free, m.allocated, m.reserved_unallocated,
                      m.process - m.reserved, m.other_bytes, rounding)


# --------------------------------------------------------------------------------------
# What the numbers mean
# --------------------------------------------------------------------------------------
#: The causes :func:`explain_oom` names, most specific first.
CAUSES = ("request above the card", "memory fraction", "shared GPU memory", "other processes",
          "held outside PyTorch", "outside the allocator", "fragmentation", "live tensors",
          "mps watermark", "mps memory", "host memory", "host killed", "nccl buffers",
          "simulated budget")


@dataclass
class OOMExplanation:
    """What an out-of-memory message means: ``cause`` (one of :data:`CAUSES`), the reading
    of each number (``lines``) and what to try (``advice``)."""

    message: OOMMessage
    cause: str
    lines: list[str]
    advice: list[str]

    def table(self) -> str:
        """The explanation as text, for a terminal or a notebook."""
        m = self.message
        era = m.torch_versions or m.era
        head = f"out of memory ({m.kind}{', torch ' + era + ' format' if era else ''}): {self.cause}"
        out = [head] + [f"  {line}" for line in self.lines]
        if self.advice:
            out += ["what to try:"] + [f"  - {a}" for a in self.advice]
        out += [f"note: {n}" for n in m.notes]
        return "\n".join(out)

    def to_dict(self) -> dict:
        return {"cause": self.cause, "lines": list(self.lines), "advice": list(self.advice),
                "message": asdict(self.message)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        return self.table()


def _fb(n: int | None) -> str:
    return "?" if n is None else fmt_bytes(n)


def _versions_advice(m: OOMMessage) -> str:
    """Expandable segments by torch version: added by pytorch/pytorch#96995 (merged April 2023,
    after 2.0), so first released in 2.1, whose message still suggested max_split_size_mb."""
    if m.torch_versions in ("< 1.5", "1.5 to 2.0"):
        return ("this message's format is torch's before 2.1, which predates expandable segments: "
                "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128 keeps large blocks unsplit, or "
                "upgrade to 2.1+ for expandable_segments:True")
    if m.torch_versions == "2.1":
        return ("torch 2.1 (its message still names max_split_size_mb) already has expandable "
                "segments: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, set before CUDA starts")
    return ("set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (before CUDA starts) so the "
            "cache's free pages can be remapped")


def _explain_cuda(m: OOMMessage, lines: list[str], advice: list[str]) -> str:  # noqa: C901 one branch per line of the explanation
    """A CUDA OOM message explained: its figures appended to ``lines``, what to try to
    ``advice``; returns the cause.

    Over 80 lines because it writes the explanation's lines in the order a reader checks them
    (the card, PyTorch's cache, the request, the cause), one line each.
    """
    req = m.requested or 0
    seg = m.segment or 0
    if m.total is not None:
        lines.append(f"GPU {'' if m.device is None else m.device}: {_fb(m.total)} in all, "
                     f"{_fb(m.free)} free as the driver saw it")
    if m.allocated is not None:
        lines.append(f"live tensors (allocated by PyTorch): {_fb(m.allocated)}")
    if m.reserved_unallocated is not None:
        lines.append(f"cached by PyTorch but not in use (reserved, unallocated): "
                     f"{_fb(m.reserved_unallocated)}, of {_fb(m.reserved)} reserved")
    if m.non_pytorch:
        lines.append(f"this process outside PyTorch's cache (CUDA context, cuBLAS, NCCL): {_fb(m.non_pytorch)}")
    if m.other_processes:
        own = [b for _, b in m.other_processes if m.reserved is not None and b >= m.reserved]
        lines.append(f"other processes: {_fb(m.other_bytes)} in {len(m.other_processes)} process(es)"
                     + (" (one of them may be this one, seen under another pid in a container)"
                        if own and m.process is None else ""))
    elif (held := m.held_outside) is not None and held >= 256 * MiB and not m.beyond_card:
        if m.process is not None:
            lines.append(f"held outside this process: {_fb(held)} (total - free - this process: other processes)")
        else:
            lines.append(f"held outside PyTorch's cache: {_fb(held)} (total - free - reserved: this process's "
                         f"CUDA context and libraries, the desktop, other processes)")
    why = ("requests up to 1 MiB share 2 MiB segments" if seg == _SMALL_BUFFER
           else "requests of 1 to 10 MiB get a 20 MiB segment")
    lines.append(f"the request: {_fb(req)}" + (
        f"; with no cached block to serve it the allocator asks the driver for a {_fb(seg)} segment"
        f" ({why}: CUDACachingAllocator.cpp)" if seg in (_SMALL_BUFFER, _LARGE_BUFFER) and seg > req else ""))
    if m.beyond_card:
        lines.append(f"PyTorch holds {_fb(max(m.allocated or 0, m.reserved or 0))}, more than the card's "
                     f"{_fb(m.total)}: Windows' WDDM driver lets CUDA spill into shared GPU memory (system "
                     f"RAM over PCIe), so the card itself was full long before this request")
    # The allocator has already returned every wholly free cached segment to the driver and
    # retried (CUDACachingAllocator.cpp, before the message): what it still caches sits in
    # segments that also hold live tensors.
    cache = m.reserved_unallocated or 0
    if m.total is not None and req > m.total:
        advice.append(f"the request alone ({_fb(req)}) is larger than the whole card ({_fb(m.total)}): no "
                      f"setting or freed cache serves it. One tensor that size is a shape, batch or "
                      f"resolution mistake, or an operation to chunk (attention over a long sequence: a "
                      f"memory-efficient kernel; an image: tiles)")
        return "request above the card"
    if m.allowed is not None and m.reserved is not None:
        lines.append(f"the memory fraction allows this process {_fb(m.allowed)}; PyTorch holds "
                     f"{_fb(m.reserved)}, the request would make {_fb(m.reserved + req)}")
        if m.free is not None and m.free >= req:
            advice.append(f"the card had {_fb(m.free)} free: the cap of "
                          f"set_per_process_memory_fraction refused the request; raise the fraction "
                          f"or fit the step under {_fb(m.allowed)}")
            if m.allocated + req <= m.allowed and cache >= req:
                advice.append("within the cap the request fits the cached bytes: "
                              "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
            return "memory fraction"
    if m.beyond_card:
        advice.append(f"the step needs more than the card's {_fb(m.total)}; shared memory only postponed "
                      f"the failure and is many times slower than the card's own: make the step smaller "
                      f"(batch, resolution, sequence, activation checkpointing, 16-bit weights, offload); "
                      f"`memlab estimate` says by how much")
        return "shared GPU memory"
    others = [(pid, b) for pid, b in m.other_processes]
    if m.process is None and m.reserved and any(b >= m.reserved for _, b in others):
        # NVML lists host pids; in a container this process is listed under one it does not
        # know as its own. The entry that holds at least PyTorch's cache is taken to be it.
        # the smallest entry that still holds PyTorch's cache: the cache plus a CUDA context
        own = min((e for e in others if e[1] >= m.reserved), key=lambda e: e[1])
        others.remove(own)
        lines.append(f"process {own[0]} ({_fb(own[1])}) is taken to be this one: it holds at least "
                     f"PyTorch's {_fb(m.reserved)}")
    held = sum(b for _, b in others)
    if others and m.total and held >= max(req, m.total // 10):
        sizes = {b for _, b in others}
        advice.append(f"{len(others)} other process(es) hold {_fb(held)} of this card: stop them or "
                      f"use another GPU (CUDA_VISIBLE_DEVICES)")
        if len(others) > 1 and len(sizes) <= 2 and max(sizes) < GiB * 3 // 2:
            advice.append("many processes with the same small amount look like CUDA contexts: every "
                          "rank started CUDA on this GPU; call torch.cuda.set_device(local_rank) "
                          "before any CUDA work")
        return "other processes"
    if m.free is not None and m.allowed is None and m.free >= seg + DRIVER_SLACK:
        advice.append(f"the driver reported {_fb(m.free)} free, more than the {_fb(seg)} segment: it was "
                      f"taken between the failed cudaMalloc and the report (another process), or it "
                      f"cannot be allocated (Windows WDDM, MIG): check nvidia-smi")
        return "outside the allocator"
    outside = m.held_outside
    short = seg - (m.free or 0)
    if (not m.other_processes and outside is not None and m.total
            and outside >= max(short, m.total // 4, GiB)):
        # a quarter of the card or more, beyond what one CUDA context takes: someone else's
        if m.process is not None:
            advice.append(f"{_fb(outside)} of the card is in use by other processes (the card's total "
                          f"minus this process minus free; the driver did not list them): check "
                          f"nvidia-smi, stop them or use another GPU")
            return "other processes"
        advice.append(f"{_fb(outside)} of the card is held outside PyTorch's cache: other processes (check "
                      f"nvidia-smi), or this process's own non-PyTorch memory (another framework, a "
                      f"library's cudaMalloc); PyTorch itself reserved only {_fb(m.reserved)}")
        return "held outside PyTorch"
    # "If reserved but unallocated memory is large" (the message's own words): large enough
    # to hold the request, and a tenth of the cache or more. A sliver that happens to exceed
    # a small request is not why a card full of live tensors failed.
    if cache >= req and cache * 10 >= (m.reserved or 0):
        advice.append(f"{_fb(cache)} is cached but split between live tensors, no piece large enough "
                      f"for {_fb(req)}: fragmentation. " + _versions_advice(m))
        return "fragmentation"
    if cache >= req:
        advice.append(f"expandable_segments:True would serve this request from the {_fb(cache)} cached, "
                      f"but live tensors fill {100 * (m.allocated or 0) / (m.total or 1):.0f}% of the card: "
                      f"the next request would fail")
    advice.append(f"live tensors and the request need {_fb((m.allocated or 0) + req)} where PyTorch could "
                  f"hold at most {_fb((m.reserved or 0) + (m.free or 0))} of the card: make the step smaller "
                  f"(batch, sequence, activation checkpointing, bf16, a sharded or 8-bit optimizer); "
                  f"`memlab estimate` says by how much")
    if m.zero3_gather:
        advice.append("the failure is in ZeRO-3 gathering parameters: lower stage3_max_live_parameters "
                      "and stage3_prefetch_bucket_size, or offload parameters (offload_param)")
    return "live tensors"


def _explain_mps(m: OOMMessage, lines: list[str], advice: list[str]) -> str:
    """MPSAllocator.mm: the OOM is raised when the allocation would pass the high watermark
    (``max allowed``), or when Metal itself returned no buffer."""
    req, a, o = m.requested or 0, m.allocated or 0, m.other_allocations or 0
    lines.append(f"Apple GPU (MPS): PyTorch's MPS allocator holds {_fb(a)}, other Metal allocations of "
                 f"this process {_fb(o)}, the request {_fb(req)} ({m.pool or '?'} pool)")
    if o > a:
        lines.append("other allocations exceed PyTorch's own: Metal buffers made outside PyTorch's "
                     "allocator in this process (another framework, MPSGraph's own buffers)")
    if m.allowed is None:
        advice.append("no watermark is set (PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0): Metal itself found "
                      "no memory; the Mac's unified memory is shared with every app: make the step smaller")
        return "mps memory"
    working = int(m.allowed / MPS_HIGH_WATERMARK_DEFAULT)
    lines.append(f"max allowed {_fb(m.allowed)} = PYTORCH_MPS_HIGH_WATERMARK_RATIO (default "
                 f"{MPS_HIGH_WATERMARK_DEFAULT}) x the GPU's recommendedMaxWorkingSetSize, so with the "
                 f"default ratio that working set is {_fb(working)}: a share of the Mac's unified memory, "
                 f"which is larger")
    if a + o + req > m.allowed:
        advice.append(f"{_fb(a)} + {_fb(o)} + the {_fb(req)} asked make {_fb(a + o + req)}, above the "
                      f"{_fb(m.allowed)} cap: the step needs more than this Mac lets the GPU use. Make it "
                      f"smaller; PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 lifts the cap but the system may swap "
                      f"or fail (the message's own warning)")
        return "mps watermark"
    advice.append("below the cap, Metal itself returned no buffer: other apps hold the unified memory, "
                  "or no contiguous piece was left; close them or make the step smaller")
    return "mps memory"


def explain_oom(message: str | OOMMessage) -> OOMExplanation:
    """What an out-of-memory message means, number by number.

    Reads the message (:func:`parse_oom`) and names the cause: a request larger than the whole
    card; a memory fraction's cap that refused a request the card had room for; allocations
    above the card's total (Windows' shared GPU memory); other processes on the card, listed or
    not (the card's total minus this process minus free); free memory the driver reported but
    would not hand out (compared with the segment the request needs: 20 MiB for 1 to 10 MiB);
    a cache too fragmented to serve the request although it holds enough bytes (the
    ``expandable_segments`` hint, by torch version); live tensors that need more than the card;
    Apple's MPS watermark; the host's RAM; the host's OOM killer (DeepSpeed's return code -9);
    NCCL's buffers, allocated outside PyTorch's cache.

    Args:
        message: the message or traceback text, or an already parsed :class:`OOMMessage`.
    Returns:
        an :class:`OOMExplanation`; ``str()`` of it prints it.
    """
    m = message if isinstance(message, OOMMessage) else parse_oom(message)
    lines: list[str] = []
    advice: list[str] = []
    if m.kind == "cuda":
        cause = _explain_cuda(m, lines, advice)
    elif m.kind == "mps":
        cause = _explain_mps(m, lines, advice)
    elif m.kind == "simulated":
        lines.append(f"memlab's simulated device: {_fb(m.in_use)} in use, budget {_fb(m.budget)}, "
                     f"the request {_fb(m.requested)} left it {_fb(m.short)} short")
        cause = "simulated budget"
        advice.append("the report's oom.by_category names what held the budget")
    elif m.kind == "host":
        lines.append(f"the host allocator (DefaultCPUAllocator) could not get {_fb(m.requested)}"
                     + (f": errno {m.errno} ({m.error_text})" if m.errno is not None else ""))
        cause = "host memory"
        if m.requested is not None and m.requested >= 2**50:
            advice.append("over a PiB: a shape or dtype mistake, not a small machine")
        else:
            advice.append("host RAM (or the job's cgroup or ulimit) ran out: CPU offload, pinned "
                          "buffers, data-loader workers and a full model loaded on every rank all live here")
    elif m.kind == "nccl":
        lines.append("NCCL asked CUDA for its buffers and CUDA had none: NCCL allocates outside "
                     "PyTorch's caching allocator, so memory PyTorch caches is not free for it"
                     + (f"; the failed cudaMalloc was for {_fb(m.requested)}" if m.requested else ""))
        cause = "nccl buffers"
        advice.append("leave headroom for NCCL (its buffers are per peer and channel: NCCL_BUFFSIZE, "
                      "NCCL_MAX_NCHANNELS), call torch.cuda.empty_cache() before the first collective, "
                      "or make the step smaller")
    elif m.kind == "cuda-runtime":
        lines.append("CUDA itself refused memory outside PyTorch's caching allocator (the CUDA context, "
                     "cuBLAS/cuDNN workspaces, a library's own cudaMalloc)")
        cause = "outside the allocator"
        advice.append("check nvidia-smi for other processes; set CUDA_LAUNCH_BLOCKING=1 to see the call")
    else:
        cause = "host killed"
    if m.ds_allocated is not None:
        lines.append(f"DeepSpeed's last see_memory_usage: {_fb(m.ds_allocated)} allocated "
                     f"(max {_fb(m.ds_max_allocated)}), {_fb(m.ds_reserved)} reserved (max {_fb(m.ds_max_reserved)})")
    if m.host_used is not None:
        lines.append(f"host memory in use then: {_fb(m.host_used)} ({m.host_percent:g}% of the machine)")
    if m.return_code is not None:
        lines.append(f"the launcher saw a rank exit with return code {m.return_code}"
                     + (" (SIGKILL: the kernel's OOM killer, when host RAM runs out)" if m.return_code == -9 else ""))
        if m.return_code == -9 and m.kind == "deepspeed":
            advice.append("host RAM ran out, not GPU memory: every rank loading the whole model, "
                          "offload_optimizer/offload_param to the CPU and pinned memory all count; "
                          "check `dmesg | grep -i oom`, load with low_cpu_mem_usage, offload less, or "
                          "use offload to NVMe")
    return OOMExplanation(m, cause, lines, advice)


def last_exception_text() -> str:
    """The last uncaught exception of this interpreter, with its traceback, as text: what a
    notebook or REPL just printed (``sys.last_exc``, or ``sys.last_value`` before Python 3.12;
    IPython sets both). Raises InputError when nothing has failed yet."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if exc is None:
        raise InputError("no exception has reached the top level of this interpreter yet: "
                         "run the failing cell first, or pass the message")
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def explain_last() -> OOMExplanation:
    """:func:`explain_oom` of the last traceback of this notebook or REPL."""
    return explain_oom(last_exception_text())


# --------------------------------------------------------------------------------------
# Fragmentation, provoked on purpose (CUDA only)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fragmentation:
    """One provoked fragmentation run (:func:`fragment_once`, :func:`fragmentation`)."""

    expandable: bool
    """Whether ``PYTORCH_CUDA_ALLOC_CONF`` had ``expandable_segments:True``."""
    cap_bytes: int
    """The per-process cap set on the GPU."""
    request_bytes: int
    """The request made after the holes were left."""
    allocated_before: int
    """``torch.cuda.memory_allocated`` before the request (the pieces kept)."""
    reserved_before: int
    """``torch.cuda.memory_reserved`` before the request."""
    fits: bool
    """Whether the request was served."""
    oom: str | None
    """The OOM message's first line when it was not (``None`` when it fits)."""
    reserved_after: int
    """``torch.cuda.memory_reserved`` after the request."""


def fragment_once(big_mib: int = 1024, piece_mib: int = 60, request_mib: int = 200,
                  cap_mib: int = 1100) -> Fragmentation:
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
    allocated, reserved = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
    oom = None
    try:
        extra = torch.empty(request_mib * MiB, **u8)
        del extra
    except torch.OutOfMemoryError as e:
        oom = str(e).split("\n")[0]
    return Fragmentation(expandable="expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                         cap_bytes=cap_mib * MiB, request_bytes=request_mib * MiB, allocated_before=allocated,
                         reserved_before=reserved, fits=oom is None, oom=oom,
                         reserved_after=torch.cuda.memory_reserved(dev))


def fragmentation(expandable: bool, timeout: float = 120.0, **sizes) -> Fragmentation:
    """:func:`fragment_once` in a fresh Python process, with or without
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (read when CUDA starts, so it needs
    its own process; the notebook's allocator stays as it is)."""
    env = dict(os.environ)
    conf = [c for c in env.get("PYTORCH_CUDA_ALLOC_CONF", "").split(",")
            if c and not c.startswith("expandable_segments")]
    env["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(conf + [f"expandable_segments:{expandable}"])
    args = [sys.executable, "-m", "memlab.tracking.oom_messages", "fragment"]
    for key, value in sizes.items():
        args += [f"--{key.replace('_', '-')}", str(int(value))]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the fragmentation run failed: {done.stderr.strip()[-600:]}")
    return Fragmentation(**json.loads(done.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m memlab.tracking.oom_messages",
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
        print(f"memlab.tracking.oom_messages: {e}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(out)))  # the line fragmentation() reads back
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["CAUSES", "DRIVER_SLACK", "KINDS", "MPS_HIGH_WATERMARK_DEFAULT", "OOMBalance", "OOMExplanation",
           "OOMMessage", "OOM_MESSAGE_DIR", "Fragmentation", "ROUNDING_BYTES", "RecordedOOM", "explain_last",
           "explain_oom",
           "fragment_once", "fragmentation", "last_exception_text", "oom_balance", "parse_oom", "read_oom",
           "recorded_oom", "recorded_oom_names", "requested_bytes", "segment_bytes"]
