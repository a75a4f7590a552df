"""The training step and its report: the shared types every lens uses.

A *step* is what an optimizer loop does once in steady state: forward, backward (over
``micro_batches`` slices of the batch when accumulating), ``optimizer.step()`` and
``zero_grad(set_to_none=True)``. :class:`StepConfig` says which step; :func:`build_trainer`
builds its model and optimizer; :func:`make_batch` its inputs; :class:`MemoryReport` is what
the estimate, the simulation and the measurement return about it.

Over 500 lines because the run description every lens reads documents each of its fields
where it is declared, beside the report those lenses return and the trainer that runs it.
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from html import escape
from importlib import resources
from typing import Literal

import torch
import torch.nn as nn

from memlab.core.errors import InputError
from memlab.core.precision import PRECISIONS, check_precision
from memlab.core.torch_private import activation_memory_budget
from memlab.core.units import MiB, fmt_bytes
from memlab.models.decoder_shape import MEMLAB_GPT, DecoderShape
from memlab.models.gpt_unet import GPTConfig, UNetConfig, build_model, get_config
from memlab.step.activation_offload import offload_context
from memlab.step.compiled import PartitionedModel, check_budget, compile_layers, compile_model
from memlab.step.decoder_states import adapter_shapes, adapters_for
from memlab.step.fine_tune_config import LoraConfig, QuantConfig
from memlab.step.low_bit import BLOCKWISE, EIGHT_BIT, OPTIMIZER_STATES, TORCHAO, eight_bit_adamw, torchao_adamw
from memlab.step.optimizer_in_backward import OptimizerInBackward
from memlab.step.parallel_dims import ParallelDims
from memlab.step.states import OFFLOADS, PARAM_OFFLOAD, ZeroBuckets
from memlab.tracking.tracker import CATEGORIES, Event, OOMInfo

OPTIMIZERS = ("adamw", "sgd")
#: memlab's GPT also runs bitsandbytes' 8-bit AdamW, plain or paged, and torchao's low-bit AdamW
#: (:data:`memlab.step.low_bit.BLOCKWISE`)
GPT_OPTIMIZERS = (*OPTIMIZERS, *BLOCKWISE)
#: a Hugging Face decoder's steps (:class:`memlab.models.decoder_shape.DecoderShape` models) checkpoint whole layers
DECODER_CHECKPOINTING = ("none", "full")
#: a decoder's losses: its class's own (``None``: ``transformers``' upcast logits) or chunked
DECODER_LOSSES = ("transformers", "chunked")
#: whose code trains a decoder: the Hugging Face class, or litgpt's own model and LoRA loop at one
#: of two commits (:mod:`memlab.lenses.litgpt_estimate`: they differ in the RMSNorm's dtype)
DECODER_IMPLEMENTATIONS = ("transformers", "litgpt-8641822", "litgpt-6178c7cc")
#: what the step owns of its model's switches (see :class:`StepConfig`)
SWITCHES = ("checkpointing", "attention")


@dataclass(frozen=True)
class StepConfig:
    """Everything that decides the memory of one training step.

    ``model`` is a preset name or a config. ``zero``, ``world_size`` and ``offload`` describe
    data-parallel sharding: the single-process lenses account for them by formula.

    ``checkpointing`` and ``attention`` are switches of the model config (a model built on
    its own needs them); a step only chooses them for its step: what a lesson varies
    (``replace(step, checkpointing="full")``) while the model stays the same. ``None`` (the
    default) keeps the model's own; a value replaces it. :attr:`model_config` is the one place
    where the two meet, and the one to read: ``step.model_config.checkpointing`` is what is
    built and estimated. A UNet has no ``attention`` switch (SDPA at its lowest resolution):
    ``attention`` must stay ``None``.

    ``optimizer_in_backward``: the optimizer step fused into backward
    (:class:`memlab.step.optimizer_in_backward.OptimizerInBackward`): each parameter is updated and its
    gradient freed as soon as the gradient is ready. It needs one micro-batch, no fp16 loss
    scaler and no ZeRO or offload (DeepSpeed owns the step there).

    ``activation_offload``: every tensor forward saves copied to host memory and brought back
    for backward (``torch.autograd.graph.save_on_cpu``, :mod:`memlab.step.activation_offload`, which
    says what each lens counts: on a CPU device nothing moves).

    Raises:
        InputError: a field value that is not allowed (checked when the step is made).
    """

    model: str | GPTConfig | UNetConfig | DecoderShape = "tiny"
    """A preset name, memlab's GPT or UNet config, or a decoder's shape (a Hugging Face config
    read by :func:`memlab.hf.shape.decoder_shape`)."""
    seq: int = 256
    """Tokens per sequence (a UNet: the image side)."""
    batch: int = 8
    """Sequences per rank per optimizer step, all micro-batches together."""
    precision: str = "fp32"
    """``fp32``, ``bf16``/``fp16`` (autocast on fp32 weights) or ``pure-bf16``."""
    checkpointing: str | None = None
    """``None``: the model config's own; ``none``, ``full``, ``selective`` (memlab's GPT; a
    decoder checkpoints whole layers: ``none`` or ``full``)."""
    attention: str | None = None
    """``None``: the model config's own (a decoder: its class's SDPA); ``naive`` or ``sdpa``."""
    optimizer: str = "adamw"
    """:data:`OPTIMIZERS` for memlab's models; memlab's GPT also bitsandbytes' ``AdamW8bit`` and
    ``PagedAdamW8bit`` (:data:`GPT_OPTIMIZERS`: ``"adamw-8bit"``, ``"paged-adamw-8bit"``, plain PyTorch
    only: no ZeRO or offload); a decoder all of :data:`memlab.step.low_bit.OPTIMIZER_STATES`
    (8-bit, paged, Adafactor)."""
    micro_batches: int = 1
    """Micro-batches accumulated into one optimizer step."""
    zero: int = 0
    """DeepSpeed's ZeRO stage (0-3)."""
    world_size: int = 1
    """Ranks in all: data-parallel replicas times the tensor and pipeline degrees of ``parallel``."""
    offload: str = "none"
    """DeepSpeed's offload: ``none``, ``optimizer``, ``all``."""
    lora: LoraConfig | None = None
    """LoRA adapters on a frozen base (a decoder's run; memlab's GPT: :mod:`memlab.techniques.finetune`)."""
    quantization: QuantConfig | None = None
    """The frozen base in bitsandbytes' 4- or 8-bit layout (needs ``lora``)."""
    loss: str | None = None
    """A decoder's loss: ``None``/``transformers`` (its class's) or ``chunked``."""
    loss_chunk: int = 1024
    """Tokens per chunk of the chunked loss."""
    implementation: str = "transformers"
    """A decoder's code (:data:`DECODER_IMPLEMENTATIONS`): ``transformers`` (the Hugging Face class)
    or Lightning-AI/litgpt's model and ``finetune/lora.py`` at commit 8641822 or 6178c7cc, which
    the estimate counts (:mod:`memlab.lenses.litgpt_estimate`)."""
    parallel: ParallelDims = ParallelDims()
    """The tensor, pipeline and expert degrees over ``world_size`` ranks (:class:`ParallelDims`;
    all 1: data parallelism only)."""
    buckets: ZeroBuckets | None = None
    """DeepSpeed's buffer sizes as a run's config sets them (``None``: DeepSpeed's defaults)."""
    optimizer_in_backward: bool = False
    """Each parameter's optimizer step runs in backward, as its gradient is ready
    (``register_post_accumulate_grad_hook``; torchtune's ``optimizer_in_bwd``): the gradients never
    all exist at once. One micro-batch, no fp16 scaler, no DeepSpeed."""
    activation_offload: bool = False
    """Forward's saved tensors go to host memory (``torch.autograd.graph.save_on_cpu``), come back
    for backward."""
    compile: bool | Literal["layers"] = False
    """The model under ``torch.compile`` (inductor): the min-cut partitioner chooses what forward
    saves (:mod:`memlab.step.compiled` says what each lens counts). ``True``: the whole model and
    its loss, one graph each way. ``"layers"``: as torchtune compiles (a GPT with the plain loss),
    each block and the loss apart, the rest eager (:func:`memlab.step.compiled.compile_layers`); with
    full checkpointing each compiled block is checkpointed from outside, torchtune's order."""
    activation_memory_budget: float | None = None
    """``torch._functorch.config.activation_memory_budget`` for the compile (``None``: its default,
    1.0); 0.5 keeps about half of what the default saves and recomputes the rest. Needs ``compile``."""

    def __post_init__(self) -> None:
        for name in ("seq", "batch", "micro_batches", "world_size", "loss_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name.replace('_', ' ')} must be a positive integer, got {value!r}")
        check_precision(self.precision)
        self._check_parallel()
        # DeepSpeed's parameter-only offload is read from a decoder's DeepSpeed config
        offloads = (*OFFLOADS, PARAM_OFFLOAD) if isinstance(self.model, DecoderShape) else OFFLOADS
        if self.offload not in offloads:
            raise InputError(f"offload={self.offload!r}; allowed: {', '.join(offloads)}")
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise InputError(f"ZeRO stage {self.zero!r} is outside 0-3")
        if self.batch % self.micro_batches:
            raise InputError(f"batch {self.batch} is not divisible into {self.micro_batches} "
                             f"micro-batches; choose a divisor of the batch")
        self._check_in_backward()
        if not isinstance(self.activation_offload, bool):
            raise InputError(f"activation_offload={self.activation_offload!r}; allowed: True, False")
        if not isinstance(self.compile, bool) and self.compile != "layers":
            raise InputError(f"compile={self.compile!r}; allowed: True, False, 'layers'")
        if self.compile == "layers" and not (isinstance(self.model_config, GPTConfig)
                                             and self.model_config.loss in ("plain", "chunked_output")):
            raise InputError(f"compile='layers' compiles a GPT's blocks and its plain loss apart; the model "
                             f"{getattr(self.model_config, 'name', self.model)!r} is not a GPT with loss='plain' "
                             f"or 'chunked_output'; allowed for it: compile=True or False")
        check_budget(self.activation_memory_budget, self.compile)
        if self.quantization is not None and self.lora is None:
            raise InputError("a 4-/8-bit base is frozen: give LoRA adapters to train (lora=LoraConfig(...))")
        if isinstance(self.model, DecoderShape):
            self._check_decoder()
            return
        extras = {n: getattr(self, n) for n in ("lora", "quantization", "loss", "buckets")}
        extras.update(implementation=self.implementation if self.implementation != "transformers" else None)
        experts = (self.parallel.expert, self.parallel.expert_imbalance) != (1, 1.0)
        extras.update({"parallel.expert": self.parallel if experts else None})
        given = [n for n, v in extras.items() if v is not None]
        if given:
            raise InputError(f"{', '.join(given)}: fields of a Hugging Face decoder's run (a DecoderShape "
                             f"model); memlab's own models take LoRA through memlab.techniques.finetune "
                             f"and their loss from their config")
        cfg = get_config(self.model) if isinstance(self.model, str) else self.model
        for name in SWITCHES:
            on_step = getattr(self, name)
            if on_step is not None and name not in getattr(cfg, "__dataclass_fields__", {}):
                raise InputError(f"{name}={on_step!r}: the model {cfg.name!r} has no {name} "
                                 f"switch; leave {name} unset")
        cfg = self.model_config  # validates the preset name and the switches' values
        self._check_optimizer(cfg)
        limit = cfg.block_size if isinstance(cfg, GPTConfig) else 4096
        if self.seq > limit:
            raise InputError(f"seq {self.seq} exceeds the model's block size; allowed: 1-{limit}")

    def _check_decoder(self) -> None:
        """The fields of a decoder's run (a :class:`DecoderShape` model)."""
        s = self.model
        if s.model_type == MEMLAB_GPT:  # its shape describes it; its class and switches are the config's
            raise InputError(f"model={s.name!r} is memlab's GPT as a shape; allowed: its GPTConfig (or preset "
                             f"name), whose class the lenses build")
        if self.compile or self.activation_offload:  # no lens of a decoder's run counts them
            raise InputError(f"compile={self.compile!r}, activation_offload={self.activation_offload!r} for a "
                             f"Hugging Face decoder: counted for memlab's GPT (a GPTConfig model); allowed "
                             f"for a decoder: compile=False, activation_offload=False")
        if self.optimizer not in OPTIMIZER_STATES:
            raise InputError(f"optimizer={self.optimizer!r}; allowed: {', '.join(OPTIMIZER_STATES)}")
        if (self.checkpointing or "none") not in DECODER_CHECKPOINTING:
            raise InputError(f"checkpointing={self.checkpointing!r} for a Hugging Face model; allowed: "
                             f"{', '.join(DECODER_CHECKPOINTING)} (HF checkpoints whole decoder layers)")
        if self.attention not in (None, "naive", "sdpa"):
            raise InputError(f"attention={self.attention!r}; allowed: naive, sdpa")
        if (self.loss or "transformers") not in DECODER_LOSSES:
            raise InputError(f"loss={self.loss!r}; allowed: {', '.join(DECODER_LOSSES)}")
        if self.implementation not in DECODER_IMPLEMENTATIONS:
            raise InputError(f"implementation={self.implementation!r}; allowed: {', '.join(DECODER_IMPLEMENTATIONS)}")
        if s.context is not None and self.seq > s.context:
            raise InputError(f"seq {self.seq} exceeds the model's context of {s.context} tokens "
                             f"(max_position_embeddings, rope-scaled where the config says so); "
                             f"allowed: 1-{s.context}")
        if self.lora is not None:  # its target names checked against the layers' Linear modules
            adapters_for(s, self.lora, self.precision, self.quantization is not None)

    def _check_parallel(self) -> None:
        """``parallel`` is a :class:`ParallelDims` whose tensor and pipeline degrees divide ``world_size``."""
        if not isinstance(self.parallel, ParallelDims):
            raise InputError(f"parallel={self.parallel!r}; allowed: a memlab.step.parallel_dims.ParallelDims")
        split = self.parallel.tensor * self.parallel.pipeline
        if self.world_size % split:
            raise InputError(f"parallel.tensor x parallel.pipeline = {split} on world_size={self.world_size} ranks; "
                             f"allowed: a divisor of the world size")

    def _check_optimizer(self, cfg: GPTConfig | UNetConfig) -> None:
        """The optimizer of memlab's own model: :data:`OPTIMIZERS`, and for its GPT bitsandbytes'
        8-bit AdamW, which DeepSpeed's ZeRO optimizer does not run."""
        allowed = GPT_OPTIMIZERS if isinstance(cfg, GPTConfig) else OPTIMIZERS
        if self.optimizer not in allowed:
            raise InputError(f"optimizer={self.optimizer!r} for {cfg.name!r}; allowed: {', '.join(allowed)}")
        if self.optimizer in BLOCKWISE and (self.zero or self.offload != "none"):
            raise InputError(f"optimizer={self.optimizer!r} with zero={self.zero}, offload={self.offload!r}: "
                             f"bitsandbytes' and torchao's optimizers step plain PyTorch's weights, "
                             f"DeepSpeed runs its own; "
                             f"allowed with it: zero=0, offload='none'")

    def _check_in_backward(self) -> None:
        """The conditions the optimizer step in backward needs (see the field)."""
        if not isinstance(self.optimizer_in_backward, bool):
            raise InputError(f"optimizer_in_backward={self.optimizer_in_backward!r}; allowed: True, False")
        if not self.optimizer_in_backward:
            return
        if self.micro_batches != 1:
            raise InputError(f"optimizer_in_backward with micro_batches={self.micro_batches}: each gradient "
                             f"is applied as it is made, so it cannot accumulate; allowed: micro_batches=1")
        if self.precision == "fp16":
            raise InputError("optimizer_in_backward with precision='fp16': the loss scaler unscales and "
                             "checks every gradient before any step; allowed: fp32, bf16, pure-bf16")
        if self.zero or self.offload != "none":
            raise InputError(f"optimizer_in_backward with zero={self.zero}, offload={self.offload!r}: "
                             f"DeepSpeed owns the optimizer step; allowed: zero=0, offload='none'")

    @property
    def model_config(self) -> GPTConfig | UNetConfig | DecoderShape:
        """The model the step builds: its config with the switches the step sets (and, for a
        UNet, ``seq`` as the image side); a decoder's shape as it is (its run's switches are
        the step's own fields)."""
        if isinstance(self.model, DecoderShape):
            return self.model
        cfg = get_config(self.model) if isinstance(self.model, str) else self.model
        over = {n: getattr(self, n) for n in SWITCHES if getattr(self, n) is not None}
        if isinstance(cfg, UNetConfig):
            over["image_size"] = self.seq
        return replace(cfg, **over) if over else cfg

    @property
    def checkpointing_used(self) -> str:
        """The checkpointing the step runs with (the model's own, or the step's)."""
        if isinstance(self.model, DecoderShape):
            return self.checkpointing or "none"
        return self.model_config.checkpointing

    @property
    def trainable_params(self) -> int:
        """Parameters that train: the adapters under LoRA (a decoder's), else all of them."""
        cfg = self.model_config
        if isinstance(cfg, DecoderShape) and self.lora is not None:
            ad = adapters_for(cfg, self.lora, self.precision, self.quantization is not None)
            return sum(r * c for r, c in adapter_shapes(cfg, ad))
        return cfg.num_params()

    def describe(self) -> dict:
        """The step as the JSON report's ``config``: every field, the model's name, its
        config and parameter counts.

        A dict because it is the JSON report's ``config``.
        """
        cfg = self.model_config
        d = {k: v for k, v in asdict(self).items() if k not in ("model", "lora", "quantization")}
        d["model"] = cfg.name
        d["model_config"] = asdict(cfg)
        d["checkpointing"] = self.checkpointing_used
        d["attention"] = self.attention if isinstance(cfg, DecoderShape) else getattr(cfg, "attention", None)
        d["num_params"] = cfg.num_params() + (self.trainable_params if self.lora is not None else 0)
        d["trainable_params"] = self.trainable_params
        d["lora"] = None if self.lora is None else self.lora.to_dict()
        d["quantization"] = None if self.quantization is None else self.quantization.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> StepConfig:
        """The run a JSON dict describes: :meth:`describe`'s output (``from_dict(s.describe())``
        describes itself as ``s`` does), or any subset with ``model``, ``seq`` and ``batch``.

        Args:
            d: the fields; ``model_config`` (a GPT's, a UNet's or a decoder's shape, told apart by
                their fields) wins over ``model`` (then a preset name); ``lora``, ``quantization``,
                ``buckets`` and ``parallel`` as dicts; the counts ``describe`` adds are checked.

        Returns:
            The :class:`StepConfig`.

        Raises:
            InputError: a missing or unknown field, or a parameter count the model does not have.
        """
        if "model" not in d or "seq" not in d or "batch" not in d:
            raise InputError(f"a run needs 'model', 'seq' and 'batch'; got keys {sorted(d)}")
        derived = {"model_config", "num_params", "trainable_params"}
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names - derived)
        if unknown:
            raise InputError(f"run fields {unknown}; allowed: {', '.join(sorted(names | derived))}")
        kw = {k: v for k, v in d.items() if k in names and v is not None}
        kw["model"] = _model_from_dict(d["model_config"]) if d.get("model_config") else d["model"]
        nested = {"lora": LoraConfig.from_dict, "quantization": QuantConfig.from_dict,
                  "buckets": lambda b: ZeroBuckets(**b), "parallel": lambda p: ParallelDims(**p)}
        kw.update({k: make(kw[k]) for k, make in nested.items() if isinstance(kw.get(k), dict)})
        step = cls(**kw)
        if "num_params" in d and (n := step.describe()["num_params"]) != d["num_params"]:
            raise InputError(f"rebuilt {step.model_config.name} has {n} parameters, the description "
                             f"says {d['num_params']}")
        return step


@dataclass
class MemoryReport:
    """Bytes of one step by category at its peak, from one lens.

    ``peak_bytes`` and ``by_category`` are the *device's* (the accelerator's; on a CPU-only
    run the CPU is the device). ``host_bytes`` is the peak of what the step keeps in host
    memory on an accelerator run (ZeRO-Offload's optimizer state and parameters,
    ``save_on_cpu`` activations), split in ``host_by_category``. On CUDA the measure lens
    adds the allocator's growth over the step that no tensor accounts for as ``workspace``
    (:func:`memlab.lenses.measure.add_workspace`); ``tracked_peak_bytes`` keeps the tracker's exact
    tensor bytes.

    Args:
        lens: ``"estimate"``, ``"simulate"`` or ``"measure"``; step: the step measured.
        device, peak_bytes, by_category: where, and the peak's bytes by category.
        budget_bytes, oom, timeline, allocator, per_rank, ...: as above; filled by the lenses.
    """

    lens: str
    step: StepConfig
    device: str
    peak_bytes: int
    by_category: dict[str, int]
    budget_bytes: int | None = None
    step_seconds: float | None = None
    oom: OOMInfo | None = None
    timeline: list[Event] = field(default_factory=list, repr=False)
    allocator: dict[str, int] = field(default_factory=dict)
    live_before: int | None = None
    live_after: int | None = None
    per_rank: list["MemoryReport"] | None = None
    notes: list[str] = field(default_factory=list)
    host_bytes: int = 0
    host_by_category: dict[str, int] = field(default_factory=dict)
    tracked_peak_bytes: int | None = None
    #: the time lens (:class:`memlab.time.step_time.StepTime`): FLOPs, and seconds on a card
    time: object | None = None

    @property
    def fits(self) -> bool | None:
        if self.oom is not None:
            return False
        if self.budget_bytes is None:
            return None
        return self.peak_bytes <= self.budget_bytes

    @property
    def headroom_bytes(self) -> int | None:
        return None if self.budget_bytes is None else self.budget_bytes - self.peak_bytes

    def replace_timeline(self, events: list[Event]) -> None:
        """Put ``events`` (a lens's timeline with its bytes rewritten) in place of the timeline;
        the peak and its categories become those of the largest event. No events: nothing changes.

        Args:
            events: the new timeline, in step order.
        """
        if not events:
            return
        top = max(events, key=lambda e: e.total)
        self.timeline, self.peak_bytes = events, top.total
        self.by_category = dict(zip(CATEGORIES, top.by_category, strict=True))

    def to_dict(self) -> dict:
        """The JSON shape of the CLI (keys fixed by the project's contract)."""
        d = {
            "lens": self.lens,
            "config": self.step.describe(),
            "seq": self.step.seq,
            "batch": self.step.batch,
            "device": self.device,
            "peak_bytes": self.peak_bytes,
            "by_category": {c: int(self.by_category.get(c, 0)) for c in CATEGORIES},
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            "step_seconds": self.step_seconds,
            "host_bytes": int(self.host_bytes),
            "host_by_category": {c: int(self.host_by_category.get(c, 0)) for c in CATEGORIES},
        }
        if self.tracked_peak_bytes is not None:
            d["tracked_peak_bytes"] = self.tracked_peak_bytes
        if self.oom is not None:
            d["oom"] = {"op": self.oom.op, "module": self.oom.module, "phase": self.oom.phase,
                        "requested_bytes": self.oom.requested_bytes, "message": self.oom.message,
                        "culprit": self.oom.culprit,
                        "by_category": {c: int(self.oom.by_category.get(c, 0)) for c in CATEGORIES}}
            if self.oom.allocator:
                d["oom"]["allocator"] = dict(self.oom.allocator)
        if self.allocator:
            d["allocator"] = dict(self.allocator)
        if self.per_rank is not None:
            d["per_rank"] = [r.to_dict() for r in self.per_rank]
        if self.notes:
            d["notes"] = list(self.notes)
        if self.time is not None:
            d["time"] = self.time.to_dict()
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=_json_default)

    # -- reading it ---------------------------------------------------------------------
    def category_peaks(self) -> dict[str, int]:
        """Each category's most bytes alive at any op of the step. The peak's split
        (``by_category``) can miss a category: at a small batch the peak sits in the optimizer
        step, after the activations are freed; this finds them at the end of forward. A
        report without a timeline (the estimate, a rank's summary) has only the peak's split."""
        peaks = {c: int(self.by_category.get(c, 0)) for c in CATEGORIES}
        for e in self.timeline:
            for c, b in zip(CATEGORIES, e.by_category, strict=False):
                peaks[c] = max(peaks[c], int(b))
        return peaks

    def largest_category(self) -> tuple[str, int]:
        """The largest category of the step and its bytes (its most at any op): what to
        attack first. Ties go to the earlier category in :data:`CATEGORIES`. One category's
        most is :func:`memlab.techniques.sweeps.category_max`."""
        peaks = self.category_peaks()
        name = max(CATEGORIES, key=lambda c: peaks[c])  # max keeps the first of equals
        return name, peaks[name]

    def mib(self, category: str | None = None) -> float:
        """The peak in MiB, or one category's bytes at the peak (``by_category``) in MiB."""
        if category is None:
            return self.peak_bytes / MiB
        if category not in CATEGORIES:
            raise InputError(f"unknown category {category!r}; allowed: {', '.join(CATEGORIES)}")
        return self.by_category.get(category, 0) / MiB

    # -- showing it ----------------------------------------------------------------------
    def _title(self) -> str:
        cfg = self.step.model_config
        return (f"{self.lens} | {cfg.name} | seq {self.step.seq} batch {self.step.batch} | "
                f"{self.step.precision} | ckpt {self.step.checkpointing_used} | {self.device}")

    def _verdict(self) -> str | None:
        if self.oom is not None:
            return "does NOT fit (out of memory)"
        if self.budget_bytes is None:
            return None
        return "fits" if self.fits else "does NOT fit"

    def table(self) -> str:
        """A readable table: the categories at the peak, the peak, host bytes, the budget and
        its verdict, the OOM, the allocator's figures, the step time, per-rank peaks, notes."""
        lines = [self._title()]
        for c in CATEGORIES:
            lines.append(f"  {c:<12} {fmt_bytes(self.by_category.get(c, 0)):>12}")
        lines.append(f"  {'peak':<12} {fmt_bytes(self.peak_bytes):>12}")
        if self.tracked_peak_bytes is not None:
            lines.append(f"  {'tracked':<12} {fmt_bytes(self.tracked_peak_bytes):>12}  (tensors only)")
        if self.host_bytes:
            host = ", ".join(f"{c} {fmt_bytes(v)}" for c, v in self.host_by_category.items() if v)
            lines.append(f"  {'host':<12} {fmt_bytes(self.host_bytes):>12}  ({host})")
        if self.budget_bytes is not None:
            lines.append(f"  {'budget':<12} {fmt_bytes(self.budget_bytes):>12}  -> {self._verdict()}")
        if self.oom is not None:
            lines.append(f"  OOM: {self.oom.message}")
        for name, value in self.allocator.items():
            lines.append(f"  {name:<24} {fmt_bytes(value):>12}")
        if self.step_seconds is not None:
            lines.append(f"  step time   {self.step_seconds * 1e3:10.1f} ms")
        if self.time is not None:
            t = self.time
            on = (f", predicted {t.seconds * 1e3:.1f} ms on {t.card}" if t.seconds is not None else "")
            lines.append(f"  {'FLOPs':<12} {t.flops.total:>12.4g}{on}")
        for i, r in enumerate(self.per_rank or []):
            lines.append(f"  rank {i:<7} {fmt_bytes(r.peak_bytes):>12}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        top = sorted(((v, c) for c, v in self.by_category.items() if v), reverse=True)[:3]
        parts = ", ".join(f"{c} {fmt_bytes(v)}" for v, c in top)
        verdict = self._verdict()
        return (f"<MemoryReport {self.lens} on {self.device}: peak {fmt_bytes(self.peak_bytes)}"
                f"{f' ({parts})' if parts else ''}{f', {verdict}' if verdict else ''}"
                f"{f', {len(self.notes)} note(s)' if self.notes else ''}>")

    def _repr_html_(self) -> str:
        """The table in a notebook: one row per category with its share of the peak."""
        def row(*cells: str, bold: bool = False) -> str:
            tag = ("<td><b>{}</b></td>" if bold else "<td>{}</td>")
            return "<tr>" + "".join(tag.format(escape(c)) for c in cells) + "</tr>"

        peak = self.peak_bytes
        rows = [row(c, fmt_bytes(b), f"{b / peak:.0%}" if peak else "")
                for c, b in ((c, int(self.by_category.get(c, 0))) for c in CATEGORIES)]
        rows.append(row("peak", fmt_bytes(peak), "", bold=True))
        if self.host_bytes:
            rows.append(row("host", fmt_bytes(self.host_bytes), ""))
        if self.budget_bytes is not None:
            rows.append(row("budget", fmt_bytes(self.budget_bytes), self._verdict()))
        after = [f"<p>OOM: {escape(self.oom.message)}</p>"] if self.oom is not None else []
        if self.notes:
            after.append("<ul>" + "".join(f"<li>{escape(n)}</li>" for n in self.notes) + "</ul>")
        return (f"<table><caption>{escape(self._title())}</caption>"
                f"<tr><th>category</th><th>bytes</th><th>of the peak</th></tr>{''.join(rows)}"
                f"</table>{''.join(after)}")


def _json_default(o):
    if is_dataclass(o):
        return asdict(o)
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


# --------------------------------------------------------------------------------------
# Building and running a step
# --------------------------------------------------------------------------------------
def _corpus_tokens() -> torch.Tensor:
    # package data, so that a wheel install outside the repository finds it too
    data = resources.files("memlab").joinpath("data", "corpus.txt").read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def make_batch(step: StepConfig, device: torch.device | str = "cpu", seed: int = 0) -> tuple:
    """Inputs for one step: token windows from the package's ``data/corpus.txt`` for the GPT, noisy images
    and timesteps for the UNet. Contents do not change memory; shapes do.

    Args:
        step: the step (its model, seq and batch); device: where the tensors go; seed: which windows.

    Returns:
        GPT or a decoder: ``(idx, targets)``, each ``batch x seq`` token ids; UNet: its images, timesteps and noise.
    """
    cfg = step.model_config
    g = torch.Generator().manual_seed(seed)
    if isinstance(cfg, UNetConfig):
        x = torch.randn(step.batch, cfg.channels, step.seq, step.seq, generator=g)
        t = torch.randint(0, 1000, (step.batch,), generator=g)
        return x.to(device), t.to(device), torch.randn(x.shape, generator=g).to(device)
    tokens = _corpus_tokens() % (cfg.vocab if isinstance(cfg, DecoderShape) else cfg.vocab_size)
    starts = torch.randint(0, len(tokens) - step.seq - 1, (step.batch,), generator=g)
    idx = torch.stack([tokens[s:s + step.seq] for s in starts.tolist()])
    tgt = torch.stack([tokens[s + 1:s + step.seq + 1] for s in starts.tolist()])
    return idx.to(device), tgt.to(device)


def build_optimizer(model: nn.Module, name: str, fake: bool = False) -> torch.optim.Optimizer:
    """AdamW (two moments per parameter) or SGD with momentum (one), as fused kernels; or
    bitsandbytes' 8-bit AdamW, plain or paged (:func:`memlab.step.low_bit.eight_bit_adamw`; ``fake``:
    the model's tensors are fake).

    Fused kernels update each parameter in one pass without full-size temporaries (the
    ``foreach`` default on CUDA adds up to 4 bytes per parameter at the optimizer step), and
    they are what large-model training uses (nanoGPT's ``configure_optimizers``, say).
    bitsandbytes' 8-bit update is one kernel per tensor on CUDA, in place.
    """
    return _optimizer(model.parameters(), name, fake)


def _optimizer(params, name: str, fake: bool = False) -> torch.optim.Optimizer:
    if name in EIGHT_BIT:
        return eight_bit_adamw(list(params), name, lr=1e-4, fake=fake)
    if name in TORCHAO:
        return torchao_adamw(list(params), name, lr=1e-4, fake=fake)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, fused=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, fused=True)
    raise InputError(f"optimizer={name!r}; allowed: {', '.join(GPT_OPTIMIZERS)}")


def autocast_for(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The forward context for a precision: autocast for ``bf16``/``fp16``, else nothing."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision == "fp16":
        return torch.autocast(device.type, dtype=torch.float16)
    return contextlib.nullcontext()


@dataclass
class Trainer:
    """A model, its optimizer and the precision machinery, ready for :meth:`step`."""

    step_config: StepConfig
    device: torch.device
    model: nn.Module
    optimizer: torch.optim.Optimizer | OptimizerInBackward
    scaler: torch.amp.GradScaler | None
    fake: bool = False  # under FakeTensorMode: no data-dependent branches
    #: with ``activation_offload``: whether saved tensors leave the device (a CUDA device, or
    #: the simulation of a CUDA target, which sets it)
    offload_to_host: bool = False

    def warm_up_optimizer(self) -> None:
        """Create the optimizer (and loss-scaler) state without a forward/backward pass."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.scale(torch.ones((), device=self.device))

    def step(self, batch: tuple) -> torch.Tensor:
        """One optimizer step over ``micro_batches`` slices; returns the detached loss."""
        k = self.step_config.micro_batches
        total = None
        for micro in zip(*(t.chunk(k) for t in batch), strict=True):
            offload = (offload_context(self.device, to_host=self.offload_to_host, fake=self.fake)
                       if self.step_config.activation_offload else contextlib.nullcontext())
            budget = activation_memory_budget(self.step_config.activation_memory_budget)
            with offload, budget, autocast_for(self.step_config.precision, self.device):
                loss = self.model(*micro) / k
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
            del loss
        if self.scaler and self.fake:
            # GradScaler.step skips the update when it finds inf/nan, which needs real values;
            # fake tensors have none, so take the no-overflow path (same memory).
            self.scaler.unscale_(self.optimizer)
            self.optimizer.step()
            self.scaler._per_optimizer_states.clear()
        elif self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total


#: a model config's class, told apart by a field only it has
_MODEL_CLASSES = (("model_type", DecoderShape), ("mults", UNetConfig), ("channels", UNetConfig))


def _model_from_dict(mc: dict) -> GPTConfig | UNetConfig | DecoderShape:
    """A model config from its ``asdict`` (lists back to the tuples its fields hold)."""
    cls = next((c for key, c in _MODEL_CLASSES if key in mc), GPTConfig)
    allowed = {f.name for f in fields(cls)}
    unknown = sorted(set(mc) - allowed)
    if unknown:
        raise InputError(f"model_config fields {unknown}; allowed for {cls.__name__}: {sorted(allowed)}")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in mc.items()})


def build_trainer(step: StepConfig, device: torch.device | str = "cpu", seed: int = 0,
                  fake: bool = False) -> Trainer:
    """Model + optimizer for ``step`` on ``device``; ``fake=True`` under FakeTensorMode.

    Args:
        step: the step; device: where the model lives; seed: weight initialisation.
        fake: build under ``FakeTensorMode`` (allocates nothing).

    Returns:
        A :class:`~memlab.step.training_step.Trainer` whose ``step(batch)`` runs one optimizer step.
    """
    device = torch.device(device)
    torch.manual_seed(seed)
    # Build in the target dtype rather than calling model.to(): that fails under fake mode.
    dtype = torch.bfloat16 if step.precision == "pure-bf16" else torch.get_default_dtype()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(step.model_config)
    finally:
        torch.set_default_dtype(previous)
    scaler = torch.amp.GradScaler(device.type) if step.precision == "fp16" else None
    if step.optimizer_in_backward:
        # one optimizer per parameter, as torchtune's optimizer_in_bwd builds bitsandbytes' too
        opt = OptimizerInBackward(model.parameters(), lambda ps: _optimizer(ps, step.optimizer, fake))
    else:
        opt = build_optimizer(model, step.optimizer, fake)
    if step.compile:  # on fake tensors, inductor's partition and generated code (memlab.step.compiled)
        if step.compile == "layers":
            model = compile_layers(model, fake)
        else:
            model = PartitionedModel(model) if fake else compile_model(model)
    return Trainer(step, device, model, opt, scaler, fake, offload_to_host=device.type == "cuda")


def batch_to(batch: tuple, step: StepConfig) -> tuple:
    """The batch in the dtype the step feeds its model: floating inputs in bf16 for ``pure-bf16``."""
    if step.precision == "pure-bf16":
        return tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in batch)
    return batch


def resolve_step(step: StepConfig | None = None, *, lens: str | None = None, **overrides) -> StepConfig:
    """``step`` (default :class:`StepConfig()`) with keyword ``overrides`` applied, validated.

    Args:
        step: the run; overrides: fields to replace.
        lens: the lens that builds memlab's own class for it (``"simulate"``, ``"measure"``):
            a Hugging Face decoder's run is refused there, naming the lens that builds its class.

    Returns:
        The run.

    Raises:
        InputError: a field that is not allowed, or a decoder's run for a lens that builds memlab's class.
    """
    step = step or StepConfig()
    step = replace(step, **overrides) if overrides else step
    if lens is not None and isinstance(step.model, DecoderShape):
        raise InputError(f"model={step.model.name!r}, a Hugging Face decoder's shape, in memlab's {lens} lens, "
                         f"which builds memlab's GPT or UNet; a decoder's class is built from its config: "
                         f"memlab.hf.{lens}.{lens}_hf(config, ...) or `memlab {lens} --hf-config`")
    return step


__all__ = ["StepConfig", "MemoryReport", "Trainer", "build_trainer", "build_optimizer", "make_batch",
           "batch_to", "resolve_step", "autocast_for", "PRECISIONS", "OPTIMIZERS", "GPT_OPTIMIZERS", "OFFLOADS"]
