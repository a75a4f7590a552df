"""Reading out-of-memory messages (real and simulated), and a real OOM seen by the tracker."""
import pytest
import torch
import torch.nn as nn

from memlab.tracking.oom_messages import fragmentation, read_oom
from memlab.tracking.tracker import MemoryTracker

MiB, GiB = 2**20, 2**30

# assembled as CUDACachingAllocator.cpp assembles it (torch 2.x, a fraction set), numbers ours
REAL = ("CUDA out of memory. Tried to allocate 200.00 MiB. GPU 0 has a total capacity of "
        "139.81 GiB of which 137.50 GiB is free. Including non-PyTorch memory, this process has "
        "1.52 GiB memory in use. 1.07 GiB allowed; Of the allocated memory 540.00 MiB is "
        "allocated by PyTorch, and 484.00 MiB is reserved by PyTorch but unallocated. If "
        "reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
        "documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")


def test_real_message_gives_every_size():
    r = read_oom(REAL)
    assert r == {"requested": 200 * MiB, "total": int(139.81 * GiB), "free": int(137.5 * GiB),
                 "process": int(1.52 * GiB), "allowed": int(1.07 * GiB),
                 "allocated": 540 * MiB, "reserved_unallocated": 484 * MiB}


def test_message_without_a_fraction_or_process_line():
    msg = ("Out of memory. Tried to allocate 512 bytes. GPU 1 has a total capacity of 8.00 GiB "
           "of which 0 bytes is free. Of the allocated memory 7.50 GiB is allocated by PyTorch, "
           "and 15.90 MiB is reserved by PyTorch but unallocated.")
    r = read_oom(msg)
    assert r["requested"] == 512 and r["free"] == 0 and "allowed" not in r
    assert r["reserved_unallocated"] == int(15.9 * MiB)


def test_simulated_message_from_the_tracker():
    with pytest.raises(torch.OutOfMemoryError) as info:
        with MemoryTracker(budget="64MiB"):
            torch.empty(100 * MiB, dtype=torch.uint8)
    r = read_oom(str(info.value))
    assert r == {"requested": 100 * MiB, "in_use": 0, "budget": 64 * MiB, "short": 36 * MiB}


def test_not_an_oom_message_is_refused():
    with pytest.raises(ValueError, match="not an out-of-memory message"):
        read_oom("RuntimeError: shapes do not match")
    with pytest.raises(ValueError, match="string"):
        read_oom(None)


@torch.library.custom_op("memlab_test::allocator_gives_up", mutates_args=())
def allocator_gives_up(x: torch.Tensor) -> torch.Tensor:
    """Stands in for a CUDA kernel launch whose output the allocator cannot place."""
    raise torch.OutOfMemoryError(REAL.replace("200.00 MiB", "2.00 GiB"))


class Asks(nn.Module):
    def forward(self, x):
        return allocator_gives_up(x)


def test_a_real_oom_inside_an_op_is_dissected_like_a_simulated_one():
    model = nn.Sequential(nn.Linear(8, 1024), Asks())
    x = torch.randn(64, 8)
    tracker = MemoryTracker()
    with pytest.raises(torch.OutOfMemoryError):
        with tracker:
            tracker.track_model(model)
            model(x)
    oom = tracker.oom
    assert (oom.op, oom.module, oom.phase) == ("allocator_gives_up.default", "Sequential.1", "forward")
    assert oom.requested_bytes == 2 * GiB
    assert oom.message.startswith("CUDA out of memory. Tried to allocate 2.00 GiB")
    # the Linear's output (64 x 1024 fp32) was kept for the failing op: an activation
    assert oom.by_category["activations"] == 64 * 1024 * 4 and oom.culprit == "activations"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_expandable_segments_serve_what_fragmentation_refused():
    default, expandable = fragmentation(False), fragmentation(True)
    assert not default.fits and expandable.fits
    r = read_oom(default.oom)
    # 9 of 17 60-MiB pieces live; the cached 1 GiB block holds the 8 holes and the 4 MiB tail
    assert r["allocated"] == 9 * 60 * MiB and r["reserved_unallocated"] == 484 * MiB
    assert r["allocated"] + r["requested"] < default.cap_bytes  # it would have fitted
    assert expandable.reserved_after <= expandable.cap_bytes
