"""Lesson 16: the KV cache of grouped-query attention."""
from __future__ import annotations

from typing import Callable

from memlab.classroom.exercises.common import CheckResult, call_learner, fail, require
from memlab.core.units import fmt_bytes
from memlab.models.gpt_unet import get_config

MODELS = ("llama-3-8b", "llama-3-70b", "mistral-7b", "qwen2.5-7b", "gpt2-medium")


def check_kv_cache(kv_cache_bytes: Callable, *, tokens: int = 8192) -> CheckResult:
    """``kv_cache_bytes(cfg, tokens)`` returns the bytes of the inference KV cache of ``tokens``
    tokens in bf16: a key and a value vector per layer and per key/value head, ``head_dim``
    values each, 2 bytes a value. Checked on Llama 3 8B and 70B, Mistral 7B, Qwen2.5 7B and
    (multi-head) GPT-2 medium, against ``2 x n_layer x n_kv_head x head_dim x 2`` per token."""
    name = "KV cache of grouped-query attention"
    require(name, "kv_cache_bytes", kv_cache_bytes, "a function (cfg, tokens) returning bytes")
    measured = {}
    for model in MODELS:
        cfg = get_config(model)
        want = 2 * cfg.n_layer * cfg.kv_heads * cfg.head_dim * 2 * tokens
        have = call_learner(name, "kv_cache_bytes", kv_cache_bytes, cfg, tokens)
        measured[model] = have
        if have == want:
            continue
        if cfg.kv_heads != cfg.n_head and have == want * cfg.n_head // cfg.kv_heads:
            fail(name, f"{model}: {fmt_bytes(have)}, expected {fmt_bytes(want)}: "
                       f"{cfg.n_head // cfg.kv_heads}x too large; the cache keeps the "
                       f"n_kv_head={cfg.kv_heads} key/value heads, not the n_head={cfg.n_head} "
                       f"query heads (cfg.kv_heads)")
        if have * 2 == want:
            fail(name, f"{model}: {fmt_bytes(have)}, expected {fmt_bytes(want)}: half; the cache "
                       f"keeps a key *and* a value per head")
        fail(name, f"{model}: {fmt_bytes(have)}, expected {fmt_bytes(want)} = 2 (key, value) x "
                   f"{cfg.n_layer} layers x {cfg.kv_heads} key/value heads x {cfg.head_dim} x "
                   f"2 bytes x {tokens} tokens")
    return CheckResult(name, measured,
                       [f"{len(MODELS)} models agree at {tokens} tokens; Llama 3 8B: "
                        f"{fmt_bytes(measured['llama-3-8b'])}"])
