"""Lesson 14: how many ranks a ZeRO stage needs for the model states to fit a card."""
from __future__ import annotations

from typing import Callable

from memlab.classroom.exercises.common import CheckResult, call_learner, fail, require
from memlab.core.hardware import GPU_PRESETS
from memlab.core.units import fmt_bytes
from memlab.step.states import bytes_per_param

HEADROOM = 0.10  # the advisor's default: CUDA context, NCCL buffers, fragmentation
MAX_RANKS = 1024
CASES = [(6.74e9, 1, "A100-40GB"), (6.74e9, 2, "A100-40GB"), (6.74e9, 3, "A100-40GB"),
         (13.0e9, 3, "A100-80GB"), (70.6e9, 3, "H100-80GB"), (70.6e9, 1, "H100-80GB")]


def reference_min_ranks(num_params: float, stage: int, card_bytes: float,
                        headroom: float = HEADROOM) -> int | None:
    """The smallest N (up to :data:`MAX_RANKS`) at which mixed-precision Adam's model states
    per rank, as :func:`memlab.step.states.bytes_per_param` counts them under ZeRO ``stage``, fit
    ``(1 - headroom) * card_bytes``; None when no N does (a floor the stage does not shard)."""
    for n in range(1, MAX_RANKS + 1):
        if sum(bytes_per_param("bf16", stage, n).values()) * num_params <= (1 - headroom) * card_bytes:
            return n
    return None


def check_min_ranks(min_ranks: Callable, *, headroom: float = HEADROOM) -> CheckResult:
    """``min_ranks(num_params, stage, card_bytes)`` returns the smallest number of ranks at
    which the model states of mixed-precision Adam (2 + 2 + 12 bytes per parameter, sharded by
    ``stage`` as in :func:`memlab.step.zero.zero_formula`) fit the card less 10%
    headroom, or None when no number of ranks up to 1024 does. Checked on LLaMA-7B, -13B and
    -70B shapes at stages 1-3."""
    name = "ranks for a ZeRO stage"
    require(name, "min_ranks", min_ranks,
            "a function (num_params, stage, card_bytes) returning an int (or None)")
    got = {}
    for psi, stage, gpu in CASES:
        card = GPU_PRESETS[gpu]
        want = reference_min_ranks(psi, stage, card, headroom)
        have = call_learner(name, "min_ranks", min_ranks, psi, stage, card)
        got[(psi, stage, gpu)] = have
        if have == want:
            continue
        case = f"{psi / 1e9:.1f}B parameters, ZeRO-{stage}, {gpu} ({fmt_bytes(card)})"
        if have == reference_min_ranks(psi, stage, card, 0.0):
            fail(name, f"{case}: you said {have}, expected {want}: that fits the whole card; "
                       f"keep {headroom:.0%} headroom (the CUDA context, NCCL, fragmentation)")
        if want is None:
            fail(name, f"{case}: you said {have}, expected None: ZeRO-{stage} leaves "
                       f"{'4 bytes (weights and gradients)' if stage == 1 else '2 bytes (the weights)'} "
                       f"per parameter whole on every rank, more than the card holds")
        per_rank = sum(bytes_per_param("bf16", stage, want).values())
        fail(name, f"{case}: you said {have}, expected {want} (at {want} ranks a parameter costs "
                   f"{per_rank:.2f} bytes per rank: stage 1 shards the 12 optimizer bytes, stage 2 "
                   f"also the 2 of gradients, stage 3 also the 2 of weights)")
    return CheckResult(name, {f"{psi / 1e9:.1f}B ZeRO-{s} {g}": (v if v is not None else -1)
                              for (psi, s, g), v in got.items()},
                       [f"{len(CASES)} cases agree with memlab.step.states (2 + 2 + 12 bytes, "
                        f"{headroom:.0%} headroom)"])
