"""Run `make test`'s phases in order and print each one's wall time at the end.

    python3 tools/phase_timer.py "lint=make lint" "package tests=make test-package" ...

Each argument is ``NAME=COMMAND`` (run by the shell). The phases run one after another; the
first that fails stops the run (as make would), and the table is printed either way, with
the failed phase marked, so a slow or failing phase is named. Exits with the failed phase's
status (0 when all pass). Standard library only: it runs before the venv exists.
"""
from __future__ import annotations

import subprocess
import sys
import time


def parse(args: list[str]) -> list[tuple[str, str]]:
    """``["NAME=COMMAND", ...]`` as (name, command) pairs; exits 2 on a malformed one."""
    phases = []
    for arg in args:
        name, sep, command = arg.partition("=")
        if not sep or not name.strip() or not command.strip():
            print(f"phase_timer: {arg!r}: allowed: NAME=COMMAND", file=sys.stderr)
            raise SystemExit(2)
        phases.append((name.strip(), command))
    return phases


def table(done: list[tuple[str, float, int]], skipped: list[str]) -> str:
    """The summary: one line per phase (seconds, status) and the total."""
    width = max([len(n) for n, _, _ in done] + [len(n) for n in skipped] + [5])
    lines = ["", "== make test: time per phase"]
    for name, sec, rc in done:
        lines.append(f"  {name:<{width}} {sec:8.1f} s  {'ok' if rc == 0 else f'FAILED (exit {rc})'}")
    lines += [f"  {name:<{width}} {'-':>8}    not run" for name in skipped]
    total = sum(sec for _, sec, _ in done)
    lines.append(f"  {'total':<{width}} {total:8.1f} s ({total / 60:.1f} min)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    phases = parse(argv)
    done: list[tuple[str, float, int]] = []
    rc = 0
    for i, (name, command) in enumerate(phases):
        t0 = time.monotonic()
        rc = subprocess.run(command, shell=True).returncode  # noqa: S602 - the Makefile's own commands
        done.append((name, time.monotonic() - t0, rc))
        if rc != 0:
            print(table(done, [n for n, _ in phases[i + 1:]]))
            return rc
    print(table(done, []))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
