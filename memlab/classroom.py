"""Collect a class's results: run submitted student notebooks headless, record every checker.

    memlab class collect SUBMITTED/ --out results.csv       # also writes results.md
    python -m memlab.classroom SUBMITTED/ --out results.csv

``SUBMITTED/<student>/.../NN_name.ipynb`` (nbgrader's ``submitted/<student>/<assignment>/``
layout works as is); a notebook directly in ``SUBMITTED/`` is filed under student ``-``. Each
notebook runs top to bottom in a fresh ``python3`` kernel (nbclient), one cell at a time with
a per-cell timeout; an error or a timeout in one cell does not stop the next, so every checker
cell (a code cell calling ``exercises.check_...``, after a "Your turn" cell) runs and is
recorded: ``pass`` with the checker's ``PASSED`` line, or ``fail`` with its message
(``CheckFailed``, or the error the learner's empty or broken cell left, e.g. a ``NameError``).

Why not nbgrader: 0.9.6 installs beside JupyterLab 4 (``jupyterlab<5,>=4.2``), but grades only
cells carrying its own metadata (``nbgrader.grade_id``, points) and keeps a gradebook
database; our checkers already say what is wrong, so a CSV is all a class needs.
"""
from __future__ import annotations

import argparse
import csv
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
