"""Real DeepSpeed ZeRO on a Hugging Face decoder: the measure lens of a ZeRO run, per rank.

:func:`measure_zero_hf` starts the ranks of :func:`memlab.distributed.deepspeed_zero.measure_zero`
(gloo ranks on this CPU, one GPU a rank on CUDA) with ``transformers``' class of the config as
each rank's model (:func:`memlab.hf.simulate.build_run`: peft's adapters where the run has LoRA),
wrapped by :class:`CausalLMLoss` so that DeepSpeed's engine calls it as it calls memlab's GPT.
Each rank's peak, by category, is the tracker's; DeepSpeed's own accounting comes with it. It is
the truth :func:`memlab.hf.simulate.simulate_hf` and :func:`memlab.lenses.estimate.estimate_step` are
held to for ZeRO (``tests/test_hf_zero.py``).
"""
from __future__ import annotations

import functools
import pathlib

from torch import nn

from memlab.core.errors import InputError
from memlab.distributed.deepspeed_zero import measure_zero
from memlab.hf.config import load_config
from memlab.hf.shape import decoder_shape
from memlab.hf.simulate import build_run
from memlab.lenses.estimate import estimate_step
from memlab.models.decoder_shape import DecoderShape
from memlab.step.training_step import MemoryReport, StepConfig


class CausalLMLoss(nn.Module):
    """A causal LM whose forward takes memlab's batch and returns the class's own loss.

    DeepSpeed's engine calls its module with the batch's tensors (``engine(idx, targets)``);
    ``transformers`` shifts the labels itself, so the tokens are their own labels, as
    :func:`memlab.hf.config.causal_lm_step` passes them: the same loss, its fp32 logits included.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx, targets):  # noqa: ARG002 the labels are the tokens (see the class doc)
        return self.model(input_ids=idx, labels=idx).loss


def causal_lm_for(cfg: dict, step: StepConfig) -> CausalLMLoss:
    """The model of ``step`` for one rank: ``cfg``'s class with the step's precision,
    checkpointing, attention, LoRA and quantisation (:func:`memlab.hf.simulate.build_run`; the
    optimizer it builds is dropped, DeepSpeed builds its own).

    Args:
        cfg: the Hugging Face config dict (:func:`memlab.hf.config.load_config`).
        step: the run (a :class:`DecoderShape` model read from ``cfg``).

    Returns:
        The model under :class:`CausalLMLoss`.
    """
    model, _ = build_run(cfg, precision=step.precision, checkpointing=step.checkpointing,
                         attention=step.attention, lora=step.lora, quantization=step.quantization)()
    return CausalLMLoss(model)


def measure_zero_hf(cfg: dict | str | pathlib.Path, steps: list[StepConfig], *, device: str | None = "cpu",
                    timeout: float = 600.0, budget: int | str | None = None,
                    ds_config: dict | None = None) -> list[MemoryReport]:
    """Each ZeRO run of ``steps`` with real DeepSpeed on ``cfg``'s class, in one launch.

    Args:
        cfg: a config dict, config.json, its folder or a shipped name.
        steps: the runs, each a :class:`StepConfig` whose model is ``cfg``'s shape
            (:func:`memlab.hf.shape.decoder_shape`), all with one ``world_size``.
        device, timeout, budget, ds_config: as :func:`memlab.distributed.deepspeed_zero.measure_zero`.

    Returns:
        One :class:`MemoryReport` per step (lens ``measure``, the largest rank's peak,
        ``per_rank`` one report per rank).

    Raises:
        InputError: a step whose model is not ``cfg``'s shape, or one DeepSpeed's config refuses.
    """
    d = load_config(cfg)
    shape = decoder_shape(d)
    for s in steps:
        if not isinstance(s.model, DecoderShape) or s.model != shape:
            raise InputError(f"step model {getattr(s.model, 'name', s.model)!r} is not the shape of "
                             f"config {shape.name!r}; allowed: StepConfig(decoder_shape(cfg), ...)")
    target = "cpu" if device in (None, "cpu") else "cuda"
    estimates = [estimate_step(s, target=target) for s in steps]
    return measure_zero(steps, device=device, timeout=timeout, budget=budget, ds_config=ds_config,
                        model_fn=functools.partial(causal_lm_for, d), estimates=estimates)


__all__ = ["CausalLMLoss", "causal_lm_for", "measure_zero_hf"]
