"""The notebook watchdog (memlab.classroom.watchdog) for nbval: a pytest plugin.

notebooks/conftest.py registers it, so ``make test``'s nbval runs and ``make gpu-check``'s (one
pytest per notebook under notebooks/) have it; elsewhere ``pytest -p nbval_watchdog --nbval``
with tools/ on the path. nbval waits for a cell's ``execute_reply`` on the shell channel for the
whole ``--nbval-cell-timeout``; here that wait goes in one-second slices, reading IOPub between
them (kept for nbval, which reads it next) to see whether the kernel went busy or idle. A cell
whose kernel sits idle with no message for ``MEMLAB_STALL_SECONDS`` (default
:data:`memlab.classroom.watchdog.STALL_SECONDS`) is reported in one line on stderr and in the cell's
report; the kernel restarts, the notebook's earlier cells run again in it and the cell is
retried, once per notebook. A second stall fails the cell with the line as its message.
"""
from __future__ import annotations

import os
import pathlib
import sys
import time
from queue import Empty

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from memlab.classroom.watchdog import STALL_SECONDS, KernelStalled, StallWatch, kernel_pid  # noqa: E402


def stall_seconds() -> float:
    """The bound: ``MEMLAB_STALL_SECONDS`` if set, else the watchdog's default."""
    return float(os.environ.get("MEMLAB_STALL_SECONDS", STALL_SECONDS))


def watch_kernel(kernel, notebook: str) -> None:
    """Make nbval's ``RunningKernel`` wait for replies under a :class:`StallWatch` (once)."""
    if getattr(kernel, "_memlab_watch", None) is not None:
        return
    watch = StallWatch(stall_seconds(), notebook=notebook)
    kernel._memlab_watch = watch
    buffered: list[dict] = []   # IOPub read while waiting: nbval reads it after the reply
    get_message = kernel.get_message

    def watched_get_message(stream, timeout=None):
        if stream == "iopub" and buffered:
            return buffered.pop(0)
        return get_message(stream, timeout=timeout)

    def watched_await_reply(msg_id, timeout=None):
        watch.pid = kernel_pid(kernel.km)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                msg = get_message("shell", timeout=1.0)
            except Empty:
                while True:   # what IOPub said meanwhile: did the kernel go busy, or idle?
                    try:
                        seen = get_message("iopub", timeout=0)
                    except Empty:
                        break
                    buffered.append(seen)
                    if seen["parent_header"].get("msg_id") == msg_id:
                        watch.saw(seen)
                stall = watch.check()
                if stall is not None:
                    raise KernelStalled(stall) from None
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                if msg["content"]["status"] == "aborted":
                    raise RuntimeError("Kernel aborted execution request")
                return

    def execute_cell_input(cell_input, allow_stdin=None):
        msg_id = execute(cell_input, allow_stdin=allow_stdin)
        watch.start(watch.cell)
        return msg_id

    execute = kernel.execute_cell_input
    kernel.get_message = watched_get_message
    kernel.await_reply = watched_await_reply
    kernel.execute_cell_input = execute_cell_input
    kernel._memlab_buffered = buffered


def replay(item, kernel, cell_timeout: float) -> None:
    """Restart ``kernel`` and run the notebook's cells before ``item`` in it again."""
    kernel._memlab_buffered.clear()
    kernel.restart()
    kernel.kc.wait_for_ready(timeout=60)
    kernel._memlab_buffered.clear()
    earlier = [it for it in item.session.items if it.parent is item.parent
               and getattr(it, "cell_num", 1 << 30) < item.cell_num and not it.options.get("skip")]
    for it in earlier:
        kernel._memlab_watch.cell = it.cell_num
        msg_id = kernel.execute_cell_input(it.cell.source, allow_stdin=False)
        kernel.await_reply(msg_id, timeout=cell_timeout)
        kernel.await_idle(msg_id, 5)


def report(item, line: str) -> None:
    """The watchdog's line: on the terminal now (no terminal in an xdist worker) and in the
    cell's report, which the closing summary lists."""
    terminal = item.config.pluginmanager.get_plugin("terminalreporter")
    capture = item.config.pluginmanager.get_plugin("capturemanager")
    if terminal is not None and capture is not None:
        with capture.global_and_fixture_disabled():   # the test's capture holds the terminal's fd
            terminal.write_line(line)
    item.add_report_section("call", "watchdog", line)


SEEN: list[str] = []   # the watchdog's lines of this session's reports (xdist's too)


def pytest_runtest_logreport(report) -> None:
    if report.when == "call":   # (the teardown's report repeats the call's sections)
        SEEN.extend(text for title, text in report.sections if "watchdog" in title)


def pytest_terminal_summary(terminalreporter) -> None:
    if SEEN:
        terminalreporter.section("notebook watchdog")
        for line in SEEN:
            terminalreporter.write_line(line)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    kernel = getattr(getattr(item, "parent", None), "kernel", None)
    if kernel is None or not hasattr(item, "cell_num") or not hasattr(kernel, "await_reply"):
        return (yield)   # not an nbval cell
    watch_kernel(kernel, pathlib.Path(str(item.parent.fspath)).name)
    kernel._memlab_watch.cell = item.cell_num
    try:
        return (yield)
    except KernelStalled as e:
        if getattr(item.parent, "_memlab_retried", False):
            report(item, f"{e.stall.line()}; gave up")
            item.raise_cell_error(e.stall.line())
        item.parent._memlab_retried = True
        report(item, f"{e.stall.line()}; retrying the notebook in a fresh kernel")
        kernel._memlab_watch.cell = item.cell_num
        try:
            replay(item, kernel, float(item.config.option.nbval_cell_timeout))
            kernel._memlab_watch.cell = item.cell_num
            return item.runtest()
        except KernelStalled as again:
            report(item, f"{again.stall.line()}; gave up")
            item.raise_cell_error(again.stall.line())
