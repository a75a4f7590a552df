"""Lesson 17: the skip tensors of a UNet, against a measured step."""
from __future__ import annotations

from typing import Callable

from memlab.classroom.exercises.common import CheckResult, call_learner, fail, require
from memlab.core.units import fmt_bytes
from memlab.lenses.measure import measure_step
from memlab.models.diffusion import unet_levels
from memlab.step.training_step import StepConfig
from memlab.techniques.sweeps import activations_by_module


def check_skip_bytes(skip_bytes: Callable, *, image: int = 32, batch: int = 2) -> CheckResult:
    """``skip_bytes(levels, batch)`` returns the bytes of a UNet's skip tensors (each encoder
    level's fp32 output, kept until the decoder reads it) from ``levels``, the list of
    :class:`~memlab.models.diffusion.UNetLevel` that :func:`memlab.models.diffusion.unet_levels`
    returns. Checked against a measurement: with every ResBlock checkpointed, what the encoder
    keeps for backward is exactly its outputs."""
    name = "UNet skip tensors"
    require(name, "skip_bytes", skip_bytes, "a function (levels, batch) returning bytes")
    step = StepConfig(model="unet-small", seq=image, batch=batch)
    levels = unet_levels(step.model_config, image)
    report = measure_step(step, checkpointing="full")
    kept = sum(v for k, v in activations_by_module(report).items() if k.startswith("down."))
    have = call_learner(name, "skip_bytes", skip_bytes, levels, batch)
    if have != kept:
        if have * 2 == kept:
            fail(name, f"{fmt_bytes(have)}, measured {fmt_bytes(kept)}: half; the maps are fp32, "
                       f"4 bytes a value")
        if have * batch == kept:
            fail(name, f"{fmt_bytes(have)}, measured {fmt_bytes(kept)}: one image's worth; "
                       f"multiply by the batch ({batch})")
        fail(name, f"{fmt_bytes(have)}, measured {fmt_bytes(kept)}: one map per level, "
                   f"batch x channels x side^2 x 4 bytes (``tokens`` is side^2)")
    return CheckResult(name, {"skip_bytes": have, "measured": kept},
                       [f"{fmt_bytes(have)} = what the checkpointed encoder kept, measured "
                        f"({image}px, batch {batch})"])
