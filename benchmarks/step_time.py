"""The time lens against clocks: predicted / measured step-time ratios (memlab.time.step_time).

1. This CPU: the rate of each dtype's training matmuls is measured at the step's own Linear
   shape (``memlab.app.doctor.measure_matmul_flops`` with ``shape``: a micro-batch's tokens through
   ``d_model -> 4 d_model``, forward and backward, as ``memlab doctor --calibrate`` does at its
   square shape), and causal attention's at the step's heads
   (``memlab.app.doctor.measure_attention_flops``), every shape in turn over rounds (this host's
   speed drifts); they stand in for a card's peak x achievable.
   Elementwise work runs at the rates ``memlab.app.doctor.measure_elementwise`` measures at the
   step's activation shapes (a streaming add; tanh-GELU at the MLP's width).
   The predicted ratios of full checkpointing, accumulation (4 micro-batches) and bf16
   autocast to the plain fp32 step are printed beside the measured ones, timed in turn (one
   step of each per round, the fastest of the rounds: a round another process slowed is
   dropped for every variant alike; target: within 15%, on an otherwise idle machine).
2. The H200 reference: gpt2-large bf16 seq 1024 batch 4 under DeepSpeed on one GPU
   (``memlab/data/reference/NVIDIA-H200/zero_offload_one_gpu.json``), predicted with the
   H200's datasheet figures and Llama 3's published fraction, DeepSpeed's counted passes
   (``memlab.time.step_time.DEEPSPEED_PASSES``), against the recorded seconds (target: within 25%;
   offload: the bound the model names). The record holds ONE timed step per row, so its
   spread is unknown; its ZeRO-1 row (0.575 s) takes twice ZeRO-2's (0.297 s) on one GPU, where
   memlab's count of DeepSpeed's ops finds the same work in both, so no one prediction lands
   within 25% of both. ``make gpu-check`` now times five steps per row
   (``memlab.app.gpu_check.DEEPSPEED_TIMED_STEPS``) and keeps each: the column ``spread`` prints
   their (max - min) / median where a record has them.
3. DeepSpeed's host time on this CPU: the same engine and config on a model of gpt2-large's
   tensors (36 blocks, 436 parameter tensors) at width 80, where the arithmetic is negligible,
   so the step's seconds are the engine's Python and dispatch: the part of the H200 rows the
   model leaves out (ZeRO-3's parameter coordinator above all). A GPU host's cores run it
   faster than this shared one; ``make gpu-check`` on a card is where to compare.

Prints, asserts nothing: timings on a shared 2-core machine are noisy (fastest of repeats).
"""
from __future__ import annotations

import json
from dataclasses import replace
from importlib import resources

import torch

from memlab.app.doctor import fastest_seconds, measure_attention_flops, measure_elementwise, measure_matmul_flops
from memlab.app.gpu_check import DEEPSPEED_CASES, deepspeed_one_gpu_worker
from memlab.core.cards import Speeds
from memlab.distributed.ranks import run_ranks
from memlab.lenses.measure import time_steps
from memlab.models.gpt_unet import get_config
from memlab.step.training_step import StepConfig, build_trainer, make_batch
from memlab.time.step_time import (
    CPU_ADAM_PARAMS_PER_S,
    Calibration,
    ElementwiseRates,
    compute_dtype,
    parameter_tensors,
    step_time,
)

#: the datasheet and published fractions, the stated host-Adam default
NO_CALIBRATION = Calibration("none", {}, CPU_ADAM_PARAMS_PER_S)


def copy_bandwidth(elements: int = 2**24, repeats: int = 3) -> float:
    """Bytes/s a large fp32 copy reads and writes on this host (the engine part's 'HBM')."""
    src, dst = torch.ones(elements), torch.empty(elements)
    return 8 * elements / fastest_seconds(lambda: dst.copy_(src), torch.device("cpu"), repeats)


def step_shapes(step: StepConfig) -> tuple[tuple[int, int, int], tuple[int, int, int, int], tuple[int, int]]:
    """``step``'s Linear shape (a micro-batch's tokens, ``d_model -> 4 d_model``), its
    attention shape (a micro-batch's sequences, heads, tokens, head dim) and its activations'
    (a micro-batch's tokens, ``d_model``)."""
    cfg = step.model_config
    rows = step.batch // step.micro_batches
    return ((step.seq * rows, cfg.d_model, 4 * cfg.d_model),
            (rows, cfg.n_head, step.seq, cfg.d_model // cfg.n_head),
            (step.seq * rows, cfg.d_model))


def cpu_rates(shapes: list[tuple[int, ...]], measure, rounds: int = 6) -> dict[tuple, dict[str, float]]:
    """FLOP/s per shape and dtype of ``measure``, the fastest of ``rounds`` rounds that each
    measure every shape in turn: this host's speed drifts (a shared VM: 65-128 GFLOP/s for the
    same fp32 GEMM within minutes), and what drifts falls on every shape alike."""
    best = {shape: {d: 0.0 for d in ("fp32", "bf16")} for shape in shapes}
    for _ in range(rounds):
        for shape in shapes:
            for d in best[shape]:
                best[shape][d] = max(best[shape][d], measure(d, "cpu", shape=shape, repeats=1))
    return best


def elementwise_rates(shapes: list[tuple[int, int]], rounds: int = 6) -> dict[tuple, dict[str, ElementwiseRates]]:
    """:func:`memlab.app.doctor.measure_elementwise` per activation shape ``(tokens, d_model)`` (its
    GELU at ``(tokens, 4 d_model)``, the MLP's) and dtype, the fastest of ``rounds`` rounds."""
    def bandwidth(d, device, shape, repeats):
        return measure_elementwise(d, device, shape=shape, repeats=repeats).bytes_per_s

    def gelu(d, device, shape, repeats):
        rows, width = shape
        return measure_elementwise(d, device, shape=(rows, 4 * width), repeats=repeats).activation_elements_per_s

    streams, activations = cpu_rates(shapes, bandwidth, rounds), cpu_rates(shapes, gelu, rounds)
    return {sh: {d: ElementwiseRates(streams[sh][d], activations[sh][d]) for d in streams[sh]} for sh in shapes}


def cpu_ratios(rounds: int = 6) -> None:
    base = StepConfig(model="tiny", seq=256, batch=8, attention="sdpa")
    steps = {"plain fp32": base, "full checkpointing": replace(base, checkpointing="full"),
             "4 micro-batches": replace(base, micro_batches=4), "bf16 autocast": replace(base, precision="bf16")}
    bandwidth = copy_bandwidth()
    shapes = {name: step_shapes(s) for name, s in steps.items()}
    matmuls = cpu_rates(sorted({m for m, _, _ in shapes.values()}), measure_matmul_flops)
    attention = cpu_rates(sorted({a for _, a, _ in shapes.values()}), measure_attention_flops)
    streams = elementwise_rates(sorted({e for _, _, e in shapes.values()}))
    predicted = {}
    for name, s in steps.items():
        mm, attn, ew = matmuls[shapes[name][0]], attention[shapes[name][1]], streams[shapes[name][2]]
        sp = Speeds(tuple((d, r / 1e12) for d, r in mm.items()), bandwidth, 0.0, 1.0, 1.0,
                    "measured training matmuls on this CPU", "this CPU")
        dtype = compute_dtype(s)
        t = step_time(s, speeds=sp, calibration=NO_CALIBRATION, attention_flops_per_s=attn[dtype],
                      elementwise_rates=ew[dtype])
        predicted[name] = t.seconds
        print(f"  {name}: matmuls " + ", ".join(f"{d} {r / 1e9:.1f}" for d, r in mm.items())
              + "; attention " + ", ".join(f"{d} {r / 1e9:.1f}" for d, r in attn.items()) + " GFLOP/s; "
              + f"elementwise {t.elementwise.bytes / 1e6:.0f} MB at {ew[dtype].bytes_per_s / 1e9:.1f} GB/s, "
              + f"GELU {ew[dtype].activation_elements_per_s / 1e6:.0f} M/s: {t.by_part.elementwise:.3f} s")
    runs = {}
    for name, s in steps.items():
        trainer = build_trainer(s)
        batch = make_batch(s)
        trainer.step(batch)  # warm-up: the optimizer's state exists from here on
        runs[name] = (trainer, batch)
    measured = time_steps(runs, rounds, fastest=True)
    print(f"{'variant':<22}{'predicted':>10}{'measured':>10}{'pred/meas':>11}   (plain fp32: predicted "
          f"{predicted['plain fp32']:.3f} s, measured {measured['plain fp32']:.3f} s)")
    for name in list(steps)[1:]:
        pred = predicted[name] / predicted["plain fp32"]
        meas = measured[name] / measured["plain fp32"]
        print(f"{name:<22}{pred:>10.2f}{meas:>10.2f}{pred / meas:>11.2f}")


def h200_ratios() -> None:
    path = resources.files("memlab").joinpath("data", "reference", "NVIDIA-H200", "zero_offload_one_gpu.json")
    rows = json.loads(path.read_text())
    print(f"{'H200 one GPU':<24}{'predicted s':>12}{'measured s':>11}{'pred/meas':>11}{'steps':>6}"
          f"{'spread':>8}  bound")
    for r in rows:
        step = StepConfig(model=r["model"], seq=r["seq"], batch=r["batch"], precision="bf16", zero=r["zero"],
                          offload=r["offload"])
        t = step_time(step, "H200-141GB", calibration=NO_CALIBRATION, engine="deepspeed")
        name = f"ZeRO-{r['zero']}" + ("" if r["offload"] == "none" else f" + offload {r['offload']}")
        samples = r.get("step_seconds_samples", [r["step_seconds"]])
        spread = f"{(max(samples) - min(samples)) / r['step_seconds']:.2f}" if len(samples) > 1 else "-"
        print(f"{name:<24}{t.seconds:>12.3f}{r['step_seconds']:>11.3f}{t.seconds / r['step_seconds']:>11.2f}"
              f"{len(samples):>6}{spread:>8}  {t.bound}")


def deepspeed_host_seconds(width: int = 80) -> None:
    """Section 3 of the module doc: one DeepSpeed rank per case, each in a fresh process."""
    shape = replace(get_config("gpt2-large"), d_model=width, vocab_size=256, name=f"gpt2-large-width-{width}")
    print(f"DeepSpeed on this CPU, {shape.n_layer} blocks x width {width} ({parameter_tensors(shape)} tensors):")
    for zero, offload in DEEPSPEED_CASES[:5]:
        step = StepConfig(model=shape, seq=16, batch=1, precision="bf16", zero=zero, offload=offload)
        row = run_ranks(deepspeed_one_gpu_worker, 1, kwargs={"step": step}, timeout=600)[0]
        name = f"ZeRO-{zero}" + ("" if offload == "none" else f" + offload {offload}")
        print(f"  {name:<26}{row['step_seconds']:.3f} s (median of {len(row['step_seconds_samples'])})")


if __name__ == "__main__":
    h200_ratios()
    cpu_ratios()
    deepspeed_host_seconds()
