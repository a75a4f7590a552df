"""Run a function on N ranks, and measure ZeRO's per-rank memory with real DeepSpeed.

:func:`run_ranks` starts ``world_size`` processes (``spawn``), joins them into one
``torch.distributed`` process group and calls an importable worker
``fn(rank, world_size, **kwargs)`` in each. Where the ranks run (NCCL with one GPU per rank,
or gloo on the CPU) is decided once, by :func:`memlab.hardware.place_ranks`. A rank that
raises, dies or hangs makes :func:`run_ranks` raise :class:`RankError` naming the rank; every
rank is then killed, so a notebook cell fails cleanly and leaves no processes behind.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import queue as queue_mod
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from .errors import InputError
from .hardware import Placement, place_ranks, rank_device, visible_gpus
# the paper's per-rank formula (re-exported for lesson 06) and memlab's DeepSpeed buckets: one
# source in memlab.states, which the estimate and the advisor read too
from .ranks import default_backend, fake_process_group
from .states import BUCKET_ELEMENTS, PERSISTENCE_THRESHOLD, zero_formula

REPO = Path(__file__).resolve().parent.parent


class RankError(RuntimeError):
    """A rank raised, died or timed out. ``rank`` is its number, ``detail`` its message,
    ``partial`` the results other ranks had returned by then (rank -> result)."""

    def __init__(self, rank: int | None, detail: str, partial: dict | None = None):
        self.rank = rank
        self.detail = detail
        self.partial = dict(partial or {})
        where = f"rank {rank}" if rank is not None else "ranks"
        super().__init__(f"{where} failed: {detail}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_dist_env(rank: int, world_size: int, port: int | None = None) -> None:
    """The environment torch.distributed and DeepSpeed read; launchers set it themselves."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    set_cache_env()


def set_cache_env() -> None:
    """Keep DeepSpeed's JIT-built ops in the project (``.cache/torch_extensions``); run
    DeepSpeed's CPU accelerator when there is no GPU."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _resolve(worker: str | Callable) -> Callable:
    if callable(worker):
        return worker
    module, _, name = worker.partition(":")
    if not module or not name:
        raise InputError(f"worker {worker!r} must be 'module:function'")
    fn = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    return fn


def _check_importable(worker: str | Callable) -> None:
    """Spawned ranks import the worker anew: refuse what they could not import."""
    if isinstance(worker, str):
        _resolve(worker)
        return
    qual = getattr(worker, "__qualname__", "")
    mod = getattr(worker, "__module__", None)
    if "<lambda>" in qual or "<locals>" in qual or mod is None:
        raise InputError(f"worker {qual or worker!r} must be a top-level function of an "
                         f"importable module (spawned ranks import it)")
    if mod == "__main__" and not getattr(sys.modules["__main__"], "__file__", None):
        raise InputError(f"worker {qual!r} is defined in a notebook or REPL; spawned ranks "
                         f"cannot import it: put it in a module (e.g. memlab/...) and pass it")


def _die_with_parent() -> None:
    """Linux: the kernel kills this rank if the parent dies, so no rank outlives it."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: the parent's cleanup still kills the ranks
        pass


def _entry(rank: int, world_size: int, worker, kwargs: dict, port: int, placement: Placement,
           results) -> None:
    """The body of one spawned rank: join the group, run, report, leave the group."""
    _die_with_parent()
    # before anything touches CUDA or imports DeepSpeed: which accelerator this rank has
    os.environ.update(placement.rank_env())
    # Results travel back through the queue; what a rank prints (DeepSpeed's build and
    # config logs) goes to stderr so that the parent's stdout (``memlab ... --json``) stays clean.
    sys.stdout.flush()
    os.dup2(2, 1)
    set_dist_env(rank, world_size, port)
    import torch.distributed as dist
    try:
        if placement.backend == "nccl":
            torch.cuda.set_device(placement.device(rank))
        dist.init_process_group(placement.backend, rank=rank, world_size=world_size)
        out = _resolve(worker)(rank, world_size, **kwargs)
        results.put((rank, True, out))
    except BaseException as e:  # report everything, even SystemExit, to the parent
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _kill(procs) -> None:
    started = [p for p in procs if p.pid is not None]
    for p in started:
        if p.is_alive():
            p.kill()
    for p in started:
        p.join(timeout=5)


def resolve_placement(world_size: int, *, backend: str | None = None, device: str | None = None,
                      placement: Placement | None = None) -> Placement:
    """The :class:`~memlab.hardware.Placement` for a run: the one given, or one from
    :func:`~memlab.hardware.place_ranks` that honours ``backend`` (``"gloo"``/``"nccl"``) or
    ``device`` (``"cpu"``/``"cuda"``; ``None``: whatever the machine has)."""
    if backend is not None and backend not in ("gloo", "nccl"):
        raise InputError(f"backend={backend!r}; allowed: gloo, nccl")
    if device is not None and device not in ("cpu", "cuda"):
        raise InputError(f"device={device!r}; allowed: cpu, cuda")
    if placement is None:
        cpu = backend == "gloo" or device == "cpu"
        placement = place_ranks(world_size, gpus=0 if cpu else None)
        if (backend == "nccl" or device == "cuda") and placement.backend != "nccl":
            raise InputError(f"{world_size} NCCL rank(s) need one CUDA GPU each; torch sees "
                             f"{visible_gpus()}: use CPU ranks (device 'cpu', backend 'gloo') "
                             f"or fewer ranks")
    if placement.world_size != world_size:
        raise InputError(f"the placement is for {placement.world_size} rank(s), not {world_size}")
    if backend is not None and backend != placement.backend:
        raise InputError(f"backend={backend!r} but the placement says {placement.backend!r}")
    return placement


def run_ranks(worker: str | Callable, world_size: int = 2, *, kwargs: dict | None = None,
              timeout: float = 300.0, backend: str | None = None,
              placement: Placement | None = None) -> list:
    """Call ``worker(rank, world_size, **kwargs)`` on ``world_size`` spawned ranks.

    ``worker`` is a top-level function of an importable module or a ``"module:function"``
    string; it runs after ``init_process_group`` and returns something picklable. The ranks
    go where ``placement`` says (default :func:`~memlab.hardware.place_ranks`; ``backend``
    ``"gloo"`` asks for CPU ranks). Returns the results ordered by rank. Raises
    :class:`RankError` when a rank raises (with its message), exits without a result
    (killed, ``os._exit``) or the ranks exceed ``timeout`` seconds; all ranks are killed
    before it is raised.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"world_size must be a positive integer, got {world_size!r}")
    if timeout <= 0:
        raise InputError(f"timeout must be positive seconds, got {timeout!r}")
    placement = resolve_placement(world_size, backend=backend, placement=placement)
    _check_importable(worker)
    set_cache_env()  # spawned children inherit it
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, daemon=True,
                         args=(r, world_size, worker, dict(kwargs or {}), port, placement,
                               results))
             for r in range(world_size)]
    out: dict[int, Any] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in out]
                if dead:
                    # a last look: the rank may have reported just before exiting
                    try:
                        rank, ok, value = results.get(timeout=1.0)
                    except queue_mod.Empty:
                        r = dead[0]
                        raise RankError(r, f"exited with code {procs[r].exitcode} without a "
                                           f"result (killed, crashed, os._exit, or failed to "
                                           f"start: see its stderr)", out) from None
                elif time.monotonic() > deadline:
                    pending = [r for r in range(world_size) if r not in out]
                    raise RankError(pending[0], f"timed out after {timeout:g} s "
                                                f"(ranks {pending} still running)", out) from None
                else:
                    continue
            if not ok:
                raise RankError(rank, value, out)
            out[rank] = value
        for p in procs:
            p.join(timeout=30)
    finally:
        _kill(procs)
        results.close()
        results.join_thread()
    return [out[r] for r in range(world_size)]


def allreduce_worker(rank: int, world_size: int, value: float = 1.0) -> dict:
    """The smallest collective: each rank adds ``value * (rank + 1)``; all see the sum."""
    import torch.distributed as dist
    t = torch.tensor([value * (rank + 1)])
    dist.all_reduce(t)
    return {"rank": rank, "world_size": world_size, "backend": dist.get_backend(),
            "sum": t.item(), "pid": os.getpid()}


# --------------------------------------------------------------------------------------
# ZeRO with real DeepSpeed
# --------------------------------------------------------------------------------------
ACCOUNTS = ("parameters", "gradients", "fp32_master", "optimizer_state", "comm_buffers")


def deepspeed_config(step, *, bucket_elements: int = BUCKET_ELEMENTS,
                     persistence_threshold: int = PERSISTENCE_THRESHOLD,
                     torch_adam: bool = True) -> dict:
    """The DeepSpeed config for ``step`` (a :class:`~memlab.step.StepConfig`).

    Modelled on the seed's config (train_batch_size, gradient_accumulation_steps, fp16/bf16,
    zero_optimization with offload, activation_checkpointing). ``step.batch`` is the batch of
    one rank, so train_batch_size = batch x world_size. Adam runs as ``torch.optim.AdamW``
    (``torch_adam``): no op is compiled, and the state lives where ZeRO puts it.
    ``torch_adam=False`` (offload only) lets DeepSpeed run its compiled ``DeepSpeedCPUAdam``.
    """
    if step.precision not in ("fp32", "bf16"):
        raise InputError(f"precision={step.precision!r} for DeepSpeed here; allowed: fp32, bf16 "
                         f"(fp16 loss scaling is not supported by DeepSpeed's CPU accelerator)")
    if step.optimizer != "adamw":
        raise InputError(f"optimizer={step.optimizer!r} for DeepSpeed here; allowed: adamw")
    if step.offload == "all" and step.zero != 3:
        raise InputError(f"offload='all' (parameters too) needs ZeRO stage 3, got stage {step.zero}")
    if step.offload == "optimizer" and step.zero == 0:
        raise InputError("offload='optimizer' needs ZeRO stage 1-3, got stage 0")
    if bucket_elements < 1:
        raise InputError(f"bucket_elements must be positive, got {bucket_elements}")
    if not torch_adam and step.offload == "none":
        raise InputError("torch_adam=False selects DeepSpeedCPUAdam, which runs on the host: "
                         "it needs offload='optimizer' or 'all'")
    zero: dict[str, Any] = {"stage": step.zero, "reduce_bucket_size": bucket_elements,
                            "allgather_bucket_size": bucket_elements,
                            "contiguous_gradients": True, "overlap_comm": False}
    if step.zero == 3:
        zero.update(stage3_prefetch_bucket_size=bucket_elements,
                    stage3_param_persistence_threshold=persistence_threshold,
                    stage3_max_live_parameters=4 * bucket_elements,
                    stage3_max_reuse_distance=4 * bucket_elements)
    if step.offload in ("optimizer", "all"):
        zero["offload_optimizer"] = {"device": "cpu"}
    if step.offload == "all":
        zero["offload_param"] = {"device": "cpu"}
    cfg = {
        "train_batch_size": step.batch * step.world_size,
        "train_micro_batch_size_per_gpu": step.batch // step.micro_batches,
        "gradient_accumulation_steps": step.micro_batches,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": torch_adam}},
        "fp16": {"enabled": False},
        "bf16": {"enabled": step.precision == "bf16"},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if step.model_config.checkpointing != "none":
        cfg["activation_checkpointing"] = {"partition_activations": step.zero == 3,
                                           "contiguous_memory_optimization": False}
    return cfg


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


def _rss_bytes() -> int | None:
    """Resident bytes of this process (host memory as the OS sees it), if psutil is there."""
    try:
        import psutil
    except ImportError:
        return None
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
    import gc
    import deepspeed
    from .hardware import resolve_budget
    from .step import build_trainer, make_batch
    from .tracking import MemoryTracker

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
    import logging
    import warnings
    import torch.distributed as dist
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
    from .measure import add_workspace
    from .step import MemoryReport
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
    from .step import MemoryReport
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
    """
    from .guard import preflight
    from .hardware import resolve_budget
    from .step import MemoryReport
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
    each rank's, enforced in the ranks; ranks are placed as in :func:`measure_zero`."""
    from .step import StepConfig
    from dataclasses import replace
    step = step or StepConfig()
    step = replace(step, **overrides) if overrides else step
    return measure_zero([step], device=device, placement=placement, timeout=timeout,
                        budget=budget)[0]


# --------------------------------------------------------------------------------------
# Offload: what leaves the device, and what it costs
# --------------------------------------------------------------------------------------
OFFLOAD_CASES = ((2, "none"), (2, "optimizer"), (3, "all"))


def cpu_adam_buildable() -> tuple[bool, str]:
    """Whether DeepSpeed can JIT-compile its ``DeepSpeedCPUAdam`` op here (a C++ compiler
    and ninja), and why not."""
    import shutil
    from torch.utils.cpp_extension import is_ninja_available
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return False, f"no C++ compiler ({cxx!r} is not on PATH)"
    if not is_ninja_available():
        return False, "ninja is not installed"
    return True, f"{cxx} and ninja found"


def measure_offload(step, *, cases=OFFLOAD_CASES, placement: Placement | None = None,
                    cpu_adam: bool = False, timeout: float = 900.0) -> list[dict]:
    """ZeRO with and without offload, one row per ``(stage, offload)`` case, in one launch.

    On CUDA ranks the device figures are the caching allocator's: ``device_peak_bytes`` is
    ``max_memory_allocated`` over the timed step (run without the tracker),
    ``device_base_bytes`` what the engine held before it. On CPU ranks host and device are
    one memory: the device peak is the tracked peak less what ZeRO-Offload keeps on the host,
    the base the model states DeepSpeed keeps on the device (``source`` says which). Both
    give ``host_bytes`` (DeepSpeed's accounting of the offloaded fp32 master, Adam's state,
    the fp32 gradient partition and, with ``"all"``, the parameters), how much the process's
    resident memory grew while the engine was built and run (``rss_growth_bytes``, psutil) and the step time. ``cpu_adam``
    runs the offloaded optimizer as DeepSpeed's compiled ``DeepSpeedCPUAdam`` instead of
    torch's AdamW (offload cases only). Rows are rank 0's.
    """
    from dataclasses import replace
    placement = placement or place_ranks(step.world_size)
    steps = []
    for zero, offload in cases:
        s = replace(step, zero=zero, offload=offload, world_size=placement.world_size)
        deepspeed_config(s, torch_adam=not cpu_adam)  # validate before spawning anything
        steps.append(s)
    on_cuda = placement.device_type == "cuda"
    threads = max(1, (os.cpu_count() or 1) // placement.world_size) if on_cuda else None
    ranks = run_ranks(zero_worker, placement.world_size, placement=placement, timeout=timeout,
                      kwargs={"steps": steps, "torch_adam": not cpu_adam, "track": not on_cuda,
                              "threads": threads})
    rows = []
    for s, res in zip(steps, ranks[0]):
        acc = res["accounting"]
        host = sum(acc[k] for k in res["host_accounts"])
        if on_cuda:
            peak, base, source = res["device_peak_bytes"], res["device_base_bytes"], "allocator"
        else:
            # parameters offloaded at stage 3 are gathered to the device for each layer: the
            # tracker saw them there, so only the optimizer side leaves the device's count
            peak = res["peak_bytes"] - sum(acc[k] for k in res["host_accounts"] if k != "parameters")
            base = sum(acc[k] for k in ACCOUNTS if k not in res["host_accounts"])
            source = "accounting"
        rss = (res["rss_bytes"] - res["rss_start_bytes"]) if res["rss_bytes"] is not None else None
        rows.append({"zero": s.zero, "offload": s.offload, "optimizer": res["optimizer"],
                     "device": placement.device_type, "source": source,
                     "device_peak_bytes": peak, "device_base_bytes": base, "host_bytes": host,
                     "rss_growth_bytes": rss, "step_seconds": res["step_seconds"],
                     "accounting": dict(acc)})
    return rows


# --------------------------------------------------------------------------------------
# Per-rank memory without the ranks: FSDP2 on a fake process group and fake tensors
# --------------------------------------------------------------------------------------
SHARDED_PRECISIONS = ("fp32", "bf16")


def _fsdp_kwargs(step) -> dict:
    """``fully_shard`` options for ``step``'s precision. bf16 is FSDP2's own mixed precision
    (``MixedPrecisionPolicy``): fp32 sharded parameters (the master copy), gathered and
    computed in bf16 with no autocast, gradients reduce-scattered in fp32 - the 16-bit
    compute and sharded fp32 master of DeepSpeed's bf16 ZeRO-3, with the fp32 weights counted
    as parameters (DeepSpeed keeps bf16 weights and counts its fp32 copy as optimizer state)."""
    if step.precision not in SHARDED_PRECISIONS:
        raise InputError(f"precision={step.precision!r} for a sharded simulation; allowed: "
                         f"{', '.join(SHARDED_PRECISIONS)}")
    if step.precision == "fp32":
        return {}
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                              reduce_dtype=torch.float32)}


def _fsdp_tracked_step(step, mesh, mode=None) -> "MemoryTracker":
    """Shard each block and the root with FSDP2 ``fully_shard`` (= ZeRO-3: parameters,
    gradients and optimizer state sharded), warm up, then track one step.

    An untied embedding is its own FSDP unit, so its gathered weight lives only around its
    forward and backward rather than the whole step. Under fake tensors (``mode``) the model
    is built on the meta device and sharded there (splitting meta tensors is cheap; splitting
    fake ones in 64 costs seconds per layer), then materialised as fake tensors. The warm-up
    creates the optimizer state from zero gradients and runs FSDP's lazy set-up on a
    one-token forward: the tracked step is in steady state without a whole step before it.
    """
    from torch.distributed.fsdp import fully_shard
    from .step import make_batch
    from .models import GPTConfig, build_model

    cfg = step.model_config
    kw = _fsdp_kwargs(step)
    real_batch = make_batch(step, "cpu")
    torch.manual_seed(0)
    with torch.device("meta" if mode is not None else "cpu"):
        model = build_model(cfg)
    if isinstance(cfg, GPTConfig) and not cfg.tie_embeddings:
        fully_shard(model.wte, mesh=mesh, **kw)
    for block in getattr(model, "blocks", []):
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    with mode if mode is not None else contextlib.nullcontext():
        if mode is not None:
            model.to_empty(device="cpu")
        # fused, as build_optimizer: no per-parameter temporaries in the optimizer step
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        batch = tuple(mode.from_tensor(b) for b in real_batch) if mode else real_batch
        with torch.no_grad():
            model(*(t[:1, :1] for t in batch))

        def one_step() -> None:
            for micro in zip(*(t.chunk(step.micro_batches) for t in batch)):
                loss = model(*micro) / step.micro_batches
                loss.backward()
                del loss
            opt.step()
            opt.zero_grad(set_to_none=True)

        tracker = _FSDPTracker(model, opt)
        with tracker:
            one_step()
    return tracker


# FSDP2 frees gathered parameters with ``untyped_storage().resize_(0)``, which no dispatch
# mode sees; torch's FSDPMemTracker follows those resizes. Its categories map onto ours:
_FSDP_CATEGORIES = {"Sharded Param": "parameters", "Sharded Grad": "gradients",
                    "OptState": "optimizer", "Activation": "activations",
                    "Unsharded Param": "temporaries", "Unsharded Grad": "temporaries",
                    "All Gather": "temporaries", "Reduce Scatter": "temporaries",
                    "Temp": "temporaries", "Inputs": "other", "Buffer": "other"}


def _fast_fsdp_tracker() -> type:
    """FSDPMemTracker without its bookkeeping on ``prim.device``: a device query allocates
    nothing, and under fake tensors it is half of all dispatched calls."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    device_query = torch.ops.prim.device.default

    class Tracker(FSDPMemTracker):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is device_query:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    return Tracker


class _FSDPTracker:
    """FSDPMemTracker around one step, read out as ``peak_bytes`` and ``peak_by_category``.
    Gathered parameters and gradients and the collectives' buffers count as temporaries."""

    def __init__(self, model, opt):
        self._t = _fast_fsdp_tracker()(mod=model, optm=opt)
        self.peak_bytes = 0
        self._cats: dict[str, int] = {}

    def __enter__(self):
        self._t.__enter__()
        self._t.reset_mod_stats()
        return self

    def __exit__(self, *exc):
        self._t.__exit__(*exc)
        from .tracking import CATEGORIES
        snap = next(iter(self._t.get_tracker_snapshot("peak").values()))
        self._cats = dict.fromkeys(CATEGORIES, 0)
        for key, value in snap.items():
            name = getattr(key, "value", key)
            if name != "Total":
                self._cats[_FSDP_CATEGORIES.get(name, "other")] += value
        self.peak_bytes = snap.get("Total", sum(self._cats.values()))

    def peak_by_category(self) -> dict[str, int]:
        return dict(self._cats)


def fsdp_worker(rank: int, world_size: int, step) -> dict:
    """A real FSDP2 step on this rank (the check for :func:`simulate_sharded`)."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,))
    t = _fsdp_tracked_step(step, mesh)
    return {"rank": rank, "peak_bytes": t.peak_bytes, "by_category": t.peak_by_category()}


def simulate_sharded(step=None, world_size: int | None = None, *, budget=None, **overrides):
    """Per-rank memory of a fully sharded step on ``world_size`` ranks, in this process.

    A fake process group (backend ``"fake"``: collectives return at once) and fake tensors
    run FSDP2 ``fully_shard`` as rank 0; FSDP2's full sharding is ZeRO stage 3 (parameters,
    gradients and optimizer state each 1/N per rank). Shards are padded to equal size, so
    every rank holds what rank 0 holds. No fp32 master copy exists in fp32 training (FSDP2
    updates the sharded parameters in place), where DeepSpeed keeps one; ``precision="bf16"``
    is FSDP2's mixed precision (see :func:`_fsdp_kwargs`). Nothing of the model is
    allocated: llama-3-70b over 64 ranks at 8192 tokens runs on a laptop
    (``benchmarks/scale.py`` times it). Against real gloo ranks (``fsdp_worker``) the fp32
    and the checkpointed bf16 steps agree to the byte; a bf16 step without checkpointing ran
    5% higher on real ranks (a 2-layer toy: one block's fp32 reduce-scatter input lived
    longer there), a difference in collective timing the fake group does not have. Returns a
    :class:`MemoryReport` (lens "simulate") with ``per_rank``.
    """
    from dataclasses import replace
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from .hardware import resolve_budget
    from .step import MemoryReport, StepConfig

    step = step or StepConfig()
    world_size = world_size or step.world_size
    step = replace(step, world_size=world_size, zero=3, **overrides)
    _fsdp_kwargs(step)  # validates the precision
    budget_bytes = resolve_budget(budget)
    with fake_process_group(world_size):
        mesh = init_device_mesh("cpu", (world_size,))  # outside fake mode: it reads ranks
        start = time.perf_counter()
        # real inputs: to_empty (meta -> fake) and the batch meet the mode from outside
        tracker = _fsdp_tracked_step(step, mesh, FakeTensorMode(allow_non_fake_inputs=True))
        seconds = time.perf_counter() - start
    one = MemoryReport("simulate", step, "cpu", tracker.peak_bytes, tracker.peak_by_category(),
                       budget_bytes, seconds)
    rep = MemoryReport("simulate", step, "cpu", one.peak_bytes, dict(one.by_category),
                       budget_bytes, seconds, per_rank=[one] * world_size)
    rep.notes.append(f"FSDP2 fully_shard (= ZeRO-3) on a fake {world_size}-rank process group; "
                     f"ranks hold equal padded shards")
    if step.precision == "bf16":
        rep.notes.append("bf16: FSDP2 MixedPrecisionPolicy (fp32 sharded parameters, bf16 "
                         "gathered weights and compute, fp32 gradient reduce-scatter)")
    return rep


__all__ = ["RankError", "allreduce_worker", "deepspeed_config",
           "zero_accounting", "zero_worker", "zero_rank_step", "measure_zero", "measure_distributed",
           "ACCOUNTS", "zero_formula", "simulate_sharded", "fsdp_worker", "run_ranks",
           "resolve_placement", "default_backend", "set_dist_env", "set_cache_env",
           "OFFLOAD_CASES", "measure_offload", "cpu_adam_buildable"]
