"""Run a function on N ranks, and measure ZeRO's per-rank memory with real DeepSpeed.

:func:`run_ranks` starts ``world_size`` processes (``spawn``), joins them into one
``torch.distributed`` process group (gloo on CPU, NCCL on CUDA) and calls an importable
worker ``fn(rank, world_size, **kwargs)`` in each. A rank that raises, dies or hangs makes
:func:`run_ranks` raise :class:`RankError` naming the rank; every rank is then killed, so a
notebook cell fails cleanly and leaves no processes behind.
"""
from __future__ import annotations

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

REPO = Path(__file__).resolve().parent.parent


class RankError(RuntimeError):
    """A rank raised, died or timed out. ``rank`` is its number, ``detail`` its message."""

    def __init__(self, rank: int | None, detail: str):
        self.rank = rank
        self.detail = detail
        where = f"rank {rank}" if rank is not None else "ranks"
        super().__init__(f"{where} failed: {detail}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    """NCCL when CUDA is available, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


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
        raise ValueError(f"worker {worker!r} must be 'module:function'")
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
        raise ValueError(f"worker {qual or worker!r} must be a top-level function of an "
                         f"importable module (spawned ranks import it)")
    if mod == "__main__" and not getattr(sys.modules["__main__"], "__file__", None):
        raise ValueError(f"worker {qual!r} is defined in a notebook or REPL; spawned ranks "
                         f"cannot import it: put it in a module (e.g. memlab/...) and pass it")


def _die_with_parent() -> None:
    """Linux: the kernel kills this rank if the parent dies, so no rank outlives it."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: the parent's cleanup still kills the ranks
        pass


def _entry(rank: int, world_size: int, worker, kwargs: dict, port: int, backend: str,
           results) -> None:
    """The body of one spawned rank: join the group, run, report, leave the group."""
    _die_with_parent()
    set_dist_env(rank, world_size, port)
    import torch.distributed as dist
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world_size)
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
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


def run_ranks(worker: str | Callable, world_size: int = 2, *, kwargs: dict | None = None,
              timeout: float = 300.0, backend: str | None = None) -> list:
    """Call ``worker(rank, world_size, **kwargs)`` on ``world_size`` spawned ranks.

    ``worker`` is a top-level function of an importable module or a ``"module:function"``
    string; it runs after ``init_process_group`` and returns something picklable. Returns
    the results ordered by rank. Raises :class:`RankError` when a rank raises (with its
    message), exits without a result (killed, ``os._exit``) or the ranks exceed ``timeout``
    seconds; all ranks are killed before it is raised.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    backend = backend or default_backend()
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}; allowed: gloo, nccl")
    if backend == "nccl" and torch.cuda.device_count() < 1:
        raise ValueError("backend='nccl' needs a CUDA GPU; use 'gloo' on CPU")
    _check_importable(worker)
    set_cache_env()  # spawned children inherit it
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, daemon=True,
                         args=(r, world_size, worker, dict(kwargs or {}), port, backend, results))
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
                                           f"result (killed, crashed or os._exit)") from None
                elif time.monotonic() > deadline:
                    pending = [r for r in range(world_size) if r not in out]
                    raise RankError(pending[0], f"timed out after {timeout:g} s "
                                                f"(ranks {pending} still running)") from None
                else:
                    continue
            if not ok:
                raise RankError(rank, value)
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


__all__ = ["RankError", "allreduce_worker", "run_ranks", "default_backend", "set_dist_env", "set_cache_env"]
