"""The DeepSpeed config a training step describes: written here, read by DeepSpeed.

:func:`deepspeed_config` turns a :class:`~memlab.step.training_step.StepConfig` (ZeRO stage, offload,
precision, micro-batches, checkpointing) into the JSON ``deepspeed.initialize`` takes, shaped
like the curriculum's config, with memlab's bucket sizes (:data:`memlab.step.states.BUCKET_ELEMENTS`).
``paper_collectives=True`` adds the keys under which DeepSpeed moves the ZeRO paper's bytes
(:data:`REDUCE_TO_OWNER`, :data:`GATHER_EVERY_USE`; :mod:`memlab.time.communication`'s
``engine="deepspeed-reduce-scatter"`` is their formula); the default leaves DeepSpeed's own.
"""
from __future__ import annotations

from typing import Any

from memlab.core.errors import InputError
from memlab.step.states import BUCKET_ELEMENTS, PERSISTENCE_THRESHOLD

#: ZeRO-1/2: each gradient slice is reduced to the rank that owns its partition (``dist.reduce``
#: in ``average_tensor`` of DeepSpeed 0.19's ``stage_1_and_2.py``), which together is the
#: paper's reduce-scatter; by default (``use_multi_rank_bucket_allreduce`` true) every bucket
#: is all-reduced instead, twice the bytes
REDUCE_TO_OWNER: dict[str, Any] = {"use_multi_rank_bucket_allreduce": False, "reduce_scatter": True}
#: ZeRO-3: no parameter kept whole (persistence threshold 0), none kept gathered for its next
#: use (reuse distance 0) nor fetched ahead (prefetch 0, whose fetched parameters are kept
#: until their use): every module gathers its weights in forward and again in backward
GATHER_EVERY_USE: dict[str, Any] = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                                    "stage3_prefetch_bucket_size": 0}


def deepspeed_config(step, *, bucket_elements: int = BUCKET_ELEMENTS,
                     persistence_threshold: int = PERSISTENCE_THRESHOLD,
                     torch_adam: bool = True, paper_collectives: bool = False) -> dict:
    """The DeepSpeed config for ``step`` (a :class:`~memlab.step.training_step.StepConfig`).

    Modelled on the curriculum's config (course/curriculum.md, section 5) (train_batch_size,
    gradient_accumulation_steps, fp16/bf16, zero_optimization with offload,
    activation_checkpointing). ``step.batch`` is the batch of one rank, so train_batch_size = batch
    x world_size. Adam runs as ``torch.optim.AdamW`` (``torch_adam``): no op is compiled, and the
    state lives where ZeRO puts it. ``torch_adam=False`` (offload only) lets DeepSpeed run its
    compiled ``DeepSpeedCPUAdam``. ``paper_collectives`` adds :data:`REDUCE_TO_OWNER` (stages
    1-2) or :data:`GATHER_EVERY_USE` (stage 3): the ZeRO paper's collectives (sec. 7), at the
    cost of ZeRO-3 re-gathering what it could keep.

    A dict because it is a DeepSpeed config, as ``deepspeed.initialize`` reads it.
    """
    if step.precision not in ("fp32", "bf16"):
        raise InputError(f"precision={step.precision!r} for DeepSpeed here; allowed: fp32, bf16 "
                         f"(fp16 loss scaling is not supported by DeepSpeed's CPU accelerator)")
    if step.optimizer != "adamw":
        raise InputError(f"optimizer={step.optimizer!r} for DeepSpeed here; allowed: adamw")
    if step.offload == "all" and step.zero != 3:
        raise InputError(f"offload='all' (parameters too) needs ZeRO stage 3, got stage {step.zero}")
    if step.offload == "optimizer" and step.zero == 0:
        raise InputError("offload='optimizer' needs ZeRO stage 1-3, got stage 0")
    if bucket_elements < 1:
        raise InputError(f"bucket_elements must be positive, got {bucket_elements}")
    if not torch_adam and step.offload == "none":
        raise InputError("torch_adam=False selects DeepSpeedCPUAdam, which runs on the host: "
                         "it needs offload='optimizer' or 'all'")
    zero: dict[str, Any] = {"stage": step.zero, "reduce_bucket_size": bucket_elements,
                            "allgather_bucket_size": bucket_elements,
                            "contiguous_gradients": True, "overlap_comm": False}
    if step.zero == 3:
        zero.update(stage3_prefetch_bucket_size=bucket_elements,
                    stage3_param_persistence_threshold=persistence_threshold,
                    stage3_max_live_parameters=4 * bucket_elements,
                    stage3_max_reuse_distance=4 * bucket_elements)
    if paper_collectives and step.zero in (1, 2):
        zero.update(REDUCE_TO_OWNER)
    if paper_collectives and step.zero == 3:
        zero.update(GATHER_EVERY_USE)
    if step.offload in ("optimizer", "all"):
        zero["offload_optimizer"] = {"device": "cpu"}
    if step.offload == "all":
        zero["offload_param"] = {"device": "cpu"}
    cfg = {
        "train_batch_size": step.batch * step.world_size,
        "train_micro_batch_size_per_gpu": step.batch // step.micro_batches,
        "gradient_accumulation_steps": step.micro_batches,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": torch_adam}},
        "fp16": {"enabled": False},
        "bf16": {"enabled": step.precision == "bf16"},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if step.model_config.checkpointing != "none":
        cfg["activation_checkpointing"] = {"partition_activations": step.zero == 3,
                                           "contiguous_memory_optimization": False}
    return cfg
