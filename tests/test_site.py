"""`make site`: lesson pages with their outputs and figures, opened in headless Chromium with
every host unresolvable and no proxy reachable, so anything fetched from a network fails."""
import importlib.util
import json
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("make_site", ROOT / "tools" / "make_site.py")
make_site = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_site)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (.ci/run installs it "
                                    "with apt-get; or: apt-get install chromium)")
PROBE = """<script>window.addEventListener("load", function () {
  var p = document.createElement("pre"); p.id = "memlab-probe";
  p.textContent = JSON.stringify({title: document.title, text: document.body.innerText.length,
    imgs: Array.from(document.images).map(function (i) { return i.naturalWidth; }),
    links: Array.from(document.links).map(function (a) { return a.getAttribute("href"); }),
    fetched: performance.getEntriesByType("resource").map(function (r) { return r.name; })});
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


def test_offline_strips_every_cdn_script():
    import nbformat
    nb = nbformat.read(ROOT / "notebooks" / "00_start_here.ipynb", as_version=4)
    page = make_site.render(nb, "<nav></nav>")
    assert "cdnjs" not in page and "<script" not in page          # require.js, MathJax, mermaid gone
    assert f"<title>{make_site.title_of(nb)}</title>" in page


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
