"""Strip outputs, execution counts and widget state from notebooks (stdlib only).

    python tools/nbstrip.py [--check] [NOTEBOOK ...]   # default: notebooks/*.ipynb

--check changes nothing and exits 1 if any notebook still carries outputs.
Cell tags (nbval-ignore-output, raises-exception, ...) and other metadata are kept.
"""
import glob
import json
import sys

CELL_META = ("execution", "ExecuteTime", "collapsed", "scrolled")


def strip(nb):
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
        for key in CELL_META:
            cell.get("metadata", {}).pop(key, None)
    nb.get("metadata", {}).pop("widgets", None)
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
            # only outputs/counts matter for nbval; formatting differences are not an error
            cells = json.loads(text).get("cells", [])
            if any(c.get("outputs") or c.get("execution_count") for c in cells):
                dirty.append(path)
        else:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
            print("stripped", path)
    if dirty:
        print("notebooks with outputs (run `make strip` and commit):", *dirty, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
