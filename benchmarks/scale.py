"""Today's models at their real size, simulated on a laptop: wall time, CPU time, peak RSS.

Each case runs in a fresh subprocess (so its peak RSS, ``resource.getrusage`` ``ru_maxrss``,
is its own) with ``OMP_NUM_THREADS=1``:

* ``llama-3-8b``: one rank, seq 8192, batch 1, bf16 autocast, full checkpointing
  (:func:`memlab.lenses.simulate.simulate_step`). Target: under 10 s.
* ``llama-3-70b``: ZeRO-3 over 64 ranks, seq 8192, batch 1, bf16, full checkpointing, as
  FSDP2 on a fake process group (:func:`memlab.distributed.fsdp.simulate_sharded`, what
  ``memlab simulate --zero 3 --world-size 64`` runs). Targets: under 60 s, under 2 GiB RSS.

"simulation" is the call itself; "process" adds starting Python and importing torch and
memlab (FakeTensorMode imports torch._dynamo on first use: a few seconds, counted in the
simulation). CPU time is printed beside wall time because on a shared machine the wall time
grows with the load (the load average is printed too); the simulation is single-threaded, so
on an idle machine the two agree. Asserts nothing.

Run: ``python benchmarks/scale.py`` (about a minute of CPU time).
"""
import json
import os
import resource
import subprocess
import sys
import time

CASES = {
    "llama-3-8b": dict(target_s=10.0),
    "llama-3-70b zero-3 x64": dict(target_s=60.0),
}
RSS_TARGET_GIB = 2.0


def child(name: str) -> None:
    """One case, in this process; prints a JSON line."""
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    import memlab as ml
    if name == "llama-3-8b":
        from memlab.lenses.simulate import simulate_step
        def run():
            return simulate_step(ml.StepConfig(model="llama-3-8b", seq=8192, batch=1,
                                               precision="bf16", checkpointing="full"))
    else:
        from memlab.distributed.fsdp import simulate_sharded
        def run():
            return simulate_sharded(ml.StepConfig(model="llama-3-70b", seq=8192, batch=1,
                                                  precision="bf16", checkpointing="full"), 64)
    sim_wall, sim_cpu = time.perf_counter(), time.process_time()
    report = run()
    now_wall, now_cpu = time.perf_counter(), time.process_time()
    print(json.dumps({"case": name, "peak_bytes": report.peak_bytes,
                      "by_category": report.by_category,
                      "sim_wall_s": now_wall - sim_wall, "sim_cpu_s": now_cpu - sim_cpu,
                      "process_wall_s": now_wall - start_wall, "process_cpu_s": now_cpu - start_cpu,
                      "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))


def main() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for name, spec in CASES.items():
        started = time.perf_counter()
        out = subprocess.run([sys.executable, __file__, "--child", name], env=env,
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        total = time.perf_counter() - started  # includes starting the interpreter
        wall_ok = "ok" if r["sim_wall_s"] < spec["target_s"] else "MISSED"
        cpu_ok = "ok" if r["sim_cpu_s"] < spec["target_s"] else "MISSED"
        rss_ok = "ok" if r["rss_gib"] < RSS_TARGET_GIB else "MISSED"
        print(f"{name:<24} peak {r['peak_bytes'] / 2**30:7.2f} GiB | simulation {r['sim_wall_s']:6.1f} s "
              f"wall ({wall_ok}), {r['sim_cpu_s']:6.1f} s CPU ({cpu_ok}), target {spec['target_s']:.0f} s "
              f"| process {total:6.1f} s | peak RSS {r['rss_gib']:.2f} GiB ({rss_ok}, target "
              f"{RSS_TARGET_GIB:.0f} GiB)")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        main()
