"""Instrumented models: a GPT-style decoder and a small diffusion UNet.

Both are written to make their memory visible rather than to be fast: the GPT can
materialise the full ``s x s`` attention matrix (``attention="naive"``) so the O(L^2)
activations of long sequences show up in a measurement, and it can recompute activations in
backward (``checkpointing="full"`` per block, ``"selective"`` for the attention core only,
after Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 5; ``"op"``: each block checkpointed with an op-level policy that saves the
attention kernel's outputs and every other matmul's, as torchtitan's ``op`` selective
checkpointing does, :func:`op_sac_context`).

The GPT follows nanoGPT's layout (one config dataclass, small modules). Presets are
shape-alike copies of well-known models: the same widths and depths, so estimates and
simulations of them are meaningful, without pretending to load their weights. The
``llama-3-*``, ``mistral-7b`` and ``qwen2.5-7b`` presets take every shape field from the
model's published ``config.json`` on the Hugging Face hub (see :data:`PRESETS`), including
grouped-query attention (``n_kv_head``; Ainslie et al. 2023, "GQA: Training Generalized
Multi-Query Transformer Models from Multi-Head Checkpoints", arXiv:2305.13245).

The loss can be computed in chunks of tokens (``loss="chunked"``) so that the full
``tokens x vocab`` logits never exist: see :mod:`memlab.models.chunked_loss`.

Over 500 lines because both families share one interface the lenses build through
(:func:`get_config` over one preset table, :func:`build_model`, the ``checkpointing``
switch), and the GPT's presets are a published-shape table that reads best beside the config.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memlab.core.errors import InputError
from memlab.core.quiet import OneLine
from memlab.models.chunked_loss import linear_cross_entropy
from memlab.models.decoder_shape import MEMLAB_GPT, DecoderShape

Attention = Literal["naive", "sdpa"]
Checkpointing = Literal["none", "full", "selective", "op"]
GQAKernel = Literal["repeat", "native"]
Loss = Literal["plain", "chunked", "chunked_output"]
ATTENTIONS = ("naive", "sdpa")
CHECKPOINTINGS = ("none", "full", "selective", "op")
GQA_KERNELS = ("repeat", "native")
LOSSES = ("plain", "chunked", "chunked_output")


@dataclass(frozen=True)
class GPTConfig(OneLine):
    """Shape and behaviour of a decoder-only transformer.

    ``mlp="gelu"`` with LayerNorm and learned positions is GPT-2's block; ``mlp="swiglu"``
    with RMSNorm and rotary positions is LLaMA's.

    ``attention`` and ``checkpointing`` are switches of the built model, owned here. A
    :class:`~memlab.step.training_step.StepConfig` can choose them for its step (``StepConfig(...,
    checkpointing="full")``), which is where a lesson varies them: its ``model_config`` is this
    config with the step's choices.

    Fields added for today's open models (all default to the old behaviour, so every config
    written before them builds the same model, byte for byte):

    ``n_kv_head``
        Key/value heads. ``None`` means ``n_head`` (multi-head attention); a divisor of
        ``n_head`` gives grouped-query attention, ``1`` multi-query attention. The fused
        ``qkv`` projection then has ``(n_head + 2 * n_kv_head) * head_dim`` outputs, laid out
        ``[q (n_head heads) | k (n_kv_head) | v (n_kv_head)]``; query head ``j`` reads
        key/value head ``j // (n_head // n_kv_head)`` (``repeat_interleave`` order, as
        ``torch``'s SDPA ``enable_gqa`` and Hugging Face's ``repeat_kv``).
    ``gqa``
        How grouped k/v reach the attention kernel when ``n_kv_head < n_head``.
        ``"repeat"`` (default): k and v are repeated to ``n_head`` heads first, as
        Hugging Face's ``repeat_kv`` does; any kernel on any device takes that, and the
        repeated copies are what attention saves for backward (the same bytes as MHA).
        ``"native"``: SDPA gets the grouped heads with ``enable_gqa=True`` (torch >= 2.5)
        and saves no copies on CPU and with CUDA flash attention (fp16/bf16); on CUDA in
        fp32 torch's memory-efficient kernel rejects unequal head counts and SDPA falls back
        to the math kernel, which materialises the ``s x s`` scores. Needs ``attention="sdpa"``.
        Views share a storage: v is a view of the fused qkv output, so when SDPA saves the
        unrepeated v it keeps the whole ``(n_head + 2 n_kv_head) * head_dim``-wide output
        alive. With learned positions (q, k, v all views) "native" saves exactly the two
        repeated copies less, ``2 * tokens * d_model`` elements per layer; with rope (q and k
        rotated into new tensors) it can keep *more* bytes than "repeat" when ``n_kv_head`` is
        close to ``n_head`` (tests/test_models.py measures the first).
    ``qkv_bias``
        Bias on the q, k, v projections; ``None`` follows ``bias``. Qwen2/2.5 have biases
        there and nowhere else (``bias=False, qkv_bias=True``).
    ``rope_theta``
        Base of the rotary frequencies (10000 in LLaMA/Mistral, 500000 in Llama 3, 1e6 in
        Qwen2.5). It changes values, not memory.
    ``loss``, ``loss_chunk``
        ``"plain"``: ``F.cross_entropy`` on the full ``[tokens, vocab]`` logits.
        ``"chunked"``: :func:`memlab.models.chunked_loss.linear_cross_entropy` over ``loss_chunk``
        tokens at a time; the same loss and gradients, without the logits.
        ``"chunked_output"``: torchtune's ``CEWithChunkedOutputLoss`` (torchtune/modules/loss/
        ce_chunked_output_loss.py at 1814feb17) on its decoder's ``chunked_output``
        (transformer.py:750-753): the head makes ``output_chunks`` chunks of logits along the
        sequence, all in forward, and each chunk is cast to fp32 and summed into the loss on its own.
    ``output_chunks``
        The chunks of ``"chunked_output"`` (torchtune's ``num_output_chunks``, 8 by default).
    ``norm_fp32``
        RMSNorm written out as torchtune's (torchtune/modules/rms_norm.py:61-65 at 1814feb17):
        ``x.float()``, ``x * rsqrt(mean(x^2) + eps)`` in fp32, cast back to the input's dtype,
        times the weight. For a 16-bit input it saves the fp32 upcast, an fp32 rstd per row and
        the cast-back normalised input, where ``F.rms_norm`` (fused on CUDA) keeps the input and
        the rstd: 4 more bytes per element in bf16 on CUDA. Needs ``norm="rmsnorm"``.
    ``logits_fp32``
        The head's logits cast to fp32 before the plain loss, as torchtune's decoders do
        (``F.linear(h, tok_embeddings.weight).float()``, torchtune/modules/transformer.py:937 at
        1814feb17, tied; ``self.output(h).float()``, :652, untied): with 16-bit logits the
        log-softmax, its saved output and its gradients are fp32, twice the bytes. Needs
        ``loss="plain"`` (the chunked loss never makes whole logits).

    Raises:
        InputError: a field value that is not allowed (checked when the config is made).
    """

    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    vocab_size: int = 1000
    block_size: int = 1024
    mlp: Literal["gelu", "swiglu"] = "gelu"
    mlp_hidden: int | None = None  # default 4 * d_model
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    position: Literal["learned", "rope"] = "learned"
    bias: bool = True
    tie_embeddings: bool = True
    attention: Attention = "sdpa"
    checkpointing: Checkpointing = "none"
    name: str = "custom"
    n_kv_head: int | None = None
    gqa: GQAKernel = "repeat"
    qkv_bias: bool | None = None
    rope_theta: float = 10000.0
    loss: Loss = "plain"
    loss_chunk: int = 1024
    norm_fp32: bool = False
    logits_fp32: bool = False
    output_chunks: int = 8

    def __post_init__(self) -> None:
        for field, value in (("n_layer", self.n_layer), ("n_head", self.n_head),
                             ("d_model", self.d_model), ("vocab_size", self.vocab_size),
                             ("block_size", self.block_size), ("loss_chunk", self.loss_chunk),
                             ("output_chunks", self.output_chunks)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{field} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise InputError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}; "
                             f"choose d_model as a multiple of the number of heads")
        if self.n_kv_head is not None:
            divisors = [k for k in range(1, self.n_head + 1) if self.n_head % k == 0]
            if (isinstance(self.n_kv_head, bool) or not isinstance(self.n_kv_head, int)
                    or self.n_kv_head not in divisors):
                raise InputError(f"n_kv_head={self.n_kv_head!r} must divide n_head={self.n_head}; "
                                 f"allowed: None (= n_head), {', '.join(map(str, divisors))}")
        if self.attention not in ATTENTIONS:
            raise InputError(f"attention={self.attention!r}; allowed: {', '.join(ATTENTIONS)}")
        if self.checkpointing not in CHECKPOINTINGS:
            raise InputError(f"checkpointing={self.checkpointing!r}; "
                             f"allowed: {', '.join(CHECKPOINTINGS)}")
        if self.gqa not in GQA_KERNELS:
            raise InputError(f"gqa={self.gqa!r}; allowed: {', '.join(GQA_KERNELS)}")
        if self.gqa == "native" and self.attention != "sdpa":
            raise InputError(f"gqa='native' needs attention='sdpa' (got attention={self.attention!r}); "
                             f"allowed with naive attention: gqa='repeat'")
        if self.loss not in LOSSES:
            raise InputError(f"loss={self.loss!r}; allowed: {', '.join(LOSSES)}")
        self._check_fp32_switches()
        if isinstance(self.rope_theta, bool) or not isinstance(self.rope_theta, (int, float)) \
                or not self.rope_theta > 0:
            raise InputError(f"rope_theta must be a positive number, got {self.rope_theta!r}")
        if self.position == "rope" and self.head_dim % 2:
            raise InputError(f"rotary positions need an even head_dim, got "
                             f"d_model/n_head = {self.head_dim}; choose an even head size")

    def _check_fp32_switches(self) -> None:
        """``norm_fp32`` and ``logits_fp32``: booleans, each with the norm or loss it changes."""
        for field, value in (("norm_fp32", self.norm_fp32), ("logits_fp32", self.logits_fp32)):
            if not isinstance(value, bool):
                raise InputError(f"{field} must be True or False, got {value!r}")
        if self.norm_fp32 and self.norm != "rmsnorm":
            raise InputError(f"norm_fp32=True is torchtune's RMSNorm; it needs norm='rmsnorm' "
                             f"(got norm={self.norm!r}); allowed with layernorm: norm_fp32=False")
        if self.logits_fp32 and self.loss != "plain":
            raise InputError(f"logits_fp32=True casts whole logits before the plain loss; it needs "
                             f"loss='plain' (got loss={self.loss!r}); allowed with the chunked loss: "
                             f"logits_fp32=False")

    def __str__(self) -> str:
        """One line of the shape: ``GPTConfig tiny: 3.68M params, 4 layers x 256, 4 heads, ...``."""
        n = self.num_params()
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
        kv = f" ({self.n_kv_head} k/v)" if self.n_kv_head not in (None, self.n_head) else ""
        extra = [f"ckpt {self.checkpointing}"] if self.checkpointing != "none" else []
        extra += [f"{self.loss} loss"] if self.loss != "plain" else []
        return ", ".join([f"GPTConfig {self.name}: {size} params", f"{self.n_layer} layers x {self.d_model}",
                          f"{self.n_head} heads{kv}", f"{self.mlp} {self.hidden}", self.norm,
                          "rope" if self.position == "rope" else "learned pos", f"vocab {self.vocab_size}",
                          self.attention, *extra])

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads actually used (``n_kv_head``, or ``n_head`` when it is None)."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def has_qkv_bias(self) -> bool:
        return self.bias if self.qkv_bias is None else self.qkv_bias

    @property
    def hidden(self) -> int:
        return self.mlp_hidden or 4 * self.d_model

    @property
    def shape(self) -> DecoderShape:
        """This GPT as a decoder's shape (``model_type`` :data:`memlab.models.decoder_shape.MEMLAB_GPT`):
        the one description of widths and parameter tensors every model memlab reads has
        (:meth:`param_numels` and :meth:`matmul_numels` are its)."""
        return DecoderShape(
            MEMLAB_GPT, self.name, self.n_layer, self.d_model, self.vocab_size, self.n_head, self.kv_heads,
            self.head_dim, self.head_dim, self.hidden, self.tie_embeddings,
            norm="layer" if self.norm == "layernorm" else "rms", norm_bias=self.bias, qkv_bias=self.has_qkv_bias,
            o_bias=self.bias, fused_qkv=True, mlp="gelu" if self.mlp == "gelu" else "gated", mlp_bias=self.bias,
            positions=self.block_size if self.position == "learned" else 0, context=self.block_size,
            use_cache=False)

    def matmul_numels(self) -> tuple[list[int], int]:
        """Elements of the matmul weights of one block (fused ``qkv``, ``proj``, the MLP's
        two or three) and of the head (autocast copies these), from :attr:`shape`. The fused
        ``qkv`` has ``(n_head + 2 n_kv_head) * head_dim`` rows, so grouped-query attention copies less."""
        s = self.shape
        return [i * o for ios in s.linears(0).values() for i, o in ios], s.vocab * s.d

    def param_numels(self) -> list[int]:
        """Elements of every parameter (tied embeddings counted once), from :attr:`shape`'s one
        count (:meth:`memlab.models.decoder_shape.DecoderShape.param_numels`)."""
        return self.shape.param_numels()

    def num_params(self) -> int:
        """Parameter count (tied embeddings counted once); equals
        ``sum(p.numel() for p in GPT(cfg).parameters())`` for every config."""
        return self.shape.num_params()

    def check_tensor_parallel(self, tensor_parallel: int) -> str:
        """How ``tensor_parallel`` ranks split this model's attention, or an InputError.

        The degree must divide the query heads and the MLP width. Key/value heads are
        ``"split"`` when it divides ``n_kv_head`` (each rank its own), ``"replicated"`` when
        ``n_kv_head`` divides it (``t / n_kv_head`` ranks share each; Megatron-Core's
        ``num_query_groups < world_size`` case), and anything else is refused.
        """
        t = tensor_parallel
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise InputError(f"tensor-parallel degree must be a positive integer, got {t!r}")
        h, kv = self.n_head, self.kv_heads
        allowed = [d for d in range(1, h + 1) if h % d == 0 and self.hidden % d == 0
                   and (kv % d == 0 or (d % kv == 0
                                        and ((h // kv + 2) * self.head_dim) % (d // kv) == 0))]
        if t not in allowed:
            raise InputError(f"tensor-parallel degree t={t} must divide n_head={h} and the MLP "
                             f"width {self.hidden}, and divide or be a multiple of n_kv_head={kv}; "
                             f"allowed: {', '.join(map(str, allowed))}")
        return "split" if kv % t == 0 else "replicated"


def _llama(name: str, d: int, layers: int, heads: int, hidden: int, *, kv_heads: int | None = None,
           vocab: int = 32000, context: int = 4096, theta: float = 10000.0,
           qkv_bias: bool | None = None) -> GPTConfig:
    """A LLaMA-style block: SwiGLU, RMSNorm, rotary positions, no biases, untied head."""
    return GPTConfig(n_layer=layers, n_head=heads, d_model=d, vocab_size=vocab, block_size=context,
                     mlp="swiglu", mlp_hidden=hidden, norm="rmsnorm", position="rope",
                     bias=False, tie_embeddings=False, name=name, n_kv_head=kv_heads,
                     qkv_bias=qkv_bias, rope_theta=theta)


def tiny_llama(vocab: int = 1000, **over) -> GPTConfig:
    """The lessons' small LLaMA-shaped model (07, 16): 2 layers, ``d_model`` 64, 8 query and
    2 key/value heads, SwiGLU (128), RMSNorm, rotary, untied head, loss chunks of 128 tokens;
    ``over`` replaces any field (``n_kv_head=None`` for multi-head, ``loss="chunked"``)."""
    shape = dict(n_layer=2, d_model=64, n_head=8, n_kv_head=2, vocab_size=vocab, block_size=1024,
                 mlp="swiglu", mlp_hidden=128, norm="rmsnorm", position="rope", bias=False,
                 tie_embeddings=False, loss_chunk=128, name=f"tiny-v{vocab}")
    return GPTConfig(**{**shape, **over})


def _gpt2(name: str, d: int, layers: int, heads: int) -> GPTConfig:
    return GPTConfig(n_layer=layers, n_head=heads, d_model=d, vocab_size=50257,
                     block_size=1024, name=name)


#: Model presets. The last four copy the published ``config.json`` of each model on the
#: Hugging Face hub (``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
#: ``num_attention_heads``, ``num_key_value_heads``, ``vocab_size``,
#: ``tie_word_embeddings=false``, ``max_position_embeddings`` as ``block_size``,
#: ``rope_theta``); the totals in brackets are the hub's "Model size" figures for the
#: safetensors checkpoints, which ``num_params()`` reproduces (tests/test_models.py):
#:
#: * ``llama-3-8b``: huggingface.co/meta-llama/Meta-Llama-3-8B, config.json: 4096, 14336,
#:   32 layers, 32 heads, 8 kv heads, vocab 128256, context 8192, theta 500000 [8.03 B].
#: * ``llama-3-70b``: huggingface.co/meta-llama/Meta-Llama-3-70B: 8192, 28672, 80 layers,
#:   64 heads, 8 kv heads, vocab 128256, context 8192, theta 500000 [70.6 B].
#: * ``mistral-7b``: huggingface.co/mistralai/Mistral-7B-v0.1: 4096, 14336, 32 layers,
#:   32 heads, 8 kv heads, vocab 32000, context 32768, theta 10000 [7.24 B]. Its
#:   ``sliding_window=4096`` is not modelled (attention here is full causal; with SDPA the
#:   saved bytes do not depend on the window).
#: * ``qwen2.5-7b``: huggingface.co/Qwen/Qwen2.5-7B: 3584, 18944, 28 layers, 28 heads,
#:   4 kv heads, vocab 152064, context 131072, theta 1e6, bias on q/k/v only (the Qwen2
#:   architecture, whose ``q_proj``/``k_proj``/``v_proj`` have ``bias=True`` and ``o_proj``
#:   and the MLP none; the Qwen2.5 technical report, arXiv:2412.15115, lists "QKV bias"
#:   among the dense architecture's components) [7.62 B].
#:
#: Rotary tables are per layer, ``2 * block_size * head_dim`` fp32 each (what the estimate
#: counts): 256 MiB in all for llama-3-8b, 1 GiB for mistral-7b, 3.5 GiB for qwen2.5-7b,
#: where Hugging Face computes cos/sin per forward instead. Build the large presets only
#: under ``FakeTensorMode`` (``simulate_step``) on a laptop.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(name="tiny"),
    "gpt2-small": _gpt2("gpt2-small", 768, 12, 12),
    "gpt2-medium": _gpt2("gpt2-medium", 1024, 24, 16),
    "gpt2-large": _gpt2("gpt2-large", 1280, 36, 20),
    "gpt2-xl": _gpt2("gpt2-xl", 1600, 48, 25),
    "llama-7b": _llama("llama-7b", 4096, 32, 32, 11008),
    "llama-13b": _llama("llama-13b", 5120, 40, 40, 13824),
    "llama-3-8b": _llama("llama-3-8b", 4096, 32, 32, 14336, kv_heads=8, vocab=128256,
                         context=8192, theta=500000.0),
    "llama-3-70b": _llama("llama-3-70b", 8192, 80, 64, 28672, kv_heads=8, vocab=128256,
                          context=8192, theta=500000.0),
    "mistral-7b": _llama("mistral-7b", 4096, 32, 32, 14336, kv_heads=8, vocab=32000,
                         context=32768, theta=10000.0),
    "qwen2.5-7b": _llama("qwen2.5-7b", 3584, 28, 28, 18944, kv_heads=4, vocab=152064,
                         context=131072, theta=1000000.0, qkv_bias=True),
}


def get_config(preset: str, **overrides) -> "GPTConfig | UNetConfig":
    """Look up a preset by name (``tiny``, ``gpt2-xl``, ``unet-small``, ...) with overrides.

    Args:
        preset: a name of :data:`PRESETS` or :data:`UNET_PRESETS`.
        overrides: fields replaced in the preset.

    Returns:
        The :class:`GPTConfig` or :class:`UNetConfig`.

    Raises:
        InputError: an unknown preset or field value.
    """
    table = {**PRESETS, **UNET_PRESETS}
    if preset not in table:
        raise InputError(f"unknown model preset {preset!r}; allowed: {', '.join(table)}")
    return replace(table[preset], **overrides) if overrides else table[preset]


# --------------------------------------------------------------------------------------
# GPT
# --------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """RMSNorm: ``F.rms_norm``, or with ``fp32`` torchtune's Python form (``GPTConfig.norm_fp32``).

    Args:
        dim: the normalised width. eps: added to the mean square.
        fp32: compute as torchtune/modules/rms_norm.py:61-65 at 1814feb17 does.
    """

    def __init__(self, dim: int, eps: float = 1e-6, fp32: bool = False):
        super().__init__()
        self.eps, self.fp32 = eps, fp32
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32:
            # torchtune's ops in its order: pow and the product save the fp32 upcast, rsqrt its
            # output, the weight's product the cast-back normalised x
            x_fp32 = x.float()
            x_normed = (x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
            return x_normed * self.weight
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _norm(cfg: GPTConfig) -> nn.Module:
    if cfg.norm == "layernorm":
        return nn.LayerNorm(cfg.d_model, bias=cfg.bias)
    return RMSNorm(cfg.d_model, fp32=cfg.norm_fp32)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class CausalSelfAttention(nn.Module):
    """Causal self-attention with ``n_head`` query and ``n_kv_head`` key/value heads."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        hd, kv = cfg.head_dim, cfg.kv_heads
        # one fused projection, [q | k | v]: with MHA its output is one storage that q, k and
        # v are views of, as before GQA existed
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_head + 2 * kv) * hd, bias=cfg.has_qkv_bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        if cfg.position == "rope":
            inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
            freqs = torch.outer(torch.arange(cfg.block_size).float(), inv)
            emb = torch.cat((freqs, freqs), dim=-1)
            self.register_buffer("cos", emb.cos(), persistent=False)
            self.register_buffer("sin", emb.sin(), persistent=False)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v with a causal mask; q is (b, n_head, s, hd), k and v
        (b, n_kv_head, s, hd); the output is (b, n_head, s, hd)."""
        groups = q.shape[1] // k.shape[1]
        if self.cfg.attention == "sdpa" and groups > 1 and self.cfg.gqa == "native":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if groups > 1:
            # query head j reads kv head j // groups (the order of SDPA's enable_gqa)
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        if self.cfg.attention == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        s = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu_(1)
        att = att.masked_fill(mask, float("-inf"))
        att = F.softmax(att, dim=-1)
        return att @ v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h, kv, hd = self.cfg.n_head, self.cfg.kv_heads, self.cfg.head_dim
        q, k, v = self.qkv(x).split([h * hd, kv * hd, kv * hd], dim=2)
        q = q.view(b, s, h, hd).transpose(1, 2)
        k, v = (t.view(b, s, kv, hd).transpose(1, 2) for t in (k, v))
        if self.cfg.position == "rope":
            cos, sin = self.cos[:s].to(q.dtype), self.sin[:s].to(q.dtype)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        if self.cfg.checkpointing == "selective":
            y = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            y = self.core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        self.fc = nn.Linear(cfg.d_model, cfg.hidden, bias=cfg.bias)
        if self.swiglu:
            self.gate = nn.Linear(cfg.d_model, cfg.hidden, bias=cfg.bias)
        self.out = nn.Linear(cfg.hidden, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.out(F.silu(self.gate(x)) * self.fc(x))
        return self.out(F.gelu(self.fc(x), approximate="tanh"))


#: what the op-level policy saves: matmuls (``addmm``: a Linear with a bias on CPU) and the
#: attention kernels (torchtitan's ``_op_sac_save_list``, torchtitan/models/llama3/infra/
#: parallelize.py, with CPU's flash kernel and ``addmm`` added)
OP_SAC_SAVE = frozenset(getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "max"))
_MATMULS = frozenset((torch.ops.aten.mm.default, torch.ops.aten.addmm.default))


def op_sac_context():
    """The contexts of one block's op-level selective checkpoint, as torchtitan builds them
    (pytorch/torchtitan ``torchtitan/distributed/activation_checkpoint.py`` at cfb9326,
    ``_apply_op_sac``): the outputs of the ops in :data:`OP_SAC_SAVE` are saved, except every
    second matmul (counted separately in forward and in the recompute); all else recomputed."""
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func in _MATMULS:
            counts[mode] += 1
        save = func in OP_SAC_SAVE and not (func in _MATMULS and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.ln1, self.attn = _norm(cfg), CausalSelfAttention(cfg)
        self.ln2, self.mlp = _norm(cfg), MLP(cfg)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.checkpointing == "full" and torch.is_grad_enabled():
            # Non-reentrant checkpoint: keeps only the block input, recomputes the rest.
            return checkpoint(self._forward, x, use_reentrant=False)
        if self.cfg.checkpointing == "op" and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False, context_fn=op_sac_context)
        return self._forward(x)


class GPT(nn.Module):
    """Decoder-only transformer. ``forward(idx, targets)`` returns the mean token loss.

    The logits are not returned with the loss: keeping them would hold ``b*s*vocab`` more
    values alive until the end of the step, which a training loop never needs. With
    ``cfg.loss == "chunked"`` they are never made whole at all
    (:func:`memlab.models.chunked_loss.linear_cross_entropy`).

    Args:
        cfg: the :class:`GPTConfig` to build.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model) if cfg.position == "learned" else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = _norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        #: the plain loss compiled apart from the model (``StepConfig(compile="layers")``,
        #: :func:`memlab.step.compiled.compile_layers`); ``None``: ``F.cross_entropy`` eager
        self.compiled_loss = None
        self.apply(self.init_weights)

    @staticmethod
    def init_weights(m: nn.Module) -> None:
        """GPT-2 initialisation: N(0, 0.02) weights, zero biases (also for a stage rebuilt
        from meta tensors)."""
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        b, s = idx.shape
        if s > self.cfg.block_size:
            raise InputError(f"sequence length {s} exceeds block_size {self.cfg.block_size}")
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(s, device=idx.device))
        for block in self.blocks:
            x = block(x)
        if targets is not None and self.cfg.loss == "chunked_output":
            return self._chunked_output_loss(self.ln_f(x), targets)
        if targets is not None and self.cfg.loss == "chunked":
            return linear_cross_entropy(self.ln_f(x).flatten(0, 1), self.lm_head.weight,
                                        targets.flatten(), chunk_size=self.cfg.loss_chunk)
        # one expression, so no local keeps the final norm's output alive through the loss
        logits = self.lm_head(self.ln_f(x))
        if self.cfg.logits_fp32:
            # rebinding drops the 16-bit logits: only the fp32 copy lives through the loss, as in
            # torchtune (transformer.py:937 at 1814feb17, the cast in the forward's expression)
            logits = logits.float()
        if targets is None:
            return logits
        loss = F.cross_entropy if self.compiled_loss is None else self.compiled_loss
        return loss(logits.view(-1, logits.size(-1)), targets.view(-1))

    def _chunked_output_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """torchtune's ``chunked_output`` then ``CEWithChunkedOutputLoss.forward`` (transformer.py:750-753,
        ce_chunked_output_loss.py at 1814feb17): every chunk's logits made first, then each one's fp32
        cross-entropy summed, divided by the token count."""
        n = self.cfg.output_chunks
        logits = [self.lm_head(chunk) for chunk in h.chunk(n, dim=1)]
        ce = summed_fp32_cross_entropy if self.compiled_loss is None else self.compiled_loss
        total = 0.0
        for chunk, target in zip(logits, targets.chunk(n, dim=1), strict=True):
            total = total + ce(chunk.reshape(-1, chunk.size(-1)), target.reshape(-1))
        return total / targets.numel()


def summed_fp32_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """torchtune's ``compute_cross_entropy``: the chunk cast to fp32, its cross-entropy summed."""
    return F.cross_entropy(logits.float(), targets, reduction="sum")


class CrossEntropy(nn.Module):
    """``F.cross_entropy`` as a module, so that it can be compiled on its own; with ``summed_fp32``
    :func:`summed_fp32_cross_entropy`, the per-chunk loss of ``loss="chunked_output"``."""

    def __init__(self, summed_fp32: bool = False):
        super().__init__()
        self.summed_fp32 = summed_fp32

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.summed_fp32:
            return summed_fp32_cross_entropy(logits, targets)
        return F.cross_entropy(logits, targets)


# --------------------------------------------------------------------------------------
# A small diffusion UNet (DDPM-style noise prediction)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class UNetConfig:
    """A DDPM-style UNet (Ho et al. 2020): ResBlocks with a time embedding, skip connections,
    self-attention at the lowest resolution. ``image_size`` plays the role of sequence length.

    Raises:
        InputError: a field value that is not allowed (checked when the config is made).
    """

    channels: int = 3
    base: int = 32
    mults: tuple[int, ...] = (1, 2, 2)
    groups: int = 8
    image_size: int = 32
    checkpointing: Checkpointing = "none"
    name: str = "custom-unet"

    def __post_init__(self) -> None:
        if self.base % self.groups:
            raise InputError(f"base={self.base} must be divisible by groups={self.groups}")
        if self.checkpointing == "op":
            raise InputError("checkpointing='op' is a transformer block's policy; allowed for a UNet: "
                             "none, full, selective")
        if self.checkpointing not in CHECKPOINTINGS:
            raise InputError(f"checkpointing={self.checkpointing!r}; "
                             f"allowed: {', '.join(CHECKPOINTINGS)}")

    def num_params(self) -> int:
        return sum(p.numel() for p in UNet(self).parameters())


UNET_PRESETS: dict[str, UNetConfig] = {
    "unet-small": UNetConfig(name="unet-small"),
}


def _time_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([args.sin(), args.cos()], dim=-1)


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, tdim: int, groups: int):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(groups, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.temb = nn.Linear(tdim, cout)
        self.norm2, self.conv2 = nn.GroupNorm(groups, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.temb(temb)[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return h + self.skip(x)


class AttnBlock(nn.Module):
    def __init__(self, ch: int, groups: int):
        super().__init__()
        self.norm = nn.GroupNorm(groups, ch)
        self.qkv = nn.Conv2d(ch, 3 * ch, 1)
        self.proj = nn.Conv2d(ch, ch, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, hh, ww = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, 3, c, hh * ww).unbind(1)
        y = F.scaled_dot_product_attention(q.transpose(1, 2)[:, None], k.transpose(1, 2)[:, None],
                                           v.transpose(1, 2)[:, None])
        return x + self.proj(y[:, 0].transpose(1, 2).reshape(b, c, hh, ww))


class UNet(nn.Module):
    """Predicts the noise added to an image; ``forward(x, t, noise)`` returns the MSE loss.

    Args:
        cfg: the :class:`UNetConfig` to build.
    """

    def __init__(self, cfg: UNetConfig):
        super().__init__()
        self.cfg = cfg
        tdim = cfg.base * 4
        self.time = nn.Sequential(nn.Linear(cfg.base, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.inp = nn.Conv2d(cfg.channels, cfg.base, 3, padding=1)
        chans = [cfg.base * m for m in cfg.mults]
        self.down, self.pool = nn.ModuleList(), nn.ModuleList()
        cin = cfg.base
        for i, c in enumerate(chans):
            self.down.append(ResBlock(cin, c, tdim, cfg.groups))
            last = i == len(chans) - 1
            self.pool.append(nn.Identity() if last else nn.Conv2d(c, c, 3, stride=2, padding=1))
            cin = c
        self.mid = ResBlock(cin, cin, tdim, cfg.groups)
        self.mid_attn = AttnBlock(cin, cfg.groups)
        self.up, self.upsample = nn.ModuleList(), nn.ModuleList()
        for i, c in reversed(list(enumerate(chans))):
            self.up.append(ResBlock(cin + c, c, tdim, cfg.groups))
            first = i == 0
            self.upsample.append(nn.Identity() if first else nn.Upsample(scale_factor=2))
            cin = c
        self.out = nn.Sequential(nn.GroupNorm(cfg.groups, cin), nn.SiLU(),
                                 nn.Conv2d(cin, cfg.channels, 3, padding=1))

    def _res(self, block: ResBlock, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        if self.cfg.checkpointing == "full" and torch.is_grad_enabled():
            return checkpoint(block, x, temb, use_reentrant=False)
        return block(x, temb)

    def forward(self, x: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        temb = self.time(_time_embedding(t, self.cfg.base))
        h = self.inp(x)
        skips = []
        for block, pool in zip(self.down, self.pool, strict=True):
            h = self._res(block, h, temb)
            skips.append(h)
            h = pool(h)
        h = self.mid_attn(self._res(self.mid, h, temb))
        for block, up in zip(self.up, self.upsample, strict=True):
            h = self._res(block, torch.cat([h, skips.pop()], dim=1), temb)
            h = up(h)
        return F.mse_loss(self.out(h), noise)


def build_model(cfg: GPTConfig | UNetConfig) -> nn.Module:
    """Instantiate the model a config describes, on the current default device.

    Args:
        cfg: a :class:`GPTConfig` or :class:`UNetConfig`.

    Returns:
        The :class:`GPT` or :class:`UNet` (use ``torch.device("meta")`` to allocate nothing).
    """
    return UNet(cfg) if isinstance(cfg, UNetConfig) else GPT(cfg)
