"""The course kit: the syllabus covers the notebooks, and a class's GPU share survives a
budgeted measurement."""
import pathlib
import re
from types import SimpleNamespace

import pytest
import torch

from memlab.lenses import measure

ROOT = pathlib.Path(__file__).resolve().parents[1]
COURSE = ROOT / "course"


def test_syllabus_names_every_notebook_and_no_other():
    text = (COURSE / "syllabus.md").read_text()
    notebooks = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks, "no notebooks found"
    missing = [n for n in notebooks if n not in text]
    assert missing == [], f"syllabus.md does not name {missing}"
    named = set(re.findall(r"\b\d\d_[a-z0-9_]+\.ipynb\b", text))
    unknown = named - set(notebooks)
    assert not unknown, f"syllabus.md names notebooks that do not exist: {unknown}"


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


# --- the learner's copy survives `make student` and `make clean` ----------------------------

def _make(tmp, *args):
    import subprocess
    import sys
    out = subprocess.run(["make", "-s", *args, f"PYTHON={sys.executable}", f"PY={sys.executable}"],
                         cwd=tmp, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.fixture
def repo_copy(tmp_path):
    """The Makefile, tools/ and two notebooks in a scratch folder, so `make clean` runs there."""
    import shutil
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    shutil.copytree(ROOT / "tools", tmp_path / "tools")
    (tmp_path / "notebooks").mkdir()
    for name in ("00_start_here.ipynb", "05_checkpointing.ipynb"):
        shutil.copy(ROOT / "notebooks" / name, tmp_path / "notebooks" / name)
    return tmp_path


def test_student_edit_survives_make_student_and_make_clean(repo_copy):
    import json
    _make(repo_copy, "student")
    target = repo_copy / "student" / "05_checkpointing.ipynb"
    nb = json.loads(target.read_text())
    cell = next(c for c in nb["cells"] if "exercise" in c["metadata"].get("tags", []))
    cell["source"] = ["class CheckpointedBlock: pass  # my answer"]
    target.write_text(json.dumps(nb, indent=1))
    untouched = (repo_copy / "student" / "00_start_here.ipynb").read_text()

    # a new edition of both notebooks arrives
    for name in ("00_start_here.ipynb", "05_checkpointing.ipynb"):
        src = repo_copy / "notebooks" / name
        fresh = json.loads(src.read_text())
        fresh["cells"][0]["source"] = ["# Revised\n"] + fresh["cells"][0]["source"]
        src.write_text(json.dumps(fresh, indent=1))
    said = _make(repo_copy, "student")
    _make(repo_copy, "clean")

    assert "my answer" in target.read_text()                     # the learner's work is kept
    beside = repo_copy / "student" / "05_checkpointing.new.ipynb"
    assert beside.exists() and "# Revised" in beside.read_text()  # the new edition beside it
    assert "05_checkpointing.new.ipynb" in said                   # and the learner is told
    fresh00 = (repo_copy / "student" / "00_start_here.ipynb").read_text()
    assert fresh00 != untouched and "# Revised" in fresh00       # untouched: simply updated
    assert not (repo_copy / "student" / "00_start_here.new.ipynb").exists()

    _make(repo_copy, "student", "FORCE=1")                        # forcing replaces it
    assert "my answer" not in target.read_text() and "# Revised" in target.read_text()


def test_make_lab_opens_the_learners_edition_and_solutions_on_request(repo_copy):
    """Plain `make lab` makes student/ (blank exercises) and opens it; EDITION=solutions opens
    notebooks/ as committed, EDITION=instructor the answer-key edition; any other edition stops
    before installing anything."""
    import shutil
    import subprocess
    import sys
    for name in ("pyproject.toml", "constraints.txt"):
        shutil.copy(ROOT / name, repo_copy / name)

    def plan(*args):
        # --no-print-directory: under `make test` the child make would add "Leaving directory"
        return subprocess.run(["make", "--no-print-directory", "-n", "lab", *args,
                               f"PY={sys.executable}", f"PYTHON={sys.executable}"],
                              cwd=repo_copy, capture_output=True, text=True)

    runs = {"default": plan()} | {e: plan(f"EDITION={e}") for e in ("student", "instructor", "solutions")}
    assert all(r.returncode == 0 for r in runs.values()), {e: r.stderr for e, r in runs.items()}
    out = {e: r.stdout for e, r in runs.items()}
    assert out["default"] == out["student"]                       # the learner's edition by default
    assert "tools/make_student.py --out student" in out["student"]
    last = out["student"].splitlines()[-1]
    assert "jupyter lab" in last and last.endswith(" student/")
    assert out["instructor"].splitlines()[-1].endswith(" build/instructor/")
    assert out["solutions"].splitlines()[-1].endswith(" notebooks/") and "make_student" not in out["solutions"]
    wrong = plan("EDITION=solution")
    assert wrong.returncode != 0 and "allowed: student solutions instructor" in wrong.stderr
    assert "pip install" not in wrong.stdout
