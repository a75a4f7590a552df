"""A plain (non-editable) install works outside the repository: the package carries its data."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """Build a wheel of this checkout and install it into a folder of its own."""
    tmp = tmp_path_factory.mktemp("install")
    wheels, site = tmp / "wheels", tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), str(ROOT)], check=True, capture_output=True)
    wheel = next(wheels.glob("memlab-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(site), str(wheel)], check=True, capture_output=True)
    # the venv's own torch and friends, but memlab only from the installed wheel
    env = dict(os.environ, PYTHONPATH=str(site), MPLBACKEND="Agg")
    return {"cwd": tmp, "site": site, "env": env}


def _memlab(installed, *args) -> subprocess.CompletedProcess:
    code = "import sys; from memlab.app.cli import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=installed["cwd"],
                          env=installed["env"], capture_output=True, text=True, timeout=600)


def test_wheel_carries_its_data(installed):
    data = installed["site"] / "memlab" / "data"
    assert (data / "corpus.txt").stat().st_size > 100_000
    assert (data / "reference" / "NVIDIA-H200" / "devset.json").is_file()


def test_installed_measure_runs_outside_the_repository(installed):
    done = _memlab(installed, "measure", "--model", "tiny", "--seq", "64", "--batch", "2", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["lens"] == "measure" and out["peak_bytes"] > 0
    where = subprocess.run([sys.executable, "-c", "import memlab; print(memlab.__file__)"],
                           cwd=installed["cwd"], env=installed["env"], capture_output=True, text=True)
    assert where.stdout.strip().startswith(str(installed["site"]))


@pytest.mark.slow
def test_installed_report_runs_outside_the_repository(installed):
    out = installed["cwd"] / "report"
    done = _memlab(installed, "report", "--out", str(out), "--no-distributed",
                   "--seq", "64", "--batch", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert {"table.md", "table.json", "table.png"} <= {p.name for p in out.iterdir()}
