"""The fastest plan that fits: every combination of the techniques, estimated and timed.

:func:`memlab.advisor.advise` walks the curriculum's flowchart and stops at the first plan
that fits: the teaching walk. This module answers the learner's other question, *which plan
should I run?*: it enumerates the candidates (precision x checkpointing x accumulation x
ZeRO stage x offload x tensor- and pipeline-parallel degrees whose product divides the world
size), estimates each one's peak (:func:`memlab.estimate.estimate_step`) and its step time
on the card (:func:`memlab.step_time.step_time`), and recommends the fastest that fits,
ties going to the simpler plan (no offload, then the lower ZeRO stage, then fewer
parallel degrees).

Pipeline parallelism's memory is the estimate's with the model states divided by ``p``:
under 1F1B the first of ``p`` stages keeps ``p`` micro-batches of ``L/p`` layers, the
activations of one rank without pipelining (Korthikanti et al. 2022, sec. 4.2.3), and holds
``1/p`` of the layers' states; the embedding and head are left on it whole (not divided).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import product

from .cards import SPEEDS, Card, get_card
from .errors import InputError
from .estimate import estimate_step
from .models import GPTConfig
from .step import StepConfig
from .step_time import step_time
from .units import fmt_bytes

#: (zero, offload) pairs DeepSpeed runs (offload from its ZeRO optimizer; parameters at stage 3)
ZERO_OFFLOAD = ((0, "none"), (1, "none"), (2, "none"), (3, "none"), (1, "optimizer"), (2, "optimizer"),
                (3, "optimizer"), (3, "all"))
TP_MAX = 8  # tensor parallelism stays inside one NVLink domain


@dataclass(frozen=True)
class Candidate:
    """One plan: its knobs, its estimated peak per rank, whether that fits, its step seconds."""

    plan: dict
    peak_bytes: int
    fits: bool
    seconds: float | None
    bound: str = "gpu"

    def describe(self) -> str:
        p = self.plan
        parts = [p["precision"]]
        if p["checkpointing"] != "none":
            parts.append(f"{p['checkpointing']} checkpointing")
        if p["micro_batches"] > 1:
            parts.append(f"{p['micro_batches']} micro-batches")
        if p["zero"]:
            parts.append(f"ZeRO-{p['zero']}")
        if p["offload"] != "none":
            parts.append(f"offload {p['offload']}")
        if p["tensor_parallel"] > 1:
            parts.append(f"TP {p['tensor_parallel']}")
        if p["pipeline_parallel"] > 1:
            parts.append(f"PP {p['pipeline_parallel']}")
        return " + ".join(parts)

    def to_dict(self) -> dict:
        return {"plan": dict(self.plan), "peak_bytes": self.peak_bytes, "fits": self.fits,
                "seconds": self.seconds, "bound": self.bound, "describe": self.describe()}


@dataclass
class PlanSearch:
    """Every candidate, the fastest that fits (``best``) and one line saying why."""

    candidates: list[Candidate] = field(default_factory=list)
    best: Candidate | None = None
    why: str = ""

    def to_dict(self) -> dict:
        return {"candidates": [c.to_dict() for c in self.candidates],
                "recommendation": None if self.best is None else self.best.to_dict(), "why": self.why}


def _simplicity(c: Candidate) -> tuple:
    p = c.plan
    return (p["offload"] != "none", p["zero"], p["tensor_parallel"] * p["pipeline_parallel"],
            p["micro_batches"], p["checkpointing"] != "none")


def search_plans(model: str | GPTConfig, card: Card | str, world_size: int, seq: int, batch: int, *,
                 usable_bytes: int, attention: str | None = None, optimizer: str = "adamw",
                 target=None) -> PlanSearch:
    """Every candidate plan of ``batch`` sequences of ``seq`` tokens per data-parallel rank on
    ``world_size`` cards, and the fastest whose estimated peak is within ``usable_bytes``.

    Args:
        model: a preset name or a GPT config. card: a profile with datasheet figures
            (:data:`memlab.cards.SPEEDS`). target: the policy target to estimate for.
        usable_bytes: the budget less headroom, per rank.

    Returns:
        :class:`PlanSearch`.
    """
    name = card if isinstance(card, str) else card.name
    if name not in SPEEDS:
        raise InputError(f"card {name!r} has no throughput figures; allowed: {', '.join(SPEEDS)}")
    base = StepConfig(model=model, seq=seq, batch=batch, attention=attention, optimizer=optimizer,
                      world_size=world_size)
    cfg = base.model_config
    if not isinstance(cfg, GPTConfig):
        raise InputError(f"the plan search covers GPT models, got {cfg.name!r}")
    profile = get_card(name)
    precisions = ("fp32", "bf16") if profile.bf16_native else ("fp32", "fp16")
    ckpts = ("none", "full", "selective") if cfg.attention == "naive" else ("none", "full")
    micro = sorted({1, batch} | ({2} if batch % 2 == 0 else set()))
    degrees = [d for d in range(1, world_size + 1) if world_size % d == 0]
    pairs = [(t, p) for t in degrees for p in degrees
             if world_size % (t * p) == 0 and t <= TP_MAX and p <= cfg.n_layer and _tp_ok(cfg, t)]
    out = PlanSearch()
    for prec, ckpt, m, (zero, off), (t, p) in product(precisions, ckpts, micro, ZERO_OFFLOAD, pairs):
        if (zero or off != "none") and prec == "fp16":
            continue  # memlab's DeepSpeed config runs bf16 or fp32 (no fp16 loss scaling on its CPU path)
        if p > 1 and m == 1:
            continue  # a pipeline without micro-batches is all bubble
        dp = world_size // (t * p)
        if zero and dp == 1 and off == "none":
            continue  # ZeRO over one data-parallel rank shards nothing
        step = replace(base, precision=prec, checkpointing=ckpt, micro_batches=m, zero=zero, offload=off,
                       world_size=world_size // p)
        report = estimate_step(step, tensor_parallel=t, target=target)
        peak = report.peak_bytes
        if p > 1:
            states = sum(report.by_category.get(c, 0) for c in ("parameters", "gradients", "optimizer"))
            peak -= int(states * (1 - 1 / p))
        timed = step_time(replace(step, world_size=world_size), name, tensor_parallel=t, pipeline_parallel=p,
                          flops=report.time.flops if report.time is not None else None)
        plan = {"precision": prec, "checkpointing": ckpt, "micro_batches": m, "zero": zero, "offload": off,
                "tensor_parallel": t, "pipeline_parallel": p}
        out.candidates.append(Candidate(plan, int(peak), peak <= usable_bytes, timed.seconds, timed.bound))
    fitting = [c for c in out.candidates if c.fits]
    if not fitting:
        out.why = "no candidate fits: use more ranks, a shorter sequence or a smaller batch"
        return out
    out.best = min(fitting, key=lambda c: (round(c.seconds, 6), _simplicity(c)))
    b = out.best
    line = f"{b.describe()} over {world_size} GPU(s) fits at {b.seconds:.3g} s a step"
    offloading = [c for c in fitting if c.plan["offload"] != "none"]
    if b.plan["offload"] == "none" and offloading:
        o = min(offloading, key=lambda c: c.seconds)
        line += f"; offloading ({o.describe()}) would take {o.seconds:.3g} s"
    elif b.plan["offload"] != "none":
        line += f" ({fmt_bytes(b.peak_bytes)} per GPU): no plan without offload fits"
    out.why = line
    return out


def _tp_ok(cfg: GPTConfig, t: int) -> bool:
    try:
        cfg.check_tensor_parallel(t)
    except InputError:
        return False
    return True


__all__ = ["Candidate", "PlanSearch", "TP_MAX", "ZERO_OFFLOAD", "search_plans"]
