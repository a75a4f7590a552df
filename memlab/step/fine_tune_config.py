"""What a fine-tune adds to a run: LoRA adapters and a quantised base, as typed descriptions.

A run of a Hugging Face model is its step (sequence, batch, precision, checkpointing,
optimizer, micro-batches, ZeRO) plus what the fine-tuner turns on: :class:`LoraConfig` (peft's
``LoraConfig`` fields that move memory) and :class:`QuantConfig` (``BitsAndBytesConfig``'s).
Every reader (the CLI's flags, peft's ``adapter_config.json``, the Trainer and TRL arguments)
produces these, and every lens of a Hugging Face config reads them
(:func:`memlab.hf.estimate.estimate_hf`, :func:`memlab.hf.simulate.simulate_hf`). ``to_dict`` and
``from_dict`` are the JSON boundary.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Literal

from memlab.core.errors import InputError

#: peft's own shorthand for "every Linear but the output head"
ALL_LINEAR = "all-linear"
ADAPTER_DTYPES = ("fp32", "base")
QUANT_BITS = (4, 8)
QUANT_TYPES = ("nf4", "fp4")
COMPUTE_DTYPES = ("bf16", "fp16", "fp32")
#: LoRA target module names per family of memlab's GPT (every Linear of a layer, as peft names them)
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GPT2_TARGETS = ("c_attn", "c_proj", "c_fc")


def lora_targets_for(cfg) -> tuple[str, ...]:
    """The LoRA target module names of a memlab GPT config's family.

    Args:
        cfg: a :class:`memlab.models.gpt_unet.GPTConfig` (its ``mlp``: ``"gelu"`` is GPT-2's).
    Returns:
        :data:`GPT2_TARGETS` for a GELU MLP, else :data:`LLAMA_TARGETS` (SwiGLU).
    """
    return GPT2_TARGETS if cfg.mlp == "gelu" else LLAMA_TARGETS


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (Hu et al. 2021, sec. 4.1) as peft builds them.

    Raises:
        InputError: a field value that is not allowed (checked when made).
    """

    rank: int = 8
    """``r``: each adapted ``Linear(in, out)`` gains ``A`` (r x in) and ``B`` (out x r)."""
    targets: tuple[str, ...] | str = ALL_LINEAR
    """``target_modules``: the modules' own names (``q_proj``, ``c_attn``, ...) or ``"all-linear"``
    (every ``Linear`` of the decoder layers, the output head excepted, as peft expands it)."""
    dropout: float = 0.0
    """``lora_dropout``: above 0 each adapter drops its own copy of the input (a mask and the
    dropped tensor are saved per adapted module)."""
    alpha: int | None = None
    """``lora_alpha`` (the scale ``alpha / r``); it moves no memory. ``None``: twice the rank."""
    adapter_dtype: Literal["fp32", "base"] = "fp32"
    """``fp32``: peft's ``autocast_adapter_dtype=True`` (its default) keeps adapters of a 16-bit
    base in fp32 and casts each adapter's input to fp32; ``base``: adapters in the base's dtype."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise InputError(f"LoRA rank={self.rank!r}; allowed: a positive integer")
        if isinstance(self.targets, str) and self.targets != ALL_LINEAR:
            object.__setattr__(self, "targets", tuple(t for t in self.targets.split(",") if t))
        if not isinstance(self.targets, str):
            object.__setattr__(self, "targets", tuple(self.targets))
            if not self.targets:
                raise InputError(f"LoRA targets=(); allowed: module names or {ALL_LINEAR!r}")
        if not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise InputError(f"LoRA dropout={self.dropout!r}; allowed: 0 <= dropout < 1")
        if self.adapter_dtype not in ADAPTER_DTYPES:
            raise InputError(f"LoRA adapter_dtype={self.adapter_dtype!r}; allowed: {', '.join(ADAPTER_DTYPES)}")

    def peft_kwargs(self, linears: tuple[str, ...] | None = None) -> dict:
        """The keywords of ``peft.LoraConfig`` this describes; ``linears`` (the model's
        ``Linear`` module names) spells ``all-linear`` out, so that peft adapts exactly those
        (on a mixture of experts its own ``all-linear`` also wraps the experts' 3-d parameters).

        A dict because it is the keywords of ``peft.LoraConfig``.
        """
        targets = list(linears) if self.targets == ALL_LINEAR and linears else self.targets
        return {"r": self.rank, "target_modules": targets if isinstance(targets, str) else list(targets),
                "lora_alpha": self.alpha or 2 * self.rank, "lora_dropout": float(self.dropout)}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["targets"] = self.targets if isinstance(self.targets, str) else list(self.targets)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LoraConfig":
        return cls(**_known(cls, d, "LoRA"))


@dataclass(frozen=True)
class QuantConfig:
    """A base model loaded in 4 or 8 bits by bitsandbytes (QLoRA: Dettmers et al. 2023, sec. 3).

    Raises:
        InputError: a field value that is not allowed (checked when made).
    """

    bits: Literal[4, 8] = 4
    """``load_in_4bit`` or ``load_in_8bit``: every decoder ``Linear`` stored in that many bits."""
    double_quant: bool = True
    """``bnb_4bit_use_double_quant``: the block maxima quantised again (4-bit only)."""
    quant_type: Literal["nf4", "fp4"] = "nf4"
    """``bnb_4bit_quant_type``: the same bytes either way (two values a byte)."""
    compute_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    """``bnb_4bit_compute_dtype``: the dtype a 4-bit weight is dequantised to for its matmul."""
    base_dtype: Literal["bf16", "fp16", "fp32"] | None = None
    """``from_pretrained``'s ``dtype``: what bitsandbytes leaves unquantised (embeddings, head,
    norms) is stored in it, whatever the compute dtype; ``None``: the compute dtype (a recipe
    that loads in the dtype it computes in)."""
    matmul_keeps_input: bool = False
    """Whether bitsandbytes' 4-bit matmul keeps its input for backward. Up to 0.43.1 it did:
    ``MatMul4Bit.forward`` sets ``ctx.tensors = (A, B)`` when any input needs a gradient
    (bitsandbytes 0.41.1, commit 18e827d6, ``bitsandbytes/autograd/_functions.py`` line 523),
    though backward reads only ``B`` (the input's gradient needs only the weight). Since 0.43.2
    it keeps ``(None, B)`` (PR #1270, commit 9e753741; 0.50.0's line 358). ``False``: today's
    bitsandbytes; ``True``: a run on an older one (litgpt's resource tables: 0.41.1)."""

    def __post_init__(self) -> None:
        if self.bits not in QUANT_BITS or isinstance(self.bits, bool):
            raise InputError(f"quantisation bits={self.bits!r}; allowed: 4, 8")
        if self.quant_type not in QUANT_TYPES:
            raise InputError(f"bnb_4bit_quant_type={self.quant_type!r}; allowed: {', '.join(QUANT_TYPES)}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise InputError(f"bnb_4bit_compute_dtype={self.compute_dtype!r}; allowed: {', '.join(COMPUTE_DTYPES)}")
        if self.base_dtype is not None and self.base_dtype not in COMPUTE_DTYPES:
            raise InputError(f"base dtype={self.base_dtype!r}; allowed: {', '.join(COMPUTE_DTYPES)}")
        if not isinstance(self.matmul_keeps_input, bool) or (self.matmul_keeps_input and self.bits != 4):
            raise InputError(f"matmul_keeps_input={self.matmul_keeps_input!r} with bits={self.bits}; allowed: "
                             f"True or False with 4 bits (MatMul4Bit), False with 8")

    @property
    def name(self) -> str:
        """memlab's name of the layout (:data:`memlab.step.low_bit.QUANTIZATIONS`)."""
        return f"{self.bits}bit"

    @property
    def compute_bytes(self) -> int:
        return 4 if self.compute_dtype == "fp32" else 2

    @property
    def rest_dtype(self) -> str:
        """The dtype of the modules bitsandbytes does not quantise."""
        return self.base_dtype or self.compute_dtype

    @property
    def rest_bytes(self) -> int:
        return 4 if self.rest_dtype == "fp32" else 2

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "QuantConfig":
        return cls(**_known(cls, d, "quantisation"))


def _known(cls, d: dict, what: str) -> dict:
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise InputError(f"{what} fields {unknown}; allowed: {', '.join(sorted(names))}")
    return dict(d)


__all__ = ["ALL_LINEAR", "ADAPTER_DTYPES", "QUANT_BITS", "QUANT_TYPES", "COMPUTE_DTYPES", "LLAMA_TARGETS",
           "GPT2_TARGETS", "lora_targets_for", "LoraConfig", "QuantConfig"]
