"""The CUDA caching allocator's block rules (memlab.policy.caching_allocator), case by case."""
from memlab.policy.caching_allocator import (
    CachingAllocator,
    fresh_block_bytes,
    replay_steady_step,
    round_size,
    should_split,
)

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
