"""Lesson 06: gradient accumulation."""
from __future__ import annotations

from typing import Callable

import torch

from memlab.classroom.exercises.common import (
    CheckResult,
    call_learner,
    fail,
    max_activations,
    rel_diff,
    require,
    tiny_model,
)
from memlab.core.errors import InputError
from memlab.core.units import fmt_bytes
from memlab.models.gpt_unet import GPT
from memlab.step.training_step import StepConfig, make_batch
from memlab.tracking.tracker import MemoryTracker

ACC_TOLERANCE = 1e-5  # fp32 sums in another order


class RecordingOptimizer(torch.optim.Optimizer):
    """An optimizer that changes nothing: ``step`` records the gradients it was handed."""

    def __init__(self, params):
        super().__init__(params, {})
        self.steps = 0
        self.grads: list[torch.Tensor | None] = []

    @torch.no_grad()
    def step(self, closure=None):
        self.steps += 1
        self.grads = [None if p.grad is None else p.grad.clone()
                      for g in self.param_groups for p in g["params"]]


def _big_batch(model: GPT, batch: tuple) -> tuple[list[torch.Tensor], int]:
    tracker = MemoryTracker()
    with tracker:
        tracker.track_model(model)
        model(*batch).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads, max_activations(tracker)


def check_accumulation(accumulate: Callable, *, k: int = 4, seq: int = 32,
                       batch: int = 8) -> CheckResult:
    """``accumulate(model, optimizer, batch, k)``: one optimizer step over ``k`` micro-batches.

    Checked on two consecutive steps: ``optimizer.step()`` runs once per call; the gradients it
    sees equal one big batch's within :data:`ACC_TOLERANCE` (relative to the largest gradient);
    the activations alive at once are at most 1.5/k of the big batch's.
    """
    name = "gradient accumulation"
    require(name, "accumulate", accumulate,
            "def accumulate(model, optimizer, batch, k): one optimizer step over k micro-batches")
    if batch % k:
        raise InputError(f"batch {batch} is not divisible by k={k}; choose a divisor")
    step = StepConfig(model="tiny", seq=seq, batch=batch)
    data = [make_batch(step, seed=s) for s in (0, 1)]
    ref_model = tiny_model()
    refs = [_big_batch(ref_model, b) for b in data]
    model = tiny_model()
    opt = RecordingOptimizer(model.parameters())
    diffs, acts = [], []
    for i, b in enumerate(data):
        tracker = MemoryTracker()
        with tracker:
            tracker.track_model(model)
            call_learner(name, "your accumulate", accumulate, model, opt, b, k)
        acts.append(max_activations(tracker))
        if opt.steps != i + 1:
            fail(name, f"optimizer.step() ran {opt.steps - i} times in one call: step once, "
                        f"after all {k} micro-batches")
        if any(g is None for g in opt.grads):
            fail(name, "some weights had no gradient at optimizer.step(): call backward on "
                        "every micro-batch's loss before stepping")
        ref = refs[i][0]
        diff = rel_diff(opt.grads, ref)
        diffs.append(diff)
        if diff <= ACC_TOLERANCE:
            continue
        msg = f"gradients differ from one batch of {batch} by {diff:.1e} (allowed {ACC_TOLERANCE:g})"
        if rel_diff(opt.grads, [g * k for g in ref]) <= ACC_TOLERANCE:
            fail(name, f"{msg}: they are {k} times too large; did you divide the loss by k?")
        if i == 1 and rel_diff(opt.grads, [a + b for a, b in zip(ref, refs[0][0], strict=True)]) <= ACC_TOLERANCE:
            fail(name, f"{msg}: the previous step's gradients were still there; zero them "
                        f"(optimizer.zero_grad(set_to_none=True)) once per optimizer step")
        fail(name, f"{msg}: the loss of each micro-batch is a mean over batch/k samples; divide "
                    f"it by k and let backward add into .grad, zeroing only once per step")
    big = max(r[1] for r in refs)
    if max(acts) > 1.5 * big / k:
        fail(name, f"{fmt_bytes(max(acts))} of activations were alive at once, one batch of "
                    f"{batch} keeps {fmt_bytes(big)}: {k} micro-batches should keep about 1/{k} of it; "
                    f"call backward on each micro-batch's loss before the next forward")
    return CheckResult(name, {"max_grad_diff": max(diffs), "activation_bytes": max(acts),
                              "big_batch_activation_bytes": big},
                       [f"one optimizer step per call; gradients equal one batch of {batch} "
                        f"within {max(diffs):.1e} (allowed {ACC_TOLERANCE:g})",
                        f"activations alive at once {fmt_bytes(max(acts))}, one big batch "
                        f"{fmt_bytes(big)} (x{max(acts) / big:.2f}, 1/k = {1 / k:.2f})"])


