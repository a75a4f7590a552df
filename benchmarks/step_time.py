"""The time lens against clocks: predicted / measured step-time ratios (memlab.step_time).

1. This CPU: the matmul rate of each dtype is measured (``memlab.doctor.measure_matmul_flops``,
   as ``memlab doctor --calibrate`` does) and stands in for a card's peak x achievable; the
   predicted ratios of full checkpointing, accumulation (4 micro-batches) and bf16 autocast
   to the plain fp32 step are printed beside the measured ones (target: within 15%).
2. The H200 reference: gpt2-large bf16 seq 1024 batch 4 under DeepSpeed on one GPU
   (``memlab/data/reference/NVIDIA-H200/zero_offload_one_gpu.json``), predicted with the
   H200's datasheet figures and Llama 3's published fraction, DeepSpeed's counted passes
   (``memlab.step_time.DEEPSPEED_PASSES``), against the recorded seconds (target: within 25%;
   offload: the bound the model names).

Prints, asserts nothing: timings on a shared 2-core machine are noisy (fastest of repeats).
"""
from __future__ import annotations

import json
import time
from dataclasses import replace
from importlib import resources

import torch

from memlab.cards import Speeds
from memlab.doctor import measure_matmul_flops
from memlab.step import StepConfig, build_trainer, make_batch
from memlab.step_time import CPU_ADAM_PARAMS_PER_S, Calibration, step_time

#: the datasheet and published fractions, the stated host-Adam default
NO_CALIBRATION = Calibration("none", {}, CPU_ADAM_PARAMS_PER_S)


def measured_seconds(step: StepConfig, repeats: int = 3) -> float:
    """Fastest of ``repeats`` steps after a warm-up step."""
    trainer = build_trainer(step)
    batch = make_batch(step)
    trainer.step(batch)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        trainer.step(batch)
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth(elements: int = 2**24, repeats: int = 3) -> float:
    """Bytes/s a large fp32 copy reads and writes on this host (the engine part's 'HBM')."""
    src, dst = torch.ones(elements), torch.empty(elements)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 8 * elements / best


def cpu_ratios() -> None:
    base = StepConfig(model="tiny", seq=256, batch=8, attention="sdpa")
    rates = {d: measure_matmul_flops(d, "cpu", n=512) for d in ("fp32", "bf16")}
    cpu = Speeds(tuple((d, r / 1e12) for d, r in rates.items()), copy_bandwidth(), 0.0, 1.0, 1.0,
                 "measured matmul on this CPU", "this CPU")
    print("CPU matmul: " + ", ".join(f"{d} {r / 1e9:.1f} GFLOP/s" for d, r in rates.items()))
    variants = {"full checkpointing": replace(base, checkpointing="full"),
                "4 micro-batches": replace(base, micro_batches=4),
                "bf16 autocast": replace(base, precision="bf16")}
    t0 = measured_seconds(base)
    p0 = step_time(base, speeds=cpu, calibration=NO_CALIBRATION).seconds
    print(f"{'variant':<22}{'predicted':>10}{'measured':>10}{'pred/meas':>11}")
    for name, step in variants.items():
        pred = step_time(step, speeds=cpu, calibration=NO_CALIBRATION).seconds / p0
        meas = measured_seconds(step) / t0
        print(f"{name:<22}{pred:>10.2f}{meas:>10.2f}{pred / meas:>11.2f}")


def h200_ratios() -> None:
    path = resources.files("memlab").joinpath("data", "reference", "NVIDIA-H200", "zero_offload_one_gpu.json")
    rows = json.loads(path.read_text())
    print(f"{'H200 one GPU':<24}{'predicted s':>12}{'measured s':>11}{'pred/meas':>11}  bound")
    for r in rows:
        step = StepConfig(model=r["model"], seq=r["seq"], batch=r["batch"], precision="bf16", zero=r["zero"],
                          offload=r["offload"])
        t = step_time(step, "H200-141GB", calibration=NO_CALIBRATION, engine="deepspeed")
        name = f"ZeRO-{r['zero']}" + ("" if r["offload"] == "none" else f" + offload {r['offload']}")
        print(f"{name:<24}{t.seconds:>12.3f}{r['step_seconds']:>11.3f}{t.seconds / r['step_seconds']:>11.2f}"
              f"  {t.bound}")


if __name__ == "__main__":
    h200_ratios()
    cpu_ratios()
