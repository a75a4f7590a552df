"""The fastest plan that fits: every combination of the techniques, estimated and timed.

:func:`memlab.planning.advisor.advise` walks the curriculum's flowchart and stops at the first plan
that fits: the teaching walk. This module answers the learner's other question, *which plan
should I run?*: it enumerates the candidates (precision x checkpointing x accumulation x
ZeRO stage x offload x tensor- and pipeline-parallel degrees whose product divides the world
size, each with the plain or the chunked loss), estimates each one's peak
(:func:`memlab.lenses.estimate.estimate_step`) and its step time on the card
(:func:`memlab.time.step_time.step_time`), and recommends the fastest that fits, ties going to the
simpler plan (no offload, then the lower ZeRO stage, then fewer parallel degrees). It also
lists the plans that fit by training differently (pure bf16, 8-bit AdamW, LoRA: each flagged
``changes_training`` with what it gives up); the recommendation is the fastest *exact* plan
that fits, and one of those only when none does.

Pipeline parallelism's memory is the estimate's with the model states divided by ``p``:
under 1F1B the first of ``p`` stages keeps ``p`` micro-batches of ``L/p`` layers, the
activations of one rank without pipelining (Korthikanti et al. 2022, sec. 4.2.3), and holds
``1/p`` of the layers' states; the embedding and head are left on it whole (not divided).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import product

from memlab.core.cards import SPEEDS, Card, get_card
from memlab.core.errors import InputError
from memlab.core.units import fmt_bytes
from memlab.lenses.estimate import estimate_step
from memlab.models.decoder_shape import DecoderShape
from memlab.models.gpt_unet import GPTConfig
from memlab.policy import resolve_target
from memlab.step.decoder_states import adapter_shapes, adapters_for
from memlab.step.fine_tune_config import ALL_LINEAR, LoraConfig, lora_targets_for
from memlab.step.training_step import DECODER_CHECKPOINTING, StepConfig
from memlab.step.write_deepspeed_config import CPU_PRECISIONS
from memlab.techniques.finetune import estimate_finetune, lora_shapes
from memlab.time.flops import gpt_step_flops
from memlab.time.step_time import optimizer_pass, parameter_tensors, step_time

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
    changes_training: bool = False
    gives_up: str = ""
    host_bytes: int = 0  # host memory its offloaded states take, per rank

    def describe(self) -> str:
        p = self.plan
        parts = [p["precision"]]
        if p.get("loss", "plain") == "chunked":
            parts.append("chunked loss")
        if p.get("optimizer_state", "adamw") != "adamw":
            parts.append(f"{p['optimizer_state']} state")
        if p.get("lora"):
            parts.append(f"LoRA r={p['lora']}")
        if p["checkpointing"] != "none":
            parts.append(f"{p['checkpointing']} checkpointing")
        if p["micro_batches"] > 1:
            parts.append(f"{p['micro_batches']} micro-batches")
        if p.get("optimizer_in_backward"):
            parts.append("optimizer step in backward")
        if p["zero"]:
            parts.append(f"ZeRO-{p['zero']}")
        if p["offload"] != "none":
            parts.append(f"offload {p['offload']}")
        if p["tensor_parallel"] > 1:
            parts.append(f"TP {p['tensor_parallel']}")
        if p["pipeline_parallel"] > 1:
            parts.append(f"PP {p['pipeline_parallel']}")
        text = " + ".join(parts)
        if p["tensor_parallel"] * p["pipeline_parallel"] > 1 and "batch" in p:
            text += f" ({p['batch']} sequences a replica)"
        return text

    def to_dict(self) -> dict:
        return {"plan": dict(self.plan), "peak_bytes": self.peak_bytes, "fits": self.fits,
                "seconds": self.seconds, "bound": self.bound, "changes_training": self.changes_training,
                "gives_up": self.gives_up, "host_bytes": self.host_bytes, "describe": self.describe()}


@dataclass
class PlanSearch:
    """Every candidate, the fastest that fits (``best``) and one line saying why."""

    candidates: list[Candidate] = field(default_factory=list)
    best: Candidate | None = None
    why: str = ""

    def to_dict(self) -> dict:
        return {"candidates": [c.to_dict() for c in self.candidates],
                "recommendation": None if self.best is None else self.best.to_dict(), "why": self.why}


#: ranks one machine runs at most (8 GPUs a host): their offloaded states share its memory
RANKS_PER_HOST = 8


def _fastest(c: Candidate) -> tuple:
    return (round(c.seconds, 6), _simplicity(c))


def _simplicity(c: Candidate) -> tuple:
    p = c.plan
    return (p["offload"] != "none", p["zero"], p["tensor_parallel"] * p["pipeline_parallel"],
            p["micro_batches"], p["checkpointing"] != "none")


def search_plans(model: str | GPTConfig | DecoderShape, card: Card | str, world_size: int, seq: int, batch: int, *,
                 usable_bytes: int, attention: str | None = None, optimizer: str = "adamw",
                 target=None, host_limit_bytes: int | None = None) -> PlanSearch:
    """Every candidate plan of the run's global batch on ``world_size`` cards, and the fastest
    whose estimated peak is within ``usable_bytes``.

    The run as given is data parallel: ``batch`` sequences of ``seq`` tokens on each card, so
    ``batch x world_size`` a step. Every plan takes that global batch (the training's): one
    with tensor- and pipeline-parallel degrees ``t``, ``p`` has ``world_size / (t p)``
    replicas of ``batch x t x p`` sequences each (its plan's ``batch``), so every candidate's
    seconds are for the same tokens and compare as they stand.

    Args:
        model: a preset name, a GPT config or a decoder's shape (a Hugging Face config read by
            :func:`memlab.hf.shape.decoder_shape`: its class's own terms, whole-layer
            checkpointing, its loss or the chunked one, and no tensor parallelism with offload,
            as :func:`memlab.lenses.decoder_estimate.estimate_run` counts). card: a profile with datasheet figures
            (:data:`memlab.core.cards.SPEEDS`).
        target: the policy target to estimate for (default: CUDA on ``card``).
        usable_bytes: the budget less headroom, per rank.
        host_limit_bytes: one machine's host memory; a plan whose offloaded states, times the
            ranks a machine runs (up to :data:`RANKS_PER_HOST`), exceed it does not fit.

    Returns:
        :class:`PlanSearch`.

    Over 80 lines because its docstring states the search's rules; the body, about 60 lines,
    enumerates and prices the candidates.
    """
    name = card if isinstance(card, str) else card.name
    if name not in SPEEDS:
        raise InputError(f"card {name!r} has no throughput figures; allowed: {', '.join(SPEEDS)}")
    target = resolve_target(target, card=name)  # left out: the card's own rules, not this machine's
    base = StepConfig(model=model, seq=seq, batch=batch, attention=attention, optimizer=optimizer,
                      world_size=world_size)
    cfg = base.model_config
    decoder = isinstance(cfg, DecoderShape)
    if not isinstance(cfg, (GPTConfig, DecoderShape)):
        raise InputError(f"the plan search covers GPT models and decoders' shapes, got {cfg.name!r}")
    profile = get_card(name)
    precisions = ("fp32", "bf16") if profile.bf16_native else ("fp32", "fp16")
    # op: torchtitan's op-level policy (matmul outputs saved), between selective and full;
    # transformers checkpoints a decoder's whole layers
    ckpts = (DECODER_CHECKPOINTING if decoder else
             ("none", "full", "selective", "op") if cfg.attention == "naive" else ("none", "full", "op"))
    degrees = [d for d in range(1, world_size + 1) if world_size % d == 0]
    pairs = [(t, p) for t in degrees for p in degrees
             if world_size % (t * p) == 0 and t <= TP_MAX and p <= cfg.n_layer and _tp_ok(cfg, t)]
    out = PlanSearch()
    for (t, p), prec, ckpt, (zero, off) in product(pairs, precisions, ckpts, ZERO_OFFLOAD):
        # the run's global batch, batch x world_size sequences, is the training's: a plan over
        # t x p GPUs per replica has world_size / (t p) replicas, each taking t p times as many
        rank_batch = batch * t * p
        for m in sorted({1, rank_batch} | ({2} if rank_batch % 2 == 0 else set())):
            if _skipped(prec, zero, off, m, t, p, world_size // (t * p), decoder):
                continue
            _add_plan(out, base, cfg, name, prec, ckpt, m, zero, off, t, p, rank_batch, world_size,
                      usable_bytes, target)
    if profile.bf16_native and optimizer == "adamw":
        for ckpt, m in product(ckpts, sorted({1, batch} | ({2} if batch % 2 == 0 else set()))):
            step = replace(base, checkpointing=ckpt, micro_batches=m)
            out.candidates += _changed_training(step, name, usable_bytes, target)
    unlimited = _pick([c for c in out.candidates if c.fits])
    if host_limit_bytes is not None:  # a plan the host cannot hold does not fit
        local = min(world_size, RANKS_PER_HOST)
        out.candidates = [replace(c, fits=False) if c.host_bytes * local > host_limit_bytes else c
                          for c in out.candidates]
    fitting = [c for c in out.candidates if c.fits]
    held_back = ""
    if unlimited is not None and unlimited not in fitting:  # the host's memory decided the plan
        local = min(world_size, RANKS_PER_HOST)
        held_back = (f"; with {fmt_bytes(unlimited.host_bytes * local)} of host memory (this host: "
                     f"{fmt_bytes(host_limit_bytes)}) it would be {unlimited.describe()} at "
                     f"{unlimited.seconds:.3g} s a step")
    if not fitting:
        out.why = "no candidate fits: use more ranks, a shorter sequence or a smaller batch" + held_back
        return out
    out.best = _pick(fitting)
    b = out.best
    line = f"{b.describe()} over {world_size} GPU(s) fits at {b.seconds:.3g} s a step"
    if b.changes_training:
        line += f" (no exact-training plan fits; this one gives up {b.gives_up})"
    changed = [c for c in fitting if c.changes_training and c.seconds < b.seconds]
    offloading = [c for c in fitting if c.plan["offload"] != "none"]
    if b.plan["offload"] == "none" and offloading:
        o = min(offloading, key=lambda c: c.seconds)
        line += f"; offloading ({o.describe()}) would take {o.seconds:.3g} s"
    elif b.plan["offload"] != "none":
        line += f" ({fmt_bytes(b.peak_bytes)} per GPU): no plan without offload fits"
    if changed and not b.changes_training:
        c = min(changed, key=_fastest)
        line += f"; changing the training, {c.describe()} would take {c.seconds:.3g} s (gives up {c.gives_up})"
    out.why = line + held_back
    return out


def _pick(fitting: list[Candidate]) -> Candidate | None:
    """The recommendation among the plans that fit: the fastest exact one, else the fastest."""
    exact = [c for c in fitting if not c.changes_training]
    return min(exact or fitting, key=_fastest) if fitting else None


def _add_plan(out: PlanSearch, base: StepConfig, cfg: GPTConfig, card: str, prec: str, ckpt: str, m: int,  # noqa: PLR0913 one candidate's dimensions, from search_plans' loops
              zero: int, off: str, t: int, p: int, rank_batch: int, world_size: int, usable_bytes: int,
              target) -> None:
    """Estimate and time one plan (``rank_batch`` sequences per data-parallel replica) and
    append it to ``out``, with its chunked-loss twin on one GPU per replica."""
    step = replace(base, batch=rank_batch, precision=prec, checkpointing=ckpt, micro_batches=m, zero=zero,
                   offload=off, world_size=world_size // p, parallel=replace(base.parallel, tensor=t))
    loss = _loss(step)
    report = estimate_step(step, target=target)
    peak = report.peak_bytes
    if p > 1:
        states = sum(report.by_category.get(c, 0) for c in ("parameters", "gradients", "optimizer"))
        peak -= int(states * (1 - 1 / p))
    timed = step_time(replace(step, world_size=world_size, parallel=replace(step.parallel, pipeline=p)), card,
                      flops=report.time.flops if report.time is not None else None)
    plan = {"precision": prec, "checkpointing": ckpt, "micro_batches": m, "zero": zero, "offload": off,
            "tensor_parallel": t, "pipeline_parallel": p, "batch": rank_batch, "loss": loss,
            "optimizer_state": "adamw", "lora": None, "optimizer_in_backward": False}
    out.candidates.append(Candidate(plan, int(peak), peak <= usable_bytes, timed.seconds, timed.bound,
                                    host_bytes=int(report.host_bytes)))
    if t == 1 and p == 1 and m == 1 and not zero and off == "none" and prec != "fp16" and _fuses_step(cfg):
        # the optimizer step in backward (memlab.step.optimizer_in_backward): the same update and FLOPs,
        # no moment with every gradient
        fused = replace(step, optimizer_in_backward=True)
        peak_fused = estimate_step(fused, target=target).peak_bytes
        out.candidates.append(Candidate({**plan, "optimizer_in_backward": True}, int(peak_fused),
                                        peak_fused <= usable_bytes, timed.seconds, timed.bound,
                                        host_bytes=int(report.host_bytes)))
    if t == 1 and p == 1 and loss != "chunked" and not getattr(cfg, "final_softcap", None):
        out.candidates.append(_chunked(step, plan, card, usable_bytes, target))


def _skipped(prec: str, zero: int, off: str, m: int, t: int, p: int, dp: int, decoder: bool) -> bool:
    """Whether a combination is left out of the search, and (in the comments) why."""
    if (zero or off != "none") and prec not in CPU_PRECISIONS:
        return True  # the plans memlab's DeepSpeed ranks can rehearse on a CPU (no fp16 loss scaling)
    if p > 1 and m == 1:
        return True  # a pipeline without micro-batches is all bubble
    if zero and dp == 1 and off == "none":
        return True  # ZeRO over one data-parallel rank shards nothing
    return decoder and t > 1 and off != "none"  # a decoder's TP is counted without offload (estimate_run)


def _loss(step: StepConfig) -> str:
    """The step's loss: memlab's GPT's from its config, a decoder's from its run."""
    cfg = step.model_config
    return step.loss or "transformers" if isinstance(cfg, DecoderShape) else cfg.loss


def _with_chunked_loss(step: StepConfig) -> StepConfig:
    """``step`` with the chunked loss: memlab's GPT's config switch, a decoder's run field."""
    if isinstance(step.model_config, DecoderShape):
        return replace(step, loss="chunked")
    return replace(step, model=replace(step.model_config, loss="chunked"))


def _fuses_step(cfg) -> bool:
    """Whether the optimizer step in backward is counted for ``cfg`` (a decoder: a dense one)."""
    return not (isinstance(cfg, DecoderShape) and cfg.experts)


def _chunked(step: StepConfig, plan: dict, card: str, usable: int, target) -> Candidate:
    """``plan`` with the chunked loss (:mod:`memlab.models.chunked_loss`): the same gradients, no
    logits held; its FLOPs and time are the plain loss's."""
    s = _with_chunked_loss(step)
    report = estimate_step(s, target=target)
    timed = step_time(s, card)
    return Candidate({**plan, "loss": "chunked"}, int(report.peak_bytes), report.peak_bytes <= usable,
                     timed.seconds, timed.bound, host_bytes=int(report.host_bytes))


#: LoRA's rank in the plan search (peft's examples use 8-64; 16 is the middle of that range)
LORA_RANK = 16


def _changed_training(step: StepConfig, card: str, usable: int, target) -> list[Candidate]:
    """The plans that fit by training differently, one GPU's view (no ZeRO: memlab estimates
    them for plain PyTorch): pure bf16 (weights and Adam state in bf16, no fp32 master),
    bitsandbytes' 8-bit AdamW, LoRA of :data:`LORA_RANK` on every projection."""
    cfg = step.model_config
    tensors = parameter_tensors(cfg) or 1
    n = cfg.num_params()
    own = "none" if isinstance(cfg, DecoderShape) else cfg.checkpointing
    base = {"checkpointing": own if step.checkpointing is None else step.checkpointing,
            "micro_batches": step.micro_batches, "zero": 0, "offload": "none", "tensor_parallel": 1,
            "pipeline_parallel": 1, "batch": step.batch, "loss": _loss(step)}
    out = []
    pure = replace(step, precision="pure-bf16")
    peak = estimate_step(pure, target=target).peak_bytes
    t = step_time(pure, card, optimizer=optimizer_pass("adamw-bf16", n, tensors))
    out.append(Candidate({**base, "precision": "pure-bf16", "optimizer_state": "adamw", "lora": None}, int(peak),
                         peak <= usable, t.seconds, t.bound, True,
                         "fp32 master weights: updates below bf16's resolution round away"))
    mixed = replace(step, precision="bf16")
    if isinstance(cfg, DecoderShape):
        return out + _decoder_changed_training(mixed, base, card, usable, target, n, tensors)
    peak = estimate_finetune(mixed, optimizer="adamw-8bit", target=target or "cuda").peak_bytes
    t = step_time(mixed, card, optimizer=optimizer_pass("adamw-8bit", n, tensors))
    out.append(Candidate({**base, "precision": "bf16", "optimizer_state": "adamw-8bit", "lora": None}, int(peak),
                         peak <= usable, t.seconds, t.bound, True,
                         "exact Adam moments: they are quantised to 8 bits per block"))
    targets = lora_targets_for(cfg)
    peak = estimate_finetune(mixed, lora=(LORA_RANK, targets), target=target or "cuda").peak_bytes
    flops = gpt_step_flops(cfg, step.seq, step.batch, checkpointing=base["checkpointing"], attention=cfg.attention,
                           lora_rank=LORA_RANK, lora_targets=targets)
    adapters = sum(lora_shapes(cfg, LORA_RANK, targets))
    t = step_time(mixed, card, flops=flops,
                  optimizer=optimizer_pass("adamw", adapters, len(lora_shapes(cfg, LORA_RANK, targets))))
    out.append(Candidate({**base, "precision": "bf16", "optimizer_state": "adamw", "lora": LORA_RANK}, int(peak),
                         peak <= usable, t.seconds, t.bound, True,
                         "full fine-tuning: only low-rank adapters train, the base stays frozen"))
    return out


def _decoder_changed_training(mixed: StepConfig, base: dict, card: str, usable: int, target, n: int,
                              tensors: int) -> list[Candidate]:
    """A decoder's 8-bit AdamW and LoRA candidates: fields of its run (bitsandbytes' state, peft's
    adapters on every ``Linear`` of its layers), estimated and timed as any run."""
    out = []
    eight = replace(mixed, optimizer="adamw-8bit")
    peak = estimate_step(eight, target=target or "cuda").peak_bytes
    t = step_time(eight, card, optimizer=optimizer_pass("adamw-8bit", n, tensors))
    out.append(Candidate({**base, "precision": "bf16", "optimizer_state": "adamw-8bit", "lora": None}, int(peak),
                         peak <= usable, t.seconds, t.bound, True,
                         "exact Adam moments: they are quantised to 8 bits per block"))
    # the frozen base loaded in bf16 (``torch_dtype=torch.bfloat16``), peft's adapters in fp32
    lora = replace(mixed, precision="pure-bf16", lora=LoraConfig(rank=LORA_RANK, targets=ALL_LINEAR))
    peak = estimate_step(lora, target=target or "cuda").peak_bytes
    shapes = adapter_shapes(lora.model_config, adapters_for(lora.model_config, lora.lora, lora.precision))
    t = step_time(lora, card, optimizer=optimizer_pass("adamw", sum(r * c for r, c in shapes), len(shapes)))
    out.append(Candidate({**base, "precision": "pure-bf16", "optimizer_state": "adamw", "lora": LORA_RANK}, int(peak),
                         peak <= usable, t.seconds, t.bound, True,
                         "full fine-tuning: only low-rank adapters train, the base stays frozen"))
    return out


def _tp_ok(cfg: GPTConfig | DecoderShape, t: int) -> bool:
    try:
        cfg.check_tensor_parallel(t)
    except InputError:
        return False
    return True


__all__ = ["Candidate", "LORA_RANK", "PlanSearch", "TP_MAX", "ZERO_OFFLOAD", "search_plans"]
