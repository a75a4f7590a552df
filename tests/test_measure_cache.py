"""Lesson 15 asks for the same measurements again and again (the table's panel, its exercise):
memlab.classroom.technique_table measures each (step, variant) once per process, keyed by both."""
from dataclasses import replace

from memlab.classroom import technique_table as tt
from memlab.lenses.measure import measure_trainer
from memlab.step.training_step import StepConfig
from memlab.techniques.compression import compressed_trainer

STEP = StepConfig(seq=64, batch=1)


def _fresh_peak(step: StepConfig) -> int:
    """The baseline's peak, measured without the cache."""
    trainer, _, batch = compressed_trainer(step, "none")
    return measure_trainer(trainer, batch).peak_bytes


def test_a_baseline_is_measured_once_for_every_technique(monkeypatch):
    calls = []

    def counted(trainer, batch):
        calls.append(1)
        return measure_trainer(trainer, batch)

    monkeypatch.setattr(tt, "measure_trainer", counted)
    tt._measured_bytes.cache_clear()
    ckpt = tt.measure_saving(STEP, "gradient checkpointing")
    bf16 = tt.measure_saving(STEP, "mixed precision")
    again = tt.measure_saving(STEP, "gradient checkpointing")
    assert len(calls) == 3  # the baseline once, each technique once; the repeat measures nothing
    assert ckpt == again and ckpt.baseline == bf16.baseline


def test_the_cached_numbers_are_the_measured_ones_and_keyed_by_the_step():
    tt._measured_bytes.cache_clear()
    small = tt.measure_saving(STEP, "gradient checkpointing")
    larger = replace(STEP, batch=4)
    big = tt.measure_saving(larger, "gradient checkpointing")
    assert small.baseline.peak_bytes == _fresh_peak(STEP)
    assert big.baseline.peak_bytes == _fresh_peak(larger)
    # four times the batch holds more activations: a key that dropped the batch would not see it
    assert big.baseline.activation_bytes > 3 * small.baseline.activation_bytes
    small.baseline.by_category["parameters"] = -1  # a caller's edit stays its own
    assert tt.measure_saving(STEP, "gradient checkpointing").baseline.by_category["parameters"] > 0
