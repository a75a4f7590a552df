"""Tensor and pipeline parallelism, measured per rank.

Tensor parallelism (TP, Shoeybi et al. 2019, "Megatron-LM", section 3) splits every weight
matrix of a transformer block across ``t`` ranks: the first Linear of attention (``qkv``) and
of the MLP (``fc``) column-wise, the second (``proj``, ``out``) row-wise, so each pair needs
one all-reduce in forward and one in backward. Each rank keeps ``1/t`` of the block weights
and of the activations inside attention and the MLP; LayerNorms, embeddings and the inputs
of the two sublayers stay replicated (Korthikanti et al. 2022, section 4.2.1).

Pipeline parallelism (PP, Huang et al. 2019 "GPipe"; Narayanan et al. 2021 section 2.2)
gives each of ``p`` ranks a contiguous slice of the blocks and streams ``m`` micro-batches
through them; ranks idle while the pipeline fills and drains, the *bubble*
``(p - 1) / (m + p - 1)`` of each rank's time. GPipe runs all forwards, then all backwards
(holding ``m`` micro-batches of activations); 1F1B interleaves them (holding at most ``p``).

Workers follow :func:`memlab.distributed.run_ranks`' contract ``fn(rank, world_size,
**kwargs)`` and run after ``init_process_group``; ``python -m memlab.parallel tp|pp`` runs
the same worker under ``torchrun``.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import time
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .step import MemoryReport, StepConfig, build_optimizer, make_batch
from .models import GPT, GPTConfig
from .tracking import MemoryTracker
from .widgets import Panel

SCHEDULES = ("gpipe", "1f1b")


# --------------------------------------------------------------------------------------
# Formulas
# --------------------------------------------------------------------------------------
def bubble_fraction(p: int, m: int) -> float:
    """Idle share of each stage's time in a GPipe/1F1B step: ``(p - 1) / (m + p - 1)``."""
    for name, v in (("p", p), ("m", m)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
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
        raise ValueError("the formula covers the GPT-2 block (gelu MLP, hidden 4*d_model); "
                         f"got mlp={cfg.mlp!r}, hidden={cfg.hidden}")
    s, b, h, a = seq, batch, cfg.d_model, cfg.n_head
    core = 4 * a * s * s * b if cfg.attention == "naive" else 4 * a * s * b
    mask = s * s if cfg.attention == "naive" else 0
    replicated = 16 * s * b * h + 16 * s * b + mask
    sharded, core = 48 * s * b * h / t, core / t
    return {"replicated": replicated, "sharded": sharded, "attention_core": core,
            "total": replicated + sharded + core}


# --------------------------------------------------------------------------------------
# Tensor parallelism
# --------------------------------------------------------------------------------------
def qkv_head_permutation(cfg: GPTConfig, t: int) -> torch.Tensor:
    """Row order of the fused ``qkv`` weight that gives each rank whole heads.

    ``qkv`` rows are ``[q (all heads) | k | v]``; a column-wise split in ``t`` contiguous
    chunks would hand rank 0 all of q and part of k. Reordered to
    ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` (``q_r``: the rows of rank ``r``'s heads), chunk
    ``r`` holds q, k and v of the same ``n_head / t`` heads, and attention needs no
    communication.
    """
    if cfg.n_head % t or cfg.hidden % t:
        raise ValueError(f"tensor-parallel degree t={t} must divide n_head={cfg.n_head} and "
                         f"the MLP width {cfg.hidden}")
    d, hd, per = cfg.d_model, cfg.head_dim, cfg.n_head // t
    rows = torch.arange(3 * d).view(3, cfg.n_head, hd)  # (q/k/v, head, row in head)
    return torch.cat([rows[:, r * per:(r + 1) * per].reshape(-1) for r in range(t)])


def _tp_attention_forward(self, x: torch.Tensor) -> torch.Tensor:
    """The attention forward on one TP rank: ``qkv`` yields this rank's heads only."""
    b, s, _ = x.shape
    hd = self.cfg.head_dim
    q, k, v = self.qkv(x).chunk(3, dim=-1)  # [q_r | k_r | v_r], see qkv_head_permutation
    h = q.shape[-1] // hd
    q, k, v = (z.view(b, s, h, hd).transpose(1, 2) for z in (q, k, v))
    if self.cfg.position == "rope":
        cos, sin = self.cos[:s].to(q.dtype), self.sin[:s].to(q.dtype)
        q = q * cos + torch.cat((-q[..., hd // 2:], q[..., :hd // 2]), -1) * sin
        k = k * cos + torch.cat((-k[..., hd // 2:], k[..., :hd // 2]), -1) * sin
    y = self.core(q, k, v)
    return self.proj(y.transpose(1, 2).reshape(b, s, h * hd))  # row-wise: all-reduce inside


def apply_tensor_parallel(model: GPT, mesh) -> GPT:
    """Shard every block of ``model`` in place over the 1-D ``mesh`` (Megatron layout)."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    cfg, t = model.cfg, mesh.size()
    if cfg.mlp != "gelu":
        raise ValueError("tensor parallelism here covers the gelu MLP (fc, out); got swiglu")
    perm = qkv_head_permutation(cfg, t)
    for block in model.blocks:
        with torch.no_grad():
            qkv = block.attn.qkv
            qkv.weight.copy_(qkv.weight[perm])
            if qkv.bias is not None:
                qkv.bias.copy_(qkv.bias[perm])
        block.attn.forward = types.MethodType(_tp_attention_forward, block.attn)
        parallelize_module(block, mesh, {"attn.qkv": ColwiseParallel(),
                                         "attn.proj": RowwiseParallel(),
                                         "mlp.fc": ColwiseParallel(),
                                         "mlp.out": RowwiseParallel()})
    return model


def _full_grad(name: str, p: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """A TP parameter's gradient gathered and put back in the single-process row order."""
    g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
    if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):
        out = torch.empty_like(g)
        out[perm] = g
        return out
    return g


def _is_sharded(p: torch.Tensor) -> bool:
    return hasattr(p, "to_local")


def _local_bytes(p: torch.Tensor) -> int:
    q = p.to_local() if _is_sharded(p) else p
    return q.numel() * q.element_size()


def _device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _step_config(model: str, seq: int, batch: int, attention: str, tie: bool | None = None,
                 micro_batches: int = 1) -> StepConfig:
    step = StepConfig(model=model, seq=seq, batch=batch, attention=attention,
                      micro_batches=micro_batches)
    if tie is not None and step.model_config.tie_embeddings != tie:
        from dataclasses import replace
        step = replace(step, model=replace(step.model_config, tie_embeddings=tie))
    return step


def _default_backend(ranks: int) -> str:
    """NCCL when every rank can have its own GPU, gloo (CPU) otherwise."""
    return "nccl" if torch.cuda.device_count() >= ranks else "gloo"


def _threads(world_size: int) -> None:
    """Ranks on one CPU share its cores: one rank per core keeps the timing honest."""
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))


def _tp_tracked_step(tp: GPT, opt: torch.optim.Optimizer, idx: torch.Tensor,
                     tgt: torch.Tensor) -> dict:
    """Parameter bytes on this rank, then one tracked step; the live bytes before and after
    each block's forward give the activations that block keeps."""
    blocks = {n for n, _ in tp.blocks.named_parameters(prefix="blocks")}
    params = dict(tp.named_parameters())
    out = {"param_bytes": sum(_local_bytes(p) for p in params.values()),
           "block_param_bytes": sum(_local_bytes(params[n]) for n in blocks),
           "sharded_param_bytes": sum(_local_bytes(p) for p in params.values() if _is_sharded(p)),
           "full_block_param_bytes": sum(p.numel() * p.element_size()
                                         for n, p in params.items() if n in blocks),
           "full_param_bytes": sum(p.numel() * p.element_size() for p in params.values())}
    marks: list[int] = []
    with MemoryTracker() as mt:
        hooks = [tp.blocks[0].register_forward_pre_hook(lambda m, a: marks.append(mt.live_bytes))]
        hooks += [b.register_forward_hook(lambda m, a, o: marks.append(mt.live_bytes))
                  for b in tp.blocks]
        mt.track_model(tp)
        mt.track_optimizer(opt)
        mt.track_tensors((idx, tgt), "other")
        mt.reset_peak()
        loss = tp(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for hk in hooks:
            hk.remove()
    per_layer = sorted(b - a for a, b in zip(marks, marks[1:]))
    out["layer_activation_bytes"] = [b - a for a, b in zip(marks, marks[1:])]
    # the median: an all-reduce result may be freed one block late, moving bytes between
    # neighbouring layers (the sum over layers is exact)
    mid = len(per_layer) // 2
    out["layer_activation"] = (per_layer[mid] if len(per_layer) % 2
                               else (per_layer[mid - 1] + per_layer[mid]) / 2)
    out["peak_bytes"] = mt.peak_bytes
    out["by_category"] = mt.peak_by_category()
    return out


def tp_worker(rank: int, world_size: int, *, model: str = "tiny", seq: int = 256,
              batch: int = 8, attention: str = "sdpa", check: bool = True) -> dict:
    """One TP rank: loss and gradients against the single-process model, then a tracked
    AdamW step with the activations each block keeps. Returns plain numbers."""
    from torch.distributed.device_mesh import init_device_mesh
    _threads(world_size)
    dev = _device()
    step = _step_config(model, seq, batch, attention)
    cfg = step.model_config
    torch.manual_seed(0)
    with torch.device(dev):
        ref = GPT(cfg)
    tp = apply_tensor_parallel(copy.deepcopy(ref) if check else ref,
                               init_device_mesh(dev.type, (world_size,)))
    idx, tgt = make_batch(step, dev)
    # fused kernels refuse a mix of DTensor (sharded) and plain (replicated) parameters;
    # the per-tensor loop makes no full-size temporaries either
    opt = torch.optim.AdamW(tp.parameters(), lr=1e-4, foreach=False)
    out: dict = {"rank": rank, "world_size": world_size, "config": cfg.name}

    # 1. equal loss and gradients (this is also the warm-up step that creates AdamW state)
    loss = tp(idx, tgt)
    loss.backward()
    out["loss"] = loss.item()
    if check:  # the single-process model on the same batch
        ref_loss = ref(idx, tgt)
        ref_loss.backward()
        perm = qkv_head_permutation(cfg, world_size)
        ref_grads = dict(ref.named_parameters())
        out["ref_loss"] = ref_loss.item()
        out["max_grad_diff"] = max(
            (_full_grad(n, p, perm) - ref_grads[n].grad).abs().max().item()
            for n, p in tp.named_parameters())
    opt.step()
    opt.zero_grad(set_to_none=True)
    del ref

    out.update(_tp_tracked_step(tp, opt, idx, tgt))
    out["formula"] = tp_activation_bytes(cfg, seq, batch, world_size)
    return out


def simulate_tensor_parallel(step: StepConfig | None = None, tp: int = 2) -> dict:
    """Rank 0 of a ``tp``-way tensor-parallel step, in this process, without the memory:
    a fake process group (collectives return at once) and fake tensors, tracked exactly.

    Every rank holds the same shapes, so rank 0 stands for all; the numbers equal a real
    run's (lesson 08 checks it on the tiny model), for models no laptop could hold.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    step = step or StepConfig()
    cfg = step.model_config
    if not isinstance(cfg, GPTConfig):
        raise ValueError("tensor parallelism needs a GPT model")
    qkv_head_permutation(cfg, tp)  # validates tp against the heads and the MLP width
    if dist.is_initialized():
        raise RuntimeError("a process group already exists in this process; the simulation "
                           "needs its own fake one (run it outside a distributed job)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        mesh = init_device_mesh("cpu", (tp,))  # outside fake mode: it reads the ranks
        with FakeTensorMode(), torch.device("cpu"):
            model = apply_tensor_parallel(GPT(cfg), mesh)
            idx = torch.randint(0, cfg.vocab_size, (step.batch, step.seq))
            tgt = torch.randint(0, cfg.vocab_size, (step.batch, step.seq))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
            model(idx, tgt).backward()  # warm-up: the optimizer state exists from here on
            opt.step()
            opt.zero_grad(set_to_none=True)
            out = _tp_tracked_step(model, opt, idx, tgt)
    finally:
        dist.destroy_process_group()
    out.update(rank=0, world_size=tp, config=cfg.name,
               formula=tp_activation_bytes(cfg, step.seq, step.batch, tp))
    return out


@dataclass
class ParallelResult:
    """What a multi-rank run measured: ``per_rank`` holds each rank's numbers."""

    kind: str
    step: StepConfig
    per_rank: list[dict]

    def report(self, schedule: str | None = None, m: int | None = None) -> MemoryReport:
        """The per-rank peaks as a :class:`MemoryReport` (``per_rank`` filled); for a
        pipeline, of the run with ``schedule`` and ``m`` (default: the last one measured)."""
        ranks = []
        for r in self.per_rank:
            src = r
            if "runs" in r:
                runs = [x for x in r["runs"] if (schedule is None or x["schedule"] == schedule)
                        and (m is None or x["m"] == m) and "peak_bytes" in x]
                if not runs:
                    raise ValueError(f"no tracked run with schedule={schedule!r}, m={m!r}")
                src = runs[-1]
            ranks.append(MemoryReport("measure", self.step, "cpu", src["peak_bytes"],
                                      src["by_category"], notes=[f"rank {r['rank']}"]))
        top = max(ranks, key=lambda r: r.peak_bytes)
        return MemoryReport("measure", self.step, top.device, top.peak_bytes,
                            dict(top.by_category), per_rank=ranks,
                            notes=[f"{self.kind}, {len(ranks)} ranks; peak of the largest rank"])


def measure_tensor_parallel(step: StepConfig | None = None, tp: int = 2, *, check: bool = True,
                            timeout: float = 300.0, backend: str | None = None) -> ParallelResult:
    """Run one TP step of ``step``'s GPT on ``tp`` spawned ranks: loss and gradients against
    one process (``check``), parameter bytes, activations per layer and the tracked peak.
    ``backend``: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank); default NCCL with CUDA."""
    from .distributed import run_ranks
    step = step or StepConfig()
    cfg = step.model_config
    if not isinstance(cfg, GPTConfig) or not isinstance(step.model, str):
        raise ValueError("tensor parallelism needs a GPT preset name as the model")
    attention = cfg.attention
    res = run_ranks(tp_worker, tp, timeout=timeout, backend=backend or _default_backend(tp),
                    kwargs=dict(model=step.model, seq=step.seq, batch=step.batch,
                                attention=attention, check=check))
    return ParallelResult("tensor parallel", step, res)


# --------------------------------------------------------------------------------------
# Pipeline parallelism
# --------------------------------------------------------------------------------------
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
            return self.lm_head(self.ln_f(x))  # the loss closes this forward, see _loss_fn
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
        raise ValueError(f"stages={stages} exceeds n_layer={n_layer}: each stage needs a block")
    cuts = [round(i * n_layer / stages) for i in range(stages + 1)]
    return list(zip(cuts, cuts[1:]))


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
    intervals, wall time) and a tracked step (peak bytes). Rank ``r`` is stage ``r``."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    _threads(world_size)
    dev = _device()
    step = _step_config(model, seq, batch, attention, tie=False)  # a tie would span stages
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
        mod.apply(GPT._init_weights)
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
                raise ValueError(f"batch {batch} is not divisible into {m} micro-batches")
            if name == "1f1b" and m < world_size:
                continue  # 1F1B needs a micro-batch per stage in flight; with fewer it is GPipe
            stage = PipelineStage(mod, rank, world_size, dev)
            sched = kinds[name](stage, m, loss_fn=_loss_fn(mod))  # every rank: it enables backward

            def run():
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
                     backend: str | None = None) -> ParallelResult:
    """Run ``step``'s GPT as a ``stages``-rank pipeline for each schedule and micro-batch
    count; per stage: wall and busy time, bubble, micro-batches in flight, peak bytes."""
    from .distributed import run_ranks
    step = step or StepConfig()
    if isinstance(micro_batches, int):
        micro_batches = (micro_batches,)
    if isinstance(schedules, str):
        schedules = (schedules,)
    for s in schedules:
        if s not in SCHEDULES:
            raise ValueError(f"schedule={s!r}; allowed: {', '.join(SCHEDULES)}")
    if not isinstance(step.model, str):
        raise ValueError("pipeline parallelism needs a GPT preset name as the model")
    res = run_ranks(pp_worker, stages, timeout=timeout,
                    backend=backend or _default_backend(stages),
                    kwargs=dict(model=step.model, seq=step.seq, batch=step.batch,
                                attention=step.model_config.attention,
                                micro_batches=tuple(micro_batches), schedules=tuple(schedules),
                                repeats=repeats, track=track))
    return ParallelResult("pipeline parallel", step, res)


# --------------------------------------------------------------------------------------
# Figures and a control panel for the lesson (matplotlib / ipywidgets imported lazily:
# spawned ranks import this module and need neither)
# --------------------------------------------------------------------------------------
def pipeline_run(result: ParallelResult, schedule: str, m: int, rank: int = 0) -> dict | None:
    """The measured run of ``schedule`` with ``m`` micro-batches on ``rank``, or None."""
    return next((r for r in result.per_rank[rank]["runs"]
                 if r["schedule"] == schedule and r["m"] == m), None)


def pipeline_bubble(result: ParallelResult, schedule: str, m: int) -> float:
    """Measured bubble of a run, averaged over the stages."""
    runs = [pipeline_run(result, schedule, m, r) for r in range(len(result.per_rank))]
    return sum(r["bubble"] for r in runs) / len(runs)


def plot_pipeline(result: ParallelResult, schedule: str, m: int, ax=None):
    """Gantt chart of one step: forward (light) and backward (dark) of each micro-batch."""
    import matplotlib.pyplot as plt
    ax = ax or plt.subplots(figsize=(8, 2))[1]
    p = len(result.per_rank)
    for rank in range(p):
        run = pipeline_run(result, schedule, m, rank)
        for kind, mb, s, e in run["events"]:
            color = "tab:blue" if kind == "F" else "tab:orange"
            ax.barh(rank, e - s, left=s, color=color, alpha=0.5 if kind == "F" else 0.9,
                    edgecolor="k", linewidth=0.3)
            ax.text((s + e) / 2, rank, str(mb), ha="center", va="center", fontsize=7)
    wall = pipeline_run(result, schedule, m)["wall"]
    ax.axvline(wall, color="k", ls=":", lw=1)
    ax.set_yticks(range(p), [f"stage {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds (blue: forward, orange: backward; number: micro-batch)")
    ax.set_title(f"{schedule}, m={m}: bubble measured {pipeline_bubble(result, schedule, m):.2f}, "
                 f"formula {bubble_fraction(p, m):.2f}")
    return ax


def plot_bubble(result: ParallelResult, ax=None, *, highlight: tuple[str, int] | None = None):
    """Measured bubble (mean of the stages) against (p - 1)/(m + p - 1), over m."""
    import matplotlib.pyplot as plt
    ax = ax or plt.subplots(figsize=(4, 3))[1]
    p = len(result.per_rank)
    ms = sorted({r["m"] for r in result.per_rank[0]["runs"]})
    grid = range(1, max(ms) + 1)
    ax.plot(list(grid), [bubble_fraction(p, m) for m in grid], "k-", label="(p-1)/(m+p-1)")
    for sched, mark in (("gpipe", "o"), ("1f1b", "s")):
        pts = [(m, pipeline_bubble(result, sched, m)) for m in ms if pipeline_run(result, sched, m)]
        if pts:
            ax.plot(*zip(*pts), mark, label=f"{sched} measured")
    if highlight and pipeline_run(result, *highlight):
        ax.plot(highlight[1], pipeline_bubble(result, *highlight), "r*", ms=14)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble (idle share)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    return ax


def plot_stage_memory(result: ParallelResult, ax=None, *, rank: int = 0):
    """Peak bytes of one stage against m, GPipe vs 1F1B (the batch is fixed)."""
    import matplotlib.pyplot as plt
    ax = ax or plt.subplots(figsize=(4, 3))[1]
    for sched, mark in (("gpipe", "o-"), ("1f1b", "s-")):
        pts = [(r["m"], r["peak_bytes"] / 2**20) for r in result.per_rank[rank]["runs"]
               if r["schedule"] == sched and "peak_bytes" in r]
        if pts:
            ax.plot(*zip(*pts), mark, label=sched)
    ax.set_xlabel("micro-batches m (same batch)")
    ax.set_ylabel(f"stage {rank} peak (MiB)")
    ax.set_ylim(0, None)
    ax.legend(fontsize=8)
    return ax


class PipelinePanel(Panel):
    """A micro-batch slider and a schedule drop-down over a measured
    :func:`measure_pipeline` result; redraws the step's Gantt chart, the bubble curve and
    the stage's memory. :attr:`data` holds what was drawn last."""

    def __init__(self, result: ParallelResult, *, draw: bool = True):
        import ipywidgets as W
        self.result = result
        ms = sorted({r["m"] for r in result.per_rank[0]["runs"]})
        self.m = W.SelectionSlider(options=ms, value=ms[len(ms) // 2], description="m",
                                   continuous_update=False)
        scheds = sorted({r["schedule"] for r in result.per_rank[0]["runs"]})
        self.schedule = W.Dropdown(options=scheds, value=scheds[-1], description="schedule")
        self.output = W.Output()
        self.data: dict | None = None
        for w in (self.m, self.schedule):
            w.observe(lambda change: self.refresh(), names="value")
        self.box = W.VBox([W.HBox([self.m, self.schedule]), self.output])
        if draw:
            self.refresh()

    def refresh(self) -> None:
        import matplotlib.pyplot as plt
        sched, m = self.schedule.value, self.m.value
        if pipeline_run(self.result, sched, m) is None:
            sched = "gpipe"  # 1F1B needs m >= p; below that it is GPipe
        run = pipeline_run(self.result, sched, m)
        self.data = {"schedule": sched, "m": m, "bubble": pipeline_bubble(self.result, sched, m),
                     "formula": bubble_fraction(len(self.result.per_rank), m),
                     "in_flight": run["in_flight"], "peak_bytes": run.get("peak_bytes")}
        fig = plt.figure(figsize=(10, 5))
        plot_pipeline(self.result, sched, m, fig.add_subplot(2, 1, 1))
        plot_bubble(self.result, fig.add_subplot(2, 2, 3), highlight=(sched, m))
        ax = plot_stage_memory(self.result, fig.add_subplot(2, 2, 4))
        if run.get("peak_bytes"):
            ax.plot(m, run["peak_bytes"] / 2**20, "r*", ms=14)
        fig.tight_layout()
        self.show(fig)


# --------------------------------------------------------------------------------------
# As a script, under torchrun (one process per rank; torchrun sets RANK, WORLD_SIZE, ...)
# --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> list[dict] | None:
    """``torchrun --nproc-per-node N -m memlab.parallel tp|pp ...``: rank 0 prints JSON."""
    ap = argparse.ArgumentParser(prog="python -m memlab.parallel",
                                 description="tensor (tp) or pipeline (pp) parallel step, "
                                             "per-rank memory as JSON")
    ap.add_argument("mode", choices=("tp", "pp"))
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--attention", default="sdpa", choices=("sdpa", "naive"))
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--schedule", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    ap.add_argument("--no-check", dest="check", action="store_false",
                    help="skip the single-process reference (needed when the whole model "
                         "does not fit one rank)")
    args = ap.parse_args(argv)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        common = dict(model=args.model, seq=args.seq, batch=args.batch, attention=args.attention,
                      check=args.check)
        if args.mode == "tp":
            out = tp_worker(rank, world, **common)
        else:
            out = pp_worker(rank, world, micro_batches=tuple(args.micro_batches),
                            schedules=tuple(args.schedule), **common)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(out, gathered, dst=0)
        if rank == 0:
            print(json.dumps(gathered, indent=1, default=str))
        return gathered
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
