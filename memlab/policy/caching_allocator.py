"""The CUDA caching allocator's blocks: what ``torch.cuda.max_memory_allocated`` counts.

``max_memory_allocated`` is the peak of the allocator's ``allocated_bytes``, which grows by
the size of the *block* handed out, not by the bytes asked for. The rules, from
``c10/cuda/CUDACachingAllocator.cpp`` (torch 2.x, default ``PYTORCH_CUDA_ALLOC_CONF``):

* ``round_size``: a request is rounded up to a multiple of ``kMinBlockSize`` (512 B), at
  least 512 B; a request of 0 bytes gets no block.
* ``get_pool``: requests of at most ``kSmallSize`` (1 MiB) come from the small pool, the
  rest from the large pool; the pools never share blocks.
* ``get_free_block``: the smallest cached free block of the pool that fits (ties: the
  lowest address, ``BlockComparatorSize``).
* ``get_allocation_size``: without one, a new segment from the driver: ``kSmallBuffer``
  (2 MiB) for the small pool, ``kLargeBuffer`` (20 MiB) for requests under
  ``kMinLargeAlloc`` (10 MiB), else the request rounded up to ``kRoundLarge`` (2 MiB).
* ``should_split``: the block is split when what remains is at least ``kMinBlockSize``
  (small pool) or more than ``kSmallSize`` (large pool); otherwise the request gets the
  whole block and ``alloc_found_block`` counts all of it as allocated. So a large request
  may hold up to 1 MiB more than it asked for, depending on which cached block it finds.
* ``free_block`` / ``try_merge_blocks``: a freed block merges with its free neighbours in
  the same segment and goes back to its pool (cached, still reserved).

Which cached block a request finds depends on every allocation and free before it, so the
rule cannot be a per-tensor formula: :class:`CachingAllocator` replays a step's sequence
of allocations and frees (the simulation's tracker log) through these rules. What a
closed-form estimate can use is :func:`fresh_block_bytes`, the block of a request served
by a new segment.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterable

kMinBlockSize = 512            # all sizes are rounded to at least 512 bytes
kSmallSize = 1 << 20           # largest "small" allocation is 1 MiB
kSmallBuffer = 2 << 20         # "small" allocations are packed in 2 MiB blocks
kLargeBuffer = 20 << 20        # "large" allocations may be packed in 20 MiB blocks
kMinLargeAlloc = 10 << 20      # allocations between 1 and 10 MiB may use kLargeBuffer
kRoundLarge = 2 << 20          # round up large allocations to 2 MiB


def round_size(nbytes: int) -> int:
    """``round_size``: the request rounded up to a multiple of 512 bytes (0 stays 0: no block)."""
    if nbytes <= 0:
        return 0
    return kMinBlockSize if nbytes < kMinBlockSize else -(-nbytes // kMinBlockSize) * kMinBlockSize


def allocation_size(nbytes: int) -> int:
    """``get_allocation_size``: the segment a request asks the driver for when no cached
    block fits (``nbytes`` already rounded)."""
    if nbytes <= kSmallSize:
        return kSmallBuffer
    if nbytes < kMinLargeAlloc:
        return kLargeBuffer
    return -(-nbytes // kRoundLarge) * kRoundLarge


def should_split(block_bytes: int, nbytes: int) -> bool:
    """``should_split``: whether a block of ``block_bytes`` serving ``nbytes`` is split."""
    remaining = block_bytes - nbytes
    if nbytes <= kSmallSize:
        return remaining >= kMinBlockSize
    return remaining > kSmallSize


def fresh_block_bytes(nbytes: int) -> int:
    """Bytes ``allocated_bytes`` counts for a request served by a new segment: the rounded
    request, or the whole segment when the rest is too small to split off."""
    n = round_size(nbytes)
    if n == 0:
        return 0
    segment = allocation_size(n)
    return n if should_split(segment, n) else segment


class _Block:
    __slots__ = ("size", "addr", "prev", "next", "free", "small")


class CachingAllocator:
    """The caching allocator's bookkeeping for one device and one stream, no device memory:
    :meth:`malloc` and :meth:`free` follow the module's rules and keep ``allocated``,
    ``peak_allocated`` and ``reserved`` as ``torch.cuda.memory_stats`` would."""

    def __init__(self):
        self._free = {True: [], False: []}    # per pool (small?): sorted (size, addr, block)
        self._next_addr = 0
        self.allocated = 0
        self.peak_allocated = 0
        self.reserved = 0
        # library workspaces (cuBLAS): made once per process, kept across steps and models
        self.workspaces: list[_Block] = []

    def reset_peak(self) -> None:
        self.peak_allocated = self.allocated

    def _insert(self, b: _Block) -> None:
        pool = self._free[b.small]
        pool.insert(bisect.bisect_left(pool, (b.size, b.addr)), (b.size, b.addr, b))

    def _remove(self, b: _Block) -> None:
        pool = self._free[b.small]
        del pool[bisect.bisect_left(pool, (b.size, b.addr))]

    def malloc(self, nbytes: int) -> _Block | None:
        """A block for a request of ``nbytes`` (``None`` for 0 bytes)."""
        n = round_size(nbytes)
        if n == 0:
            return None
        small = n <= kSmallSize
        pool = self._free[small]
        i = bisect.bisect_left(pool, (n, -1))
        if i < len(pool):
            b = pool.pop(i)[2]
        else:
            b = _Block()
            b.size, b.addr, b.prev, b.next, b.small = allocation_size(n), self._next_addr, None, None, small
            self._next_addr += b.size + kSmallBuffer   # segments are never adjacent
            self.reserved += b.size
        if should_split(b.size, n):
            rest = _Block()
            rest.size, rest.addr, rest.small, rest.free = b.size - n, b.addr + n, small, True
            rest.prev, rest.next = b, b.next
            if b.next is not None:
                b.next.prev = rest
            b.next, b.size = rest, n
            self._insert(rest)
        b.free = False
        self.allocated += b.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return b

    def free(self, b: _Block | None) -> None:
        """Return a block to its pool, merged with its free neighbours."""
        if b is None:
            return
        self.allocated -= b.size
        b.free = True
        for other in (b.prev, b.next):
            if other is not None and other.free:
                self._remove(other)
                if other is b.prev:
                    b.addr, b.prev = other.addr, other.prev
                    if other.prev is not None:
                        other.prev.next = b
                else:
                    b.next = other.next
                    if other.next is not None:
                        other.next.prev = b
                b.size += other.size
        self._insert(b)


def replay_steady_step(held: Iterable[tuple[int, int, str]],
                       step: list[tuple[str, int, int]],
                       allocator: CachingAllocator | None = None) -> CachingAllocator:
    """``max_memory_allocated`` of a steady-state step, replayed through the allocator.

    ``held``: ``(key, nbytes, category)`` for what exists before the step and stays
    (parameters, optimizer state, the batch, library workspaces); a real run creates the
    ``optimizer`` state lazily, in its first optimizer step, out of the blocks its first
    forward and backward freed. ``step``: the step's events in order, ``("alloc", key,
    nbytes)``, ``("free", key, 0)`` and ``(phase, -1, 0)`` where a phase begins
    (:meth:`memlab.tracking.tracker.MemoryTracker.allocation_log`).
    The step is run twice, a warm-up that creates the lazy state then the step measured
    from the cache the warm-up left; frees of held keys (the tracker's teardown) are
    ignored. Returns the allocator after it (``peak_allocated``: the measured step's peak).

    ``allocator``: the caching allocator of the process the step runs in, holding the cache
    its earlier steps left (default: a fresh process). Which cached block each request finds
    depends on that history, so the same step can peak higher in a process that ran others
    first. After the step its tensors are freed, as when a trainer is dropped: the allocator
    keeps its cache and the library workspaces (``workspace`` in ``held``, made once per
    process and reused by the next step) for the next call.
    """
    alloc = CachingAllocator() if allocator is None else allocator
    held = list(held)
    keep = {key for key, _, _ in held}
    spare = list(alloc.workspaces)
    live: dict[int, _Block | None] = {}
    for key, n, cat in held:
        if cat == "workspace":
            same = next((b for b in spare if b.size == round_size(n)), None)
            if same is None:
                same = alloc.malloc(n)
                alloc.workspaces.append(same)
            else:
                spare.remove(same)
            continue
        if cat != "optimizer":
            live[key] = alloc.malloc(n)
    lazy = [(key, n) for key, n, cat in held if cat == "optimizer"]

    def run(create_lazy: bool) -> None:
        for kind, key, n in step:
            if kind == "optimizer":
                if create_lazy:
                    for k, size in lazy:
                        live[k] = alloc.malloc(size)
                    create_lazy = False
            elif kind == "alloc":
                if key in live:
                    alloc.free(live.pop(key))
                live[key] = alloc.malloc(n)
            elif kind == "free" and key not in keep and key in live:
                alloc.free(live.pop(key))
        if create_lazy:  # a step with no optimizer ops (SGD without state) still makes none
            for k, size in lazy:
                live[k] = alloc.malloc(size)

    run(True)
    alloc.reset_peak()
    run(False)
    for block in live.values():
        alloc.free(block)
    return alloc


__all__ = ["CachingAllocator", "allocation_size", "fresh_block_bytes", "kMinBlockSize",
           "kSmallSize", "replay_steady_step", "round_size", "should_split"]
