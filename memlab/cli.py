"""``memlab``: estimate, simulate or measure the memory of one training step.

    memlab estimate --model gpt2-xl --seq 1024 --batch 4 --gpu A100-40GB
    memlab simulate --model gpt2-medium --seq 2048 --batch 8 --precision bf16 --json
    memlab simulate --model tiny --target cpu      # bytes as this CPU holds them
    memlab measure  --model tiny --budget 120MiB
    memlab measure  --model tiny --zero 2 --world-size 2 --json
    memlab presets

Exit status: 0 for a result (a step that does not fit its budget is a result: ``fits:
false``); 2 for bad input, a flag the command cannot honour, or a real measurement this
machine cannot hold (one line naming the value and what is allowed, or the memory needed,
what is available and what to run instead); 1 for an internal error, with its traceback.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import traceback
from dataclasses import replace
from typing import Union

from . import classroom, doctor, hf
from .advisor import Advice, advise
from .cards import SPEEDS, detect_card
from .distributed.deepspeed_zero import measure_distributed
from .distributed.fsdp import simulate_sharded
from .errors import InputError
from .estimate import estimate_step
from .guard import HostMemoryError
from .hardware import GPU_PRESETS, resolve_budget
from .measure import measure_step
from .models import ATTENTIONS, CHECKPOINTINGS, PRESETS, UNET_PRESETS, GPTConfig, get_config
from .plan_search import search_plans
from .policy import emulate, get_target, resolve_target
from .simulate import simulate_step
from .step import OFFLOADS, OPTIMIZERS, PRECISIONS, MemoryReport, StepConfig
from .technique_table import Table, write_report
from .units import fmt_bytes

#: What a subcommand computes: each prints itself with ``table()`` or ``to_json()``.
Result = Union[MemoryReport, Advice, Table]


class UsageError(InputError):
    """Bad command line (argparse's complaint): printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's default prints the whole usage first
        raise UsageError(message)


def _positive_int(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a positive integer, got {text!r}")
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be a positive integer, got {value}")
        return value
    return parse


def _zero_stage(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value not in (0, 1, 2, 3):
        raise argparse.ArgumentTypeError(f"ZeRO stage {text!r} is outside 0-3")
    return value


def _add_step_args(p: argparse.ArgumentParser, *, device: bool, target: bool = False) -> None:
    models = ", ".join([*PRESETS, *UNET_PRESETS])
    p.add_argument("--model", default="tiny", help=f"preset: {models}")
    p.add_argument("--d-model", type=_positive_int("d-model"), help="custom GPT width")
    p.add_argument("--layers", type=_positive_int("layers"), help="custom GPT depth")
    p.add_argument("--heads", type=_positive_int("heads"), help="custom GPT heads")
    p.add_argument("--vocab", type=_positive_int("vocab"), help="custom GPT vocabulary")
    p.add_argument("--seq", type=_positive_int("seq"), default=256, help="sequence length (UNet: image side)")
    p.add_argument("--batch", type=_positive_int("batch"), default=8, help="batch size per rank")
    p.add_argument("--micro-batches", type=_positive_int("micro-batches"), default=1,
                   help="gradient accumulation: split the batch into this many micro-batches")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32")
    p.add_argument("--checkpointing", choices=CHECKPOINTINGS, default=None)
    p.add_argument("--attention", choices=ATTENTIONS, default=None)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--zero", type=_zero_stage, default=0, help="ZeRO stage 0-3")
    p.add_argument("--world-size", type=_positive_int("world size"), default=1)
    p.add_argument("--offload", choices=OFFLOADS, default="none")
    p.add_argument("--gpu", default=None, help=f"budget from a card: {', '.join(GPU_PRESETS)}")
    p.add_argument("--budget", default=None, help="budget as a size: 512MiB, 40GB, 1073741824")
    if target:
        p.add_argument("--hf-config", default=None, metavar="PATH",
                       help="a Hugging Face config.json (or its folder, or a shipped name: "
                            "llama-3-8b, qwen2.5-7b, mistral-7b, gpt2) instead of --model")
        p.add_argument("--target", default="cuda",
                       help="device whose autocast policy, kernels and workspaces are counted: "
                            "cuda (default) or cpu")
    if device:
        p.add_argument("--device", default="cpu", help="cpu or cuda")
        p.add_argument("--snapshot", default=None,
                       help="CUDA only: write the allocator history (.pickle) for pytorch.org/memory_viz")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="memlab", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_step_args(sub.add_parser("estimate", help="closed-form formulas"), device=False, target=True)
    _add_step_args(sub.add_parser("simulate", help="the step on fake tensors"), device=False, target=True)
    _add_step_args(sub.add_parser("measure", help="a real step, tracked"), device=True)
    p = sub.add_parser("presets", help="list model and GPU presets")
    p.add_argument("--json", action="store_true")
    _add_advise_args(sub.add_parser("advise", help="the techniques, in order, until the step fits"))
    p = sub.add_parser("report", help="the curriculum's comparison table, measured (Markdown + PNG)")
    p.add_argument("--out", required=True, help="folder for table.md, table.json and table.png")
    p.add_argument("--model", default="tiny", help=f"preset: {', '.join(PRESETS)}")
    p.add_argument("--seq", type=_positive_int("seq"), default=256, help="sequence length")
    p.add_argument("--batch", type=_positive_int("batch"), default=8, help="batch size")
    p.add_argument("--world-size", type=_positive_int("world size"), default=2,
                   help="ranks for the ZeRO, offload, TP and PP rows")
    p.add_argument("--no-distributed", action="store_true", help="single-device rows only (fast)")
    p.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    # classroom commands: their logic is in memlab.doctor and memlab.classroom
    p = sub.add_parser("doctor", help="pre-flight check for a class: versions, GPU, DeepSpeed op, two ranks")
    p.add_argument("--no-build", action="store_true", help="do not build DeepSpeed's CPU Adam op")
    p.add_argument("--json", action="store_true")
    p.add_argument("--calibrate", action="store_true",
                   help="measure one matmul and the host's Adam for the step-time model (memlab.step_time)")
    p = sub.add_parser("class", help="class tools: `class collect DIR --out results.csv`")
    p.add_argument("action", choices=["collect"])
    p.add_argument("rest", nargs=argparse.REMAINDER, help="DIR [--out results.csv] [--timeout S]")
    return parser


def _headroom(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"headroom {text!r} is outside [0, 1): give a fraction such as 0.1")
    return value


def _add_advise_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help=f"preset: {', '.join(PRESETS)}")
    p.add_argument("--gpu", default=None, help=f"the card: {', '.join(GPU_PRESETS)}")
    p.add_argument("--budget", default=None, help="or a size: 512MiB, 40GB")
    p.add_argument("--world-size", type=_positive_int("world size"), default=1)
    p.add_argument("--seq", type=_positive_int("seq"), default=1024, help="sequence length")
    p.add_argument("--batch", type=_positive_int("batch"), default=8, help="batch size per rank")
    p.add_argument("--attention", choices=ATTENTIONS, default=None)
    p.add_argument("--headroom", type=_headroom, default=0.1, help="fraction of the card kept free")
    p.add_argument("--no-simulate", action="store_true", help="estimate only, never simulate")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _advise(args: argparse.Namespace) -> Advice:
    budget = _budget(args)
    if budget is None:
        raise InputError(f"give --gpu ({', '.join(GPU_PRESETS)}) or --budget SIZE")
    advice = advise(args.model, budget, args.world_size, args.seq, args.batch,
                    attention=args.attention, headroom=args.headroom,
                    simulate=False if args.no_simulate else None)
    return _with_fastest_fit(advice, args)


def _with_fastest_fit(advice: Advice, args: argparse.Namespace) -> Advice:
    """``--gpu`` names a card: time every candidate on it (memlab.plan_search), as the Python
    ``advise`` does when given the preset's name (the CLI passes its budget in bytes)."""
    if advice.search is None and args.gpu in SPEEDS:
        advice.search = search_plans(args.model, args.gpu, args.world_size, args.seq, args.batch,
                                     usable_bytes=advice.usable_bytes, attention=args.attention,
                                     target=advice.target)
    return advice


def step_from_args(args: argparse.Namespace) -> StepConfig:
    """A validated StepConfig from parsed flags; :class:`InputError` names a bad value."""
    custom = {k: v for k, v in (("d_model", args.d_model), ("n_layer", args.layers),
                                ("n_head", args.heads), ("vocab_size", args.vocab)) if v is not None}
    model = get_config(args.model)
    if custom:
        if not isinstance(model, GPTConfig):
            raise InputError(f"--d-model/--layers/--heads/--vocab apply to GPT models, not {args.model!r}")
        model = replace(model, name="custom", **custom)
    return StepConfig(model=model, seq=args.seq, batch=args.batch, precision=args.precision,
                      checkpointing=args.checkpointing, attention=args.attention,
                      optimizer=args.optimizer, micro_batches=args.micro_batches, zero=args.zero,
                      world_size=args.world_size, offload=args.offload)


def _budget(args: argparse.Namespace) -> int | None:
    if args.gpu is not None and args.gpu not in GPU_PRESETS:
        raise InputError(f"unknown GPU preset {args.gpu!r}; allowed: {', '.join(GPU_PRESETS)}")
    if args.gpu is not None and args.budget is not None:
        raise InputError("give --gpu or --budget, not both")
    return resolve_budget(args.gpu if args.gpu is not None else args.budget)


def _multi_rank(step: StepConfig) -> bool:
    """Whether ``measure`` runs ``step`` on DeepSpeed ranks rather than in this process."""
    return step.world_size > 1 or step.zero > 0 or step.offload != "none"


def _check_simulate(step: StepConfig) -> None:
    """Refuse what the simulation cannot honour rather than ignore it."""
    if step.world_size > 1:
        if step.offload != "none":
            raise InputError(f"--offload {step.offload} with --world-size {step.world_size}: the "
                             f"sharded simulation keeps every tensor on the device; use estimate "
                             f"or measure")
        if step.zero != 3:
            raise InputError(f"simulate shards with FSDP2 (ZeRO-3) only; got --zero {step.zero} "
                             f"with --world-size {step.world_size}: use --zero 3, or estimate/measure")
        if step.optimizer != "adamw":
            raise InputError(f"--optimizer {step.optimizer} with --world-size {step.world_size}: "
                             f"the sharded simulation runs AdamW only; use estimate or measure")


def _check_measure(step: StepConfig, args: argparse.Namespace) -> None:
    """Refuse the measurement flags that a run cannot honour rather than ignore them."""
    if args.device not in ("cpu", "cuda"):
        raise InputError(f"unknown device {args.device!r}; allowed: cpu, cuda")
    if args.snapshot is not None and _multi_rank(step):
        raise InputError("--snapshot records one process's CUDA allocator; it is not available "
                         "for multi-rank runs (--world-size/--zero/--offload): drop it, or "
                         "measure one rank without ZeRO")
    if args.snapshot is not None and args.device != "cuda":
        raise InputError(f"--snapshot records the CUDA allocator's history; with --device "
                         f"{args.device} there is none: use --device cuda, or drop it")


def run(args: argparse.Namespace) -> Result:
    """Compute what a subcommand asks for: a :class:`MemoryReport` (estimate, simulate,
    measure), an :class:`~memlab.advisor.Advice` (advise) or a
    :class:`~memlab.technique_table.Table` (report)."""
    if args.command == "advise":
        return _advise(args)
    if args.command == "report":
        if args.world_size < 2 and not args.no_distributed:
            raise InputError(f"world size {args.world_size} for the multi-rank rows; allowed: 2 or "
                             f"more (or --no-distributed)")
        table, _ = write_report(args.out, StepConfig(model=args.model, seq=args.seq, batch=args.batch),
                                world_size=args.world_size, distributed=not args.no_distributed)
        return table
    step = step_from_args(args)
    budget = _budget(args)
    if args.command in ("estimate", "simulate"):
        get_target(args.target)  # a bad --target is a usage error before any work
        # the card: --gpu names it (its kernels, cuBLAS workspace, memory as the budget), else
        # the GPU present, else the reference H200 (the same target Python's lenses take)
        card = None if args.gpu is not None or args.target != "cuda" else detect_card()
        target = get_target(args.target, args.gpu, card)
        budget = args.gpu if args.gpu is not None else budget
        if args.hf_config is not None:
            return _hf_step(args, budget, target)
    if args.command == "estimate":
        return estimate_step(step, budget=budget, target=target)
    if args.command == "simulate":
        _check_simulate(step)
        if step.world_size > 1:
            return _simulate_sharded(step, budget, target)
        return simulate_step(step, budget=budget, target=target)
    _check_measure(step, args)
    if _multi_rank(step):
        return measure_distributed(step, device=args.device, budget=budget)
    return measure_step(step, device=args.device, budget=budget, snapshot_path=args.snapshot)


def _hf_step(args: argparse.Namespace, budget: int | str | None, target) -> MemoryReport:
    """estimate or simulate of a Hugging Face config.json (:mod:`memlab.hf`)."""
    if args.model != "tiny" or any(v is not None for v in (args.d_model, args.layers, args.heads, args.vocab)):
        raise InputError("--hf-config describes the model: drop --model/--d-model/--layers/--heads/--vocab")
    kw = dict(seq=args.seq, batch=args.batch, precision=args.precision,
              checkpointing=args.checkpointing, attention=args.attention)
    if args.command == "estimate":
        step = hf.step_config(args.hf_config, optimizer=args.optimizer, micro_batches=args.micro_batches,
                              zero=args.zero, world_size=args.world_size, offload=args.offload, **kw)
        return estimate_step(step, budget=budget, target=target)
    if (args.micro_batches, args.zero, args.world_size, args.offload, args.optimizer) != (1, 0, 1, "none", "adamw"):
        raise InputError("simulate --hf-config runs one AdamW step on one device; allowed: no "
                         "--micro-batches/--zero/--world-size/--offload/--optimizer (use estimate)")
    return hf.simulate_hf(args.hf_config, target=target, budget=budget, **kw)


def _simulate_sharded(step: StepConfig, budget: int | str | None, target) -> MemoryReport:
    """The FSDP2 simulation under a target's kernels; for CUDA each rank also holds the
    cuBLAS workspaces (its own process). Block rounding and per-call workspaces are not
    applied by the sharded tracker."""
    tgt = resolve_target(target, budget)
    with emulate(tgt):
        report = simulate_sharded(step, step.world_size, budget=budget)
    workspace = tgt.resident_workspace()
    for rep in {id(r): r for r in [report, *(report.per_rank or [])]}.values():
        rep.device = f"{tgt.name} (fake)"
        if workspace:
            rep.by_category["workspace"] = rep.by_category.get("workspace", 0) + workspace
            rep.peak_bytes += workspace
    if workspace:
        report.notes.append(f"{tgt.name}: autocast policy and kernels emulated, cuBLAS workspace "
                            f"added per rank; no 512-byte block rounding in the sharded tracker")
    return report


def way_out(argv: list[str], step: StepConfig | None) -> str:
    """What to run instead of a measurement this machine cannot hold: the same flags with
    ``simulate`` (``estimate`` where the simulation cannot honour them)."""
    lens = "simulate"
    if step is not None:
        try:
            _check_simulate(step)
        except InputError:
            lens = "estimate"
    rest, skip = [], False
    for a in argv[argv.index("measure") + 1:] if "measure" in argv else argv:
        if skip:
            skip = False
        elif a in ("--device", "--snapshot"):
            skip = True  # measurement-only flags, with their value
        elif not a.startswith(("--device=", "--snapshot=")):
            rest.append(a)
    return (f"run `{shlex.join(['memlab', lens, *rest])}` instead, or choose a smaller model, "
            f"sequence or batch")


def _presets(as_json: bool) -> str:
    models = {name: {"params": cfg.num_params(), "d_model": cfg.d_model, "layers": cfg.n_layer,
                     "heads": cfg.n_head, "kv_heads": cfg.kv_heads, "vocab": cfg.vocab_size}
              for name, cfg in PRESETS.items()}
    models.update({name: {"params": cfg.num_params()} for name, cfg in UNET_PRESETS.items()})
    if as_json:
        return json.dumps({"models": models, "gpus": GPU_PRESETS}, indent=2)
    lines = ["models:"]
    lines += [f"  {n:<12} {m['params'] / 1e6:10.1f} M params" for n, m in models.items()]
    lines += ["gpus:"] + [f"  {n:<14} {fmt_bytes(b)}" for n, b in GPU_PRESETS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = None
    try:
        args = parser.parse_args(argv)
        if args.command == "presets":
            print(_presets(args.json))
            return 0
        if args.command == "doctor":
            return doctor.main(["--no-build"] * args.no_build + ["--json"] * args.json
                               + ["--calibrate"] * args.calibrate)
        if args.command == "class":
            return classroom.main(args.rest)
        result = run(args)
    except HostMemoryError as e:
        step = None
        try:
            step = step_from_args(args)
        except (InputError, AttributeError):
            pass
        _one_line(e.with_way_out(way_out(argv, step)))
        return 2
    except InputError as e:
        _one_line(e)
        return 2
    except Exception:  # a bug, not the user's input: show where
        traceback.print_exc()
        print("memlab: internal error (the traceback above is a bug in memlab, not in your "
              "input; please report it)", file=sys.stderr)
        return 1
    print(result.to_json() if args.json else result.table())
    return 0


def _one_line(error: Exception) -> None:
    print(f"memlab: error: {' '.join(str(error).split())}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
