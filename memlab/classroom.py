"""Collect a class's results: run submitted student notebooks headless, record every checker;
and time a lesson for a class plan (:func:`lesson_time`, ``course/two-day-plan.md``).

    memlab class collect SUBMITTED/ --out results.csv       # also writes results.md
    python -m memlab.classroom SUBMITTED/ --out results.csv
    python tools/class_minutes.py                           # the plan's minutes per lesson

``SUBMITTED/<student>/.../NN_name.ipynb`` (nbgrader's ``submitted/<student>/<assignment>/``
layout works as is); a notebook directly in ``SUBMITTED/`` is filed under student ``-``. Each
notebook runs top to bottom in a fresh ``python3`` kernel (nbclient), one cell at a time with
a per-cell timeout; an error or a timeout in one cell does not stop the next, so every checker
cell (a code cell calling ``exercises.check_...``, after a "Your turn" cell) runs and is
recorded: ``pass`` with the checker's ``PASSED`` line, or ``fail`` with its message
(``CheckFailed``, or the error the learner's empty or broken cell left, e.g. a ``NameError``).
Notebooks run one at a time (20-60 s each on a CPU), so a class of 30 takes hours: collect
after the session, overnight; in class the learners self-check with the same checkers.

Why not nbgrader: 0.9.6 installs beside JupyterLab 4 (``jupyterlab<5,>=4.2``), but grades only
cells carrying its own metadata (``nbgrader.grade_id``, points) and keeps a gradebook
database; our checkers already say what is wrong, so a CSV is all a class needs.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import pathlib
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable

from .errors import InputError

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


def run_notebook(path: pathlib.Path, cell_timeout: float = 600.0,
                 after_cell: Callable[[Any, Any], None] | None = None) -> dict:
    """Execute ``path`` in a fresh kernel, cell by cell; returns the executed notebook.

    ``after_cell(client, cell)``, if given, runs after each code cell with the nbclient
    ``NotebookClient`` (the site reads each panel's widget state there, as the cell left it)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=cell_timeout, allow_errors=True, interrupt_on_timeout=True,
                            kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    with client.setup_kernel():
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            try:
                client.execute_cell(cell, i)
            except CellTimeoutError:  # interrupted: record it, go on with the next cell
                cell.outputs = [nbformat.v4.new_output("error", ename="Timeout", traceback=[],
                                                       evalue=f"cell ran over {cell_timeout:g} s")]
            except DeadKernelError as e:  # e.g. killed for memory: the rest cannot run
                for later in nb.cells[i:]:
                    if later.cell_type == "code":
                        later.outputs = [nbformat.v4.new_output("error", ename="DeadKernel",
                                                                evalue=str(e).splitlines()[0], traceback=[])]
                break
            if after_cell is not None:
                after_cell(client, cell)
    return nb


def collect(folder: str | pathlib.Path, cell_timeout: float = 600.0) -> list[Result]:
    """Run every notebook under ``folder`` and record each checker cell."""
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
        nb = run_notebook(path, cell_timeout)
        for index, title in checker_cells(nb):
            result, message = cell_outcome(nb.cells[index])
            results.append(Result(student, path.name, title, result, message))
        print(f"{student} {path.name}: " + (", ".join(r.result for r in results
                                                    if r.student == student and r.notebook == path.name)
                                          or "no checker cells"), file=sys.stderr)
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
    """``python -m memlab.classroom DIR [--out results.csv] [--timeout S]``."""
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
