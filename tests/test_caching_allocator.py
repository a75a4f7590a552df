"""The CUDA caching allocator's block rules (memlab.policy.caching_allocator), case by case."""
import pytest

from memlab.core.errors import InputError
from memlab.policy.caching_allocator import (
    AllocatorOutOfMemory,
    CachingAllocator,
    fresh_block_bytes,
    replay_fragmentation,
    replay_steady_step,
    round_size,
    should_split,
)
from memlab.tracking.snapshot import load_snapshot

MiB = 2**20


def test_requests_round_to_512_byte_blocks():
    assert [round_size(n) for n in (0, 1, 512, 513)] == [0, 512, 512, 1024]


def test_a_large_block_is_split_only_when_more_than_1_mib_remains():
    assert not should_split(2 * MiB, 1 * MiB + 512)          # small remainder: whole block
    assert should_split(20 * MiB, 3 * MiB)
    assert should_split(2 * MiB, 1024)                       # small pool: any 512 B rest
    # gpt2-small's tied embedding (50257 x 768 fp32): a 148 MiB segment, 0.76 MiB left over
    wte = 50257 * 768 * 4
    assert fresh_block_bytes(wte) == 148 * MiB
    assert fresh_block_bytes(3 * MiB) == 3 * MiB             # carved from a 20 MiB segment


def test_freed_blocks_merge_and_are_reused_whole():
    a = CachingAllocator()
    x, y = a.malloc(3 * MiB), a.malloc(3 * MiB)
    a.free(x)
    a.free(y)
    assert (a.allocated, a.reserved) == (0, 20 * MiB)
    z = a.malloc(int(18.5 * MiB))    # the merged 20 MiB block, 1.5 MiB left: split
    assert a.allocated == int(18.5 * MiB)
    a.free(z)
    a.malloc(int(19.5 * MiB))        # 0.5 MiB left: the whole block is counted
    assert a.allocated == 20 * MiB and a.peak_allocated == 20 * MiB


def test_replay_measures_the_second_step():
    held = [(0, 4 * MiB, "parameters"), (1, 4 * MiB, "optimizer")]
    step = [("forward", -1, 0), ("alloc", 2, int(2.5 * MiB)), ("free", 2, 0),
            ("optimizer", -1, 0), ("alloc", 3, 2 * MiB), ("free", 3, 0),
            ("free", 0, 0)]                                  # teardown of a held key: ignored
    alloc = replay_steady_step(held, step)
    assert alloc.peak_allocated == 8 * MiB + int(2.5 * MiB)
    # the trainer is dropped after the step: nothing stays allocated, the segment stays cached
    assert (alloc.allocated, alloc.reserved) == (0, 20 * MiB)


def test_a_warm_process_hands_out_a_whole_block_a_fresh_one_splits():
    # Step A leaves [free 8 MiB][cuBLAS workspace 4 MiB][free 8 MiB] in one 20 MiB segment.
    proc = CachingAllocator()
    replay_steady_step([(0, 8 * MiB, "parameters"), (1, 4 * MiB, "workspace")], [], proc)
    assert (proc.allocated, proc.reserved) == (4 * MiB, 20 * MiB)   # the workspace stays
    # Step B's 7.5 MiB parameter: a fresh process carves it from a new segment's 16 MiB rest
    # (8.5 MiB left: split); the warm process's best fit is a cached 8 MiB block (0.5 MiB
    # left: not split), so max_memory_allocated reads 0.5 MiB more, and no segment is added.
    step_b = [(0, 4 * MiB, "workspace"), (1, int(7.5 * MiB), "parameters")]
    assert replay_steady_step(step_b, []).peak_allocated == int(11.5 * MiB)
    assert replay_steady_step(step_b, [], proc).peak_allocated == 12 * MiB
    assert (len(proc.workspaces), proc.reserved) == (1, 20 * MiB)


# --- expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) ---------------

def test_expandable_segments_split_every_block_and_map_20_mib_pages():
    a = CachingAllocator(expandable=True)
    x = a.malloc(int(19.5 * MiB))
    # one 20 MiB page mapped; the 0.5 MiB rest is split off (the default hands out all 20 MiB)
    assert (a.allocated, a.reserved) == (int(19.5 * MiB), 20 * MiB)
    a.malloc(3 * MiB)                      # 0.5 MiB free + 2.5 MiB more: a second page mapped
    assert (a.allocated, a.reserved) == (int(22.5 * MiB), 40 * MiB)
    a.free(x)
    assert a.reserved == 40 * MiB          # freed pages stay mapped (cached) until an OOM


def test_fragmentation_counted_both_ways():
    """Lesson 02's case by hand. Default: the freed 1 GiB segment serves 17 pieces of 60 MiB
    (4 MiB tail); with 8 freed, 9 x 60 = 540 MiB live, the segment is split so it cannot go back,
    and 1024 + 200 > 1100: OOM with 484 MiB reserved but unallocated. Expandable: 1024 MiB maps
    52 pages (1040 MiB); on the refusal the 8 holes (3 whole pages each) and the last page are
    unmapped, 540 + 200 = 740 MiB fits under the cap."""
    default, expandable = replay_fragmentation(False), replay_fragmentation(True)
    assert (default.fits, default.allocated_before, default.reserved_before) == (False, 540 * MiB, 1024 * MiB)
    assert default.oom.reserved - default.oom.allocated == 484 * MiB and default.reserved_after == 1024 * MiB
    assert (expandable.fits, expandable.allocated_before) == (True, 540 * MiB)
    assert (expandable.reserved_before, expandable.reserved_after) == (1040 * MiB, 740 * MiB)


def test_a_cap_refuses_a_new_segment_but_first_returns_whole_cached_ones():
    a = CachingAllocator(cap=24 * MiB)
    a.free(a.malloc(12 * MiB))             # a 12 MiB segment, cached whole
    a.malloc(16 * MiB)                     # 12 + 16 > 24: the cached segment goes back first
    assert a.reserved == 16 * MiB
    with pytest.raises(AllocatorOutOfMemory, match="tried to allocate"):
        a.malloc(16 * MiB)
    with pytest.raises(InputError, match="cap"):
        CachingAllocator(cap=-1)


def test_expandable_replay_of_the_h200_trace_counts_the_rounded_requests():
    """The reference step's trace (default allocator, H200) replayed: with expandable segments
    every block is split, so the peak is the running sum of the 512-byte-rounded requests,
    summed here from the trace alone; the default's whole blocks can only add to it."""
    trace = load_snapshot()["device_traces"][0]
    live, peak = 0, 0
    for ev in trace:
        if ev["action"] == "alloc":
            live += round_size(ev["size"])
        elif ev["action"] == "free_completed":
            live -= round_size(ev["size"])
        peak = max(peak, live)
    peaks = {}
    for expandable in (False, True):
        a, blocks = CachingAllocator(expandable=expandable), {}
        for ev in trace:
            if ev["action"] == "alloc":
                blocks[ev["addr"]] = a.malloc(ev["size"])
            elif ev["action"] == "free_completed" and ev["addr"] in blocks:
                a.free(blocks.pop(ev["addr"]))
        peaks[expandable] = a.peak_allocated
    assert peaks[True] == peak
    assert peaks[False] >= peak
