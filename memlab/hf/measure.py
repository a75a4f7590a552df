"""The measure lens of a Hugging Face config: its real step, random weights, under the guard.

:func:`measure_hf` builds ``transformers``' class from the config (no download) on the device
and tracks one AdamW step with :func:`memlab.lenses.your_model.track_step`, after the guard of
:mod:`memlab.lenses.guard` has compared the closed-form estimate (:func:`memlab.hf.estimate.estimate_hf`)
with what this machine has: so ``memlab estimate|simulate|measure --hf-config`` take the same
input. Real experts run transformers' own ``grouped_mm`` implementation.
"""
from __future__ import annotations

import pathlib
from dataclasses import replace

import torch

from memlab.core.errors import InputError
from memlab.core.hardware import resolve_budget
from memlab.hf.config import causal_lm_step, check_seq, is_moe, load_config
from memlab.hf.estimate import estimate_hf
from memlab.hf.simulate import build_run
from memlab.lenses.guard import HostMemoryError, StepEstimate, memory_needs, target_for
from memlab.lenses.your_model import track_step
from memlab.step.fine_tune_config import LoraConfig, QuantConfig
from memlab.step.low_bit import TORCHAO
from memlab.step.training_step import PRECISIONS, MemoryReport


def measure_hf(cfg: dict | str | pathlib.Path, *, seq: int, batch: int, precision: str = "fp32",  # noqa: PLR0913 keyword-only: the run's fields, as estimate_hf's
               checkpointing: str | None = None, attention: str | None = None,
               device: str = "cpu", budget: int | str | None = None, optimizer: str = "adamw",
               micro_batches: int = 1, lora: LoraConfig | None = None,
               quantization: QuantConfig | None = None, optimizer_in_backward: bool = False) -> MemoryReport:
    """The real training step of the HF model of ``cfg`` (random weights), tracked on
    ``device``, after the guard (:mod:`memlab.lenses.guard`): the closed-form estimate
    (:func:`memlab.hf.estimate.estimate_hf`) on the device's target is checked against what
    this machine has before anything is built (:class:`memlab.lenses.guard.HostMemoryError`).

    Args:
        cfg: a config dict, config.json, its folder or a shipped name.
        seq, batch, precision, checkpointing, attention: as :func:`memlab.hf.estimate.estimate_hf`.
        device: ``cpu`` or ``cuda``.
        budget: a simulated device size (bytes, ``"512MiB"`` or a GPU preset).
        optimizer, micro_batches, lora, quantization: the run, as the estimate takes them; the step
            is the one :func:`memlab.hf.simulate.simulate_hf` runs on fake tensors
            (:func:`memlab.hf.simulate.build_run`, :func:`memlab.hf.config.causal_lm_step`), here real:
            bitsandbytes' own optimizers and ``Linear4bit``, peft's adapters.
        optimizer_in_backward: the optimizer step fused into backward (:func:`memlab.hf.config.build_fn`).

    Returns:
        The :class:`MemoryReport` of :func:`memlab.lenses.your_model.track_step` (lens ``measure``).
    """
    if device not in ("cpu", "cuda"):
        raise InputError(f"unknown device {device!r}; allowed: cpu, cuda")
    if precision not in PRECISIONS or precision == "fp16":
        raise InputError(f"precision={precision!r} for a Hugging Face step; allowed: fp32, bf16, "
                         f"pure-bf16")
    d = load_config(cfg)
    check_seq(d, seq)
    run = dict(optimizer=optimizer, micro_batches=micro_batches, lora=lora, quantization=quantization)
    est = estimate_hf(d, seq=seq, batch=batch, precision=precision, checkpointing=checkpointing,
                      attention=attention, target=target_for(device),
                      optimizer_in_backward=optimizer_in_backward, **run)
    cats = est.by_category
    held = cats["parameters"] + cats["optimizer"] + cats["parameters"]  # gradients as the weights
    guess = StepEstimate(est.peak_bytes, cats["parameters"], cats["optimizer"], held, 0, None, dict(cats))
    for need in memory_needs(None, device, resolve_budget(budget), est=guess):
        if not need.fits:
            raise HostMemoryError(need.need_bytes, need.available_bytes, need.resource, need.rule)
    with torch.device(device):  # real experts run transformers' own grouped_mm
        model, opt = build_run(d, precision=precision, checkpointing=checkpointing, attention=attention,
                               optimizer=optimizer, lora=lora, quantization=quantization,
                               optimizer_in_backward=optimizer_in_backward)()
        step = causal_lm_step(seq, batch, precision, micro_batches=micro_batches)
        # torchao's update is compiled (torch.compile(fullgraph=True), adam.py:142): no dispatch mode
        report = track_step(lambda: step(model, opt), model=model, optimizer=opt, budget=budget,
                            compiled=optimizer in TORCHAO, seq=seq, batch=batch, precision=precision,
                            checkpointing=checkpointing or "none")
    report.step = replace(report.step, name=(d.get("architectures") or [d["model_type"]])[0])
    if is_moe(d):
        report.notes.append("experts: transformers' grouped_mm implementation; the router of "
                            "random weights decides which experts get tokens")
    return report


__all__ = ["measure_hf"]
