"""Execute the notebooks and write a static HTML site that opens with no network.

    python tools/make_site.py [--out build/site] [--timeout S] [--only 00,01] [--no-execute] [NOTEBOOK ...]

Each notebook (default ``notebooks/*.ipynb``) runs top to bottom in a fresh ``python3`` kernel,
one at a time (the rank-starting lessons must not overlap), with ``memlab.classroom.collect.run_notebook``:
a failing cell is shown on its page, the build goes on, and the exit status is 1. Pages are
nbconvert's ``lab`` template with figures embedded as PNG data; every script it would load from
a CDN (require.js, MathJax, mermaid) is removed, so a page needs no network.

A page reads as a learner meets it:

- an ``<details><summary>Answer</summary>`` block in the prose stays closed, with its answer
  rendered inside it (nbconvert's image embedding re-parsed each HTML block on its own and
  closed the ``<details>`` before the answer); a "Your turn" solution cell (tag ``solution``,
  the cells ``tools/make_student.py`` blanks) shows its code inside a closed "Solution" block;
- a widget panel (a static page has no kernel to drive it) is replaced by what it drew as the
  cell that displayed it finished: the figures and text in its Output widgets, its status line,
  and one line naming its controls and the values drawn. The widget state comes from the
  executing client after each cell (or, with ``--no-execute``, from the notebook's saved
  ``metadata.widgets``); the widget's text form (``VBox(children=...``) is dropped;
- every figure's ``<img>`` has alt text: its title, which ``tools/site_kernel.py`` (the kernels'
  ``PYTHONSTARTUP``) attaches to each matplotlib figure a cell displays.

``index.html`` lists the lessons in order with their run time and status. A cell whose kernel
sits idle with no reply is reported in one line and its notebook run again in a fresh kernel
(``memlab.classroom.watchdog``); a notebook over its bound (``memlab/data/notebook_bounds.txt``, the
seconds each may take on 2 cores) is named in its line, its index row and the closing line.
"""
from __future__ import annotations

import argparse
import copy
import html
import json
import os
import pathlib
import re
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # the worktree's memlab, as in the notebooks
from memlab.classroom.watchdog import BOUNDS_FILE, over_bound  # noqa: E402  (no torch: --no-execute stays light)

ELECTIVES = ("16", "17", "18")
REMOTE_SCRIPT = re.compile(r"<script\b[^>]*\bsrc=\"https?://[^\"]*\"[^>]*>\s*</script>", re.S)
# inline scripts that only configure or import a CDN library (MathJax's config, mermaid's loader)
CDN_INLINE = re.compile(r"<script\b[^>]*>(?:(?!</script>).)*?(?:https?://cdn|MathJax\.Hub)(?:(?!</script>).)*</script>",
                        re.S)
NAV_STYLE = ("<style>nav.memlab{font:14px sans-serif;padding:8px 16px;background:#f3f3f3;"
             "border-bottom:1px solid #ddd}nav.memlab a{margin-right:16px}"
             "details>summary{cursor:pointer}details.memlab-solution{width:100%}"
             "details.memlab-solution>summary{font:600 13px sans-serif;color:#555;padding:4px 0 4px 72px}"
             "p.memlab-controls{font-size:90%;color:#555;margin:2px 0}</style>")
SOLUTION_TAG = "solution"   # tools/make_student.py's mark on a "Your turn" solution cell
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
TEXT_MODELS = {"HTMLModel": True, "HTMLMathModel": True, "LabelModel": False}   # name -> value is HTML
# a progress bar (tqdm's: text, bar, text) is shown by its text alone, not named as a control
PROGRESS_MODELS = {"FloatProgressModel", "IntProgressModel"}
# the page template: nbconvert's lab page, with solution inputs folded and figures' alt text
TEMPLATE = """{%- extends 'index.html.j2' -%}
{% block input_group -%}
{%- if '""" + SOLUTION_TAG + """' in cell.metadata.get('tags', []) -%}
<details class="memlab-solution"><summary>Solution</summary>
{{ super() }}
</details>
{%- else -%}
{{ super() }}
{%- endif -%}
{%- endblock input_group %}
{% block data_png scoped -%}
{%- set alt = output | get_metadata('alt', 'image/png') or 'figure' -%}
{{ super() | replace('<img src=', '<img alt="' ~ (alt | escape_html) ~ '" src=', 1) }}
{%- endblock data_png %}
"""


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


def exporter():
    """nbconvert's ``lab`` HTML exporter with the site's template and a markdown renderer that
    passes an HTML block without an image through as it is."""
    import jinja2
    from nbconvert import HTMLExporter
    from nbconvert.filters.markdown_mistune import IPythonRenderer, MarkdownWithMath

    class Renderer(IPythonRenderer):
        # Embedding images parses each raw HTML block on its own (BeautifulSoup), which closes
        # a lone `<details><summary>Answer</summary>` block before the markdown answer after it:
        # the answer then showed, outside its closed block. Only blocks with an image need it.
        def block_html(self, html: str) -> str:
            return super().block_html(html) if "<img" in html else super(IPythonRenderer, self).block_html(html)

        def inline_html(self, html: str) -> str:
            return super().inline_html(html) if "<img" in html else super(IPythonRenderer, self).inline_html(html)

    class SiteExporter(HTMLExporter):
        @jinja2.pass_context
        def markdown2html(self, context, source):   # HTMLExporter.markdown2html with Renderer
            cell = context.get("cell", {})
            path = context.get("resources", {}).get("metadata", {}).get("path", "")
            renderer = Renderer(escape=False, attachments=cell.get("attachments", {}),
                                embed_images=self.embed_images, path=path,
                                anchor_link_text=self.anchor_link_text,
                                exclude_anchor_links=self.exclude_anchor_links, **self.lexer_options)
            return MarkdownWithMath(renderer=renderer).render(source)

    return SiteExporter(template_name="lab", embed_images=True, template_file="memlab_site.html.j2",
                        extra_loaders=[jinja2.DictLoader({"memlab_site.html.j2": TEMPLATE})])


def control_words(state: dict) -> str:
    """One control of a panel in words: its name, its range or choices, and the value drawn."""
    name = state.get("_model_name", "")
    label = state.get("description") or name.removesuffix("Model").lower()
    now = None
    if "_options_labels" in state:   # SelectionSlider, Dropdown, ToggleButtons, ...
        labels = list(state["_options_labels"])
        index = state.get("index")
        now = labels[index] if isinstance(index, int) and 0 <= index < len(labels) else None
        if "Slider" in name and len(labels) > 2:
            span = f"{labels[0]}..{labels[-1]}"
        elif len(labels) <= 5:
            span = "/".join(labels)
        else:
            span = f"{'/'.join(labels[:3])}/... ({len(labels)} choices)"
    elif "min" in state and "max" in state:   # IntSlider, FloatSlider
        span, now = f"{state['min']}..{state['max']}", state.get("value")
    elif isinstance(state.get("value"), bool):   # Checkbox, ToggleButton
        span, now = "on/off", "on" if state["value"] else "off"
    else:
        return label
    return f"{label} {span}" + (f" (shown: {now})" if now is not None else "")


def static_panel(model_id: str, models: dict) -> list:
    """The outputs that stand for a widget on a static page: what its Output widgets hold (its
    figure), its status text, and one line naming its controls.

    Args:
        model_id: the widget shown (a ``widget-view+json`` output's ``model_id``).
        models: every widget's state by model id (the executing client's ``widget_state``).
    Returns:
        nbformat outputs, in the panel's order (figures first); empty for an unknown widget.
    """
    import nbformat
    figures, texts, controls = [], [], []

    def walk(mid: str) -> None:
        state = models.get(mid)
        if state is None:
            return
        name = state.get("_model_name", "")
        if name == "OutputModel":
            figures.extend(copy.deepcopy(list(state.get("outputs", []))))   # the client keeps appending
        elif name in TEXT_MODELS:
            if state.get("value"):
                texts.append(state["value"] if TEXT_MODELS[name] else html.escape(state["value"]))
        elif name in PROGRESS_MODELS:
            return
        elif "children" in state:   # a box: its children in order
            for child in state["children"]:
                walk(str(child).removeprefix("IPY_MODEL_"))
        else:
            controls.append(control_words(state))

    walk(model_id)
    outputs = [nbformat.from_dict(o) for o in figures]
    if texts:
        outputs.append(nbformat.v4.new_output("display_data", data={
            "text/html": f'<p class="memlab-status">{" ".join(texts)}</p>'}))
    if controls:
        line = ", ".join(html.escape(c) for c in controls)
        outputs.append(nbformat.v4.new_output("display_data", data={
            "text/html": f'<p class="memlab-controls">controls: {line} &mdash; open the notebook to move them</p>'}))
    return outputs


def freeze_widgets(cell, models: dict) -> int:
    """Replace each widget view among ``cell``'s outputs with :func:`static_panel`'s outputs
    (a note where the widget's state is unknown); returns how many were replaced."""
    import nbformat
    outputs, frozen = [], 0
    for out in cell.get("outputs", []):
        view = out.get("data", {}).get(WIDGET_VIEW)
        if view is None:
            outputs.append(out)
            continue
        frozen += 1
        outputs += static_panel(view.get("model_id", ""), models) or [nbformat.v4.new_output(
            "display_data", data={"text/html": '<p class="memlab-controls">an interactive panel '
                                               '&mdash; open the notebook to use it</p>'})]
    if frozen:   # (a cell without a panel keeps its outputs list as nbclient holds it)
        cell.outputs = outputs
    return frozen


def saved_widget_state(nb) -> dict:
    """The widget states a notebook saved (``metadata.widgets``), by model id."""
    saved = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    return {mid: entry.get("state", {}) for mid, entry in saved.items()}


def render(nb, nav: str) -> str:
    nb.metadata["title"] = title_of(nb)   # the page's <title>
    nb.metadata.pop("widgets", None)      # no widget manager on a static page (its script is a CDN's)
    page, _ = exporter().from_notebook_node(nb)
    page = offline(page)
    return re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + NAV_STYLE + nav, page, count=1)


def build(paths: list[pathlib.Path], out: pathlib.Path, timeout: float, execute: bool = True) -> list[dict]:
    """Execute and render ``paths`` into ``out``; returns one row per lesson for the index."""
    import nbformat

    out.mkdir(parents=True, exist_ok=True)
    # kernels inherit the environment: a non-interactive backend (MPLBACKEND=Agg, as the tests
    # set) would leave every lesson without `%matplotlib inline` with no figures on its page;
    # PYTHONSTARTUP gives each figure its title as alt text; nobody watches a page's progress
    # bars, so memlab draws none (memlab.core.quiet.progress_wanted)
    kernel_env = {"MPLBACKEND": "module://matplotlib_inline.backend_inline",
                  "PYTHONSTARTUP": str(ROOT / "tools" / "site_kernel.py"), "MEMLAB_PROGRESS": "0"}
    saved_env = {k: os.environ.get(k) for k in kernel_env}
    os.environ.update(kernel_env)
    rows = []
    try:
        for i, path in enumerate(paths):
            panels = {}   # by cell: a retry in a fresh kernel freezes the cells again
            stalls = []

            def freeze(client, cell, panels=panels):   # as the cell left its panels
                panels[cell.get("id") or id(cell)] = freeze_widgets(cell, client.widget_state)

            t = time.perf_counter()
            if execute:
                from memlab.classroom.collect import run_watched  # (imports torch: not for --no-execute)
                run = run_watched(path, timeout, after_cell=freeze)
                nb, stalls = run.nb, [s.line() for s in run.stalls]
            else:
                nb = nbformat.read(path, as_version=4)
                models = saved_widget_state(nb)
                panels.update((k, freeze_widgets(c, models)) for k, c in enumerate(nb.cells) if c.cell_type == "code")
            secs = time.perf_counter() - t
            slow = over_bound(path.stem, secs) if execute else None
            errs = errors_in(nb)
            prev = f'<a href="{paths[i - 1].stem}.html">&larr; {paths[i - 1].stem}</a>' if i else ""
            nxt = f'<a href="{paths[i + 1].stem}.html">{paths[i + 1].stem} &rarr;</a>' if i + 1 < len(paths) else ""
            nav = f'<nav class="memlab"><a href="index.html">contents</a>{prev}{nxt}</nav>'
            (out / f"{path.stem}.html").write_text(render(nb, nav), encoding="utf-8")
            figures = sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
            rows.append({"stem": path.stem, "title": title_of(nb), "seconds": round(secs, 1),
                         "figures": figures, "panels": sum(panels.values()), "errors": errs,
                         "stalls": stalls, "slow": slow})
            print(f"{path.stem}: {secs:.0f} s, {figures} figures, {sum(panels.values())} panels, "
                  + (f"{len(errs)} error(s): {errs[0]}" if errs else "ok")
                  + (f"; {len(stalls)} stall(s), retried" if stalls else "") + (f"; {slow}" if slow else ""),
                  flush=True)
    finally:   # the build runs inside pytest too: leave its environment as it was
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return rows


def write_index(rows: list[dict], out: pathlib.Path) -> pathlib.Path:
    """``index.html``: the table of contents in lesson order, electives last and marked."""
    lines = []
    for r in rows:
        number = r["stem"][:2]
        status = "ok" if not r["errors"] else f"{len(r['errors'])} failing cell(s)"
        if r.get("slow"):
            status += f" (slow: {r['seconds']:.0f} s, over its bound)"
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
    slow = [r["stem"] for r in rows if r.get("slow")]
    print(f"{len(rows)} pages -> {index} in {time.perf_counter() - t:.0f} s, {size / 2**20:.1f} MiB"
          + (f"; failing cells in {', '.join(failed)}" if failed else "")
          + (f"; over their bound ({BOUNDS_FILE}): {', '.join(slow)}" if slow else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
