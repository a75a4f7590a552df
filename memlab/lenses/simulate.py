"""Simulate: the measured step, run on fake tensors, for hardware you do not have.

Under ``FakeTensorMode`` every op computes shapes, dtypes and strides but allocates nothing,
so a gpt2-xl or llama-7b step "runs" on a laptop in seconds while
:class:`~memlab.tracking.tracker.MemoryTracker` counts the bytes it would hold, exactly as it counts
a real step (the two agree to the byte on the tiny model).

The step always runs on the *fake CPU* device: on a CPU-only torch build, fake CUDA tensors
cannot be initialised, and the first autograd op on one aborts the process. The device the
bytes are counted for is the ``target``:

* ``"cpu"`` (the function's default): CPU autocast and CPU kernels, exact bytes, equal to
  :func:`~memlab.lenses.measure.measure_step` on this machine.
* ``"cuda"`` (the CLI's default): :func:`memlab.policy.emulate` puts CUDA's autocast op lists
  on the ``AutocastCPU`` dispatch key and CUDA's fused ``rms_norm`` on ``AutogradCPU`` for the
  duration of the step, so autograd saves what it saves on a GPU; the tracker's
  :class:`~memlab.policy.TargetAccounting` adds what no op returns (cuBLAS workspaces, cuDNN
  convolution and FlashAttention backward workspaces, in the category ``workspace``),
  CUDA's attention log-sum-exp and LayerNorm statistics, and rounds every storage to the
  caching allocator's 512-byte blocks; the step's allocations are then replayed through the
  allocator's block rules (:mod:`memlab.policy.caching_allocator`: a block too little larger than the
  request is handed out whole), and what that adds goes to ``workspace``. Which cached block
  a request finds depends on what the process ran before (``allocator=``). How close this
  lands to ``torch.cuda.max_memory_allocated()`` on the H200 reference steps, in the
  recording process and in a fresh one: ``docs/accuracy.md`` (``data/reference/``,
  ``benchmarks/gpu_reference.py``).

A GPU's capacity is applied as a budget, as on CPU.

A step under DeepSpeed (ZeRO or offload) is simulated as DeepSpeed runs it as far as one
process can: the model cast to its 16-bit (or fp32) dtype, no autocast; the model states of
every moment are then put in DeepSpeed's layout (:func:`memlab.step.states.model_states`: sharded
per rank, offloaded ones in ``host_bytes``). Those model-state bytes are the formula's, not
the simulation's, and the report's ``notes`` say so (:data:`FORMULA_NOTE`): only the
activations, temporaries and workspaces of such a report are simulated.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import replace

import torch

from memlab.core.cards import SPEEDS, Card, card_speeds
from memlab.core.hardware import resolve_budget
from memlab.core.torch_private import FakeTensorMode
from memlab.core.units import fmt_bytes
from memlab.lenses.measure import run_tracked_step
from memlab.models.gpt_unet import GPTConfig, UNetConfig
from memlab.policy import emulate, resolve_target
from memlab.policy.caching_allocator import CachingAllocator, replay_steady_step
from memlab.step.compiled import lowering_notes
from memlab.step.low_bit import PAGED, paged_note
from memlab.step.states import ModelStates, ZeroBuckets, model_states
from memlab.step.training_step import MemoryReport, StepConfig, batch_to, build_trainer, resolve_step
from memlab.step.zero3_gathers import ACCUMULATE_GRAD, gathered_by_op, module_params
from memlab.time.elementwise import ElementwiseCounter
from memlab.time.flops import PhaseFlopCounter
from memlab.time.step_time import report_time
from memlab.tracking.tracker import CATEGORIES, Event


def _fake_batch(step: StepConfig) -> tuple:
    cfg = step.model_config
    if isinstance(cfg, UNetConfig):
        x = torch.randn(step.batch, cfg.channels, step.seq, step.seq)
        return x, torch.randint(0, 1000, (step.batch,)), torch.randn_like(x)
    idx = torch.randint(0, cfg.vocab_size, (step.batch, step.seq))
    return idx, torch.randint(0, cfg.vocab_size, (step.batch, step.seq))


#: what the simulation says of a compiled step (memlab.step.compiled.PartitionedModel)
SIMULATED_COMPILE_NOTE = ("compiled: forward saves what inductor's partitioner chooses, and each graph runs as "
                          "the code inductor generates for this CPU orders it (its fusion, reordering and buffer "
                          "reuse; kernels left out, traced on fake tensors): within 0.1% of the measured peak on "
                          "the CPU test steps at budgets 1.0 and 0.5 (memlab.step.compiled)")


def simulate_step(step: StepConfig | None = None, *, budget: int | str | None = None,
                  target: str | None = None, card: "Card | str | None" = None,
                  allocator: CachingAllocator | None = None, **overrides) -> MemoryReport:
    """Run one steady-state step on fake tensors and report its peak by category.

    ``budget`` is bytes, a size string, or a GPU preset (``"A100-40GB"``): the report says
    whether the step fits and, if not, where it ran out (``report.oom``). ``target`` is the
    device the bytes are counted for: ``"cpu"`` (exactly what :func:`measure_step` sees on
    this CPU) or ``"cuda"`` (CUDA's autocast policy, kernels, workspaces and 512-byte
    blocks, see :mod:`memlab.policy`). Left out, it follows the card asked for (``card``, or
    a GPU preset budget), else the GPU this process sees, else the CPU
    (:func:`memlab.policy.resolve_target`): on a CPU machine the simulation still equals
    the measurement to the byte.

    ``allocator`` (CUDA target): the caching allocator of the process the step runs in,
    with what its earlier steps left cached (:class:`memlab.policy.caching_allocator.CachingAllocator`;
    pass the same one to each step a process runs, in order). Left out, the step runs in a
    fresh process. A warm cache can hand out larger blocks, so a row recorded after others
    lands closer replayed in its recording process than alone (``docs/accuracy.md``).

    Args:
        step: the step (``None``: ``StepConfig()``); ``overrides`` replace its fields.
        budget, target, card, allocator: as above.

    Returns:
        A :class:`MemoryReport` (lens ``"simulate"``); ``oom`` says where a step over budget ran out.

    Raises:
        InputError: a field, preset, budget or target that is not allowed.
    """
    tgt = resolve_target(target, budget, card)
    step = resolve_step(step, lens="simulate", **overrides)
    budget_bytes = resolve_budget(budget)
    start = time.perf_counter()
    ms = model_states(step.model_config, precision=step.precision, optimizer=step.optimizer,
                      zero=step.zero, world_size=step.world_size, offload=step.offload)
    # DeepSpeed runs the model cast to one dtype, unsharded here; its states are put right below
    run = replace(step, precision=ms.compute_precision, zero=0, offload="none",
                  world_size=1) if ms.deepspeed else step
    # One mode for building and running: mixing fake modes is not supported.
    with FakeTensorMode(allow_non_fake_inputs=False), emulate(tgt):
        trainer = build_trainer(run, "cpu", fake=True)
        trainer.offload_to_host = tgt.is_cuda  # activation_offload: saved tensors leave a GPU
        batch = batch_to(_fake_batch(run), run)
        # the step's FLOPs, op by op (memlab.time.flops), and its elementwise bytes where memlab has no
        # closed form (memlab.time.elementwise; a GPT's follows the target's kernels: a CPU step runs
        # rms_norm's composite)
        gpt = isinstance(step.model_config, GPTConfig)
        if step.compile:  # AOT autograd traces and partitions at the first call: untracked, uncounted
            trainer.step(batch)
        with PhaseFlopCounter() as flops, contextlib.nullcontext() if gpt else ElementwiseCounter() as elementwise:
            tracker, _, before, after = run_tracked_step(
                trainer, batch, None if ms.deepspeed else budget_bytes, warmup="optimizer",
                accounting=tgt.accounting())
        report = MemoryReport("simulate", step, f"{tgt.name} (fake)", tracker.peak_bytes,
                              tracker.peak_by_category(), budget_bytes, None, tracker.oom,
                              tracker.timeline, {}, before, after,
                              host_bytes=tracker.host_peak_bytes,
                              host_by_category=tracker.host_peak_by_category())
        paged = ms.host.get("optimizer", 0.0) if step.optimizer in PAGED else 0.0
        if step.optimizer in PAGED:  # before the allocator's replay: unified memory is not the caching allocator's
            page_out(report, step.optimizer, paged)
        if tgt.is_cuda and not ms.deepspeed and tracker.oom is None:
            _add_unsplit_blocks(report, tracker, allocator, paged)
        gathered = _zero3_gathered(report, trainer.model, step, ms) if step.zero == 3 else None
        del trainer, batch, tracker
    if ms.deepspeed:
        deepspeed_layout(report, ms, model_states(run.model_config, precision=run.precision,
                                                   optimizer=run.optimizer).gradients, gathered)
    report.time = report_time(step, tgt.card, flops=flops.flops(), elementwise=None if gpt else elementwise.work())
    if step.activation_offload:
        report.notes.append(_offload_note(report, tgt))
    if step.compile:
        report.notes.append(SIMULATED_COMPILE_NOTE)
        report.notes.extend(lowering_notes(tgt.is_cuda))
    report.step_seconds = time.perf_counter() - start
    report.notes.append("step_seconds is the wall time of the whole simulation")
    return report


def _zero3_gathered(report: MemoryReport, model: torch.nn.Module, step: StepConfig, ms: ModelStates) -> list[float]:
    """What DeepSpeed's stage-3 coordinator holds gathered at each op of ``report``'s timeline
    (:func:`memlab.step.zero3_gathers.gathered_by_op`, with the run's buffer sizes)."""
    b = step.buckets or ZeroBuckets()
    return gathered_by_op(report.timeline, *module_params(model), world_size=step.world_size,
                          element_bytes=4 if ms.compute_precision == "fp32" else 2,
                          prefetch=b.prefetch, max_live=b.max_live, reuse_distance=b.max_live,
                          persistence=b.persistence)


def _offload_note(report: MemoryReport, tgt) -> str:
    """What activation offloading moved, and its PCIe seconds on the card (not overlapped)."""
    if not tgt.is_cuda:
        return ("activation_offload on a CPU target: save_on_cpu packs with tensor.cpu(), the tensor "
                "itself, so nothing moves and the peak is the plain step's")
    moved = report.host_by_category.get("activations", 0)
    note = (f"activation_offload: {fmt_bytes(moved)} of saved tensors in host memory at the host's peak "
            f"(one copy per saved tensor, weights and views included), copied down in forward and up in backward")
    sp = card_speeds(tgt.card) if tgt.card is not None and tgt.card.name in SPEEDS else None
    if sp is not None and sp.pcie:
        note += (f": {2 * moved / sp.pcie * 1e3:.1f} ms over PCIe at {sp.pcie / 1e9:.0f} GB/s each way "
                 f"unless overlapped with compute (torchtune's OffloadActivations uses a second stream)")
    return note


def _add_unsplit_blocks(report: MemoryReport, tracker, allocator: CachingAllocator | None,
                        paged: float = 0.0) -> None:
    """Count what the CUDA caching allocator hands out beyond the rounded requests: the
    step's allocations replayed through its block rules (warm-up, then the step measured,
    :func:`memlab.policy.caching_allocator.replay_steady_step`); the excess of that peak over the
    tracker's goes to ``workspace``, as :func:`memlab.lenses.measure.add_workspace` counts it on a GPU.
    ``paged``: bytes of optimizer state in unified memory (:func:`page_out`), not replayed: the
    largest optimizer storages up to that total (the paged moments are each large tensor's
    largest state; the device keeps the small tensors' and the block maxima)."""
    held, events = tracker.allocation_log()
    if paged:
        out, left = set(), paged
        for key, nbytes, _ in sorted((h for h in held if h[2] == "optimizer"), key=lambda h: -h[1]):
            if nbytes <= left:
                out.add(key)
                left -= nbytes
        held = [h for h in held if h[0] not in out]
    extra = replay_steady_step(held, events, allocator).peak_allocated - report.peak_bytes
    if extra > 0:
        report.peak_bytes += extra
        report.by_category["workspace"] = report.by_category.get("workspace", 0) + extra
        report.notes.append(f"{fmt_bytes(extra)} of whole blocks the CUDA caching allocator "
                            f"hands out unsplit (counted as workspace; the timeline is the tracker's)")


def page_out(report: MemoryReport, optimizer: str, paged: float) -> None:
    """Move a paged optimizer's unified-memory bytes off the device timeline, to the host.

    bitsandbytes' ``get_paged`` puts the moments of large tensors in CUDA unified memory, outside
    the caching allocator; the rest of the simulated state stays on the device
    (:func:`memlab.step.low_bit.paged_state_bytes`). The state is made in the warm-up and held all
    step, so every moment loses the same bytes.

    Args:
        report: the simulated step; changed in place.
        optimizer: the paged optimizer's name, for the note.
        paged: the state's bytes in unified memory.
    """
    i = CATEGORIES.index("optimizer")
    state = max((ev.by_category[i] for ev in report.timeline), default=report.by_category.get("optimizer", 0))
    moved = int(min(paged, state))
    events = []
    for ev in report.timeline:
        cats = list(ev.by_category)
        cats[i] -= min(cats[i], moved)
        events.append(Event(ev.index, ev.op, ev.module, ev.phase, tuple(cats), ev.host_by_category))
    if events:
        report.replace_timeline(events)
    else:
        report.peak_bytes -= min(report.by_category.get("optimizer", 0), moved)
        report.by_category["optimizer"] = max(report.by_category.get("optimizer", 0) - moved, 0)
    host = dict(report.host_by_category or dict.fromkeys(CATEGORIES, 0))
    host["optimizer"] = host.get("optimizer", 0) + moved
    report.host_by_category, report.host_bytes = host, sum(host.values())
    report.notes.append(paged_note(optimizer, state, moved))


#: The note a DeepSpeed simulation carries: which of its numbers are the formula's, not the
#: fake step's. A test comparing the simulation with the estimate must leave these out.
FORMULA_CATEGORIES = ("parameters", "gradients", "optimizer", "host")
FORMULA_NOTE = ("from the formula (memlab.step.states.model_states), not simulated: parameters, "
                "optimizer, gradients (the rank's share; only their growth through backward "
                "is simulated), DeepSpeed's buffers, ZeRO-3's gathered parameters and the "
                "step's fp32 gradient copy (in temporaries), and all host bytes; simulated: "
                "activations, the other temporaries and workspaces")


def deepspeed_layout(report: MemoryReport, ms: ModelStates, full_grads: float,
                     gathered: list[float] | None = None) -> None:
    """Put the simulated unsharded step's model states in DeepSpeed's layout, op by op.

    Parameters and optimizer state are held all step; gradients grow through backward as
    simulated (scaled to the rank's share), or are held from the first reduce bucket (ZeRO-2)
    or all step (ZeRO-3); DeepSpeed's buffers are added everywhere (stages 1-2's reduce bucket
    from backward's first gradient to its end, ZeRO-1's to the last backward's end:
    ``ModelStates.bucket``, ``bucket_until``), ZeRO-3's gathered
    parameters in forward and backward (``gathered``, one figure per op of the timeline, where
    :func:`memlab.step.zero3_gathers.gathered_by_op` replayed DeepSpeed's coordinator; else the
    bound ``ModelStates.gathered``), the fp32 gradient copy in the optimizer step.
    """
    i = {c: k for k, c in enumerate(CATEGORIES)}
    events = []
    # stages 1-2's bucket comes at the first gradient's hook in each backward, with that gradient
    # alive (the hook copies it in): DeepSpeed hooks the parameters' AccumulateGrad nodes, so the
    # bucket is there from the first one's op on. After the first micro-batch that op is torch's
    # add_ into .grad, which frees the new gradient an op later; DeepSpeed clears .grad at each
    # backward's end (stage_1_and_2.py _clear_param_grad_only), so its hook sees the new gradient
    hooked = False
    # ZeRO-1 releases its bucket only at the last backward's end (ModelStates.bucket_until)
    last_backward = max((n for n, ev in enumerate(report.timeline) if ev.phase == "backward"), default=-1)
    # with accumulation the partition made at a backward's end (stage_1_and_2.py
    # copy_grads_in_partition: grads_in_partition, allocated once) holds the sum for the next
    # micro-batches
    reduced = False
    for n, ev in enumerate(report.timeline):
        cats = list(ev.by_category)
        reduced = reduced or (n > 0 and report.timeline[n - 1].phase == "backward" and ev.phase != "backward")
        grown = cats[i["gradients"]] / full_grads if full_grads else 0.0
        first_hook = ev.phase == "backward" and ev.module == ACCUMULATE_GRAD
        if ms.bucket_until == "step":
            hooked = n <= last_backward and (hooked or first_hook)
        else:
            hooked = ev.phase == "backward" and (hooked or first_hook)
        in_backward = ms.bucket if hooked else 0.0
        flushed = grown > 0 and grown * full_grads >= ms.flush  # ZeRO-2's first bucket is full
        if ms.gradients_from == "always" or (ms.gradients_from == "first bucket" and flushed):
            grads = ms.gradients
        elif ms.gradients_from == "end of backward":
            grads = ms.gradients if ev.phase == "optimizer" or reduced else 0.0
        else:
            grads = grown * ms.gradients
        cats[i["parameters"]] = ms.parameters
        cats[i["optimizer"]] = ms.optimizer
        cats[i["gradients"]] = grads + ms.buffers + in_backward
        if gathered is not None:
            cats[i["temporaries"]] += gathered[n]
        elif ev.phase in ("forward", "backward"):
            cats[i["temporaries"]] += ms.gathered
        if ev.phase == "optimizer":
            cats[i["temporaries"]] += ms.step_scratch
        events.append(Event(ev.index, ev.op, ev.module, ev.phase,
                            tuple(int(round(c)) for c in cats), ev.host_by_category))
    report.replace_timeline(events)
    host = {c: int(round(ms.host.get(c, 0.0))) for c in CATEGORIES}
    report.host_bytes, report.host_by_category = sum(host.values()), host
    report.notes.append(f"DeepSpeed step: simulated in {ms.compute_precision} without autocast, "
                        f"model states in DeepSpeed's layout (memlab.step.states)")
    report.notes.append(FORMULA_NOTE)
    report.notes.extend(ms.notes)


__all__ = ["FORMULA_CATEGORIES", "FORMULA_NOTE", "deepspeed_layout", "page_out", "simulate_step"]
