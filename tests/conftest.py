import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")
REPO = Path(__file__).resolve().parent.parent


def _torchrun(*args: str, timeout: float = 180) -> str:
    """``torchrun --standalone --nproc-per-node 2 -m ARGS`` (gloo on CPU); its stdout."""
    # faulthandler: a rank that aborts shows where (its Python stack, or that it had none)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", "-m", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)
    err = done.stderr if len(done.stderr) < 6000 else done.stderr[:2000] + "\n...\n" + done.stderr[-4000:]
    assert done.returncode == 0, f"exit {done.returncode}; stdout ends {done.stdout[-300:]!r}\n{err}"
    return done.stdout


@pytest.fixture
def torchrun():
    """Run a module under torchrun with two CPU ranks and return its stdout."""
    return _torchrun


@pytest.fixture
def no_memlab_scratch_left(tmp_path, monkeypatch):
    """The temporary folder is a fresh one for the test, and no ``memlab-*`` folder is left in it
    after: a real loop's scratch (Trainer wants an output folder) goes when the call returns.
    Datasets and inductor keep their own folders there."""
    import tempfile
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    yield
    assert [p.name for p in scratch.iterdir() if p.name.startswith("memlab-")] == []
