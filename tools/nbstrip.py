"""Strip outputs, execution counts and widget state from notebooks, and give every notebook
the same kernelspec (stdlib only).

    python tools/nbstrip.py [--check] [NOTEBOOK ...]   # default: notebooks/*.ipynb

--check changes nothing and exits 1 if any notebook still carries outputs or names another
kernel than ``python3``: the kernel ipykernel installs with itself, so that a plain
``pytest --nbval notebooks/`` in any environment with ipykernel finds it.
Cell tags (nbval-ignore-output, raises-exception, ...) and other metadata are kept.
"""
import glob
import json
import sys

CELL_META = ("execution", "ExecuteTime", "collapsed", "scrolled")
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def strip(nb):
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
        for key in CELL_META:
            cell.get("metadata", {}).pop(key, None)
    meta = nb.setdefault("metadata", {})
    meta.pop("widgets", None)
    meta["kernelspec"] = dict(KERNELSPEC)
    meta.setdefault("language_info", {"name": "python"})
    return nb


def main(argv):
    check = "--check" in argv
    paths = [a for a in argv if a != "--check"] or sorted(glob.glob("notebooks/*.ipynb"))
    dirty = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        new = json.dumps(strip(json.loads(text)), indent=1, ensure_ascii=False) + "\n"
        if new == text:
            continue
        if check:
            # outputs/counts and the kernel matter for nbval; formatting differences do not
            nb = json.loads(text)
            cells = nb.get("cells", [])
            if any(c.get("outputs") or c.get("execution_count") for c in cells):
                dirty.append(path)
            elif nb.get("metadata", {}).get("kernelspec") != KERNELSPEC:
                dirty.append(f"{path} (kernelspec {nb.get('metadata', {}).get('kernelspec')}, "
                             f"expected {KERNELSPEC})")
        else:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
            print("stripped", path)
    if dirty:
        print("notebooks with outputs or another kernelspec (run `make strip` and commit):",
              *dirty, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
