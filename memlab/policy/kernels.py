"""Kernels that save or allocate differently on a device than the op list suggests.

LayerNorm's saved mean and rstd are fp32 for 16-bit inputs on CUDA, in the input dtype on CPU
(``layer_norm_cuda`` in ``aten/src/ATen/native/cuda/layer_norm_kernel.cu``). ``rms_norm``
calls ``_fused_rms_norm``, which has a CUDA kernel saving only input and ``rstd`` (on CPU it
is the composite that also saves ``x * rstd``; ``rms_norm_symint`` in
``aten/src/ATen/native/layer_norm.cpp``). ``softmax``/``log_softmax`` of a half input asked
for float output run as one ``half_to_float`` kernel on CUDA (``SoftMax.cpp``). Scaled
dot-product attention picks the first kernel the card has, in the order flash, efficient,
math (``priority_order`` in ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``;
recent builds put cuDNN attention first on sm90 with a new cuDNN, which saves the same
``(b, h, s)`` statistics): flash saves an fp32 log-sum-exp of ``(b, h, s)``, the efficient
kernel pads its last dim to a multiple of 32 (``kAlignLSE`` in
``transformers/cuda/attention.cu``); neither keeps a philox RNG state on the device without
dropout or graph capture (``flash_attn/flash_api.cpp``, ``mha_fwd``: ``seed_t =
at::empty({}, at::dtype(at::kLong))``, a host tensor). The flash backward allocates
``dq_accum`` ``(b, round(s, 128), h, round(d, 32))`` and ``softmax_d`` ``(b, h, round(s,
128))`` in fp32 inside the kernel, and with grouped-query attention ``dk``/``dv`` expanded to
every query head (``mha_bwd``). Without a fused kernel for the dtype (bf16 below sm80) the
``math`` composite materialises the scores (:func:`sdpa_math_extra_bytes`).
"""
from __future__ import annotations

import torch

from memlab.core.cards import CARDS, REFERENCE_CARD, Card

# torch dtypes by the names the card rules use (Card.sdpa_kernels)
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def target_name(target) -> str:
    """``"cuda"`` or ``"cpu"`` for a target given by name or as a :class:`~memlab.policy.Target`."""
    return target if isinstance(target, str) else target.name


def target_card(target) -> Card:
    """The card a CUDA target is for (the reference H200 when given by name)."""
    card = None if isinstance(target, str) else getattr(target, "card", None)
    return card if card is not None else CARDS[REFERENCE_CARD]


def sdpa_backend(target, elem_bytes: int, head_dim: int, last_dim_contiguous: bool = True,
                 dtype: str | None = None) -> str:
    """The attention kernel a device runs for ``F.scaled_dot_product_attention``.

    All fused kernels need the last dim of q, k, v contiguous (else ``math``, the composite
    with a materialised score matrix, on both devices). CUDA tries FlashAttention-2 first
    (16-bit inputs on sm80+, head dim a multiple of 8 up to 256), then the memory-efficient
    kernel (fp16/fp32 below sm80, also bf16 from sm80; head dim a multiple of 16 bytes),
    else ``math`` (``sdp_utils.cpp``: ``priority_order``,
    ``check_last_dim_stride_equals_1_dense``, ``check_head_dim_size_flash``,
    ``check_head_dim_size_mem_efficient``; the card's kernels: :meth:`memlab.core.cards.Card.sdpa_kernels`).
    ``dtype`` (``"bf16"``/``"fp16"``) tells the two 16-bit types apart; on sm75 bf16 runs
    ``math``. CPU runs its own flash kernel for any float dtype. ``target``: a name (CUDA
    then means the reference H200) or a :class:`~memlab.policy.Target` with its card.
    """
    if not last_dim_contiguous:
        return "math"
    if target_name(target) == "cpu":
        return "cpu_flash"
    kernels = target_card(target).sdpa_kernels(elem_bytes, dtype)
    if "flash" in kernels and head_dim % 8 == 0 and head_dim <= 256:
        return "flash"
    if "efficient" in kernels and (head_dim * elem_bytes) % 16 == 0:
        return "efficient"
    return "math"


def sdpa_dtype(precision: str) -> str:
    """The attention inputs' dtype name for a precision (``"bf16"``, ``"fp16"``, ``"fp32"``)."""
    return {"bf16": "bf16", "pure-bf16": "bf16", "fp16": "fp16"}.get(precision, "fp32")


def sdpa_math_extra_bytes(elem_bytes: int, batch: int, heads: int, seq: int, head_dim: int) -> int:
    """Bytes the ``math`` attention composite saves beyond a fused kernel's q, k, v and
    output, per layer (``_scaled_dot_product_attention_math`` in
    ``aten/src/ATen/native/transformers/attention.cpp``, torch 2.5+): 16-bit q, k, v are
    first cast to fp32 (``allowFP16BF16ReductionMathSDP`` is off by default), so the matmuls
    save fp32 scaled q and k, fp32 v and the fp32 probabilities ``(b, a, s, s)`` instead of
    the 16-bit q, k, v (whose buffer is then freed); fp32 inputs save the scaled q and k
    (new tensors) and the probabilities, v being the input itself."""
    tokens_dims = batch * seq * heads * head_dim
    probs = 4 * batch * heads * seq * seq
    if elem_bytes == 4:
        return probs + 2 * 4 * tokens_dims
    return probs + 3 * (4 - elem_bytes) * tokens_dims


def sdpa_lse_bytes(backend: str, batch: int, heads: int, seq: int) -> int:
    """The fp32 log-sum-exp a fused attention kernel saves for backward (the philox RNG
    state of the CUDA kernels is a host tensor without dropout: 0 device bytes)."""
    if backend == "math":
        return 0
    rows = -(-seq // 32) * 32 if backend == "efficient" else seq  # kAlignLSE = 32
    return 4 * batch * heads * rows


def sdpa_backward_workspace(backend: str, batch: int, heads: int, seq: int, head_dim: int,
                            kv_heads: int | None = None, elem_bytes: int = 2) -> int:
    """Bytes FlashAttention-2's backward allocates inside the kernel (``mha_bwd``):
    ``dq_accum`` and ``softmax_d`` in fp32, sequence rounded to 128 and head dim to 32, and
    for grouped-query attention (``kv_heads < heads``) ``dk`` and ``dv`` expanded to all
    query heads before they are summed per group."""
    if backend != "flash":
        return 0
    s128, d32 = -(-seq // 128) * 128, -(-head_dim // 32) * 32
    total = 4 * (batch * s128 * heads * d32 + batch * heads * s128)
    if kv_heads is not None and kv_heads != heads:
        total += 2 * batch * seq * heads * head_dim * elem_bytes
    return total


def layer_norm_stat_bytes(target, elem_bytes: int) -> int:
    """Bytes per row of LayerNorm's saved mean and rstd: CUDA keeps them in the
    accumulation type, fp32 for 16-bit inputs (``layer_norm_cuda`` in
    ``aten/src/ATen/native/cuda/layer_norm_kernel.cu``); the CPU kernel in the input's."""
    return 4 if target_name(target) == "cuda" else elem_bytes


def rms_norm_fused(target) -> bool:
    """Whether ``rms_norm`` runs as one kernel saving only its input and ``rstd``."""
    return target_name(target) == "cuda"


__all__ = ["DTYPE_NAMES", "layer_norm_stat_bytes", "rms_norm_fused", "sdpa_backend",
           "sdpa_backward_workspace", "sdpa_dtype", "sdpa_lse_bytes", "sdpa_math_extra_bytes", "target_card",
           "target_name"]
