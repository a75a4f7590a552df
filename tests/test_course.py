"""The course kit: the syllabus covers the notebooks, and a class's GPU share survives a
budgeted measurement."""
import pathlib
import re
from types import SimpleNamespace

import pytest
import torch

from memlab import measure

ROOT = pathlib.Path(__file__).resolve().parents[1]
COURSE = ROOT / "course"


def test_syllabus_names_every_notebook_and_no_other():
    text = (COURSE / "syllabus.md").read_text()
    notebooks = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks, "no notebooks found"
    missing = [n for n in notebooks if n not in text]
    assert missing == [], f"syllabus.md does not name {missing}"
    named = set(re.findall(r"\b\d\d_[a-z0-9_]+\.ipynb\b", text))
    assert named <= set(notebooks), f"syllabus.md names notebooks that do not exist: {named - set(notebooks)}"


def test_course_documents_exist_and_link_the_syllabus():
    for name in ("syllabus.md", "instructor-notes.md", "running-a-class.md"):
        assert (COURSE / name).read_text().startswith("# "), name
    assert "syllabus.md" in (COURSE / "running-a-class.md").read_text()


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA device of 1000 bytes whose per-process fraction we can read back."""
    state = {"fraction": 1.0, "set": []}

    def set_fraction(fraction, device=None):
        state["fraction"] = fraction
        state["set"].append(fraction)

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=1000))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d=None: state["fraction"])
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    return state


def test_budget_below_the_class_cap_applies_then_the_cap_returns(fake_cuda):
    fake_cuda["fraction"] = 0.25               # the instructor's share: 250 of 1000 bytes
    with measure.cuda_budget(100):
        assert fake_cuda["fraction"] == pytest.approx(0.1)
    assert fake_cuda["fraction"] == 0.25       # not lifted to the whole card


def test_budget_above_the_class_cap_keeps_the_cap(fake_cuda):
    fake_cuda["fraction"] = 0.25
    with measure.cuda_budget(600):
        assert fake_cuda["fraction"] == 0.25   # a budget never raises the ceiling
    assert fake_cuda["fraction"] == 0.25


def test_no_budget_touches_nothing(fake_cuda):
    with measure.cuda_budget(None):
        pass
    assert fake_cuda["set"] == []
