"""Per-rank memory without the ranks: FSDP2 (``fully_shard``, = ZeRO-3) on a fake process
group and fake tensors.

:func:`simulate_sharded` runs rank 0 of a ``world_size``-rank FSDP2 step in this process
(:func:`memlab.distributed.ranks.fake_process_group`) under ``FakeTensorMode``, tracked exactly;
:func:`measure_sharded` runs the same tracked step on real ranks (:func:`fsdp_worker` on each,
gloo on the CPU or NCCL with a GPU per rank), with ``reshard_after_forward`` on or off and
FSDP2's ``CPUOffloadPolicy``: ``memlab measure --fsdp --world-size 2``.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from memlab.core.errors import InputError
from memlab.core.hardware import resolve_budget
from memlab.core.torch_private import FakeTensorMode, fsdp2_mem_tracker
from memlab.distributed.ranks import fake_process_group, resolve_placement, run_ranks
from memlab.models.gpt_unet import GPTConfig, build_model
from memlab.step.training_step import MemoryReport, StepConfig, make_batch
from memlab.tracking.tracker import CATEGORIES, MemoryTracker

SHARDED_PRECISIONS = ("fp32", "bf16")


def _fsdp_kwargs(step) -> dict:
    """``fully_shard`` options for ``step``'s precision. bf16 is FSDP2's own mixed precision
    (``MixedPrecisionPolicy``): fp32 sharded parameters (the master copy), gathered and
    computed in bf16 with no autocast, gradients reduce-scattered in fp32 - the 16-bit
    compute and sharded fp32 master of DeepSpeed's bf16 ZeRO-3, with the fp32 weights counted
    as parameters (DeepSpeed keeps bf16 weights and counts its fp32 copy as optimizer state)."""
    if step.precision not in SHARDED_PRECISIONS:
        raise InputError(f"precision={step.precision!r} for a sharded simulation; allowed: "
                         f"{', '.join(SHARDED_PRECISIONS)}")
    if step.precision == "fp32":
        return {}
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                              reduce_dtype=torch.float32)}


def _fsdp_tracked_step(step, mesh, mode=None, *, reshard_after_forward: bool = True,
                       cpu_offload: bool = False, device: str = "cpu") -> "MemoryTracker":
    """Shard each block and the root with FSDP2 ``fully_shard`` (= ZeRO-3: parameters,
    gradients and optimizer state sharded), warm up, then track one step.

    An untied embedding is its own FSDP unit, so its gathered weight lives only around its
    forward and backward rather than the whole step. Under fake tensors (``mode``) the model
    is built on the meta device and sharded there (splitting meta tensors is cheap; splitting
    fake ones in 64 costs seconds per layer), then materialised as fake tensors. The warm-up
    creates the optimizer state from zero gradients and runs FSDP's lazy set-up on a
    one-token forward: the tracked step is in steady state without a whole step before it.
    """
    from torch.distributed.fsdp import fully_shard

    cfg = step.model_config
    kw = _fsdp_kwargs(step)
    kw["reshard_after_forward"] = reshard_after_forward
    if cpu_offload:
        from torch.distributed.fsdp import CPUOffloadPolicy
        # sharded parameters, gradients and the optimizer step on the host; pinning needs CUDA
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device == "cuda")
    real_batch = make_batch(step, device)
    torch.manual_seed(0)
    with torch.device("meta" if mode is not None else device):
        model = build_model(cfg)
    if isinstance(cfg, GPTConfig) and not cfg.tie_embeddings:
        fully_shard(model.wte, mesh=mesh, **kw)
    for block in getattr(model, "blocks", []):
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    with mode if mode is not None else contextlib.nullcontext():
        if mode is not None:
            model.to_empty(device="cpu")
        # fused, as build_optimizer: no per-parameter temporaries in the optimizer step
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        batch = tuple(mode.from_tensor(b) for b in real_batch) if mode else real_batch
        with torch.no_grad():
            model(*(t[:1, :1] for t in batch))

        def one_step() -> None:
            for micro in zip(*(t.chunk(step.micro_batches) for t in batch), strict=True):
                loss = model(*micro) / step.micro_batches
                loss.backward()
                del loss
            opt.step()
            opt.zero_grad(set_to_none=True)

        tracker = _FSDPTracker(model, opt)
        with tracker:
            one_step()
    return tracker


# FSDP2 frees gathered parameters with ``untyped_storage().resize_(0)``, which no dispatch
# mode sees; torch's FSDPMemTracker follows those resizes. Its categories map onto ours:
_FSDP_CATEGORIES = {"Sharded Param": "parameters", "Sharded Grad": "gradients",
                    "OptState": "optimizer", "Activation": "activations",
                    "Unsharded Param": "temporaries", "Unsharded Grad": "temporaries",
                    "All Gather": "temporaries", "Reduce Scatter": "temporaries",
                    "Temp": "temporaries", "Inputs": "other", "Buffer": "other"}


def _fast_fsdp_tracker() -> type:
    """FSDPMemTracker without its bookkeeping on ``prim.device``: a device query allocates
    nothing, and under fake tensors it is half of all dispatched calls."""
    FSDPMemTracker = fsdp2_mem_tracker()
    device_query = torch.ops.prim.device.default

    class Tracker(FSDPMemTracker):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is device_query:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    return Tracker


class _FSDPTracker:
    """FSDPMemTracker around one step, read out as ``peak_bytes`` and ``peak_by_category``.
    Gathered parameters and gradients and the collectives' buffers count as temporaries."""

    def __init__(self, model, opt):
        self._t = _fast_fsdp_tracker()(mod=model, optm=opt)
        self.peak_bytes = 0
        self._cats: dict[str, int] = {}

    def __enter__(self):
        self._t.__enter__()
        self._t.reset_mod_stats()
        return self

    def __exit__(self, *exc):
        self._t.__exit__(*exc)
        snap = next(iter(self._t.get_tracker_snapshot("peak").values()))
        self._cats = dict.fromkeys(CATEGORIES, 0)
        for key, value in snap.items():
            name = getattr(key, "value", key)
            if name != "Total":
                self._cats[_FSDP_CATEGORIES.get(name, "other")] += value
        self.peak_bytes = snap.get("Total", sum(self._cats.values()))

    def peak_by_category(self) -> dict[str, int]:
        return dict(self._cats)


def fsdp_worker(rank: int, world_size: int, step, reshard_after_forward: bool = True,
                cpu_offload: bool = False) -> dict:
    """A real FSDP2 step on this rank (the check for :func:`simulate_sharded`): on its GPU
    when the group is NCCL's, else on the CPU."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device, (world_size,))
    t = _fsdp_tracked_step(step, mesh, reshard_after_forward=reshard_after_forward,
                           cpu_offload=cpu_offload, device=device)
    return {"rank": rank, "device": device, "peak_bytes": t.peak_bytes,
            "by_category": t.peak_by_category()}


def measure_sharded(step=None, world_size: int | None = None, *, reshard_after_forward: bool = True,
                    cpu_offload: bool = False, backend: str | None = None, budget=None,
                    timeout: float = 600.0, **overrides) -> MemoryReport:
    """FSDP2 (``fully_shard``, = ZeRO-3) measured on ``world_size`` real ranks: one tracked
    step per rank (FSDPMemTracker, as :func:`simulate_sharded` tracks it), beside
    :func:`memlab.distributed.deepspeed_zero.measure_distributed`'s DeepSpeed.

    Args:
        step: the step (``zero`` becomes 3: FSDP2 shards all three model states).
        world_size: ranks (default ``step.world_size``).
        reshard_after_forward: free gathered parameters after each unit's forward (FSDP2's
            default, ZeRO-3) or keep them to the backward (ZeRO-2-like parameters).
        cpu_offload: FSDP2's ``CPUOffloadPolicy`` (sharded states and the optimizer step on
            the host; on a CPU-only run host and device are one memory).
        backend: "gloo" (CPU ranks) or "nccl" (a GPU per rank); default what the machine has.
        budget: each rank's budget, for ``fits``.
        timeout: seconds for the ranks.
    Returns:
        a :class:`MemoryReport` (lens "measure") of the largest rank, ``per_rank`` one per rank.
    """
    step = step or StepConfig()
    world_size = world_size or step.world_size
    step = replace(step, world_size=world_size, zero=3, **overrides)
    _fsdp_kwargs(step)  # validates the precision
    budget_bytes = resolve_budget(budget)
    placement = resolve_placement(world_size, backend=backend)
    results = run_ranks(fsdp_worker, world_size, backend=placement.backend, placement=placement,
                        timeout=timeout, kwargs={"step": step, "reshard_after_forward": reshard_after_forward,
                                                 "cpu_offload": cpu_offload})
    per = [MemoryReport("measure", step, r["device"], r["peak_bytes"], dict(r["by_category"]),
                        budget_bytes) for r in results]
    top = max(per, key=lambda r: r.peak_bytes)
    # no step time: the tracked step is not timed apart from the build and warm-up around it
    rep = MemoryReport("measure", step, top.device, top.peak_bytes, dict(top.by_category), budget_bytes,
                       None, per_rank=per)
    rep.notes.append(f"FSDP2 fully_shard (= ZeRO-3) on {world_size} {placement.backend} ranks; "
                     f"reshard_after_forward={reshard_after_forward}"
                     + ("; CPUOffloadPolicy" if cpu_offload else ""))
    if cpu_offload and top.device == "cpu":
        rep.notes.append("CPUOffloadPolicy on CPU ranks: host and device are one memory, so the "
                         "offload moves nothing; on GPUs the sharded states leave the device")
    return rep


def simulate_sharded(step=None, world_size: int | None = None, *, budget=None,
                     reshard_after_forward: bool = True, **overrides):
    """Per-rank memory of a fully sharded step on ``world_size`` ranks, in this process.

    A fake process group (backend ``"fake"``: collectives return at once) and fake tensors
    run FSDP2 ``fully_shard`` as rank 0; FSDP2's full sharding is ZeRO stage 3 (parameters,
    gradients and optimizer state each 1/N per rank). Shards are padded to equal size, so
    every rank holds what rank 0 holds. No fp32 master copy exists in fp32 training (FSDP2
    updates the sharded parameters in place), where DeepSpeed keeps one; ``precision="bf16"``
    is FSDP2's mixed precision (see :func:`_fsdp_kwargs`). Nothing of the model is
    allocated: llama-3-70b over 64 ranks at 8192 tokens runs on a laptop
    (``benchmarks/scale.py`` times it). Against real gloo ranks (``fsdp_worker``) the fp32
    and the checkpointed bf16 steps agree to the byte; a bf16 step without checkpointing ran
    5% higher on real ranks (a 2-layer toy: one block's fp32 reduce-scatter input lived
    longer there), a difference in collective timing the fake group does not have. Returns a
    :class:`MemoryReport` (lens "simulate") with ``per_rank``. ``reshard_after_forward=False``
    keeps each unit's gathered parameters from its forward to its backward, as FSDP2 does.

    Args:
        step: the step (``None``: ``StepConfig()``); ``overrides`` replace its fields.
        world_size: ranks to shard over (``None``: ``step.world_size``).
        budget: each rank's, as in :func:`memlab.lenses.simulate.simulate_step`.

    Returns:
        A :class:`MemoryReport` (lens ``"simulate"``) with ``per_rank``.

    Raises:
        InputError: a field, ``world_size`` or budget that is not allowed.
    """

    step = step or StepConfig()
    world_size = world_size or step.world_size
    step = replace(step, world_size=world_size, zero=3, **overrides)
    _fsdp_kwargs(step)  # validates the precision
    budget_bytes = resolve_budget(budget)
    with fake_process_group(world_size):
        mesh = init_device_mesh("cpu", (world_size,))  # outside fake mode: it reads ranks
        start = time.perf_counter()
        # real inputs: to_empty (meta -> fake) and the batch meet the mode from outside
        tracker = _fsdp_tracked_step(step, mesh, FakeTensorMode(allow_non_fake_inputs=True),
                                     reshard_after_forward=reshard_after_forward)
        seconds = time.perf_counter() - start
    one = MemoryReport("simulate", step, "cpu", tracker.peak_bytes, tracker.peak_by_category(),
                       budget_bytes, seconds)
    rep = MemoryReport("simulate", step, "cpu", one.peak_bytes, dict(one.by_category),
                       budget_bytes, seconds, per_rank=[one] * world_size)
    rep.notes.append(f"FSDP2 fully_shard (= ZeRO-3) on a fake {world_size}-rank process group; "
                     f"ranks hold equal padded shards")
    if step.precision == "bf16":
        rep.notes.append("bf16: FSDP2 MixedPrecisionPolicy (fp32 sharded parameters, bf16 "
                         "gathered weights and compute, fp32 gradient reduce-scatter)")
    return rep


__all__ = ["SHARDED_PRECISIONS", "fsdp_worker", "measure_sharded", "simulate_sharded"]
