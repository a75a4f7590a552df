"""torch.compile as a run field (memlab.step.compiled): the compiled step's peak measured from
the allocator's events, its saved set counted from inductor's backward graph, on CPU."""
import pytest
import torch

from memlab.core.errors import InputError
from memlab.core.torch_private import FakeTensorMode, activation_memory_budget, profiler_memory_events
from memlab.lenses.estimate import COMPILE_NOTE, compiled_pass_bytes, estimate_step
from memlab.lenses.measure import allocator_peak, measure_step, run_tracked_step
from memlab.lenses.simulate import simulate_step
from memlab.models.gpt_unet import tiny_llama
from memlab.step.compiled import CUDA_LOWERING_NOTE, count_compiled_saved
from memlab.step.parallel_dims import ParallelDims
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


#: (model, the StepConfig fields of the compiled runs)
RUNS = {"gpt": SMALL, "llama": dict(model=tiny_llama(), seq=128, batch=4)}


@pytest.fixture(scope="module")
def compiled_runs():
    """Each compile once for the module (inductor on two cores: minutes each)."""
    out = {"eager": measure_step(StepConfig(**SMALL))}
    for budget in (None, 0.5):
        step = StepConfig(compile=True, activation_memory_budget=budget, **SMALL)
        trainer = build_trainer(StepConfig(**SMALL))
        saved = count_compiled_saved(trainer.model, make_batch(step), budget)
        out[budget] = (measure_step(step), saved)
    for budget in (None, 0.5):
        out["llama", budget] = measure_step(StepConfig(compile=True, activation_memory_budget=budget,
                                                       **RUNS["llama"]))
    return out


def partitioned_saved(fields: dict, budget: float | None) -> int:
    """What the simulation's fake partition saves for backward (memlab.step.compiled.PartitionedModel)."""
    step = StepConfig(compile=True, activation_memory_budget=budget, **fields)
    with FakeTensorMode():
        trainer = build_trainer(step, fake=True)
        vocab = step.model_config.vocab_size
        batch = tuple(torch.randint(0, vocab, (step.batch, step.seq)) for _ in range(2))
        with activation_memory_budget(budget):
            trainer.model(*batch).backward()
    return trainer.model.saved_bytes


@pytest.mark.slow
@pytest.mark.parametrize("budget", [None, 0.5])
def test_the_simulation_saves_what_inductor_saves(compiled_runs, budget):
    """The fake tensors' partition (inductor's partition_fn, parameters static) keeps the same
    tensors as a real inductor compile, counted from the backward graph each one compiles."""
    assert partitioned_saved(SMALL, budget) == compiled_runs[budget][1].saved_bytes


def measured(compiled_runs, model: str, budget: float | None):
    return compiled_runs[budget][0] if model == "gpt" else compiled_runs["llama", budget]


#: the measured compiled peaks (bytes) these tests were written against, on this repository's CPU run
#: (torch 2.13): read from the allocator's events of the real inductor step (measure_compiled), so
#: the simulation's bound below is checked against inductor's step, never against memlab's own output
MEASURED_WHEN_WRITTEN = {("gpt", None): 84_122_840, ("gpt", 0.5): 73_553_240,
                         ("llama", None): 8_795_980, ("llama", 0.5): 7_939_916}


@pytest.mark.slow
@pytest.mark.parametrize("budget", [None, 0.5])
@pytest.mark.parametrize("model", RUNS)
def test_the_simulated_compiled_peak_follows_inductors_code(compiled_runs, model, budget):
    """The issue's 2%, at the default budget and at 0.5, from the same state held before the step.
    The simulation runs the wrapper inductor generates for each partitioned graph (its fusion,
    reorder_for_peak_memory, buffer reuse and donated saved tensors; memlab.step.compiled), so it
    follows the order inductor runs: at 0.5 its scheduler recomputes the backward's attention of
    several layers and the residual stream in one kernel at the start of backward, which the
    partitioned graph's own order put 12-14% lower. When written: gpt +0.00% and -0.09%, llama
    +0.00% and +0.00%; the bound is kept near that, well inside the issue's 2%."""
    run = measured(compiled_runs, model, budget)
    assert run.peak_bytes == pytest.approx(MEASURED_WHEN_WRITTEN[model, budget], rel=0.01)  # the same step
    sim = simulate_step(StepConfig(compile=True, activation_memory_budget=budget, **RUNS[model]))
    assert sim.live_before == run.live_before
    assert sim.peak_bytes == pytest.approx(run.peak_bytes, rel=0.0025)


@pytest.mark.slow
@pytest.mark.parametrize("budget", [None, 0.5])
@pytest.mark.parametrize("model", RUNS)
def test_the_estimate_counts_the_compiled_step(compiled_runs, model, budget):
    """The issue's 2% for the estimate: its compiled forward and backward are traced as inductor
    runs them (estimate.compiled_pass_bytes), its model states and optimizer step are the formula's.
    When written: gpt -0.00% and -0.09%, llama -0.00% and -0.00% (the eager count it replaced read
    +1% and +16%, +57% and +74%)."""
    run = measured(compiled_runs, model, budget)
    est = estimate_step(StepConfig(compile=True, activation_memory_budget=budget, **RUNS[model]))
    assert est.peak_bytes == pytest.approx(run.peak_bytes, rel=0.0025)
    assert COMPILE_NOTE in est.notes and "peak moment: compiled forward and backward" in est.notes
    assert CUDA_LOWERING_NOTE not in est.notes   # a CPU target: inductor's CPU code is the one followed


def test_the_estimate_traces_nothing_for_an_eager_step_and_refuses_what_it_cannot_trace():
    """The CLI's fast path stays closed form: only compile=True traces (seconds). A compiled step
    with tensor parallelism is not traced by the estimate (its pass would be the whole model's)."""
    calls = compiled_pass_bytes.cache_info()
    estimate_step(StepConfig(**SMALL))
    assert compiled_pass_bytes.cache_info() == calls
    with pytest.raises(InputError, match="simulate_step"):
        estimate_step(StepConfig(compile=True, world_size=2, parallel=ParallelDims(tensor=2), **SMALL))


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


def test_another_torch_runs_the_partitioned_graphs_as_they_are(monkeypatch):
    """The wrapper inductor generates is read through private APIs checked on 2.13 only
    (memlab.step.compiled.LOWERED_ON); the GPU machine's torch 2.11 runs the partitioned graphs
    unlowered instead of failing, saves what the partitioner chose (the same bytes), and says so."""
    import memlab.step.compiled as compiled
    fields = dict(model=tiny_llama(), seq=32, batch=1)
    assert compiled.inductor_lowering_available() == torch.__version__.startswith("2.13.")
    lowered = partitioned_saved(fields, 0.5)
    monkeypatch.setattr(compiled, "inductor_lowering_available", lambda: False)

    def moved(*args, **kwargs):  # what another release's inductor internals do to the lowering
        raise AttributeError("module 'torch._inductor.compile_fx' has no attribute 'fake_tensor_prop'")
    monkeypatch.setattr(compiled, "inductor_wrapper_call", moved)
    assert partitioned_saved(fields, 0.5) == lowered
    sim = simulate_step(StepConfig(compile=True, activation_memory_budget=0.5, **fields))
    assert compiled.UNLOWERED_NOTE in sim.notes and sim.peak_bytes > 0


@pytest.mark.parametrize("fields", [dict(compile=True), dict(activation_offload=True)])
def test_a_decoders_run_refuses_what_no_decoder_lens_counts(fields, capsys):
    """compile and activation offloading are counted for memlab's GPT only: a Hugging Face
    decoder's run (and the CLI with --hf-config) refuses them instead of answering the plain
    step's peak (which the estimate did, silently, before)."""
    from memlab.app.cli import main
    from memlab.hf.shape import decoder_shape
    with pytest.raises(InputError, match="allowed for a decoder: compile=False"):
        StepConfig(decoder_shape("llama-3.1-8b"), seq=128, batch=1, **fields)
    flag = "--compile" if "compile" in fields else "--activation-offload"
    assert main(["estimate", "--hf-config", "llama-3.1-8b", flag]) == 2
    assert "allowed with --hf-config: none of them" in capsys.readouterr().err


@pytest.mark.parametrize("lens", [simulate_step, measure_step])
def test_memlabs_own_lenses_name_where_a_decoders_run_is_built(lens):
    """simulate_step and measure_step build memlab's GPT or UNet: a decoder's run is bad input
    naming memlab.hf's lens that builds its class (before: an AttributeError inside the build),
    while the estimate takes the same run."""
    from memlab.hf.shape import decoder_shape
    run = StepConfig(decoder_shape("llama-3.1-8b"), seq=128, batch=1)
    assert estimate_step(run, target="cpu").peak_bytes > 0
    name = lens.__name__.split("_")[0]
    with pytest.raises(InputError, match=rf"memlab\.hf\.{name}\.{name}_hf\(config"):
        lens(run)
