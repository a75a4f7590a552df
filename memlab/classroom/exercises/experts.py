"""Lesson 16: the model states of a mixture of experts on expert-parallel ranks."""
from __future__ import annotations

from typing import Callable

from memlab.classroom.exercises.common import CheckResult, call_learner, fail, require
from memlab.core.units import fmt_bytes
from memlab.hf.shape import decoder_shape

MODELS = ("qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b", "deepseek-v3")
RANKS = (1, 8)
BYTES = 16  # fp32 weights, fp32 gradients, AdamW's two fp32 moments (plain PyTorch, autocast)


def check_expert_states(rank_state_bytes: Callable) -> CheckResult:
    """``rank_state_bytes(shape, ep)`` returns one rank's model-state bytes (16 a parameter)
    when the routed experts of ``shape`` (a :class:`memlab.models.decoder_shape.DecoderShape`) are divided
    across ``ep`` ranks and everything else is replicated: ``16 x (num_params - expert_total
    x (1 - 1/ep))``. Checked on four shipped mixtures of experts at 1 and 8 ranks."""
    name = "model states with expert parallelism"
    require(name, "rank_state_bytes", rank_state_bytes, "a function (shape, ep) returning bytes")
    measured = {}
    for model in MODELS:
        s = decoder_shape(model)
        for ep in RANKS:
            want = BYTES * (s.num_params() - s.expert_total() * (1 - 1 / ep))
            have = call_learner(name, "rank_state_bytes", rank_state_bytes, s, ep)
            measured[(model, ep)] = have
            if abs(have - want) <= 1e-6 * want:
                continue
            if abs(have - BYTES * s.num_params() / ep) <= 1e-6 * want:
                fail(name, f"{model}, ep={ep}: {fmt_bytes(have)}, expected {fmt_bytes(want)}: you "
                           f"divided every parameter by ep; only the routed experts are split, the "
                           f"attention, norms, embeddings, routers and shared experts are replicated")
            if abs(have - BYTES * s.active_params()) <= 1e-6 * want:
                fail(name, f"{model}: {fmt_bytes(have)} is 16 bytes per *active* parameter; the "
                           f"optimizer keeps state for every expert, used by this token or not")
            fail(name, f"{model}, ep={ep}: {fmt_bytes(have)}, expected {fmt_bytes(want)} = 16 x "
                       f"({s.num_params():,} - {s.expert_total():,} x (1 - 1/{ep}))")
    q1, q8 = measured[("qwen3-30b-a3b", 1)], measured[("qwen3-30b-a3b", 8)]
    return CheckResult(name, measured, [f"{len(MODELS)} models agree at ep = 1 and 8; Qwen3-30B-A3B: "
                                        f"{fmt_bytes(q1)} on one rank, {fmt_bytes(q8)} on each of 8"])


__all__ = ["check_expert_states"]
