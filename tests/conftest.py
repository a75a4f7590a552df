import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")
REPO = Path(__file__).resolve().parent.parent


def _torchrun(*args: str, timeout: float = 180) -> str:
    """``torchrun --standalone --nproc-per-node 2 -m ARGS`` (gloo on CPU); its stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", "-m", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture
def torchrun():
    """Run a module under torchrun with two CPU ranks and return its stdout."""
    return _torchrun
