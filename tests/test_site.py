"""`make site`: lesson pages with their outputs and figures, opened in headless Chromium with
every host unresolvable and no proxy reachable, so anything fetched from a network fails."""
import base64
import importlib.util
import json
import pathlib
import re
import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("make_site", ROOT / "tools" / "make_site.py")
make_site = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_site)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (.ci/run installs it "
                                    "with apt-get; or: apt-get install chromium)")
PROBE = r"""<script>window.addEventListener("load", function () {
  var p = document.createElement("pre"); p.id = "memlab-probe";
  p.textContent = JSON.stringify({title: document.title, text: document.body.innerText.length,
    imgs: Array.from(document.images).map(function (i) { return i.naturalWidth; }),
    links: Array.from(document.links).map(function (a) { return a.getAttribute("href"); }),
    fetched: performance.getEntriesByType("resource").map(function (r) { return r.name; }),
    alts: Array.from(document.images).map(function (i) { return i.getAttribute("alt"); }),
    widgetText: Array.from(document.querySelectorAll(".jp-OutputArea-output")).some(function (o) {
      return /children=\(|Slider\(|Dropdown\(/.test(o.innerText); }),   // a widget's text form as output
    details: Array.from(document.querySelectorAll("details")).map(function (d) {
      var body = Array.from(d.children).filter(function (c) { return c.tagName !== "SUMMARY"; });
      var seen = function () { return body.filter(function (c) { return c.checkVisibility(); }).length; };
      var text = body.map(function (c) { return c.innerText; }).join(" ").trim().slice(0, 40);
      var wasOpen = d.open, hidden = seen() === 0, inPage = document.body.innerText.indexOf(text) >= 0;
      d.open = true;   // as a click on its summary would
      var shown = seen() === body.length && document.body.innerText.indexOf(text) >= 0;
      d.open = wasOpen;
      return {summary: d.querySelector("summary").textContent, wasOpen: wasOpen, hidden: hidden,
              textInClosedPage: inPage && text.length > 0, shown: shown, parts: body.length};
    })});
  document.body.appendChild(p);
});</script>"""


def open_in_chromium(page: pathlib.Path, tmp_path: pathlib.Path) -> dict:
    """Load ``page`` (a copy with a probe script) offline; what the browser saw."""
    probe = page.with_name(page.stem + ".probe.html")
    probe.write_text(page.read_text() + PROBE)
    try:
        out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                              "--disable-background-networking", "--no-first-run",
                              f"--user-data-dir={tmp_path / 'chromium-profile'}",
                              "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9",
                              "--virtual-time-budget=10000", "--dump-dom", probe.as_uri()],
                             capture_output=True, text=True, timeout=120)
    finally:
        probe.unlink()
    m = re.search(r'<pre id="memlab-probe">(.*?)</pre>', out.stdout, re.S)
    assert m, f"{page.name} did not load: {out.stderr[-1000:]}"
    return json.loads(m.group(1).replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">"))


def check_site(site: pathlib.Path, tmp_path: pathlib.Path, stems: list[str]) -> None:
    index = open_in_chromium(site / "index.html", tmp_path)
    assert index["links"] == [f"{s}.html" for s in stems]          # every lesson, in lesson order
    rows = {r["stem"]: r for r in json.loads((site / "site.json").read_text())}
    for stem in stems:
        page = site / f"{stem}.html"
        assert not re.search(r"<(script|link|img)\b[^>]*(src|href)=\"https?:", page.read_text())
        seen = open_in_chromium(page, tmp_path)
        assert seen["fetched"] == [], seen["fetched"]             # nothing asked of a network
        assert seen["title"] == rows[stem]["title"] and seen["text"] > 2000
        assert len(seen["imgs"]) == rows[stem]["figures"]         # the figures the run made...
        plots = (ROOT / "notebooks" / f"{stem}.ipynb").read_text().count("plots.plot_")
        assert rows[stem]["figures"] >= min(plots, 1), stem       # (a lesson that plots has some)
        assert all(w > 100 for w in seen["imgs"]), seen["imgs"]   # ...each decoded by the browser
        assert rows[stem]["errors"] == []
        assert all(seen["alts"]), seen["alts"]                    # every figure has alt text
        assert not seen["widgetText"]                             # no panel as widget text
        check_details(seen["details"])


def check_details(details: list[dict]) -> None:
    """Every <details> (answers, solutions) loads closed with its content hidden, and opened
    shows all of it."""
    for d in details:
        assert not d["wasOpen"] and d["hidden"] and not d["textInClosedPage"], d
        assert d["parts"] >= 1 and d["shown"], d


def test_offline_strips_every_cdn_script():
    import nbformat
    nb = nbformat.read(ROOT / "notebooks" / "00_start_here.ipynb", as_version=4)
    page = make_site.render(nb, "<nav></nav>")
    assert "cdnjs" not in page and "<script" not in page          # require.js, MathJax, mermaid gone
    assert f"<title>{make_site.title_of(nb)}</title>" in page


def png(width: int = 120, height: int = 40) -> str:
    """A grey PNG of that size (base64), written with zlib, for a synthetic figure."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    raw = b"".join(b"\0" + b"\x80" * width for _ in range(height))
    data = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return base64.b64encode(data).decode()


ANSWER = "The answer is"
SOLUTION = "SOLUTION-MARK"


def synthetic_notebook(path: pathlib.Path) -> pathlib.Path:
    """A small executed notebook as nbclient saves it: a details answer, a solution cell, a
    widget panel with its saved state (a figure in its Output), a panel with no state, and two
    figures, one with alt metadata."""
    import nbformat
    v4 = nbformat.v4

    def model(name: str, **state) -> dict:
        return {"model_name": name, "model_module": "@jupyter-widgets/controls", "model_module_version": "2.0.0",
                "state": {"_model_name": name, "layout": "IPY_MODEL_lay", **state}}

    def view(model_id: str, text: str):
        return v4.new_output("display_data", data={
            "application/vnd.jupyter.widget-view+json": {"model_id": model_id, "version_major": 2,
                                                         "version_minor": 0}, "text/plain": text})

    figure = v4.new_output("display_data", data={"image/png": png(), "text/plain": "<Figure>"},
                           metadata={"image/png": {"alt": "peak at seq 128"}})
    nb = v4.new_notebook(cells=[
        v4.new_markdown_cell("# Synthetic lesson\n\nWhich category tops the step?\n\n"
                             "<details><summary>Answer</summary>\n\n"
                             f"{ANSWER} **the activations** (`seq x batch`).\n</details>\n\nAfter the block."),
        v4.new_code_cell(f"def solve():\n    return 42  # {SOLUTION}", metadata={"tags": ["solution"]}),
        v4.new_code_cell("check(solve)"),
        v4.new_code_cell("panel", outputs=[view("box", "VBox(children=(HBox(children=(SelectionSlider(...")]),
        v4.new_code_cell("other", outputs=[view("gone", "IntSlider(value=2)")]),
        v4.new_code_cell("bar", outputs=[view("bar", "HBox(children=(HTML(value='measure: 100%'), ...")]),
        v4.new_code_cell("plot", outputs=[
            v4.new_output("display_data", data={"image/png": png()}, metadata={"image/png": {"alt": "a titled plot"}}),
            v4.new_output("display_data", data={"image/png": png()})]),
    ])
    states = {
        "box": model("VBoxModel", children=["IPY_MODEL_row", "IPY_MODEL_status", "IPY_MODEL_out"]),
        "row": model("HBoxModel", children=["IPY_MODEL_seq", "IPY_MODEL_tech", "IPY_MODEL_bits"]),
        "seq": model("SelectionSliderModel", description="seq", _options_labels=["64", "128", "256"], index=1),
        "tech": model("DropdownModel", description="technique", _options_labels=["none", "full"], index=0),
        "bits": model("CheckboxModel", description="8-bit AdamW", value=False),
        "status": model("HTMLModel", value="peak <b>12.0 MiB</b> fits"),
        "out": model("OutputModel", outputs=[figure]),
        "lay": model("LayoutModel"),
        "bar": model("HBoxModel", children=["IPY_MODEL_b1", "IPY_MODEL_b2", "IPY_MODEL_b3"]),   # tqdm's
        "b1": model("HTMLModel", value="measure: 100%"),
        "b2": model("FloatProgressModel", value=4.0, min=0.0, max=4.0),
        "b3": model("HTMLModel", value=" 4/4 [00:01&lt;00:00]"),
    }
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"version_major": 2, "version_minor": 0,
                                                                             "state": states}}
    nbformat.write(nb, path)
    return path


class Page(HTMLParser):
    """A page's text (not its styles or scripts), each piece with the elements it sits in, and
    its images' attributes."""
    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "wbr"}

    def __init__(self, text: str):
        super().__init__()
        self.stack: list[tuple[str, dict]] = []
        self.texts: list[tuple[str, list]] = []
        self.imgs: list[dict] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.imgs.append(dict(attrs))
        if tag not in self.VOID:
            self.stack.append((tag, dict(attrs)))

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                del self.stack[i:]
                break

    def handle_data(self, data):
        if data.strip() and not any(tag in ("style", "script", "title") for tag, _ in self.stack):
            self.texts.append((data, list(self.stack)))

    def around(self, needle: str) -> list[list]:
        """The element stacks around each text piece holding ``needle``."""
        return [stack for data, stack in self.texts if needle in data]

    def text(self) -> str:
        return " ".join(data for data, _ in self.texts)


def details_of(stack: list) -> list[dict]:
    return [attrs for tag, attrs in stack if tag == "details"]


@pytest.fixture(scope="module")
def synthetic_page(tmp_path_factory) -> pathlib.Path:
    tmp = tmp_path_factory.mktemp("synthetic")
    nb = synthetic_notebook(tmp / "99_synthetic.ipynb")
    assert make_site.main(["--no-execute", "--out", str(tmp / "site"), str(nb)]) == 0
    return tmp / "site" / "99_synthetic.html"


def test_answers_render_inside_their_closed_block(synthetic_page):
    page = Page(synthetic_page.read_text())
    (stack,) = page.around(ANSWER)                            # the answer, once...
    (block,) = details_of(stack)                              # ...inside one <details>...
    assert "open" not in block                                # ...that loads closed
    assert any(tag == "strong" for tag, _ in page.around("the activations")[0])   # markdown inside
    assert details_of(page.around("After the block.")[0]) == []   # the block ends where it ends
    assert page.around("Answer") and all(("summary", {}) in s for s in page.around("Answer"))


def test_solution_cells_are_folded_and_others_are_not(synthetic_page):
    page = Page(synthetic_page.read_text())
    (stack,) = page.around(SOLUTION)
    assert [a.get("class") for a in details_of(stack)] == ["memlab-solution"]
    assert "open" not in details_of(stack)[0]
    assert all(details_of(s) == [] for s in page.around("check"))   # the check cell stays open
    assert page.text().count("Solution") == 1


def test_panels_leave_their_figure_and_controls_not_widget_text(synthetic_page):
    text = synthetic_page.read_text()
    page = Page(text)
    assert "children=(" not in text and "IntSlider(" not in text          # no widget repr
    assert "widget-state" not in text and "jupyter-widgets" not in text   # nor the widget manager
    assert [i["alt"] for i in page.imgs] == ["peak at seq 128", "a titled plot", "figure"]
    words = " ".join(page.text().split())
    assert ("controls: seq 64..256 (shown: 128), technique none/full (shown: none), "
            "8-bit AdamW on/off (shown: off)") in words
    assert "peak 12.0 MiB fits" in words                                # the status line
    assert "an interactive panel" in words                              # the one with no saved state
    assert "measure: 100% 4/4 [00:01<00:00]" in words                   # a progress bar: its text
    assert "progress" not in words and words.count("controls:") == 1
    rows = json.loads((synthetic_page.parent / "site.json").read_text())
    assert rows[0]["figures"] == 3 and rows[0]["panels"] == 3


def test_figure_title_names_what_a_figure_shows():
    import matplotlib.pyplot as plt
    spec = importlib.util.spec_from_file_location("site_kernel", ROOT / "tools" / "site_kernel.py")
    site_kernel = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(site_kernel)
    fig, (a, b) = plt.subplots(1, 2)
    assert site_kernel.figure_title(fig) == "figure"
    b.set(xlabel="ranks N", ylabel="% saved")
    assert site_kernel.figure_title(fig) == "% saved against ranks N"
    fig.suptitle("ZeRO savings")
    a.set_title("stage 1")
    b.set_title("stage 1")
    assert site_kernel.figure_title(fig) == "ZeRO savings; stage 1"
    plt.close(fig)


@needs_chromium
def test_synthetic_page_in_chromium_hides_answers_until_opened(synthetic_page, tmp_path):
    seen = open_in_chromium(synthetic_page, tmp_path)
    assert [d["summary"] for d in seen["details"]] == ["Answer", "Solution"]
    check_details(seen["details"])
    assert seen["alts"] == ["peak at seq 128", "a titled plot", "figure"] and not seen["widgetText"]
    assert seen["fetched"] == []


LIVE_PANEL = """import ipywidgets as W
import matplotlib.pyplot as plt
out, slider = W.Output(), W.IntSlider(value=2, min=1, max=64, description="ranks N")
def redraw(change=None):
    with out:
        out.clear_output(wait=True)
        fig, ax = plt.subplots(figsize=(3, 2))
        ax.plot([1, slider.value]); ax.set_title(f"N={slider.value}"); plt.show()
slider.observe(redraw, "value"); redraw()
W.VBox([slider, out])"""


@pytest.mark.slow
def test_a_live_panel_leaves_the_figure_its_cell_drew(tmp_path):
    """Executed: the panel's Output as the displaying cell left it (N=2), not as a later cell
    moved it (N=64), with the kernel's title as alt text."""
    import nbformat
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Live"),
                                         nbformat.v4.new_code_cell(LIVE_PANEL),
                                         nbformat.v4.new_code_cell("slider.value = 64")])
    nbformat.write(nb, tmp_path / "98_live.ipynb")
    assert make_site.main(["--out", str(tmp_path / "site"), "--timeout", "120", str(tmp_path / "98_live.ipynb")]) == 0
    page = Page((tmp_path / "site" / "98_live.html").read_text())
    assert [i["alt"] for i in page.imgs] == ["N=2"]
    assert "controls: ranks N 1..64 (shown: 2)" in " ".join(page.text().split())
    assert "children=(" not in page.text()


@needs_chromium
def test_site_of_lesson_00_loads_offline(tmp_path):
    site = tmp_path / "site"
    assert make_site.main(["--out", str(site), "--only", "00", "--timeout", "300"]) == 0
    check_site(site, tmp_path, ["00_start_here"])


@pytest.mark.slow
@pytest.mark.distributed
@needs_chromium
def test_whole_site_loads_offline(tmp_path):
    site = tmp_path / "site"
    assert make_site.main(["--out", str(site)]) == 0
    check_site(site, tmp_path, sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb")))


ESTIMATE_PANELS = ["TensorParallelPanel('gpt2-medium', seq=1024, batch=1)", "CalculatorPanel('gpt2-xl')",
                   "FinetunePanel('llama-3-8b', 'RTX4090-24GB')", "AdvisorPanel('gpt2-xl', 'A100-40GB')"]


@pytest.mark.parametrize("make", ESTIMATE_PANELS)
def test_each_estimate_panel_shows_its_figure_on_construction(make, monkeypatch):
    """What the site keeps of a panel is what its Output holds: each panel displays one figure
    there when built (TensorParallelPanel drew one and never showed it)."""
    import matplotlib.figure

    from memlab.classroom import widgets
    shown = []
    monkeypatch.setattr(widgets, "display", shown.append)
    panel = eval(make, vars(widgets))
    assert [type(f) for f in shown] == [matplotlib.figure.Figure]
    assert panel.refresh() is panel.data and len(shown) == 2
