"""Reference figures from a real GPU: ``python -m memlab.gpu_check --out data/reference``.

Writes ``<out>/<gpu-name>/`` with the files of the shipped ``NVIDIA-H200`` folder:

``gpu_check.json``  gpt2-small and gpt2-medium at two sequence lengths x {fp32, bf16} x
                    {no checkpointing, full}: estimate, simulation (fake CPU tensors), the
                    measured step (tracker bytes by category) and the CUDA caching allocator's
                    ``max_memory_allocated`` / ``max_memory_reserved``; the advisor's plan for a
                    24 GB card run for real (``plan_check``)
``devset.json``     precisions x attention kinds on gpt2-small, SGD, accumulation, a LLaMA-like
                    GPT (SwiGLU, RMSNorm, rotary) and the UNet, same fields; ``config`` is
                    :meth:`StepConfig.describe`
``zero_offload_one_gpu.json``  real DeepSpeed on this one GPU (world size 1, NCCL), gpt2-large
                    bf16: the allocator after warm-up (``device_base``) and at the step's peak
                    (``device_peak``, ``device_reserved``), host RSS before and after, step
                    seconds, and memlab's estimate, for ZeRO 0-3, ZeRO-2 + optimizer offload
                    and ZeRO-3 + parameter offload
``cli_measure_zero2_offload.json``  ``memlab measure`` (one DeepSpeed rank) of the offload step

:func:`memlab.report.load_references` reads these folders; lesson 11 and ``memlab report``
show their GPU columns.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from .advisor import check_plan
from .distributed import deepspeed_config, default_backend, measure_distributed, run_ranks
from .estimate import estimate_step
from .measure import measure_step, time_step
from .models import GPTConfig
from .simulate import simulate_step
from .step import StepConfig, build_trainer, make_batch
from .units import GiB, MiB

CASES = [("gpt2-small", 512, 8), ("gpt2-small", 1024, 8), ("gpt2-medium", 512, 4),
         ("gpt2-medium", 1024, 4)]
VARIANTS = [dict(), dict(precision="bf16"), dict(checkpointing="full"),
            dict(precision="bf16", checkpointing="full")]
# A LLaMA-like block small enough for any GPU: SwiGLU, RMSNorm, rotary, untied, no bias.
LLAMA_DEV = GPTConfig(n_layer=6, n_head=12, d_model=768, vocab_size=16000, block_size=1024,
                      mlp="swiglu", mlp_hidden=2048, norm="rmsnorm", position="rope", bias=False,
                      tie_embeddings=False, name="llama-dev")


def devset() -> list[StepConfig]:
    """The steps of ``devset.json``: precisions x attention kinds, SGD, accumulation, the
    LLaMA-like GPT and the UNet."""
    steps = [StepConfig(model="gpt2-small", seq=512, batch=8, precision=p, attention=a)
             for a in ("sdpa", "naive") for p in ("fp32", "bf16", "fp16", "pure-bf16")]
    steps += [StepConfig(model="gpt2-small", seq=512, batch=8, precision="bf16", attention="naive",
                         checkpointing="selective"),
              StepConfig(model="gpt2-small", seq=512, batch=8, optimizer="sgd"),
              StepConfig(model="gpt2-small", seq=512, batch=8, precision="bf16", micro_batches=4)]
    steps += [StepConfig(model=LLAMA_DEV, seq=1024, batch=4, precision=p)
              for p in ("fp32", "bf16", "fp16", "pure-bf16")]
    steps += [StepConfig(model="unet-small", seq=s, batch=8, precision=p)
              for s in (64, 96) for p in ("fp32", "bf16")]
    return steps


# gpt2-large bf16 on one GPU: (zero, offload) of zero_offload_one_gpu.json
DEEPSPEED_STEP = StepConfig(model="gpt2-large", seq=1024, batch=4, precision="bf16")
DEEPSPEED_CASES = [(0, "none"), (1, "none"), (2, "none"), (2, "optimizer"), (3, "none"), (3, "all")]


def gpu_name() -> str:
    """A file-name-safe GPU name, e.g. ``NVIDIA-H200``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", torch.cuda.get_device_name(0)).strip("-")


def _header() -> dict:
    return {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "cuda": torch.version.cuda}


def lens_row(step: StepConfig, timed: bool = False) -> dict:
    """Estimate, simulation, the measured step and the allocator for one step."""
    real = measure_step(step, device="cuda")
    row = {"config": step.describe(),
           "estimate_peak_bytes": estimate_step(step).peak_bytes,
           "simulate_peak_bytes": simulate_step(step).peak_bytes,
           "measure_peak_bytes": real.tracked_peak_bytes or real.peak_bytes,
           "measure_by_category": real.by_category, "allocator": real.allocator}
    if timed:
        row["step_seconds"] = time_step(step, device="cuda")
    alloc = real.allocator.get("max_memory_allocated", 0)
    print(f"{step.model_config.name} s{step.seq} b{step.batch} {step.precision}: tracked "
          f"{row['measure_peak_bytes'] / GiB:.2f} GiB, allocator {alloc / GiB:.2f} GiB", flush=True)
    return row


def collect(cases=CASES, variants=VARIANTS) -> dict:
    """``gpu_check.json``: three lenses, the allocator and the step time per case and variant."""
    rows = []
    for model, seq, batch in cases:
        for kw in variants:
            row = lens_row(StepConfig(model=model, seq=seq, batch=batch, **kw), timed=True)
            rows.append({"model": model, "seq": seq, "batch": batch, **kw, **row})
    props = torch.cuda.get_device_properties(0)
    return {**_header(), "total_memory": props.total_memory, "rows": rows,
            "plan_check": check_plan("gpt2-medium", 1024, 16,
                                     budget=min(props.total_memory, 24564 * MiB))}


def _rss() -> int:
    """This process's resident set size in bytes (Linux ``/proc``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def deepspeed_one_gpu_worker(rank: int, world_size: int, step: StepConfig) -> dict:
    """One DeepSpeed rank: warm up, then the allocator and host RSS around one step.

    ``device_base`` is what the allocator holds after the warm-up step (model states and
    DeepSpeed's buffers), ``device_peak`` its ``max_memory_allocated`` over the next step.
    """
    import deepspeed  # optional and heavy: only this rank worker needs it
    deepspeed.init_distributed(dist_backend=default_backend())
    cuda = torch.cuda.is_available()
    model = build_trainer(step, "cuda" if cuda else "cpu").model
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=deepspeed_config(step))
    batch = make_batch(step, engine.device)

    def one_step() -> None:
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()

    one_step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    out = {"zero": step.zero, "offload": step.offload, "model": step.model_config.name,
           "seq": step.seq, "batch": step.batch, "num_params": step.model_config.num_params(),
           "device_base": torch.cuda.memory_allocated() if cuda else None, "rss_before": _rss()}
    start = time.perf_counter()
    one_step()
    if cuda:
        torch.cuda.synchronize()
    out.update(step_seconds=time.perf_counter() - start, rss_after=_rss(),
               device_peak=torch.cuda.max_memory_allocated() if cuda else None,
               device_reserved=torch.cuda.max_memory_reserved() if cuda else None)
    return out


def collect_deepspeed(step: StepConfig = DEEPSPEED_STEP, cases=DEEPSPEED_CASES) -> list[dict]:
    """``zero_offload_one_gpu.json``: each case in its own one-rank launch (a fresh process,
    so host RSS and the allocator start clean), with memlab's estimate beside it."""
    rows = []
    for zero, offload in cases:
        s = replace(step, zero=zero, offload=offload)
        row = run_ranks(deepspeed_one_gpu_worker, 1, kwargs={"step": s}, timeout=1800)[0]
        est = estimate_step(s) if zero or offload != "none" else None
        row["estimate_peak_bytes"] = est.peak_bytes if est else None
        row["estimate_host_bytes"] = est.host_bytes if est else None
        rows.append(row)
        print(f"DeepSpeed ZeRO-{zero} offload {offload}: device peak "
              f"{(row['device_peak'] or 0) / GiB:.2f} GiB, host RSS {row['rss_before'] / GiB:.2f} GiB",
              flush=True)
    return rows


def write(out: str | Path) -> Path:
    """Record everything for the GPU at hand into ``<out>/<gpu-name>/``."""
    folder = Path(out) / gpu_name()
    folder.mkdir(parents=True, exist_ok=True)

    def dump(name: str, data) -> None:
        (folder / name).write_text(json.dumps(data, indent=1, default=str))
        print(f"wrote {folder / name}", flush=True)

    dump("gpu_check.json", collect())
    dump("devset.json", {**_header(), "rows": [lens_row(s) for s in devset()]})
    dump("zero_offload_one_gpu.json", collect_deepspeed())
    offload = replace(DEEPSPEED_STEP, zero=2, offload="optimizer")
    dump("cli_measure_zero2_offload.json", measure_distributed(offload, device="cuda").to_dict())
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memlab.gpu_check", description=__doc__)
    parser.add_argument("--out", default="data/reference")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA GPU; run it on a machine with one", file=sys.stderr)
        return 2
    write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
