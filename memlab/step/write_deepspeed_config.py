"""The DeepSpeed config a training step describes: written here, read by DeepSpeed.

:func:`deepspeed_config` turns a :class:`~memlab.step.training_step.StepConfig` (ZeRO stage, offload,
precision, micro-batches, checkpointing) into the JSON ``deepspeed.initialize`` takes, shaped
like the curriculum's config, with memlab's bucket sizes (:data:`memlab.step.states.BUCKET_ELEMENTS`).
``paper_collectives=True`` adds the keys under which DeepSpeed moves the ZeRO paper's bytes
(:data:`REDUCE_TO_OWNER`, :data:`GATHER_EVERY_USE`; :mod:`memlab.time.communication`'s
``engine="deepspeed-reduce-scatter"`` is their formula); the default leaves DeepSpeed's own.
``accelerator="cuda"`` writes the config a card runs (fp16 with DeepSpeed's dynamic loss
scaling, which its CPU accelerator lacks), ``step.parallel.tensor`` DeepSpeed's AutoTP degree.

:func:`deepspeed_batch_sizes` is DeepSpeed's own batch rule (``train_batch_size = micro-batch x
accumulation x data-parallel ranks``, each derived from the other two), which the writer
follows and :func:`memlab.hf.read_run_configs.read_deepspeed` applies to a config it reads.
"""
from __future__ import annotations

from typing import Any

from memlab.core.errors import InputError
from memlab.step.states import BUCKET_ELEMENTS, PERSISTENCE_THRESHOLD, ZeroBuckets

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
#: the precisions a config for DeepSpeed's CPU accelerator may run: it has no fp16 loss scaling
CPU_PRECISIONS = ("fp32", "bf16")
#: the precisions a config for a card may run: fp16 with DeepSpeed's dynamic loss scaling too
CUDA_PRECISIONS = ("fp32", "bf16", "fp16")


def deepspeed_batch_sizes(train: int | None, micro: int | None, accumulation: int | None,
                          world_size: int) -> tuple[int, int, int]:
    """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)`` as
    DeepSpeed derives them from those a config gives on ``world_size`` data-parallel ranks, and
    refuses them, in its own words (DeepSpeed 0.19 ``deepspeed/runtime/config.py``,
    ``DeepSpeedConfig._set_batch_related_parameters`` and ``_batch_assertion``): any two give the
    third (integer division), the train batch alone means no accumulation, the micro-batch alone
    too; then ``train = micro x accumulation x world_size``, each positive."""
    if train is not None and micro is not None and accumulation is not None:
        pass
    elif train is not None and micro is not None:
        accumulation = train // micro // world_size
    elif train is not None and accumulation is not None:
        micro = train // world_size // accumulation
    elif micro is not None and accumulation is not None:
        train = micro * accumulation * world_size
    elif train is not None:
        accumulation, micro = 1, train // world_size
    elif micro is not None:
        train, accumulation = micro * world_size, 1
    else:
        raise InputError("DeepSpeed rejects this config: Either train_batch_size or "
                         "train_micro_batch_size_per_gpu needs to be provided")
    for value, what in ((train, "Train batch size"), (micro, "Micro batch size per gpu"),
                        (accumulation, "Gradient accumulation steps")):
        if not value > 0:
            raise InputError(f"DeepSpeed rejects this config: {what}: {value} has to be greater than 0")
    if train != micro * accumulation * world_size:
        raise InputError(f"DeepSpeed rejects this config: Check batch related parameters. train_batch_size "
                         f"is not equal to micro_batch_per_gpu * gradient_acc_step * world_size {train} != "
                         f"{micro} * {accumulation} * {world_size}")
    return train, micro, accumulation


def check_accelerator_precision(precision: str, accelerator: str) -> None:
    """Refuse (:class:`InputError`) an accelerator other than ``"cpu"``/``"cuda"``, or a precision
    DeepSpeed cannot run on it (:data:`CPU_PRECISIONS`, :data:`CUDA_PRECISIONS`)."""
    if accelerator not in ("cpu", "cuda"):
        raise InputError(f"accelerator={accelerator!r}; allowed: cpu, cuda")
    if precision not in (CPU_PRECISIONS if accelerator == "cpu" else CUDA_PRECISIONS):
        if accelerator == "cpu":
            raise InputError(f"precision={precision!r} for DeepSpeed here; allowed: fp32, bf16 "
                             f"(fp16 loss scaling is not supported by DeepSpeed's CPU accelerator)")
        raise InputError(f"precision={precision!r} for DeepSpeed; allowed: {', '.join(CUDA_PRECISIONS)}")


def deepspeed_config(step, *, bucket_elements: int = BUCKET_ELEMENTS,
                     persistence_threshold: int = PERSISTENCE_THRESHOLD,
                     torch_adam: bool = True, paper_collectives: bool = False,
                     accelerator: str = "cpu") -> dict:
    """The DeepSpeed config for ``step`` (a :class:`~memlab.step.training_step.StepConfig`).

    Modelled on the curriculum's config (course/curriculum.md, section 5) (train_batch_size,
    gradient_accumulation_steps, fp16/bf16, zero_optimization with offload,
    activation_checkpointing). ``step.batch`` is the batch of one rank, so train_batch_size = batch
    x world_size. Adam runs as ``torch.optim.AdamW`` (``torch_adam``): no op is compiled, and the
    state lives where ZeRO puts it. ``torch_adam=False`` (offload only) lets DeepSpeed run its
    compiled ``DeepSpeedCPUAdam``. ``paper_collectives`` adds :data:`REDUCE_TO_OWNER` (stages
    1-2) or :data:`GATHER_EVERY_USE` (stage 3): the ZeRO paper's collectives (sec. 7), at the
    cost of ZeRO-3 re-gathering what it could keep. ``accelerator``: ``"cpu"`` (DeepSpeed's CPU
    accelerator: :data:`CPU_PRECISIONS`) or ``"cuda"`` (a card: fp16 too, with dynamic loss
    scaling, ``loss_scale`` 0). ``step.parallel.tensor``: DeepSpeed's AutoTP degree t (DeepSpeed >=
    0.16.4 splits the Linear layers; the data-parallel degree, which the train batch counts, is
    world_size / t).

    A run's own buffer sizes (``step.buckets``, a decoder's run) replace ``bucket_elements`` and
    ``persistence_threshold``: the config writes the run the lenses count.

    A dict because it is a DeepSpeed config, as ``deepspeed.initialize`` reads it.
    """
    check_accelerator_precision(step.precision, accelerator)
    tensor_parallel = step.parallel.tensor
    if step.world_size % tensor_parallel:
        raise InputError(f"parallel.tensor={tensor_parallel!r} on {step.world_size} ranks; allowed: a "
                         f"divisor of the world size")
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
    b = step.buckets or ZeroBuckets(reduce=bucket_elements, prefetch=bucket_elements, max_live=4 * bucket_elements,
                                    persistence=persistence_threshold)
    zero: dict[str, Any] = {"stage": step.zero, "reduce_bucket_size": b.reduce, "allgather_bucket_size": b.reduce,
                            "contiguous_gradients": True, "overlap_comm": b.overlap_comm}
    if step.zero == 3:
        zero.update(stage3_prefetch_bucket_size=b.prefetch, stage3_param_persistence_threshold=b.persistence,
                    stage3_max_live_parameters=b.max_live, stage3_max_reuse_distance=b.max_live,
                    sub_group_size=b.sub_group)
    if paper_collectives and step.zero in (1, 2):
        zero.update(REDUCE_TO_OWNER)
    if paper_collectives and step.zero == 3:
        zero.update(GATHER_EVERY_USE)
    if step.offload in ("optimizer", "all"):
        zero["offload_optimizer"] = {"device": "cpu"}
    if step.offload == "all":
        zero["offload_param"] = {"device": "cpu"}
    train, micro, accumulation = deepspeed_batch_sizes(None, step.batch // step.micro_batches,
                                                       step.micro_batches, step.world_size // tensor_parallel)
    fp16 = {"enabled": True, "loss_scale": 0} if step.precision == "fp16" else {"enabled": False}
    cfg = {
        "train_batch_size": train,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": torch_adam}},
        "fp16": fp16,
        "bf16": {"enabled": step.precision == "bf16"},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    # a GPT's switch lives in its config; a decoder's shape has none, its step holds it
    checkpointing = getattr(step.model_config, "checkpointing", None) or step.checkpointing or "none"
    if checkpointing != "none":
        cfg["activation_checkpointing"] = {"partition_activations": step.zero == 3,
                                           "contiguous_memory_optimization": False}
    if tensor_parallel > 1:
        cfg["tensor_parallel"] = {"autotp_size": tensor_parallel}
    return cfg
