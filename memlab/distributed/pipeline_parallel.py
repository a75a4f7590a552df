"""Pipeline parallelism (Huang et al. 2019, "GPipe"; Narayanan et al. 2021, section 2.2),
measured per stage: GPipe and 1F1B schedules, their bubbles and the activations in flight."""
from __future__ import annotations

import itertools
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from memlab.core.errors import InputError
from memlab.core.hardware import Placement
from memlab.distributed.parallel_common import ParallelResult, rank_device, set_rank_threads, worker_step
from memlab.distributed.ranks import resolve_placement, run_ranks
from memlab.lenses.parallel_formulas import SCHEDULES, bubble_fraction
from memlab.models.gpt_unet import GPT
from memlab.step.training_step import StepConfig, build_optimizer, make_batch
from memlab.tracking.tracker import MemoryTracker


class _Clock:
    """Busy intervals of one stage: forward and backward per micro-batch, with times."""

    def __init__(self):
        self.events: list[tuple[str, int, float, float]] = []  # (F|B, micro-batch, start, end)
        self._fwd = 0
        self._bwd_start: dict[int, float] = {}
        self._f_start: float | None = None

    def reset(self) -> None:
        self.events.clear()
        self._fwd = 0
        self._bwd_start.clear()


class _Mark(torch.autograd.Function):
    """Identity whose backward notes the time: at a stage's output it marks the start of
    that micro-batch's backward, at its input the end."""

    @staticmethod
    def forward(ctx, x, clock, mb, end):
        ctx.clock, ctx.mb, ctx.end = clock, mb, end
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        now = time.perf_counter()
        if ctx.end:
            ctx.clock.events.append(("B", ctx.mb, ctx.clock._bwd_start.pop(ctx.mb), now))
        else:
            ctx.clock._bwd_start[ctx.mb] = now
        return g, None, None, None


class PipelineStageModule(nn.Module):
    """Blocks ``lo:hi`` of a GPT; the first stage also embeds, the last also projects to
    logits. Forward and backward of each micro-batch are timed on ``clock``."""

    def __init__(self, model: GPT, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe = model.wte, model.wpe
        self.blocks = nn.ModuleList(model.blocks[lo:hi])
        if last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head
        self.logits_fp32 = model.cfg.logits_fp32  # the GPT's cast before the loss, kept per stage
        self.clock = _Clock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        clock, mb = self.clock, self.clock._fwd
        clock._f_start = time.perf_counter()
        if self.first:
            x = self.wte(x)
            if self.wpe is not None:
                x = x + self.wpe(torch.arange(x.shape[1], device=x.device))
        x = _Mark.apply(x, clock, mb, True)
        for block in self.blocks:
            x = block(x)
        if self.last:
            logits = self.lm_head(self.ln_f(x))  # the loss closes this forward, see _loss_fn
            return logits.float() if self.logits_fp32 else logits
        clock._fwd += 1
        clock.events.append(("F", mb, clock._f_start, time.perf_counter()))
        return _Mark.apply(x, clock, mb, False)


def _loss_fn(stage: PipelineStageModule):
    """Cross-entropy for the last stage, timed as part of its forward and backward."""
    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        clock, mb = stage.clock, stage.clock._fwd
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
        clock._fwd += 1
        clock.events.append(("F", mb, clock._f_start, time.perf_counter()))
        return _Mark.apply(loss, clock, mb, False)
    return loss_fn


def stage_bounds(n_layer: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous, as even as possible slices of ``n_layer`` blocks for ``stages`` ranks."""
    if stages > n_layer:
        raise InputError(f"stages={stages} exceeds n_layer={n_layer}: each stage needs a block")
    cuts = [round(i * n_layer / stages) for i in range(stages + 1)]
    return list(itertools.pairwise(cuts))


def in_flight(events: list[tuple[str, int, float, float]]) -> int:
    """Most micro-batches whose forward has finished and backward not yet (activations held)."""
    marks = sorted([(e[3], +1) for e in events if e[0] == "F"] +
                   [(e[3], -1) for e in events if e[0] == "B"])
    live = peak = 0
    for _, d in marks:
        live += d
        peak = max(peak, live)
    return peak


def pp_worker(rank: int, world_size: int, *, model: str = "tiny", seq: int = 256,
              batch: int = 8, attention: str = "sdpa", micro_batches=(1, 2, 4, 8),
              schedules=SCHEDULES, repeats: int = 2, track: bool = True,
              check: bool = True) -> dict:
    """One pipeline stage: for each schedule and micro-batch count, a timed step (busy
    intervals, wall time) and a tracked step (peak bytes). Rank ``r`` is stage ``r``.

    Over 80 lines because one spawned rank runs its whole stage (reference check, then each schedule
    timed and tracked) over locals the steps share.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    set_rank_threads(world_size)
    dev = rank_device()
    step = worker_step(model, seq, batch, attention, tie=False)  # a tie would span stages
    cfg = step.model_config
    torch.manual_seed(0)
    # without the check, only this stage is materialised: a large model need not fit a rank
    with torch.device(dev if check else "meta"):
        full = GPT(cfg)
    lo, hi = stage_bounds(cfg.n_layer, world_size)[rank]
    first, last = rank == 0, rank == world_size - 1
    mod = PipelineStageModule(full, lo, hi, first, last)
    if not check:
        mod.to_empty(device=dev)
        for sub in mod.modules():
            if hasattr(sub, "reset_parameters"):
                sub.reset_parameters()
        mod.apply(GPT.init_weights)
    idx, tgt = make_batch(step, dev)
    out: dict = {"rank": rank, "world_size": world_size, "blocks": (lo, hi), "runs": []}
    if check and last:
        out["ref_loss"] = full(idx, tgt).item()
    del full
    out["param_bytes"] = sum(p.numel() * p.element_size() for p in mod.parameters())
    opt = build_optimizer(mod, step.optimizer)
    kinds = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    for name in schedules:
        for m in micro_batches:
            if batch % m:
                raise InputError(f"batch {batch} is not divisible into {m} micro-batches")
            if name == "1f1b" and m < world_size:
                continue  # 1F1B needs a micro-batch per stage in flight; with fewer it is GPipe
            stage = PipelineStage(mod, rank, world_size, dev)
            sched = kinds[name](stage, m, loss_fn=_loss_fn(mod))  # every rank: it enables backward

            def run(sched=sched):  # this iteration's schedule, bound at definition
                losses: list = []
                dist.barrier()
                mod.clock.reset()
                t0 = time.perf_counter()
                if first:
                    sched.step(idx)
                elif last:
                    sched.step(target=tgt, losses=losses)
                else:
                    sched.step()
                # the step lasts until the last stage is done: the bubble is idle time in it
                wall = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(wall, op=dist.ReduceOp.MAX)
                opt.step()
                opt.zero_grad(set_to_none=True)
                return wall.item(), losses, t0

            _, losses, _ = run()  # warm-up: optimizer state, buffers, shape inference
            run_out = {"schedule": name, "m": m}
            if last and "loss" not in out:
                out["loss"] = float(torch.stack([x.detach() for x in losses]).mean())
            best = None
            for _ in range(repeats):
                wall, _, t0 = run()
                busy = sum(e[3] - e[2] for e in mod.clock.events)
                if best is None or wall < best[0]:
                    best = (wall, busy, list(mod.clock.events), t0)
            wall, busy, events, start = best
            run_out.update(wall=wall, busy=busy, bubble=1 - busy / wall,
                           formula=bubble_fraction(world_size, m), in_flight=in_flight(events),
                           events=[(k, mb, s - start, e - start) for k, mb, s, e in events])
            if track:
                with MemoryTracker() as mt:
                    mt.track_model(mod)
                    mt.track_optimizer(opt)
                    mt.track_tensors((idx, tgt), "other")
                    mt.reset_peak()
                    run()
                run_out.update(peak_bytes=mt.peak_bytes, by_category=mt.peak_by_category())
            out["runs"].append(run_out)
    return out


def measure_pipeline(step: StepConfig | None = None, stages: int = 2, *,
                     micro_batches=(1, 2, 4, 8), schedules=SCHEDULES, repeats: int = 2,
                     track: bool = True, timeout: float = 300.0,
                     backend: str | None = None,
                     placement: Placement | None = None) -> ParallelResult:
    """Run ``step``'s GPT as a ``stages``-rank pipeline for each schedule and micro-batch
    count; per stage: wall and busy time, bubble, micro-batches in flight, peak bytes.
    Ranks are placed as in :func:`~memlab.distributed.tensor_parallel.measure_tensor_parallel`.

    Args:
        step: the step (``None``: ``StepConfig()``); its model must be a GPT.
        stages: ranks, one pipeline stage each.
        micro_batches, schedules: what to run (``"gpipe"``, ``"1f1b"``); each count must divide the batch.
        repeats, track, timeout, backend, placement: timed runs, tracking and where the ranks run.

    Returns:
        A :class:`~memlab.distributed.parallel_common.ParallelResult`, one entry per stage.

    Raises:
        InputError: a model, schedule or micro-batch count that is not allowed.
        RankError: a rank failed (:mod:`memlab.distributed.ranks`).
    """
    step = step or StepConfig()
    if isinstance(micro_batches, int):
        micro_batches = (micro_batches,)
    if isinstance(schedules, str):
        schedules = (schedules,)
    for s in schedules:
        if s not in SCHEDULES:
            raise InputError(f"schedule={s!r}; allowed: {', '.join(SCHEDULES)}")
    if not isinstance(step.model, str):
        raise InputError("pipeline parallelism needs a GPT preset name as the model")
    placement = resolve_placement(stages, backend=backend, placement=placement)
    res = run_ranks(pp_worker, stages, timeout=timeout, placement=placement,
                    kwargs=dict(model=step.model, seq=step.seq, batch=step.batch,
                                attention=step.model_config.attention,
                                micro_batches=tuple(micro_batches), schedules=tuple(schedules),
                                repeats=repeats, track=track))
    return ParallelResult("pipeline parallel", step, res, placement.device_type)


def pipeline_run(result: ParallelResult, schedule: str, m: int, rank: int = 0) -> dict | None:
    """The measured run of ``schedule`` with ``m`` micro-batches on ``rank``, or None."""
    return next((r for r in result.per_rank[rank]["runs"]
                 if r["schedule"] == schedule and r["m"] == m), None)


def pipeline_bubble(result: ParallelResult, schedule: str, m: int) -> float:
    """Measured bubble of a run, averaged over the stages."""
    runs = [pipeline_run(result, schedule, m, r) for r in range(len(result.per_rank))]
    return sum(r["bubble"] for r in runs) / len(runs)
