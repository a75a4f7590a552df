"""tools/colab_cell.py: the install cell goes in once, after the title, is updated in place,
and does nothing where memlab is importable."""
import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("colab_cell", ROOT / "tools" / "colab_cell.py")
cc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cc)
SRC = "git+https://example.invalid/memlab"


def test_insert_then_idempotent_then_update(tmp_path):
    nb_path = tmp_path / "00.ipynb"
    shutil.copy(ROOT / "notebooks" / "00_start_here.ipynb", nb_path)
    before = json.loads(nb_path.read_text())
    assert cc.main(["--source", SRC, str(nb_path)]) == 0
    once = json.loads(nb_path.read_text())
    assert len(once["cells"]) == len(before["cells"]) + 1
    assert once["cells"][0] == before["cells"][0]                      # the title stays first
    assert cc.TAG in once["cells"][1]["metadata"]["tags"]
    assert cc.main(["--source", SRC, str(nb_path)]) == 0                # again: nothing added
    assert json.loads(nb_path.read_text()) == once
    assert cc.main(["--check", "--source", SRC, str(nb_path)]) == 0
    assert cc.main(["--check", "--source", SRC + "2", str(nb_path)]) == 1  # stale source
    assert cc.main(["--source", SRC + "2", str(nb_path)]) == 0
    twice = json.loads(nb_path.read_text())
    assert len(twice["cells"]) == len(once["cells"]) and SRC + "2" in "".join(twice["cells"][1]["source"])
    assert len({c["id"] for c in twice["cells"]}) == len(twice["cells"])


def test_cell_is_a_no_op_where_memlab_imports(tmp_path):
    # the pip call would fail (the source does not exist): running cleanly proves it is skipped
    done = subprocess.run([sys.executable, "-c", cc.cell_source(SRC)], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "pip" not in done.stdout + done.stderr


def test_cell_installs_where_memlab_is_missing(tmp_path):
    # a Python that cannot import memlab runs pip with the source (it fails: no network, bad host)
    code = "import sys; sys.path = [p for p in sys.path if 'klass' not in p and 'site-packages' not in p]\n"
    code += "sys.meta_path = [f for f in sys.meta_path if 'editable' not in type(f).__name__.lower()]\n"
    done = subprocess.run([sys.executable, "-S", "-c", code + cc.cell_source(SRC)], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode != 0 and "CalledProcessError" in done.stderr, done.stderr[-500:]
