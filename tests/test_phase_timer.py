"""`make test` prints the time of each phase (tools/phase_timer.py), failed or not."""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMER = ROOT / "tools" / "phase_timer.py"


def _run(*phases: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TIMER), *phases], capture_output=True, text=True,
                          timeout=60)


def test_each_phase_is_timed_and_the_first_failure_stops_the_run():
    done = _run("quick=true", "slow=sleep 0.6", "broken=exit 3", "after=true")
    assert done.returncode == 3
    rows = dict(re.findall(r"^  (\w+) +(.+)$", done.stdout, re.M))
    assert rows["quick"].endswith("ok") and rows["after"].endswith("not run")
    assert rows["broken"].endswith("FAILED (exit 3)")
    slow = float(rows["slow"].split()[0])
    assert 0.6 <= slow < 5.0  # sleep's own 0.6 s, measured
    assert float(rows["total"].split()[0]) >= slow


def test_a_malformed_phase_is_refused():
    done = _run("no command here")
    assert done.returncode == 2 and "NAME=COMMAND" in done.stderr


def test_make_test_runs_the_four_phases_through_the_timer():
    out = subprocess.run(["make", "-n", "test", "PY=" + sys.executable, "STAMP="], capture_output=True,
                         text=True, cwd=ROOT, timeout=60).stdout
    line = next(ln for ln in out.splitlines() if "phase_timer.py" in ln)
    joined = out[out.index(line):]
    for phase in ("lint=", "package tests=", "notebooks=", "rank notebooks="):
        assert phase in joined, phase
