"""Simulate: the measured step, run on fake tensors, for hardware you do not have.

Under ``FakeTensorMode`` every op computes shapes, dtypes and strides but allocates nothing,
so a gpt2-xl or llama-7b step "runs" on a laptop in seconds while
:class:`~memlab.tracking.MemoryTracker` counts the bytes it would hold, exactly as it counts
a real step (the two agree to the byte on the tiny model).

The step always runs on the *fake CPU* device: on a CPU-only torch build, fake CUDA tensors
cannot be initialised, and the first autograd op on one aborts the process. The device the
bytes are counted for is the ``target``:

* ``"cpu"`` (the function's default): CPU autocast and CPU kernels, exact bytes, equal to
  :func:`~memlab.measure.measure_step` on this machine.
* ``"cuda"`` (the CLI's default): :func:`memlab.policy.emulate` puts CUDA's autocast op lists
  on the ``AutocastCPU`` dispatch key and CUDA's fused ``rms_norm`` on ``AutogradCPU`` for the
  duration of the step, so autograd saves what it saves on a GPU; the tracker's
  :class:`~memlab.policy.TargetAccounting` adds what no op returns (cuBLAS workspaces, cuDNN
  convolution and FlashAttention backward workspaces, in the category ``workspace``),
  CUDA's attention log-sum-exp and LayerNorm statistics, and rounds every storage to the
  caching allocator's 512-byte blocks. On the H200 reference steps this lands within 1.5% of
  ``torch.cuda.max_memory_allocated()`` on GPT steps and within 10% on the UNet, whose cuDNN
  workspace is a model (``data/reference/``, ``benchmarks/gpu_reference.py``).

A GPU's capacity is applied as a budget, as on CPU.
"""
from __future__ import annotations

import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .hardware import resolve_budget
from .measure import run_tracked_step
from .step import MemoryReport, StepConfig, batch_to, build_trainer, resolve_step
from .models import UNetConfig
from .policy import emulate, get_target


def _fake_batch(step: StepConfig) -> tuple:
    cfg = step.model_config
    if isinstance(cfg, UNetConfig):
        x = torch.randn(step.batch, cfg.channels, step.seq, step.seq)
        return x, torch.randint(0, 1000, (step.batch,)), torch.randn_like(x)
    idx = torch.randint(0, cfg.vocab_size, (step.batch, step.seq))
    return idx, torch.randint(0, cfg.vocab_size, (step.batch, step.seq))


def simulate_step(step: StepConfig | None = None, *, budget: int | str | None = None,
                  target: str = "cpu", **overrides) -> MemoryReport:
    """Run one steady-state step on fake tensors and report its peak by category.

    ``budget`` is bytes, a size string, or a GPU preset (``"A100-40GB"``): the report says
    whether the step fits and, if not, where it ran out (``report.oom``). ``target`` is the
    device the bytes are counted for: ``"cpu"`` (exactly what :func:`measure_step` sees on
    this CPU) or ``"cuda"`` (CUDA's autocast policy, kernels, workspaces and 512-byte
    blocks, see :mod:`memlab.policy`; a GPU preset budget picks the card's cuBLAS workspace).
    """
    tgt = get_target(target, budget)
    step = resolve_step(step, **overrides)
    budget_bytes = resolve_budget(budget)
    start = time.perf_counter()
    # One mode for building and running: mixing fake modes is not supported.
    with FakeTensorMode(allow_non_fake_inputs=False), emulate(tgt):
        trainer = build_trainer(step, "cpu", fake=True)
        batch = batch_to(_fake_batch(step), step)
        tracker, _, before, after = run_tracked_step(trainer, batch, budget_bytes, warmup="optimizer",
                                                     accounting=tgt.accounting())
        report = MemoryReport("simulate", step, f"{tgt.name} (fake)", tracker.peak_bytes,
                              tracker.peak_by_category(), budget_bytes, None, tracker.oom,
                              tracker.timeline, {}, before, after)
        del trainer, batch, tracker
    report.step_seconds = time.perf_counter() - start
    report.notes.append("step_seconds is the wall time of the whole simulation")
    return report
