"""Reference figures from a real GPU: ``python -m memlab.gpu_check --out data/reference``.

For gpt2-small and gpt2-medium at a few sequence lengths, records the estimate, the
simulation (fake CPU tensors) and the measured step (tracker bytes plus the CUDA caching
allocator's ``max_memory_allocated`` / ``max_memory_reserved``), and writes
``<out>/<gpu-name>.json``. Lessons and ``11_the_table`` read these files when present.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

from .estimate import estimate_step
from .measure import measure_step, time_step
from .step import StepConfig
from .simulate import simulate_step

CASES = [("gpt2-small", 512, 8), ("gpt2-small", 1024, 8), ("gpt2-medium", 512, 4),
         ("gpt2-medium", 1024, 4)]
VARIANTS = [dict(), dict(precision="bf16"), dict(checkpointing="full"),
            dict(precision="bf16", checkpointing="full")]


def gpu_name() -> str:
    """A file-name-safe GPU name, e.g. ``NVIDIA-H200``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", torch.cuda.get_device_name(0)).strip("-")


def collect(cases=CASES, variants=VARIANTS) -> dict:
    """Three lenses, the allocator and the step time for each case and variant."""
    rows = []
    for model, seq, batch in cases:
        for kw in variants:
            step = StepConfig(model=model, seq=seq, batch=batch, **kw)
            real = measure_step(step, device="cuda")
            rows.append({
                "model": model, "seq": seq, "batch": batch, **kw,
                "estimate_peak_bytes": estimate_step(step).peak_bytes,
                "simulate_peak_bytes": simulate_step(step).peak_bytes,
                "measure_peak_bytes": real.peak_bytes,
                "measure_by_category": real.by_category,
                "allocator": real.allocator,
                "step_seconds": time_step(step, device="cuda"),
            })
            print(f"{model} s{seq} b{batch} {kw}: measured {real.peak_bytes / 2**30:.2f} GiB, "
                  f"allocator {real.allocator.get('max_memory_allocated', 0) / 2**30:.2f} GiB",
                  flush=True)
    props = torch.cuda.get_device_properties(0)
    from .advisor import check_plan  # the advisor's plan for this card, run for real
    return {"gpu": torch.cuda.get_device_name(0), "total_memory": props.total_memory,
            "torch": torch.__version__, "cuda": torch.version.cuda, "rows": rows,
            "plan_check": check_plan("gpt2-medium", 1024, 16,
                                     budget=min(props.total_memory, 24564 * 2**20))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memlab.gpu_check", description=__doc__)
    parser.add_argument("--out", default="data/reference")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA GPU; run it on a machine with one", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{gpu_name()}.json"
    path.write_text(json.dumps(collect(), indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
