"""``memlab``: estimate, simulate or measure the memory of one training step.

    memlab estimate --model gpt2-xl --seq 1024 --batch 4 --gpu A100-40GB
    memlab simulate --model gpt2-medium --seq 2048 --batch 8 --precision bf16 --json
    memlab simulate --model tiny --target cpu      # bytes as this CPU holds them
    memlab measure  --model tiny --budget 120MiB
    memlab measure  --model tiny --zero 2 --world-size 2 --json
    memlab measure  --model tiny --fsdp --world-size 2         # FSDP2 on 2 ranks (gloo; NCCL with --device cuda)
    memlab presets
    memlab oom < traceback.txt                     # an OOM message read and explained
    memlab estimate --hf-config gpt2 --world-size 2 --deepspeed ds_config.json --checkpointing full
    memlab estimate --hf-config llama-3-8b --training-args args.json      # TrainingArguments / SFTConfig
    memlab estimate --hf-config llama-3.1-8b --training-args grpo.yaml --gpu H100-80GB  # GRPO/DPO/RewardConfig
    memlab estimate --hf-config llama-3-8b --lora-rank 16 --load-in-4bit  # QLoRA
    memlab advise --hf-config llama-3-8b --gpu A100-80GB --world-size 8 --seq 4096 --batch 1 --finetune

Exit status: 0 for a result (a step that does not fit its budget is a result: ``fits:
false``); 2 for bad input, a flag the command cannot honour, or a real measurement this
machine cannot hold (one line naming the value and what is allowed, or the memory needed,
what is available and what to run instead); 1 for an internal error, with its traceback.

Over 500 lines because every subcommand's flags and their refusals live here, each family in
its own block (the step, advise, a run's configs: --deepspeed, --training-args, LoRA and
quantisation); the readers themselves are in memlab.hf.read_run_configs and memlab.techniques.finetune.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
import traceback
from dataclasses import replace
from typing import TYPE_CHECKING, Union

from memlab.core.errors import InputError
from memlab.core.hardware import GPU_PRESETS, resolve_budget
from memlab.core.units import fmt_bytes
from memlab.hf import config as hf
from memlab.hf import simulation_bound
from memlab.models.gpt_unet import ATTENTIONS, CHECKPOINTINGS, PRESETS, UNET_PRESETS, GPTConfig, get_config
from memlab.step import low_bit
from memlab.step.training_step import (
    DECODER_LOSSES,
    GPT_OPTIMIZERS,
    OFFLOADS,
    OPTIMIZERS,
    PRECISIONS,
    MemoryReport,
    StepConfig,
)

if TYPE_CHECKING:  # annotations only: each command imports what it runs when it runs (startup)
    from memlab.classroom.technique_table import Table
    from memlab.planning.advisor import Advice
    from memlab.step.fine_tune_config import LoraConfig
    from memlab.tracking.oom_messages import OOMExplanation

#: --hf-config's help wherever a command takes it (the shipped names from memlab.hf.config.SHIPPED)
HF_CONFIG_HELP = ("a Hugging Face config.json (or its folder, or a shipped name: "
                  f"{', '.join(hf.SHIPPED)}) instead of --model")

# -- a run as its configs write it (memlab.hf.read_run_configs, memlab.techniques.finetune) ---------------------
#: --optimizer: the step's own optimizers, the fine-tuner's states, and HF's optim names
OPTIMIZER_CHOICES = tuple(dict.fromkeys([*OPTIMIZERS, *low_bit.OPTIMIZER_STATES,
                                         *low_bit.HF_OPTIMIZERS]))


def _add_run_config_args(p: argparse.ArgumentParser) -> None:
    """--deepspeed FILE and the fine-tuning flags of estimate, simulate and measure."""
    p.add_argument("--deepspeed", default=None, metavar="FILE",
                   help="a DeepSpeed config (JSON): stage, offload, precision, batch keys and "
                        "bucket sizes; \"auto\" values filled as HF's Trainer fills them")
    p.add_argument("--lora-rank", type=_positive_int("lora-rank"), default=None,
                   help="LoRA adapters of this rank (with --lora-targets, default: every projection)")
    p.add_argument("--lora-targets", default=None, help="comma-separated LoRA target modules")
    p.add_argument("--lora-dropout", type=float, default=0.0,
                   help="LoRA dropout (--hf-config): each adapter keeps a mask and a dropped copy of its input")
    p.add_argument("--lora-config", default=None, metavar="FILE", help="peft's adapter_config.json")
    p.add_argument("--loss", choices=DECODER_LOSSES, default="transformers",
                   help="--hf-config: the class's own loss (fp32 logits) or memlab's chunked linear "
                        "cross-entropy (no logits)")
    p.add_argument("--loss-chunk", type=_positive_int("loss-chunk"), default=1024,
                   help="tokens per chunk of --loss chunked")
    p.add_argument("--load-in-4bit", action="store_true",
                   help="bitsandbytes NF4 base weights (blocks of 64, double quantization): QLoRA")
    p.add_argument("--load-in-8bit", action="store_true", help="bitsandbytes int8 base weights")
    p.add_argument("--training-args", default=None, metavar="FILE",
                   help="a training YAML/JSON: TrainingArguments / TRL config with TRL's model arguments "
                        "(use_peft, lora_*, load_in_4bit, dtype), a LLaMA-Factory or an axolotl recipe: "
                        "batch, accumulation, precision, checkpointing, optim, deepspeed, fsdp, length, LoRA")
    p.add_argument("--accelerate-config", default=None, metavar="FILE",
                   help="an accelerate config YAML: num_processes, mixed_precision, its DeepSpeed plugin "
                        "(deepspeed_config_file or zero_stage/offload_*_device) or fsdp_config (--hf-config)")


def _with_training_args(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of ``args`` with what --training-args decides (memlab.hf.read_run_configs.read_training_args):
    batch = per-device batch x accumulation, precision, checkpointing, --optimizer, --seq from
    max_length, its deepspeed config; fsdp full_shard as ZeRO-3, shard_grad_op as ZeRO-2."""
    from memlab.hf import read_run_configs as run_config
    tr = run_config.read_training_args(args.training_args)
    new = argparse.Namespace(**vars(args))
    new.batch, new.micro_batches = tr.micro_batch * tr.accumulation, tr.accumulation
    new.precision, new.checkpointing = tr.precision, tr.checkpointing or args.checkpointing
    new.optimizer = tr.optimizer
    new.seq = tr.seq or args.seq
    new.trainer_args, new.run_notes = tr.args, list(tr.notes)
    new.file_lora, new.file_quant = tr.lora, tr.quantization
    if tr.attention == "eager":  # HF's own attention keeps its scores; the fused kernels are the default
        new.attention = "naive"
    if tr.deepspeed is not None:
        if args.deepspeed is not None:
            raise InputError("--training-args names a deepspeed config: drop --deepspeed")
        new.deepspeed = tr.deepspeed
    if tr.fsdp:
        if new.deepspeed is not None:
            raise InputError("--training-args sets fsdp and deepspeed; allowed: one of them")
        stage = 3 if "full_shard" in tr.fsdp else 2 if "shard_grad_op" in tr.fsdp else 0
        if stage:
            new.zero = stage
            new.run_notes.append(f"fsdp {' '.join(tr.fsdp)} estimated as ZeRO-{stage} (DeepSpeed's "
                                 f"2 + 2 + 12 bytes layout; simulate --world-size N runs FSDP2 itself)")
        if "offload" in tr.fsdp:
            new.run_notes.append("fsdp offload is not modelled")
    return new


def _with_accelerate(args: argparse.Namespace):
    """A copy of ``args`` with what --accelerate-config decides (memlab.hf.read_run_configs.read_accelerate):
    the world size, the precision (its mixed_precision, unless --training-args sets one), its
    DeepSpeed config or FSDP's stage; and the AccelerateRun."""
    from memlab.hf import read_run_configs as run_config
    acc = run_config.read_accelerate(args.accelerate_config)
    new = argparse.Namespace(**vars(args))
    if args.world_size not in (1, acc.world_size):
        raise InputError(f"--world-size {args.world_size} and the accelerate config's num_processes "
                         f"{acc.world_size}; allowed: one of them")
    new.world_size = acc.world_size
    if args.precision in (None, "fp32") and acc.mixed_precision != "no":
        new.precision = acc.precision
    if acc.deepspeed is not None:
        if args.deepspeed is not None:
            raise InputError("--accelerate-config names a DeepSpeed config: drop --deepspeed")
        new.deepspeed = acc.deepspeed
    elif acc.zero:
        new.zero = acc.zero
    return new, acc


def _file_fine_tune(args: argparse.Namespace, lora, quant):
    """The LoRA and quantisation a --training-args file asks for, where no flag gives them."""
    file_lora, file_quant = getattr(args, "file_lora", None), getattr(args, "file_quant", None)
    if file_lora is not None and lora is not None:
        raise InputError("--training-args gives the LoRA adapters: drop --lora-rank/--lora-targets/--lora-config")
    if file_quant is not None and quant is not None:
        raise InputError("--training-args gives the quantisation: drop --load-in-4bit/--load-in-8bit")
    return lora or file_lora, quant or file_quant


def _fine_tune(args: argparse.Namespace, cfg) -> tuple[dict | None, list[str]]:
    """``estimate_finetune``'s keywords from the flags (None: a plain step) and the notes of
    what a --lora-config does not model."""
    from memlab.step.fine_tune_config import lora_targets_for
    kind = low_bit.HF_OPTIMIZERS.get(args.optimizer, args.optimizer)
    lora, notes = None, []
    if args.lora_config is not None:
        if args.lora_rank is not None or args.lora_targets is not None:
            raise InputError("give --lora-config or --lora-rank/--lora-targets, not both")
        from memlab.hf import read_run_configs as run_config
        spec = run_config.read_lora_config(args.lora_config, cfg)
        lora, notes = (spec.rank, spec.targets), list(spec.notes)
    elif args.lora_rank is not None or args.lora_targets is not None:
        targets = (tuple(args.lora_targets.split(",")) if args.lora_targets
                   else lora_targets_for(cfg))
        lora = (args.lora_rank or 8, targets)  # 8: peft's default r
    if args.load_in_4bit and args.load_in_8bit:
        raise InputError("give --load-in-4bit or --load-in-8bit, not both")
    quant = "4bit" if args.load_in_4bit else "8bit" if args.load_in_8bit else "none"
    if lora is None and quant == "none" and kind in GPT_OPTIMIZERS:  # a field of the step (_step_optimizer)
        return None, notes
    return {"lora": lora, "optimizer": kind, "quantization": quant}, notes


def _step_optimizer(args: argparse.Namespace) -> str:
    """The StepConfig optimizer of the --optimizer name: SGD; bitsandbytes' 8-bit AdamW, plain or
    paged, or torchao's low-bit AdamW,
    when no adapter or quantised base is asked for (a run field every lens runs); else AdamW
    (Adafactor's and the adapters' state replace AdamW's in memlab.techniques.finetune.estimate_finetune)."""
    kind = low_bit.HF_OPTIMIZERS.get(args.optimizer, args.optimizer)
    tuned = any(getattr(args, f, None) for f in ("lora_rank", "lora_targets", "lora_config", "load_in_4bit",
                                                  "load_in_8bit"))
    if kind in low_bit.BLOCKWISE and not tuned:
        return kind
    return "sgd" if kind == "sgd" else "adamw"


def _configured(args: argparse.Namespace) -> bool:
    """Whether a run config or a fine-tuning flag is given (the step is then read from them)."""
    return (getattr(args, "deepspeed", None) is not None or args.lora_rank is not None
            or getattr(args, "training_args", None) is not None
            or getattr(args, "accelerate_config", None) is not None
            or args.lora_targets is not None or args.lora_config is not None
            or args.load_in_4bit or args.load_in_8bit or args.optimizer not in OPTIMIZERS)


def _configured_step(args: argparse.Namespace):
    """The step, the DeepSpeed run (or None) and its notes: --deepspeed decides the stage,
    offload, precision and batch keys (the flags fill only its "auto" values)."""
    from memlab.hf import read_run_configs as run_config
    step = step_from_args(args)
    step = replace(step, optimizer=_step_optimizer(args),
                   optimizer_in_backward=args.optimizer_in_backward)
    if args.deepspeed is None:
        return step, None, []
    if args.zero != 0 or args.offload != "none":
        raise InputError("--deepspeed gives the ZeRO stage and the offload: drop --zero/--offload")
    ds = run_config.read_deepspeed(args.deepspeed, world_size=args.world_size,
                                   hidden_size=step.model_config.d_model, batch=args.batch,
                                   micro_batches=args.micro_batches, precision=args.precision,
                                   trainer_args=getattr(args, "trainer_args", None))
    return replace(step, **ds.step_fields()), ds, list(ds.notes)


def _run_configured(args: argparse.Namespace, budget, target) -> MemoryReport:
    """estimate, simulate or measure of a step read from --training-args, --deepspeed and the
    fine-tuning flags."""
    from memlab.distributed.deepspeed_zero import measure_distributed
    from memlab.lenses.estimate import estimate_step
    from memlab.lenses.measure import measure_step
    from memlab.techniques import finetune
    if getattr(args, "accelerate_config", None) is not None:
        raise InputError("--accelerate-config is read with --hf-config (estimate); allowed: a Hugging Face config")
    if getattr(args, "training_args", None) is not None:
        args = _with_training_args(args)
        if args.file_lora is not None or args.file_quant is not None:
            raise InputError("--training-args asks for LoRA or a 4/8-bit base: its model arguments are read "
                             "with --hf-config; allowed here: --lora-rank/--lora-targets/--load-in-4bit")
    step, ds, notes = _configured_step(args)
    notes = getattr(args, "run_notes", []) + notes
    tune, lora_notes = _fine_tune(args, step.model_config)
    notes += lora_notes
    if args.command == "estimate":
        if tune is None:
            report = estimate_step(step, budget=budget, target=target,
                                   buckets=ds.buckets if ds else None)
        else:
            if ds is not None and (ds.zero or ds.offload != "none") and \
                    (tune["optimizer"] != "adamw" or tune["quantization"] != "none"):
                raise InputError("bitsandbytes' 8-bit, paged and 4-bit state are estimated without "
                                 "ZeRO; drop them or the DeepSpeed config's stage")
            report = finetune.estimate_finetune(step, budget=budget, target=target, **tune)
    elif args.command == "simulate":
        report = _simulate_configured(args, step, tune, budget, target)
        if ds is not None and ds.zero:
            notes.append("simulate: DeepSpeed's bucket sizes are not simulated (estimate honours them)")
    else:
        if tune is not None:
            raise InputError("measure runs full AdamW or SGD steps; for LoRA, quantised weights and "
                             "8-bit, paged or Adafactor state use estimate or simulate")
        _check_measure(step, args)
        if _multi_rank(step):
            report = measure_distributed(step, device=args.device, budget=budget,
                                         ds_config=ds.config if ds else None)
        else:
            report = measure_step(step, device=args.device, budget=budget, snapshot_path=args.snapshot)
    if ds is not None:
        notes.insert(0, f"--deepspeed: ZeRO-{ds.zero}, offload {ds.offload}, {ds.precision}, micro-batch "
                        f"{ds.micro_batch} x {ds.accumulation} accumulation x {ds.world_size} rank(s) "
                        f"= train_batch_size {ds.train_batch}; buckets reduce {ds.buckets.reduce:,}, "
                        f"prefetch {ds.buckets.prefetch:,}, persistence {ds.buckets.persistence:,} elements")
    report.notes.extend(notes)
    return report


def _simulate_configured(args, step, tune, budget, target) -> MemoryReport:
    """simulate of a configured step of memlab's own model (a Hugging Face config's run goes
    through :func:`_hf_step`, LoRA and quantisation included)."""
    from memlab.lenses.simulate import simulate_step
    if tune is not None:
        raise InputError("simulate with LoRA or a quantised base builds the model with peft and "
                         "bitsandbytes: give --hf-config")
    _check_simulate(step)
    if step.world_size > 1:
        return _simulate_sharded(step, budget, target)
    return simulate_step(step, budget=budget, target=target)

#: What a subcommand computes: each prints itself with ``table()`` or ``to_json()``.
Result = Union[MemoryReport, "Advice", "Table"]


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
            raise argparse.ArgumentTypeError(f"{name} must be a positive integer, got {text!r}") from None
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


#: ``--compile``'s scopes and the ``StepConfig.compile`` value each gives
COMPILE_SCOPES = {"graph": True, "layers": "layers"}


def _compile_scope(text: str) -> bool | str:
    """``--compile``'s value: ``graph`` (what bare ``--compile`` means) or ``layers``."""
    if text not in COMPILE_SCOPES:
        raise argparse.ArgumentTypeError(
            f"{text!r}; allowed: graph (the whole model and loss as one graph; bare --compile), "
            f"layers (torchtune's: each block and the loss compiled apart)")
    return COMPILE_SCOPES[text]


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
    p.add_argument("--optimizer", choices=OPTIMIZER_CHOICES, default="adamw",
                   help="adamw, sgd; 8-bit, paged and Adafactor state (memlab names or HF's optim names)")
    p.add_argument("--zero", type=_zero_stage, default=0, help="ZeRO stage 0-3")
    p.add_argument("--world-size", type=_positive_int("world size"), default=1)
    p.add_argument("--offload", choices=OFFLOADS, default="none")
    p.add_argument("--optimizer-in-backward", action="store_true",
                   help="the optimizer step fused into backward: each gradient applied and freed as it is made")
    p.add_argument("--activation-offload", action="store_true",
                   help="save_on_cpu: forward's saved tensors copied to host memory, brought back for backward")
    p.add_argument("--compile", nargs="?", const=True, default=False, type=_compile_scope, metavar="{graph,layers}",
                   help="torch.compile (inductor): the min-cut partitioner chooses what forward saves "
                        "(measured from the allocator's events; estimate and simulate trace inductor's partition "
                        "and generated code on fake tensors: seconds). graph (bare --compile): the whole model "
                        "and loss, one graph; layers: as torchtune compiles, each block and the loss apart")
    p.add_argument("--activation-memory-budget", type=float, default=None, metavar="FRACTION",
                   help="torch._functorch.config.activation_memory_budget for --compile, in (0, 1]")
    p.add_argument("--gpu", default=None, help=f"budget from a card: {', '.join(GPU_PRESETS)}")
    p.add_argument("--budget", default=None, help="budget as a size: 512MiB, 40GB, 1073741824")
    if target:
        p.add_argument("--hf-config", default=None, metavar="PATH",
                       help=HF_CONFIG_HELP)
        p.add_argument("--target", default="cuda",
                       help="device whose autocast policy, kernels and workspaces are counted: "
                            "cuda (default) or cpu")
    if device:
        p.add_argument("--device", default="cpu", help="cpu or cuda")
        p.add_argument("--snapshot", default=None,
                       help="CUDA only: write the allocator history (.pickle) for pytorch.org/memory_viz")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_run_config_args(p)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="memlab", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_step_args(sub.add_parser("estimate", help="closed-form formulas"), device=False, target=True)
    p = sub.add_parser("simulate", help="the step on fake tensors")
    _add_step_args(p, device=False, target=True)
    _add_bound_args(p)
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
    # classroom commands: their logic is in memlab.app.doctor and memlab.classroom.collect
    p = sub.add_parser("doctor", help="pre-flight check for a class: versions, GPU, DeepSpeed op, two ranks")
    p.add_argument("--no-build", action="store_true", help="do not build DeepSpeed's CPU Adam op")
    p.add_argument("--json", action="store_true")
    p.add_argument("--calibrate", action="store_true",
                   help="measure a Linear's training matmuls, attention, elementwise rates and the host's Adam "
                        "for the step-time model")
    p = sub.add_parser("class", help="class tools: `class collect DIR --out results.csv`")
    p.add_argument("action", choices=["collect"])
    p.add_argument("rest", nargs=argparse.REMAINDER, help="DIR [--out results.csv] [--timeout S]")
    _add_oom_args(sub.add_parser("oom", help="read an out-of-memory message and say what it means"))
    _add_fsdp_args(sub.choices["measure"])
    _add_hf_flags(sub.choices)
    return parser


# --- memlab measure --fsdp: FSDP2 on real ranks (memlab.distributed.fsdp) ----------------
def _add_fsdp_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fsdp", action="store_true",
                   help="FSDP2 fully_shard (= ZeRO-3) on --world-size real ranks instead of DeepSpeed")
    p.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false",
                   help="with --fsdp: keep gathered parameters from forward to backward")
    p.add_argument("--cpu-offload", action="store_true", help="with --fsdp: FSDP2's CPUOffloadPolicy")


def _measure_fsdp(step: StepConfig, args: argparse.Namespace, budget: int | None) -> MemoryReport:
    """``memlab measure --fsdp``: refuse what FSDP2's measurement cannot honour, then run it."""
    from memlab.distributed.fsdp import measure_sharded
    if step.zero not in (0, 3):
        raise InputError(f"--fsdp shards like ZeRO-3; got --zero {step.zero}: drop it or use --zero 3")
    if step.offload != "none":
        raise InputError(f"--offload {step.offload} is DeepSpeed's; with --fsdp use --cpu-offload")
    if step.optimizer != "adamw":
        raise InputError(f"--optimizer {step.optimizer} with --fsdp; allowed: adamw")
    if args.snapshot is not None:
        raise InputError("--snapshot records one process; it is not available with --fsdp")
    if args.device not in ("cpu", "cuda"):
        raise InputError(f"unknown device {args.device!r}; allowed: cpu, cuda")
    return measure_sharded(step, step.world_size, reshard_after_forward=args.reshard_after_forward,
                           cpu_offload=args.cpu_offload, backend="gloo" if args.device == "cpu" else "nccl",
                           budget=budget)


# --- memlab oom: an out-of-memory message read (memlab.tracking.oom_messages) ------------------------------
def _add_oom_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", nargs="?", default="-",
                   help="a file holding the message, traceback or log; '-' or nothing: stdin")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def _oom(args: argparse.Namespace) -> OOMExplanation:
    """``memlab oom``: the message from a file or stdin, explained."""
    from memlab.tracking.oom_messages import explain_oom
    if args.file == "-":
        if sys.stdin.isatty():
            raise InputError("paste the message on stdin (end with Ctrl-D) or give a file: memlab oom FILE")
        text = sys.stdin.read()
    else:
        try:
            with open(args.file, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError as e:
            raise InputError(f"cannot read {args.file!r}: {e.strerror}") from None
    return explain_oom(text)


def _add_bound_args(p: argparse.ArgumentParser) -> None:
    """simulate's bound before a long simulation (memlab.hf.simulation_bound)."""
    p.add_argument(simulation_bound.ALLOW_FLAG, action="store_true",
                   help=f"--hf-config: simulate even past the bound ({simulation_bound.MAX_SECONDS:.0f} s "
                        f"predicted, or {simulation_bound.PARAM_LIMIT:.0e} parameters)")
    p.add_argument("--progress", action="store_true",
                   help="--hf-config: a progress bar on stderr (shown on a terminal for a long simulation)")


def _add_hf_flags(commands: dict) -> None:
    """Flags of the Hugging Face lenses (:mod:`memlab.hf.config`, :mod:`memlab.lenses.decoder_estimate`):
    ``measure --hf-config`` and the estimate's expert parallelism."""
    commands["measure"].add_argument("--hf-config", default=None, metavar="PATH",
                                     help="a Hugging Face config.json (or its folder, or a shipped "
                                          "name): its real step, random weights, under the guard")
    p = commands["estimate"]
    p.add_argument("--expert-parallel", type=_positive_int("expert-parallel"), default=1, metavar="E",
                   help="--hf-config MoE: divide the routed experts across E ranks (all-to-all buffers counted)")
    p.add_argument("--expert-imbalance", type=float, default=1.0, metavar="F",
                   help="--hf-config MoE with --expert-parallel: the busiest rank gets F x the balanced "
                        "share of tokens (default 1: balanced routing)")


def _hf_plain(args: argparse.Namespace) -> bool:
    """Whether the step is one AdamW step on one device (what memlab.hf.estimate counts)."""
    return (args.micro_batches, args.zero, args.world_size, args.offload, args.optimizer) == (1, 0, 1, "none", "adamw")


def _hf_measure(args: argparse.Namespace, budget: int | None) -> MemoryReport:
    """``measure --hf-config``: the HF model's real step (:func:`memlab.hf.measure.measure_hf`), or
    with ``--zero``/``--world-size`` real DeepSpeed on that many ranks
    (:func:`memlab.hf.deepspeed_measure.measure_zero_hf`)."""
    from memlab.hf.measure import measure_hf
    if args.model != "tiny" or any(v is not None for v in (args.d_model, args.layers, args.heads, args.vocab)):
        raise InputError("--hf-config describes the model: drop --model/--d-model/--layers/--heads/--vocab")
    deepspeed_run = args.zero > 0 or args.world_size > 1
    if deepspeed_run and args.optimizer == "adamw" and args.snapshot is None and not _configured(args) \
            and not args.optimizer_in_backward:
        from memlab.hf.deepspeed_measure import measure_zero_hf
        from memlab.hf.shape import decoder_shape
        step = StepConfig(decoder_shape(args.hf_config), seq=args.seq, batch=args.batch, precision=args.precision,
                          checkpointing=args.checkpointing, attention=args.attention,
                          micro_batches=args.micro_batches, zero=args.zero, world_size=args.world_size,
                          offload=args.offload)
        return measure_zero_hf(args.hf_config, [step], device=args.device, budget=budget)[0]
    if not _hf_plain(args) or args.snapshot is not None or _configured(args):
        raise InputError("measure --hf-config runs one AdamW step in this process, or with --zero/--world-size "
                         "DeepSpeed's AdamW on that many ranks; allowed: no --optimizer/--snapshot, no "
                         "--micro-batches/--offload without --zero or --world-size, no "
                         "--deepspeed/--training-args/LoRA or 4/8-bit flags (estimate and simulate take them)")
    return measure_hf(args.hf_config, seq=args.seq, batch=args.batch, precision=args.precision,
                         checkpointing=args.checkpointing, attention=args.attention, device=args.device,
                         budget=args.gpu if args.gpu is not None else budget,
                         optimizer_in_backward=args.optimizer_in_backward)


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
    p.add_argument("--host-memory", default=None, metavar="SIZE",
                   help="one machine's host memory: no offload beyond it (default: this machine's RAM "
                        "with --world-size 1, the card being in it; no bound for a cluster)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_advise_finetune_args(p)


def _add_advise_finetune_args(p: argparse.ArgumentParser) -> None:
    """advise's Hugging Face config and the fine-tuner's ladder."""
    p.add_argument("--hf-config", default=None, metavar="PATH",
                   help=HF_CONFIG_HELP)
    p.add_argument("--finetune", action="store_true",
                   help="also the fine-tuner's ladder: 8-bit AdamW, LoRA, QLoRA")
    p.add_argument("--lora-rank", type=_positive_int("lora-rank"), default=16,
                   help="LoRA rank of the ladder's LoRA and QLoRA rungs")
    p.add_argument("--lora-targets", default=None,
                   help="comma-separated module names (default: every attention and MLP projection)")


def _advise(args: argparse.Namespace) -> Advice:
    from memlab.planning.advisor import advise
    budget = _budget(args)
    if budget is None:
        raise InputError(f"give --gpu ({', '.join(GPU_PRESETS)}) or --budget SIZE")
    if args.hf_config is not None and args.model != "tiny":
        raise InputError("--hf-config describes the model: drop --model")
    # the card itself, not its byte count: the plan follows that card's rules (advisor.advise)
    gpu = args.gpu if args.gpu is not None else budget
    targets = tuple(args.lora_targets.split(",")) if args.lora_targets else None
    return advise(args.model, gpu, args.world_size, args.seq, args.batch,
                  attention=args.attention, headroom=args.headroom,
                  simulate=False if args.no_simulate else None, hf_config=args.hf_config,
                  finetune=args.finetune, lora_rank=args.lora_rank, lora_targets=targets,
                  host_memory=args.host_memory or ("here" if args.world_size == 1 else None))


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
                      optimizer=_step_optimizer(args), micro_batches=args.micro_batches, zero=args.zero,
                      world_size=args.world_size, offload=args.offload,
                      optimizer_in_backward=args.optimizer_in_backward,
                      activation_offload=args.activation_offload, compile=args.compile,
                      activation_memory_budget=args.activation_memory_budget)


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


def run(args: argparse.Namespace) -> Result:  # noqa: C901 one branch per subcommand's output
    """Compute what a subcommand asks for: a :class:`MemoryReport` (estimate, simulate,
    measure), an :class:`~memlab.planning.advisor.Advice` (advise) or a
    :class:`~memlab.classroom.technique_table.Table` (report)."""
    from memlab.policy import get_target
    if args.command == "advise":
        return _advise(args)
    if args.command == "oom":
        return _oom(args)
    if args.command == "report":
        if args.world_size < 2 and not args.no_distributed:
            raise InputError(f"world size {args.world_size} for the multi-rank rows; allowed: 2 or "
                             f"more (or --no-distributed)")
        from memlab.classroom.technique_table import write_report
        table, _ = write_report(args.out, StepConfig(model=args.model, seq=args.seq, batch=args.batch),
                                world_size=args.world_size, distributed=not args.no_distributed)
        return table
    # --hf-config: the config.json describes the model, so memlab's preset is not built (its
    # block size would bound --seq); the context is the HF model's own (memlab.hf.config.check_seq)
    step = step_from_args(args) if getattr(args, "hf_config", None) is None else None
    if step is not None and getattr(args, "loss", "transformers") != "transformers":
        raise InputError(f"--loss {args.loss} is a Hugging Face model's (give --hf-config); memlab's own "
                         f"GPT takes its loss from its config (GPTConfig.loss)")
    budget = _budget(args)
    if args.command in ("estimate", "simulate"):
        get_target(args.target)  # a bad --target is a usage error before any work
        # the card: --gpu names it (its kernels, cuBLAS workspace, memory as the budget), else
        # the GPU present, else the reference H200 (the same target Python's lenses take)
        from memlab.core.cards import detect_card
        card = None if args.gpu is not None or args.target != "cuda" else detect_card()
        target = get_target(args.target, args.gpu, card)
        budget = args.gpu if args.gpu is not None else budget
        if args.hf_config is not None:
            return _hf_checked(args, budget, target)
        if _configured(args):
            return _run_configured(args, budget, target)
        if args.hf_config is not None:
            return _hf_checked(args, budget, target)
    if args.command == "estimate":
        from memlab.lenses.estimate import estimate_step
        return estimate_step(step, budget=budget, target=target)
    if args.command == "simulate":
        from memlab.lenses.simulate import simulate_step
        _check_simulate(step)
        if step.world_size > 1:
            return _simulate_sharded(step, budget, target)
        return simulate_step(step, budget=budget, target=target)
    if args.fsdp:
        return _measure_fsdp(step, args, budget)
    if args.cpu_offload or not args.reshard_after_forward:
        raise InputError("--cpu-offload and --no-reshard-after-forward are FSDP2's: add --fsdp")
    if getattr(args, "hf_config", None) is not None:
        return _hf_measure(args, budget)
    if _configured(args):
        return _run_configured(args, budget, None)
    _check_measure(step, args)
    if _multi_rank(step):
        from memlab.distributed.deepspeed_zero import measure_distributed
        return measure_distributed(step, device=args.device, budget=budget)
    from memlab.lenses.measure import measure_step
    return measure_step(step, device=args.device, budget=budget, snapshot_path=args.snapshot)


def _hf_step(args: argparse.Namespace, budget: int | str | None, target) -> MemoryReport:
    """estimate or simulate of a Hugging Face config.json: one run (:func:`_hf_run`) through
    :func:`memlab.hf.estimate.estimate_hf` or :func:`memlab.hf.simulate.simulate_hf`."""
    if args.model != "tiny" or any(v is not None for v in (args.d_model, args.layers, args.heads, args.vocab)):
        raise InputError("--hf-config describes the model: drop --model/--d-model/--layers/--heads/--vocab")
    if getattr(args, "compile", False) or getattr(args, "activation_offload", False) \
            or getattr(args, "activation_memory_budget", None) is not None:
        raise InputError("--compile, --activation-memory-budget and --activation-offload are counted for memlab's "
                         "GPT (--model); allowed with --hf-config: none of them")
    if getattr(args, "training_args", None) is not None:
        from memlab.hf import post_training
        from memlab.hf import read_run_configs as run_config
        from memlab.hf.shape import decoder_shape
        trl_args = run_config.load_file(args.training_args, "--training-args")
        if post_training.trl_kind(trl_args) is not None:  # a TRL config: memlab.hf.post_training
            run = post_training.read_trl_args(trl_args, prompt_len=args.seq)
            lora, lora_notes = _hf_lora(args, decoder_shape(args.hf_config))
            quant = _quant_flags(args)
            if args.command == "estimate":
                report = post_training.estimate_trl_run(args.hf_config, run, lora=lora, card=budget, target=target,
                                                        quantization=quant)
            elif quant is not None:
                raise InputError(f"simulate of a {run.objective.kind.upper()} step over a {quant.name} base is "
                                 f"not built; allowed: memlab estimate, or drop --load-in-4bit/--load-in-8bit")
            else:
                from memlab.hf.trl_simulate import simulate_trl_run
                report = simulate_trl_run(args.hf_config, run, lora=lora, card=budget, target=target)
            report.notes.extend(lora_notes)
            return report
    run, notes = _hf_run(args)
    if args.command == "estimate":  # the simulation's modules (the tracker, transformers' glue) only for it
        from memlab.hf.estimate import estimate_hf as lens
    else:
        from memlab.hf.simulate import simulate_hf as lens
    report = lens(args.hf_config, budget=budget, target=target, **run)
    report.notes.extend(notes)
    return report


def _hf_run(args: argparse.Namespace) -> tuple[dict, list[str]]:
    """The run the flags, --training-args, --deepspeed and the LoRA/quantisation flags describe,
    as the keyword arguments both lenses of a Hugging Face config take, and the notes of where
    each came from."""
    from memlab.hf.shape import FAMILIES, decoder_shape
    notes: list[str] = []
    acc = None
    if getattr(args, "accelerate_config", None) is not None:
        args, acc = _with_accelerate(args)
        notes += list(acc.notes)
    if getattr(args, "training_args", None) is not None:
        args = _with_training_args(args)
        notes += args.run_notes
    kw = dict(seq=args.seq, batch=args.batch, precision=args.precision, checkpointing=args.checkpointing,
              attention=args.attention, optimizer_in_backward=getattr(args, "optimizer_in_backward", False))
    run = dict(micro_batches=args.micro_batches, zero=args.zero, world_size=args.world_size, offload=args.offload)
    model_type = hf.load_config(args.hf_config)["model_type"]
    needs_shape = any(getattr(args, f, None) for f in ("deepspeed", "lora_rank", "lora_targets", "lora_config",
                                                       "load_in_4bit", "load_in_8bit"))
    shape = decoder_shape(args.hf_config) if model_type in FAMILIES or needs_shape else None
    buckets = None
    if args.deepspeed is not None:
        if args.zero != 0 or args.offload != "none":
            raise InputError("--deepspeed gives the ZeRO stage and the offload: drop --zero/--offload")
        from memlab.hf import read_run_configs as run_config
        ds = run_config.read_deepspeed(args.deepspeed, world_size=args.world_size, hidden_size=shape.d,
                                       batch=kw["batch"], micro_batches=args.micro_batches,
                                       precision=kw["precision"], trainer_args=getattr(args, "trainer_args", None),
                                       mixed_precision=None if acc is None else acc.mixed_precision)
        fields = ds.step_fields()
        kw = dict(kw, batch=fields.pop("batch"), precision=fields.pop("precision"))
        run.update(fields)
        buckets = ds.buckets
        notes = [f"--deepspeed: ZeRO-{ds.zero}, offload {ds.offload}, {ds.precision}, micro-batch "
                 f"{ds.micro_batch} x {ds.accumulation} accumulation x {ds.world_size} rank(s) "
                 f"= train_batch_size {ds.train_batch}", *notes, *ds.notes]
    lora, lora_notes = _hf_lora(args, shape) if shape is not None else (None, [])
    quant = _quant_flags(args)
    lora, quant = _file_fine_tune(args, lora, quant)
    optimizer = low_bit.HF_OPTIMIZERS.get(args.optimizer, args.optimizer)
    run.update(expert_parallel=getattr(args, "expert_parallel", 1), imbalance=getattr(args, "expert_imbalance", 1.0),
               optimizer=optimizer, lora=lora, quantization=quant, buckets=buckets, loss=args.loss,
               loss_chunk=args.loss_chunk)
    return {**kw, **run}, notes + lora_notes


def _quant_flags(args: argparse.Namespace):
    """The :class:`memlab.step.fine_tune_config.QuantConfig` of --load-in-4bit/--load-in-8bit, or None."""
    from memlab.step.fine_tune_config import QuantConfig
    if args.load_in_4bit and args.load_in_8bit:
        raise InputError("give --load-in-4bit or --load-in-8bit, not both")
    return QuantConfig(bits=4) if args.load_in_4bit else QuantConfig(bits=8) if args.load_in_8bit else None


def _hf_lora(args: argparse.Namespace, shape) -> tuple[LoraConfig | None, list[str]]:
    """The LoRA of --lora-config or --lora-rank/--lora-targets/--lora-dropout on a Hugging Face
    decoder (every ``Linear`` of its layers by default, as peft's ``all-linear``)."""
    from memlab.step.fine_tune_config import LoraConfig
    names = shape.linear_names()
    if args.lora_config is not None:
        from memlab.hf import read_run_configs as run_config
        if args.lora_rank is not None or args.lora_targets is not None:
            raise InputError("give --lora-config or --lora-rank/--lora-targets, not both")
        spec = run_config.read_lora_config(args.lora_config, names)
        return spec.lora_config(), list(spec.notes)
    if args.lora_rank is None and args.lora_targets is None:
        if args.load_in_4bit or args.load_in_8bit:
            raise InputError("a 4-/8-bit base is frozen: give LoRA adapters to train (--lora-rank or --lora-config)")
        return None, []
    return LoraConfig(rank=args.lora_rank or 8, targets=args.lora_targets or "all-linear",
                      dropout=args.lora_dropout), []


def _hf_checked(args: argparse.Namespace, budget: int | str | None, target) -> MemoryReport:
    """:func:`_hf_step` after the config is checked (memlab.hf.config_check) and, for simulate,
    the bound (memlab.hf.simulation_bound); the report notes the fields left to transformers'
    defaults, and a peak more than any card holds."""
    from memlab.hf.config_check import check_config
    simulate = args.command == "simulate"
    checked = check_config(hf.load_config(args.hf_config, checked=False), construct=True if simulate else None)
    bar = None
    if simulate:
        bound = simulation_bound.simulation_bound(args.hf_config, seq=args.seq, batch=args.batch,
                                                  precision=args.precision, checkpointing=args.checkpointing,
                                                  attention=args.attention, target=target)
        simulation_bound.check_bound(bound, allow_long=args.allow_long)
        bar = simulation_bound.progress(bound.layers, simulation_bound.wants_progress(bound, args.progress))
    with bar or contextlib.nullcontext():
        report = _hf_step(args, budget, target)
    if checked.note:
        report.notes.append(checked.note)
    beyond = simulation_bound.beyond_cards(report.peak_bytes)
    if beyond:
        report.notes.append(f"peak {fmt_bytes(report.peak_bytes)}{beyond}")
    return report


def _simulate_sharded(step: StepConfig, budget: int | str | None, target) -> MemoryReport:
    """The FSDP2 simulation under a target's kernels; for CUDA each rank also holds the
    cuBLAS workspaces (its own process). Block rounding and per-call workspaces are not
    applied by the sharded tracker."""
    from memlab.distributed.fsdp import simulate_sharded
    from memlab.policy import emulate, resolve_target
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
            from memlab.app import doctor
            return doctor.main(["--no-build"] * args.no_build + ["--json"] * args.json
                               + ["--calibrate"] * args.calibrate)
        if args.command == "class":
            from memlab.classroom import collect as classroom
            return classroom.main(args.rest)
        result = run(args)
    except InputError as e:
        # the guard's refusal can only come from a command that imported the guard, so a
        # command that does not need it (estimate, --help) never pays for its imports
        guard = sys.modules.get("memlab.lenses.guard")
        if guard is not None and isinstance(e, guard.HostMemoryError):
            step = None
            with contextlib.suppress(InputError, AttributeError):
                step = step_from_args(args)
            e = e.with_way_out(way_out(argv, step))
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
