"""The notebook watchdog: a planted hang (a cell waiting on a comm reply no frontend sends) is
reported in one line within its bound, the notebook runs again in a fresh kernel, and the run
goes on; a computing kernel is never called stalled; each lesson has its bound on 2 cores."""
import pathlib
import re
import subprocess
import sys

import nbformat
import pytest

from memlab.classroom import collect as classroom
from memlab.classroom import watchdog

ROOT = pathlib.Path(__file__).resolve().parents[1]
BOUND = 3.0   # the planted hangs' watchdog bound, seconds: the tests stay fast

# Opens a comm to a target no headless client handles and waits for its answer: the kernel sits
# busy on a sleeping main thread, and IOPub and the shell say nothing more. With a FLAG file
# given, only the first kernel waits (the retry's kernel finds the file and goes on).
WAITS_ON_A_COMM = """import os, time
from comm import create_comm
answers = []
c = create_comm(target_name="memlab.nobody")
c.on_msg(answers.append)
flag = {flag!r}
if not flag or not os.path.exists(flag):
    if flag:
        open(flag, "w").close()
    while not answers:
        time.sleep(0.1)
print("answered")"""


def notebook(path: pathlib.Path, flag: str = "") -> pathlib.Path:
    cells = [nbformat.v4.new_code_cell("x = 41\nprint('first')"),
             nbformat.v4.new_code_cell(WAITS_ON_A_COMM.format(flag=flag)),
             nbformat.v4.new_code_cell("print('after', x + 1)")]
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def texts(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs)


@pytest.mark.timeout(120)
def test_a_planted_hang_is_reported_in_one_line_and_the_retry_goes_on(tmp_path, capsys):
    path = notebook(tmp_path / "planted.ipynb", flag=str(tmp_path / "waited-once"))
    run = classroom.run_watched(path, cell_timeout=600, stall_seconds=BOUND)
    err = capsys.readouterr().err
    [stall] = run.stalls
    assert (stall.notebook, stall.cell) == ("planted.ipynb", 1)
    assert BOUND <= stall.waited < BOUND + 2          # checked every second of the wait
    assert stall.phase.startswith("busy")             # it went busy, then said nothing
    lines = [line for line in err.splitlines() if line.startswith("watchdog:")]
    assert lines == [stall.line() + "; retrying in a fresh kernel"]
    assert re.search(r"planted\.ipynb cell 1: no reply for \d+ s and the kernel idle \(busy.*kernel pid \d+ ", lines[0])
    # the fresh kernel ran every cell: the retry's state, not the stalled kernel's
    assert [texts(c) for c in run.nb.cells] == ["first\n", "answered\n", "after 42\n"]
    assert run.seconds < 60    # two kernels and one bound, not a 600 s cell timeout


@pytest.mark.timeout(180)
def test_a_hang_every_time_is_recorded_and_the_class_goes_on(tmp_path, capsys):
    """Both kernels wait: the stall is the cell's error, the cells after it are not run, and
    the collector goes on to the next learner."""
    (tmp_path / "ada").mkdir()
    (tmp_path / "bob").mkdir()
    notebook(tmp_path / "ada" / "planted.ipynb")   # no flag: every kernel waits
    good = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print('PASSED fine')  # exercises.check_x()")])
    good.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(good, tmp_path / "bob" / "good.ipynb")
    results = classroom.collect(tmp_path, cell_timeout=600, stall_seconds=BOUND)
    err = capsys.readouterr().err
    assert [(r.student, r.result, r.message) for r in results] == [("bob", "pass", "PASSED fine")]
    stalls = [line for line in err.splitlines() if line.startswith("watchdog: planted.ipynb cell 1:")]
    assert len(stalls) == 2 and stalls[0].endswith("retrying in a fresh kernel")
    assert stalls[1].endswith("gave up, the cells after it not run")
    run = classroom.run_watched(tmp_path / "ada" / "planted.ipynb", 600, stall_seconds=BOUND, retries=0)
    assert [o["ename"] for c in run.nb.cells[1:] for o in c.outputs] == ["KernelStalled"] * 2
    assert texts(run.nb.cells[0]) == "first\n"


class Clock:
    def __init__(self):
        self.t, self.cpu = 100.0, 5.0

    def __call__(self):
        return self.t


def watch_with(clock: Clock, bound: float = 60.0) -> watchdog.StallWatch:
    return watchdog.StallWatch(bound, pid=None, notebook="05.ipynb", clock=clock, cpu=lambda pid: clock.cpu)


def wait(w: watchdog.StallWatch, clock: Clock, seconds: float, share: float = 0.0):
    """``seconds`` pass with the kernel at ``share`` of a core, checked once a second as the
    client's waits check: the first :class:`~memlab.classroom.watchdog.Stall`, or None."""
    while seconds > 0:
        step = min(1.0, seconds)
        clock.t, clock.cpu, seconds = clock.t + step, clock.cpu + share * step, seconds - step
        stall = w.check()
        if stall is not None:
            return stall
    return None


def test_a_computing_kernel_is_never_stalled_an_idle_one_is_at_the_bound():
    clock = Clock()
    w = watch_with(clock)
    clock.t += 1000
    assert w.check() is None                   # before the first cell: the kernel_info wait
    w.start(3)
    w.saw({"msg_type": "status", "content": {"execution_state": "busy"}})
    assert wait(w, clock, 59.9) is None        # under the bound
    clock.t += 0.2
    clock.cpu += 0.06 * 60.1                   # 6% of a core: over IDLE_CPU_SHARE, it computes
    assert w.check() is None
    stall = wait(w, clock, 60, share=0.04)     # 4% of a core for the next bound: idle
    assert stall is not None and stall.cell == 3 and stall.waited == pytest.approx(60)
    assert stall.phase == "busy, then silent"
    w.saw({"msg_type": "status", "content": {"execution_state": "idle"}})
    assert wait(w, clock, 61).phase == "went idle, its execute_reply never came"


def test_a_stopped_watcher_is_no_stall_when_it_resumes():
    """``Ctrl-Z`` on ``memlab class collect``, then ``fg`` ten minutes later: the kernel was stopped
    with it, and the first check after is not a stall; a kernel silent for a bound after is."""
    clock = Clock()
    w = watch_with(clock)
    w.start(2)
    w.saw({"msg_type": "status", "content": {"execution_state": "busy"}})
    assert wait(w, clock, 5, share=1.0) is None
    clock.t += 600                             # stopped: no check, no CPU
    assert w.check() is None
    assert wait(w, clock, 59, share=0.0) is None
    stall = wait(w, clock, 2, share=0.0)
    assert stall is not None and stall.waited == pytest.approx(60)


def test_every_lesson_has_a_bound_and_a_slow_one_is_named():
    bounds = watchdog.notebook_bounds()
    lessons = {p.stem for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert set(bounds) == lessons
    # twice the slowest measured run of course/two-day-plan.md, a minute up: 05's 136 s contended
    assert bounds["05_checkpointing"] == 300
    assert bounds["08_activation_compression"] == 1380      # 2 x 669 s, a minute up
    assert bounds["15_the_table"] == 2220                   # no contended run: 2 x 5 x 220 s
    assert watchdog.over_bound("05_checkpointing", 300) is None
    assert "05_checkpointing took 301 s, over its bound of 300 s" in watchdog.over_bound("05_checkpointing", 300.6)
    assert watchdog.over_bound("my_scratch", 1e6) is None   # not a lesson: no bound
    docs = (ROOT / "docs" / "make.md").read_text()
    for stem, seconds in bounds.items():
        assert f"| `{stem}` | {seconds:.0f} |" in docs, stem


@pytest.mark.timeout(120)
def test_nbval_under_the_watchdog_reports_the_hang_and_retries_the_notebook(tmp_path):
    """``make test``'s nbval run: the same planted hang, the same line, the cell passes on the retry."""
    import os
    import subprocess
    import sys
    path = notebook(tmp_path / "planted.ipynb", flag=str(tmp_path / "waited-once"))
    env = dict(os.environ, MEMLAB_STALL_SECONDS=str(BOUND),
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tools")]))
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "nbval_watchdog",
                           "--nbval", "--nbval-current-env", "--nbval-lax", str(path)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=110)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "3 passed" in done.stdout
    lines = [line for line in done.stdout.splitlines() if line.startswith("watchdog:")]
    assert len(lines) == 2 and lines[0] == lines[1]     # live, and in the closing summary
    assert re.match(r"watchdog: planted\.ipynb cell 1: no reply for 3 s and the kernel idle \(busy", lines[0])
    assert lines[0].endswith("retrying the notebook in a fresh kernel")


# A parent that runs two CPU-bound children one after the other (as ninja runs compilers), then
# waits: its tree's CPU seconds must not fall when a child ends, or a build reads as idle.
BUILD = """
import subprocess, sys, time
burn = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.6: pass"
for _ in range(2):
    subprocess.run([sys.executable, "-c", burn], check=True)
print("built", flush=True)
time.sleep(30)
"""


def test_a_tree_keeps_the_cpu_of_children_that_ended():
    proc = subprocess.Popen([sys.executable, "-c", BUILD], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "built"   # both children burned 0.6 s and ended
        seconds = watchdog.tree_cpu_seconds(proc.pid)
        assert seconds is not None and seconds >= 2 * 0.6  # their time, reaped by the parent
    finally:
        proc.kill()
        proc.wait()
