"""tools/relayout.py's name rules: each old reference to a moved module becomes its new home,
a new reference stays as it is (so a second run changes nothing), and a module the mapping does
not know stops the run."""
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("relayout", ROOT / "tools" / "relayout.py")
relayout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(relayout)

#: old text -> the text after the move (each written by hand from MOVES)
CASES = {
    "from memlab.hf import load_config": "from memlab.hf.config import load_config",
    "from memlab import hf": "from memlab.hf import config as hf",
    "from memlab import tracking, units": "from memlab.tracking import tracker as tracking\n"
                                          "from memlab.core import units",
    "from memlab.distributed import zero, fsdp": "from memlab.step import zero\nfrom memlab.distributed import fsdp",
    "from memlab.tracking import MemoryTracker": "from memlab.tracking.tracker import MemoryTracker",
    'mock.patch("memlab.hardware.pick_device")': 'mock.patch("memlab.core.hardware.pick_device")',
    "python -m memlab.distributed tp": "python -m memlab.distributed tp",
    'memlab = "memlab.cli:main"': 'memlab = "memlab.app.cli:main"',
    "see `memlab/distributed/zero.py` and `memlab/exercises/`":
        "see `memlab/step/zero.py` and `memlab/classroom/exercises/`",
    "class B(ml.models.Block):": "class B(ml.models.gpt_unet.Block):",
    ":mod:`memlab.exercises.zero`": ":mod:`memlab.classroom.exercises.zero`",
    "ml.estimate_step(cfg)": "ml.estimate_step(cfg)",
    'code = "import sys; from memlab.cli import main; sys.exit(main())"':
        'code = "import sys; from memlab.app.cli import main; sys.exit(main())"',
    'code = "from memlab import estimate, units"':
        'code = "from memlab.lenses import estimate; from memlab.core import units"',
    "    from memlab.callbacks import MemoryCallback  # imports transformers":
        "    from memlab.hf.callbacks import MemoryCallback  # imports transformers",
    "from memlab.policy import emulate": "from memlab.policy import emulate",
    "import memlab.tracking\nmemlab.tracking.MemoryTracker":
        "import memlab.tracking.tracker\nmemlab.tracking.tracker.MemoryTracker",
}


@pytest.mark.parametrize("old", CASES)
def test_an_old_reference_moves_and_a_new_one_stays(old):
    new = relayout.rewrite_python(old, None)
    assert new == CASES[old]
    assert relayout.rewrite_python(new, None) == new  # a second run changes nothing


def test_relative_imports_become_absolute_from_the_files_old_place():
    src = "from ..errors import InputError\nfrom .ranks import run_ranks\nfrom . import zero\n"
    assert relayout.rewrite_python(src, ["distributed"]) == (
        "from memlab.core.errors import InputError\nfrom memlab.distributed.ranks import run_ranks\n"
        "from memlab.step import zero\n")


def test_a_module_the_mapping_does_not_know_is_listed(tmp_path, monkeypatch):
    (tmp_path / "hf").mkdir()
    for rel in ("__init__.py", "errors.py", "hf/__init__.py", "hf/config.py", "brand_new.py", "hf/extra.py"):
        (tmp_path / rel).write_text("")
    monkeypatch.setattr(relayout, "PACKAGE", tmp_path)
    assert relayout.unknown_modules() == ["brand_new", "hf.extra"]
    assert relayout.run(dry=True) == 2


def test_every_move_lands_in_a_package_of_the_layer_order():
    assert {new.split(".")[0] for new in relayout.MOVES.values()} <= set(relayout.PACKAGES)
    assert len(set(relayout.MOVES.values())) == len(relayout.MOVES)  # no two modules share a home


def test_the_tree_is_laid_out_in_layer_packages():
    """``relayout.py --check``: no flat module in memlab/, LAYERS one layer per package in
    PACKAGES' order, and no module importing a package above its own."""
    assert relayout.check() == []
    assert sorted(p.name for p in relayout.PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(
        [*relayout.PACKAGES, "data"])  # `ls memlab/` shows the layers
