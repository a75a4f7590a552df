"""ZeRO with real DeepSpeed: its per-rank accounting, and ranks that measure it.

:func:`memlab.step.write_deepspeed_config.deepspeed_config` writes the config a
:class:`~memlab.step.training_step.StepConfig` describes; :func:`zero_rank_step` runs one rank's engine under
the tracker (or, on CUDA, the caching allocator) and returns its :class:`RankResult`;
:func:`zero_accounting` reads what DeepSpeed's ZeRO optimizer holds, by account;
:func:`measure_zero` and :func:`measure_distributed` start the ranks
(:func:`memlab.distributed.ranks.run_ranks`) and return a :class:`~memlab.step.training_step.MemoryReport`
per step with ``per_rank``. The per-rank formula is :func:`memlab.step.zero.zero_formula`.

Over 500 lines because one rank's step (engine, accounting, tracked and timed steps, its
:class:`RankResult`) and the launch that gathers the ranks' reports are read together: the
report is built from exactly the fields the rank step fills.
"""
from __future__ import annotations

import gc
import logging
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any

import psutil
import torch
import torch.distributed as dist

from memlab.core.errors import InputError
from memlab.core.hardware import Placement, rank_device, resolve_budget
from memlab.distributed.ranks import RankError, default_backend, resolve_placement, run_ranks
from memlab.lenses.guard import preflight
from memlab.lenses.measure import add_workspace
from memlab.step.training_step import MemoryReport, StepConfig, build_trainer, make_batch
from memlab.step.write_deepspeed_config import deepspeed_config
from memlab.tracking.tracker import MemoryTracker, OOMInfo

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
    during backward, so the tracker sees it as a temporary); host_gradients: the fp32 gradient
    partition ZeRO-Offload keeps beside the master (:func:`host_gradient_bytes`); host_staging:
    stages 1-2's host buffer of one parameter's gradient under offload
    (``temp_grad_buffer_for_cpu_offload``, made at init). Read it after
    the last backward of a step, where the gradients are held.
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
            "optimizer_state": _nbytes(state), "comm_buffers": comm,
            "host_gradients": host_gradient_bytes(engine),
            "host_staging": _nbytes(_ds_tensors(opt, "temp_grad_buffer_for_cpu_offload"))}


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


@dataclass
class RankResult:
    """One rank's ZeRO step (:func:`zero_rank_step`), in bytes and seconds.

    ``accounting`` is DeepSpeed's exact bytes by account (:func:`zero_accounting`; ``None``
    when the step ran out of its budget first); ``host_accounts`` the accounts ZeRO-Offload
    keeps in host memory. ``peak_bytes``/``by_category`` and ``host_bytes``/``host_by_category``
    are the tracker's device and host peaks (``None``/0 when no step was tracked);
    ``device_*_bytes`` the CUDA caching allocator's over the untracked timed step (CUDA and
    no budget only). Ranks send it to the parent pickled; as JSON it goes through
    :meth:`to_dict` and comes back with :meth:`from_dict`.
    """

    rank: int
    device: str                      # "cpu" or "cuda": the device the rank built on
    optimizer: str                   # the class of the optimizer DeepSpeed steps
    host_accounts: tuple[str, ...]
    accounting: dict[str, int] | None = None
    step_seconds: float = 0.0
    rss_start_bytes: int = 0
    rss_bytes: int | None = None     # after the timed step; None when none was timed
    device_base_bytes: int | None = None
    device_peak_bytes: int | None = None
    device_reserved_bytes: int | None = None
    peak_bytes: int | None = None
    by_category: dict[str, int] | None = None
    host_bytes: int = 0
    host_by_category: dict[str, int] = field(default_factory=dict)
    cuda_stats: dict[str, int] = field(default_factory=dict)
    oom: OOMInfo | None = None

    def host_account_bytes(self) -> int:
        """Bytes of the accounts kept in host memory (0 without offload)."""
        return sum(self.accounting[k] for k in self.host_accounts) if self.accounting else 0

    def device_account_bytes(self) -> int:
        """Bytes of the model-state accounts kept on the device."""
        acc = self.accounting or {}
        return sum(acc[k] for k in ACCOUNTS if k not in self.host_accounts)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``host_accounts`` a list, ``oom`` a dict or ``None``)."""
        d = asdict(self)
        d["host_accounts"] = list(self.host_accounts)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RankResult:
        """The result :meth:`to_dict` wrote; keys that are not fields (a launcher's
        ``world_size``) are left out.

        Raises:
            InputError: a required field (``rank``, ``device``, ``optimizer``,
                ``host_accounts``) is missing."""
        names = {f.name for f in fields(cls)}
        missing = [f.name for f in fields(cls) if f.default is MISSING
                   and f.default_factory is MISSING and f.name not in d]
        if missing:
            raise InputError(f"a rank result needs {missing}; got keys {sorted(d)}")
        kw = {k: v for k, v in d.items() if k in names}
        kw["host_accounts"] = tuple(kw["host_accounts"])
        if isinstance(kw.get("oom"), dict):
            kw["oom"] = OOMInfo(**kw["oom"])
        return cls(**kw)


def _build_engine(step: StepConfig, rank: int, torch_adam: bool, ds_config: dict | None = None,
                  model_fn: Callable[[StepConfig], torch.nn.Module] | None = None):
    """DeepSpeed's engine for ``step`` on this rank's device (with a run's own ``ds_config``,
    else memlab's), this rank's batch (seeded by the rank) and its micro-batches; the model is
    ``model_fn(step)``'s where given, else memlab's."""
    import deepspeed

    if model_fn is None:
        trainer = build_trainer(step, rank_device())
        model = trainer.model
        del trainer
    else:
        with torch.device(rank_device()):
            model = model_fn(step)
    # a frozen base (LoRA) is not the optimizer's: DeepSpeed partitions what it is given
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable,
                                      config=_run_config(step, ds_config, torch_adam))
    batch = make_batch(step, engine.device, seed=rank)
    micro = list(zip(*(t.chunk(step.micro_batches) for t in batch), strict=True))  # one batch dim
    return engine, batch, micro


def _train_step(engine, micro: list, stage: int, account: bool = False) -> dict[str, int] | None:
    """One optimizer step over the micro-batches; with ``account``, DeepSpeed's accounting
    read after the last backward, where the gradients are held."""
    acc = None
    for i, mb in enumerate(micro):
        loss = engine(*mb)
        engine.backward(loss)
        if account and i == len(micro) - 1:
            acc = zero_accounting(engine, stage)
        engine.step()
        del loss
    return acc


def track_engine(tracker: MemoryTracker, engine, stage: int, batch) -> None:
    """Tell ``tracker`` which of a DeepSpeed engine's tensors are parameters, optimizer state
    and the batch, then start its peak from what is live now.

    Stages 1-3 wrap torch's optimizer in DeepSpeed's ZeRO optimizer (its ``.optimizer``); at
    stage 0 in fp32 DeepSpeed steps torch's optimizer itself (0.19.8 ``runtime/engine.py``,
    ``_configure_optimizer``: ``self.optimizer = basic_optimizer``), whose moments must be
    registered too: a storage made before tracking is counted only once it is registered, and
    the optimizer step's hook would register them only after forward and backward (stage 0's
    peak then missed Adam's moments, and landed in the step, with no activations).

    Args:
        tracker: the tracker the step will run under.
        engine: the DeepSpeed engine (``.module``, ``.optimizer``).
        stage: the engine's ZeRO stage (3: the parameters' ``ds_tensor`` shards, the gradient
            partition and the reduce bucket, all held from init).
        batch: the step's input tensors (category ``other``).
    """
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    tracker.track_model(engine.module)
    if stage == 3:
        tracker.track_tensors((p.ds_tensor for p in engine.module.parameters()), "parameters")
        # stage 3's gradient partition and reduce bucket are allocated once, at init, and first
        # written in backward: unregistered, the tracker would count them only from then on
        persistent = [getattr(opt, "grad_partitions_flat_buffer", None)]
        persistent += [getattr(b, "buffer", None) for b in getattr(opt, "ipg_buckets", {}).values()]
        tracker.track_tensors((t for t in persistent if isinstance(t, torch.Tensor)), "gradients")
    # stages 1-2's offload staging buffers (one parameter's gradient, device and host), likewise
    staging = [getattr(opt, n, None) for n in ("temp_grad_buffer_for_gpu_offload",
                                               "temp_grad_buffer_for_cpu_offload")]
    tracker.track_tensors((t for t in staging if isinstance(t, torch.Tensor)), "gradients")
    tracker.track_tensors(_ds_tensors(opt, "single_partition_of_fp32_groups")
                          + _ds_tensors(opt, "fp32_partitioned_groups_flat"), "optimizer")
    if isinstance(inner, torch.optim.Optimizer):
        tracker.track_optimizer(inner)
    tracker.track_tensors(batch, "other")
    tracker.reset_peak()


def _tracked_steps(tracker: MemoryTracker, engine, batch, micro: list, stage: int, n: int,
                   account: bool) -> dict[str, int] | None:
    """``n`` steps under ``tracker``; an OOM is recorded in ``tracker.oom``. Every rank holds
    the same shapes, so under one budget the ranks run out at the same op."""
    acc = None
    try:
        with tracker:
            track_engine(tracker, engine, stage, batch)
            for _ in range(n):
                acc = _train_step(engine, micro, stage, account=account)
    except torch.OutOfMemoryError as e:
        traceback.clear_frames(e.__traceback__)
    return acc


def _timed_step(res: RankResult, engine, micro: list, stage: int, held_before: int | None) -> None:
    """One untracked step (a dispatch mode slows it down) into ``res``: its seconds,
    DeepSpeed's accounting, the process's RSS and, on CUDA (``held_before`` the bytes an
    earlier engine of this launch left), the allocator's base, peak and reserved bytes."""
    device = engine.device
    if held_before is not None:
        torch.cuda.synchronize(device)
        res.device_base_bytes = torch.cuda.memory_allocated(device) - held_before
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    res.accounting = _train_step(engine, micro, stage, account=True)
    if held_before is not None:
        torch.cuda.synchronize(device)
        res.device_peak_bytes = torch.cuda.max_memory_allocated(device) - held_before
        res.device_reserved_bytes = torch.cuda.max_memory_reserved(device)
    res.step_seconds = time.perf_counter() - start
    res.rss_bytes = _rss_bytes()


def _record_peaks(res: RankResult, tracker: MemoryTracker) -> None:
    """The tracker's device and host peaks, and its CUDA figures, into ``res``."""
    res.peak_bytes, res.by_category = tracker.peak_bytes, tracker.peak_by_category()
    res.host_bytes, res.host_by_category = tracker.host_peak_bytes, tracker.host_peak_by_category()
    res.cuda_stats, res.oom = dict(tracker.cuda_stats), tracker.oom


def zero_rank_step(rank: int, world_size: int, step: StepConfig, steps: int = 2,
                   budget: int | str | None = None, *, torch_adam: bool = True,
                   track: bool = True, ds_config: dict | None = None,
                   model_fn: Callable[[StepConfig], torch.nn.Module] | None = None) -> RankResult:
    """Build a DeepSpeed engine for ``step`` on this rank's device, warm up, then one timed
    step and, with ``track``, one tracked step (peak by category, device and host).

    The device follows the process group (:func:`~memlab.core.hardware.rank_device`), never
    ``torch.cuda.is_available()``: CPU ranks on a GPU machine build on the CPU. Without a
    budget the timed step runs without a tracker: its seconds, DeepSpeed's accounting, on
    CUDA the allocator's base and peak, and the process's RSS.

    Args:
        rank, world_size: this rank of the process group.
        step: the step to run (its ``zero``, ``offload``, ``micro_batches``...).
        steps: steps in all, the last one measured (the first creates Adam's state).
        budget: this rank's bytes (a size or a GPU preset): the warm-up and the tracked step
            then run under a budgeted tracker (which also gives the time and the accounting),
            and an OOM comes back as the result's ``oom`` with the step abandoned.
        torch_adam: torch's AdamW rather than DeepSpeed's compiled CPU Adam.
        track: run the tracked step even without a budget.
        ds_config: a run's own DeepSpeed config (:mod:`memlab.hf.read_run_configs`) instead of
            memlab's; without an optimizer section torch's AdamW is added, as the Trainer
            passes one.
        model_fn: builds the model of ``step`` on this rank (a top-level function or a
            ``functools.partial`` of one: it crosses to the spawned ranks), whose forward takes
            the batch's ``(idx, targets)`` and returns the loss; ``None``: memlab's model.

    Returns:
        The rank's :class:`RankResult`.
    """
    device = rank_device()
    rss_start = _rss_bytes()
    held_before = None
    if device.type == "cuda":  # what an earlier engine of this launch left behind is not this step's
        torch.cuda.synchronize(device)
        held_before = torch.cuda.memory_allocated(device)
    engine, batch, micro = _build_engine(step, rank, torch_adam, ds_config, model_fn)
    budget_bytes = resolve_budget(budget)
    on_cuda = held_before is not None
    # host memory is whatever is not on the engine's device (offloaded master, moments, grads)
    warm = MemoryTracker(budget_bytes, device=engine.device, cuda=on_cuda)
    if budget_bytes is None:
        for _ in range(steps - 1):
            _train_step(engine, micro, step.zero)  # warm-up: Adam's state exists afterwards
    else:
        _tracked_steps(warm, engine, batch, micro, step.zero, steps - 1, False)  # the budget covers it too
    res = RankResult(rank=rank, device=device.type, host_accounts=_host_accounts(step.offload, step.zero),
                     optimizer=type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__,
                     rss_start_bytes=rss_start)
    if budget_bytes is None:
        _timed_step(res, engine, micro, step.zero, held_before)
    if warm.oom is not None:
        _record_peaks(res, warm)
    elif track or budget_bytes is not None:
        tracker = MemoryTracker(budget_bytes, device=engine.device, cuda=on_cuda)
        start = time.perf_counter()
        acc = _tracked_steps(tracker, engine, batch, micro, step.zero, 1, budget_bytes is not None)
        if budget_bytes is not None:
            res.accounting, res.step_seconds = acc, time.perf_counter() - start
        _record_peaks(res, tracker)
        del tracker
    del engine, warm, batch, micro
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()  # the next engine in this launch starts from a clean device
    return res


def _run_config(step, ds_config: dict | None, torch_adam: bool) -> dict:
    """memlab's config of ``step``, or a run's own with an optimizer section."""
    if ds_config is None:
        return deepspeed_config(step, torch_adam=torch_adam)
    default = deepspeed_config(step, torch_adam=torch_adam)["optimizer"]
    return {"optimizer": default, "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10**9, **ds_config}


def zero_worker(rank: int, world_size: int, steps: list, budget: int | None = None, *,
                torch_adam: bool = True, track: bool = True,
                threads: int | None = None, ds_config: dict | None = None,
                model_fn: Callable[[StepConfig], torch.nn.Module] | None = None) -> list[RankResult]:
    """Run each :class:`StepConfig` in ``steps`` with DeepSpeed on this rank, one after
    another in one process group (one launch for several stages saves start-up time);
    ``budget`` and ``model_fn`` as :func:`zero_rank_step`. ``threads``: torch's CPU threads
    in this rank (the host optimizer of offload uses them)."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    if threads:
        torch.set_num_threads(threads)
    import deepspeed
    deepspeed.init_distributed(dist_backend=dist.get_backend() if dist.is_initialized()
                               else default_backend(world_size))
    return [zero_rank_step(rank, world_size, s, budget=budget, torch_adam=torch_adam, track=track,
                           ds_config=ds_config, model_fn=model_fn) for s in steps]


def _rank_report(step: StepConfig, res: RankResult, budget_bytes: int | None = None) -> MemoryReport:
    """One rank's report: the tracker's device peak and host peak (on a GPU, offloaded state
    is host memory), DeepSpeed's exact accounting and, on CUDA, the allocator's figures."""
    rep = MemoryReport("measure", step, res.device, res.peak_bytes, dict(res.by_category or {}),
                       budget_bytes, step_seconds=res.step_seconds, oom=res.oom,
                       host_bytes=res.host_bytes, host_by_category=dict(res.host_by_category))
    if res.accounting is None:  # the step ran out of its budget before accounting
        rep.notes.append(f"rank {res.rank} of {step.world_size}: out of its budget")
        return rep
    acc = dict(res.accounting)
    acc["host_bytes"] = res.host_account_bytes()
    acc["device_bytes"] = res.device_account_bytes()
    if res.device == "cpu":
        # host and device are one memory: what a GPU would hold is the peak less the
        # offloaded accounts (parameters are gathered back for compute, so they stay) and
        # offload's host staging buffer
        acc["device_peak_bytes"] = res.peak_bytes - (
            sum(acc[k] for k in res.host_accounts if k != "parameters") + acc.get("host_staging", 0))
    else:
        acc["device_peak_bytes"] = res.peak_bytes  # the tracker counted the device alone
    acc.update(res.cuda_stats)
    rep.allocator = acc
    add_workspace(rep)
    rep.notes.append(f"rank {res.rank} of {step.world_size}; 'allocator' holds DeepSpeed's "
                     f"exact per-rank accounting (bytes): " + ", ".join(ACCOUNTS))
    if res.host_accounts:
        rep.notes.append("offload: allocator['host_bytes'] are what ZeRO-Offload keeps in CPU "
                         "memory by DeepSpeed's accounting; on a CPU-only machine host and "
                         "device are one memory (the report's host_bytes are 0), so the saving "
                         "is shown by accounting, not by a second memory")
    return rep


def _oom_after_failure(error: RankError, step, device: str, budget_bytes: int | None):
    """The report of a one-step launch in which a rank ran out of its budget and returned,
    and a peer, still inside a collective, lost its connection and failed: the OOM is the
    finding, not the peer's broken pipe. Re-raises ``error`` when no rank reported an OOM."""
    ooms = sorted(r for r, res in error.partial.items() if res[0].oom is not None)
    if not ooms:
        raise error
    per = [_rank_report(step, error.partial[r][0], budget_bytes) for r in ooms]
    rep = MemoryReport("measure", step, device, per[0].peak_bytes, dict(per[0].by_category),
                       budget_bytes, oom=per[0].oom, per_rank=per)
    rep.notes.append(f"rank {ooms[0]} ran out of its budget; rank {error.rank} then failed: "
                     f"{error.detail.splitlines()[0]}")
    return rep


def measure_zero(steps: list, *, device: str | None = "cpu", placement: Placement | None = None,
                 timeout: float = 600.0, budget: int | str | None = None,
                 ds_config: dict | None = None,
                 model_fn: Callable[[StepConfig], torch.nn.Module] | None = None,
                 estimates: list[MemoryReport] | None = None) -> list:
    """Measure several ZeRO configurations in one multi-rank launch.

    All ``steps`` must share ``world_size``. The ranks run where ``placement`` says, else on
    ``device`` (``"cpu"``: gloo ranks; ``"cuda"``: one GPU per rank or an InputError; ``None``:
    :func:`~memlab.core.hardware.place_ranks` decides). Returns one :class:`MemoryReport` per step
    (lens "measure", the peak of rank 0, ``per_rank`` one report per rank). ``budget`` is
    each rank's, enforced in the ranks. Before anything is spawned, every step is checked
    against this host (:func:`memlab.lenses.guard.preflight`, all ranks together): one it cannot hold
    raises :class:`~memlab.core.errors.HostMemoryError`; one whose model states exceed the budget
    comes back ``fits: false`` at phase ``build`` without being run.

    Args:
        steps: the ZeRO configurations, one ``StepConfig`` each, all with one ``world_size``.
        device, placement, timeout, budget: as above.
        ds_config, model_fn: as :func:`zero_rank_step` (a Hugging Face decoder's model:
            :func:`memlab.hf.deepspeed_measure.measure_zero_hf`).
        estimates: one estimate per step for the pre-flight check (a model of ``model_fn``'s,
            which memlab's GPT estimate cannot read); ``None``: memlab's estimate of each.

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
    ests = estimates or [None] * len(steps)
    refused = {i: preflight(s, device, budget_bytes, spawned=True, estimate=e)
               for i, (s, e) in enumerate(zip(steps, ests, strict=True))}
    todo = [s for i, s in enumerate(steps) if refused[i] is None]
    ranks = []
    if todo:
        try:
            ranks = run_ranks(zero_worker, world, kwargs={"steps": todo, "budget": budget_bytes,
                                                          "ds_config": ds_config, "model_fn": model_fn},
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
        per = [_rank_report(s, ranks[r][j], budget_bytes) for r in range(world)]
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
                        timeout: float = 600.0, budget: int | str | None = None,
                        ds_config: dict | None = None, **overrides):
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
                        budget=budget, ds_config=ds_config)[0]


__all__ = ["ACCOUNTS", "RankResult", "measure_distributed", "measure_zero", "track_engine", "zero_accounting",
           "zero_rank_step", "zero_worker"]
