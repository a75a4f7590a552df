"""Execute the notebooks and write a static HTML site that opens with no network.

    python tools/make_site.py [--out build/site] [--timeout S] [--only 00,01] [NOTEBOOK ...]

Each notebook (default ``notebooks/*.ipynb``) runs top to bottom in a fresh ``python3`` kernel,
one at a time (the rank-starting lessons must not overlap), with ``memlab.classroom.run_notebook``:
a failing cell is shown on its page, the build goes on, and the exit status is 1. Pages are
nbconvert's ``lab`` template with figures embedded as PNG data; every script it would load from
a CDN (require.js, MathJax, mermaid) is removed, so a page needs no network: formulas show as
their TeX source and widget panels as their text form (a static page has no kernel to drive
them). ``index.html`` lists the lessons in order with their run time and status.
"""
from __future__ import annotations

import argparse
import html
import json
import os
import pathlib
import re
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # the worktree's memlab, as in the notebooks

ELECTIVES = ("16", "17")
REMOTE_SCRIPT = re.compile(r"<script\b[^>]*\bsrc=\"https?://[^\"]*\"[^>]*>\s*</script>", re.S)
# inline scripts that only configure or import a CDN library (MathJax's config, mermaid's loader)
CDN_INLINE = re.compile(r"<script\b[^>]*>(?:(?!</script>).)*?(?:https?://cdn|MathJax\.Hub)(?:(?!</script>).)*</script>",
                        re.S)
NAV_STYLE = ("<style>nav.memlab{font:14px sans-serif;padding:8px 16px;background:#f3f3f3;"
             "border-bottom:1px solid #ddd}nav.memlab a{margin-right:16px}</style>")


def title_of(nb: dict) -> str:
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            m = re.search(r"^#\s+(.+)$", "".join(cell["source"]), re.M)
            if m:
                return m.group(1).strip()
    return "untitled"


def offline(page: str) -> str:
    """The page without the scripts it would fetch from a CDN."""
    return CDN_INLINE.sub("", REMOTE_SCRIPT.sub("", page))


def errors_in(nb: dict) -> list[str]:
    return [f"{o['ename']}: {o['evalue']}".splitlines()[0] for c in nb["cells"] if c["cell_type"] == "code"
            for o in c.get("outputs", []) if o.get("output_type") == "error"]


def render(nb, nav: str) -> str:
    from nbconvert import HTMLExporter
    nb.metadata["title"] = title_of(nb)   # the page's <title>
    page, _ = HTMLExporter(template_name="lab", embed_images=True).from_notebook_node(nb)
    page = offline(page)
    return re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + NAV_STYLE + nav, page, count=1)


def build(paths: list[pathlib.Path], out: pathlib.Path, timeout: float, execute: bool = True) -> list[dict]:
    """Execute and render ``paths`` into ``out``; returns one row per lesson for the index."""
    import nbformat

    from memlab.classroom import run_notebook

    out.mkdir(parents=True, exist_ok=True)
    # kernels inherit the environment: a non-interactive backend (MPLBACKEND=Agg, as the tests
    # set) would leave every lesson without `%matplotlib inline` with no figures on its page
    os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    # nobody watches a page's progress bars: memlab draws none (memlab.quiet.progress_wanted)
    os.environ["MEMLAB_PROGRESS"] = "0"
    rows = []
    for i, path in enumerate(paths):
        t = time.perf_counter()
        nb = run_notebook(path, timeout) if execute else nbformat.read(path, as_version=4)
        secs = time.perf_counter() - t
        errs = errors_in(nb)
        prev = f'<a href="{paths[i - 1].stem}.html">&larr; {paths[i - 1].stem}</a>' if i else ""
        nxt = f'<a href="{paths[i + 1].stem}.html">{paths[i + 1].stem} &rarr;</a>' if i + 1 < len(paths) else ""
        nav = f'<nav class="memlab"><a href="index.html">contents</a>{prev}{nxt}</nav>'
        (out / f"{path.stem}.html").write_text(render(nb, nav), encoding="utf-8")
        figures = sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
        rows.append({"stem": path.stem, "title": title_of(nb), "seconds": round(secs, 1),
                     "figures": figures, "errors": errs})
        print(f"{path.stem}: {secs:.0f} s, {figures} figures, "
              + (f"{len(errs)} error(s): {errs[0]}" if errs else "ok"), flush=True)
    return rows


def write_index(rows: list[dict], out: pathlib.Path) -> pathlib.Path:
    """``index.html``: the table of contents in lesson order, electives last and marked."""
    lines = []
    for r in rows:
        number = r["stem"][:2]
        status = "ok" if not r["errors"] else f"{len(r['errors'])} failing cell(s)"
        lines.append(f'<tr><td>{number}{" (elective)" if number in ELECTIVES else ""}</td>'
                     f'<td><a href="{r["stem"]}.html">{html.escape(r["title"])}</a></td>'
                     f'<td>{r["figures"]}</td><td>{r["seconds"]:.0f} s</td><td>{status}</td></tr>')
    page = ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>memlab: GPU memory in training"
            "</title><style>body{font:15px sans-serif;max-width:60em;margin:2em auto}td,th{padding:4px 10px;"
            "text-align:left}</style></head><body><h1>memlab: GPU memory in training</h1>"
            "<p>Every lesson, executed on the machine that built this site, with its outputs and figures. "
            "Open the notebooks themselves to change the panels and run the exercises.</p>"
            "<table><tr><th>lesson</th><th>title</th><th>figures</th><th>run</th><th>status</th></tr>"
            + "".join(lines) + "</table></body></html>")
    index = out / "index.html"
    index.write_text(page, encoding="utf-8")
    (out / "site.json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return index


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("notebooks", nargs="*", help="default: notebooks/*.ipynb")
    p.add_argument("--out", default="build/site")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per cell")
    p.add_argument("--only", default="", help="lesson numbers, e.g. 00,01")
    p.add_argument("--no-execute", action="store_true", help="render the notebooks as they are")
    args = p.parse_args(argv)
    paths = [pathlib.Path(n) for n in args.notebooks] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    if args.only:
        wanted = set(args.only.split(","))
        paths = [q for q in paths if q.name[:2] in wanted]
    if not paths:
        print("no notebooks to build", file=sys.stderr)
        return 2
    t = time.perf_counter()
    out = pathlib.Path(args.out)
    rows = build(sorted(paths, key=lambda q: q.name), out, args.timeout, execute=not args.no_execute)
    index = write_index(rows, out)
    size = sum(f.stat().st_size for f in out.iterdir())
    failed = [r["stem"] for r in rows if r["errors"]]
    print(f"{len(rows)} pages -> {index} in {time.perf_counter() - t:.0f} s, {size / 2**20:.1f} MiB"
          + (f"; failing cells in {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
