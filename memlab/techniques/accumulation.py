"""Gradient accumulation, checked: ``k`` micro-batches of ``b / k`` rows give the gradients
of one batch of ``b`` rows, up to float rounding.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from memlab.core.errors import InputError
from memlab.core.quiet import OneLine
from memlab.step.training_step import StepConfig, build_trainer, make_batch


@dataclass
class AccumulationCheck(OneLine):
    """One batch of ``batch`` against ``k`` micro-batches of ``batch // k``."""

    k: int
    max_abs_diff: float
    max_grad: float
    same: bool  # torch.allclose at fp32 tolerance

    def __str__(self) -> str:
        verdict = "the same gradients" if self.same else "DIFFERENT gradients"
        return (f"AccumulationCheck: {self.k} micro-batches give {verdict} as one batch "
                f"(differ by {self.max_abs_diff:.1e} at most; largest {self.max_grad:.2g})")


def _grads(step: StepConfig, k: int, seed: int, device: str = "cpu") -> list[torch.Tensor]:
    trainer = build_trainer(replace(step, micro_batches=k), device, seed=seed)
    batch = make_batch(step, device, seed=seed)
    for micro in zip(*(t.chunk(k) for t in batch), strict=True):
        (trainer.model(*micro) / k).backward()  # mean over micro-batches = mean over batch
    return [p.grad.detach().clone() for p in trainer.model.parameters()]


def accumulation_check(step: StepConfig, k: int, *, seed: int = 0, rtol: float = 1e-4,
                       atol: float = 1e-6, device: str = "cpu") -> AccumulationCheck:
    """Do ``k`` accumulated micro-batches give the gradients of one big batch? (fp32, on
    ``device``: a lesson's GPU when it has one)"""
    if k < 1 or step.batch % k:
        raise InputError(f"k={k} must be a positive divisor of batch {step.batch}")
    one = _grads(replace(step, precision="fp32"), 1, seed, device)
    acc = _grads(replace(step, precision="fp32"), k, seed, device)
    diff = max((a - b).abs().max().item() for a, b in zip(one, acc, strict=True))
    same = all(torch.allclose(a, b, rtol=rtol, atol=atol) for a, b in zip(one, acc, strict=True))
    return AccumulationCheck(k, diff, max(a.abs().max().item() for a in one), same)


__all__ = ["AccumulationCheck", "accumulation_check"]
