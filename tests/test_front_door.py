"""The front door (``import memlab as ml``) and how a MemoryReport shows itself."""
import json
import pathlib
import re
import subprocess
import sys
from html.parser import HTMLParser

import pytest

import memlab as ml
from memlab.step.training_step import MemoryReport, StepConfig
from memlab.tracking.tracker import CATEGORIES, Event, OOMInfo

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def test_import_memlab_loads_no_heavy_optional_dependency():
    """DeepSpeed, the notebook stack and matplotlib load only where used (import cost)."""
    heavy = ["deepspeed", "ipywidgets", "IPython", "matplotlib", "transformers", "peft"]
    code = f"import sys, memlab; print([m for m in {heavy!r} if m in sys.modules])"
    # from the repository root: this checkout's memlab, not an installed one
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=ROOT)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr[-2000:]


def test_all_names_resolve_and_leave_plumbing_out():
    missing = [n for n in ml.__all__ if not hasattr(ml, n)]
    assert missing == []
    assert len(set(ml.__all__)) == len(ml.__all__)
    for name in ("estimate_step", "simulate_step", "measure_step", "advise", "measure_distributed",
                 "simulate_sharded", "MemoryReport", "StepConfig", "GPTConfig", "MiB", "GiB",
                 "fmt_bytes", "InputError"):
        assert name in ml.__all__, name
    for plumbing in ("Placement", "pick_device"):
        assert plumbing not in ml.__all__ and not hasattr(ml, plumbing), plumbing
    from memlab.core.hardware import Placement, pick_device  # still importable from their module
    assert Placement and pick_device


def _notebook_code() -> str:
    cells = []
    for nb in sorted(NOTEBOOKS.glob("*.ipynb")):
        cells += ["".join(c["source"]) for c in json.loads(nb.read_text())["cells"]
                  if c["cell_type"] == "code"]
    return "\n".join(cells)


def test_every_name_the_notebooks_take_from_the_front_door_exists():
    """Each ``ml.NAME`` in a notebook code cell (``import memlab as ml``) resolves."""
    used = set(re.findall(r"\bml\.([A-Za-z_]\w*)", _notebook_code()))
    assert used, "no ml.NAME found: has the notebooks' alias changed?"
    assert sorted(n for n in used if not hasattr(ml, n)) == []


# -- MemoryReport: what a learner reads -------------------------------------------------------
def _event(i: int, phase: str, **bytes_by_cat) -> Event:
    return Event(i, "op", "mod", phase, tuple(bytes_by_cat.get(c, 0) for c in CATEGORIES))


def _report(**kw) -> MemoryReport:
    """A hand-made report: activations reach 7 MiB at the end of forward, but the peak
    (the optimizer step) holds parameters 4 + gradients 4 + optimizer 8 = 16 MiB."""
    MiB = 2**20
    timeline = [_event(0, "forward", parameters=4 * MiB, optimizer=8 * MiB, activations=7 * MiB),
                _event(1, "backward", parameters=4 * MiB, optimizer=8 * MiB, gradients=4 * MiB,
                       activations=MiB),
                _event(2, "optimizer", parameters=4 * MiB, optimizer=8 * MiB, gradients=4 * MiB)]
    base = dict(lens="measure", step=StepConfig(), device="cpu", peak_bytes=19 * MiB,
                by_category={"parameters": 4 * MiB, "gradients": 4 * MiB, "optimizer": 8 * MiB,
                             "activations": 3 * MiB}, timeline=timeline)
    return MemoryReport(**{**base, **kw})


def test_largest_category_reads_the_whole_step_not_only_the_peak():
    r = _report()
    # at the peak the split says optimizer 8 MiB is largest; over the step it still is,
    # and activations reach 7 MiB (end of forward), not the 3 MiB of the peak's split
    assert r.largest_category() == ("optimizer", 8 * 2**20)
    assert r.category_peaks()["activations"] == 7 * 2**20
    assert r.category_peaks()["gradients"] == 4 * 2**20
    bigger = _report(timeline=r.timeline + [_event(3, "forward", activations=9 * 2**20)])
    assert bigger.largest_category() == ("activations", 9 * 2**20)


def test_largest_category_without_a_timeline_is_the_peaks_split():
    r = ml.estimate_step(StepConfig(seq=64, batch=2))
    name, nbytes = r.largest_category()
    assert nbytes == max(r.by_category.values()) and r.by_category[name] == nbytes


def test_mib_is_bytes_over_two_to_the_twenty():
    r = _report(peak_bytes=7 * 2**19)  # 3.5 MiB
    assert r.mib() == 3.5
    assert r.mib("optimizer") == 8.0
    assert r.mib("workspace") == 0.0
    with pytest.raises(ml.InputError, match="unknown category 'weights'; allowed: parameters"):
        r.mib("weights")


class _Cells(HTMLParser):
    def __init__(self):
        super().__init__()
        self.rows, self.caption, self.items, self._where = [], "", [], None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        self._where = tag if tag in ("td", "caption", "li", "p") else self._where

    def handle_endtag(self, tag):
        self._where = None if tag in ("td", "caption", "li", "p") else self._where

    def handle_data(self, data):
        if self._where == "td":
            self.rows[-1].append(data)
        elif self._where == "caption":
            self.caption += data
        elif self._where in ("li", "p"):
            self.items.append(data)


def test_html_table_shows_each_category_its_share_the_budget_and_escaped_notes():
    r = _report(budget_bytes=16 * 2**20, notes=["softmax <fp32> kept"])
    cells = _Cells()
    cells.feed(r._repr_html_())
    table = {row[0]: row[1:] for row in cells.rows if row}
    assert list(table)[:len(CATEGORIES)] == list(CATEGORIES)
    assert table["optimizer"] == ["8.00 MiB", "42%"]     # 8 of 19 MiB
    assert table["activations"] == ["3.00 MiB", "16%"]   # 3 of 19 MiB
    assert table["peak"][0] == "19.00 MiB"
    assert table["budget"] == ["16.00 MiB", "does NOT fit"]  # 19 > 16
    assert "measure" in cells.caption and "cpu" in cells.caption
    assert cells.items == ["softmax <fp32> kept"]  # escaped in the HTML, read back whole
    assert "<fp32>" not in r._repr_html_()


def test_repr_is_one_line_with_lens_device_peak_and_verdict():
    oom = OOMInfo("aten::mm", "lm_head", "forward", 2**20, 15 * 2**20, 16 * 2**20, "over budget")
    r = _report(budget_bytes=16 * 2**20, oom=oom)
    text = repr(r)
    assert "\n" not in text
    assert text.startswith("<MemoryReport measure on cpu: peak 19.00 MiB (optimizer 8.00 MiB")
    assert "does NOT fit (out of memory)" in text
    s = str(_report(notes=["peak moment: optimizer step"]))
    assert s.splitlines()[-1] == "  note: peak moment: optimizer step"
    assert "  peak            19.00 MiB" in s
