"""Write the student edition of the workbook (stdlib only).

    python tools/make_student.py [--out DIR] [NOTEBOOK ...]   # default: notebooks/*.ipynb -> build/student/

Every code cell tagged ``solution`` (cell metadata ``tags``) becomes an empty code cell
holding only ``# your code here``; every other cell is copied unchanged, without outputs. The
exercise's markdown cell before it and the check cell after it stay, so the learner writes the
code and runs the check.
"""
import glob
import json
import os
import sys

from student_stub import student_source  # tools/ is on the path when run as a script

PLACEHOLDER = "# your code here"
SOLUTION_TAG = "solution"


def is_solution(cell: dict) -> bool:
    return cell.get("cell_type") == "code" and SOLUTION_TAG in cell.get("metadata", {}).get("tags", [])


def studentize(nb: dict) -> tuple[dict, int]:
    """The notebook with its solution cells emptied, and how many there were."""
    cells, removed = [], 0
    for cell in nb.get("cells", []):
        if is_solution(cell):
            removed += 1
            empty = {"cell_type": "code", "execution_count": None, "metadata": {"tags": ["exercise"]},
                     "outputs": [], "source": student_source(cell["source"])}
            if "id" in cell:  # nbformat 4.5 cell ids: the emptied cell keeps the solution's
                empty["id"] = cell["id"]
            cell = empty
        elif cell.get("cell_type") == "code":
            cell = dict(cell, outputs=[], execution_count=None)
        cells.append(cell)
    return dict(nb, cells=cells), removed


def main(argv: list[str]) -> int:
    out = "build/student"
    if "--out" in argv:
        i = argv.index("--out")
        if i + 1 >= len(argv):
            print("--out needs a directory", file=sys.stderr)
            return 2
        out = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    paths = argv or sorted(glob.glob("notebooks/*.ipynb"))
    os.makedirs(out, exist_ok=True)
    total = 0
    for path in paths:
        with open(path, encoding="utf-8") as f:
            nb, removed = studentize(json.load(f))
        target = os.path.join(out, os.path.basename(path))
        with open(target, "w", encoding="utf-8") as f:
            f.write(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        total += removed
        if removed:
            print(f"{target}: {removed} solution cell(s) emptied")
    print(f"{len(paths)} notebooks -> {out}/, {total} exercises to write")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
