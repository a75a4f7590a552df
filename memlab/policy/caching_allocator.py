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

With ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (:class:`CachingAllocator` with
``expandable=True``; the same file at pytorch/pytorch 001074d2, ``Note [Expandable Segments]``,
``find_expandable_block``, ``map_block``, ``try_allocate_expandable_block``, ``unmap_block``,
``release_blocks``):

* each pool is one segment per stream, a virtual address range mapped to physical memory in
  pages of ``kLargeBuffer`` (20 MiB, large pool) or ``kSmallBuffer`` (2 MiB, small pool);
* ``should_split``: any block with at least 512 bytes left over is split, in both pools, so
  ``allocated_bytes`` counts the rounded requests only;
* ``get_free_block``: the best fit among mapped free blocks, except that a block followed by
  unmapped space is ranked by the size it could grow to (so it is kept for large requests);
* without one, ``try_allocate_expandable_block``: the lowest address where free and unmapped
  blocks together hold the request (``find_expandable_block``); the pages it lacks are
  mapped (``map_block``), and ``reserved`` grows by whole pages;
* ``alloc_block`` refuses when ``reserved + get_allocation_size(request)`` exceeds the cap
  (``set_per_process_memory_fraction``), as without expandable segments; then
  ``release_cached_blocks`` runs: without expandable segments it returns only the cached
  segments with nothing split off (``release_block``), with them it unmaps every whole free
  page of every free block (``unmap_block``), holes between live tensors included, and the
  request is tried once more. Failing that: the out-of-memory error
  (:class:`AllocatorOutOfMemory`).

:func:`replay_fragmentation` runs lesson 02's fragmentation case
(:func:`memlab.tracking.oom_messages.fragment_once`) through both modes.

Which cached block a request finds depends on every allocation and free before it, so the
rule cannot be a per-tensor formula: :class:`CachingAllocator` replays a step's sequence
of allocations and frees (the simulation's tracker log) through these rules. What a
closed-form estimate can use is :func:`fresh_block_bytes`, the block of a request served
by a new segment.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from memlab.core.errors import InputError

kMinBlockSize = 512            # all sizes are rounded to at least 512 bytes
kSmallSize = 1 << 20           # largest "small" allocation is 1 MiB
kSmallBuffer = 2 << 20         # "small" allocations are packed in 2 MiB blocks
kLargeBuffer = 20 << 20        # "large" allocations may be packed in 20 MiB blocks
kMinLargeAlloc = 10 << 20      # allocations between 1 and 10 MiB may use kLargeBuffer
kRoundLarge = 2 << 20          # round up large allocations to 2 MiB
#: an expandable segment's address range: far beyond any card, never exhausted here
_ADDRESS_SPACE = 1 << 50


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
    __slots__ = ("size", "addr", "prev", "next", "free", "small", "mapped")


class AllocatorOutOfMemory(MemoryError):
    """The replayed allocator could not place a request under its cap (CUDA's OOM)."""

    def __init__(self, requested: int, allocated: int, reserved: int, cap: int):
        self.requested, self.allocated, self.reserved, self.cap = requested, allocated, reserved, cap
        super().__init__(f"out of memory: tried to allocate {requested} bytes with {allocated} allocated, "
                         f"{reserved} reserved ({reserved - allocated} reserved but unallocated), cap {cap}")


def _page(small: bool) -> int:
    """An expandable segment's page: 2 MiB in the small pool, 20 MiB in the large one."""
    return kSmallBuffer if small else kLargeBuffer


class CachingAllocator:
    """The caching allocator's bookkeeping for one device and one stream, no device memory:
    :meth:`malloc` and :meth:`free` follow the module's rules and keep ``allocated``,
    ``peak_allocated`` and ``reserved`` as ``torch.cuda.memory_stats`` would.

    Args:
        expandable: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (the module's rules).
        cap: the bytes ``set_per_process_memory_fraction`` allows (``None``: no cap); a request
            that cannot be placed under it raises :class:`AllocatorOutOfMemory`.
    """

    def __init__(self, expandable: bool = False, cap: int | None = None):
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
            raise InputError(f"cap={cap!r}; allowed: None or a positive number of bytes")
        self.expandable = bool(expandable)
        self.cap = cap
        self._free = {True: [], False: []}    # per pool (small?): sorted (size, addr, block)
        self._next_addr = 0
        self.allocated = 0
        self.peak_allocated = 0
        self.reserved = 0
        # library workspaces (cuBLAS): made once per process, kept across steps and models
        self.workspaces: list[_Block] = []
        # expandable segments: each pool's segment, one unmapped block behind a 0-byte head
        # that is never free (so it never merges, and the walk in address order starts there)
        self._head: dict[bool, _Block] = {}
        if self.expandable:
            for small in (True, False):
                head, space = _Block(), _Block()
                head.size, head.addr, head.prev, head.next, head.free, head.small, head.mapped = (
                    0, self._next_addr, None, space, False, small, True)
                space.size, space.addr, space.prev, space.next, space.free, space.small, space.mapped = (
                    _ADDRESS_SPACE, self._next_addr, head, None, True, small, False)
                self._head[small] = head
                self._next_addr += _ADDRESS_SPACE + kSmallBuffer

    def reset_peak(self) -> None:
        self.peak_allocated = self.allocated

    def _insert(self, b: _Block) -> None:
        pool = self._free[b.small]
        pool.insert(bisect.bisect_left(pool, (b.size, b.addr)), (b.size, b.addr, b))

    def _remove(self, b: _Block) -> None:
        pool = self._free[b.small]
        del pool[bisect.bisect_left(pool, (b.size, b.addr))]

    def malloc(self, nbytes: int) -> _Block | None:
        """A block for a request of ``nbytes`` (``None`` for 0 bytes).

        Raises:
            AllocatorOutOfMemory: under ``cap``, no block even after the cache was released.
        """
        n = round_size(nbytes)
        if n == 0:
            return None
        small = n <= kSmallSize
        b = self._best_fit(n, small)
        if b is None:
            b = self._alloc_block(n, small)
            if b is None:  # release_cached_blocks, then alloc_block once more
                self._release_cached()
                b = self._alloc_block(n, small)
            if b is None:
                raise AllocatorOutOfMemory(n, self.allocated, self.reserved, self.cap or 0)
        split = (b.size - n >= kMinBlockSize) if self.expandable else should_split(b.size, n)
        if split:
            rest = _Block()
            rest.size, rest.addr, rest.small, rest.free, rest.mapped = b.size - n, b.addr + n, small, True, True
            rest.prev, rest.next = b, b.next
            if b.next is not None:
                b.next.prev = rest
            b.next, b.size = rest, n
            self._insert(rest)
        b.free = False
        self.allocated += b.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return b

    def _best_fit(self, n: int, small: bool) -> _Block | None:
        """``get_free_block``: the smallest cached block that fits, taken out of its pool; with
        expandable segments a block followed by unmapped space ranks by what it could grow to."""
        pool = self._free[small]
        i = bisect.bisect_left(pool, (n, -1))
        if i >= len(pool):
            return None
        if self.expandable:
            def grows_to(b: _Block) -> int:
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)
            while i + 1 < len(pool) and grows_to(pool[i + 1][2]) < grows_to(pool[i][2]):
                i += 1
        return pool.pop(i)[2]

    def _alloc_block(self, n: int, small: bool) -> _Block | None:
        """``alloc_block``: a new segment (or, expandable, newly mapped pages); ``None`` past the cap."""
        if self.cap is not None and self.reserved + allocation_size(n) > self.cap:
            return None
        if self.expandable:
            return self._allocate_expandable(n, small)
        b = _Block()
        b.size, b.addr, b.prev, b.next, b.small, b.mapped = allocation_size(n), self._next_addr, None, None, small, True
        self._next_addr += b.size + kSmallBuffer   # segments are never adjacent
        self.reserved += b.size
        return b

    def _allocate_expandable(self, n: int, small: bool) -> _Block:
        """``try_allocate_expandable_block``: map what the lowest-address room lacks, merged
        into one free block, taken out of the pool."""
        c = self._head[small].next
        while c is not None:  # find_expandable_block: unmapped blocks in address order
            if not c.mapped:
                start = c.prev if c.prev is not None and c.prev.free else c
                room, cur = 0, start
                while cur is not None and cur.free and room < n:
                    room, cur = room + cur.size, cur.next
                if room >= n:
                    break
            c = c.next
        c = start
        if not c.mapped:
            c = self._map(c, min(c.size, n))
        while c.size < n:
            c = self._map(c.next, min(n - c.size, c.next.size))
        self._remove(c)
        return c

    def _map(self, b: _Block, nbytes: int) -> _Block:
        """``map_block``: back the first pages of unmapped ``b`` covering ``nbytes``; the block
        merges with its free mapped neighbours and joins the pool."""
        page = _page(b.small)
        mapped = -(-nbytes // page) * page
        if mapped < b.size:
            rest = _Block()
            rest.size, rest.addr, rest.small = b.size - mapped, b.addr + mapped, b.small
            rest.free, rest.mapped = True, False
            rest.prev, rest.next = b, b.next
            if b.next is not None:
                b.next.prev = rest
            b.next, b.size = rest, mapped
        b.mapped = True
        self.reserved += mapped
        b = self._merge(b)
        self._insert(b)
        return b

    def _release_cached(self) -> None:
        """``release_cached_blocks``: cached segments with nothing split off go back to the
        driver; with expandable segments every whole free page is unmapped instead."""
        for small in (True, False):
            for _, _, b in list(self._free[small]):
                if self.expandable:
                    self._unmap(b)
                elif b.prev is None and b.next is None:
                    self._remove(b)
                    self.reserved -= b.size

    def _unmap(self, b: _Block) -> None:
        """``unmap_block``: the whole pages inside free ``b`` unmapped; what is left of a page
        at either end stays a free mapped block."""
        page, base = _page(b.small), self._head[b.small].addr
        begin = -(-(b.addr - base) // page) * page + base
        end = (b.addr + b.size - base) // page * page + base
        if begin >= end:
            return
        self._remove(b)
        for lo, hi, keep in ((b.addr, begin, True), (end, b.addr + b.size, False)):
            if hi <= lo:
                continue
            part = _Block()
            part.size, part.addr, part.small, part.free, part.mapped = hi - lo, lo, b.small, True, True
            if keep:   # before b
                part.prev, part.next = b.prev, b
                if b.prev is not None:
                    b.prev.next = part
                b.prev = part
            else:      # after b
                part.prev, part.next = b, b.next
                if b.next is not None:
                    b.next.prev = part
                b.next = part
            self._insert(part)
        b.addr, b.size, b.mapped = begin, end - begin, False
        self.reserved -= b.size
        self._merge(b)

    def _merge(self, b: _Block) -> _Block:
        """``try_merge_blocks``: ``b`` absorbs free neighbours in the same mapping state."""
        for other in (b.prev, b.next):
            if other is None or not other.free or other.mapped != b.mapped:
                continue
            if other.mapped:
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
        return b

    def free(self, b: _Block | None) -> None:
        """Return a block to its pool, merged with its free neighbours."""
        if b is None:
            return
        self.allocated -= b.size
        b.free = True
        self._insert(self._merge(b))


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


@dataclass
class FragmentationReplay:
    """:func:`replay_fragmentation`'s figures, named as :func:`memlab.tracking.oom_messages.fragment_once`
    reports them from a GPU (bytes)."""

    expandable: bool
    fits: bool
    cap_bytes: int
    request_bytes: int
    allocated_before: int
    reserved_before: int
    reserved_after: int
    #: the allocator's refusal (``None`` when the request fits)
    oom: AllocatorOutOfMemory | None


def replay_fragmentation(expandable: bool, big_mib: int = 1024, piece_mib: int = 60,
                         request_mib: int = 200, cap_mib: int = 1100) -> FragmentationReplay:
    """The fragmentation case (:func:`memlab.tracking.oom_messages.fragment_once`, the same
    sizes) through the allocator's rules, with or without expandable segments: one
    ``big_mib`` block made and freed, carved into ``piece_mib`` pieces, every other one freed,
    then ``request_mib`` asked for under a cap of ``cap_mib``. No GPU needed."""
    for name, value in (("big_mib", big_mib), ("piece_mib", piece_mib), ("request_mib", request_mib),
                        ("cap_mib", cap_mib)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InputError(f"{name}={value!r}; allowed: a positive whole number of MiB")
    mib = 1 << 20
    a = CachingAllocator(expandable=expandable, cap=cap_mib * mib)
    a.free(a.malloc(big_mib * mib))
    pieces = [a.malloc(piece_mib * mib) for _ in range(big_mib // piece_mib)]
    for b in pieces[1::2]:
        a.free(b)
    allocated, reserved = a.allocated, a.reserved
    try:
        a.free(a.malloc(request_mib * mib))
        oom = None
    except AllocatorOutOfMemory as e:
        oom = e
    return FragmentationReplay(a.expandable, oom is None, cap_mib * mib, request_mib * mib, allocated,
                               reserved, a.reserved, oom)


__all__ = ["AllocatorOutOfMemory", "CachingAllocator", "FragmentationReplay", "replay_fragmentation",
           "allocation_size", "fresh_block_bytes", "kMinBlockSize",
           "kSmallSize", "replay_steady_step", "round_size", "should_split"]
