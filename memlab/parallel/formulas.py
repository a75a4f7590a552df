"""Formulas of tensor and pipeline parallelism: the pipeline bubble, which tensor-parallel
degrees a model allows, and the activations a tensor-parallel layer keeps (Korthikanti et
al. 2022, section 4.2.1)."""
from __future__ import annotations

from ..models import GPTConfig

SCHEDULES = ("gpipe", "1f1b")


def bubble_fraction(p: int, m: int) -> float:
    """Idle share of each stage's time in a GPipe/1F1B step: ``(p - 1) / (m + p - 1)``."""
    for name, v in (("p", p), ("m", m)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return (p - 1) / (m + p - 1)


def check_tensor_parallel(cfg: GPTConfig, t: int) -> str:
    """How ``t`` tensor-parallel ranks split ``cfg``'s attention, or a ValueError.

    ``t`` must divide the query heads and the MLP width. Key/value heads are ``"split"``
    when ``t`` divides ``n_kv_head`` (each rank its own), ``"replicated"`` when
    ``n_kv_head`` divides ``t`` (``t / n_kv_head`` ranks share each; Megatron-Core's
    ``num_query_groups < world_size`` case), and anything else is refused.
    """
    if isinstance(t, bool) or not isinstance(t, int) or t < 1:
        raise ValueError(f"tensor-parallel degree must be a positive integer, got {t!r}")
    h, kv = cfg.n_head, cfg.kv_heads
    allowed = [d for d in range(1, h + 1) if h % d == 0 and cfg.hidden % d == 0
               and (kv % d == 0 or (d % kv == 0 and ((h // kv + 2) * cfg.head_dim) % (d // kv) == 0))]
    if t not in allowed:
        raise ValueError(f"tensor-parallel degree t={t} must divide n_head={h} and the MLP width "
                         f"{cfg.hidden}, and divide or be a multiple of n_kv_head={kv}; "
                         f"allowed: {', '.join(map(str, allowed))}")
    return "split" if kv % t == 0 else "replicated"


def tp_activation_bytes(cfg: GPTConfig, seq: int, batch: int, t: int = 1) -> dict[str, float]:
    """Activation bytes one transformer layer keeps for backward on each of ``t`` TP ranks
    (fp32, the precision the tensor-parallel runs use).

    Korthikanti et al. 2022 (section 4.2.1) give ``sbh(10 + 24/t + 5as/(ht))`` for the GPT
    block in fp16 with dropout. memlab's blocks are fp32 (4 bytes, not 2) with no dropout,
    and the count is tensor by tensor, so it also covers LLaMA-style blocks:

    - replicated, per norm: its input (the residual stream) and output, ``8 sbh``, plus
      LayerNorm's mean and 1/std (``8 sb``) or RMSNorm's ``x / rms`` and ``1/rms``
      (``4 sbh + 4 sb``). For the GPT-2 block that is ``16 sbh + 16 sb`` in all: the
      paper's ``10`` less the two dropout masks, doubled for fp32.
    - sharded: what attention saves of q, k and v (below), the attention output that
      ``proj`` reads (``4 sbh / t``), and the MLP's hidden tensors: GELU its input and
      output (``2 x 4 sbf / t``), SwiGLU the gate, SiLU, up and product (``4 x 4 sbf / t``).
      For the GPT-2 block (``f = 4h``, MHA, no rotary) that is ``48 sbh / t``, the paper's
      ``24``, doubled.
    - q, k, v (counted by :func:`memlab.estimate.attention_saved_elements`) under SDPA:
      with learned positions q, k and v are views of the ``qkv`` output, so the whole
      output stays alive (``4 s b (a_r + 2 g_r) d_head`` for ``a_r``
      query and ``g_r`` key/value heads per rank). Rotary positions make new q and k;
      grouped heads with ``gqa="repeat"`` make new k and v of ``a_r`` heads each (then
      nothing keeps the ``qkv`` output). With replicated key/value heads
      (``t > n_kv_head``) the kept ``qkv`` output is the all-gathered one,
      ``4 s b (a + 2 g) d_head``. Naive attention's matmuls fold batch and heads into one
      dimension; unless one of them is 1 a view cannot be folded, and they save contiguous
      copies of q, k and v instead (``4 s b d_head`` times ``a_r + 2 g_r``, or ``3 a_r``
      when k and v are repeated).
    - the attention core: with ``attention="naive"`` the softmax output ``4 a_r s^2 b``
      (no dropout: the paper's ``5`` becomes ``4``) and the boolean causal mask, ``s^2``
      bytes on every rank; with fused SDPA only its log-sum-exp, ``4 a_r s b``.
    """
    from ..estimate import attention_saved_elements  # one count of q, k, v for both
    check_tensor_parallel(cfg, t)
    s, b, h, f = seq, batch, cfg.d_model, cfg.hidden
    tokens = s * b
    norm = 8 * tokens * h + (8 * tokens if cfg.norm == "layernorm" else 4 * tokens * h + 4 * tokens)
    mask = s * s if cfg.attention == "naive" else 0
    replicated = 2 * norm + mask
    heads = cfg.n_head // t
    mlp = (4 if cfg.mlp == "swiglu" else 2) * 4 * tokens * f / t
    sharded = 4 * attention_saved_elements(cfg, seq, batch, t) + mlp  # with proj's input
    core = 4 * heads * s * s * b if cfg.attention == "naive" else 4 * heads * tokens
    return {"replicated": replicated, "sharded": sharded, "attention_core": core,
            "total": replicated + sharded + core}
