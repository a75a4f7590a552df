"""ZeRO with real DeepSpeed: its per-rank accounting, and ranks that measure it.

:func:`memlab.distributed.deepspeed_config.deepspeed_config` writes the config a
:class:`~memlab.step.StepConfig` describes; :func:`zero_rank_step` runs one rank's engine under the
tracker (or, on CUDA, the caching allocator) and :func:`zero_accounting` reads what DeepSpeed's ZeRO
optimizer holds, by account; :func:`measure_zero` and :func:`measure_distributed` start the ranks
(:func:`memlab.distributed.ranks.run_ranks`) and return a :class:`~memlab.step.MemoryReport` per
step with ``per_rank``. The per-rank formula is :func:`memlab.distributed.zero.zero_formula`.
"""
from __future__ import annotations

import gc
import logging
import time
import traceback
import warnings
from dataclasses import replace
from typing import Any

import psutil
import torch
import torch.distributed as dist

from ..errors import InputError
from ..guard import preflight
from ..hardware import Placement, rank_device, resolve_budget
from ..measure import add_workspace
from ..step import MemoryReport, StepConfig, build_trainer, make_batch
from ..tracking import MemoryTracker
from .deepspeed_config import deepspeed_config
from .ranks import RankError, default_backend, resolve_placement, run_ranks

ACCOUNTS = ("parameters", "gradients", "fp32_master", "optimizer_state", "comm_buffers")


def _nbytes(tensors) -> int:
    """Bytes of the tensors themselves (views into DeepSpeed's flat buffers count once)."""
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _flat(obj) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _flat(o)]
    return []


def _ds_tensors(opt, name: str) -> list:
    return _flat(getattr(opt, name, None))


def zero_accounting(engine, stage: int) -> dict[str, int]:
    """Exact bytes one rank holds, read from DeepSpeed's own structures.

    parameters: the model's parameters (stage 3: the rank's ``ds_tensor`` shards plus the
    small persistent parameters kept whole); gradients: what backward left for the step
    (``p.grad`` at stage 0, the reduced partitions at 1-3); fp32_master: the rank's fp32
    partition the optimizer updates; optimizer_state: Adam's moments; comm_buffers: the
    contiguous gradient reduce bucket (configured elements x dtype size; it exists only
    during backward, so the tracker sees it as a temporary).
    """
    opt = engine.optimizer
    params = list(engine.module.parameters())
    if stage == 3:
        p_bytes = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in params) \
            + sum(p.numel() * p.element_size() for p in params if p.data.numel() > 0)
    else:
        p_bytes = _nbytes(params)
    grads = _nbytes(p.grad for p in params if p.grad is not None)
    if stage in (1, 2):
        grads += _nbytes(_ds_tensors(opt, "averaged_gradients"))
    elif stage == 3:
        grads += _nbytes(_ds_tensors(opt, "grad_partitions_flat_buffer"))
    master = _ds_tensors(opt, "single_partition_of_fp32_groups" if stage in (1, 2)
                         else "fp32_partitioned_groups_flat")
    inner = getattr(opt, "optimizer", opt)
    state = [t for st in inner.state.values() for t in st.values()
             if isinstance(t, torch.Tensor) and t.dim() > 0]
    # the contiguous reduce bucket lives only during backward: account the configured size
    bucket = engine.zero_reduce_bucket_size() if stage > 0 else 0
    comm = bucket * (2 if engine.bfloat16_enabled() else 4)
    return {"parameters": p_bytes, "gradients": grads, "fp32_master": _nbytes(master),
            "optimizer_state": _nbytes(state), "comm_buffers": comm}


def host_gradient_bytes(engine) -> int:
    """Bytes of the fp32 gradient partition ZeRO-Offload keeps in host memory beside the fp32
    master, where the CPU's Adam reads it (Ren et al. 2021, "ZeRO-Offload", sec. 3.5): the
    ``.grad`` of the optimizer's fp32 partitions, read after the last backward of a step.
    Without offload DeepSpeed sets those only inside ``step()``, so this is 0 there."""
    opt = engine.optimizer
    fp32 = (_ds_tensors(opt, "single_partition_of_fp32_groups")          # stages 1 and 2
            + _ds_tensors(opt, "fp32_partitioned_groups_flat"))         # stage 3
    return _nbytes(g.grad for g in fp32 if g.grad is not None)


def _host_accounts(offload: str, zero: int) -> tuple[str, ...]:
    """Which accounts ZeRO-Offload keeps in host memory: with the optimizer, the fp32 master,
    Adam's moments and the fp32 gradient partition (16 bytes per parameter / N), and at
    stage 3 the 16-bit gradient partition too (DeepSpeed allocates it on the offload device)."""
    if offload == "none":
        return ()
    accounts = ("fp32_master", "optimizer_state", "host_gradients")
    accounts += ("gradients",) if zero == 3 else ()
    return accounts + (("parameters",) if offload == "all" else ())


def _rss_bytes() -> int:
    """Resident bytes of this process (host memory as the OS sees it)."""
    return psutil.Process().memory_info().rss


def zero_rank_step(rank: int, world_size: int, step, steps: int = 2,
                   budget: int | str | None = None, *, torch_adam: bool = True,
                   track: bool = True) -> dict:
    """Build a DeepSpeed engine for ``step`` on this rank's device, warm up, then one timed
    step and, with ``track``, one tracked step (peak by category, device and host).

    The device follows the process group (:func:`~memlab.hardware.rank_device`), never
    ``torch.cuda.is_available()``: CPU ranks on a GPU machine build on the CPU. The timed step
    runs without a tracker (a dispatch mode slows it down): its seconds, DeepSpeed's
    accounting, on CUDA the allocator's base and peak, and the process's RSS.

    ``budget`` (bytes, a size or a GPU preset) is this rank's: the warm-up and the tracked
    step then run under a budgeted tracker (which also gives the time and the accounting),
    and an OOM comes back as the result's ``oom`` (an :class:`~memlab.tracking.OOMInfo`)
    with the step abandoned."""
    import deepspeed

    device = rank_device()
    on_cuda = device.type == "cuda"
    rss_start = _rss_bytes()
    if on_cuda:  # what an earlier engine of this launch left behind is not this step's
        torch.cuda.synchronize(device)
        held_before = torch.cuda.memory_allocated(device)
    trainer = build_trainer(step, device)
    model = trainer.model
    del trainer
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=deepspeed_config(step, torch_adam=torch_adam))
    batch = make_batch(step, engine.device, seed=rank)
    micro = list(zip(*(t.chunk(step.micro_batches) for t in batch)))

    def one_step(account: bool = False) -> dict | None:
        acc = None
        for i, mb in enumerate(micro):
            loss = engine(*mb)
            engine.backward(loss)
            if account and i == len(micro) - 1:
                acc = zero_accounting(engine, step.zero)  # gradients are held right here
                acc["host_gradients"] = host_gradient_bytes(engine)
            engine.step()
            del loss
        return acc

    budget_bytes = resolve_budget(budget)

    def register(tracker: MemoryTracker) -> None:
        opt = engine.optimizer
        inner = getattr(opt, "optimizer", None)
        tracker.track_model(engine.module)
        if step.zero == 3:
            tracker.track_tensors((p.ds_tensor for p in engine.module.parameters()), "parameters")
        tracker.track_tensors(_ds_tensors(opt, "single_partition_of_fp32_groups")
                              + _ds_tensors(opt, "fp32_partitioned_groups_flat"), "optimizer")
        if isinstance(inner, torch.optim.Optimizer):
            tracker.track_optimizer(inner)
        tracker.track_tensors(batch, "other")
        tracker.reset_peak()

    def run(tracker: MemoryTracker, n: int, account: bool) -> dict | None:
        """``n`` steps under ``tracker``; an OOM is recorded in ``tracker.oom``. Every rank
        holds the same shapes, so under one budget the ranks run out at the same op."""
        acc = None
        try:
            with tracker:
                register(tracker)
                for _ in range(n):
                    acc = one_step(account=account)
        except torch.OutOfMemoryError as e:
            traceback.clear_frames(e.__traceback__)
        return acc

    # host memory is whatever is not on the engine's device (offloaded master, moments, grads)
    warm = MemoryTracker(budget_bytes, device=engine.device, cuda=on_cuda)
    if budget_bytes is None:
        for _ in range(steps - 1):
            one_step()  # warm-up: Adam's state exists afterwards
    else:
        run(warm, steps - 1, False)  # the budget covers the warm-up too
    out: dict[str, Any] = {"rank": rank, "device": device.type,
                           "host_accounts": _host_accounts(step.offload, step.zero),
                           "optimizer": type(getattr(engine.optimizer, "optimizer",
                                                     engine.optimizer)).__name__,
                           "accounting": None, "step_seconds": 0.0,
                           "rss_start_bytes": rss_start, "rss_bytes": None}
    if budget_bytes is None:
        if on_cuda:
            torch.cuda.synchronize(device)
            out["device_base_bytes"] = torch.cuda.memory_allocated(device) - held_before
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        out["accounting"] = one_step(account=True)
        if on_cuda:
            torch.cuda.synchronize(device)
            out["device_peak_bytes"] = torch.cuda.max_memory_allocated(device) - held_before
            out["device_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        out["step_seconds"] = time.perf_counter() - start
        out["rss_bytes"] = _rss_bytes()
    tracker = MemoryTracker(budget_bytes, device=engine.device, cuda=on_cuda)
    ran = warm.oom is None and (track or budget_bytes is not None)
    if ran:
        start = time.perf_counter()
        acc = run(tracker, 1, budget_bytes is not None)
        if budget_bytes is not None:
            out["accounting"], out["step_seconds"] = acc, time.perf_counter() - start
    used = tracker if ran else warm
    if ran or warm.oom is not None:
        out.update(peak_bytes=used.peak_bytes, by_category=used.peak_by_category(),
                   host_bytes=used.host_peak_bytes, host_by_category=used.host_peak_by_category(),
                   cuda_stats=dict(used.cuda_stats), oom=used.oom)
    else:
        out.update(peak_bytes=None, by_category=None, host_bytes=0, host_by_category={},
                   cuda_stats={}, oom=None)
    del engine, model, warm, tracker, used, batch, micro
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()  # the next engine in this launch starts from a clean device
    return out


def zero_worker(rank: int, world_size: int, steps: list, budget: int | None = None, *,
                torch_adam: bool = True, track: bool = True,
                threads: int | None = None) -> list[dict]:
    """Run each :class:`StepConfig` in ``steps`` with DeepSpeed on this rank, one after
    another in one process group (one launch for several stages saves start-up time);
    ``budget`` is each rank's (see :func:`zero_rank_step`). ``threads``: torch's CPU threads
    in this rank (the host optimizer of offload uses them)."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    if threads:
        torch.set_num_threads(threads)
    import deepspeed
    deepspeed.init_distributed(dist_backend=dist.get_backend() if dist.is_initialized()
                               else default_backend(world_size))
    return [zero_rank_step(rank, world_size, s, budget=budget, torch_adam=torch_adam, track=track)
            for s in steps]


def _rank_report(step, res: dict, device: str, budget_bytes: int | None = None):
    """One rank's report: the tracker's device peak and host peak (on a GPU, offloaded state
    is host memory), DeepSpeed's exact accounting and, on CUDA, the allocator's figures."""
    rep = MemoryReport("measure", step, device, res["peak_bytes"], dict(res["by_category"]),
                       budget_bytes, step_seconds=res["step_seconds"], oom=res.get("oom"),
                       host_bytes=res.get("host_bytes", 0),
                       host_by_category=dict(res.get("host_by_category", {})))
    if res.get("accounting") is None:  # the step ran out of its budget before accounting
        rep.notes.append(f"rank {res['rank']} of {step.world_size}: out of its budget")
        return rep
    acc = dict(res["accounting"])
    host = sum(acc[k] for k in res["host_accounts"])
    acc["host_bytes"] = host
    acc["device_bytes"] = sum(acc[k] for k in ACCOUNTS if k not in res["host_accounts"])
    if res.get("device", device) == "cpu":
        # host and device are one memory: what a GPU would hold is the peak less the
        # offloaded accounts (parameters are gathered back for compute, so they stay)
        acc["device_peak_bytes"] = res["peak_bytes"] - (
            sum(acc[k] for k in res["host_accounts"] if k != "parameters"))
    else:
        acc["device_peak_bytes"] = res["peak_bytes"]  # the tracker counted the device alone
    acc.update(res.get("cuda_stats", {}))
    rep.allocator = acc
    add_workspace(rep)
    rep.notes.append(f"rank {res['rank']} of {step.world_size}; 'allocator' holds DeepSpeed's "
                     f"exact per-rank accounting (bytes): " + ", ".join(ACCOUNTS))
    if res["host_accounts"]:
        rep.notes.append("offload: allocator['host_bytes'] are what ZeRO-Offload keeps in CPU "
                         "memory by DeepSpeed's accounting; on a CPU-only machine host and "
                         "device are one memory (the report's host_bytes are 0), so the saving "
                         "is shown by accounting, not by a second memory")
    return rep


def _oom_after_failure(error: RankError, step, device: str, budget_bytes: int | None):
    """The report of a one-step launch in which a rank ran out of its budget and returned,
    and a peer, still inside a collective, lost its connection and failed: the OOM is the
    finding, not the peer's broken pipe. Re-raises ``error`` when no rank reported an OOM."""
    ooms = sorted(r for r, res in error.partial.items() if res[0].get("oom") is not None)
    if not ooms:
        raise error
    per = [_rank_report(step, error.partial[r][0], device, budget_bytes) for r in ooms]
    rep = MemoryReport("measure", step, device, per[0].peak_bytes, dict(per[0].by_category),
                       budget_bytes, oom=per[0].oom, per_rank=per)
    rep.notes.append(f"rank {ooms[0]} ran out of its budget; rank {error.rank} then failed: "
                     f"{error.detail.splitlines()[0]}")
    return rep


def measure_zero(steps: list, *, device: str | None = "cpu", placement: Placement | None = None,
                 timeout: float = 600.0, budget: int | str | None = None) -> list:
    """Measure several ZeRO configurations in one multi-rank launch.

    All ``steps`` must share ``world_size``. The ranks run where ``placement`` says, else on
    ``device`` (``"cpu"``: gloo ranks; ``"cuda"``: one GPU per rank or an InputError; ``None``:
    :func:`~memlab.hardware.place_ranks` decides). Returns one :class:`MemoryReport` per step
    (lens "measure", the peak of rank 0, ``per_rank`` one report per rank). ``budget`` is
    each rank's, enforced in the ranks. Before anything is spawned, every step is checked
    against this host (:func:`memlab.guard.preflight`, all ranks together): one it cannot hold
    raises :class:`~memlab.errors.HostMemoryError`; one whose model states exceed the budget
    comes back ``fits: false`` at phase ``build`` without being run.

    Args:
        steps: the ZeRO configurations, one ``StepConfig`` each, all with one ``world_size``.
        device, placement, timeout, budget: as above.

    Returns:
        One :class:`MemoryReport` per step, in order.

    Raises:
        InputError: steps of different ``world_size``, or a device or budget not allowed.
        HostMemoryError: a step the ranks on this machine cannot hold.
    """
    steps = list(steps)
    if not steps:
        raise InputError("steps is empty; give at least one StepConfig")
    sizes = {s.world_size for s in steps}
    if len(sizes) != 1:
        raise InputError(f"all steps must share one world_size, got {sorted(sizes)}")
    for s in steps:
        deepspeed_config(s)  # validate before spawning anything
    world = sizes.pop()
    placement = resolve_placement(world, device=device, placement=placement)
    device, backend = placement.device_type, placement.backend
    budget_bytes = resolve_budget(budget)
    refused = {i: preflight(s, device, budget_bytes, spawned=True) for i, s in enumerate(steps)}
    todo = [s for i, s in enumerate(steps) if refused[i] is None]
    ranks = []
    if todo:
        try:
            ranks = run_ranks(zero_worker, world, kwargs={"steps": todo, "budget": budget_bytes},
                              timeout=timeout, placement=placement)
        except RankError as e:
            if len(todo) > 1:
                raise
            rep = _oom_after_failure(e, todo[0], device, budget_bytes)
            return [refused[i] or rep for i in range(len(steps))]
    reports, j = [], 0
    for i, s in enumerate(steps):
        if refused[i] is not None:
            reports.append(refused[i])
            continue
        per = [_rank_report(s, ranks[r][j], device, budget_bytes) for r in range(world)]
        j += 1
        top = max(per, key=lambda r: r.peak_bytes)
        oom = next((r.oom for r in per if r.oom is not None), None)
        rep = MemoryReport("measure", s, device, top.peak_bytes, dict(top.by_category),
                           budget_bytes, step_seconds=max(r.step_seconds for r in per), oom=oom,
                           per_rank=per, allocator=dict(top.allocator), host_bytes=top.host_bytes,
                           host_by_category=dict(top.host_by_category),
                           tracked_peak_bytes=top.tracked_peak_bytes)
        rep.notes.append(f"DeepSpeed ZeRO-{s.zero}, {world} ranks ({backend}); peak and "
                         f"categories are the largest rank's; placement: {placement.reason}")
        reports.append(rep)
    return reports


def measure_distributed(step=None, *, device: str | None = "cpu", placement: Placement | None = None,
                        timeout: float = 600.0, budget: int | str | None = None, **overrides):
    """One ZeRO step on ``step.world_size`` ranks with DeepSpeed: a :class:`MemoryReport`
    whose ``per_rank`` holds one report per rank (``to_dict()["per_rank"]``). ``budget`` is
    each rank's, enforced in the ranks; ranks are placed as in :func:`measure_zero`.

    Args:
        step: the step (``None``: ``StepConfig()``); ``overrides`` replace its fields.
        device, placement, timeout, budget: as in :func:`measure_zero`.

    Returns:
        A :class:`MemoryReport` (lens ``"measure"``, rank 0's peak) with ``per_rank``.

    Raises:
        InputError: a field, device or budget that is not allowed.
        HostMemoryError: the ranks do not fit this machine.
    """
    step = step or StepConfig()
    step = replace(step, **overrides) if overrides else step
    return measure_zero([step], device=device, placement=placement, timeout=timeout,
                        budget=budget)[0]


# --------------------------------------------------------------------------------------
# Offload: what leaves the device, and what it costs
# --------------------------------------------------------------------------------------


__all__ = ["ACCOUNTS", "measure_distributed", "measure_zero", "zero_accounting", "zero_rank_step",
           "zero_worker"]
