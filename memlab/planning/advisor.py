"""The advisor: walk the curriculum's decision flowchart until a training step fits the GPU.

The curriculum's flowchart (course/curriculum.md, section 6) is: enough memory? -> mixed precision -> still
short? checkpointing -> still short? ZeRO-1/2/3 -> still short? tensor + pipeline parallel
-> CPU offload -> train. :func:`advise` walks it on the estimate
(:func:`memlab.lenses.estimate.estimate_step`), adding one technique at a time to the plan, and
stops at the first plan whose peak fits the card with ``headroom`` to spare (allocator
fragmentation, the CUDA context and NCCL buffers are not in the formulas: 10% by default).
Where a simulation is cheap (one rank, under ~2B parameters) each step is also run on fake
tensors (:func:`memlab.lenses.simulate.simulate_step`) and the larger of the two peaks decides.

The plan is estimated in the accounting of the software that runs it, the config the
advisor emits: without ZeRO or offload a plain PyTorch step (autocast, ``torch.utils.checkpoint``,
DDP across ranks; no DeepSpeed config), with them DeepSpeed's layout
(:func:`memlab.step.states.model_states`: 16-bit weights and gradients plus an fp32 master and
moments, sharded by stage, offloaded ones in host memory) and the config of
:func:`memlab.step.write_deepspeed_config.deepspeed_config`. On one rank offload needs a ZeRO stage all the
same (DeepSpeed offloads from its ZeRO optimizer, and parameters only at stage 3: ZeRO-Offload
on ZeRO-2, Ren et al. 2021 sec. 4; ZeRO-Infinity on ZeRO-3, Rajbhandari et al. 2021 sec. 5):
the message says so, and how much host memory the offloaded states take.

Tensor parallelism (``t`` ranks of a node per group, ZeRO across the ``N/t`` groups) is
estimated by ``estimate_step(step)`` with ``step.parallel.tensor = t``: Megatron's layout without sequence
parallelism, so the checkpointed block inputs stay whole on every rank; at long context they
are what sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2) would divide by ``t``.
Pipeline parallelism adds nothing here: with 1F1B the first of ``p`` stages keeps ``p``
micro-batches of ``L/p`` layers, the activations of one rank without it (sec. 4.2.3), and
ZeRO-3 already divided the model states.

A technique that raises the peak (bf16 autocast on a model whose activations are small keeps fp32
weights *and* adds bf16 copies) is tried, reported, and left out of the plan; one that leaves it
equal (ZeRO-2 when the peak sits where gradients do not exist yet) is kept, as later stages build on
it; tensor parallelism is kept only when it lowers the peak by at least 1% (``TP_MIN_SAVING``).

Over 500 lines because the advisor's answer is typed rows (:class:`PlanStep`, :class:`HeldBack`,
:class:`LadderRung`, :class:`PlanCheck`), each field documented, beside the walk that makes them;
the fastest-fit search lives in :mod:`memlab.planning.plan_search`.

>>> a = advise("llama-7b", "A100-40GB", world_size=8, seq=4096, batch=1)
>>> a.plan, a.fits
(['bf16', 'checkpointing', 'zero-1', 'zero-2', 'zero-3'], True)
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from memlab.core.cards import SPEEDS, Card, detect_card
from memlab.core.errors import InputError
from memlab.core.hardware import GPU_PRESETS, resolve_budget
from memlab.core.units import fmt_bytes, parse_size
from memlab.distributed.deepspeed_zero import measure_distributed
from memlab.hf.config import load_config
from memlab.hf.shape import decoder_shape
from memlab.hf.simulate import simulate_hf
from memlab.lenses.estimate import estimate_step
from memlab.lenses.guard import host_total_bytes
from memlab.lenses.measure import measure_step
from memlab.lenses.simulate import simulate_step
from memlab.models.decoder_shape import DecoderShape
from memlab.models.gpt_unet import GPTConfig, get_config
from memlab.planning.plan_search import RANKS_PER_HOST, search_plans
from memlab.policy import resolve_target
from memlab.step.fine_tune_config import LoraConfig, QuantConfig, lora_targets_for
from memlab.step.states import under_deepspeed
from memlab.step.training_step import StepConfig
from memlab.step.write_deepspeed_config import deepspeed_config
from memlab.techniques.finetune import estimate_finetune

SIMULATE_MAX_PARAMS = 2_000_000_000  # gpt2-xl (1.6B) simulates in ~4 s on 2 cores
TP_MAX = 8  # tensor parallelism all-reduces twice per layer each way: keep it inside a node
TP_MIN_SAVING = 0.01  # ... and is worth that only if it lowers the peak by 1% or more
MIXED = ("bf16", "fp16")  # the flowchart's mixed precision: the card's (Card.precision)


@dataclass(frozen=True)
class PlanStep:
    """One technique the advisor tried (a row of :attr:`Advice.steps`)."""

    technique: str
    """The flowchart's name (``baseline``, ``bf16``, ``zero-2``, ``tensor-parallel (t=4)``, ...)."""
    peak_bytes: int
    """The step's peak with this technique on top of those kept: the larger of the two lenses."""
    fits: bool
    """Whether ``peak_bytes`` fits the usable budget."""
    kept: bool
    """Whether the plan kept it (it lowered the peak, and the host holds what it offloads)."""
    estimate_bytes: int
    """The estimate lens's peak."""
    simulated_bytes: int | None
    """The simulate lens's peak (``None``: not simulated)."""


@dataclass(frozen=True)
class HeldBack:
    """An offload step the host could not hold (a row of :attr:`Advice.held_back`)."""

    technique: str
    """``offload-optimizer`` or ``offload-all``."""
    host_bytes: int
    """Host bytes it needs for the ranks one host runs."""
    peak_bytes: int
    """The card's peak it would have."""
    fits: bool
    """Whether that peak would fit the card."""


@dataclass(frozen=True)
class LadderRung:
    """A rung of the fine-tuner's ladder (:func:`finetune_ladder`, :attr:`Advice.ladder`)."""

    technique: str
    """``8-bit AdamW``, ``LoRA r=16``, ``QLoRA r=16 (NF4)``."""
    peak_bytes: int
    """The estimated peak with this rung and those below it."""
    fits: bool
    """Whether it fits the usable budget."""


@dataclass(frozen=True)
class PlanCheck:
    """The advisor's plan for a card, run for real (:func:`check_plan`)."""

    model: str
    """The preset planned."""
    seq: int
    """Tokens per sequence."""
    batch: int
    """Sequences per step."""
    budget_bytes: int
    """The card's memory (or the budget given)."""
    plan: list[str]
    """The techniques the advisor kept."""
    advice_fits: bool
    """Whether the advisor says the plan fits."""
    estimate_peak_bytes: int
    """The plan's peak by the advisor's lenses."""
    measure_peak_bytes: int
    """The plan's peak, measured."""
    measure_fits: bool
    """Whether the measured peak fits the budget."""
    host_bytes: int
    """Host bytes the measured run offloaded."""
    advice_host_bytes: int
    """Host bytes the advisor said the plan offloads."""
    allocator: dict[str, int]
    """The measured run's allocator figures (:attr:`memlab.step.training_step.MemoryReport.allocator`)."""

    def to_dict(self) -> dict:
        """``gpu_check.json``'s ``plan_check`` record."""
        return asdict(self)


@dataclass
class Advice:
    """What :func:`advise` found: every step tried, the plan kept, and its DeepSpeed config.

    Args:
        steps, plan, step: every technique tried (a row each), the ones kept, the step they make
            (its tensor-parallel degree in ``step.parallel``).
        peak_bytes, budget_bytes, usable_bytes, headroom, fits: the plan's peak against the card.
        deepspeed_config, message, host_bytes, target: the rest of the plan.
    """

    steps: list[PlanStep]
    plan: list[str]
    step: StepConfig
    peak_bytes: int
    budget_bytes: int
    usable_bytes: int
    headroom: float
    fits: bool
    deepspeed_config: dict = field(default_factory=dict)
    message: str = ""
    host_bytes: int = 0  # host memory the plan's offloaded model states take, per rank
    target: object = None  # the policy.Target the plan was estimated for (its card)
    ladder: list[LadderRung] = field(default_factory=list)  # the fine-tuner's ladder (finetune_ladder)
    search: object = None  # memlab.planning.plan_search.PlanSearch: every candidate, the fastest fit
    host_limit_bytes: int | None = None  # the host memory plans were held to (None: no bound)
    held_back: list[HeldBack] = field(default_factory=list)  # offload steps the host could not hold

    @property
    def short_bytes(self) -> int:
        """Bytes the best plan is over the usable budget (0 when it fits)."""
        return max(0, self.peak_bytes - self.usable_bytes)

    def to_dict(self) -> dict:
        """The CLI's JSON (keys fixed by the project's contract, plus a few extras)."""
        return {"steps": [asdict(s) for s in self.steps], "plan": list(self.plan),
                "peak_bytes": self.peak_bytes, "budget_bytes": self.budget_bytes,
                "usable_bytes": self.usable_bytes, "headroom": self.headroom,
                "fits": self.fits, "short_bytes": self.short_bytes,
                "tensor_parallel": self.step.parallel.tensor, "message": self.message,
                "host_bytes": self.host_bytes, "host_limit_bytes": self.host_limit_bytes,
                "held_back": [asdict(h) for h in self.held_back],
                "config": self.step.describe(), "deepspeed_config": self.deepspeed_config,
                "ladder": [asdict(r) for r in self.ladder],
                **(self.search.to_dict() if self.search is not None else {})}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        cfg = self.step.model_config
        lines = [f"advise | {cfg.name} | seq {self.step.seq} batch {self.step.batch} | "
                 f"{self.step.world_size} rank(s) | budget {fmt_bytes(self.budget_bytes)} "
                 f"(usable {fmt_bytes(self.usable_bytes)}, {self.headroom:.0%} headroom)"]
        for s in self.steps:
            held = s.technique.startswith("offload") and any(h.technique == s.technique for h in self.held_back)
            mark = "host short" if held else "fits" if s.fits else ("kept" if s.kept else "not kept")
            sim = "" if s.simulated_bytes is None else f"  (simulated {fmt_bytes(s.simulated_bytes)})"
            lines.append(f"  + {s.technique:<22} {fmt_bytes(s.peak_bytes):>12}  {mark}{sim}")
        lines.append(f"  plan: {' + '.join(self.plan) or 'nothing to add'}")
        lines.append(f"  {self.message}")
        if self.ladder:
            lines.append("  fine-tuner's ladder (from the plan's step, plain PyTorch):")
            for r in self.ladder:
                lines.append(f"  + {r.technique:<22} {fmt_bytes(r.peak_bytes):>12}  "
                             f"{'fits' if r.fits else 'does not fit'}")
        if self.search is not None:
            lines.append(f"  fastest that fits: {self.search.why}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def tensor_parallel_degree(cfg: GPTConfig | DecoderShape, world_size: int, limit: int = TP_MAX) -> int:
    """Largest ``t <= limit`` dividing the world size that the model allows
    (:meth:`memlab.models.gpt_unet.GPTConfig.check_tensor_parallel`: the heads and the MLP width, and
    the key/value heads split or replicated; a decoder's shape:
    :meth:`memlab.models.decoder_shape.DecoderShape.check_tensor_parallel`)."""

    def allowed(t: int) -> bool:
        try:
            cfg.check_tensor_parallel(t)
        except ValueError:  # InputError is one
            return False
        return world_size % t == 0

    return max(t for t in range(1, min(limit, world_size) + 1) if allowed(t))


def flowchart(world_size: int, mixed: str = "bf16") -> list[tuple[str, dict[str, int | str]]]:
    """The curriculum's flowchart as ``(technique, StepConfig overrides)``, in order.

    ``mixed`` is the card's 16-bit mixed precision (:attr:`memlab.core.cards.Card.precision`):
    ``bf16`` where the card runs it natively, else ``fp16`` (autocast with a ``GradScaler``;
    its scale and growth tracker are two scalars, nothing per parameter).

    ZeRO sharding and tensor parallelism need several ranks. Offload runs under DeepSpeed's
    ZeRO optimizer on any number of ranks: stage 2 for the optimizer state (ZeRO-Offload, Ren
    et al. 2021, sec. 4), stage 3 to move the parameters too (ZeRO-Infinity, Rajbhandari et
    al. 2021, sec. 5); on one rank those stages shard nothing.
    """
    if mixed not in MIXED:
        raise InputError(f"mixed precision {mixed!r}; allowed: {', '.join(MIXED)}")
    chain = [(mixed, {"precision": mixed}), ("checkpointing", {"checkpointing": "full"})]
    if world_size > 1:
        chain += [("zero-1", {"zero": 1}), ("zero-2", {"zero": 2}), ("zero-3", {"zero": 3}),
                  ("tensor-parallel", {})]
    chain += [("offload-optimizer", {"offload": "optimizer", "zero": 2}),
              ("offload-all", {"offload": "all", "zero": 3})]
    return chain


def _simulate(step: StepConfig, target, hf: dict | None = None) -> int:
    """Simulated peak of ``step`` on ``target``: a DeepSpeed step runs in its own dtype on fake
    tensors with its model states in DeepSpeed's layout (:func:`memlab.lenses.simulate.simulate_step`;
    a Hugging Face config ``hf``: its own class, :func:`memlab.hf.simulate.simulate_hf`)."""
    if hf is None:
        return simulate_step(step, target=target).peak_bytes
    return simulate_hf(hf, seq=step.seq, batch=step.batch, precision=step.precision,
                       checkpointing=step.checkpointing, attention=step.attention, target=target,
                       optimizer=step.optimizer, zero=step.zero, world_size=step.world_size,
                       offload=step.offload, micro_batches=step.micro_batches).peak_bytes


def _model(model: str | GPTConfig) -> GPTConfig:
    cfg = get_config(model) if isinstance(model, str) else model
    if not isinstance(cfg, GPTConfig):
        raise InputError(f"the advisor plans GPT models; got {getattr(cfg, 'name', cfg)!r}")
    return cfg


def mixed_precision_for(target) -> str:
    """The 16-bit mixed precision the plan uses on ``target`` (a :class:`memlab.policy.Target`):
    its card's (:attr:`memlab.core.cards.Card.precision`: ``fp16`` with a ``GradScaler`` below sm80,
    where bf16 is emulated), ``bf16`` on the CPU and on a CUDA target without a card."""
    card = getattr(target, "card", None)
    return card.precision if card is not None else "bf16"


def advise(model: str | GPTConfig = "tiny", gpu: int | str = "A100-40GB", world_size: int = 1,  # noqa: PLR0913 the run's fields and the planner's knobs, as the CLI's flags
           seq: int = 256, batch: int = 8, *, attention: str | None = None,
           optimizer: str = "adamw", headroom: float = 0.10, simulate: bool | None = None,
           simulate_seconds: float = 30.0, target: str | None = None,
           card: "Card | str | None" = None, hf_config: str | dict | None = None,
           finetune: bool = False, lora_rank: int = 16,
           lora_targets: tuple[str, ...] | None = None, host_memory: int | str | None = None) -> Advice:
    """Walk the flowchart for ``model`` on ``world_size`` cards of ``gpu`` (a preset name or
    a size such as ``"150MiB"``), ``batch`` sequences of ``seq`` tokens per rank.

    ``simulate``: ``None`` simulates each step when affordable (one rank, fewer than 2B
    parameters) until ``simulate_seconds`` are spent; ``True``/``False`` force it.

    The plan follows the card's rules (:func:`memlab.policy.resolve_target`): a GPU preset
    ``gpu`` (or ``card``) plans with that card's kernels and workspaces, exactly as
    ``estimate_step(advice.step, target=advice.target)``
    estimates the config it emits, and with its mixed precision (:func:`mixed_precision_for`:
    fp16 where bf16 is not native); a size plans for the GPU present, else the CPU
    (``target`` names one outright).

    ``hf_config``: a Hugging Face ``config.json`` (a path or a shipped name) instead of ``model``:
    its decoder's shape (:func:`memlab.hf.shape.decoder_shape`), estimated as ``memlab estimate
    --hf-config`` does (:func:`memlab.lenses.estimate.estimate_step`) and simulated in its own
    class. ``finetune``: also walk the fine-tuner's ladder (:func:`finetune_ladder`: 8-bit AdamW,
    LoRA of ``lora_rank`` on ``lora_targets``, QLoRA) from the flowchart's plan; its rows are ``Advice.ladder``.

    ``host_memory``: the host memory of one machine (bytes or a size; ``"here"``: this
    machine's RAM, :func:`memlab.lenses.guard.host_total_bytes`; ``None``: no bound). An offload
    step whose host bytes, times the ranks one host runs (up to
    :data:`memlab.planning.plan_search.RANKS_PER_HOST`), exceed it is not kept: it is listed in
    ``Advice.held_back`` with what it needs, and the message says which plan more host memory
    would allow.

    Args:
        model, gpu, world_size, seq, batch: the run to plan.
        attention, optimizer, headroom: the step's attention and optimizer; the share of the card kept free.
        simulate, simulate_seconds, target, card, hf_config, finetune, lora_rank, lora_targets,
            host_memory: as above.

    Returns:
        An :class:`Advice`: every step tried, the plan kept, its DeepSpeed config.

    Raises:
        InputError: a model, card or size that is not allowed.
    """
    if not 0 <= headroom < 1:
        raise InputError(f"headroom {headroom!r} is outside [0, 1): give a fraction such as 0.1")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"world size must be a positive integer, got {world_size!r}")
    budget = resolve_budget(gpu)
    if budget is None:
        raise InputError(f"gpu {gpu!r}: give a GPU preset ({', '.join(GPU_PRESETS)}) or a size")
    tgt = resolve_target(target, gpu if isinstance(gpu, str) else None, card)
    hf = None if hf_config is None else load_config(hf_config)
    cfg = _model(model) if hf is None else decoder_shape(hf)
    step = StepConfig(model=cfg, seq=seq, batch=batch, attention=attention, optimizer=optimizer,
                      world_size=world_size)
    usable = int(budget * (1 - headroom))
    host_limit = (None if host_memory is None else host_total_bytes() if host_memory == "here"
                  else parse_size(host_memory))
    local_ranks = min(world_size, RANKS_PER_HOST)
    if simulate is None:
        simulate = world_size == 1 and cfg.num_params() < SIMULATE_MAX_PARAMS
    lenses = _Lenses(tgt, usable, simulate, simulate_seconds, time.perf_counter(), hf)
    steps, plan, held_back, current = _walk(step, lenses, host_limit, local_ranks)
    peak = _best(steps).peak_bytes
    host = estimate_host_bytes(current)
    ladder = (finetune_ladder(current, usable, tgt, rank=lora_rank, targets=lora_targets)
              if finetune else [])
    return Advice(steps=steps, plan=plan, step=current, peak_bytes=peak, budget_bytes=budget,
                  usable_bytes=usable, headroom=headroom, fits=peak <= usable,
                  deepspeed_config=_ds_config(current),
                  message=_message(current, tgt, plan, peak, budget, usable, headroom, host)
                  + _held_back_message(held_back, host_limit, local_ranks),
                  host_bytes=host, target=tgt, ladder=ladder, host_limit_bytes=host_limit, held_back=held_back,
                  search=_fastest_fit(cfg, gpu, tgt, world_size, seq, batch, usable, attention, optimizer,
                                      host_limit))


@dataclass(frozen=True)
class _Lenses:
    """How :func:`advise` prices a step: on ``target`` against ``usable`` bytes, simulating
    (when ``simulate``) until ``simulate_seconds`` after ``started`` are spent."""

    target: object
    usable: int
    simulate: bool
    simulate_seconds: float
    started: float
    hf: dict | None = None  # a Hugging Face config: simulated in its own class

    def record(self, technique: str, s: StepConfig) -> PlanStep:
        """The row of ``technique``: ``s`` (on its ``parallel.tensor`` ranks) estimated and,
        without tensor parallelism while time is left, simulated; its peak is the larger."""
        est = estimate_step(s, target=self.target).peak_bytes
        sim = None
        if self.simulate and s.parallel.tensor == 1 and time.perf_counter() - self.started < self.simulate_seconds:
            sim = _simulate(s, self.target, self.hf)
        peak = max(est, sim or 0)
        return PlanStep(technique, peak_bytes=peak, fits=peak <= self.usable, kept=True, estimate_bytes=est,
                        simulated_bytes=sim)


def _walk(step: StepConfig, lenses: _Lenses, host_limit: int | None,
          local_ranks: int) -> tuple[list[PlanStep], list[str], list[HeldBack], StepConfig]:
    """The flowchart from ``step`` until the plan fits: every row tried, the techniques kept,
    the offload steps the host could not hold, and the plan's step (its tensor-parallel degree in
    ``parallel``)."""
    cfg, world_size = step.model_config, step.world_size
    tp = tensor_parallel_degree(cfg, world_size) if world_size > 1 else 1
    steps = [lenses.record("baseline", step)]
    plan: list[str] = []
    held_back: list[HeldBack] = []
    current = step
    for technique, over in flowchart(world_size, mixed_precision_for(lenses.target)):
        if _best(steps).fits:
            break
        if "zero" in over and technique.startswith("offload"):
            over = {**over, "zero": max(over["zero"], current.zero)}  # never a lower stage
        cand = replace(current, **over)
        if technique.startswith("offload") and current.parallel.tensor > 1 and isinstance(cfg, DecoderShape):
            continue  # a decoder's shape is estimated with tensor parallelism only without offload
        if technique == "tensor-parallel":
            if tp == 1:
                continue
            cand = replace(cand, parallel=replace(cand.parallel, tensor=tp))
        row = lenses.record(technique + (f" (t={tp})" if technique == "tensor-parallel" else ""), cand)
        need = estimate_host_bytes(cand) * local_ranks if technique.startswith("offload") else 0
        if host_limit is not None and need > host_limit:  # a plan the host cannot hold does not fit
            held_back.append(HeldBack(technique, host_bytes=need, peak_bytes=row.peak_bytes, fits=row.fits))
            steps.append(replace(row, kept=False))
            continue
        before = _best(steps).peak_bytes
        # an equal peak keeps a ZeRO stage (the next builds on it); tensor parallelism costs
        # two all-reduces per layer each way, so it must save at least TP_MIN_SAVING (it saves
        # nothing when the peak is the optimizer step: ZeRO-3 already divides those states
        # by every rank)
        new_tp = cand.parallel.tensor != current.parallel.tensor
        keep = row.peak_bytes <= (before * (1 - TP_MIN_SAVING) if new_tp else before)
        if keep:
            plan.append(technique)
            current = cand
        steps.append(replace(row, kept=keep))
    return steps, plan, held_back, current


def _held_back_message(held_back: list[HeldBack], host_limit: int, local_ranks: int) -> str:
    """What more host memory would have allowed: the first offload step held back."""
    if not held_back:
        return ""
    h = held_back[0]
    ranks = f" for {local_ranks} ranks" if local_ranks > 1 else ""
    verdict = "would fit" if h.fits else "would still not fit"
    return (f"; {h.technique} {verdict} ({fmt_bytes(h.peak_bytes)} a card) but needs "
            f"{fmt_bytes(h.host_bytes)} of host memory{ranks}, more than this host's "
            f"{fmt_bytes(host_limit)} (--host-memory)")


def _fastest_fit(cfg, gpu, tgt, world_size: int, seq: int, batch: int, usable: int,
                 attention: str | None, optimizer: str, host_limit: int | None = None):
    """The fastest plan that fits (:mod:`memlab.planning.plan_search`: memlab's GPT or a decoder's
    shape), on a card with datasheet figures (the GPU preset named, else the target's card);
    ``None`` on a bare size."""
    name = gpu if isinstance(gpu, str) and gpu in SPEEDS else getattr(getattr(tgt, "card", None), "name", None)
    if name not in SPEEDS:
        return None
    return search_plans(cfg, name, world_size, seq, batch, usable_bytes=usable, attention=attention,
                        optimizer=optimizer, target=tgt, host_limit_bytes=host_limit)


def _message(step: StepConfig, tgt, plan: list[str], peak: int, budget: int,
             usable: int, headroom: float, host_bytes: int) -> str:
    """The verdict: what fits with how much to spare, or by how much it is short and what is
    largest; then how the plan runs (:func:`_runs_as`)."""
    if peak <= usable:
        text = f"fits: {fmt_bytes(peak)} of {fmt_bytes(usable)} usable ({fmt_bytes(usable - peak)} to spare)"
    else:
        text = (f"does NOT fit: even with {' + '.join(plan) or 'every technique'} the "
                f"peak is {fmt_bytes(peak)} against {fmt_bytes(usable)} "
                f"usable ({fmt_bytes(budget)} less {headroom:.0%} headroom): short by "
                f"{fmt_bytes(peak - usable)}; use more ranks, a shorter sequence "
                f"or a smaller batch (with gradient accumulation)")
        cats = estimate_step(step, target=tgt).by_category
        if max(cats, key=cats.get) == "activations":
            text += ("; the activations are the largest part: sequence parallelism (Korthikanti et "
                     "al. 2022, sec. 4.2.2) would split the block inputs tensor parallelism keeps "
                     "whole, context parallelism the sequence itself (neither is planned here)")
    if step.precision == "fp16":
        text += "; fp16 autocast with a torch.amp.GradScaler (this card has no native bf16)"
    return text + "; " + _runs_as(step, host_bytes)


def finetune_ladder(step: StepConfig, usable: int, target, *, rank: int = 16,
                    targets: tuple[str, ...] | None = None) -> list[LadderRung]:
    """The fine-tuner's ladder beside the flowchart, each rung on top of the last, from
    ``step`` run as plain PyTorch (no ZeRO, no offload: bitsandbytes' optimizers and weights
    are not DeepSpeed's): 8-bit AdamW over every parameter, LoRA of ``rank`` on ``targets``
    (all the attention and MLP projections by default) with 8-bit AdamW, QLoRA (NF4 base
    with double quantization). Each rung's peak is
    :func:`memlab.techniques.finetune.estimate_finetune`'s; for a Hugging Face decoder's shape
    :func:`memlab.lenses.decoder_estimate.estimate_run`'s, LoRA on every ``Linear`` of its layers by default
    (peft's ``all-linear``)."""
    plain = replace(step, zero=0, offload="none")
    cfg = plain.model_config
    if isinstance(cfg, DecoderShape):
        lora = LoraConfig(rank=rank, targets=targets or "all-linear")
        runs = [("8-bit AdamW", replace(plain, optimizer="adamw-8bit")),
                (f"LoRA r={rank}", replace(plain, optimizer="adamw-8bit", lora=lora)),
                (f"QLoRA r={rank} (NF4)", replace(plain, optimizer="adamw-8bit", lora=lora,
                                                  quantization=QuantConfig(bits=4)))]
        return [LadderRung(name, peak_bytes=p, fits=p <= usable)
                for name, p in ((n, estimate_step(r, target=target).peak_bytes) for n, r in runs)]
    targets = tuple(targets or lora_targets_for(cfg))
    rungs = [("8-bit AdamW", dict(optimizer="adamw-8bit")),
             (f"LoRA r={rank}", dict(optimizer="adamw-8bit", lora=(rank, targets))),
             (f"QLoRA r={rank} (NF4)", dict(optimizer="adamw-8bit", lora=(rank, targets),
                                           quantization="4bit"))]
    rows = []
    for name, kw in rungs:
        peak = estimate_finetune(plain, target=target, **kw).peak_bytes
        rows.append(LadderRung(name, peak_bytes=peak, fits=peak <= usable))
    return rows


def estimate_host_bytes(step: StepConfig) -> int:
    """Host bytes per rank of the model states ``step`` offloads (0 without offload)."""
    return estimate_step(step, target="cpu").host_bytes  # host bytes: the same on any target


def _runs_as(step: StepConfig, host_bytes: int) -> str:
    """How the plan runs: plain PyTorch, or DeepSpeed with which stage, and why."""
    if not under_deepspeed(step.zero, step.offload):
        ranks = " with DDP" if step.world_size > 1 else ""
        return f"runs as plain PyTorch{ranks} (autocast, checkpointing): no DeepSpeed config needed"
    text = (f"runs under DeepSpeed ZeRO-{step.zero} ({step.precision} mode: 16-bit weights and "
            f"gradients, fp32 master and moments)" if step.precision != "fp32" else
            f"runs under DeepSpeed ZeRO-{step.zero} (fp32)")
    if step.offload != "none":
        what = "optimizer state and parameters" if step.offload == "all" else "optimizer state"
        text += (f"; offloads the {what} to {fmt_bytes(host_bytes)} of host memory per rank")
        if step.world_size == 1:
            text += (f" (one rank: ZeRO-{step.zero} shards nothing, but DeepSpeed offloads only "
                     f"from its ZeRO optimizer, and parameters only at stage 3)")
    if step.parallel.tensor > 1:
        text += f"; tensor parallel t={step.parallel.tensor}"
    return text


def _best(steps: list[PlanStep]) -> PlanStep:
    """The last step the plan kept (the plan's current peak)."""
    return [s for s in steps if s.kept][-1]


def _ds_config(step: StepConfig) -> dict:
    """DeepSpeed's config for the plan on its card, from :func:`memlab.step.write_deepspeed_config.deepspeed_config`
    (fp16 with DeepSpeed's dynamic loss scaling, AutoTP over ``step.parallel.tensor`` ranks); empty for a plan that
    runs as plain PyTorch (its peak is estimated as such)."""
    if not under_deepspeed(step.zero, step.offload):
        return {}
    return deepspeed_config(step, accelerator="cuda")


def check_plan(model: str = "gpt2-medium", seq: int = 1024, batch: int = 16, *,
               device: str = "cuda", budget: int | str | None = None) -> PlanCheck:
    """Advise for the card at hand (its total memory, or ``budget``), then run the plan for
    real on ``device`` with that budget enforced. Returns the plan, both peaks and the verdict
    (``make gpu-check`` records it under ``build/gpu-check/<card>/``). A plan under DeepSpeed (ZeRO,
    offload) runs on one DeepSpeed rank (:func:`memlab.distributed.deepspeed_zero.measure_distributed`);
    its budget is then compared, not enforced."""
    if budget is None:
        if device != "cuda" or not torch.cuda.is_available():
            raise InputError("check_plan without a budget needs a CUDA GPU; give budget=...")
        budget = torch.cuda.get_device_properties(0).total_memory
    card = detect_card() if device == "cuda" else None
    a = advise(model, budget, 1, seq, batch, target="cuda" if card else None, card=card)
    if under_deepspeed(a.step.zero, a.step.offload):
        real = measure_distributed(a.step, device=device)
        real.budget_bytes = a.budget_bytes
    else:
        real = measure_step(a.step, device=device, budget=a.budget_bytes)
    return PlanCheck(model=model, seq=seq, batch=batch, budget_bytes=a.budget_bytes, plan=list(a.plan),
                     advice_fits=a.fits, estimate_peak_bytes=a.peak_bytes, measure_peak_bytes=real.peak_bytes,
                     measure_fits=bool(real.fits), host_bytes=real.host_bytes, advice_host_bytes=a.host_bytes,
                     allocator=dict(real.allocator))


__all__ = ["Advice", "PlanStep", "HeldBack", "LadderRung", "PlanCheck", "advise", "check_plan", "flowchart",
           "tensor_parallel_degree", "estimate_host_bytes", "finetune_ladder", "mixed_precision_for", "MIXED"]
