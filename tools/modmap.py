"""The module map: memlab's layers, what each module owns, and what it imports (read from the code).

``LAYERS`` is the one place the layer order is written down, lowest first. A module may import
modules of its own layer and of the layers below, never above; ``tests/test_architecture.py``
holds the code to it (no upward import, no cycle, no module missing from the map) and checks
that the map in ``docs/modules.md`` (between its markers) is what this script writes.

    python tools/modmap.py           # rewrite the map in docs/modules.md from LAYERS and the code
    python tools/modmap.py --check   # exit 1 when docs/modules.md's map is out of date

A new module: add a line to its layer in ``LAYERS`` (what it owns, in a few words), then run
``python tools/modmap.py``.
"""
from __future__ import annotations

import argparse
import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "memlab"
#: the page the map lives in, between START and END (the front page links to it)
MAP_PAGE = ROOT / "docs" / "modules.md"
START, END = "<!-- modmap:start -->", "<!-- modmap:end -->"

#: (layer, {module: what it owns}), lowest layer first. Module names are dotted paths inside
#: memlab ("distributed.fsdp"); a package's ``__init__`` is the package's name ("distributed"),
#: memlab's own ``__init__`` is "__init__" (the front door).
LAYERS: list[tuple[str, dict[str, str]]] = [
    ('core', {
        'core': "errors, sizes, precisions, cards and devices, quiet output, torch's private APIs",
        'core.errors': "`InputError`: bad user input (exit 2 in the CLI); imports nothing from memlab",
        'core.units': "bytes and their units: `KiB`..`TiB`, the one size parser `parse_size`, `fmt_bytes`",
        'core.precision': "precisions and their element sizes: the one table every formula reads",
        'core.cards': "card profiles (memory, capability, native bf16, attention kernels, cuBLAS workspace), `detect_card`",
        'core.hardware': "GPU presets and budgets, picking a device, placing ranks on devices (`place_ranks`)",
        'core.quiet': "quiet outputs: progress bars only where someone watches (`progress_wanted`), op builds in one line (`quiet_build`), one-line results (`OneLine`)",
        'core.torch_private': "PyTorch's private APIs (fake tensors, dispatch keys, the fake process group, ...) behind one module, each with the torch versions it was checked on",
    }),
    ('tracking', {
        'tracking': "the memory tracker, allocator snapshots, OOM messages read into numbers",
        'tracking.tracker': "`MemoryTracker`: live bytes by category, device and host, the simulated budget and its OOM",
        'tracking.snapshot': "CUDA allocator snapshots: loading them (plain containers only), their live and reserved bytes over time",
        'tracking.oom_messages': "OOM messages of every torch era, the host allocator, DeepSpeed and NCCL read into numbers and explained; fragmentation provoked",
    }),
    ('policy', {
        'policy': "a target device's rules (autocast op lists, kernels, workspaces, allocator blocks) applied to a CPU step",
        'policy.autocast': "autocast op lists per device",
        'policy.elements': "element sizes under a target",
        'policy.kernels': "attention and norm kernels per card",
        'policy.caching_allocator': "the CUDA caching allocator's block rules, a step's allocations replayed through them",
        'policy.workspaces': "cuBLAS / cuDNN / attention workspaces",
        'policy.target': "the target device a lens predicts for",
        'policy.emulation': "the simulation's dispatcher emulation of a target",
    }),
    ('models', {
        'models': "memlab's own GPT and UNet, a decoder's shape (the one the lenses read), the chunked loss head, the UNet's activations",
        'models.gpt_unet': "GPT (MHA/GQA) and UNet, their configs and presets with published shapes",
        'models.chunked_loss': "the language-model head and cross-entropy over chunks of tokens (the loss spike's fix)",
        'models.diffusion': "the UNet's activations by part and resolution",
        'models.litgpt_model': "litgpt's Llama with LoRA and its finetune/lora.py iteration (commits 8641822, 6178c7cc), memlab's copy for the simulation",
        'models.decoder_shape': "`DecoderShape`: the one description of a decoder's shape the lenses read (widths, heads, norms, MLA, experts), its parameter counts and tensors",
    }),
    ('step', {
        'step': "a training step and its run description (LoRA, quantisation, the optimizer step in backward, activation offload), its report, the model states per rank (ZeRO, low-bit, a decoder's), its DeepSpeed config",
        'step.training_step': "`StepConfig` (a step; its model config owns checkpointing and attention), `MemoryReport`, `Trainer`, `build_trainer`, `make_batch`",
        'step.states': "model states per rank and where they live: plain PyTorch or DeepSpeed's layout per ZeRO stage and offload",
        'step.low_bit': "byte layouts of bitsandbytes' 8-bit and paged optimizer state, its 4-/8-bit weights (QLoRA's NF4), Adafactor's factored state; the 8-bit AdamW every lens runs",
        'step.parallel_dims': "`ParallelDims`: a run's tensor, pipeline and expert degrees in one object",
        'step.fine_tune_config': "what a fine-tune adds to a run, typed: `LoraConfig` (rank, targets, dropout, adapter dtype) and `QuantConfig` (4/8 bits, double quantisation, compute dtype)",
        'step.decoder_states': "an HF run's model states per rank: full or LoRA, a frozen base in 16 bits or bitsandbytes' 4-/8-bit layout, low-bit optimizer state, ZeRO",
        'step.optimizer_in_backward': "the optimizer step fused into backward: per-parameter optimizers stepped from post-accumulate-grad hooks",
        'step.activation_offload': "activation offloading (`save_on_cpu`): the step's hooks, and what each lens counts of it",
        'step.compiled': "torch.compile as a run field: the budget's check, the compiled forward's saved set counted from inductor's backward graph",
        'step.zero': "the ZeRO paper's per-rank formula: `zero_formula` (2 + 2 + K bytes divided by stage), `zero_saving`",
        'step.write_deepspeed_config': "the DeepSpeed config a step describes (`deepspeed_config`), with memlab's bucket sizes",
        'step.zero3_gathers': "ZeRO-3's gathered parameters op by op: DeepSpeed's stage-3 coordinator replayed (`replay_gathers`, `gathered_by_op`)",
    }),
    ('time', {
        'time': "a step's FLOPs, elementwise bytes, communication and its time on a card",
        'time.flops': "FLOPs of a step by part (forward, backward, recompute): counted by phase, and in closed form",
        'time.elementwise': "bytes a step's elementwise ops (norms, activations, casts, the loss) read and write: counted op by op, and in closed form",
        'time.communication': "bytes a rank moves per step by kind: DP, ZeRO 1/2/3, TP, pipeline sends, offload over PCIe",
        'time.step_time': "the time lens: compute, recompute, elementwise, communication, engine passes, offload, bubble on a card; `StepTime`",
    }),
    ('lenses', {
        'lenses': "estimate, simulate, measure, the guard, the H200 reference, any model, parallel formulas",
        'lenses.estimate': "the estimate lens: closed-form bytes, activations and the peak moment",
        'lenses.decoder_estimate': "a decoder's run in closed form, op by op as transformers' classes save it: dense, MLA, mixtures of experts; LoRA, QLoRA, low-bit state, ZeRO, tensor parallelism",
        'lenses.litgpt_estimate': "litgpt's own LoRA step (its model and finetune/lora.py at two commits, under Fabric bf16-true) in closed form: the code litgpt's published resource tables ran",
        'lenses.simulate': "the simulate lens: the same step on fake tensors",
        'lenses.measure': "the measure lens: a real step, warmed up and tracked; OOMs caught and released; step timing",
        'lenses.guard': "the refusal rule (`HostMemoryError`): estimate vs host RAM / free GPU memory, before anything is built",
        'lenses.reference': "the H200 reference rows (`data/reference/`) as steps and figures",
        'lenses.your_model': "any model: `track_step`, `tracking()`, `simulate_model`",
        'lenses.calculator': "the real-scale calculator: `estimate_step` per rank for a card",
        'lenses.parallel_formulas': "tensor- and pipeline-parallel formulas: bytes per rank, bubbles, schedules",
    }),
    ('techniques', {
        'techniques': "sweeps, mixed precision, accumulation, batch search, compression, batching, LoRA, leaks",
        'techniques.sweeps': "sweeps over a step's field, a category's peak, activations by module, FLOPs",
        'techniques.mixed_precision': "fp16 underflow and loss scaling; where mixed precision keeps 16 bytes per parameter",
        'techniques.accumulation': "gradient accumulation checked against one large batch",
        'techniques.max_batch': "the largest batch under a budget: searched and predicted",
        'techniques.compression': "activation compression with saved-tensor hooks (bf16, int8) and its gradient error",
        'techniques.fused_kernels': "Liger-Kernel's fused kernels and torchao's FP8 training: what each saves for backward, counted from their source",
        'techniques.batching': "token-budget batching of variable-length text: fixed, bucketed, packed",
        'techniques.finetune': "LoRA counted from rank and targets on memlab's GPT; its 8-bit, paged, Adafactor and 4-/8-bit estimates",
        'techniques.leaks': "growth per optimizer step: what a leaking loop keeps, by category",
    }),
    ('distributed', {
        'distributed': "the multi-rank package: ranks, data parallel, ZeRO with DeepSpeed, offload, FSDP2, tensor and pipeline parallelism",
        'distributed.__main__': "`python -m memlab.distributed tp` or `pp` for torchrun",
        'distributed.ranks': "`run_ranks` (N processes, one group, failures named by rank) and `fake_process_group` (rank 0 of N alone)",
        'distributed.launch_env': "where this process stands in a launched job (torchrun, deepspeed, MPI, Slurm variables: `launcher_env`)",
        'distributed.data_parallel': "collectives and one DDP step measured on ranks",
        'distributed.deepspeed_zero': "ZeRO with real DeepSpeed: its config, its per-rank accounting, ranks that measure it",
        'distributed.deepspeed_rank0': "DeepSpeed as rank 0 of N: fake ranks, batch keys, two engine steps",
        'distributed.offload': "ZeRO-Offload measured on ranks: device peak, host bytes, RSS growth",
        'distributed.fsdp': "FSDP2 (= ZeRO-3) on a fake process group and fake tensors: `simulate_sharded`",
        'distributed.parallel_common': "what the tensor- and pipeline-parallel workers share: results, rank threads, one step",
        'distributed.tensor_parallel': "tensor parallelism: the Megatron split, its workers and simulation",
        'distributed.pipeline_parallel': "pipeline parallelism: stages, GPipe and 1F1B, their workers",
        'distributed.comm_count': "collective bytes counted on real ranks (DDP, DeepSpeed ZeRO, TP), to check the formula; DeepSpeed's per-step ops counted",
        'distributed.zero_worker': "the ZeRO rank as a script for torchrun/deepspeed",
    }),
    ('hf', {
        'hf': "Hugging Face configs checked, read, shaped, estimated, measured; run configs read; callbacks",
        'hf.config': "Hugging Face `config.json`: mapped to a `GPTConfig`, or the real class on fake tensors",
        'hf.config_check': "an HF config.json checked field by field before any build; transformers' defaults said",
        'hf.shape': "an HF decoder config read into what memory depends on; its parameter counts",
        'hf.estimate': "an HF decoder config's estimate: the config read into its shape and a run, counted by `lenses.decoder_estimate`",
        'hf.measure': "the measure lens of an HF config: its real step under the guard",
        'hf.deepspeed_measure': "the measure lens of an HF config's ZeRO run: real DeepSpeed on its ranks",
        'hf.simulate': "the simulate lens of a whole HF run: accumulation, every optimizer, QLoRA, ZeRO, on fake tensors",
        'hf.litgpt_simulate': "litgpt's LoRA/QLoRA run on fake tensors: memlab's litgpt model, Lightning's 4-bit layer with bitsandbytes 0.41.1's matmul",
        'hf.post_training': "a DPO or GRPO step (TRL 1.16) in closed form: the reference, the fused log-probabilities, generation's KV cache, the vLLM share",
        'hf.evaluation': "`Trainer.evaluate`'s accumulated logits: the estimate and the real loop on CPU",
        'hf.trl_measure': "the measure lens of a DPO or GRPO step: TRL's real trainer for one step, tracked on CPU",
        'hf.trl_simulate': "the simulation lens of a DPO or GRPO step: TRL's own loss code and transformers' generate on fake tensors",
        'hf.read_run_configs': "a run as its configs write it: a DeepSpeed JSON (auto values, DeepSpeed's reading, buckets), peft's adapter_config.json",
        'hf.callbacks': "the learner's own run: a transformers `TrainerCallback` and `memory_watch` for a plain loop (first steps by category, CUDA history, OOMs explained)",
        'hf.simulation_bound': "the bound before a long HF simulation (seconds, parameters, 64-bit bytes), its progress bar",
    }),
    ('planning', {
        'planning': "the advisor, the fastest plan that fits, the OOM ladder",
        'planning.advisor': "the curriculum's flowchart as a plan (in DeepSpeed's accounting) and its DeepSpeed config",
        'planning.plan_search': "the fastest plan that fits: every candidate estimated and timed on a card",
        'planning.oom_ladder': "OOM now: an HF fine-tune's ladder of fixes (accumulation .. offload), each rung estimated and timed on a card",
    }),
    ('classroom', {
        'classroom': "lessons, predictions, exercises, the technique table, plots, widgets, collection",
        'classroom.lesson': "`lesson.setup`: device, the card's precision and each lesson's sizes",
        'classroom.collect': "`memlab class collect`: submitted notebooks run headless, checker results",
        'classroom.predictions': "the learner's written guesses scored against the measurement",
        'classroom.watchdog': "notebook kernels that sit idle with no reply: one line and one retry (`StallWatch`), each notebook's bound on 2 cores",
        'classroom.technique_table': "the curriculum's comparison table, measured, as Markdown, JSON and PNG",
        'classroom.plots': "every matplotlib figure",
        'classroom.widgets': "every ipywidgets panel (the only module importing ipywidgets)",
        'classroom.exercises': "checkers for the learners' own code in the lessons' \"Your turn\" cells",
        'classroom.exercises.accumulation': "the accumulation exercise's checker",
        'classroom.exercises.amp': "the amp exercise's checker",
        'classroom.exercises.checkpoint': "the checkpoint exercise's checker",
        'classroom.exercises.common': "what every checker shares",
        'classroom.exercises.compression': "the compression exercise's checker",
        'classroom.exercises.data_parallel': "the data parallel exercise's checker",
        'classroom.exercises.diffusion': "the diffusion exercise's checker",
        'classroom.exercises.evaluation': "the evaluation-store exercise's checker",
        'classroom.exercises.experts': "the expert-parallel model states exercise's checker",
        'classroom.exercises.gqa': "the gqa exercise's checker",
        'classroom.exercises.leaks': "the leak exercise's checker",
        'classroom.exercises.logits': "the logits exercise's checker",
        'classroom.exercises.oom': "the oom exercise's checker",
        'classroom.exercises.pipeline': "the pipeline exercise's checker",
        'classroom.exercises.planning': "the planning exercise's checker",
        'classroom.exercises.start': "the start exercise's checker",
        'classroom.exercises.table': "the table exercise's checker",
        'classroom.exercises.tensor_parallel': "the tensor parallel exercise's checker",
        'classroom.exercises.zero': "the zero exercise's checker",
    }),
    ('app', {
        'app': "the memlab command, doctor, the GPU check; and memlab's front door",
        'app.cli': "the `memlab` command: flags, exit codes",
        'app.doctor': "`memlab doctor`: this machine's facts and the verdict",
        'app.gpu_check': "`make gpu-check`: reference figures on a CUDA machine",
        '__init__': "the front door: `memlab.__all__`, what a learner calls",
    }),
]

#: Imports the map tolerates for now, each with why; the architecture test fails once one of
#: them is gone from the code (delete it here then).
ALLOWED: dict[tuple[str, str], str] = {}


def module_name(path: pathlib.Path) -> str:
    """``memlab/distributed/fsdp.py`` -> ``distributed.fsdp``; ``memlab/__init__.py`` -> ``__init__``."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def module_path(name: str) -> pathlib.Path:
    """The file of a module name (the inverse of :func:`module_name`)."""
    base = PACKAGE.joinpath(*name.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def modules() -> list[str]:
    """Every module of the package, by name."""
    return sorted(module_name(p) for p in PACKAGE.rglob("*.py"))


def imports(name: str, known: set[str] | None = None) -> set[str]:
    """The memlab modules ``name`` imports, anywhere in it (top, function, ``TYPE_CHECKING``).

    ``from .distributed.fsdp import x`` runs ``distributed/__init__`` first, so it counts as an
    import of both (from outside the package: ``distributed``'s own modules are loaded by it).
    memlab's own ``__init__`` (the front door) runs before any module and imports them; it is
    not counted as their import.
    """
    known = set(modules()) if known is None else known
    path = module_path(name)
    package = name.split(".") if path.name == "__init__.py" and name != "__init__" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[list[str]] = []
        if isinstance(node, ast.Import):
            targets += [a.name.split(".")[1:] for a in node.names if a.name.split(".")[0] == "memlab"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                mod = package[:len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            elif (node.module or "").split(".")[0] == "memlab":
                mod = node.module.split(".")[1:]
            else:
                continue
            # `from .pkg import sub` imports the submodule; `from .mod import name` the module
            targets += [mod + [a.name] for a in node.names if ".".join(mod + [a.name]) in known]
            targets.append(mod)
        for parts in targets:
            for i in range(1, len(parts) + 1):  # the module and every package above it
                if ".".join(parts[:i]) in known:
                    found.add(".".join(parts[:i]))
    # a module's own packages are loaded before it: not imports of it
    own = {".".join(package[:i]) for i in range(1, len(package) + 1)}
    return found - own - {name, "__init__"}


def graph() -> dict[str, set[str]]:
    """Module -> the memlab modules it imports."""
    known = set(modules())
    return {m: imports(m, known) for m in sorted(known)}


def layer_of() -> dict[str, int]:
    """Module -> the index of its layer in :data:`LAYERS`."""
    out: dict[str, int] = {}
    for i, (_, owned) in enumerate(LAYERS):
        for m in owned:
            out[m] = i
    return out


def _display(name: str) -> str:
    return module_path(name).relative_to(PACKAGE).as_posix()


def render() -> str:
    """The module map of docs/modules.md: one row per module, layers lowest first."""
    deps = graph()
    lines = [START,
             "<!-- generated by `python tools/modmap.py` from its LAYERS table and the code: edit those, not this -->",
             "| layer | module | owns | imports (memlab modules, anywhere in the file) |",
             "| --- | --- | --- | --- |"]
    for i, (layer, owned) in enumerate(LAYERS):
        for j, (m, owns) in enumerate(owned.items()):
            uses = ", ".join(f"`{d}`" for d in sorted(deps.get(m, ()))) or "none"
            lines.append(f"| {f'{i} {layer}' if j == 0 else ''} | `{_display(m)}` | {owns} | {uses} |")
    lines.append(END)
    return "\n".join(lines)


def map_block(text: str) -> str | None:
    """The map as it stands in the page's text, or None when the markers are missing."""
    if START not in text or END not in text:
        return None
    return text[text.index(START):text.index(END) + len(END)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/modules.md's map is out of date")
    args = ap.parse_args(argv)
    text = MAP_PAGE.read_text()
    old, new = map_block(text), render()
    if old is None:
        print(f"docs/modules.md has no {START} ... {END} block", file=sys.stderr)
        return 1
    if args.check:
        if old != new:
            print("docs/modules.md's module map is out of date: run python tools/modmap.py", file=sys.stderr)
            return 1
        return 0
    if old != new:
        MAP_PAGE.write_text(text.replace(old, new))
        print("docs/modules.md: module map rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
