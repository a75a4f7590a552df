"""Formulas of tensor and pipeline parallelism: the pipeline bubble and the activations a
tensor-parallel layer keeps (Korthikanti et al. 2022, section 4.2.1)."""
from __future__ import annotations

from ..errors import InputError
from ..models import GPTConfig

SCHEDULES = ("gpipe", "1f1b")


def bubble_fraction(p: int, m: int) -> float:
    """Idle share of each stage's time in a GPipe/1F1B step: ``(p - 1) / (m + p - 1)``."""
    for name, v in (("p", p), ("m", m)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"{name} must be a positive integer, got {v!r}")
    return (p - 1) / (m + p - 1)


def tp_activation_bytes(cfg: GPTConfig, seq: int, batch: int, t: int = 1) -> dict[str, float]:
    """Activation bytes one transformer layer keeps for backward on each of ``t`` TP ranks.

    Korthikanti et al. 2022 (section 4.2.1) give ``sbh(10 + 24/t + 5as/(ht))`` for fp16 with
    dropout. memlab's block is fp32 (4 bytes, not 2) and has no dropout, so:

    - replicated, ``16 sbh``: the inputs of both LayerNorms and of ``qkv`` and ``fc``
      (their ``10`` less the two dropout masks, ``8``, doubled for fp32), plus the two
      LayerNorms' saved mean and 1/std, ``16 sb`` (the paper drops such small terms);
    - sharded, ``48 sbh / t``: q, k, v (12), the attention output that ``proj`` reads (4),
      the GELU input and output (16 + 16) - their ``24``, doubled;
    - the attention core, ``/ t``: with ``attention="naive"`` the softmax output
      ``4 a s^2 b`` (no dropout mask or dropout output: their ``5`` becomes ``4``), plus
      the boolean causal mask, ``s^2`` bytes, on every rank; with fused SDPA only its
      log-sum-exp, ``4 a s b``.
    """
    if cfg.mlp != "gelu" or cfg.hidden != 4 * cfg.d_model:
        raise InputError("the formula covers the GPT-2 block (gelu MLP, hidden 4*d_model); "
                         f"got mlp={cfg.mlp!r}, hidden={cfg.hidden}")
    s, b, h, a = seq, batch, cfg.d_model, cfg.n_head
    core = 4 * a * s * s * b if cfg.attention == "naive" else 4 * a * s * b
    mask = s * s if cfg.attention == "naive" else 0
    replicated = 16 * s * b * h + 16 * s * b + mask
    sharded, core = 48 * s * b * h / t, core / t
    return {"replicated": replicated, "sharded": sharded, "attention_core": core,
            "total": replicated + sharded + core}
