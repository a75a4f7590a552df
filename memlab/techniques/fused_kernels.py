"""Fused kernels and FP8 training: what each saves for backward, counted from the libraries'
source (counted, not measured here: Liger's kernels are Triton, FP8 matmuls need a GPU).

**Liger-Kernel** (github.com/linkedin/Liger-Kernel at ead96b61, ``src/liger_kernel/ops/``):

* RMSNorm (``rms_norm.py``: ``ctx.save_for_backward(X, W, RSTD)`` at line 657; ``RSTD`` one
  value per row, fp32 in the Llama and Gemma casting modes, lines 449-453): the input in its
  dtype plus 4 bytes a token (the weight is a parameter, held anyway).
* SwiGLU (``swiglu.py``: ``LigerSiLUMulFunction.forward`` saves ``(a, b)`` at line 262): the
  gate and up projections' outputs; ``silu(a) * b`` is recomputed in backward, not kept.
* RoPE (``rope.py``: ``ctx.save_for_backward(cos, sin)`` at line 226): only the cos/sin
  tables; backward rotates the gradients, so no rotated q or k is kept by this op.
* Fused linear cross-entropy (``fused_linear_cross_entropy.py``): forward computes the
  gradients chunk by chunk and saves them (``grad_input``, ``grad_weight``: lines 431-435) in
  place of any logits; the transient is one chunk of ``chunk_size x V`` logits, with
  ``inc_factor = ceil(V / H)`` and ``chunk_size = next_power_of_2(ceil(BT / inc_factor))``
  (lines 68-70; the file's example: BT = 4096 x 4, V = 32000, H = 4096 gives 8 and 2048).

**torchao FP8 training** (``convert_to_float8_training``; torchao 0.18.0,
``torchao/float8/float8_linear.py``): ``matmul_with_hp_or_float8_args.forward`` saves
``(input_hp, weight_hp_t)`` at line 45, *before* casting: the activations a ``Float8Linear``
keeps stay in high precision (bf16 under autocast), the weights stay in their own dtype
(fp32 masters or bf16), and optimizer state is untouched. What is 8-bit is transient: the
fp8 copies of the input and the weight made for each matmul (one byte an element) and, in
backward, of the output gradient, each with its scale (one fp32 per tensor with tensorwise
scaling, one per row with rowwise). So FP8 training saves matmul time, not stored memory.
"""
from __future__ import annotations

from dataclasses import dataclass

from memlab.core.errors import InputError
from memlab.models.decoder_shape import DecoderShape

#: where the counts were read (reported beside every number)
LIGER_SOURCE = "linkedin/Liger-Kernel@ead96b61 src/liger_kernel/ops/"
TORCHAO_SOURCE = "torchao 0.18.0 torchao/float8/float8_linear.py:45"
COUNTED = "counted, not measured here"


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass
class FlceChunks:
    """Liger's fused linear cross-entropy split of ``BT`` tokens (fused_linear_cross_entropy.py:68-70)."""

    inc_factor: int
    chunk_size: int
    num_chunks: int


def flce_chunks(tokens: int, vocab: int, hidden: int) -> FlceChunks:
    """The chunking Liger's fused linear cross-entropy runs for ``tokens`` x ``hidden`` inputs."""
    for name, v in (("tokens", tokens), ("vocab", vocab), ("hidden", hidden)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"{name}={v!r}; allowed: a positive integer")
    inc = -(-vocab // hidden)
    chunk = _next_power_of_2(-(-tokens // inc))
    return FlceChunks(inc, chunk, -(-tokens // chunk))


@dataclass
class LigerSaved:
    """Bytes Liger's kernels save for backward in one decoder layer and in the loss
    (``tokens`` = batch x sequence), each marked :data:`COUNTED`."""

    rms_norms: int        # the layer's RMSNorms: inputs plus fp32 RSTD
    swiglu: int           # the gate and up outputs
    rope: int             # the cos/sin tables (shared by the layer's q and k)
    loss_saved: int       # fused linear cross-entropy: grad_input + grad_weight, no logits
    loss_transient: int   # one chunk of logits (fp32 accumulate is Liger's choice; counted in act dtype)
    chunks: FlceChunks
    note: str = COUNTED


def liger_saved(shape: DecoderShape, tokens: int, seq: int, act_bytes: int = 2,
                weight_bytes: int = 2) -> LigerSaved:
    """What Liger's RMSNorm, SwiGLU, RoPE and fused linear cross-entropy save (module docstring).

    Args:
        shape: the decoder. tokens: batch x sequence. seq: the sequence (RoPE's tables).
        act_bytes: the activations' element size (2: bf16). weight_bytes: the LM head's.
    """
    if shape.mlp != "gated":
        raise InputError(f"Liger's SwiGLU needs a gated MLP; {shape.name!r} has mlp={shape.mlp!r}")
    chunks = flce_chunks(tokens, shape.vocab, shape.d)
    return LigerSaved(
        rms_norms=shape.norms_per_layer * tokens * (shape.d * act_bytes + 4),
        swiglu=2 * tokens * shape.ffn * act_bytes,
        rope=2 * seq * shape.head_dim * act_bytes,
        loss_saved=tokens * shape.d * act_bytes + shape.vocab * shape.d * weight_bytes,
        loss_transient=chunks.chunk_size * shape.vocab * act_bytes,
        chunks=chunks)


@dataclass
class Fp8Linear:
    """One ``Float8Linear`` under torchao's FP8 training (module docstring), in bytes."""

    saved: int            # input_hp kept for backward (high precision, as without FP8)
    transient_fp8: int    # the fp8 input and weight copies of one matmul, with their scales
    note: str = COUNTED


def fp8_linear(tokens: int, in_features: int, out_features: int, hp_bytes: int = 2,
               rowwise: bool = False) -> Fp8Linear:
    """What a ``Float8Linear`` (``in_features`` -> ``out_features``) keeps and makes for
    ``tokens`` rows: tensorwise scaling has one fp32 scale per tensor, rowwise one per row."""
    scales = 4 * ((tokens + out_features) if rowwise else 2)
    return Fp8Linear(saved=tokens * in_features * hp_bytes,
                     transient_fp8=tokens * in_features + in_features * out_features + scales)


__all__ = ["COUNTED", "FlceChunks", "Fp8Linear", "LIGER_SOURCE", "LigerSaved", "TORCHAO_SOURCE",
           "flce_chunks", "fp8_linear", "liger_saved"]
