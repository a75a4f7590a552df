"""torch.compile as a run field (memlab.step.compiled): the compiled step's peak measured from
the allocator's events, its saved set counted from inductor's backward graph, on CPU."""
import pytest

from memlab.core.errors import InputError
from memlab.core.torch_private import profiler_memory_events
from memlab.lenses.measure import allocator_peak, measure_step, run_tracked_step
from memlab.step.compiled import count_compiled_saved
from memlab.step.training_step import StepConfig, build_trainer, make_batch

MiB = 2**20
SMALL = dict(model="tiny", seq=128, batch=4)


def test_the_allocator_events_see_what_the_tracker_sees_on_an_eager_step():
    """The instrument of a compiled step's peak, checked where both can look: on an eager step
    the profiler's allocator events peak exactly where memlab's tracker does."""
    trainer = build_trainer(StepConfig(**SMALL))
    batch = make_batch(trainer.step_config)
    tracker, _, before, _ = run_tracked_step(trainer, batch, None)
    growth, left = allocator_peak(profiler_memory_events(lambda: trainer.step(batch)))
    assert growth == tracker.peak_bytes - before
    assert left == 0   # a steady step leaves nothing behind


def test_the_budget_is_a_fraction_and_needs_compile():
    with pytest.raises(InputError, match="without compile"):
        StepConfig(activation_memory_budget=0.5)
    with pytest.raises(InputError, match=r"fraction in \(0, 1\]"):
        StepConfig(compile=True, activation_memory_budget=1.5)
    with pytest.raises(InputError, match="compile="):
        StepConfig(compile="yes")
    with pytest.raises(InputError, match="budget"):
        measure_step(StepConfig(compile=True, **SMALL), budget="64MiB")


@pytest.fixture(scope="module")
def compiled_runs():
    """Each compile once for the module (inductor on two cores: minutes each)."""
    out = {"eager": measure_step(StepConfig(**SMALL))}
    for budget in (None, 0.5):
        step = StepConfig(compile=True, activation_memory_budget=budget, **SMALL)
        trainer = build_trainer(StepConfig(**SMALL))
        saved = count_compiled_saved(trainer.model, make_batch(step), budget)
        out[budget] = (measure_step(step), saved)
    return out


@pytest.mark.slow
def test_a_budget_of_half_saves_half_and_the_peak_falls_by_at_most_that(compiled_runs):
    """torch/_functorch/config.py (torch 2.13) defines the budget: "0.4 would result in a
    strategy that saves 40% of the activations compared to the default strategy". Counted
    from inductor's backward graph, 0.5 keeps at most half of what the default keeps. The
    measured peak falls, but by no more than what is no longer saved (backward recomputes
    the rest, and nothing else in the step changed); both compiled peaks sit below eager's."""
    (default, saved_default), (half, saved_half) = compiled_runs[None], compiled_runs[0.5]
    eager = compiled_runs["eager"]
    assert default.live_before == half.live_before == eager.live_before   # same state held
    assert saved_half.saved_bytes <= 0.5 * saved_default.saved_bytes
    drop_measured = default.peak_bytes - half.peak_bytes
    assert 0 < drop_measured <= saved_default.saved_bytes - saved_half.saved_bytes
    assert half.peak_bytes < default.peak_bytes < eager.peak_bytes
