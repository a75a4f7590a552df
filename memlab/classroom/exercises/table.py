"""Lesson 15: a row of the table, measured by the learner: the saving on the step's peak."""
from __future__ import annotations

import functools
from typing import Callable

from memlab.classroom.exercises.common import CheckResult, call_learner, fail, require
from memlab.classroom.technique_table import SINGLE, measure_saving
from memlab.step.training_step import StepConfig

SAVING_TOLERANCE = 0.01  # two measurements of the same step by the same tracker
STEPS = (StepConfig(seq=64, batch=1), StepConfig(seq=128, batch=4))
TECHNIQUES = {"checkpointing": "gradient checkpointing", "precision": "mixed precision"}


def check_peak_saving(peak_saving: Callable) -> CheckResult:
    """``peak_saving(step, **technique)`` measures ``step`` (a StepConfig) with and without one
    technique given as a StepConfig override (``checkpointing="full"``, ``precision="bf16"``)
    and returns the saving on the step's peak, ``1 - peak_with / peak_without``. Checked on the
    tiny GPT at two sizes against the table's own measurement (``memlab.classroom.technique_table``) within
    :data:`SAVING_TOLERANCE`."""
    name = "a row of the table"
    require(name, "peak_saving", peak_saving,
            "a function (step, **technique) returning 1 - peak with / peak without")
    got = {}
    for step in STEPS:
        for key, row in TECHNIQUES.items():
            value = SINGLE[row][0][key]
            ref = measure_saving(step, row)
            have = call_learner(name, "peak_saving", functools.partial(peak_saving, **{key: value}), step)
            got[f"{key}={value} seq {step.seq} batch {step.batch}"] = have
            want = ref.saving
            if abs(have - want) <= SAVING_TOLERANCE:
                continue
            where = f"{key}={value!r} at seq {step.seq}, batch {step.batch}: you said {have:.3f}, " \
                    f"measured {want:.3f}"
            base, tech = ref.baseline, ref.with_technique
            acts = 1 - tech.activation_bytes / base.activation_bytes
            if abs(have - acts) <= SAVING_TOLERANCE:
                fail(name, f"{where}: {have:.3f} is the saving on the activations; the table's row "
                           f"is the saving on the step's peak, where the model states count too")
            if abs(have - (1 - want)) <= SAVING_TOLERANCE:
                fail(name, f"{where}: that is the share of the peak kept; the saving is 1 - it")
            fail(name, f"{where}: measure the step without and with the override "
                       f"(ml.measure_step(step) and ml.measure_step(step, **technique)) and "
                       f"compare their peak_bytes")
    return CheckResult(name, got, [f"{len(got)} savings agree with the table's measurement within "
                                   f"{SAVING_TOLERANCE:g}"])
