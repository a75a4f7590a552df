"""The student copy: an unanswered exercise meets its check cell with the checker's own
message naming what to write and where, not a NameError."""
import ast
import json
import pathlib
import subprocess
import sys

import pytest

from memlab.classroom import exercises as ex
from memlab.classroom.exercises import CheckFailed

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from student_stub import defined_names, student_source  # noqa: E402  (tools/ is on sys.path only from the line above)


def test_defined_names_are_the_top_level_answers():
    src = ("from torch.utils.checkpoint import checkpoint\n\nclass CheckpointedBlock(Block):\n"
           "    def forward(self, x):\n        y = x\n        return y\n\n"
           "def helper(): pass\nfixed, other = 1, 2\nlimit: int = 3\nfixed = 4\n")
    assert defined_names(src) == [("CheckpointedBlock", "a class"), ("helper", "a function"),
                                  ("fixed", "a value"), ("other", "a value"), ("limit", "a value")]
    lines = student_source(src.splitlines(keepends=True))
    assert lines[0] == "# your code here\n"
    assert lines[1].startswith("CheckpointedBlock = None  # your code here: a class")
    ns = {}
    exec("".join(lines), ns)  # the stub runs, and defines every name as None
    assert all(ns[n] is None for n, _ in defined_names(src))
    assert student_source("%timeit x") == ["# your code here"]


@pytest.mark.parametrize("call, name", [
    (lambda: ex.check_checkpointed_block(None), "CheckpointedBlock"),
    (lambda: ex.check_amp_step(None), "amp_step"),
    (lambda: ex.check_accumulation(None), "accumulate"),
    (lambda: ex.check_pack_hooks(None), "make_hooks"),
    (lambda: ex.check_oom_fix(None, None, "120MiB"), "fixed"),
    (lambda: ex.check_tensor_parallel(None, None), "make_shards"),
    (lambda: ex.check_checkpointed_block(3), "CheckpointedBlock"),  # not a class either
])
def test_a_checker_given_the_stub_names_what_to_write(call, name):
    with pytest.raises(CheckFailed, match=f"write `{name}` in the cell above"):
        call()


def test_student_copy_stubs_every_name_its_check_cell_reads(tmp_path):
    done = subprocess.run([sys.executable, "tools/make_student.py", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    checked = 0
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        original = json.loads(path.read_text())["cells"]
        student = json.loads((tmp_path / path.name).read_text())["cells"]
        for i, cell in enumerate(original):
            if "solution" not in cell["metadata"].get("tags", []):
                continue
            defined = {n for n, _ in defined_names("".join(cell["source"]))}
            stub = {}
            exec("".join(student[i]["source"]), stub)
            reads = {n.id for n in ast.walk(ast.parse("".join(original[i + 1]["source"])))
                     if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
            assert defined & reads <= {k for k, v in stub.items() if v is None}, path.name
            checked += 1
    assert checked >= 5
