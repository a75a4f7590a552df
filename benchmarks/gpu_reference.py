"""Each lens against a real GPU, row by row: the H200 reference steps replayed on CPU.

For every row of ``memlab/data/reference/<gpu>/{devset,gpu_check}.json`` prints the error of
estimate and simulate with ``target="cuda"`` and ``target="cpu"``, of the CUDA simulation in
the process that recorded the row (``sim proc``: one simulated caching allocator per file, the
rows in the file's order, so each starts from the cache the rows before it left), and of the
measurement as recorded on the GPU (the tracker, which misses the allocator's workspaces and
rounding), each against the allocator's ``max_memory_allocated``; then the worst case per
lens. Asserts nothing (``tests/test_gpu_reference.py`` holds the tolerances).

    python benchmarks/gpu_reference.py [--gpu NVIDIA-H200] [--only gpt2-small] [--no-simulate]
"""
from __future__ import annotations

import argparse
import sys
import time

from memlab.lenses.estimate import estimate_step
from memlab.lenses.reference import reference_steps
from memlab.lenses.simulate import simulate_step
from memlab.policy.caching_allocator import CachingAllocator

LENSES = ("est cuda", "sim cuda", "sim proc", "est cpu", "sim cpu", "measure")


def errors(ref, process: CachingAllocator | None) -> dict[str, float]:
    """Relative error of each lens against the allocator peak of one reference row;
    ``process``: the recording process's simulated allocator (``None``: no simulation)."""
    truth = ref.allocator_peak
    out = {}
    for target in ("cuda", "cpu"):
        out[f"est {target}"] = estimate_step(ref.step, target=target).peak_bytes / truth - 1
        if process is not None:
            out[f"sim {target}"] = simulate_step(ref.step, target=target).peak_bytes / truth - 1
    if process is not None:
        out["sim proc"] = simulate_step(ref.step, target="cuda", allocator=process).peak_bytes / truth - 1
    out["measure"] = ref.row["measure_peak_bytes"] / truth - 1
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpu", default="NVIDIA-H200", help="folder under memlab/data/reference/")
    p.add_argument("--only", default="", help="rows whose label contains this text")
    p.add_argument("--no-simulate", action="store_true", help="estimates only (seconds)")
    args = p.parse_args(argv)
    lenses = [lens for lens in LENSES if not (args.no_simulate and lens.startswith("sim"))]
    rows = reference_steps(args.gpu)
    processes: dict[str, CachingAllocator] = {}
    print(f"{'row':<22} {'step':<48} {'allocator MiB':>13} " + " ".join(f"{lens:>9}" for lens in lenses))
    worst: dict[str, tuple[float, str]] = {lens: (0.0, "") for lens in lenses}
    start = time.perf_counter()
    shown = 0
    for ref in rows:
        process = None if args.no_simulate else processes.setdefault(ref.file, CachingAllocator())
        if args.only not in ref.label:
            if process is not None:  # the recording process ran it: its cache carries on
                simulate_step(ref.step, target="cuda", allocator=process)
            continue
        shown += 1
        err = errors(ref, process)
        print(f"{ref.file + '#' + str(ref.index):<22} {ref.label:<48} {ref.allocator_peak / 2**20:>13.1f} "
              + " ".join(f"{err[lens]:>+9.2%}" for lens in lenses), flush=True)
        for lens in lenses:
            if abs(err[lens]) > abs(worst[lens][0]):
                worst[lens] = (err[lens], ref.label)
    print(f"\nworst case per lens over {shown} rows ({time.perf_counter() - start:.0f} s):")
    for lens in lenses:
        print(f"  {lens:<9} {worst[lens][0]:+7.2%}  {worst[lens][1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
