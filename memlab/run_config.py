"""A run as its own configs write it: a DeepSpeed JSON, a peft ``adapter_config.json``.

:func:`read_deepspeed` reads a DeepSpeed config the way a Hugging Face ``Trainer`` run hands it
to DeepSpeed: its ``"auto"`` values filled by ``transformers``' own
``HfTrainerDeepSpeedConfig`` (``trainer_config_process`` and ``trainer_config_finalize`` in
``transformers/integrations/deepspeed.py``: the micro-batch from the per-device batch,
``train_batch_size = world_size x micro-batch x accumulation``, ``fp16``/``bf16`` from the
precision, ``reduce_bucket_size = hidden^2``, ``stage3_prefetch_bucket_size = 0.9 hidden^2``,
``stage3_param_persistence_threshold = 10 hidden``), then parsed and checked by DeepSpeed's
own ``DeepSpeedConfig`` as rank 0 of the world size on a fake process group
(:func:`memlab.distributed.deepspeed_rank0.fake_ranks`): the batch sizes DeepSpeed derives,
its defaults for every key the file leaves out (``reduce_bucket_size`` 5e8,
``stage3_prefetch_bucket_size`` 5e7, ...), and its refusal, in its own words, of a config it
would reject. The result, :class:`DeepSpeedRun`, is a :class:`~memlab.step.StepConfig`
(stage, offload, precision, micro-batch and accumulation) and the
:class:`~memlab.states.ZeroBuckets` the estimate honours.

``activation_checkpointing`` configures ``deepspeed.checkpointing``, which only a model that
calls ``deepspeed.checkpointing.checkpoint`` uses (Megatron-DeepSpeed); a Hugging Face model
checkpoints with ``gradient_checkpointing`` (``--checkpointing full``). Its
``partition_activations`` splits each checkpoint across the *model-parallel* ranks: under pure
data parallelism there are none, so it divides nothing. Both are said in a note.

:func:`read_lora_config` reads peft's ``adapter_config.json`` (``r``, ``target_modules``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import pathlib
import re
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace
from unittest import mock

from .distributed.ranks import set_cache_env
from .errors import InputError
from .finetune import GPT2_TARGETS, LLAMA_TARGETS
from .hf_config_check import recorded
from .low_bit import HF_OPTIMIZERS
from .models import GPTConfig
from .quiet import quiet_build
from .run import LoraConfig
from .states import ZeroBuckets

#: "auto" keys a DeepSpeed config may leave to the Trainer and that memlab fills as it does
HIDDEN_AUTO = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
DS_PRECISIONS = ("fp32", "bf16", "fp16")


def load_file(path: str | pathlib.Path | dict, what: str = "config") -> dict:
    """A JSON or YAML file (by its suffix; JSON first otherwise) as a dict, or ``path`` if it
    is one already. A missing or unreadable file is bad input naming it."""
    if isinstance(path, dict):
        return json.loads(json.dumps(path))  # a deep copy: the readers fill values in
    p = pathlib.Path(path)
    if not p.is_file():
        raise InputError(f"{what} {str(path)!r}: no such file; allowed: a JSON or YAML file")
    text = p.read_text()
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # json and yaml raise their own error types
        raise InputError(f"{what} {str(p)!r} is not valid {'YAML' if p.suffix in ('.yaml', '.yml') else 'JSON'}: "
                         f"{' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise InputError(f"{what} {str(p)!r} holds {type(data).__name__}, not a mapping of keys")
    return data


@dataclass(frozen=True)
class DeepSpeedRun:
    """What DeepSpeed makes of a config on ``world_size`` ranks (module doc).

    ``config``: the config with its ``"auto"`` values filled; ``micro_batch``,
    ``accumulation`` and ``train_batch`` as DeepSpeed derives them; ``zero``, ``offload``
    (``"none"``, ``"optimizer"``, ``"all"``), ``precision`` (``fp32``/``bf16``/``fp16``);
    ``offload_device`` (``cpu``/``nvme``/``none``); ``buckets`` the sizes the estimate
    honours; ``notes`` what memlab does not model or what the config does not do."""

    config: dict
    world_size: int
    zero: int
    offload: str
    precision: str
    micro_batch: int
    accumulation: int
    train_batch: int
    buckets: ZeroBuckets
    offload_device: str = "none"
    checkpointing_block: bool = False
    partition_activations: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def batch(self) -> int:
        """Sequences per rank per optimizer step (memlab's ``batch``): micro-batch x accumulation."""
        return self.micro_batch * self.accumulation

    def step_fields(self) -> dict:
        """The :class:`~memlab.step.StepConfig` fields this config decides."""
        return {"batch": self.batch, "micro_batches": self.accumulation, "precision": self.precision,
                "zero": self.zero, "offload": self.offload, "world_size": self.world_size}


def _has_auto(node) -> bool:
    """Whether a config (or any section of it) leaves a value ``"auto"``."""
    if isinstance(node, dict):
        return any(_has_auto(v) for v in node.values())
    return node == "auto"


def _trainer_args(config: dict, world_size: int, batch: int | None, micro_batches: int | None,
                  precision: str | None) -> SimpleNamespace:
    """The TrainingArguments fields HF's DeepSpeed integration reads: the config's own value
    where it gives one (so they match), else the flags'."""
    def given(key: str):
        v = config.get(key)
        return None if v in (None, "auto") else int(v)

    accumulation = given("gradient_accumulation_steps") or micro_batches or 1
    micro = given("train_micro_batch_size_per_gpu")
    if micro is None:
        train = given("train_batch_size")
        if train is not None and train % (accumulation * world_size) == 0:
            micro = train // (accumulation * world_size)  # what DeepSpeed would derive
        elif batch is not None:
            micro = max(1, batch // (micro_batches or 1))
        else:
            micro = 1
    flags = {k: (config.get(k) or {}).get("enabled") for k in ("fp16", "bf16")}
    fp16 = flags["fp16"] if flags["fp16"] not in (None, "auto") else precision == "fp16"
    bf16 = flags["bf16"] if flags["bf16"] not in (None, "auto") else precision in ("bf16", "pure-bf16")
    return SimpleNamespace(world_size=world_size, per_device_train_batch_size=micro,
                           gradient_accumulation_steps=accumulation, max_grad_norm=1.0,
                           learning_rate=5e-5, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                           weight_decay=0.0, save_on_each_node=False, fp16=bool(fp16),
                           fp16_full_eval=False, bf16=bool(bf16), bf16_full_eval=False,
                           get_warmup_steps=lambda steps: 0)


def resolve_auto(config: dict, args: SimpleNamespace, hidden_size: int) -> dict:
    """``config`` with its ``"auto"`` values filled by transformers' ``HfTrainerDeepSpeedConfig``
    from ``args`` (TrainingArguments' fields) and the model's ``hidden_size``, as the Trainer
    does; a value that contradicts the arguments is HF's mismatch error, as bad input."""
    set_cache_env()
    with quiet_build(stream=sys.stderr):  # deepspeed's import logs to stdout and runs the linker
        from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config
        hf = HfTrainerDeepSpeedConfig(config)
    try:
        hf.trainer_config_process(args)
        model = SimpleNamespace(config=SimpleNamespace(hidden_size=hidden_size))
        hf.trainer_config_finalize(args, model, 1)
    except ValueError as e:
        raise InputError(f"DeepSpeed config: {' '.join(str(e).split())}") from None
    finally:
        unset_hf_deepspeed_config()  # else later HF models would think ZeRO-3 is on
    return hf.config


class _DataParallel:
    """The ``mpu`` DeepSpeedConfig asks for the data-parallel world size."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def get_data_parallel_world_size(self) -> int:
        return self.world_size


def _deepspeed_reading(config: dict, world_size: int):
    """DeepSpeed's ``DeepSpeedConfig`` of ``config`` for ``world_size`` data-parallel ranks;
    its refusal (an assertion or a pydantic validation error) as one line of bad input.

    DeepSpeedConfig reads the world size from an ``mpu`` once ``deepspeed.comm.get_rank``
    answers; no process group exists here, so for this call that answers rank 0 (a fake process
    group, :func:`memlab.distributed.deepspeed_rank0.fake_ranks`, would also start DeepSpeed's
    communication backend, which waits on a TCP port)."""
    set_cache_env()  # DS_ACCELERATOR=cpu without a GPU: DeepSpeed then prints no detection warning
    # its logger writes to stdout (the CLI's JSON), its first import's op probes run the
    # compiler and linker (their output on the file descriptors): quiet_build keeps both
    with quiet_build(stream=sys.stderr):
        import deepspeed.comm as ds_comm
        from deepspeed.runtime.config import DeepSpeedConfig
    try:
        with mock.patch.object(ds_comm, "get_rank", lambda group=None: 0), \
                contextlib.redirect_stdout(io.StringIO()):
            return DeepSpeedConfig(config, mpu=_DataParallel(world_size))
    except (AssertionError, ValueError, TypeError) as e:
        lines = [line.strip() for line in str(e).splitlines()
                 if line.strip() and not line.strip().startswith("For further information")]
        # pydantic: "1 validation error for DeepSpeedZeroConfig / stage / Input should be ..."
        raise InputError(f"DeepSpeed rejects this config: {'; '.join(lines[:4]) or type(e).__name__}") from None


def read_deepspeed(path: str | pathlib.Path | dict, *, world_size: int = 1, hidden_size: int,
                   batch: int | None = None, micro_batches: int | None = None,
                   precision: str | None = None,
                   trainer_args: SimpleNamespace | None = None) -> DeepSpeedRun:
    """Read a DeepSpeed config for ``world_size`` data-parallel ranks of a model of width
    ``hidden_size`` (module doc). ``batch`` (per rank), ``micro_batches`` and ``precision``
    fill what the config leaves to the Trainer (``"auto"``), as TrainingArguments would;
    ``trainer_args`` (:attr:`TrainingRun.args`: a run's own TrainingArguments) fill them
    instead, and a config value that contradicts them is HF's mismatch error, as in the Trainer.

    Returns: a :class:`DeepSpeedRun`. Raises :class:`InputError` with DeepSpeed's (or HF's)
    reason for a config they would reject, or for what memlab cannot estimate (NVMe offload).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"world size must be a positive integer, got {world_size!r}")
    raw = load_file(path, "--deepspeed")
    # only "auto" needs the Trainer: an explicit config goes to DeepSpeed as it is, so that a
    # config DeepSpeed would reject gets DeepSpeed's reason
    if trainer_args is not None:
        base = _trainer_args({}, world_size, None, None, None)
        config = resolve_auto(raw, SimpleNamespace(**{**vars(base), **vars(trainer_args)}), hidden_size)
    else:
        config = (resolve_auto(raw, _trainer_args(raw, world_size, batch, micro_batches, precision),
                               hidden_size) if _has_auto(raw) else raw)
    ds = _deepspeed_reading(config, world_size)
    z = ds.zero_config
    stage = int(z.stage)
    notes: list[str] = []
    opt_dev = getattr(z.offload_optimizer, "device", None) if z.offload_optimizer else None
    par_dev = getattr(z.offload_param, "device", None) if z.offload_param else None
    opt_dev, par_dev = (str(getattr(d, "value", d)) if d is not None else "none" for d in (opt_dev, par_dev))
    if "nvme" in (opt_dev, par_dev):
        raise InputError("offload to nvme: memlab counts host memory, not NVMe files; allowed: "
                         "offload_optimizer/offload_param device cpu or none")
    offload = "all" if par_dev == "cpu" else "optimizer" if opt_dev == "cpu" else "none"
    if offload == "all" and stage != 3:
        raise InputError(f"offload_param needs ZeRO stage 3 (DeepSpeed offloads parameters only "
                         f"there), got stage {stage}")
    pins = [getattr(o, "pin_memory", False) for o in (z.offload_optimizer, z.offload_param) if o]
    precision_ds = ("fp16" if ds.float16_config.enabled else
                    "bf16" if ds.bfloat16_config.enabled else "fp32")
    buckets = ZeroBuckets(reduce=int(z.reduce_bucket_size), prefetch=int(z.prefetch_bucket_size),
                          max_live=int(z.max_live_parameters),
                          persistence=int(z.param_persistence_threshold),
                          overlap_comm=bool(z.overlap_comm), pinned=all(pins) if pins else True,
                          sub_group=max(int(z.sub_group_size), 1))
    ac = raw.get("activation_checkpointing")
    partition = bool(ds.activation_checkpointing_config.partition_activations)
    if ac is not None:
        notes.append("activation_checkpointing configures deepspeed.checkpointing, which only a "
                     "model calling deepspeed.checkpointing.checkpoint uses; a Hugging Face model "
                     "checkpoints with gradient_checkpointing (--checkpointing full)"
                     + ("; partition_activations splits checkpoints across model-parallel ranks: "
                        "with data parallelism alone it divides nothing" if partition else ""))
    if ds.zero_enabled and raw.get("optimizer") is None:
        notes.append("no optimizer section: the script must pass one to deepspeed.initialize "
                     "(the Trainer does: AdamW, counted here)")
    if opt_dev == "cpu" and not ds.zero_enabled:
        raise InputError("offload_optimizer needs ZeRO stage 1-3 (DeepSpeed's ZeRO optimizer), got stage 0")
    return DeepSpeedRun(config=config, world_size=world_size, zero=stage, offload=offload,
                        precision=precision_ds, micro_batch=int(ds.train_micro_batch_size_per_gpu),
                        accumulation=int(ds.gradient_accumulation_steps),
                        train_batch=int(ds.train_batch_size), buckets=buckets,
                        offload_device=opt_dev if opt_dev != "none" else par_dev,
                        checkpointing_block=ac is not None, partition_activations=partition,
                        notes=tuple(notes))


@dataclass(frozen=True)
class LoraSpec:
    """LoRA as peft's ``adapter_config.json`` gives it: ``rank``, the ``targets`` memlab
    counts (:func:`memlab.finetune.lora_shapes`), ``dropout`` and ``alpha``, with notes on what
    it does not model."""

    rank: int
    targets: tuple[str, ...]
    notes: tuple[str, ...] = ()
    dropout: float = 0.0
    alpha: int | None = None

    def lora_config(self) -> LoraConfig:
        """The run description's :class:`memlab.run.LoraConfig` of this file."""
        return LoraConfig(rank=self.rank, targets=self.targets, dropout=self.dropout, alpha=self.alpha)


def lora_targets_for(cfg: GPTConfig) -> tuple[str, ...]:
    """The target module names of ``cfg``'s family (GPT-2's or Llama's)."""
    return GPT2_TARGETS if cfg.mlp == "gelu" else LLAMA_TARGETS


def read_lora_config(path: str | pathlib.Path | dict, cfg: GPTConfig | tuple[str, ...]) -> LoraSpec:
    """peft's ``adapter_config.json`` (``peft_type`` LORA): ``r``, ``lora_dropout``,
    ``lora_alpha`` and ``target_modules`` (a list of names, ``"all-linear"``, or a regular
    expression peft matches against module names), for the model ``cfg`` (memlab's GPT, or the
    ``Linear`` module names of a Hugging Face decoder: :meth:`memlab.shape.DecoderShape.linears`).
    ``modules_to_save``, ``use_dora`` and a trained ``bias`` are not modelled: named in the notes."""
    d = load_file(path, "--lora-config")
    if str(d.get("peft_type", "LORA")).upper() != "LORA":
        raise InputError(f"--lora-config peft_type {d.get('peft_type')!r}; allowed: LORA")
    rank = d.get("r", 8)  # peft's LoraConfig default
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InputError(f"--lora-config r={rank!r}; allowed: a positive integer")
    names = cfg if isinstance(cfg, tuple) else lora_targets_for(cfg)
    tm = d.get("target_modules")
    if tm is None or tm == "all-linear":
        targets = names  # peft's default for these architectures, and all-linear less the head
    elif isinstance(tm, str):
        targets = tuple(n for n in names if re.search(tm, n))
    else:
        targets = tuple(tm)
    unknown = [t for t in targets if t not in names]
    if unknown or not targets:
        raise InputError(f"--lora-config target_modules {tm!r} names {unknown or 'nothing'} of "
                         f"this model; allowed: {', '.join(names)}")
    notes = []
    for key, off in (("modules_to_save", None), ("use_dora", False), ("bias", "none")):
        if d.get(key, off) not in (off, [], None if off is None else off):
            notes.append(f"--lora-config {key}={d[key]!r} is not modelled (its extra trainable "
                         f"parameters and state are not counted)")
    dropout = d.get("lora_dropout") or 0.0
    if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise InputError(f"--lora-config lora_dropout={dropout!r}; allowed: 0 <= dropout < 1")
    return LoraSpec(rank=rank, targets=targets, notes=tuple(notes), dropout=float(dropout),
                    alpha=d.get("lora_alpha"))


#: TrainingArguments (and TRL SFTConfig) fields the step is read from
MODELLED = ("per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16",
            "gradient_checkpointing", "gradient_checkpointing_kwargs", "activation_checkpointing",
            "activation_checkpointing_kwargs", "optim", "deepspeed", "fsdp", "fsdp_config",
            "max_length", "max_seq_length", "packing")
#: fields that decide nothing a training step holds (logging, saving, evaluation, schedules,
#: the hub, data loading on the host); every other field set away from its default is named
_NO_MEMORY = ("output_dir", "logging_", "log_", "save_", "eval_", "per_device_eval_batch_size",
              "push_to_hub", "hub_", "report_to", "run_name", "project", "trackio_", "learning_rate",
              "lr_scheduler", "warmup", "weight_decay", "adam_", "max_grad_norm", "num_train_epochs",
              "max_steps", "seed", "data_seed", "disable_tqdm", "dataloader_", "label_names",
              "load_best_model_at_end", "metric_for_best_model", "greater_is_better",
              "ignore_data_skip", "resume_from_checkpoint", "do_", "prediction_loss_only",
              "remove_unused_columns", "local_rank", "debug", "full_determinism", "include_",
              "restore_callback_states_from_checkpoint", "length_column_name", "skip_memory_metrics",
              "label_smoothing_factor", "bf16_full_eval", "fp16_full_eval", "batch_eval_metrics",
              "enable_jit_checkpoint", "ddp_timeout", "ddp_backend", "train_sampling_strategy",
              "average_tokens_across_devices", "use_cache", "_n_gpu", "dataset_", "use_cpu",
              "overwrite_output_dir", "logging_dir")


@dataclass(frozen=True)
class TrainingRun:
    """A ``TrainingArguments``/``SFTConfig`` mapped onto the step: ``micro_batch`` and
    ``accumulation`` (the step's batch is their product), ``precision``, ``checkpointing``
    (``"full"`` or ``None``), ``optimizer`` (memlab's name, :data:`memlab.low_bit.HF_OPTIMIZERS`),
    ``deepspeed`` (a path or a dict) and ``fsdp`` as given, ``seq`` the maximum length (or
    ``None``), and ``notes`` naming what is not modelled."""

    micro_batch: int
    accumulation: int
    precision: str
    checkpointing: str | None
    optimizer: str
    deepspeed: str | dict | None = None
    fsdp: tuple[str, ...] = ()
    seq: int | None = None
    args: SimpleNamespace | None = None
    notes: tuple[str, ...] = ()


def _defaults() -> dict:
    """TrainingArguments' field defaults as its ``to_json_string()`` writes them (enums as
    their values), recorded for this transformers version (memlab.hf_config_check.recorded:
    importing transformers costs seconds)."""
    return recorded("training_args_defaults", {}, _class_defaults)


def _class_defaults() -> dict:
    """TrainingArguments' field defaults, asked of the class (no instance is built: that
    would probe devices)."""
    from transformers import TrainingArguments
    out = {}
    for f in dataclasses.fields(TrainingArguments):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return json.loads(json.dumps(out, default=lambda v: getattr(v, "value", str(v))))


def read_training_args(path: str | pathlib.Path | dict) -> TrainingRun:
    """A ``TrainingArguments`` (or TRL ``SFTConfig``) as ``args.to_json_string()`` writes it,
    JSON or YAML. Returns a :class:`TrainingRun`; an ``optim`` memlab does not count is bad
    input naming those it does."""
    d = load_file(path, "--training-args")
    defaults = _defaults()

    def get(key: str):
        return d.get(key, defaults.get(key))

    micro, accumulation = int(get("per_device_train_batch_size") or 8), int(get("gradient_accumulation_steps") or 1)
    if micro < 1 or accumulation < 1:
        raise InputError(f"--training-args per_device_train_batch_size={micro}, gradient_accumulation_steps="
                         f"{accumulation}; allowed: positive integers")
    if get("bf16") and get("fp16"):
        raise InputError("--training-args sets bf16 and fp16; allowed: one of them")
    precision = "bf16" if get("bf16") else "fp16" if get("fp16") else "fp32"
    ckpt = bool(get("gradient_checkpointing") or get("activation_checkpointing"))
    notes = []
    kw = get("gradient_checkpointing_kwargs") or get("activation_checkpointing_kwargs") or {}
    if ckpt:
        reentrant = kw.get("use_reentrant", True)  # torch.utils.checkpoint's default in HF's call
        notes.append(f"gradient_checkpointing (use_reentrant={reentrant}): every decoder layer "
                     f"checkpointed; reentrant and non-reentrant keep the same layer inputs")
    optim = get("optim") or "adamw_torch"
    optim = str(getattr(optim, "value", optim))  # the dataclass default is an OptimizerNames enum
    if optim not in HF_OPTIMIZERS:
        raise InputError(f"--training-args optim={optim!r} is not counted; allowed: {', '.join(HF_OPTIMIZERS)}")
    fsdp = get("fsdp") or ()
    fsdp = tuple(fsdp.split()) if isinstance(fsdp, str) else tuple(fsdp)
    seq = d.get("max_length") or d.get("max_seq_length")  # TRL's SFTConfig (both spellings)
    if d.get("packing"):
        notes.append("packing: every sequence is filled to max_length, so the step holds max_length "
                     "tokens per sequence")
    elif seq:
        notes.append("max_length bounds each batch; without packing a batch pads to its longest "
                     "sequence: the estimate at max_length is the worst case")
    unmodelled = sorted(k for k, v in d.items()
                        if k not in MODELLED and not k.startswith(_NO_MEMORY)
                        and k in defaults and v != defaults[k] and v not in (None, "", [], {}))
    if unmodelled:
        notes.append(f"--training-args: not modelled: {', '.join(unmodelled)}")
    unknown = sorted(k for k in d if k not in defaults and k not in MODELLED
                     and not k.startswith(_NO_MEMORY))
    if unknown:
        notes.append(f"--training-args: fields TrainingArguments does not have (TRL's?) not modelled: "
                     f"{', '.join(unknown[:12])}{' ...' if len(unknown) > 12 else ''}")
    args = SimpleNamespace(per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
                           bf16=precision == "bf16", fp16=precision == "fp16")
    return TrainingRun(micro_batch=micro, accumulation=accumulation, precision=precision,
                       checkpointing="full" if ckpt else None, optimizer=HF_OPTIMIZERS[optim],
                       deepspeed=get("deepspeed") or None, fsdp=fsdp,
                       seq=int(seq) if seq else None, args=args, notes=tuple(notes))


__all__ = ["DeepSpeedRun", "LoraSpec", "TrainingRun", "HIDDEN_AUTO", "DS_PRECISIONS", "MODELLED",
           "load_file", "resolve_auto", "read_deepspeed", "read_lora_config", "lora_targets_for",
           "read_training_args"]
