"""Lesson 18: the logits ``Trainer.evaluate`` keeps, against a real evaluation loop."""
from __future__ import annotations

from typing import Callable

from memlab.classroom.exercises.common import CheckResult, call_learner, fail, require
from memlab.core.units import fmt_bytes
from memlab.hf.evaluation import measure_eval
from memlab.hf.shape import decoder_shape

#: the checker's tiny Llama and evaluation run (fp32: 4 bytes a logit)
TINY_EVAL = dict(model_type="llama", vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
STORE_TOLERANCE = 0.01


def check_eval_store(store_bytes: Callable, *, seq: int = 32, batch: int = 4, batches: int = 6) -> CheckResult:
    """``store_bytes(batch, seq, vocab, batches)`` returns the bytes ``Trainer.evaluate`` holds
    at its peak beyond the weights when every batch's fp32 logits are kept (no
    ``eval_accumulation_steps``, no ``preprocess_logits_for_metrics``). Checked against a real
    evaluation loop on a tiny Llama, tracked on CPU, within 1% (the labels' int64 store is the rest)."""
    name = "Trainer.evaluate's logits"
    require(name, "store_bytes", store_bytes, "a function (batch, seq, vocab, batches) returning bytes")
    vocab = TINY_EVAL["vocab_size"]
    weights = decoder_shape(TINY_EVAL).num_params() * 4
    measured = measure_eval(TINY_EVAL, seq=seq, batch=batch, batches=batches) - weights
    have = call_learner(name, "store_bytes", store_bytes, batch, seq, vocab, batches)
    one = batch * seq * vocab * 4
    if abs(have / measured - 1) > STORE_TOLERANCE:
        if abs(2 * have / measured - 1) < 0.05:
            fail(name, f"{fmt_bytes(have)}, measured {fmt_bytes(measured)}: half; torch.cat makes the new "
                       f"store while the old one (and the new batch) are still alive")
        if abs(have / one - 1) < 0.05:
            fail(name, f"{fmt_bytes(have)}, measured {fmt_bytes(measured)}: one batch's logits; the loop "
                       f"keeps every batch's ({batches})")
        fail(name, f"{fmt_bytes(have)}, measured {fmt_bytes(measured)} over the weights: the store of "
                   f"{batches} batches of batch x seq x vocab fp32 logits, at its last concatenation")
    return CheckResult(name, {"store_bytes": have, "measured": measured},
                       [f"{fmt_bytes(have)} against {fmt_bytes(measured)} measured beyond the weights "
                        f"({batches} batches of {batch} x {seq} tokens x {vocab} logits)"])
