"""Everything on one GPU, for any card: ``make gpu-check`` (``python -m memlab.app.gpu_check``).

Writes ``<out>/<card>/`` (``build/gpu-check/<card>/``; never the shipped references under
``memlab/data/reference/``): the reference steps sized for the card, then every notebook
under nbval (the rank-starting ones one at a time, the others two at a time), going on past
a failure, and one table (notebook, pass/fail, wall time, card profile) in ``summary.md``.
``MEMLAB_CARD=T4-16GB`` rehearses a smaller card on a larger GPU (:mod:`memlab.classroom.lesson`);
``--dry-run`` prints the plan per notebook per card without a GPU.

The reference files have the names of the shipped ``NVIDIA-H200`` folder:

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

:func:`memlab.lenses.reference.load_references` reads these folders; the offload lesson and ``memlab report``
show their GPU columns.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from memlab.classroom.lesson import CONTEXT_BYTES, plan, rehearse
from memlab.core.cards import CARDS, Card, detect_card, get_card
from memlab.core.hardware import place_ranks
from memlab.core.units import GiB
from memlab.distributed.deepspeed_zero import measure_distributed
from memlab.distributed.ranks import default_backend, run_ranks
from memlab.lenses.estimate import estimate_step
from memlab.lenses.guard import cuda_need
from memlab.lenses.measure import measure_step, time_step
from memlab.lenses.simulate import simulate_step
from memlab.models.gpt_unet import GPTConfig
from memlab.planning.advisor import check_plan
from memlab.policy import get_target
from memlab.policy.caching_allocator import CachingAllocator
from memlab.step.training_step import StepConfig, build_trainer, make_batch
from memlab.step.write_deepspeed_config import deepspeed_config

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


def lens_row(step: StepConfig, timed: bool = False, process: CachingAllocator | None = None) -> dict:
    """Estimate, simulation, the measured step and the allocator for one step (the lenses
    predict for the card present, :func:`memlab.policy.resolve_target`); a step that fails
    is recorded with its error and the check goes on. ``process``: the simulated caching
    allocator of this process, so that each row is simulated with the cache the rows
    measured before it left (the timing trainer's steps repeat the same blocks and are not
    replayed).

    A dict because it is a row of ``gpu_check.json``, the file it is written to.
    """
    try:
        real = measure_step(step, device="cuda")
        row = {"config": step.describe(),
               "estimate_peak_bytes": estimate_step(step).peak_bytes,
               "simulate_peak_bytes": simulate_step(step, allocator=process).peak_bytes,
               "measure_peak_bytes": real.tracked_peak_bytes or real.peak_bytes,
               "measure_by_category": real.by_category, "allocator": real.allocator}
        if timed:
            row["step_seconds"] = time_step(step, device="cuda")
    except Exception as e:  # one failing step must not stop the check
        print(f"{step.model_config.name} s{step.seq} b{step.batch} {step.precision}: FAILED {e}", flush=True)
        return {"config": step.describe(), "error": f"{type(e).__name__}: {e}"[:2000]}
    alloc = real.allocator.get("max_memory_allocated", 0)
    print(f"{step.model_config.name} s{step.seq} b{step.batch} {step.precision}: tracked "
          f"{row['measure_peak_bytes'] / GiB:.2f} GiB, allocator {alloc / GiB:.2f} GiB", flush=True)
    return row


def fits_card(step: StepConfig, card: Card) -> bool:
    """Whether the measure guard lets ``step`` run on ``card`` in a fresh process
    (:func:`memlab.lenses.guard.cuda_need` against the card's memory less the CUDA context)."""
    return cuda_need(step, get_target("cuda", card=card)) <= card.memory - CONTEXT_BYTES


def sized_cases(card: Card, cases=CASES, variants=VARIANTS) -> list[StepConfig]:
    """The ``gpu_check.json`` steps this card can hold (a T4 drops gpt2-medium fp32 at 1024
    tokens; bf16 variants only where bf16 is native)."""
    steps = [StepConfig(model=m, seq=s, batch=b, **kw) for m, s, b in cases for kw in variants]
    return [st for st in steps if fits_card(st, card)
            and (card.bf16_native or st.precision not in ("bf16", "pure-bf16"))]


def sized_devset(card: Card) -> list[StepConfig]:
    """The ``devset.json`` steps this card can hold and runs natively."""
    return [st for st in devset() if fits_card(st, card)
            and (card.bf16_native or st.precision not in ("bf16", "pure-bf16"))]


def deepspeed_step(card: Card) -> StepConfig:
    """The one-GPU DeepSpeed step for a card: gpt2-large as on the H200 where ZeRO-0 of it
    fits, else gpt2-medium, else gpt2-small; in the card's 16-bit precision."""
    for model in ("gpt2-large", "gpt2-medium", "gpt2-small"):
        step = replace(DEEPSPEED_STEP, model=model, precision=card.precision)
        if fits_card(step, card):
            return step
    return replace(DEEPSPEED_STEP, model="gpt2-small", precision=card.precision, batch=1)


def collect(card: Card, cases=CASES, variants=VARIANTS,
            process: CachingAllocator | None = None) -> dict:
    """``gpu_check.json``: three lenses, the allocator and the step time per case and variant
    the card holds, and the advisor's plan for a 24 GB card (or this one) run for real.

    A dict because it is ``gpu_check.json``, the file it is written to.
    """
    rows = []
    process = CachingAllocator() if process is None else process
    for st in sized_cases(card, cases, variants):
        row = lens_row(st, timed=True, process=process)
        kw = {k: getattr(st, k) for k in ("precision",) if st.precision != "fp32"}
        if st.model_config.checkpointing != "none":
            kw["checkpointing"] = st.model_config.checkpointing
        rows.append({"model": st.model_config.name, "seq": st.seq, "batch": st.batch, **kw, **row})
    try:
        plan = check_plan("gpt2-medium", 1024, 16, budget=min(card.memory, 24564 * 2**20)).to_dict()
    except Exception as e:  # the plan check failing is a row of the record, not the end of it
        plan = {"error": f"{type(e).__name__}: {e}"[:2000]}
    return {**_header(), "card": card.describe(), "total_memory": card.memory, "rows": rows,
            "plan_check": plan}


def _rss() -> int:
    """This process's resident set size in bytes (Linux ``/proc``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


#: timed DeepSpeed steps after the peak's step: one timed step cannot tell a row's cost from
#: its noise (the H200 record has one a row: ZeRO-1 at 0.575 s against ZeRO-2's 0.297 s, for
#: the same work by memlab's count of DeepSpeed's ops); the median of several, with each kept, can
DEEPSPEED_TIMED_STEPS = 5


def deepspeed_one_gpu_worker(rank: int, world_size: int, step: StepConfig,
                             timed_steps: int = DEEPSPEED_TIMED_STEPS) -> dict:
    """One DeepSpeed rank: warm up, then the allocator and host RSS around one step, then the
    step's time.

    ``device_base`` is what the allocator holds after the warm-up step (model states and
    DeepSpeed's buffers), ``device_peak`` its ``max_memory_allocated`` over the next step.
    ``step_seconds`` is the median of ``timed_steps`` more steps, each in
    ``step_seconds_samples`` (records before these two fields' split hold the peak's step).

    A dict because it is a row of ``zero_offload_one_gpu.json``, the file it is written to.
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
    one_step()
    if cuda:
        torch.cuda.synchronize()
    out.update(rss_after=_rss(), device_peak=torch.cuda.max_memory_allocated() if cuda else None,
               device_reserved=torch.cuda.max_memory_reserved() if cuda else None)
    samples = []
    for _ in range(timed_steps):
        start = time.perf_counter()
        one_step()
        if cuda:
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    out.update(step_seconds=statistics.median(samples), step_seconds_samples=samples)
    return out


def collect_deepspeed(step: StepConfig = DEEPSPEED_STEP, cases=DEEPSPEED_CASES) -> list[dict]:
    """``zero_offload_one_gpu.json``: each case in its own one-rank launch (a fresh process,
    so host RSS and the allocator start clean), with memlab's estimate beside it.

    A dict because it is ``zero_offload_one_gpu.json``, the file it is written to.
    """
    rows = []
    for zero, offload in cases:
        s = replace(step, zero=zero, offload=offload)
        try:
            row = run_ranks(deepspeed_one_gpu_worker, 1, kwargs={"step": s}, timeout=600)[0]
        except Exception as e:  # record it, go on with the next case
            rows.append({"zero": zero, "offload": offload, "error": f"{type(e).__name__}: {e}"[:2000]})
            print(f"DeepSpeed ZeRO-{zero} offload {offload}: FAILED {e}", flush=True)
            continue
        est = estimate_step(s) if zero or offload != "none" else None
        row["estimate_peak_bytes"] = est.peak_bytes if est else None
        row["estimate_host_bytes"] = est.host_bytes if est else None
        rows.append(row)
        print(f"DeepSpeed ZeRO-{zero} offload {offload}: device peak "
              f"{(row['device_peak'] or 0) / GiB:.2f} GiB, host RSS {row['rss_before'] / GiB:.2f} GiB",
              flush=True)
    return rows


# The cases of zero_offload_one_gpu.json a gpu-check runs (each a fresh DeepSpeed process):
# plain ZeRO-2 and ZeRO-2 + optimizer offload, the pair the offload lesson compares.
CHECK_DEEPSPEED_CASES = [(2, "none"), (2, "optimizer")]


def write(out: str | Path, card: Card) -> Path:
    """Record the reference steps sized for ``card`` into ``<out>/<card>/``."""
    folder = Path(out) / card.name
    folder.mkdir(parents=True, exist_ok=True)

    def dump(name: str, make) -> None:
        try:
            data = make()
        except Exception as e:  # one file failing must not stop the check
            data = {"error": f"{type(e).__name__}: {e}"[:2000]}
        (folder / name).write_text(json.dumps(data, indent=1, default=str))
        print(f"wrote {folder / name}", flush=True)

    process = CachingAllocator()  # the simulation's copy of this process's cache
    dump("gpu_check.json", lambda: collect(card, process=process))
    dump("devset.json", lambda: {**_header(), "rows": [lens_row(s, process=process)
                                                       for s in sized_devset(card)]})
    ds = deepspeed_step(card)
    dump("zero_offload_one_gpu.json", lambda: collect_deepspeed(ds, CHECK_DEEPSPEED_CASES))
    dump("cli_measure_zero2_offload.json",
         lambda: measure_distributed(replace(ds, zero=2, offload="optimizer"), device="cuda").to_dict())
    return folder


# ---- notebooks -----------------------------------------------------------------------
RANK_LESSONS = ("09", "10", "11", "12", "13", "15")  # start ranks: one at a time
NOTEBOOK_WORKERS = 2   # the other notebooks, two at a time on the one GPU


@dataclass
class NotebookRun:
    notebook: str
    passed: bool
    seconds: float
    log: str
    stalls: int = 0   # cells the watchdog found stalled (tools/nbval_watchdog.py, via notebooks/conftest.py)


def lesson_of(notebook: str) -> str:
    """``"04"`` for ``notebooks/04_mixed_precision.ipynb``."""
    return Path(notebook).name.split("_")[0]


def notebook_groups(notebooks: list[str]) -> tuple[list[str], list[str]]:
    """(rank notebooks, one at a time; the others, two at a time)."""
    rank = [n for n in notebooks if lesson_of(n) in RANK_LESSONS]
    return rank, [n for n in notebooks if n not in rank]


def run_notebook(notebook: str, folder: Path, python: str = sys.executable,
                 cell_timeout: int = 300) -> NotebookRun:
    """One notebook under nbval in its own pytest process; its log into ``folder``."""
    log = folder / f"nb_{Path(notebook).stem}.log"
    start = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run([python, "-m", "pytest", "--nbval", "--nbval-current-env",
                               "-p", "no:cacheprovider", f"--nbval-cell-timeout={cell_timeout}",
                               "--durations=0", notebook], stdout=f, stderr=subprocess.STDOUT)
    # the watchdog's lines: once live, once in the closing "notebook watchdog" summary
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("watchdog:")]
    for line in dict.fromkeys(lines):
        print(line, flush=True)
    return NotebookRun(notebook, done.returncode == 0, time.perf_counter() - start, str(log),
                       len(dict.fromkeys(lines)))


def run_notebooks(notebooks: list[str], folder: Path, python: str = sys.executable) -> list[NotebookRun]:
    """The rank notebooks one at a time, then the others two at a time; every notebook runs
    whatever the others did."""
    rank, others = notebook_groups(notebooks)
    runs = [run_notebook(n, folder, python) for n in rank]
    with ThreadPoolExecutor(NOTEBOOK_WORKERS) as pool:
        runs += list(pool.map(lambda n: run_notebook(n, folder, python), others))
    return runs


def table(runs: list[NotebookRun], card: Card) -> str:
    """The closing table: notebook, pass/fail, wall time, card profile."""
    lines = [f"card profile: {card.describe()}", "",
             "| notebook | result | wall s | watchdog |", "|---|---|---|---|"]
    lines += [f"| {Path(r.notebook).name} | {'pass' if r.passed else 'FAIL'} | {r.seconds:.0f} | "
              f"{f'{r.stalls} stall(s), retried' if r.stalls else '-'} |" for r in runs]
    return "\n".join(lines)


def dry_run(notebooks: list[str], cards: list[Card]) -> str:
    """The plan per notebook per card, as a CPU machine can print it: the group each notebook
    runs in, the sizes :func:`memlab.classroom.lesson.plan` gives it, and the reference steps kept."""
    rank, others = notebook_groups(notebooks)
    out = []
    for card in cards:
        out.append(f"== {card.describe()}")
        steps = sized_cases(card)
        out.append(f"  reference: {len(steps)} gpu_check steps, {len(sized_devset(card))} devset steps, "
                   f"DeepSpeed {deepspeed_step(card).model_config.name} {deepspeed_step(card).precision}")
        out.append(f"  rank notebooks: {place_ranks(2, gpus=card.gpus).reason}")
        for n in rank + others:
            group = "one at a time" if n in rank else f"{NOTEBOOK_WORKERS} at a time"
            out.append(f"  {Path(n).name:<44} [{group}] {plan(lesson_of(n), card).line()}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memlab.app.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="build/gpu-check",
                        help="folder for <card>/ (never the shipped references)")
    parser.add_argument("--notebooks", nargs="*", default=[], help="notebooks to run under nbval")
    parser.add_argument("--card", default=None,
                        help=f"dry run: the card to plan for (default: all of {', '.join(CARDS)})")
    parser.add_argument("--dry-run", action="store_true", help="print the plan; needs no GPU")
    parser.add_argument("--no-reference", action="store_true", help="notebooks only")
    args = parser.parse_args(argv)
    if Path(args.out).resolve().is_relative_to(Path(__file__).resolve().parents[1] / "data"):
        print(f"gpu_check: --out {args.out} is inside the shipped references; allowed: any other "
              f"folder, e.g. build/gpu-check", file=sys.stderr)
        return 2
    if args.dry_run:
        cards = [get_card(args.card)] if args.card else list(CARDS.values())
        print(dry_run(args.notebooks, cards))
        return 0
    card = detect_card()
    if card is None:
        print("gpu_check: torch sees no CUDA GPU; run it on a machine with one (or --dry-run)",
              file=sys.stderr)
        return 2
    if card.rehearsal:
        rehearse(card)
    folder = Path(args.out) / card.name
    folder.mkdir(parents=True, exist_ok=True)
    print(f"gpu-check on {card.describe()} -> {folder}", flush=True)
    start = time.perf_counter()
    if not args.no_reference:
        write(args.out, card)
    runs = run_notebooks(args.notebooks, folder)
    summary = table(runs, card) + f"\n\ntotal {time.perf_counter() - start:.0f} s\n"
    (folder / "summary.md").write_text(summary)
    print(summary)
    return 0 if all(r.passed for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
