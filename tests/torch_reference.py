"""What torch's own tools measure, for tests to compare memlab against (not a test module)."""
import torch


def memtracker_peak(model, optimizer, step) -> int:
    """Peak bytes torch's ``MemTracker`` counts over one ``step()`` on the CPU, after one
    step to reach the steady state (as ``track_step``'s warm-up does)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    step()
    mt = MemTracker()
    mt.track_external(model, optimizer)
    with mt:
        step()
    return mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
