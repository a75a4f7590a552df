"""The CLI's wall time against torch's own import, on the same machine.

Times (best of 3, each a fresh interpreter) ``python -c "import torch"`` (the floor: every
memlab command imports torch), ``memlab --help``, and ``memlab estimate --hf-config
mistral-7b`` alone, with ``--training-args`` (a TrainingArguments YAML it writes) and with
``--deepspeed`` (a ZeRO-2 JSON it writes). Prints each command's wall seconds and its CPU
seconds (user + system of the process), each with its difference from bare torch, and exits
1 when an estimate is more than 1.5 s above bare torch or ``--help`` more than 0.5 s above it
(the instant lens: issue 37) in either. The best of 3 takes the least-disturbed run on a
shared machine, each round every command in turn; runs after the first read memlab's
bytecode cache, as a learner's Python does (PYTHONDONTWRITEBYTECODE is dropped). Each limit
is a difference, not a ratio, so a slow machine's torch import does not hide memlab's own
cost.

``--cpu-only`` judges the CPU seconds alone: on a machine other processes keep busy (more
runnable processes than cores: ``os.getloadavg()``, printed) the wall time of every command
stretches by the wait for a core, and so does its difference from torch, while the CPU
seconds are what the command itself costs. The wall figures are printed either way.

Run: ``python benchmarks/cli_startup.py [--cpu-only]`` (about 15 runs of a few seconds each).
"""
from __future__ import annotations

import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNS = 3
ESTIMATE_LIMIT_S, HELP_LIMIT_S = 1.5, 0.5
TRAINING_ARGS = "per_device_train_batch_size: 2\ngradient_accumulation_steps: 4\nbf16: true\n" \
                "gradient_checkpointing: true\n"
DEEPSPEED = '{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, ' \
            '"bf16": {"enabled": true}, "zero_optimization": {"stage": 2}}\n'


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    # as a learner's Python runs: bytecode cached after the first run (with
    # PYTHONDONTWRITEBYTECODE every run compiles memlab's sources again, about 0.5 s here)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def seconds_of(argv: list[str]) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of one fresh run of ``argv`` (which must exit 0)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall_s = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall_s, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def best_of(commands: dict[str, list[str]], runs: int = RUNS) -> dict[str, tuple[float, float]]:
    """The least wall time and the least CPU time of each command over ``runs`` rounds; each
    round runs every command once, in turn, so a change in the machine's load falls on all."""
    best = {name: (float("inf"), float("inf")) for name in commands}
    for _ in range(runs):
        for name, argv in commands.items():
            w, c = seconds_of(argv)
            best[name] = (min(best[name][0], w), min(best[name][1], c))
    return best


def main(argv: list[str] | None = None) -> int:
    """Time the commands and print them against bare torch; returns 1 when one is over its limit."""
    cpu_only = "--cpu-only" in (sys.argv[1:] if argv is None else argv)
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        ta, ds = pathlib.Path(tmp, "args.yaml"), pathlib.Path(tmp, "ds_config.json")
        ta.write_text(TRAINING_ARGS)
        ds.write_text(DEEPSPEED)
        cli = [py, "-m", "memlab.app.cli"]
        est = [*cli, "estimate", "--hf-config", "mistral-7b"]
        commands = [("memlab --help", [*cli, "--help"], HELP_LIMIT_S),
                    ("estimate --hf-config mistral-7b", est, ESTIMATE_LIMIT_S),
                    ("  + --training-args args.yaml", [*est, "--training-args", str(ta)], ESTIMATE_LIMIT_S),
                    ("  + --deepspeed ds_config.json", [*est, "--deepspeed", str(ds), "--world-size", "2"],
                     ESTIMATE_LIMIT_S)]
        floor = 'python -c "import torch"'
        seconds_of(est)  # writes the bytecode caches (module doc)
        load = os.getloadavg()[0]
        seconds = best_of({floor: [py, "-c", "import torch"], **{n: a for n, a, _ in commands}})
        torch_wall, torch_cpu = seconds[floor]
        print(f"load average {load:.1f} on {os.cpu_count()} cores; best of {RUNS}; "
              f"judged on {'CPU seconds' if cpu_only else 'wall and CPU seconds'}")
        print(f"{floor:<34} wall {torch_wall:6.2f} s           cpu {torch_cpu:6.2f} s")
        failed = []
        for name, _, limit in commands:
            (w, c), over_w, over_c = seconds[name], seconds[name][0] - torch_wall, seconds[name][1] - torch_cpu
            ok = over_c <= limit and (cpu_only or over_w <= limit)
            print(f"{name:<34} wall {w:6.2f} s ({over_w:+5.2f})  cpu {c:6.2f} s ({over_c:+5.2f})  "
                  f"limit +{limit} s{'' if ok else '  TOO SLOW'}")
            if not ok:
                failed.append(name.strip())
    if failed:
        print(f"over the limit: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
