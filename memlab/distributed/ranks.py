"""Ranks: run a function on N processes, or simulate one rank without the others.

:func:`run_ranks` starts ``world_size`` processes (``spawn``), joins them into one
``torch.distributed`` process group and calls an importable worker
``fn(rank, world_size, **kwargs)`` in each. Where the ranks run (NCCL with one GPU per rank,
or gloo on the CPU) is decided once, by :func:`memlab.core.hardware.place_ranks`. A rank that
raises, dies or hangs makes :func:`run_ranks` raise :class:`RankError` naming the rank; every
rank is then killed, so a notebook cell fails cleanly and leaves no processes behind.

:func:`fake_process_group` makes this process rank 0 of ``world_size`` ranks on a fake
process group (``torch.testing._internal.distributed.fake_pg``): every collective returns at
once and exchanges nothing. The shapes each rank holds are then those of a real job (sharded
parameters, gathered weights), which is what the simulations of ZeRO-3/FSDP2 and tensor
parallelism track; the values are not (averaged gradients, gathered weights), so it serves
bytes and configs, never losses.
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import pathlib
import queue as queue_mod
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from memlab.core.errors import InputError
from memlab.core.hardware import Placement, place_ranks, visible_gpus
from memlab.core.quiet import build_line, built_ops, in_kernel
from memlab.core.torch_private import FakeStore

REPO = Path(__file__).resolve().parents[2]  # memlab/distributed/ranks.py -> the checkout


class RankError(RuntimeError):
    """A rank raised, died or timed out. ``rank`` is its number, ``detail`` its message,
    ``partial`` the results other ranks had returned by then (rank -> result)."""

    def __init__(self, rank: int | None, detail: str, partial: dict | None = None):
        self.rank = rank
        self.detail = detail
        self.partial = dict(partial or {})
        where = f"rank {rank}" if rank is not None else "ranks"
        super().__init__(f"{where} failed: {detail}")


#: what a rank reports when ``init_process_group`` failed: the group never formed, so nothing
#: ran and the launch can be made again on another port
JOIN_FAILED = "join failed"
#: launches tried when the ranks cannot form their group: the port :func:`_free_port` found
#: free can be taken by another launch (a second test worker, a lesson) before rank 0 binds it,
#: and a rank that reaches the other launch's store sees "Connection closed by peer"
JOIN_TRIES = 2


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_dist_env(rank: int, world_size: int, port: int | None = None) -> None:
    """The environment torch.distributed and DeepSpeed read, for ranks :func:`run_ranks`
    starts on this machine (launchers set it themselves): the rendezvous is always this
    machine's loopback, whatever an earlier launcher left in the environment."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
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
    clear_stale_build_locks(os.environ["TORCH_EXTENSIONS_DIR"])


#: An op's build directory untouched this long while its ``lock`` exists: a dead build's lock.
STALE_BUILD_SECONDS = 600


def clear_stale_build_locks(extensions_dir: str | os.PathLike, idle_seconds: float = STALE_BUILD_SECONDS) -> list[str]:
    """Remove the ``lock`` files that builds killed midway (a timed-out rank, a stopped
    kernel) left in torch's extension cache, where the next build would wait on them forever
    (``torch.utils.file_baton.FileBaton.wait`` polls until the file goes).

    A lock is stale when neither it nor any file of its op's directory changed for
    ``idle_seconds``: a live build writes its objects as it compiles.

    Args:
        extensions_dir: ``TORCH_EXTENSIONS_DIR``.
        idle_seconds: how long a build directory may sit still before its lock counts as dead.

    Returns:
        The paths removed.
    """
    removed = []
    now = time.time()
    for lock in pathlib.Path(extensions_dir).glob("**/lock"):
        try:
            newest = max(f.stat().st_mtime for f in lock.parent.rglob("*"))
        except (OSError, ValueError):
            continue
        if now - newest > idle_seconds:
            lock.unlink(missing_ok=True)
            removed.append(str(lock))
            print(f"memlab: removed {lock}, left by a build that stopped midway", file=sys.stderr)
    return removed


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
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: the parent's cleanup still kills the ranks
        pass


def _entry(rank: int, world_size: int, worker, kwargs: dict, port: int, placement: Placement,
           results, log: str | None = None) -> None:
    """The body of one spawned rank: join the group, run, report, leave the group."""
    _die_with_parent()
    # before anything touches CUDA or imports DeepSpeed: which accelerator this rank has
    os.environ.update(placement.rank_env())
    # Results travel back through the queue; what a rank prints (DeepSpeed's op builds, its
    # config logs, the deprecation warnings its calls into torch raise) goes to the launch's
    # log, which run_ranks shows only when a rank fails: the parent's stdout (``memlab ...
    # --json``) and a lesson's output stay clean. File descriptors, not sys.stdout: the
    # compiler and the linker are subprocesses.
    sys.stdout.flush()
    sys.stderr.flush()
    if log is not None:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, 2)
        os.close(fd)
    os.dup2(2, 1)
    set_dist_env(rank, world_size, port)
    try:
        if placement.backend == "nccl":
            torch.cuda.set_device(placement.device(rank))
        try:
            dist.init_process_group(placement.backend, rank=rank, world_size=world_size)
        except Exception as e:  # the group did not form; the worker has not run (run_ranks retries)
            results.put((rank, JOIN_FAILED, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
            return
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
    """The :class:`~memlab.core.hardware.Placement` for a run: the one given, or one from
    :func:`~memlab.core.hardware.place_ranks` that honours ``backend`` (``"gloo"``/``"nccl"``) or
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
    go where ``placement`` says (default :func:`~memlab.core.hardware.place_ranks`; ``backend``
    ``"gloo"`` asks for CPU ranks). Returns the results ordered by rank. Raises
    :class:`RankError` when a rank raises (with its message), exits without a result
    (killed, ``os._exit``) or the ranks exceed ``timeout`` seconds; all ranks are killed
    before it is raised. When the group does not form (another launch took the port between
    :func:`_free_port` and rank 0's bind), it launches again on a new port, up to
    :data:`JOIN_TRIES` launches, saying so in one line on stderr.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"world_size must be a positive integer, got {world_size!r}")
    if timeout <= 0:
        raise InputError(f"timeout must be positive seconds, got {timeout!r}")
    placement = resolve_placement(world_size, backend=backend, placement=placement)
    _check_importable(worker)
    set_cache_env()  # spawned children inherit it
    kwargs = dict(kwargs or {})
    for _ in range(JOIN_TRIES - 1):
        try:
            return _launch(worker, world_size, kwargs, timeout, placement, last=False)
        except JoinError as e:
            print(f"memlab: the ranks could not form their group ({e.detail.splitlines()[0][:160]}); "
                  f"launching again on another port", file=sys.stderr)
    return _launch(worker, world_size, kwargs, timeout, placement, last=True)


class JoinError(RankError):
    """A rank's ``init_process_group`` failed: the group never formed and no worker ran."""


def _launch(worker: str | Callable, world_size: int, kwargs: dict, timeout: float,
            placement: Placement, last: bool) -> list:
    """One launch of :func:`run_ranks` on a port found free; raises :class:`JoinError` when the
    group does not form (its log is shown only on the ``last`` try)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    log_fd, log = tempfile.mkstemp(prefix="memlab-ranks-", suffix=".log")
    os.close(log_fd)
    built_before, started = built_ops(), time.time()
    procs = [ctx.Process(target=_entry, daemon=True,
                         args=(r, world_size, worker, kwargs, port, placement, results, log))
             for r in range(world_size)]
    out: dict[int, Any] = {}
    ok = False
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
            if ok == JOIN_FAILED:
                raise JoinError(rank, value, out)
            if not ok:
                raise RankError(rank, value, out)
            out[rank] = value
        for p in procs:
            p.join(timeout=30)
        ok = True
    finally:
        _kill(procs)
        results.close()
        results.join_thread()
        # a join that is launched again shows no log: only the last try's failure does
        _report_log(log, ok is True or (ok == JOIN_FAILED and not last), built_before, started)
    return [out[r] for r in range(world_size)]


#: lines of the ranks' log shown when a launch fails (a traceback and what led to it)
LOG_TAIL = 100


def _report_log(log: str, ok: bool, built_before: dict[str, float], started: float) -> None:
    """After a launch: the ranks' log in full when one failed (to stderr), else one line for
    the ops DeepSpeed built (in a notebook on stdout, elsewhere on stderr: ``--json`` stays
    parseable); then the log is removed."""
    try:
        if not ok:
            with open(log, encoding="utf-8", errors="replace") as f:
                text = f.read()
            lines = text.splitlines()
            if lines:
                cut = f" (its last {LOG_TAIL} lines)" if len(lines) > LOG_TAIL else ""
                print(f"the ranks' output{cut}:\n" + "\n".join(lines[-LOG_TAIL:]), file=sys.stderr)
        else:
            line = build_line(built_before, started)
            if line:
                print(line, file=sys.stdout if in_kernel() else sys.stderr)
    finally:
        with contextlib.suppress(OSError):
            os.remove(log)


def allreduce_worker(rank: int, world_size: int, value: float = 1.0) -> dict:
    """The smallest collective: each rank adds ``value * (rank + 1)``; all see the sum."""
    t = torch.tensor([value * (rank + 1)])
    dist.all_reduce(t)
    return {"rank": rank, "world_size": world_size, "backend": dist.get_backend(),
            "sum": t.item(), "pid": os.getpid()}


# --------------------------------------------------------------------------------------
# ZeRO with real DeepSpeed
# --------------------------------------------------------------------------------------


def default_backend(world_size: int = 1) -> str:
    """The backend :func:`~memlab.core.hardware.place_ranks` gives ``world_size`` ranks here: NCCL
    when every rank can have its own GPU, gloo (CPU) otherwise."""
    return place_ranks(world_size).backend


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """This process as rank 0 of ``world_size`` ranks on a fake process group, destroyed on
    exit. Refuses to run inside a job that already has a process group."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"world_size must be a positive integer, got {world_size!r}")
    if dist.is_initialized():
        raise RuntimeError("a process group already exists in this process; a fake one needs "
                           "its own (run the simulation outside a distributed job)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


__all__ = ["JOIN_FAILED", "JOIN_TRIES", "JoinError", "RankError", "allreduce_worker", "default_backend",
           "fake_process_group", "resolve_placement", "run_ranks", "set_cache_env", "set_dist_env"]
