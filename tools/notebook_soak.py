"""Run notebooks the way the site and the class collector do, many times, and count the runs
that stall: the reproduction of a kernel wait that never ends (memlab.classroom.watchdog).

    nice python tools/notebook_soak.py --runs 50                      # the small widget notebook
    nice python tools/notebook_soak.py --runs 3 notebooks/00_start_here.ipynb
    nice python tools/notebook_soak.py --runs 50 --mode plain         # nbclient as main ran it

Each run is its own process with the site's kernel environment (inline figures, the alt-text
``PYTHONSTARTUP``, no progress bars) and the site's ``after_cell`` (each cell's widget state
read and frozen). ``--mode watched`` (default) runs ``memlab.classroom.collect.run_watched`` with no
retry: a stall is reported by the watchdog in its line. ``--mode plain`` runs the loop the
site ran before the watchdog (``setup_kernel`` + ``execute_cell``, nothing watching): a run
that outlives ``--limit`` seconds (default: ten times the notebook's bound, at least 600 s)
is killed and counted as hung; one that ends after ``--bound`` seconds (default: the notebook's
bound on 2 cores, ``memlab/data/notebook_bounds.txt``; 120 s for the small notebook) is counted
as slow, not hung: on a machine other jobs share, a run can take longer than its bound without
waiting on anything (the watchdog, which watches the kernel's CPU, tells the two apart).
The small notebook (written to a temporary folder) drives ipywidgets the way the
lessons' panels do: a slider whose observer clears and redraws an Output widget's figure
(``clear_output(wait=True)``, which makes nbclient send the kernel a comm message mid-cell).
Prints one line per run and a closing count.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

SMALL = [
    "import ipywidgets as w\nimport matplotlib.pyplot as plt\nfrom IPython.display import display, clear_output",
    "out = w.Output()\nslider = w.IntSlider(value=1, min=1, max=40, description='n')\n"
    "def draw(change=None):\n    with out:\n        clear_output(wait=True)\n"
    "        fig, ax = plt.subplots(figsize=(2, 1.5))\n        ax.plot(range(slider.value))\n"
    "        ax.set_title(f'n = {slider.value}')\n        plt.show()\n"
    "slider.observe(draw, 'value')\ndraw()\ndisplay(w.VBox([slider, out]))",
    "for n in range(2, 21):\n    slider.value = n",
    "label = w.HTML(value='<b>done</b>')\ndisplay(w.HBox([label, w.Dropdown(options=['a', 'b'])]))\nslider.value = 30",
    "assert slider.value == 30 and len(out.outputs) == 1, out.outputs\nprint('PASSED small widget notebook')",
]
SITE_ENV = {"MPLBACKEND": "module://matplotlib_inline.backend_inline",
            "PYTHONSTARTUP": str(ROOT / "tools" / "site_kernel.py"), "MEMLAB_PROGRESS": "0"}


def small_notebook(folder: pathlib.Path) -> pathlib.Path:
    """The small widget notebook, written into ``folder``."""
    import nbformat
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in SMALL])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = folder / "soak_widgets.ipynb"
    nbformat.write(nb, path)
    return path


def one(path: pathlib.Path, mode: str, stall_seconds: float) -> int:
    """One run in this process: 0 when every cell ran without error, 3 on a stall, 1 otherwise."""
    import nbformat
    from make_site import errors_in, freeze_widgets

    def freeze(client, cell):
        freeze_widgets(cell, client.widget_state)

    if mode == "plain":
        from nbclient import NotebookClient
        nb = nbformat.read(path, as_version=4)
        client = NotebookClient(nb, timeout=900, allow_errors=True, interrupt_on_timeout=True,
                                kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
        seen, where, loop = [], [-1], []   # what the running cell's IOPub said, for a hung run's report
        process = client.process_message

        def process_message(msg, cell, cell_index):
            loop[:] = [asyncio.get_running_loop()]
            content = msg.get("content", {})
            seen.append(f"{time.monotonic():.1f} {msg['msg_type']}:{content.get('execution_state', '')}")
            return process(msg, cell, cell_index)

        client.process_message = process_message

        def hung() -> None:   # just before the parent's bound: what the run was waiting for
            from memlab.classroom.watchdog import kernel_pid, kernel_state
            waiting = "unknown"
            if loop:   # is the reply already in the client's shell socket, unread? (asked on its loop)
                async def ready() -> bool:
                    return await client.kc.shell_channel.msg_ready()
                try:
                    waiting = asyncio.run_coroutine_threadsafe(ready(), loop[0]).result(timeout=3)
                except Exception as e:   # the loop never got to it: it is blocked
                    waiting = f"not asked ({type(e).__name__})"
            print(f"watchdog: plain run hung at cell {where[0]} at {time.monotonic():.1f}; its IOPub: "
                  f"{', '.join(seen[-6:]) or 'nothing'}; a shell message waiting unread in the client: "
                  f"{waiting}; {kernel_state(kernel_pid(client.km))}", file=sys.stderr, flush=True)

        timer = threading.Timer(float(os.environ.get("SOAK_BOUND", "1e9")) - 5, hung)
        timer.daemon = True
        timer.start()
        with client.setup_kernel():
            for i, cell in enumerate(nb.cells):
                if cell.cell_type == "code":
                    where[0] = i
                    seen.clear()
                    client.execute_cell(cell, i)
                    freeze(client, cell)
        timer.cancel()
        stalls = []
    else:
        from memlab.classroom.collect import run_watched
        run = run_watched(path, 900, after_cell=freeze, stall_seconds=stall_seconds, retries=0)
        nb, stalls = run.nb, run.stalls
    errs = errors_in(nb)
    if errs:
        print(f"errors: {errs[0]}", file=sys.stderr)
    return 3 if stalls else (1 if errs else 0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("notebooks", nargs="*", help="default: the small widget notebook")
    p.add_argument("--runs", type=int, default=50, help="runs of each notebook")
    p.add_argument("--mode", choices=("watched", "plain"), default="watched")
    p.add_argument("--bound", type=float, default=None,
                   help="seconds past which a finished run is slow (default: its bound)")
    p.add_argument("--limit", type=float, default=None,
                   help="seconds past which a run is hung and killed (default: 10 x its bound, >= 600)")
    p.add_argument("--stall", type=float, default=60.0, help="the watchdog's bound, seconds")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)   # a single run, in the child
    args = p.parse_args(argv)
    if args.one:
        os.environ.update(SITE_ENV)
        return one(pathlib.Path(args.one), args.mode, args.stall)
    from memlab.classroom.watchdog import notebook_bounds
    bounds = notebook_bounds()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="memlab-soak-"))
    paths = [pathlib.Path(n).resolve() for n in args.notebooks] or [small_notebook(tmp)]
    counts = {}
    for path in paths:
        bound = args.bound or bounds.get(path.stem, 120.0)
        limit = args.limit or max(10 * bound, 600.0)
        for k in range(args.runs):
            t = time.perf_counter()
            child = subprocess.Popen([sys.executable, __file__, "--one", str(path), "--mode", args.mode,
                                      "--stall", str(args.stall)], stdout=subprocess.DEVNULL,
                                     env=dict(os.environ, SOAK_BOUND=str(limit)),
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
            try:
                _, err = child.communicate(timeout=limit)
                rc, tail = child.returncode, [ln for ln in err.splitlines() if ln.startswith(("watchdog:", "errors:"))]
            except subprocess.TimeoutExpired:   # the child and its kernel (its own session)
                os.killpg(child.pid, signal.SIGKILL)
                _, err = child.communicate()
                rc = 124
                tail = [ln for ln in (err or "").splitlines() if ln.startswith("watchdog:")]
                tail = tail or [f"no end after {limit:.0f} s"]
            took = time.perf_counter() - t
            verdict = {0: "ok", 3: "stalled", 124: "hung"}.get(rc, "failed")
            if verdict == "ok" and took > bound:
                verdict, tail = "slow", [f"over its bound of {bound:.0f} s"]
            counts.setdefault(path.stem, {}).setdefault(verdict, 0)
            counts[path.stem][verdict] += 1
            print(f"{path.stem} run {k + 1}/{args.runs} {args.mode}: {verdict} in {took:.0f} s"
                  + (f" -- {tail[0]}" if tail else ""), flush=True)
    for stem, c in counts.items():
        print(f"{stem}: {args.runs} runs ({args.mode}): " + ", ".join(f"{v} {n}" for n, v in sorted(c.items())))
    return 0 if all(set(c) <= {"ok", "slow"} for c in counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
