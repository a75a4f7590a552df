"""The tracker: exact bytes, categories, budgets, clean-up after errors."""
import gc
import time

import pytest
import torch

from memlab.lenses.measure import measure_step, time_steps
from memlab.step.training_step import StepConfig, build_trainer, make_batch
from memlab.tracking.tracker import CATEGORIES, MemoryTracker


def test_counts_a_new_tensor_exactly_and_its_release():
    with MemoryTracker() as mt:
        x = torch.empty(1000, dtype=torch.float32)
        assert mt.live_bytes == 4000
        y = x.view(10, 100)  # a view shares the storage: no new bytes
        assert mt.live_bytes == 4000
        del x, y
        gc.collect()
        assert mt.live_bytes == 0
    assert mt.peak_bytes == 4000


def test_categories_of_a_training_step_and_they_sum_to_the_peak():
    step = StepConfig(seq=64, batch=2)
    rep = measure_step(step)
    cfg = step.model_config
    assert rep.by_category["parameters"] == 4 * cfg.num_params()
    assert rep.by_category["optimizer"] >= 8 * cfg.num_params()  # AdamW's two moments
    assert rep.by_category["activations"] > 0
    assert sum(rep.by_category.values()) == rep.peak_bytes
    assert max(e.total for e in rep.timeline) == rep.peak_bytes
    assert {e.phase for e in rep.timeline} >= {"forward", "backward", "optimizer"}


def test_budget_raises_a_cuda_like_oom_and_memory_returns():
    rep = measure_step(StepConfig(seq=128, batch=4), budget="60MiB")
    assert rep.fits is False
    assert rep.oom is not None and "Tried to allocate" in rep.oom.message
    assert "budget 60.00 MiB" in rep.oom.message
    assert rep.live_after == rep.live_before  # the failed step left nothing behind


def test_budget_oom_is_a_torch_out_of_memory_error():
    with pytest.raises(torch.OutOfMemoryError, match="Simulated device out of memory"):
        with MemoryTracker(budget=1000):
            torch.zeros(1000)


def test_hooks_removed_after_an_exception():
    step = StepConfig(seq=32, batch=2)
    trainer = build_trainer(step)
    batch = make_batch(step)
    with pytest.raises(RuntimeError, match="boom"):
        with MemoryTracker() as mt:
            mt.track_model(trainer.model)
            trainer.model(*batch)
            raise RuntimeError("boom")
    before = mt.live_bytes
    trainer.step(batch)  # after exit, nothing is tracked any more
    assert mt.live_bytes == before
    assert not torch.utils._python_dispatch._get_current_dispatch_mode()


def test_checkpointing_keeps_only_block_inputs():
    full = measure_step(StepConfig(seq=128, batch=4, checkpointing="full"))
    none = measure_step(StepConfig(seq=128, batch=4))
    assert full.peak_bytes < 0.8 * none.peak_bytes
    assert full.live_after == full.live_before  # checkpointed graphs are released


def test_bad_category_is_rejected():
    with pytest.raises(ValueError, match="unknown category 'weights'"):
        MemoryTracker().track_tensors([torch.zeros(1)], "weights")


def test_every_category_is_reached_by_a_step_and_none_is_missing():
    """Each category the reports use is filled by some moment of a real step's timeline
    (a GPU-target simulation: workspace is what no op returns, cuBLAS's), and the peak is
    exactly the sum of its categories: none lost, none counted twice. The model states are
    the closed-form 4 + 4 + 8 bytes per parameter of fp32 AdamW."""
    from memlab.lenses.simulate import simulate_step
    step = StepConfig(seq=64, batch=2)
    rep = simulate_step(step, target="cuda")
    assert tuple(rep.by_category) == CATEGORIES
    assert rep.peak_bytes == sum(rep.by_category.values())
    reached = {c: max(e.by_category[i] for e in rep.timeline) for i, c in enumerate(CATEGORIES)}
    assert all(v > 0 for v in reached.values()), reached
    n = step.model_config.num_params()
    # parameters and gradients to the 512-byte block (CUDA's allocator), per tensor
    tensors = len(step.model_config.param_numels())
    assert 4 * n <= rep.by_category["parameters"] <= 4 * n + 512 * tensors
    assert 8 * n <= rep.by_category["optimizer"] <= 8 * n + 2 * 512 * tensors + 512 * tensors


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_allocator_stats_and_history_switched_off(tmp_path):
    rep = measure_step(StepConfig(seq=128, batch=4), device="cuda",
                       snapshot_path=str(tmp_path / "snap.pickle"))
    assert rep.allocator["max_memory_allocated"] >= rep.peak_bytes * 0.9
    assert (tmp_path / "snap.pickle").stat().st_size > 0

    def traces() -> int:
        return sum(len(t) for t in torch.cuda.memory._snapshot()["device_traces"])

    with pytest.raises(RuntimeError):
        with MemoryTracker(cuda_history=True):
            torch.empty(2**20, device="cuda")
            assert traces() > 0  # recording while the tracker is active
            raise RuntimeError("x")
    before = traces()
    x = torch.empty(2**20, device="cuda")
    del x
    assert traces() == before  # switched off on exit, also after an exception


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_real_oom_under_a_reduced_fraction():
    rep = measure_step(StepConfig(model="gpt2-small", seq=1024, batch=8), device="cuda",
                       budget="2GiB")
    assert rep.fits is False
    assert torch.cuda.memory_allocated() < 2**30


class _Sleeper:
    """A stand-in trainer: each step sleeps the next of ``seconds`` and logs its name."""

    def __init__(self, name: str, seconds: list[float], log: list[str]):
        self.name, self.seconds, self.log = name, list(seconds), log
        self.device = torch.device("cpu")

    def step(self, batch) -> None:
        self.log.append(self.name)
        time.sleep(self.seconds.pop(0))


def test_time_steps_takes_the_median_round_robin():
    log: list[str] = []
    runs = {"slow": (_Sleeper("slow", [0.20, 0.06, 0.12], log), ()),
            "fast": (_Sleeper("fast", [0.01, 0.03, 0.02], log), ())}
    times = time_steps(runs, repeats=3)
    assert log == ["slow", "fast"] * 3  # one step of each in turn
    # the median of three sleeps: sleep() never returns early and rarely overshoots by
    # as much as the gap to the next-larger sleep
    assert 0.12 <= times["slow"] < 0.20
    assert 0.02 <= times["fast"] < 0.03 + 0.02
