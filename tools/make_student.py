"""Write the student edition of the workbook (stdlib only), never over a learner's work.

    python tools/make_student.py [--out DIR] [--force] [NOTEBOOK ...]   # default: notebooks/*.ipynb -> student/

Every code cell tagged ``solution`` (cell metadata ``tags``) becomes an empty code cell
holding only ``# your code here``; every other cell is copied unchanged, without outputs. The
exercise's markdown cell before it and the check cell after it stay, so the learner writes the
code and runs the check.

A learner works in this copy, so regenerating it must not lose their answers. ``DIR/.generated.json``
records the SHA-256 of every notebook this tool wrote. A notebook whose file still has that hash
(untouched) is replaced by the new edition; one that differs (the learner edited or ran it) is
kept, and the new edition is written beside it as ``NN_name.new.ipynb`` with a message.
``--force`` overwrites anyway.
"""
import glob
import hashlib
import json
import os
import sys

from student_stub import student_source  # tools/ is on the path when run as a script

PLACEHOLDER = "# your code here"
SOLUTION_TAG = "solution"
MANIFEST = ".generated.json"


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


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_edition(target: str, text: str, manifest: dict, force: bool) -> str:
    """Write ``text`` to ``target`` unless the learner changed it; returns what happened:
    "new", "updated", "unchanged", "kept" (written beside, as .new.ipynb) or "forced"."""
    data = text.encode("utf-8")
    name = os.path.basename(target)
    if not os.path.exists(target):
        action = "new"
    else:
        with open(target, "rb") as f:
            current = sha256(f.read())
        if current == sha256(data):
            manifest[name] = current
            return "unchanged"
        if current == manifest.get(name):
            action = "updated"
        elif force:
            action = "forced"
        else:  # the learner's file: leave it, put the new edition beside it
            beside = target[: -len(".ipynb")] + ".new.ipynb"
            with open(beside, "wb") as f:
                f.write(data)
            return "kept"
    with open(target, "wb") as f:
        f.write(data)
    manifest[name] = sha256(data)
    return action


def main(argv: list[str]) -> int:
    out, force = "student", False
    if "--force" in argv:
        force = True
        argv = [a for a in argv if a != "--force"]
    if "--out" in argv:
        i = argv.index("--out")
        if i + 1 >= len(argv):
            print("--out needs a directory", file=sys.stderr)
            return 2
        out = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.split("\n\n")[1].strip())
        return 0
    paths = argv or sorted(glob.glob("notebooks/*.ipynb"))
    bad = [a for a in paths if a.startswith("-") or not a.endswith(".ipynb") or not os.path.isfile(a)]
    if bad:
        print(f"make_student: {bad[0]!r} is not a notebook file; allowed: --out DIR, --force, "
              f"and paths of .ipynb files", file=sys.stderr)
        return 2
    os.makedirs(out, exist_ok=True)
    manifest_path = os.path.join(out, MANIFEST)
    manifest = {}
    if os.path.exists(manifest_path):
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
    total, kept = 0, []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            nb, removed = studentize(json.load(f))
        target = os.path.join(out, os.path.basename(path))
        action = write_edition(target, json.dumps(nb, indent=1, ensure_ascii=False) + "\n", manifest, force)
        total += removed
        if action == "kept":
            kept.append(target)
            print(f"{target}: you changed it, kept; the new edition is beside it: "
                  f"{target[:-len('.ipynb')]}.new.ipynb")
        elif removed and action != "unchanged":
            print(f"{target}: {removed} solution cell(s) emptied ({action})")
    with open(manifest_path, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"{len(paths)} notebooks -> {out}/, {total} exercises to write")
    if kept:
        print(f"{len(kept)} notebook(s) you changed were kept; FORCE=1 (make) or --force overwrites them")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
