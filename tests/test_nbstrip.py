"""tools/nbstrip.py: notebooks are committed stripped, all on the kernel ipykernel ships."""
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "nbstrip.py"


def _run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True)


def test_committed_notebooks_pass_the_check():
    done = _run("--check")
    assert done.returncode == 0, done.stdout


def test_another_kernelspec_fails_the_check_and_strip_fixes_it(tmp_path):
    nb = {"cells": [{"cell_type": "code", "metadata": {}, "source": "1", "outputs": [],
                     "execution_count": None}],
          "metadata": {"kernelspec": {"name": "memlab", "display_name": "Python (memlab)",
                                      "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "x.ipynb"
    path.write_text(json.dumps(nb))
    done = _run("--check", path)
    assert done.returncode == 1 and "kernelspec" in done.stdout
    assert _run(path).returncode == 0
    assert json.loads(path.read_text())["metadata"]["kernelspec"]["name"] == "python3"
    assert _run("--check", path).returncode == 0
