"""The estimate of a Hugging Face decoder from its ``config.json``: the config read into its
shape (:func:`memlab.hf.shape.decoder_shape`) and a run, then counted by the one decoder estimate,
:func:`memlab.lenses.decoder_estimate.estimate_run` (where every term is, op by op).
"""
from __future__ import annotations

import pathlib

from memlab.hf.config import load_config
from memlab.hf.shape import decoder_shape
from memlab.lenses.decoder_estimate import Sizes, attention_path, estimate_run, kept_activations
from memlab.policy import precision_bytes, resolve_target
from memlab.step.decoder_states import adapters_for
from memlab.step.fine_tune_config import LoraConfig, QuantConfig
from memlab.step.parallel_dims import ParallelDims
from memlab.step.states import ZeroBuckets
from memlab.step.training_step import MemoryReport, StepConfig


def forward_activations(cfg: dict | str | pathlib.Path, *, seq: int, batch: int, precision: str = "fp32",
                        checkpointing: str | None = None, attention: str | None = None,
                        target: str | None = None, lora: LoraConfig | None = None,
                        quantized: bool = False) -> int:
    """Bytes of activations the step keeps when its forward reaches the loss (the logits'
    log-softmax not included), by the same terms as :func:`estimate_hf`.

    Args:
        cfg, seq, batch, precision, checkpointing, attention, target, lora: as :func:`estimate_hf`.
        quantized: the base is in 4 or 8 bits (bitsandbytes' matmul saves the packed weight, no cast copy).

    Returns:
        The bytes, an int.
    """
    s = decoder_shape(cfg)
    param, compute, lower = precision_bytes(precision)
    z = Sizes(w=param, c=compute, r=param, auto=lower is not None, target=resolve_target(target),
              precision=precision)
    path = attention_path(s, z, batch, seq, attention)
    ad = None if lora is None else adapters_for(s, lora, precision, quantized)
    return int(round(kept_activations(s, z, batch, seq, path, checkpointing == "full", s.num_params(), adapters=ad)[0]))


def estimate_hf(cfg: dict | str | pathlib.Path, *, seq: int, batch: int, precision: str = "fp32",  # noqa: PLR0913 keyword-only: the run's fields, as the CLI's flags
                checkpointing: str | None = None, attention: str | None = None,
                target: str | None = None, budget: int | str | None = None, card=None,
                expert_parallel: int = 1, imbalance: float = 1.0, optimizer: str = "adamw",
                zero: int = 0, world_size: int = 1, offload: str = "none",
                micro_batches: int = 1, lora: LoraConfig | None = None,
                quantization: QuantConfig | None = None, buckets: ZeroBuckets | None = None,
                loss: str = "transformers", loss_chunk: int = 1024,
                optimizer_in_backward: bool = False, tensor_parallel: int = 1,
                implementation: str = "transformers") -> MemoryReport:
    """Closed-form peak bytes of one training step of the HF decoder of ``cfg``, per rank.

    Args:
        cfg: a config dict, config.json, its folder or a shipped name (:data:`memlab.hf.config.SHIPPED`).
        seq, batch: tokens per sequence (up to the model's context) and sequences per rank.
        precision: ``fp32``, ``bf16`` or ``fp16`` (autocast on fp32 weights; fp16's loss
            scaler keeps one scalar) or ``pure-bf16``.
        checkpointing: ``none`` or ``full`` (HF checkpoints each decoder layer).
        attention: ``None`` (the class's SDPA where it has one), ``naive`` (eager) or ``sdpa``.
        target: ``cpu`` or ``cuda`` (:func:`memlab.policy.resolve_target`).
        expert_parallel: ranks the routed experts are divided across (an MoE config only).
        imbalance: the busiest rank's tokens over the balanced share (>= 1).
        optimizer: one of :data:`memlab.step.low_bit.OPTIMIZER_STATES` (8-bit, paged and Adafactor
            state as bitsandbytes and transformers allocate it).
        zero, world_size, offload: DeepSpeed's ZeRO stage over ``world_size`` data-parallel
            ranks with its offload, whose model states and buffers :func:`memlab.step.states.model_states`
            counts from the class's parameter tensors; in bf16 DeepSpeed runs the model cast to
            16 bits, so the activations are pure bf16's.
        micro_batches: ``batch`` split into this many accumulated micro-batches.
        lora: LoRA adapters (:class:`memlab.step.fine_tune_config.LoraConfig`) on a frozen base
            (:class:`memlab.step.decoder_states.Adapters`).
        quantization: the base in 4 or 8 bits (:class:`memlab.step.fine_tune_config.QuantConfig`; needs ``lora``).
        buckets: DeepSpeed's buffer sizes as a run's config sets them (:class:`memlab.step.states.ZeroBuckets`).
        loss: ``transformers`` (the class's own loss: the logits upcast to fp32, then
            cross-entropy) or ``chunked`` (the final hidden states and the head's weight into
            :func:`memlab.models.chunked_loss.linear_cross_entropy`, ``loss_chunk`` tokens at a time:
            :data:`memlab.step.training_step.DECODER_LOSSES`).
        optimizer_in_backward: the optimizer step fused into backward (:mod:`memlab.step.optimizer_in_backward`):
            a full fine-tune of a dense decoder, one micro-batch, no ZeRO.
        tensor_parallel: Megatron-LM's tensor parallelism in groups of ``t`` of the
            ``world_size`` ranks (:func:`memlab.lenses.decoder_estimate.estimate_run`).
        implementation: whose code trains the model (:data:`memlab.step.training_step.DECODER_IMPLEMENTATIONS`):
            ``transformers`` (the class) or ``litgpt-8641822``/``litgpt-6178c7cc``
            (:mod:`memlab.lenses.litgpt_estimate`).

    Returns:
        A :class:`MemoryReport` (lens ``estimate``) per rank.
    """
    s = decoder_shape(load_config(cfg))
    run = StepConfig(s, seq=seq, batch=batch, precision=precision, checkpointing=checkpointing, attention=attention,
                     optimizer=optimizer, micro_batches=micro_batches, zero=zero, world_size=world_size,
                     offload=offload, lora=lora, quantization=quantization, loss=loss, loss_chunk=loss_chunk,
                     buckets=buckets, optimizer_in_backward=optimizer_in_backward, implementation=implementation,
                     parallel=ParallelDims(tensor=tensor_parallel, expert=expert_parallel, expert_imbalance=imbalance))
    return estimate_run(run, target=target, budget=budget, card=card)


__all__ = ["estimate_hf", "forward_activations"]
