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
would reject. A config of the keys and values DeepSpeed's reading is written out for here
(:func:`plain_reading`: the batch keys, fp16/bf16 ``enabled``, the ZeRO fields of
:data:`PLAIN_ZERO` with plain values, ``cpu`` offload, activation checkpointing's switches, an
optimizer section) is read from the JSON itself, with DeepSpeed's rules and words
(:func:`memlab.step.write_deepspeed_config.deepspeed_batch_sizes`, its defaults), so the estimate
does not import DeepSpeed (seconds); any other config, or one that breaks a pydantic rule, is
read by ``DeepSpeedConfig`` itself (tests/test_run_config.py checks both readings agree). The
result, :class:`DeepSpeedRun`, is a :class:`~memlab.step.training_step.StepConfig`
(stage, offload, precision, micro-batch and accumulation) and the
:class:`~memlab.step.states.ZeroBuckets` the estimate honours.

``activation_checkpointing`` configures ``deepspeed.checkpointing``, which only a model that
calls ``deepspeed.checkpointing.checkpoint`` uses (Megatron-DeepSpeed); a Hugging Face model
checkpoints with ``gradient_checkpointing`` (``--checkpointing full``). Its
``partition_activations`` splits each checkpoint across the *model-parallel* ranks: under pure
data parallelism there are none, so it divides nothing. Both are said in a note.

:func:`read_lora_config` reads peft's ``adapter_config.json`` (``r``, ``target_modules``,
``lm_head`` included). :func:`read_accelerate` reads an accelerate config YAML (its DeepSpeed
plugin or FSDP keys, ``mixed_precision``, ``num_processes``); :func:`read_training_args` the
training YAMLs of the Trainer (with TRL's model arguments), LLaMA-Factory and axolotl
(:data:`LAUNCHERS`), each by its launcher's own defaults, into one :class:`TrainingRun` with
the :class:`~memlab.step.fine_tune_config.LoraConfig` and
:class:`~memlab.step.fine_tune_config.QuantConfig` the file asks for.

A DeepSpeed key that moves memory is either modelled (the stage, the offloads, the
:class:`~memlab.step.states.ZeroBuckets` sizes) or named in a note (:func:`_unmodelled_deepspeed`
compares every ``zero_optimization`` field with DeepSpeed's own default): none is dropped.

Over 500 lines because each launcher's reading (DeepSpeed, accelerate, the Trainer and TRL,
LLaMA-Factory, axolotl, peft) keeps its defaults and their citations beside the code that
applies them, and they feed one another (a YAML names a DeepSpeed config, an accelerate
config decides its precision).
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

from memlab.core.errors import InputError
from memlab.core.quiet import quiet_build
from memlab.distributed.ranks import set_cache_env
from memlab.hf.config_check import recorded
from memlab.models.gpt_unet import GPTConfig
from memlab.step.decoder_states import LM_HEAD
from memlab.step.fine_tune_config import LoraConfig, QuantConfig, lora_targets_for
from memlab.step.low_bit import HF_OPTIMIZERS
from memlab.step.states import PARAM_OFFLOAD, ZeroBuckets
from memlab.step.write_deepspeed_config import deepspeed_batch_sizes

#: "auto" keys a DeepSpeed config may leave to the Trainer and that memlab fills as it does
HIDDEN_AUTO = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
DS_PRECISIONS = ("fp32", "bf16", "fp16")


def load_file(path: str | pathlib.Path | dict, what: str = "config") -> dict:
    """A JSON or YAML file (by its suffix; JSON first otherwise) as a dict, or ``path`` if it
    is one already. A missing or unreadable file is bad input naming it.

    A dict because it is a run's own config file (DeepSpeed, accelerate, peft), as written.
    """
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
    tensor_parallel: int = 1
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def batch(self) -> int:
        """Sequences per rank per optimizer step (memlab's ``batch``): micro-batch x accumulation."""
        return self.micro_batch * self.accumulation

    def step_fields(self) -> dict[str, int | str]:
        """The :class:`~memlab.step.training_step.StepConfig` fields this config decides."""
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
    does; a value that contradicts the arguments is HF's mismatch error, as bad input.

    A dict because it is a DeepSpeed config, as DeepSpeed reads it.
    """
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


def _deepspeed_reading(config: dict, world_size: int, via_deepspeed: bool = False):
    """DeepSpeed's ``DeepSpeedConfig`` of ``config`` for ``world_size`` data-parallel ranks;
    its refusal (an assertion or a pydantic validation error) as one line of bad input.
    :func:`plain_reading`'s, from the JSON, where it reads the config (unless ``via_deepspeed``).

    DeepSpeedConfig reads the world size from an ``mpu`` once ``deepspeed.comm.get_rank``
    answers; no process group exists here, so for this call that answers rank 0 (a fake process
    group, :func:`memlab.distributed.deepspeed_rank0.fake_ranks`, would also start DeepSpeed's
    communication backend, which waits on a TCP port)."""
    plain = None if via_deepspeed else plain_reading(config, world_size)
    if plain is not None:
        return plain
    set_cache_env()  # DS_ACCELERATOR=cpu without a GPU: DeepSpeed then prints no detection warning
    # its logger writes to stdout (the CLI's JSON), its first import's op probes run the
    # compiler and linker (their output on the file descriptors): quiet_build keeps both
    with quiet_build(stream=sys.stderr):
        import deepspeed.comm as ds_comm
        from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
    try:
        with mock.patch.object(ds_comm, "get_rank", lambda group=None: 0), \
                contextlib.redirect_stdout(io.StringIO()):
            return DeepSpeedConfig(config, mpu=_DataParallel(world_size))
    except (AssertionError, ValueError, TypeError, DeepSpeedConfigError) as e:
        lines = [line.strip() for line in str(e).splitlines()
                 if line.strip() and not line.strip().startswith("For further information")]
        # pydantic: "1 validation error for DeepSpeedZeroConfig / stage / Input should be ..."
        raise InputError(f"DeepSpeed rejects this config: {'; '.join(lines[:4]) or type(e).__name__}") from None


#: DeepSpeed 0.19's ZeRO fields (deepspeed/runtime/zero/config.py, DeepSpeedZeroConfig, in its
#: order) that :func:`plain_reading` reads without it: name -> (its JSON alias or None, its
#: default, the values taken: "stage" 0-3, "bool", "count" an integer >= 0, "positive" > 0,
#: "offload" an offload section). Left out: the fields with a validator that reads other fields
#: (compute_grad_norm), one that logs (elastic_checkpoint), the deprecated ones, ZeRO++ and the
#: rest; a config that sets them is read by DeepSpeed. tests/test_run_config.py checks each
#: alias and default against DeepSpeedZeroConfig.
PLAIN_ZERO: dict[str, tuple[str | None, object, str]] = {
    "stage": (None, 0, "stage"),
    "contiguous_gradients": (None, True, "bool"),
    "reduce_scatter": (None, True, "bool"),
    "reduce_bucket_size": (None, 500_000_000, "positive"),
    "use_multi_rank_bucket_allreduce": (None, True, "bool"),
    "allgather_partitions": (None, True, "bool"),
    "allgather_bucket_size": (None, 500_000_000, "count"),
    "overlap_comm": (None, None, "bool"),  # None: the validator's stage == 3
    "offload_param": (None, None, "offload"),
    "offload_optimizer": (None, None, "offload"),
    "sub_group_size": (None, 1_000_000_000, "count"),
    "prefetch_bucket_size": ("stage3_prefetch_bucket_size", 50_000_000, "count"),
    "param_persistence_threshold": ("stage3_param_persistence_threshold", 100_000, "count"),
    "max_live_parameters": ("stage3_max_live_parameters", 1_000_000_000, "count"),
    "max_reuse_distance": ("stage3_max_reuse_distance", 1_000_000_000, "count"),
    "gather_16bit_weights_on_model_save": ("stage3_gather_16bit_weights_on_model_save", False, "bool"),
    "stage3_gather_fp16_weights_on_model_save": (None, False, "bool"),
    "ignore_unused_parameters": (None, True, "bool"),
    "round_robin_gradients": (None, False, "bool"),
}
#: an offload section's defaults (deepspeed/runtime/zero/offload_config.py) that it reads
PLAIN_OFFLOAD = {"offload_optimizer": {"device": "none", "pin_memory": True, "buffer_count": 4, "ratio": 1.0,
                                       "nvme_path": None},
                 "offload_param": {"device": "none", "pin_memory": True, "buffer_count": 5,
                                   "buffer_size": 100_000_000, "nvme_path": None}}
#: top-level keys read without DeepSpeed: -> what they may hold (DeepSpeedConfig reads the
#: scalars as they are, get_scalar_param)
_PLAIN_TOP = {"train_batch_size": "batch", "train_micro_batch_size_per_gpu": "batch",
              "gradient_accumulation_steps": "batch", "fp16": "enabled", "bf16": "enabled",
              "zero_optimization": "zero", "optimizer": "optimizer", "activation_checkpointing": "checkpointing",
              "zero_allow_untested_optimizer": "bool", "zero_force_ds_cpu_optimizer": "bool",
              "wall_clock_breakdown": "bool", "steps_per_print": "int", "gradient_clipping": "number"}
_CHECKPOINTING_KEYS = ("partition_activations", "contiguous_memory_optimization", "cpu_checkpointing",
                       "synchronize_checkpoint_boundary", "profile")


def _plain_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _plain_count(v, kind: str):
    """``v`` as DeepSpeed's pydantic int field takes it (an integral float too), or None."""
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not _plain_int(v) or v < (1 if kind == "positive" else 0):
        return None
    return v


def _plain_offload(name: str, sec):
    """An offload section with the defaults filled, or None where DeepSpeed must read it."""
    if sec is None:
        return None
    if not isinstance(sec, dict) or set(sec) - {"device", "pin_memory"}:
        return False
    if sec.get("device", "none") not in ("cpu", "none") or not isinstance(sec.get("pin_memory", True), bool):
        return False
    return SimpleNamespace(**{**PLAIN_OFFLOAD[name], **sec})


def _plain_zero(sec) -> SimpleNamespace | None:
    """The ZeRO section as DeepSpeedZeroConfig reads it (:data:`PLAIN_ZERO`), or None."""
    if sec is None:
        sec = {}
    if not isinstance(sec, dict):
        return None
    spelled = {alias or name: name for name, (alias, _, _) in PLAIN_ZERO.items()}
    spelled.update({name: name for name in PLAIN_ZERO})
    if set(sec) - set(spelled) or len({spelled[k] for k in sec}) < len(sec):
        return None
    values = {name: default for name, (_, default, _) in PLAIN_ZERO.items()}
    for key, v in sec.items():
        name = spelled[key]
        kind = PLAIN_ZERO[name][2]
        if kind == "offload":
            v = _plain_offload(name, v)
            ok = v is not False
        elif kind == "stage":
            ok = _plain_int(v) and 0 <= v <= 3
        elif kind == "bool":
            ok = isinstance(v, bool) or (v is None and name == "overlap_comm")
        else:
            v = _plain_count(v, kind)
            ok = v is not None
        if not ok:
            return None
        values[name] = v
    if values["overlap_comm"] is None:
        values["overlap_comm"] = values["stage"] == 3
    return SimpleNamespace(**values)


def plain_reading(config: dict, world_size: int):
    """What ``DeepSpeedConfig(config)`` reads of a config on ``world_size`` data-parallel ranks
    (the attributes :func:`read_deepspeed` uses), from the JSON alone, or None where the config
    holds anything beyond the keys and values written out here (module doc); DeepSpeed's own
    refusals of the batch sizes and of fp16 with bf16, in its words, as InputError."""
    if set(config) - set(_PLAIN_TOP):
        return None
    for key, v in config.items():
        kind = _PLAIN_TOP[key]
        if kind == "batch" and not (v is None or _plain_int(v)):
            return None
        if kind == "enabled" and not (isinstance(v, dict) and set(v) <= {"enabled"}
                                      and isinstance(v.get("enabled", False), bool)):
            return None
        if kind in ("bool", "int", "number") and not (
                isinstance(v, bool) if kind == "bool" else _plain_int(v) if kind == "int" else
                isinstance(v, (int, float)) and not isinstance(v, bool)):
            return None
        if kind == "optimizer" and not (isinstance(v, dict) and set(v) <= {"type", "params"}
                                        and isinstance(v.get("type"), str) and isinstance(v.get("params", {}), dict)):
            return None
        if kind == "checkpointing" and not (isinstance(v, dict) and set(v) <= set(_CHECKPOINTING_KEYS)
                                            and all(isinstance(x, bool) for x in v.values())):
            return None
    z = _plain_zero(config.get("zero_optimization"))
    if z is None:
        return None
    fp16, bf16 = (bool((config.get(k) or {}).get("enabled", False)) for k in ("fp16", "bf16"))
    if fp16 and bf16:  # deepspeed/runtime/config.py, DeepSpeedConfig._initialize_params
        raise InputError("DeepSpeed rejects this config: bfloat16 and fp16 modes cannot be simultaneously enabled")
    train, micro, accumulation = deepspeed_batch_sizes(
        config.get("train_batch_size"), config.get("train_micro_batch_size_per_gpu"),
        config.get("gradient_accumulation_steps"), world_size)
    checkpointing = config.get("activation_checkpointing") or {}
    return SimpleNamespace(zero_config=z, zero_enabled=z.stage > 0,
                           float16_config=SimpleNamespace(enabled=fp16), bfloat16_config=SimpleNamespace(enabled=bf16),
                           activation_checkpointing_config=SimpleNamespace(
                               partition_activations=checkpointing.get("partition_activations", False)),
                           train_batch_size=train, train_micro_batch_size_per_gpu=micro,
                           gradient_accumulation_steps=accumulation)


def _name(path) -> str:
    return "(a dict)" if isinstance(path, dict) else repr(str(path))


def is_accelerate_config(d: dict) -> bool:
    """Whether a mapping is an accelerate config (``accelerate config`` writes these keys)."""
    return "distributed_type" in d or "compute_environment" in d


def accelerate_precision(config: dict, args: SimpleNamespace) -> tuple[dict, list[str]]:
    """``config`` as accelerate's ``DeepSpeedPlugin.set_mixed_precision`` leaves it for the
    mixed precision the TrainingArguments ask for (transformers 5 ``training_args.py``: ``bf16``
    -> ``mixed_precision = "bf16"``; accelerate 1.15 ``utils/dataclasses.py`` lines 1415-1445:
    a ``bf16`` (``fp16``) section ``{"enabled": True}`` added when the config has none, an
    absent one written disabled, ``"auto"`` filled). So ``"fp16": {"enabled": "auto"}`` with no
    ``bf16`` section under ``bf16: true`` runs bf16. Returns the config and a note naming the rule.

    A dict because it is a DeepSpeed config, as accelerate leaves it.
    """
    mixed = "fp16" if getattr(args, "fp16", False) else "bf16" if getattr(args, "bf16", False) else "no"
    out = json.loads(json.dumps(config))
    other = "bf16" if mixed == "fp16" else "fp16"
    if mixed != "no" and str((out.get(other) or {}).get("enabled", False)).lower() == "true":
        raise InputError(f"mixed precision {mixed} with {other}.enabled true in the DeepSpeed config: "
                         f"accelerate refuses it; allowed: one of them")
    added = None
    if mixed != "no" and mixed not in out:
        out[mixed] = {"enabled": True} if mixed == "bf16" else {"enabled": True, "auto_cast": True}
        added = mixed
    for dtype in ("fp16", "bf16"):
        sec = out.setdefault(dtype, {"enabled": False})
        if isinstance(sec, dict) and sec.get("enabled") == "auto":
            sec["enabled"] = dtype == mixed
    if not added:
        return out, []
    return out, [f"precision as accelerate's DeepSpeedPlugin.set_mixed_precision resolves it: mixed "
                 f"precision {mixed} (the TrainingArguments' {mixed}: true) adds a {mixed} section the "
                 f"DeepSpeed config lacks, so DeepSpeed runs {mixed}"]


#: zero_optimization fields the estimate reads (ZeroBuckets, the stage, the offloads)
_ZERO_MODELLED = {"stage", "offload_optimizer", "offload_param", "reduce_bucket_size", "prefetch_bucket_size",
                  "max_live_parameters", "param_persistence_threshold", "overlap_comm", "sub_group_size",
                  "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"}
#: fields that move no bytes of a training step (saving, checks, logging, loading)
_ZERO_NO_MEMORY = {"gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
                   "elastic_checkpoint", "load_from_fp32_weights", "ignore_unused_parameters",
                   "round_robin_gradients", "reduce_scatter", "allgather_partitions", "compute_grad_norm",
                   "log_trace_cache_warnings", "enable_sanity_checks", "pipeline_loading_checkpoint",
                   "override_module_apply", "use_multi_rank_bucket_allreduce", "module_granularity_threshold",
                   "use_all_reduce_for_fetch_params", "allgather_sequential", "leaf_module",
                   "parameter_alignment", "legacy_stage1", "model_persistence_threshold"}
#: what each unmodelled memory-moving field does, for its note
_ZERO_WHY = {
    "max_reuse_distance": "a parameter used again within this many elements stays gathered (the live "
                          "set, capped by stage3_max_live_parameters, which is counted)",
    "zero_hpz_partition_size": "ZeRO++ hpZ keeps a secondary 16-bit copy of the parameters divided over "
                               "this many ranks: 2 x parameters / that size more bytes a rank",
    "zero_quantized_weights": "ZeRO++ qwZ gathers int8 weights: smaller all-gather buffers than the "
                              "16-bit ones counted",
    "zero_quantized_nontrainable_weights": "frozen weights kept int8: smaller than the 16-bit ones counted",
    "zero_quantized_gradients": "ZeRO++ qgZ reduces int4 gradients: smaller reduce buffers than counted",
    "allgather_bucket_size": "stages 1-2 gather the updated parameters in buckets of this many elements",
    "contiguous_gradients": "without it stage 2 keeps no contiguous gradient partition",
    "memory_efficient_linear": "ZeRO-3's Linear that saves no extra input copy",
    "zenflow": "ZenFlow's split of the optimizer step between device and host",
    "save_muon_momentum_buffer_in_memory": "Muon's momentum buffer placement",
}


def _zero_fields(ds) -> list[tuple[str, str, object, object]]:
    """``(name, JSON key, value, DeepSpeed's default)`` of each ZeRO field of a reading, in
    DeepSpeedZeroConfig's order: :data:`PLAIN_ZERO`'s for :func:`plain_reading`, else every
    field of DeepSpeed's own class."""
    z = ds.zero_config
    if isinstance(z, SimpleNamespace):
        return [(n, alias or n, getattr(z, n), default) for n, (alias, default, _) in PLAIN_ZERO.items()]
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    default = DeepSpeedZeroConfig()
    return [(n, f.alias or n, getattr(z, n), getattr(default, n)) for n, f in type(z).model_fields.items()]


def _unmodelled_deepspeed(raw: dict, fields: list[tuple[str, str, object, object]], tp: int,
                          world_size: int) -> list[str]:
    """Notes naming every DeepSpeed setting that moves memory and that the estimate does not
    count: a ``zero_optimization`` field away from DeepSpeed's default (``fields``:
    :func:`_zero_fields`), AutoTP, and top-level sections memlab does not read. None is
    dropped silently (module doc)."""
    notes = []
    for name, key, value, base in fields:
        if name in _ZERO_MODELLED or name in _ZERO_NO_MEMORY:
            continue
        if value == base or (name == "zero_hpz_partition_size" and int(value) <= 1):
            continue
        notes.append(f"zero_optimization.{key}={value!r} moves memory memlab does not model"
                     + (f": {_ZERO_WHY[name]}" if name in _ZERO_WHY else ""))
    if tp > 1:
        notes.append(f"tensor_parallel.autotp_size={tp}: DeepSpeed's AutoTP splits each Linear's weight "
                     f"over {tp} ranks (and the data-parallel group shrinks to {max(world_size // tp, 1)}); "
                     f"not modelled: the estimate is of {world_size}-rank data parallelism with whole "
                     f"layers (an over-estimate of the weights and their states)")
    known = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "gradient_clipping", "zero_optimization", "fp16", "bf16", "optimizer", "scheduler",
             "activation_checkpointing", "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
             "tensor_parallel", "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comms_logger",
             "prescale_gradients", "gradient_predivide_factor", "dump_state", "memory_breakdown",
             "zero_force_ds_cpu_optimizer", "checkpoint", "monitor_config", "aio", "train_batch_size_per_gpu"}
    extra = sorted(k for k in raw if k not in known and not k.startswith("_"))
    if extra:
        notes.append(f"DeepSpeed config: not modelled: {', '.join(extra)}")
    opt = (raw.get("optimizer") or {}).get("type")
    if opt and str(opt).lower() not in ("adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam"):
        notes.append(f"optimizer.type={opt!r}: counted as AdamW's two fp32 moments")
    return notes


def read_deepspeed(path: str | pathlib.Path | dict, *, world_size: int = 1, hidden_size: int,
                   batch: int | None = None, micro_batches: int | None = None,
                   precision: str | None = None,
                   trainer_args: SimpleNamespace | None = None,
                   mixed_precision: str | None = None, via_deepspeed: bool = False) -> DeepSpeedRun:
    """Read a DeepSpeed config for ``world_size`` data-parallel ranks of a model of width
    ``hidden_size`` (module doc). ``batch`` (per rank), ``micro_batches`` and ``precision``
    fill what the config leaves to the Trainer (``"auto"``), as TrainingArguments would;
    ``trainer_args`` (:attr:`TrainingRun.args`: a run's own TrainingArguments) fill them
    instead, and a config value that contradicts them is HF's mismatch error, as in the Trainer.
    ``mixed_precision`` (an accelerate launch's ``no``/``fp16``/``bf16``) is applied as
    accelerate's ``DeepSpeedPlugin.set_mixed_precision`` applies it (:func:`accelerate_precision`);
    a Trainer launch (``trainer_args``, or ``"auto"`` values) applies it from the precision.
    ``via_deepspeed``: read through DeepSpeed's ``DeepSpeedConfig`` even where the JSON alone
    is read (:func:`plain_reading`; the tests compare the two).

    Returns: a :class:`DeepSpeedRun`. Raises :class:`InputError` with DeepSpeed's (or HF's)
    reason for a config they would reject, or for an accelerate config given in its place.

    Over 80 lines because it follows the Trainer's own order of DeepSpeed's fields (batch,
    accumulation, precision, ZeRO, offload), one refusal each.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"world size must be a positive integer, got {world_size!r}")
    raw = load_file(path, "--deepspeed")
    if is_accelerate_config(raw):
        raise InputError(f"--deepspeed {_name(path)}: this is an accelerate config (its keys "
                         f"compute_environment/distributed_type), not a DeepSpeed JSON; allowed: pass "
                         f"it as --accelerate-config")
    launcher_notes: list[str] = []
    # only "auto" needs the Trainer: an explicit config goes to DeepSpeed as it is, so that a
    # config DeepSpeed would reject gets DeepSpeed's reason
    if trainer_args is not None:
        base = _trainer_args({}, world_size, None, None, None)
        args = SimpleNamespace(**{**vars(base), **vars(trainer_args)})
        config = resolve_auto(raw, args, hidden_size)
        config, launcher_notes = accelerate_precision(config, args)
    elif _has_auto(raw):
        args = _trainer_args(raw, world_size, batch, micro_batches, precision)
        config = resolve_auto(raw, args, hidden_size)
        config, launcher_notes = accelerate_precision(config, args)
    else:
        config = raw
    if mixed_precision is not None:
        config, launcher_notes = accelerate_precision(
            config, SimpleNamespace(bf16=mixed_precision in ("bf16", "fp8"), fp16=mixed_precision == "fp16"))
    ds = _deepspeed_reading(config, world_size, via_deepspeed)
    z = ds.zero_config
    stage = int(z.stage)
    notes: list[str] = list(launcher_notes)
    opt_dev = getattr(z.offload_optimizer, "device", None) if z.offload_optimizer else None
    par_dev = getattr(z.offload_param, "device", None) if z.offload_param else None
    opt_dev, par_dev = (str(getattr(d, "value", d)) if d is not None else "none" for d in (opt_dev, par_dev))
    # the device holds the same under NVMe as under CPU offload; what the host would hold is
    # on the NVMe file instead, and the host keeps DeepSpeed's pinned swap buffers
    opt_off, par_off = opt_dev in ("cpu", "nvme"), par_dev in ("cpu", "nvme")
    offload = ("all" if par_off and opt_off else PARAM_OFFLOAD if par_off else
               "optimizer" if opt_off else "none")
    if par_off and stage != 3:
        raise InputError(f"zero_optimization.offload_param needs ZeRO stage 3 (DeepSpeed offloads "
                         f"parameters only there), got stage {stage}")
    for name, dev, sec in (("offload_optimizer", opt_dev, z.offload_optimizer),
                           ("offload_param", par_dev, z.offload_param)):
        if dev == "nvme":
            count, size = int(sec.buffer_count), int(sec.buffer_size if name == "offload_param" else 0)
            swap = (f"; DeepSpeed's pinned host swap buffers: buffer_count {count} x buffer_size "
                    f"{size:,} elements" if size else f"; buffer_count {count} pinned swap buffers")
            what = "fp32 master and moments" if name == "offload_optimizer" else "16-bit parameter partition"
            notes.append(f"zero_optimization.{name}.device nvme (nvme_path {sec.nvme_path}): the device "
                         f"holds what CPU offload leaves it; the {what} counted as host bytes lie on "
                         f"the NVMe file instead{swap}")
    ratio = float(getattr(z.offload_optimizer, "ratio", 1.0) or 1.0) if z.offload_optimizer else 1.0
    if opt_off and ratio < 1.0:
        notes.append(f"zero_optimization.offload_optimizer.ratio={ratio}: DeepSpeed keeps "
                     f"{1 - ratio:.0%} of the sub-groups' optimizer states on the device; counted "
                     f"as if all were offloaded (an under-estimate)")
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
    if opt_off and not ds.zero_enabled:
        raise InputError("zero_optimization.offload_optimizer needs ZeRO stage 1-3 (DeepSpeed's ZeRO "
                         "optimizer), got stage 0")
    tp = int((raw.get("tensor_parallel") or {}).get("autotp_size") or 1)
    notes += _unmodelled_deepspeed(raw, _zero_fields(ds), tp, world_size)
    return DeepSpeedRun(config=config, world_size=world_size, zero=stage, offload=offload,
                        precision=precision_ds, micro_batch=int(ds.train_micro_batch_size_per_gpu),
                        accumulation=int(ds.gradient_accumulation_steps),
                        train_batch=int(ds.train_batch_size), buckets=buckets,
                        offload_device=opt_dev if opt_dev != "none" else par_dev,
                        checkpointing_block=ac is not None, partition_activations=partition,
                        tensor_parallel=tp, notes=tuple(notes))


@dataclass(frozen=True)
class AccelerateRun:
    """An accelerate config YAML (``accelerate config`` / ``accelerate launch --config_file``):
    ``world_size`` (``num_processes``), ``mixed_precision`` (``no``/``fp16``/``bf16``),
    ``deepspeed`` the DeepSpeed config the plugin hands DeepSpeed (a path from
    ``deepspeed_config_file``, or the dict accelerate builds from the plugin keys), ``zero`` the
    stage FSDP's sharding strategy is estimated as, and ``notes``."""

    world_size: int
    mixed_precision: str
    deepspeed: str | dict | None = None
    zero: int = 0
    notes: tuple[str, ...] = ()

    @property
    def precision(self) -> str:
        """memlab's precision of the mixed precision (``no`` is fp32)."""
        return {"no": "fp32", "fp8": "bf16"}.get(self.mixed_precision, self.mixed_precision)


_FSDP_STAGES = {"FULL_SHARD": 3, "HYBRID_SHARD": 3, "SHARD_GRAD_OP": 2, "HYBRID_SHARD_ZERO2": 2, "NO_SHARD": 0}


def read_accelerate(path: str | pathlib.Path | dict) -> AccelerateRun:  # noqa: C901 one branch per accelerate field read
    """Read an accelerate config the way ``accelerate launch`` and its ``DeepSpeedPlugin`` do
    (accelerate 1.15 ``utils/dataclasses.py``, ``DeepSpeedPlugin.__post_init__``): with
    ``deepspeed_config_file`` that file is the config (relative to the working directory, as
    accelerate opens it; also tried beside the YAML); else the plugin keys (``zero_stage``,
    ``offload_optimizer_device``, ``offload_param_device``, ``gradient_accumulation_steps``)
    become ``{"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "zero_optimization": {...}}``. FSDP's ``fsdp_sharding_strategy`` (or FSDP2's
    ``fsdp_reshard_after_forward``) is estimated as ZeRO-3/2 (the same 2 + 2 + 12 bytes
    divided the same way); its ``fsdp_offload_params`` is named as not modelled."""
    d = load_file(path, "--accelerate-config")
    if not is_accelerate_config(d):
        raise InputError("--accelerate-config: no distributed_type or compute_environment key; allowed: "
                         "a YAML that `accelerate config` writes")
    where = "--accelerate-config"
    kind = str(d.get("distributed_type", "NO")).upper()
    procs = d.get("num_processes", 1)
    if isinstance(procs, bool) or not isinstance(procs, int) or procs < 1:
        raise InputError(f"{where} num_processes={procs!r}; allowed: a positive integer")
    mixed = str(d.get("mixed_precision") or "no").lower()
    if mixed not in ("no", "fp16", "bf16", "fp8"):
        raise InputError(f"{where} mixed_precision={mixed!r}; allowed: no, fp16, bf16, fp8")
    notes = [f"read by accelerate's rules: {kind}, {procs} process(es), mixed_precision {mixed}"]
    if mixed == "fp8":
        notes.append("mixed_precision fp8 counted as bf16 (accelerate runs bf16 autocast around the fp8 matmuls)")
    if kind == "DEEPSPEED":
        plug = d.get("deepspeed_config") or {}
        file = plug.get("deepspeed_config_file")
        if file:
            p = pathlib.Path(file)
            if not p.is_file() and not isinstance(path, dict):
                beside = pathlib.Path(path).parent / file
                p = beside if beside.is_file() else p
            return AccelerateRun(world_size=procs, mixed_precision=mixed, deepspeed=str(p), notes=tuple(notes))
        stage = plug.get("zero_stage", 2)  # DeepSpeedPlugin's default (ACCELERATE_DEEPSPEED_ZERO_STAGE)
        gas = plug.get("gradient_accumulation_steps", "auto")
        config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                  "gradient_accumulation_steps": gas if gas is not None else "auto",
                  "zero_optimization": {"stage": stage,
                                        "offload_optimizer": {"device": plug.get("offload_optimizer_device") or "none"},
                                        "offload_param": {"device": plug.get("offload_param_device") or "none"}}}
        for dev in ("optimizer", "param"):
            if plug.get(f"offload_{dev}_device") == "nvme":
                path_key = f"offload_{dev}_nvme_path"
                config["zero_optimization"][f"offload_{dev}"]["nvme_path"] = plug.get(path_key) or "/nvme"
        if plug.get("gradient_clipping") not in (None, "auto"):
            config["gradient_clipping"] = plug["gradient_clipping"]
        notes.append("the DeepSpeed config built from the plugin keys as DeepSpeedPlugin.__post_init__ builds it")
        return AccelerateRun(world_size=procs, mixed_precision=mixed, deepspeed=config, notes=tuple(notes))
    if kind == "FSDP":
        f = d.get("fsdp_config") or {}
        if str(f.get("fsdp_version", 1)) == "2":
            stage = 3 if f.get("fsdp_reshard_after_forward", True) else 2
        else:
            strategy = str(f.get("fsdp_sharding_strategy", "FULL_SHARD")).upper()
            if strategy.isdigit():  # accelerate's old integer spelling (1 = FULL_SHARD)
                strategy = list(_FSDP_STAGES)[int(strategy) - 1] if 1 <= int(strategy) <= 5 else strategy
            if strategy not in _FSDP_STAGES:
                raise InputError(f"{where} fsdp_sharding_strategy={strategy!r}; allowed: {', '.join(_FSDP_STAGES)}")
            stage = _FSDP_STAGES[strategy]
        notes.append(f"FSDP estimated as ZeRO-{stage} over {procs} ranks (DeepSpeed's 2 + 2 + 12 bytes layout; "
                     f"simulate --world-size N runs FSDP2 itself)")
        if f.get("fsdp_offload_params"):
            notes.append("fsdp_offload_params: FSDP's CPU offload of parameters, gradients and optimizer "
                         "state is not modelled (the device holds less than estimated)")
        return AccelerateRun(world_size=procs, mixed_precision=mixed, zero=stage, notes=tuple(notes))
    if kind not in ("NO", "MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_MUSA"):
        raise InputError(f"{where} distributed_type={kind!r} is not counted; allowed: NO, MULTI_GPU, DEEPSPEED, FSDP")
    return AccelerateRun(world_size=procs, mixed_precision=mixed, notes=tuple(notes))


@dataclass(frozen=True)
class LoraSpec:
    """LoRA as peft's ``adapter_config.json`` gives it: ``rank``, the ``targets`` memlab
    counts (:func:`memlab.techniques.finetune.lora_shapes`), ``dropout`` and ``alpha``, with notes on what
    it does not model."""

    rank: int
    targets: tuple[str, ...]
    notes: tuple[str, ...] = ()
    dropout: float = 0.0
    alpha: int | None = None

    def lora_config(self) -> LoraConfig:
        """The run description's :class:`memlab.step.fine_tune_config.LoraConfig` of this file."""
        return LoraConfig(rank=self.rank, targets=self.targets, dropout=self.dropout, alpha=self.alpha)


def read_lora_config(path: str | pathlib.Path | dict, cfg: GPTConfig | tuple[str, ...]) -> LoraSpec:
    """peft's ``adapter_config.json`` (``peft_type`` LORA): ``r``, ``lora_dropout``,
    ``lora_alpha`` and ``target_modules`` (a list of names, ``"all-linear"``, or a regular
    expression peft matches against module names), for the model ``cfg`` (memlab's GPT, or the
    ``Linear`` module names of a Hugging Face decoder: :meth:`memlab.models.decoder_shape.DecoderShape.linears`).
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
    unknown = [t for t in targets if t not in names and t != LM_HEAD]  # peft adapts a named head
    if unknown or not targets:
        raise InputError(f"--lora-config target_modules {tm!r} names {unknown or 'nothing'} of "
                         f"this model; allowed: {', '.join(names)}, {LM_HEAD}")
    notes = []
    for key, off in (("modules_to_save", None), ("use_dora", False), ("bias", "none"),
                     ("trainable_token_indices", None), ("lora_bias", False)):
        if d.get(key, off) not in (off, [], None if off is None else off):
            notes.append(f"--lora-config {key}={d[key]!r} is not modelled (its extra trainable "
                         f"parameters and state are not counted)")
    # fields that change which modules or how large the adapters are: named, never dropped
    for key in ("layers_to_transform", "rank_pattern", "alpha_pattern", "exclude_modules", "layer_replication"):
        if d.get(key) not in (None, {}, [], ""):
            what = ("alpha only scales: no memory" if key == "alpha_pattern" else
                    "counted on every layer and module at rank r (an over-estimate where it narrows them)")
            notes.append(f"--lora-config {key}={d[key]!r} is not modelled: {what}")
    dropout = d.get("lora_dropout") or 0.0
    if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise InputError(f"--lora-config lora_dropout={dropout!r}; allowed: 0 <= dropout < 1")
    return LoraSpec(rank=rank, targets=targets, notes=tuple(notes), dropout=float(dropout),
                    alpha=d.get("lora_alpha"))


def trainer_precision(bf16, fp16) -> str:
    """The precision of TrainingArguments' ``bf16`` and ``fp16`` flags: ``"bf16"``, ``"fp16"`` or
    ``"fp32"`` (neither: no autocast); both on is refused, as TrainingArguments refuses it
    (transformers 5 ``training_args.py``: "At most one of fp16 and bf16 can be True")."""
    if bf16 and fp16:
        raise InputError("--training-args sets bf16 and fp16; allowed: one of them")
    return "bf16" if bf16 else "fp16" if fp16 else "fp32"


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
    """A training YAML mapped onto the step: ``micro_batch`` and ``accumulation`` (the step's
    batch is their product), ``precision``, ``checkpointing`` (``"full"`` or ``None``),
    ``optimizer`` (memlab's name, :data:`memlab.step.low_bit.HF_OPTIMIZERS`), ``deepspeed`` (a path
    or a dict) and ``fsdp`` as given, ``seq`` the maximum length (or ``None``), ``lora`` and
    ``quantization`` the adapters and the 4/8-bit base the file's model arguments ask for,
    ``attention`` its ``attn_implementation``, ``launcher`` whose rules read it
    (:data:`LAUNCHERS`), and ``notes`` naming what is not modelled."""

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
    lora: LoraConfig | None = None
    quantization: QuantConfig | None = None
    attention: str | None = None
    launcher: str = "trainer"


#: the launchers whose YAMLs read_training_args takes, by the keys that tell them apart
LAUNCHERS = ("trainer", "llamafactory", "axolotl")
#: TRL's ModelConfig fields (trl 1.16 ``trainer/model_config.py``) and their defaults
TRL_MODEL_ARGS = {"model_name_or_path": None, "model_revision": "main", "dtype": None, "torch_dtype": None,
                  "attn_implementation": None, "use_peft": False, "lora_r": 16, "lora_alpha": 32,
                  "lora_dropout": 0.05, "lora_target_modules": None, "lora_target_parameters": None,
                  "lora_modules_to_save": None, "lora_task_type": "CAUSAL_LM", "use_rslora": False,
                  "use_dora": False, "load_in_8bit": False, "load_in_4bit": False,
                  "bnb_4bit_quant_type": "nf4", "use_bnb_nested_quant": False, "bnb_4bit_quant_storage": None,
                  "trust_remote_code": False}
_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
           "float32": "fp32", "fp32": "fp32", "float": "fp32", "auto": None, None: None}


def _defaults() -> dict:
    """TrainingArguments' field defaults as its ``to_json_string()`` writes them (enums as
    their values), recorded for this transformers version (memlab.hf.config_check.recorded:
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


def launcher_of(d: dict) -> str:
    """Which launcher a training YAML is written for (:data:`LAUNCHERS`): LLaMA-Factory's
    (``finetuning_type``, ``cutoff_len``, ``lora_target``, ``quantization_bit``), axolotl's
    (``base_model``, ``micro_batch_size``, ``sequence_len``, ``adapter``), else the Trainer's
    (TrainingArguments, TRL's configs and ModelConfig, the handbooks' recipes)."""
    if any(k in d for k in ("finetuning_type", "cutoff_len", "lora_target", "quantization_bit", "lora_rank")):
        return "llamafactory"
    if any(k in d for k in ("base_model", "micro_batch_size", "sequence_len", "adapter")):
        return "axolotl"
    return "trainer"


def _int(d: dict, key: str, default, where: str) -> int:
    v = d.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise InputError(f"{where} {key}={v!r}; allowed: a positive integer")
    return v


def _quant(bits, *, where: str, key: str, compute: str | None, double: bool = True,
           quant_type: str = "nf4") -> QuantConfig | None:
    if bits in (None, False):
        return None
    if bits not in (4, 8):
        raise InputError(f"{where} {key}={bits!r}; allowed: 4 or 8 (bitsandbytes)")
    return QuantConfig(bits=bits, double_quant=bool(double), quant_type=str(quant_type or "nf4"),
                       compute_dtype=compute or "bf16")


#: LLaMA-Factory's own keys this reader turns into the run (``hparams`` at ff6d4d1), and those
#: that decide nothing a training step holds (data, templates, output)
_LF_READ = frozenset({"model_name_or_path", "quantization_bit", "quantization_method", "quantization_type",
                      "double_quantization", "trust_remote_code", "stage", "finetuning_type", "lora_rank",
                      "lora_alpha", "lora_dropout", "lora_target", "cutoff_len", "pure_bf16",
                      "disable_gradient_checkpointing", "flash_attn"})
_LF_NO_MEMORY = frozenset({"dataset", "eval_dataset", "template", "max_samples", "preprocessing_num_workers",
                           "overwrite_cache", "plot_loss", "overwrite_output_dir", "save_only_model", "ddp_timeout",
                           "val_size", "tokenized_path", "enable_thinking", "dataset_dir", "media_dir"})


def _named_fields(d: dict, defaults: dict, known: set | frozenset) -> list[str]:
    """The fields of a training YAML that change a step's memory and that no reader models: a
    TrainingArguments field set away from its default, or a field TrainingArguments does not have."""
    return sorted(k for k, v in d.items() if k not in known and not k.startswith(_NO_MEMORY)
                  and v not in (None, "", [], {}) and (k not in defaults or v != defaults[k]))


def _llamafactory(d: dict) -> tuple[dict, LoraConfig | None, QuantConfig | None, int, list[str], str | None]:
    """A LLaMA-Factory YAML as TrainingArguments fields, its LoRA and quantisation, the sequence
    length and the notes; defaults from LLaMA-Factory's ``hparams`` (``finetuning_type`` "lora",
    ``lora_rank`` 8, ``lora_alpha`` 2 x rank, ``lora_dropout`` 0, ``lora_target`` "all",
    ``cutoff_len`` 2048, ``double_quantization`` true; gradient checkpointing on unless
    ``disable_gradient_checkpointing``: ``hparams/finetuning_args.py``, ``data_args.py``,
    ``model_args.py`` at commit ff6d4d1)."""
    where = "LLaMA-Factory"
    kind = d.get("finetuning_type", "lora")
    notes = [f"read by LLaMA-Factory's rules (finetuning_type {kind}, cutoff_len, lora_rank/lora_target, "
             f"quantization_bit; gradient checkpointing on unless disable_gradient_checkpointing)"]
    if kind not in ("lora", "full"):
        raise InputError(f"{where} finetuning_type={kind!r} is not counted; allowed: lora, full")
    stage = d.get("stage", "sft")
    if stage not in ("sft", "pt"):
        raise InputError(f"{where} stage={stage!r}: a second model (reference or reward) is not "
                         f"counted here; allowed: sft, pt")
    lora = None
    if kind == "lora":
        rank = _int(d, "lora_rank", 8, where)
        target = d.get("lora_target", "all")
        targets = "all-linear" if target in ("all", None) else tuple(
            t.strip() for t in (target.split(",") if isinstance(target, str) else target))
        lora = LoraConfig(rank=rank, targets=targets, dropout=float(d.get("lora_dropout") or 0.0),
                          alpha=d.get("lora_alpha") or 2 * rank)
    method = d.get("quantization_method", "bnb")
    if d.get("quantization_bit") is not None and method != "bnb":
        raise InputError(f"{where} quantization_method={method!r}; allowed: bnb (bitsandbytes)")
    compute = "bf16" if d.get("bf16") else "fp16" if d.get("fp16") else "bf16"
    quant = _quant(d.get("quantization_bit"), where=where, key="quantization_bit", compute=compute,
                   double=d.get("double_quantization", True), quant_type=d.get("quantization_type", "nf4"))
    seq = _int(d, "cutoff_len", 2048, where)
    ta = {k: v for k, v in d.items() if k in _defaults()}
    ta["gradient_checkpointing"] = not d.get("disable_gradient_checkpointing", False)
    # the base loads in its own dtype (loader.py: torch_dtype "auto"; parser.py: bf16 -> compute
    # dtype bf16); adapter.py's cast_trainable_params_to_fp32 (lines 338-352) upcasts what
    # trains to fp32 unless pure_bf16: a LoRA base stays bf16, a full fine-tune trains fp32
    # weights under bf16 autocast
    precision = None
    if d.get("pure_bf16"):
        precision = "pure-bf16"
        notes.append("pure_bf16: weights and optimizer states in bf16")
    elif lora is not None and quant is None and (d.get("bf16") or d.get("fp16")):
        precision = "pure-bf16" if d.get("bf16") else None
        notes.append("LoRA: the base stays in its bf16 dtype, the adapters are upcast to fp32 "
                     "(LLaMA-Factory's cast_trainable_params_to_fp32)")
    left = _named_fields(d, _defaults(), _LF_READ | _LF_NO_MEMORY | set(MODELLED))
    if left:
        notes.append(f"LLaMA-Factory keys not modelled: {', '.join(left)}")
    return ta, lora, quant, seq, notes, precision


_AXOLOTL_OPTIM = {"adamw_bnb_8bit": "adamw_bnb_8bit", "paged_adamw_8bit": "paged_adamw_8bit",
                  "paged_adamw_32bit": "paged_adamw_32bit", "adamw_torch": "adamw_torch",
                  "adamw_torch_fused": "adamw_torch_fused", "adamw_8bit": "adamw_8bit", "sgd": "sgd"}


#: axolotl keys this reader turns into the run (the rest of :func:`_axolotl`'s body), and the
#: attention switches of its schema (``flash_attention``, ``sdp_attention``, ``xformers_attention``,
#: ``eager_attention`` before e4032fc9, ``attn_implementation`` after)
_AXOLOTL_READ = frozenset({
    "base_model", "model_type", "tokenizer_type", "load_in_8bit", "load_in_4bit", "adapter", "lora_r",
    "lora_alpha", "lora_dropout", "lora_target_linear", "lora_target_modules", "lora_modules_to_save",
    "sequence_len", "sample_packing", "pad_to_sequence_len", "micro_batch_size", "gradient_accumulation_steps",
    "optimizer", "bf16", "fp16", "gradient_checkpointing", "gradient_checkpointing_kwargs", "deepspeed", "fsdp",
    "fsdp_config", "learning_rate", "attn_implementation", "flash_attention", "sdp_attention",
    "xformers_attention", "eager_attention"})
#: axolotl keys that do not change a training step's device memory: data, paths, logging,
#: schedule, evaluation and saving (a run's eval and save are not its training step)
_AXOLOTL_NO_MEMORY = frozenset({
    "datasets", "dataset_prepared_path", "val_set_size", "output_dir", "hub_model_id", "num_epochs", "max_steps",
    "lr_scheduler", "warmup_ratio", "warmup_steps", "logging_steps", "evals_per_epoch", "saves_per_epoch",
    "eval_steps", "save_steps", "eval_table_size", "eval_max_new_tokens", "eval_sample_packing",
    "resume_from_checkpoint", "strict", "train_on_inputs", "group_by_length", "weight_decay", "tf32",
    "local_rank", "early_stopping_patience", "debug", "lora_model_dir", "lora_fan_in_fan_out", "save_first_step",
    "chat_template", "seed", "save_total_limit", "max_grad_norm", "adam_beta1", "adam_beta2", "adam_epsilon"})


def _axolotl_attention(d: dict) -> str | None:
    """``attn_implementation`` from axolotl's own spelling of it (``eager`` is HF's own attention)."""
    if d.get("attn_implementation"):
        return str(d["attn_implementation"])
    for key, name in (("flash_attention", "flash_attention_2"), ("sdp_attention", "sdpa"),
                      ("xformers_attention", "xformers"), ("eager_attention", "eager")):
        if d.get(key):
            return name
    return None


def _axolotl(d: dict) -> tuple[dict, LoraConfig | None, QuantConfig | None, int, list[str], str | None]:
    """An axolotl YAML as TrainingArguments fields, its LoRA and quantisation, the sequence
    length and the notes; defaults from axolotl's schema (``sequence_len`` 512,
    ``micro_batch_size`` 1, ``gradient_accumulation_steps`` 1: ``src/axolotl/utils/schemas/``
    ``config.py`` and ``training.py`` at commit 067b021); ``lora_target_linear`` adapts every
    Linear, ``bf16: auto`` is bf16 on a card that has it."""
    where = "axolotl"
    adapter = d.get("adapter")
    notes = [f"read by axolotl's rules (adapter {adapter or 'none: full fine-tune'}, sequence_len, "
             f"micro_batch_size, bf16: auto as bf16)"]
    if adapter not in (None, "", "lora", "qlora"):
        raise InputError(f"axolotl adapter={adapter!r} is not counted; allowed: lora, qlora or none")
    lora = None
    if adapter:
        rank = _int(d, "lora_r", 8, where)
        tm = d.get("lora_target_modules")
        if d.get("lora_target_linear") or not tm:
            targets = "all-linear"
        else:
            targets = tuple(tm) if not isinstance(tm, str) else tuple(tm.split(","))
        lora = LoraConfig(rank=rank, targets=targets, dropout=float(d.get("lora_dropout") or 0.0),
                          alpha=d.get("lora_alpha"))
        if d.get("lora_modules_to_save"):
            notes.append(f"axolotl lora_modules_to_save={d['lora_modules_to_save']!r} is not modelled "
                         f"(those modules train whole: their weights' copies, gradients and states are "
                         f"not counted)")
    bits = 4 if d.get("load_in_4bit") or adapter == "qlora" else 8 if d.get("load_in_8bit") else None
    bf16 = d.get("bf16") in (True, "auto", "true")
    quant = _quant(bits, where=where, key="load_in_4bit" if bits == 4 else "load_in_8bit",
                   compute="bf16" if bf16 else "fp16" if d.get("fp16") else "fp32")
    if quant is not None and lora is None:
        raise InputError(f"axolotl load_in_{bits}bit without adapter: a {bits}-bit base is frozen; "
                         f"allowed: adapter lora or qlora")
    seq = _int(d, "sequence_len", 512, where)
    optim = d.get("optimizer") or "adamw_torch"
    if optim not in _AXOLOTL_OPTIM:
        raise InputError(f"axolotl optimizer={optim!r} is not counted; allowed: {', '.join(_AXOLOTL_OPTIM)}")
    ta = {"per_device_train_batch_size": _int(d, "micro_batch_size", 1, where),
          "gradient_accumulation_steps": _int(d, "gradient_accumulation_steps", 1, where),
          "bf16": bf16, "fp16": bool(d.get("fp16")) and not bf16,
          "gradient_checkpointing": bool(d.get("gradient_checkpointing")),
          "gradient_checkpointing_kwargs": d.get("gradient_checkpointing_kwargs"),
          "optim": _AXOLOTL_OPTIM[optim], "deepspeed": d.get("deepspeed"),
          "learning_rate": d.get("learning_rate")}
    if d.get("sample_packing"):
        ta["packing"] = True
    if d.get("fsdp"):
        ta["fsdp"] = d["fsdp"]  # the Trainer's own fsdp list: read as the TrainingArguments' fsdp
        if (d.get("fsdp_config") or {}).get("fsdp_offload_params"):
            notes.append("axolotl fsdp_config.fsdp_offload_params: FSDP's CPU offload is not modelled")
    special = d.get("special_tokens")
    left = sorted(k for k, v in d.items() if k not in _AXOLOTL_READ and k not in _AXOLOTL_NO_MEMORY
                  and k not in ("special_tokens", "tokens") and v not in (None, "", [], {}, False))
    if isinstance(special, dict) and set(special) - {"pad_token", "bos_token", "eos_token", "unk_token"}:
        left.append("special_tokens")
    if d.get("tokens"):
        left.append("tokens")  # new tokens resize the embeddings and the head
    if left:
        notes.append(f"axolotl keys not modelled: {', '.join(left)}")
    # axolotl loads the base in bf16 under bf16 (its torch_dtype): a LoRA base and a full
    # fine-tune alike hold 16-bit weights
    precision = "pure-bf16" if bf16 and quant is None and not d.get("deepspeed") else None
    return {k: v for k, v in ta.items() if v is not None}, lora, quant, seq, notes, precision


def _trl_model_args(d: dict, precision: str) -> tuple[LoraConfig | None, QuantConfig | None, str | None, list[str]]:
    """TRL's ``ModelConfig`` fields in a handbook or TRL recipe (beside its TrainingArguments):
    ``use_peft`` and ``lora_*`` as ``trl.get_peft_config`` builds peft's LoraConfig,
    ``load_in_4bit``/``load_in_8bit`` as ``get_quantization_config`` builds bitsandbytes' (its
    compute dtype the ``dtype``), ``dtype``/``torch_dtype`` and ``attn_implementation``."""
    notes: list[str] = []
    dtype_key = "dtype" if d.get("dtype") is not None else "torch_dtype"
    dtype = d.get(dtype_key)
    if dtype not in _DTYPES:
        raise InputError(f"--training-args {dtype_key}={dtype!r}; allowed: {', '.join(k for k in _DTYPES if k)}")
    compute = _DTYPES[dtype]
    lora = None
    if d.get("use_peft"):
        rank = _int(d, "lora_r", 16, "--training-args")
        tm = d.get("lora_target_modules")
        if tm is None:
            notes.append("lora_target_modules unset: peft's default for the architecture (q_proj, v_proj "
                         "on Llama/Mistral/Qwen); counted as q_proj, v_proj")
            tm = ["q_proj", "v_proj"]
        targets = "all-linear" if tm == "all-linear" else tuple([tm] if isinstance(tm, str) else tm)
        lora = LoraConfig(rank=rank, targets=targets, dropout=float(d.get("lora_dropout", 0.05) or 0.0),
                          alpha=d.get("lora_alpha", 32))
        for key in ("lora_modules_to_save", "use_dora", "lora_target_parameters"):
            if d.get(key):
                notes.append(f"--training-args {key}={d[key]!r} is not modelled")
    bits = 4 if d.get("load_in_4bit") else 8 if d.get("load_in_8bit") else None
    quant = _quant(bits, where="--training-args", key=f"load_in_{bits}bit", compute=compute or "fp32",
                   double=d.get("use_bnb_nested_quant", False), quant_type=d.get("bnb_4bit_quant_type", "nf4"))
    if quant is not None and lora is None:
        raise InputError(f"--training-args load_in_{bits}bit without use_peft: a {bits}-bit base is "
                         f"frozen; allowed: use_peft: true")
    attention = d.get("attn_implementation")
    if attention:
        notes.append(f"attn_implementation {attention}: counted as SDPA's fused kernel (the same saved "
                     f"q, k, v, output and log-sum-exp as FlashAttention-2)"
                     if attention != "eager" else "attn_implementation eager: HF's own attention")
    return lora, quant, attention, notes


def _beside(ds, path):
    """A DeepSpeed config path named in a training YAML, as the launcher finds it: relative to
    the working directory (where the launcher runs), else beside the YAML or under a folder
    above it (the recipe's repository root), else by its name beside the YAML."""
    if not isinstance(ds, str) or isinstance(path, dict) or pathlib.Path(ds).is_file():
        return ds
    here = pathlib.Path(path).resolve().parent
    for base in (here, *here.parents):
        if (base / ds).is_file():
            return str(base / ds)
    return str(here / pathlib.Path(ds).name) if (here / pathlib.Path(ds).name).is_file() else ds


def read_training_args(path: str | pathlib.Path | dict) -> TrainingRun:  # noqa: C901 one branch per launcher's spelling of a field
    """A training YAML (or JSON) as one of :data:`LAUNCHERS` writes it: a ``TrainingArguments``
    or TRL config (``args.to_json_string()``), with TRL's ``ModelConfig`` fields beside it as the
    handbooks' recipes put them; a LLaMA-Factory recipe; an axolotl config (:func:`launcher_of`).
    Returns a :class:`TrainingRun` whose note names the launcher whose rules were applied; an
    ``optim`` memlab does not count is bad input naming those it does.

    Over 80 lines because it reads each launcher's spelling of the same fields (TrainingArguments,
    TRL, LLaMA-Factory, axolotl) in one pass, one field a line.
    """
    d = load_file(path, "--training-args")
    if is_accelerate_config(d):
        raise InputError("--training-args: this is an accelerate config (compute_environment/"
                         "distributed_type); allowed: pass it as --accelerate-config")
    launcher = launcher_of(d)
    defaults = _defaults()
    lora = quant = attention = None
    seq = None
    notes: list[str] = []
    own, forced = d, None
    if launcher == "llamafactory":
        d, lora, quant, seq, notes, forced = _llamafactory(own)
    elif launcher == "axolotl":
        d, lora, quant, seq, notes, forced = _axolotl(own)

    def get(key: str):
        return d.get(key, defaults.get(key))

    micro, accumulation = int(get("per_device_train_batch_size") or 8), int(get("gradient_accumulation_steps") or 1)
    if micro < 1 or accumulation < 1:
        raise InputError(f"--training-args per_device_train_batch_size={micro}, gradient_accumulation_steps="
                         f"{accumulation}; allowed: positive integers")
    precision = trainer_precision(get("bf16"), get("fp16"))
    if launcher == "trainer":
        lora, quant, attention, trl_notes = _trl_model_args(d, precision)
        notes.append("read by the Trainer's rules (TrainingArguments; TRL's ModelConfig fields "
                     "use_peft, lora_*, load_in_4bit/8bit, dtype beside them)")
        notes += trl_notes
        pure = _DTYPES.get(d.get("dtype") or d.get("torch_dtype")) == "bf16"
        if pure and lora is None and quant is None and precision == "bf16" and not get("deepspeed"):
            forced = "pure-bf16"  # a bf16-loaded model: autocast changes nothing, states are 16-bit
    elif launcher == "axolotl":
        attention = _axolotl_attention(own)
    else:  # LLaMA-Factory's flash_attn (hparams/model_args.py): disabled is HF's eager attention
        attention = {"disabled": "eager", "sdpa": "sdpa", "fa2": "flash_attention_2"}.get(own.get("flash_attn"))
    if launcher != "trainer" and attention:
        notes.append(f"attention {attention}: " + ("HF's own attention (its scores kept)" if attention == "eager"
                                                    else "counted as the fused kernel (SDPA's saved q, k, v, "
                                                         "output and log-sum-exp)"))
    if forced == "pure-bf16" and precision != "pure-bf16":
        precision = "pure-bf16"
        notes.append("the model is loaded in bf16 (the launcher's dtype rule): weights"
                     + (" and gradients" if lora is None else " of the frozen base")
                     + " are 16-bit (pure-bf16)")
    ckpt = bool(get("gradient_checkpointing") or get("activation_checkpointing"))
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
    seq = seq or d.get("max_length") or d.get("max_seq_length")  # TRL's SFTConfig (both spellings)
    if d.get("packing"):
        notes.append("packing: every sequence is filled to the maximum length, so the step holds "
                     "that many tokens per sequence")
    elif seq:
        notes.append("the maximum length bounds each batch; without packing a batch pads to its longest "
                     "sequence: the estimate at the maximum is the worst case")
    if launcher == "trainer":
        known = set(TRL_MODEL_ARGS) | set(MODELLED)
        unmodelled = sorted(k for k, v in d.items()
                            if k not in known and not k.startswith(_NO_MEMORY)
                            and k in defaults and v != defaults[k] and v not in (None, "", [], {}))
        if unmodelled:
            notes.append(f"--training-args: not modelled: {', '.join(unmodelled)}")
        unknown = sorted(k for k in d if k not in defaults and k not in known
                         and not k.startswith(_NO_MEMORY))
        if unknown:
            notes.append(f"--training-args: fields TrainingArguments does not have (TRL's?) not modelled: "
                         f"{', '.join(unknown[:12])}{' ...' if len(unknown) > 12 else ''}")
    # the fields HF's DeepSpeed integration checks against the config: the file's own values
    # (or TrainingArguments' defaults), so a mismatch error quotes what the file holds
    checked = {k: get(k) for k in ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2",
                                   "adam_epsilon", "max_grad_norm") if get(k) is not None}
    args = SimpleNamespace(per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
                           bf16=precision in ("bf16", "pure-bf16"), fp16=precision == "fp16",
                           **{k: float(v) for k, v in checked.items()})
    return TrainingRun(micro_batch=micro, accumulation=accumulation, precision=precision,
                       checkpointing="full" if ckpt else None, optimizer=HF_OPTIMIZERS[optim],
                       deepspeed=_beside(get("deepspeed"), path) or None, fsdp=fsdp,
                       seq=int(seq) if seq else None, args=args, notes=tuple(notes),
                       lora=lora, quantization=quant, attention=attention, launcher=launcher)


__all__ = ["DeepSpeedRun", "LoraSpec", "TrainingRun", "HIDDEN_AUTO", "DS_PRECISIONS", "MODELLED",
           "load_file", "resolve_auto", "read_deepspeed", "read_lora_config",
           "read_training_args", "LAUNCHERS", "TRL_MODEL_ARGS", "launcher_of", "is_accelerate_config",
           "accelerate_precision", "AccelerateRun", "read_accelerate", "PLAIN_ZERO", "PLAIN_OFFLOAD", "plain_reading",
           "trainer_precision"]
