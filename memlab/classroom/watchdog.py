"""A watchdog for notebook kernels: a cell whose kernel sits idle with no reply is reported in
one line and its notebook retried once in a fresh kernel, never waited out in silence.

A notebook runs cell by cell (``nbclient``'s ``execute_cell``; nbval's own loop in ``make
test``). Each cell is a request on the shell channel: the kernel goes busy on IOPub, runs the
code, sends its ``execute_reply`` and goes idle. When a message between client and kernel is
missed (the reply sitting unread in nbclient's shell socket after the event loop missed its
wake-up, what ``tools/notebook_soak.py`` caught: docs/make.md; ipykernel 7's shell ROUTER stranding
a request, ipykernel#1554; a widget cell waiting on a comm reply a headless client never sends),
the client waits for the whole cell timeout, and with nbclient's ``interrupt_on_timeout`` for
ever where the reply is truly lost (an interrupt of an idle kernel answers nothing).
:func:`memlab.classroom.collect.run_watched` reads in one-second slices, each ending in a plain poll of
the socket, so a missed wake-up costs a second; a lost message costs the bound below.

:class:`StallWatch` tells such a wait from a slow cell: no message for the request (IOPub
status, output or the reply) for ``bound`` seconds while the kernel and every process under
it used under :data:`IDLE_CPU_SHARE` of one core. A cell that computes, or whose ranks compute,
is never a stall, however long it runs; the cell timeout still bounds it.
"""
from __future__ import annotations

import pathlib
import re
import time
from dataclasses import dataclass, field
from typing import Callable

import psutil

#: seconds with no message and an idle kernel before a cell is called stalled: a lesson cell
#: on 2 shared cores prints, draws or finishes well within this, or keeps its kernel busy
STALL_SECONDS = 60.0
#: below this share of one core (kernel and children together) the kernel is idle
IDLE_CPU_SHARE = 0.05
#: a gap longer than this between two checks (the waits check about once a second) means the
#: watcher itself was stopped (``Ctrl-Z`` then ``fg``, a ``SIGSTOP``ped job): the kernel was
#: stopped too, so its silence then is no stall, and the wait starts again
SUSPENDED_SECONDS = 10.0


def tree_cpu_seconds(pid: int | None) -> float | None:
    """CPU seconds (user + system) of process ``pid`` and every process under it, or None
    when it cannot be read (no such process).

    Each process's reaped children count too (``children_user``/``children_system``): a rank's
    op build runs compilers that end one by one, and a sum over the live processes alone drops
    a finished compiler's minutes, so a busy tree read as idle (a notebook stalled so in a fresh
    clone's ``make site``, while DeepSpeed built its ``deepspeed_shm_comm`` op)."""
    if pid is None:
        return None
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return None
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:   # a child that ended between the listing and the read
            continue
    return total


def kernel_state(pid: int | None) -> str:
    """What the kernel process is doing, in words: its OS state and its threads' states."""
    if pid is None:
        return "kernel process unknown"
    try:
        p = psutil.Process(pid)
        status, threads = p.status(), p.num_threads()
    except psutil.Error:
        return f"kernel pid {pid} gone"
    return f"kernel pid {pid} {status}, {threads} threads, {tree_cpu_seconds(pid) or 0:.1f} s CPU in all"


@dataclass
class Stall:
    """One stalled cell: where, how long, and what the kernel was doing."""

    notebook: str
    cell: int          # the cell's index in the notebook
    waited: float      # seconds since the last message for the request (or since it was sent)
    phase: str         # what the request got: "never went busy", "busy, then silent", ...
    kernel: str        # :func:`kernel_state`

    def line(self) -> str:
        """The one-line report."""
        return (f"watchdog: {self.notebook} cell {self.cell}: no reply for {self.waited:.0f} s and the "
                f"kernel idle ({self.phase}; {self.kernel})")


class KernelStalled(RuntimeError):
    """A cell's request got no reply while its kernel sat idle (:class:`Stall`)."""

    def __init__(self, stall: Stall):
        super().__init__(stall.line())
        self.stall = stall


@dataclass
class StallWatch:
    """The watchdog's view of one cell's request.

    Call :meth:`start` as the request goes out, :meth:`saw` with each message for it, and
    :meth:`check` while waiting (about once a second): it returns a :class:`Stall` once nothing
    came for ``bound`` seconds while the kernel tree used under ``IDLE_CPU_SHARE`` of a core. A
    gap of over ``SUSPENDED_SECONDS`` between two checks starts the wait again.
    """

    bound: float = STALL_SECONDS
    pid: int | None = None
    notebook: str = ""
    clock: Callable[[], float] = time.monotonic
    cpu: Callable[[int | None], float | None] = tree_cpu_seconds
    cell: int = -1
    phase: str = "never went busy"
    _last: float = field(default=0.0, repr=False)
    _cpu_at_last: float | None = field(default=None, repr=False)
    _checked: float | None = field(default=None, repr=False)

    def start(self, cell: int) -> None:
        """A new request, for the cell at index ``cell``, goes out now."""
        self.cell, self.phase = cell, "never went busy"
        self._mark()
        self._checked = self._last

    def _mark(self) -> None:
        self._last, self._cpu_at_last = self.clock(), self.cpu(self.pid)

    def saw(self, msg: dict) -> None:
        """A message for the request arrived (IOPub or the shell reply)."""
        kind = msg.get("msg_type", "")
        if kind == "status":
            state = msg.get("content", {}).get("execution_state")
            self.phase = ("busy, then silent" if state == "busy"
                          else "went idle, its execute_reply never came" if state == "idle" else self.phase)
        elif kind == "execute_reply":
            self.phase = "replied"
        elif self.phase != "went idle, its execute_reply never came":
            self.phase = f"busy, last sent {kind}, then silent"
        self._mark()

    def check(self) -> Stall | None:
        """A :class:`Stall` when the request has waited ``bound`` seconds with an idle kernel."""
        if self.cell < 0:   # no cell started (the kernel_info wait before the first)
            return None
        now, checked = self.clock(), self._checked
        self._checked = now
        if checked is not None and now - checked > SUSPENDED_SECONDS:
            self._mark()   # the watcher was stopped, and the kernel with it: wait afresh
            return None
        waited = now - self._last
        if waited < self.bound:
            return None
        cpu = self.cpu(self.pid)
        if cpu is not None and self._cpu_at_last is not None and cpu - self._cpu_at_last > IDLE_CPU_SHARE * waited:
            self._mark()   # the kernel (or its ranks) computes: a slow cell, not a lost message
            return None
        return Stall(self.notebook, self.cell, waited, self.phase, kernel_state(self.pid))


def kernel_pid(km) -> int | None:
    """The kernel's process id from a jupyter_client kernel manager (a local kernel), or None."""
    process = getattr(getattr(km, "provisioner", None), "process", None)
    return getattr(process, "pid", None)


BOUNDS_FILE = pathlib.Path(__file__).resolve().parents[1] / "data" / "notebook_bounds.txt"
BOUND_LINE = re.compile(r"^(\w+)\s+(\d+(?:\.\d+)?)\s*(?:#.*)?$")


def notebook_bounds(path: str | pathlib.Path = BOUNDS_FILE) -> dict[str, float]:
    """Seconds each notebook may take on 2 cores, by stem (``memlab/data/notebook_bounds.txt``:
    ``NN_name SECONDS`` lines, ``#`` comments)."""
    return {m.group(1): float(m.group(2))
            for m in map(BOUND_LINE.match, pathlib.Path(path).read_text(encoding="utf-8").splitlines()) if m}


def over_bound(stem: str, seconds: float, bounds: dict[str, float] | None = None) -> str | None:
    """A line naming ``stem`` when its run of ``seconds`` is over its bound; None when within
    it or when the notebook has no bound (a notebook that is not a lesson)."""
    bound = (notebook_bounds() if bounds is None else bounds).get(stem)
    if bound is None or seconds <= bound:
        return None
    return f"slow: {stem} took {seconds:.0f} s, over its bound of {bound:.0f} s on 2 cores ({BOUNDS_FILE.name})"
