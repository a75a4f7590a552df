"""Communication bytes counted on real ranks, to check :mod:`memlab.time.communication`'s formula.

:class:`CollectiveCounter` is a dispatch mode that sees every collective a rank issues: the
``c10d`` ops behind ``torch.distributed``'s functions and DDP's reducer, and the functional
collectives DTensor uses (``_c10d_functional``), as ``torch.distributed.tensor.debug.
CommDebugMode`` does; it adds up the bytes of the tensors each works on, by collective
(an all-gather by its output, everything else by its input: a ``dist.reduce`` of a gradient
slice to its owner by the slice, which every rank sends). The workers run one step of DDP, of
DeepSpeed's ZeRO-1/2/3 (its own config, or the ZeRO paper's collectives: ``paper_collectives``),
or of tensor parallelism under it.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from memlab.core.errors import InputError
from memlab.core.hardware import Placement
from memlab.core.torch_private import TorchDispatchMode, tree_flatten
from memlab.distributed.deepspeed_rank0 import fake_ranks
from memlab.distributed.parallel_common import rank_device, set_rank_threads
from memlab.distributed.ranks import run_ranks
from memlab.distributed.tensor_parallel import apply_tensor_parallel
from memlab.models.gpt_unet import GPT, get_config
from memlab.step.training_step import StepConfig, build_trainer, make_batch
from memlab.step.write_deepspeed_config import deepspeed_config

#: dispatcher op name -> the collective of :data:`memlab.time.communication.COLLECTIVES`
OPS = {"allreduce_": "all_reduce", "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
       "allreduce_coalesced_": "all_reduce",
       "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
       "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
       "reduce_": "reduce",
       "allgather_": "all_gather", "_allgather_base_": "all_gather", "all_gather_into_tensor": "all_gather",
       "all_gather_into_tensor_coalesced": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
       "broadcast_": "broadcast", "send": "send", "recv_": "recv"}


def _tensors(x) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _nbytes(tensors) -> int:
    return sum(math.prod(t.shape) * t.element_size() for t in tensors)


class CollectiveCounter(TorchDispatchMode):
    """Bytes per collective over what runs under it (module doc); ``calls`` keeps each op."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = {}
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace in ("c10d", "_c10d_functional"):
            name = func.overloadpacket.__name__
            kind = OPS.get(name)
            if kind is not None:
                functional = func.namespace == "_c10d_functional"
                # schemas: c10d ops take (tensors, ...) or (outputs, inputs, ...) and return
                # (outputs, work); functional ones take the input and return the output
                if kind == "all_gather":  # by its output: what every rank ends up holding
                    tensors = _tensors(out if functional else args[0])
                elif kind == "reduce_scatter":  # by its input: the whole tensor
                    tensors = _tensors(args[0] if functional else args[1])
                else:
                    tensors = _tensors(args[0])
                n = _nbytes(tensors)
                self.bytes[kind] = self.bytes.get(kind, 0) + n
                self.calls.append((name, n))
        return out


def ddp_count_worker(rank: int, world_size: int, step) -> dict:
    """One DDP step (forward and backward; the optimizer moves nothing) under the counter."""
    trainer = build_trainer(step)
    ddp = DDP(trainer.model)
    batch = make_batch(step, seed=rank)
    ddp(*batch).backward()  # warm-up: DDP rebuilds its buckets after the first step
    with CollectiveCounter() as counter:
        for micro in zip(*(t.chunk(step.micro_batches) for t in batch), strict=True):
            ddp(*micro).backward()
    return {"rank": rank, "bytes": counter.bytes, "calls": counter.calls}


def zero_count_worker(rank: int, world_size: int, step, zero_overrides: dict | None = None,
                      paper_collectives: bool = False) -> dict:
    """One DeepSpeed ZeRO step (after a warm-up step) under the counter; ``paper_collectives``:
    :func:`~memlab.step.write_deepspeed_config.deepspeed_config`'s flag; ``zero_overrides``
    change keys of the config's ``zero_optimization`` after it."""
    import deepspeed

    model = build_trainer(step).model
    config = deepspeed_config(step, paper_collectives=paper_collectives)
    config["zero_optimization"].update(zero_overrides or {})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    batch = make_batch(step, engine.device, seed=rank)
    micro = list(zip(*(t.chunk(step.micro_batches) for t in batch), strict=True))

    def one_step() -> None:
        for mb in micro:
            engine.backward(engine(*mb))
            engine.step()

    one_step()
    with CollectiveCounter() as counter:
        one_step()
    return {"rank": rank, "bytes": counter.bytes, "calls": counter.calls}


def tp_count_worker(rank: int, world_size: int, step) -> dict:
    """One tensor-parallel forward and backward over all ranks (Megatron layout,
    :func:`memlab.distributed.tensor_parallel.apply_tensor_parallel`) under the counter."""
    set_rank_threads(world_size)
    dev = rank_device()
    torch.manual_seed(0)
    with torch.device(dev):
        model = GPT(step.model_config)
    tp = apply_tensor_parallel(model, init_device_mesh(dev.type, (world_size,)))
    idx, tgt = make_batch(step, dev)
    tp(idx, tgt).backward()  # warm-up
    with CollectiveCounter() as counter:
        tp(idx, tgt).backward()
    return {"rank": rank, "bytes": counter.bytes, "calls": counter.calls}


WORKERS = {"ddp": ddp_count_worker, "zero": zero_count_worker, "tp": tp_count_worker}


def count_step_communication(step, kind: str, world_size: int = 2, *,
                             placement: Placement | None = None, timeout: float = 600.0,
                             zero_overrides: dict | None = None, paper_collectives: bool = False) -> list[dict]:
    """Run one step of ``kind`` (``ddp``, ``zero`` at ``step.zero``, ``tp``) on ``world_size``
    ranks (gloo CPU ranks unless ``placement`` says otherwise) and return each rank's counted
    bytes by collective (``bytes``) and its calls.

    Args:
        zero_overrides: DeepSpeed ``zero_optimization`` keys for ``kind="zero"``.
        paper_collectives: ``kind="zero"`` with the ZeRO paper's collectives
            (:data:`~memlab.step.write_deepspeed_config.REDUCE_TO_OWNER`,
            :data:`~memlab.step.write_deepspeed_config.GATHER_EVERY_USE`), what
            ``engine="deepspeed-reduce-scatter"`` of :mod:`memlab.time.communication` counts.
    """
    if kind not in WORKERS:
        raise InputError(f"kind={kind!r}; allowed: {', '.join(WORKERS)}")
    if kind != "zero" and (zero_overrides or paper_collectives):
        raise InputError(f"zero_overrides and paper_collectives are DeepSpeed ZeRO's; kind={kind!r} "
                         f"takes neither (allowed with kind='zero')")
    backend = None if placement is not None else "gloo"
    kwargs = {"step": step}
    if zero_overrides:
        kwargs["zero_overrides"] = zero_overrides
    if paper_collectives:
        kwargs["paper_collectives"] = True
    return run_ranks(WORKERS[kind], world_size, kwargs=kwargs, placement=placement,
                     backend=backend, timeout=timeout)


__all__ = ["OPS", "CollectiveCounter", "OpCounter", "count_deepspeed_passes", "count_step_communication",
           "ddp_count_worker",
           "tp_count_worker", "zero_count_worker"]


# ---- DeepSpeed's per-step work, counted (memlab.time.step_time.DEEPSPEED_PASSES) ------------------
#: ops that launch no kernel: views, metadata, allocation
NO_KERNEL = frozenset({"view", "_unsafe_view", "as_strided", "detach", "t", "alias", "slice", "select", "split",
                       "unbind", "expand", "transpose", "permute", "_reshape_alias", "split_with_sizes", "empty",
                       "empty_strided", "set_"})


class OpCounter(TorchDispatchMode):
    """Counts the kernel-launching ops a block dispatches (:data:`NO_KERNEL` left out), the host
    syncs among them (``.item()``: ``_local_scalar_dense``) and the bytes their tensors hold
    (inputs and outputs: what an elementwise kernel reads and writes). ``paused`` leaves a
    nested block (the inner optimizer) out of the counts, into ``inner``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.syncs = self.bytes = 0
        self.inner_ops = self.inner_bytes = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if func.is_view or name in NO_KERNEL:
            return out
        nbytes = _nbytes(_tensors((args, kwargs, out)))
        if self.paused:
            self.inner_ops += 1
            self.inner_bytes += nbytes
            return out
        self.ops += 1
        self.bytes += nbytes
        self.syncs += name == "_local_scalar_dense"
        return out


def count_deepspeed_passes(zero: int, offload: str = "none", n_layer: int = 36, precision: str = "bf16") -> dict:
    """DeepSpeed's own work in one step, counted on this CPU: a ``precision`` (bf16 or fp32)
    GPT of ``n_layer`` blocks (GPT-2's block, 12 parameter tensors each) made narrow (d_model
    64) so that counting is quick, as rank 0 of one
    (:func:`memlab.distributed.deepspeed_rank0.fake_ranks`), the third step (Adam's state
    exists). Per parameter tensor: the ops ``engine.step()`` launches outside
    the inner torch optimizer, its host syncs, and the ops ``engine.backward`` adds over the
    plain module's backward; per parameter element: the bytes of the step's ops (elementwise
    over the flat buffers, so they scale with the elements) and of the inner optimizer's.

    Returns:
        ``{"optimizer", "tensors", "elements", "step_ops", "step_syncs", "step_bytes", "adam_ops",
        "adam_bytes", "backward_extra_ops", "backward_syncs"}``, per tensor / per element.
    """
    import deepspeed  # optional and heavy: only this count needs it

    cfg = dataclasses.replace(get_config("gpt2-large"), n_layer=n_layer, d_model=64, n_head=1, vocab_size=256,
                              block_size=64)
    if precision not in ("bf16", "fp32"):
        raise InputError(f"precision={precision!r}; allowed: bf16, fp32")
    step = StepConfig(model=cfg, seq=8, batch=1, precision=precision, zero=zero, offload=offload)
    torch.manual_seed(0)
    plain = GPT(cfg).to(torch.bfloat16 if precision == "bf16" else torch.float32)
    batch = make_batch(step)
    with OpCounter() as c:
        plain(*batch).backward()
    plain_ops = c.ops  # forward + backward of the module alone
    # ZeRO-3 replaces torch.nn.functional.linear with its own autograd Function for the rest of
    # the process ("This will persist unless manually reset": partition_parameters.py,
    # _enable_mem_efficient_linear), and a Function's forward runs with grad mode off, so a
    # later checkpointed step would look like backward: put it back
    linear = torch.nn.functional.linear
    try:
        return _count_engine(deepspeed, cfg, step, batch, plain_ops)
    finally:
        torch.nn.functional.linear = linear


def _count_engine(deepspeed, cfg, step, batch, plain_ops: int) -> dict:
    """:func:`count_deepspeed_passes`'s count on the engine, one fake rank."""
    with fake_ranks(1):
        torch.manual_seed(0)
        model = GPT(cfg)
        tensors = len(list(model.parameters()))
        elements = sum(p.numel() for p in model.parameters())
        engine = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=deepspeed_config(step))[0]
        for _ in range(2):
            engine.backward(engine(*batch))
            engine.step()
        with OpCounter() as fb:
            engine.backward(engine(*batch))
        inner = engine.basic_optimizer
        original = inner.step
        counter = OpCounter()

        def counted_step(*a, **k):
            counter.paused = True
            try:
                return original(*a, **k)
            finally:
                counter.paused = False
        inner.step = counted_step
        with counter:
            engine.step()
        inner.step = original
    return {"optimizer": type(engine.optimizer).__name__, "tensors": tensors, "elements": elements,
            "step_ops": counter.ops / tensors, "step_syncs": counter.syncs / tensors,
            "step_bytes": counter.bytes / elements, "adam_ops": counter.inner_ops / tensors,
            "adam_bytes": counter.inner_bytes / elements, "backward_extra_ops": (fb.ops - plain_ops) / tensors,
            "backward_syncs": fb.syncs / tensors}
