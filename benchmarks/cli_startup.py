"""The CLI's wall time against torch's own import, on the same machine.

Times (best of 3, each a fresh interpreter) ``python -c "import torch"`` (the floor: every
memlab command imports torch), ``memlab --help``, and ``memlab estimate --hf-config
mistral-7b`` alone, with ``--training-args`` (a TrainingArguments YAML it writes) and with
``--deepspeed`` (a ZeRO-2 JSON it writes). Prints each command's seconds, its difference
from bare torch and the ratio, and exits 1 when an estimate is more than 1.5 s above bare
torch or ``--help`` more than 0.5 s above it (the instant lens: issue 37). The best of 3
takes the least-disturbed run on a shared machine, each round every command in turn; runs
after the first read memlab's bytecode cache, as a learner's Python does
(PYTHONDONTWRITEBYTECODE is dropped). Each limit is a difference, not a ratio, so a slow
machine's torch import does not hide memlab's own cost.

Run: ``python benchmarks/cli_startup.py`` (about 15 runs of a few seconds each).
"""
from __future__ import annotations

import os
import pathlib
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


def wall(argv: list[str]) -> float:
    """Seconds of one fresh run of ``argv`` (which must exit 0)."""
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def best_of(commands: dict[str, list[str]], runs: int = RUNS) -> dict[str, float]:
    """The least wall time of each command over ``runs`` rounds; each round runs every
    command once, in turn, so a change in the machine's load falls on all of them."""
    best = dict.fromkeys(commands, float("inf"))
    for _ in range(runs):
        for name, argv in commands.items():
            best[name] = min(best[name], wall(argv))
    return best


def main() -> int:
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
        wall(est)  # writes the bytecode caches (module doc)
        seconds = best_of({floor: [py, "-c", "import torch"], **{n: a for n, a, _ in commands}})
        torch_s = seconds[floor]
        print(f"{floor:<34} {torch_s:6.2f} s")
        failed = []
        for name, _, limit in commands:
            sec = seconds[name]
            over = sec - torch_s
            ok = over <= limit
            print(f"{name:<34} {sec:6.2f} s  {over:+6.2f} s over torch  x{sec / torch_s:4.2f}  "
                  f"(limit +{limit} s){'' if ok else '  TOO SLOW'}")
            if not ok:
                failed.append(name.strip())
    if failed:
        print(f"over the limit: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
