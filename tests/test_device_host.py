"""Device and host memory, the allocator's workspace, and a real allocator OOM explained.

A CPU-only machine has one memory, so the host side is exercised with a second device type:
the step runs on ``meta`` (shapes only, like an accelerator's tensors) while the offloaded
optimizer state lives on the CPU, as ZeRO-Offload puts it in host memory.
"""
import gc

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memlab.lenses.measure import add_workspace, measure_step, run_tracked_step
from memlab.step.training_step import MemoryReport, StepConfig, build_trainer, make_batch
from memlab.tracking.oom_messages import requested_bytes
from memlab.tracking.tracker import CATEGORIES, MemoryTracker

D, H = 256, 1024  # a two-layer MLP, 256 -> 1024 -> 256


def test_storages_off_the_step_device_are_host_memory():
    """Forward and backward on the device (meta); the fp32 master weights, two Adam moments
    and the fp32 gradients on the host (cpu), as ZeRO-Offload keeps them (Ren et al. 2021,
    sec. 4.1): 4 + 8 + 4 bytes per parameter of host memory, none of it on the device."""
    model = torch.nn.Sequential(torch.nn.Linear(D, H, bias=False),
                                torch.nn.Linear(H, D, bias=False)).to("meta")
    x = torch.empty(64, D, device="meta")
    psi = 2 * D * H
    with MemoryTracker(device="meta") as mt:
        mt.track_model(model)
        mt.track_tensors([x], "other")
        master = [torch.zeros(p.shape) for p in model.parameters()]
        moments = [torch.zeros(p.shape) for p in model.parameters() for _ in range(2)]
        mt.track_tensors(master + moments, "optimizer")
        model(x).sum().backward()
        host_grads = [torch.zeros(p.shape) for p in model.parameters()]  # copied off the device
        mt.track_tensors(host_grads, "gradients")
        for p in model.parameters():
            p.grad = None  # offloaded: the device copy goes
    opt, grads = CATEGORIES.index("optimizer"), CATEGORIES.index("gradients")
    assert mt.peak_by_category()["parameters"] == 4 * psi
    assert max(ev.by_category[grads] for ev in mt.timeline) == 4 * psi  # backward, on device
    assert max(ev.by_category[opt] for ev in mt.timeline) == 0  # never on the device
    host = mt.host_peak_by_category()
    assert host["optimizer"] == (4 + 8) * psi and host["gradients"] == 4 * psi
    assert host["parameters"] == 0 and mt.host_peak_bytes == 16 * psi
    assert mt.peak_bytes < mt.host_peak_bytes
    ev = mt.timeline[-1]
    assert len(ev.host_by_category) == len(CATEGORIES) and ev.host_total == 16 * psi
    assert mt.by_category()["gradients"] == 0 and mt.host_by_category()["gradients"] == 4 * psi


def test_budget_is_the_devices_alone():
    with MemoryTracker(budget=10_000, device="meta") as mt:
        host = torch.zeros(100_000)  # 400 kB of host memory: not the device's budget
        assert mt.host_live_bytes == 400_000 and mt.live_bytes == 0
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 39.06 KiB"):
            torch.empty(10_000, device="meta")
    del host


def test_cpu_run_has_no_host_memory():
    rep = measure_step(StepConfig(seq=32, batch=2))
    assert rep.host_bytes == 0 and sum(rep.host_by_category.values()) == 0
    assert rep.tracked_peak_bytes is None and rep.by_category["workspace"] == 0
    d = rep.to_dict()
    assert d["host_bytes"] == 0 and set(d["host_by_category"]) == set(CATEGORIES)


def test_workspace_makes_the_categories_add_up_to_the_allocator():
    step = StepConfig(seq=32, batch=2)
    cats = dict.fromkeys(CATEGORIES, 0) | {"parameters": 1000, "activations": 3000}
    allocator = {"max_memory_allocated": 4000 + 640, "max_memory_reserved": 8192}
    rep = add_workspace(MemoryReport("measure", step, "cuda", 4000, cats, allocator=allocator))
    assert rep.tracked_peak_bytes == 4000 and rep.by_category["workspace"] == 640
    assert rep.peak_bytes == sum(rep.by_category.values()) == allocator["max_memory_allocated"]
    assert rep.to_dict()["tracked_peak_bytes"] == 4000
    again = add_workspace(rep)  # idempotent: the workspace is added once
    assert again.peak_bytes == 4640 and again.by_category["workspace"] == 640


CUDA_MESSAGE = ("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of "
                "15.57 GiB of which 1.12 GiB is free. Of the allocated memory 13.20 GiB is "
                "allocated by PyTorch, and 401.00 MiB is reserved by PyTorch but unallocated.")


class AllocatorRunsOut(TorchDispatchMode):
    """Below the tracker: the first matmul of backward fails as the CUDA allocator does."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        backward = torch._C._current_graph_task_id() != -1
        if backward and func.__name__.startswith("mm"):
            raise torch.OutOfMemoryError(CUDA_MESSAGE)
        return func(*args, **(kwargs or {}))


def test_parse_requested_bytes():
    assert requested_bytes(CUDA_MESSAGE) == int(1.5 * 2**30)
    assert requested_bytes("Tried to allocate 512 bytes") == 512
    assert requested_bytes("Tried to allocate 20.00 MiB (GPU 0)") == 20 * 2**20
    assert requested_bytes("no size here") == 0


def test_a_real_allocator_oom_names_the_op_module_phase_and_categories():
    step = StepConfig(seq=256, batch=8)  # activations (~150 MiB) outweigh Adam's 30 MiB
    trainer = build_trainer(step)
    batch = make_batch(step)
    trainer.warm_up_optimizer()  # the optimizer state exists; the step below is the first
    with AllocatorRunsOut():
        tracker, _, before, after = run_tracked_step(trainer, batch, None, warmup=False)
    oom = tracker.oom
    assert oom is not None and oom.op.startswith("mm") and oom.phase == "backward"
    assert oom.module not in ("unknown", "Global")  # the autograd node running backward
    assert oom.requested_bytes == int(1.5 * 2**30)
    assert oom.message.startswith("CUDA out of memory. Tried to allocate 1.50 GiB")
    cfg = step.model_config
    # at the start of backward everything forward kept is alive: the activations dominate
    assert oom.by_category["parameters"] == 4 * cfg.num_params()
    tensors = len(list(trainer.model.parameters()))  # fused AdamW: a 4-byte step per tensor
    assert oom.by_category["optimizer"] == 8 * cfg.num_params() + 4 * tensors
    assert oom.by_category["activations"] > 0 and oom.culprit == "activations"
    assert sum(oom.by_category.values()) == oom.live_bytes
    assert after == before  # the failed step's memory was released
    gc.collect()


def test_the_oom_goes_into_the_report_json():
    step = StepConfig(seq=256, batch=8)
    trainer = build_trainer(step)
    batch = make_batch(step)
    trainer.warm_up_optimizer()
    with AllocatorRunsOut():
        tracker, seconds, before, after = run_tracked_step(trainer, batch, 2**30, warmup=False)
    rep = MemoryReport("measure", step, "cpu", tracker.peak_bytes, tracker.peak_by_category(),
                       2**30, seconds, tracker.oom)
    d = rep.to_dict()["oom"]
    assert d["culprit"] == "activations" and d["requested_bytes"] == int(1.5 * 2**30)
    assert d["by_category"]["activations"] == tracker.oom.by_category["activations"]
    assert rep.fits is False and tracker.oom.budget_bytes == 2**30


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_oom_carries_the_allocators_figures():
    rep = measure_step(StepConfig(model="gpt2-small", seq=1024, batch=8), device="cuda",
                       budget="2GiB")
    assert rep.fits is False and rep.oom.op != "unknown" and rep.oom.phase != "unknown"
    alloc = rep.oom.allocator
    assert alloc["allocated_bytes"] <= alloc["reserved_bytes"] <= alloc["total_bytes"]
    assert rep.oom.requested_bytes > 0 and rep.oom.culprit != "unknown"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_measure_adds_up_to_the_allocator():
    rep = measure_step(StepConfig(model="gpt2-small", seq=512, batch=4), device="cuda")
    assert rep.peak_bytes == rep.allocator["max_memory_allocated"] == sum(rep.by_category.values())
    assert 0 < rep.by_category["workspace"] < 0.1 * rep.peak_bytes
    assert rep.allocator["max_memory_reserved"] >= rep.peak_bytes


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_save_on_cpu_activations_are_host_memory_on_cuda():
    step = StepConfig(model="gpt2-small", seq=256, batch=4)
    plain = measure_step(step, device="cuda")
    trainer = build_trainer(step, "cuda")
    batch = make_batch(step, "cuda")
    with torch.autograd.graph.save_on_cpu():
        tracker, *_ = run_tracked_step(trainer, batch, None)
    assert tracker.host_peak_by_category()["activations"] > 0.5 * plain.by_category["activations"]
    assert tracker.peak_bytes < plain.tracked_peak_bytes


def test_workspace_is_the_allocators_growth_beyond_the_tracked_tensors():
    """900 bytes no tracked tensor holds were allocated before the step (a learner's leftover
    tensors, an earlier step's cuBLAS workspace): not the step's workspace. Tracked: 1100 at
    the start, 4000 at the peak (growth 2900); allocator: 2000 at the start, 5400 at the peak
    (growth 3400); the workspace is the 500 bytes of growth no tensor accounts for."""
    step = StepConfig(seq=32, batch=2)
    cats = dict.fromkeys(CATEGORIES, 0) | {"parameters": 1000, "activations": 3000}
    # tracked: 1100 at the start (parameters + batch), 4000 at the peak
    allocator = {"max_memory_allocated": 2000 + 3400, "memory_allocated_at_start": 2000,
                 "max_memory_reserved": 8192}
    rep = add_workspace(MemoryReport("measure", step, "cuda", 4000, cats, allocator=allocator,
                                     live_before=1100))
    assert rep.by_category["workspace"] == 3400 - (4000 - 1100) == 500
    assert rep.peak_bytes == 4500 and rep.tracked_peak_bytes == 4000
    assert any("900 B were allocated before the step" in n for n in rep.notes)


def test_cuda_step_time_is_read_after_synchronize(monkeypatch):
    """run_tracked_step on a (patched) CUDA trainer: the clock is read after
    torch.cuda.synchronize, so asynchronous kernels are inside the step time."""
    import memlab.lenses.measure as measure
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("sync"))
    clock = iter(range(100))
    monkeypatch.setattr(measure.time, "perf_counter", lambda: calls.append("clock") or next(clock))

    class FakeTrainer:
        device = torch.device("cuda")
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(self, batch):
            calls.append("step")

    class Tracker:
        def __init__(self, *a, **k):
            self.live_bytes, self.oom, self.timeline = 0, None, []

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def track_model(self, *a):
            pass

        track_optimizer = track_tensors = reset_peak = track_model

    monkeypatch.setattr(measure, "MemoryTracker", Tracker)
    measure.run_tracked_step(FakeTrainer(), (), None, warmup=False)
    step_at = calls.index("step")
    after = calls[step_at:]
    assert after.index("sync") < after.index("clock"), calls
