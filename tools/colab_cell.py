"""Insert or update the install cell that lets a notebook run on Colab (stdlib only).

    python tools/colab_cell.py --source 'git+https://github.com/OWNER/memlab' NOTEBOOK ...
    python tools/colab_cell.py --check NOTEBOOK ...        # exit 1 if a cell is missing or stale

Colab opens one notebook from GitHub or Drive, without the repository around it, so memlab is
not importable there. The cell, placed after the title (before any other code), installs it
with pip only when ``import memlab`` would fail; everywhere memlab is installed (the venv,
JupyterHub, nbval) it does nothing. It installs ``memlab[dist]`` without the project's
constraints so that pip keeps Colab's own CUDA build of torch (it satisfies ``torch>=2.6``).
Running the tool again replaces the cell (tagged ``memlab-install``) instead of adding another.
"""
import json
import sys

TAG = "memlab-install"


def cell_source(source: str) -> str:
    return ("# Colab, or any Python without memlab: install it (does nothing where memlab is installed)\n"
            "import importlib.util, subprocess, sys\n"
            "if importlib.util.find_spec(\"memlab\") is None:\n"
            "    subprocess.check_call([sys.executable, \"-m\", \"pip\", \"install\", \"-q\", "
            f"\"memlab[dist] @ {source}\"])\n")


def install_cell(nb: dict, source: str) -> tuple[dict, str]:
    """``nb`` with the install cell in place; returns it and "inserted", "updated" or "unchanged"."""
    text = cell_source(source)
    cells = list(nb.get("cells", []))
    for i, cell in enumerate(cells):
        if TAG in cell.get("metadata", {}).get("tags", []):
            if "".join(cell["source"]) == text:
                return nb, "unchanged"
            cells[i] = dict(cell, source=text.splitlines(keepends=True), outputs=[], execution_count=None)
            return dict(nb, cells=cells), "updated"
    new = {"cell_type": "code", "execution_count": None, "id": TAG, "metadata": {"tags": [TAG]},
           "outputs": [], "source": text.splitlines(keepends=True)}
    at = 1 if cells and cells[0].get("cell_type") == "markdown" else 0  # after the title
    cells.insert(at, new)
    return dict(nb, cells=cells), "inserted"


def main(argv: list[str]) -> int:
    check = "--check" in argv
    argv = [a for a in argv if a != "--check"]
    source = None
    if "--source" in argv:
        i = argv.index("--source")
        if i + 1 >= len(argv):
            print("--source needs a pip requirement source, e.g. git+https://github.com/OWNER/memlab",
                  file=sys.stderr)
            return 2
        source, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    if source is None or not argv:
        print("usage: colab_cell.py --source SOURCE [--check] NOTEBOOK ...", file=sys.stderr)
        return 2
    stale = []
    for path in argv:
        with open(path, encoding="utf-8") as f:
            nb = json.load(f)
        new, action = install_cell(nb, source)
        if check:
            if action != "unchanged":
                stale.append(path)
            continue
        if action != "unchanged":
            with open(path, "w", encoding="utf-8") as f:
                f.write(json.dumps(new, indent=1, ensure_ascii=False) + "\n")
        print(f"{path}: {action}")
    if stale:
        print("install cell missing or stale: " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
