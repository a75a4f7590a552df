"""`memlab class collect`: the student edition with the reference solutions filled in passes
every checker; left empty, every checker fails with a message. Each notebook really runs."""
import csv
import importlib.util
import json
import pathlib
import sys

import pytest

from memlab.classroom import collect as classroom
from memlab.core.errors import InputError

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))  # make_student imports its neighbour student_stub
_spec = importlib.util.spec_from_file_location("make_student", ROOT / "tools" / "make_student.py")
make_student = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_student)

FAST = ["02_baseline_oom.ipynb"]
SLOW = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb")
              if p.name not in FAST and any(make_student.is_solution(c) for c in json.loads(p.read_text())["cells"]))


def editions(name: str) -> tuple[dict, dict, int]:
    """The student edition of ``name``: as handed out (empty) and with the reference filled in."""
    nb = json.loads((ROOT / "notebooks" / name).read_text())
    reference = {c["id"]: c["source"] for c in nb["cells"] if make_student.is_solution(c)}
    empty, n = make_student.studentize(nb)
    filled = json.loads(json.dumps(empty))
    for cell in filled["cells"]:
        if "exercise" in cell["metadata"].get("tags", []):
            cell["source"] = reference[cell["id"]]
    return empty, filled, n


def run_class(tmp_path, names):
    expected = {}
    for name in names:
        empty, filled, n = editions(name)
        for student, nb in (("ada", filled), ("bob", empty)):
            (tmp_path / "submitted" / student).mkdir(parents=True, exist_ok=True)
            (tmp_path / "submitted" / student / name).write_text(json.dumps(nb))
        expected[name] = n
    out = tmp_path / "results.csv"
    assert classroom.main([str(tmp_path / "submitted"), "--out", str(out), "--timeout", "600"]) == 0
    rows = list(csv.DictReader(out.open()))
    for name, n in expected.items():
        ada = [r for r in rows if r["student"] == "ada" and r["notebook"] == name]
        bob = [r for r in rows if r["student"] == "bob" and r["notebook"] == name]
        assert len(ada) == len(bob) == n            # one row per "Your turn" checker
        assert [r["result"] for r in ada] == ["pass"] * n, ada
        assert all(r["message"].startswith("PASSED") for r in ada), ada
        assert [r["result"] for r in bob] == ["fail"] * n, bob
        assert all(r["message"] and r["message"] != "passed" for r in bob), bob
    md = out.with_suffix(".md").read_text()
    assert md.count("\n| ada |") + md.count("\n| bob |") == len(rows)
    return rows


def test_filled_pass_empty_fail(tmp_path):
    rows = run_class(tmp_path, FAST)
    bob = [r for r in rows if r["student"] == "bob"]
    # the empty cell's stub (`fixed = None`): the checker itself says what to write, and where
    assert all(r["message"].startswith("CheckFailed: ") and "write `fixed` in the cell above" in r["message"]
               for r in bob), bob
    assert all(r["exercise"].startswith("Your turn") for r in rows)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", SLOW)
def test_filled_pass_empty_fail_every_notebook(tmp_path, name):
    run_class(tmp_path, [name])


def test_a_wrong_answer_fails_with_the_checkers_message(tmp_path):
    """Only the checker cells run here: a learner's wrong gradient accumulation (no division by k)."""
    nb = json.loads((ROOT / "notebooks" / "06_accumulation_and_dynamic_batch.ipynb").read_text())
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    check = next(c for c in cells if "exercises.check_accumulation" in "".join(c["source"]))
    wrong = ("K = 4\n"
             "def accumulate(model, optimizer, batch, k):\n"
             "    for idx, tgt in zip(*(t.chunk(k) for t in batch)):\n"
             "        model(idx, tgt).backward()      # forgot / k\n"
             "    optimizer.step()\n"
             "    optimizer.zero_grad(set_to_none=True)\n")
    small = {"cells": [{"cell_type": "code", "id": "a", "metadata": {}, "outputs": [], "execution_count": None,
                        "source": [wrong]}, dict(check, outputs=[], execution_count=None)],
             "metadata": nb["metadata"], "nbformat": 4, "nbformat_minor": 5}
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "06.ipynb").write_text(json.dumps(small))
    results = classroom.collect(tmp_path / "in", cell_timeout=300)
    assert [(r.student, r.result) for r in results] == [("-", "fail")]
    assert results[0].message.startswith("CheckFailed"), results[0].message


def test_bad_folder_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        classroom.collect(tmp_path / "nope")
    with pytest.raises(InputError, match="no notebooks"):
        classroom.collect(tmp_path)


def test_the_verdict_is_the_checkers_line_not_a_librarys_noise():
    """A checker cell that first built a DeepSpeed op: the build's lines come before the result."""
    cell = {"outputs": [
        {"output_type": "stream", "name": "stderr", "text": "[WARNING] cpu_adam: building\n"},
        {"output_type": "stream", "name": "stdout", "text": "/usr/bin/ld: cannot find -laio\n"},
        {"output_type": "execute_result", "data": {"text/plain": "PASSED offload: 16 B/param / N\n  host ok"}}]}
    assert classroom.cell_outcome(cell) == ("pass", "PASSED offload: 16 B/param / N")
    noisy_only = {"outputs": [{"output_type": "stream", "name": "stderr", "text": "warning\n"}]}
    assert classroom.cell_outcome(noisy_only) == ("pass", "passed")
    failed = {"outputs": [{"output_type": "error", "ename": "CheckFailed", "evalue": "zero: stage 1, not 2",
                           "traceback": []}]}
    assert classroom.cell_outcome(failed) == ("fail", "CheckFailed: zero: stage 1, not 2")
