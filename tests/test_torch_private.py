"""Each wrapper over PyTorch's private APIs still does its job on the installed torch."""
import torch
import torch.distributed as dist

from memlab import torch_private as tp


def test_fake_tensors_allocate_nothing_and_keep_shapes():
    with tp.FakeTensorMode():
        x = torch.empty(1024, 1024)
        assert isinstance(x, tp.FakeTensor) and x.shape == (1024, 1024)


def test_autocast_cpu_kernels_are_listed_and_the_key_can_be_stepped_past():
    ops = tp.aten_ops_with_kernel("AutocastCPU")
    assert {"mm", "conv2d", "linear"} <= ops and "add.Tensor" not in ops and "add" not in ops
    a = torch.ones(2, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16
        with tp.exclude_dispatch_keys(tp.AUTOCAST_CPU_KEYS):
            assert (a @ a).dtype == torch.float32


def test_backward_is_seen_from_inside_the_engine():
    seen = []
    x = torch.ones(3, requires_grad=True)
    y = (x * 2).sum()
    x.register_hook(lambda g: seen.append((tp.in_backward(), type(tp.current_autograd_node()).__name__)))
    assert not tp.in_backward() and tp.current_autograd_node() is None
    y.backward()
    assert seen and seen[0][0] is True


def test_parse_to_reads_device_and_dtype():
    assert tp.parse_to("cpu", torch.float16) == (torch.device("cpu"), torch.float16)
    assert tp.parse_to(dtype=torch.bfloat16) == (None, torch.bfloat16)


def test_pytree_and_dispatch_mode():
    leaves, _ = tp.tree_flatten(((torch.ones(1), 2), {"k": torch.zeros(1)}))
    assert len(leaves) == 3 and tp.tree_leaves([1, (2, 3)]) == [1, 2, 3]
    doubled = tp.tree_map_only(torch.Tensor, lambda t: t * 2, (torch.ones(1), "s"))
    assert doubled[0].item() == 2 and doubled[1] == "s"
    calls = []

    class Count(tp.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(func)
            return func(*args, **(kwargs or {}))

    with Count():
        torch.ones(2) + 1
    assert torch.ops.aten.add.Tensor in calls
    assert not tp.is_traceable_wrapper_subclass(torch.ones(1))


def test_fake_store_gives_a_fake_process_group_and_fsdp_tracker_imports():
    dist.init_process_group("fake", store=tp.FakeStore(), rank=0, world_size=4)
    try:
        assert dist.get_world_size() == 4
        t = torch.ones(2)
        dist.all_reduce(t)  # a fake collective: returns at once, changes nothing
        assert t.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()
    assert tp.fsdp2_mem_tracker().__name__ == "FSDPMemTracker"
