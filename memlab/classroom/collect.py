"""Collect a class's results: run submitted student notebooks headless, record every checker;
and time a lesson for a class plan (:func:`lesson_time`, ``course/two-day-plan.md``).

    memlab class collect SUBMITTED/ --out results.csv       # also writes results.md
    python -m memlab.classroom.collect SUBMITTED/ --out results.csv
    python tools/class_minutes.py                           # the plan's minutes per lesson

``SUBMITTED/<student>/.../NN_name.ipynb`` (nbgrader's ``submitted/<student>/<assignment>/``
layout works as is); a notebook directly in ``SUBMITTED/`` is filed under student ``-``. Each
notebook runs top to bottom in a fresh ``python3`` kernel (nbclient), one cell at a time with
a per-cell timeout; an error or a timeout in one cell does not stop the next, so every checker
cell (a code cell calling ``exercises.check_...``, after a "Your turn" cell) runs and is
recorded: ``pass`` with the checker's ``PASSED`` line, or ``fail`` with its message
(``CheckFailed``, or the error the learner's empty or broken cell left, e.g. a ``NameError``).
Notebooks run one at a time (20-60 s each on a CPU), so a class of 30 takes hours: collect
after the session, overnight; in class the learners self-check with the same checkers. A cell
whose kernel sits idle with no reply (a lost message: :mod:`memlab.classroom.watchdog`) is reported in one
line and the notebook run again in a fresh kernel, once; a notebook over its bound on 2 cores
(``memlab/data/notebook_bounds.txt``) is named after its results.

Why not nbgrader: 0.9.6 installs beside JupyterLab 4 (``jupyterlab<5,>=4.2``), but grades only
cells carrying its own metadata (``nbgrader.grade_id``, points) and keeps a gradebook
database; our checkers already say what is wrong, so a CSV is all a class needs.
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import pathlib
import re
import sys
import time
from dataclasses import dataclass
from queue import Empty
from typing import Any, Callable

from memlab.classroom.watchdog import STALL_SECONDS, KernelStalled, Stall, StallWatch, kernel_pid, over_bound
from memlab.core.errors import InputError

CHECKER = re.compile(r"\bexercises\.check_\w+\s*\(")
HEADING = re.compile(r"^#+\s*(.+)$", re.M)
ANSI = re.compile(r"\x1b\[[0-9;]*m")
FIELDS = ("student", "notebook", "exercise", "result", "message")


@dataclass
class Result:
    """One checked exercise of one learner."""

    student: str
    notebook: str
    exercise: str
    result: str     # "pass" or "fail"
    message: str


def checker_cells(nb: dict) -> list[tuple[int, str]]:
    """(cell index, exercise title) of every checker cell; the title is the last markdown
    heading above it ("Your turn: ...")."""
    found, title = [], "exercise"
    for i, cell in enumerate(nb["cells"]):
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell["cell_type"] == "markdown":
            heads = HEADING.findall(src)
            if heads:
                title = heads[-1].strip()
        elif cell["cell_type"] == "code" and CHECKER.search(src):
            found.append((i, title))
    return found


def cell_outcome(cell) -> tuple[str, str]:
    """("pass" | "fail", message) from an executed cell's outputs."""
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return "fail", ANSI.sub("", f"{out['ename']}: {out['evalue']}").strip()
    # the checker's result is displayed (text/plain) or printed; stderr is the libraries' noise
    # (DeepSpeed's op build, warnings), never the verdict
    lines = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            text = out.get("text", "") if out.get("name") == "stdout" else ""
        else:
            text = out.get("data", {}).get("text/plain", "")
        lines += [line.strip() for line in text.splitlines() if line.strip()]
    return "pass", next((line for line in lines if line.startswith("PASSED")), lines[0] if lines else "passed")


@dataclass
class NotebookRun:
    """A notebook run: the executed notebook, its wall time and the stalls the watchdog met."""

    nb: Any
    seconds: float
    stalls: list[Stall]


def run_notebook(path: pathlib.Path, cell_timeout: float = 600.0,
                 after_cell: Callable[[Any, Any], None] | None = None,
                 stall_seconds: float = STALL_SECONDS) -> Any:
    """Execute ``path`` in a fresh kernel, cell by cell; returns the executed notebook
    (:func:`run_watched`'s ``nb``)."""
    return run_watched(path, cell_timeout, after_cell, stall_seconds).nb


def run_watched(path: pathlib.Path, cell_timeout: float = 600.0,
                after_cell: Callable[[Any, Any], None] | None = None,
                stall_seconds: float = STALL_SECONDS, retries: int = 1) -> NotebookRun:
    """Execute ``path`` in a fresh kernel, cell by cell, under the watchdog.

    A cell that errs or runs over ``cell_timeout`` is recorded and the next one runs. A cell
    whose kernel sits idle with no reply for ``stall_seconds`` (:class:`memlab.classroom.watchdog.StallWatch`)
    is reported in one line on stderr and the notebook runs again from the top in a fresh kernel,
    up to ``retries`` times; the last try records the stall as that cell's error and leaves the
    cells after it unrun.

    Args:
        path: the notebook.
        cell_timeout: seconds a cell may run (nbclient interrupts it then).
        after_cell: ``after_cell(client, cell)`` runs after each code cell with the nbclient
            ``NotebookClient`` (the site reads each panel's widget state there); on a retry it
            sees the cells again.
        stall_seconds: the watchdog's bound.
        retries: fresh-kernel runs after a stall.

    Returns:
        The executed notebook, the wall time of every try together, and each stall.
    """
    start, stalls = time.perf_counter(), []
    for attempt in range(retries + 1):
        last = attempt == retries
        try:
            nb = _run_once(path, cell_timeout, after_cell, stall_seconds, record_stall=last)
        except KernelStalled as e:
            stalls.append(e.stall)
            print(f"{e.stall.line()}; retrying in a fresh kernel", file=sys.stderr, flush=True)
            continue
        if isinstance(nb, tuple):   # the last try stalled: recorded in the notebook
            nb, stall = nb
            stalls.append(stall)
            print(f"{stall.line()}; gave up, the cells after it not run", file=sys.stderr, flush=True)
        return NotebookRun(nb, time.perf_counter() - start, stalls)
    raise AssertionError("unreachable: the last try returns")


def _not_run(cells, ename: str, evalue: str) -> None:
    import nbformat
    for cell in cells:
        if cell.cell_type == "code":
            cell.outputs = [nbformat.v4.new_output("error", ename=ename, evalue=evalue, traceback=[])]


def _watch(client, watch: StallWatch) -> None:
    """Let ``watch`` see every message nbclient reads for the running cell, and end nbclient's
    wait for the reply with :class:`KernelStalled` once it says so. Both waits (the reply on the
    shell channel, the outputs on IOPub) go in one-second slices: each ends in a plain poll of
    the socket, so a message already there is read even when the event loop's wake-up for it
    was missed."""
    process = client.process_message   # called with the running cell's IOPub messages only

    def process_message(msg, cell, cell_index):
        watch.saw(msg)
        return process(msg, cell, cell_index)

    client.process_message = process_message
    channel = client.kc.shell_channel
    get_msg = channel.get_msg

    async def watched_get_msg(timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))
            try:
                msg = await get_msg(timeout=left)
            except Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                stall = watch.check()
                if stall is not None:
                    # nbclient's kernel-alive poll of this cell would outlive the kernel
                    for task in asyncio.all_tasks():
                        if task.get_coro().__qualname__.endswith("_async_poll_kernel_alive"):
                            task.cancel()
                    raise KernelStalled(stall) from None
                continue
            watch.saw(msg)
            return msg

    channel.get_msg = watched_get_msg
    iopub = client.kc.iopub_channel
    iopub_get_msg = iopub.get_msg

    async def sliced_get_msg(timeout: float | None = None):
        # nbclient reads IOPub with no timeout: a wake-up the socket's poll misses would lose
        # the cell's outputs (nbclient gives up on IOPub 4 s after the reply); each slice ends
        # in a plain poll of the socket, which sees a message that is there
        if timeout is not None:
            return await iopub_get_msg(timeout=timeout)
        while True:
            try:
                return await iopub_get_msg(timeout=1.0)
            except Empty:
                continue

    iopub.get_msg = sliced_get_msg


def _run_once(path: pathlib.Path, cell_timeout: float, after_cell, stall_seconds: float,
              record_stall: bool):
    """One try of :func:`run_watched`: the notebook, or (notebook, stall) when ``record_stall``
    and a cell stalled; raises :class:`KernelStalled` when not ``record_stall``."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=cell_timeout, allow_errors=True, interrupt_on_timeout=True,
                            kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    stalled = None
    with client.setup_kernel():
        watch = StallWatch(stall_seconds, pid=kernel_pid(client.km), notebook=path.name)
        _watch(client, watch)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            watch.start(i)
            try:
                client.execute_cell(cell, i)
            except CellTimeoutError:  # interrupted: record it, go on with the next cell
                cell.outputs = [nbformat.v4.new_output("error", ename="Timeout", traceback=[],
                                                       evalue=f"cell ran over {cell_timeout:g} s")]
            except DeadKernelError as e:  # e.g. killed for memory: the rest cannot run
                _not_run(nb.cells[i:], "DeadKernel", str(e).splitlines()[0])
                break
            except KernelStalled as e:
                if not record_stall:
                    raise
                stalled = e.stall
                _not_run(nb.cells[i:], "KernelStalled", e.stall.line())
                break
            if after_cell is not None:
                after_cell(client, cell)
    return (nb, stalled) if stalled is not None else nb


def collect(folder: str | pathlib.Path, cell_timeout: float = 600.0,
            stall_seconds: float = STALL_SECONDS) -> list[Result]:
    """Run every notebook under ``folder`` and record each checker cell.

    Each notebook runs under the watchdog (:func:`run_watched`); one over its bound
    (:func:`memlab.classroom.watchdog.over_bound`) is named on stderr after its results."""
    folder = pathlib.Path(folder)
    if not folder.is_dir():
        raise InputError(f"submitted folder {str(folder)!r} does not exist or is not a folder")
    paths = sorted(p for p in folder.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    if not paths:
        raise InputError(f"no notebooks (*.ipynb) under {str(folder)!r}")
    results = []
    for path in paths:
        rel = path.relative_to(folder)
        student = rel.parts[0] if len(rel.parts) > 1 else "-"
        run = run_watched(path, cell_timeout, stall_seconds=stall_seconds)
        nb = run.nb
        for index, title in checker_cells(nb):
            result, message = cell_outcome(nb.cells[index])
            results.append(Result(student, path.name, title, result, message))
        print(f"{student} {path.name}: " + (", ".join(r.result for r in results
                                                    if r.student == student and r.notebook == path.name)
                                          or "no checker cells")
              + (f" ({len(run.stalls)} stall(s), retried)" if run.stalls else ""), file=sys.stderr)
        slow = over_bound(path.stem, run.seconds)
        if slow:
            print(f"{student} {slow}", file=sys.stderr)
    return results


def write_tables(results: list[Result], csv_path: str | pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """One CSV and one Markdown table (same name, ``.md``) of ``results``."""
    csv_path = pathlib.Path(csv_path)
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    with csv_path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(FIELDS)
        for r in results:
            writer.writerow([r.student, r.notebook, r.exercise, r.result, r.message])
    md = csv_path.with_suffix(".md")
    passed = sum(r.result == "pass" for r in results)
    lines = [f"# Class results: {passed} of {len(results)} checks passed", "",
             "| " + " | ".join(FIELDS) + " |", "|" + " --- |" * len(FIELDS)]
    for r in results:
        cells = [r.student, r.notebook, r.exercise, r.result, r.message]
        lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    md.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return csv_path, md


# --- how long a lesson takes in class (course/two-day-plan.md states and justifies each figure) ---
WORDS_PER_MINUTE = 120      # the lesson's prose, read closely (formulas, tables, predict-first prompts)
CODE_CELL_MINUTES = 0.5     # a code cell and its output: about 55 words (the executed lessons' median)
EXERCISE_MINUTES = 20       # a "Your turn": read the task, write the code, run the checker, fix once
DEMO_MINUTES = 10           # the teacher: the live demo and the question of instructor-notes.md
FENCE = re.compile(r"^```.*?^```[^\n]*$", re.M | re.S)
DETAILS = re.compile(r"<details\b.*?</details\s*>", re.I | re.S)
TAG = re.compile(r"<[^>]+>")
WORD = re.compile(r"\S*\w\S*")   # a token with a letter or digit in it ("|", "---" and "-" are not words)
LOG_LINE = re.compile(r"^(\d\d_\w+)\s+(\d+(?:\.\d+)?)\s*$")


@dataclass(frozen=True)
class LessonTime:
    """One lesson's minutes in class and what they are computed from."""

    lesson: str          # the notebook's stem, "05_checkpointing"
    words: int           # prose: markdown cells without fenced code and <details> answer blocks
    code_cells: int      # code cells a learner runs and reads, the exercises' own cells left out
    exercises: int       # "Your turn" checker cells (what `class collect` records)
    run_seconds: float   # the whole notebook's measured run time on a CPU
    reading: int         # ceil(words / WORDS_PER_MINUTE)
    code: int            # ceil(code_cells * CODE_CELL_MINUTES)
    exercise: int        # exercises * EXERCISE_MINUTES
    run: int             # ceil(run_seconds / 60)
    demo: int            # DEMO_MINUTES
    total: int           # the sum of the five


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def prose_words(nb: dict) -> int:
    """Words of a notebook's prose: its markdown cells, without fenced code blocks, ``<details>``
    answer blocks (closed until asked) and HTML tags; a word is a token with a letter or digit."""
    words = 0
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "markdown":
            text = TAG.sub(" ", DETAILS.sub(" ", FENCE.sub(" ", _source(cell))))
            words += len(WORD.findall(text))
    return words


def lesson_time(nb: dict, lesson: str, run_seconds: float) -> LessonTime:
    """The minutes one lesson takes in class, from its notebook and its measured run time.

    Args:
        nb: the notebook (``json.load`` of the ``.ipynb``), as committed.
        lesson: its stem, for the result.
        run_seconds: its measured wall time, executed top to bottom on a CPU.

    Returns:
        The counts and the minutes: prose at :data:`WORDS_PER_MINUTE`, each code cell
        :data:`CODE_CELL_MINUTES`, each "Your turn" :data:`EXERCISE_MINUTES`, the run time rounded
        up to a minute and :data:`DEMO_MINUTES` of the teacher's.
    """
    if isinstance(run_seconds, bool) or not isinstance(run_seconds, (int, float)) or not run_seconds >= 0:
        raise InputError(f"run_seconds={run_seconds!r} for {lesson}: a measured wall time, seconds >= 0")
    checkers = {i for i, _ in checker_cells(nb)}
    code_cells = sum(1 for i, c in enumerate(nb.get("cells", []))
                     if c.get("cell_type") == "code" and i not in checkers
                     and "solution" not in c.get("metadata", {}).get("tags", []))
    words = prose_words(nb)
    reading = math.ceil(words / WORDS_PER_MINUTE)
    code = math.ceil(code_cells * CODE_CELL_MINUTES)
    exercise = len(checkers) * EXERCISE_MINUTES
    run = math.ceil(run_seconds / 60)
    return LessonTime(lesson, words, code_cells, len(checkers), float(run_seconds), reading, code,
                      exercise, run, DEMO_MINUTES, reading + code + exercise + run + DEMO_MINUTES)


def read_run_seconds(path: str | pathlib.Path) -> dict[str, float]:
    """Seconds per lesson stem from a run's record: ``make site``'s ``site.json`` (a list of
    ``{"stem", "seconds"}``) or a log of ``NN_name SECONDS`` lines (other lines are skipped)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise InputError(f"run-time record {str(path)!r} does not exist: a site.json, or a log of "
                         f"'NN_name SECONDS' lines")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        return {row["stem"]: float(row["seconds"]) for row in json.loads(text)}
    return {m.group(1): float(m.group(2)) for m in map(LOG_LINE.match, text.splitlines()) if m}


def main(argv: list[str] | None = None) -> int:
    """``python -m memlab.classroom.collect DIR [--out results.csv] [--timeout S]``."""
    p = argparse.ArgumentParser(prog="memlab class collect", description=__doc__.split("\n")[0])
    p.add_argument("dir", help="folder of submitted notebooks, one subfolder per student")
    p.add_argument("--out", default="results.csv", help="CSV to write (the Markdown table goes beside it)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per cell")
    args = p.parse_args(argv)
    try:
        results = collect(args.dir, args.timeout)
    except InputError as e:
        print(f"memlab: error: {e}", file=sys.stderr)
        return 2
    csv_path, md = write_tables(results, args.out)
    print(f"{sum(r.result == 'pass' for r in results)}/{len(results)} passed -> {csv_path}, {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
