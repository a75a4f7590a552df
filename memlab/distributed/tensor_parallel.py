"""Tensor parallelism (Shoeybi et al. 2019, "Megatron-LM", section 3), measured per rank.

Every weight matrix of a transformer block is split across ``t`` ranks: the first Linear of
attention (``qkv``) and of the MLP (``fc``, and SwiGLU's ``gate``) column-wise, the second
(``proj``, ``out``) row-wise, so each pair needs one all-reduce in forward and one in backward.

Grouped-query attention (``n_kv_head < n_head``) is split by key/value groups, as
Megatron-Core does (``megatron/core/transformer/attention.py``, ``SelfAttention``):

* ``n_kv_head`` a multiple of ``t``: each rank holds ``n_head / t`` query heads and the
  ``n_kv_head / t`` key/value heads they read; attention needs no communication.
* ``t`` a multiple of ``n_kv_head`` (``t > n_kv_head``, MQA included): the ``qkv`` weight is
  still split evenly (no rank holds a weight twice), the projection's output is all-gathered,
  and each rank takes its group's key/value head - *replicated* on the ``t / n_kv_head`` ranks
  that share it - and its ``n_head / t`` query heads. The all-gather's backward is a
  reduce-scatter, which sums the key/value gradients of the ranks sharing a head.

Any other ``t`` is refused (:meth:`memlab.models.gpt_unet.GPTConfig.check_tensor_parallel`), as
Megatron-Core's ``divide`` does.
"""
from __future__ import annotations

import copy
import itertools
import types

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from memlab.core.errors import InputError
from memlab.core.hardware import Placement
from memlab.core.torch_private import FakeTensorMode
from memlab.distributed.parallel_common import (
    ParallelResult,
    is_sharded,
    local_bytes,
    rank_device,
    set_rank_threads,
    worker_step,
)
from memlab.distributed.ranks import fake_process_group, resolve_placement, run_ranks
from memlab.lenses.parallel_formulas import tp_activation_bytes
from memlab.models.gpt_unet import GPT, GPTConfig
from memlab.step.training_step import StepConfig, make_batch
from memlab.tracking.tracker import MemoryTracker


def qkv_head_permutation(cfg: GPTConfig, t: int) -> torch.Tensor:
    """Row order of the fused ``qkv`` weight that a column-wise split in ``t`` equal chunks
    turns into whole attention heads (:meth:`memlab.models.gpt_unet.GPTConfig.check_tensor_parallel`
    says which layout).

    ``qkv`` rows are ``[q (n_head heads) | k (n_kv_head) | v (n_kv_head)]``, ``head_dim``
    rows per head; a split of that order would hand rank 0 all of q and none of k.

    * ``"split"``: ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``, where ``q_r`` are rank ``r``'s
      ``n_head / t`` query heads and ``k_r``, ``v_r`` the ``n_kv_head / t`` key/value heads
      they read: chunk ``r`` is everything rank ``r`` needs.
    * ``"replicated"``: one block per key/value group, ``[q heads of group g | k_g | v_g]``
      (Megatron-Core's interleaved layout); a chunk is part of a group, so ranks all-gather
      the projection's output and pick their group from it (:func:`tp_attention_forward`).
    """
    layout = cfg.check_tensor_parallel(t)
    h, kv, hd = cfg.n_head, cfg.kv_heads, cfg.head_dim
    q = torch.arange(h * hd).view(h, hd)
    k = h * hd + torch.arange(kv * hd).view(kv, hd)
    v = (h + kv) * hd + torch.arange(kv * hd).view(kv, hd)
    if layout == "split":
        qs, ks = h // t, kv // t
        blocks = [(q[r * qs:(r + 1) * qs], k[r * ks:(r + 1) * ks], v[r * ks:(r + 1) * ks])
                  for r in range(t)]
    else:
        g = h // kv
        blocks = [(q[j * g:(j + 1) * g], k[j:j + 1], v[j:j + 1]) for j in range(kv)]
    return torch.cat([torch.cat([b.reshape(-1) for b in blk]) for blk in blocks])


def _gather_last_dim(local: torch.Tensor, mesh) -> torch.Tensor:
    """All-gather ``local`` along its last dimension over ``mesh``; backward reduce-scatters
    (every rank used a different slice of the result, so its gradient is a partial sum)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    dim = local.dim() - 1
    whole = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False)
    return whole.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])


def tp_attention_forward(self, x: torch.Tensor) -> torch.Tensor:
    """The attention forward on one TP rank: its query heads and the key/value heads they
    read (see :func:`qkv_head_permutation`), then its slice of ``proj`` (row-wise: the
    all-reduce happens inside). ``self.tp_mesh`` is set by :func:`apply_tensor_parallel`;
    without it the layer holds the ``"split"`` layout's rows of one rank."""
    b, s, _ = x.shape
    cfg = self.cfg
    hd, groups = cfg.head_dim, cfg.n_head // cfg.kv_heads
    mesh = getattr(self, "tp_mesh", None)
    qkv = self.qkv(x)
    if mesh is not None and cfg.check_tensor_parallel(mesh.size()) == "replicated":
        t, rank = mesh.size(), mesh.get_local_rank()
        ranks_per_group = t // cfg.kv_heads
        width = (groups + 2) * hd
        group = _gather_last_dim(qkv, mesh)[..., (rank // ranks_per_group) * width:
                                            (rank // ranks_per_group + 1) * width]
        q, k, v = group.split([groups * hd, hd, hd], dim=-1)
        heads = cfg.n_head // t
        q = q[..., (rank % ranks_per_group) * heads * hd:(rank % ranks_per_group + 1) * heads * hd]
        kv_heads = 1
    else:
        kv_heads = qkv.shape[-1] // ((groups + 2) * hd)
        heads = groups * kv_heads
        q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    q = q.reshape(b, s, heads, hd).transpose(1, 2)
    k, v = (z.reshape(b, s, kv_heads, hd).transpose(1, 2) for z in (k, v))
    if cfg.position == "rope":
        cos, sin = self.cos[:s].to(q.dtype), self.sin[:s].to(q.dtype)
        q = q * cos + torch.cat((-q[..., hd // 2:], q[..., :hd // 2]), -1) * sin
        k = k * cos + torch.cat((-k[..., hd // 2:], k[..., :hd // 2]), -1) * sin
    if cfg.checkpointing == "selective":
        y = checkpoint(self.core, q, k, v, use_reentrant=False)
    else:
        y = self.core(q, k, v)
    return self.proj(y.transpose(1, 2).reshape(b, s, heads * hd))


def apply_tensor_parallel(model: GPT, mesh) -> GPT:
    """Shard every block of ``model`` in place over the 1-D ``mesh`` (Megatron layout):
    ``qkv``, ``fc`` and SwiGLU's ``gate`` column-wise, ``proj`` and ``out`` row-wise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    cfg, t = model.cfg, mesh.size()
    perm = qkv_head_permutation(cfg, t)
    plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
            "mlp.fc": ColwiseParallel(), "mlp.out": RowwiseParallel()}
    if cfg.mlp == "swiglu":
        plan["mlp.gate"] = ColwiseParallel()
    for block in model.blocks:
        with torch.no_grad():
            qkv = block.attn.qkv
            qkv.weight.copy_(qkv.weight[perm])
            if qkv.bias is not None:
                qkv.bias.copy_(qkv.bias[perm])
        block.attn.tp_mesh = mesh
        block.attn.forward = types.MethodType(tp_attention_forward, block.attn)
        parallelize_module(block, mesh, plan)
    return model


def _full_grad(name: str, p: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """A TP parameter's gradient gathered and put back in the single-process row order."""
    g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
    if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):
        out = torch.empty_like(g)
        out[perm] = g
        return out
    return g


def tp_tracked_step(tp: GPT, opt: torch.optim.Optimizer, idx: torch.Tensor,
                     tgt: torch.Tensor) -> dict:
    """Parameter bytes on this rank, then one tracked step; the live bytes before and after
    each block's forward give the activations that block keeps."""
    blocks = {n for n, _ in tp.blocks.named_parameters(prefix="blocks")}
    params = dict(tp.named_parameters())
    out = {"param_bytes": sum(local_bytes(p) for p in params.values()),
           "block_param_bytes": sum(local_bytes(params[n]) for n in blocks),
           "sharded_param_bytes": sum(local_bytes(p) for p in params.values() if is_sharded(p)),
           "full_block_param_bytes": sum(p.numel() * p.element_size()
                                         for n, p in params.items() if n in blocks),
           "full_param_bytes": sum(p.numel() * p.element_size() for p in params.values())}
    marks: list[int] = []
    with MemoryTracker() as mt:
        hooks = [tp.blocks[0].register_forward_pre_hook(lambda m, a: marks.append(mt.live_bytes))]
        hooks += [b.register_forward_hook(lambda m, a, o: marks.append(mt.live_bytes))
                  for b in tp.blocks]
        mt.track_model(tp)
        mt.track_optimizer(opt)
        mt.track_tensors((idx, tgt), "other")
        mt.reset_peak()
        loss = tp(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for hk in hooks:
            hk.remove()
    per_layer = sorted(b - a for a, b in itertools.pairwise(marks))
    out["layer_activation_bytes"] = [b - a for a, b in itertools.pairwise(marks)]
    # the median: gloo's thread may free an all-reduce's input after a block's hook has read
    # the live bytes (a layer late, or past the last block), so one layer can read high
    mid = len(per_layer) // 2
    out["layer_activation"] = (per_layer[mid] if len(per_layer) % 2
                               else (per_layer[mid - 1] + per_layer[mid]) / 2)
    out["peak_bytes"] = mt.peak_bytes
    out["by_category"] = mt.peak_by_category()
    return out


def tp_worker(rank: int, world_size: int, *, model: str | GPTConfig = "tiny", seq: int = 256,
              batch: int = 8, attention: str = "sdpa", check: bool = True) -> dict:
    """One TP rank: loss and gradients against the single-process model, then a tracked
    AdamW step with the activations each block keeps. ``model``: a preset name or a
    :class:`~memlab.models.gpt_unet.GPTConfig`. Returns plain numbers."""
    set_rank_threads(world_size)
    dev = rank_device()
    step = worker_step(model, seq, batch, attention)
    cfg = step.model_config
    torch.manual_seed(0)
    with torch.device(dev):
        ref = GPT(cfg)
    tp = apply_tensor_parallel(copy.deepcopy(ref) if check else ref,
                               init_device_mesh(dev.type, (world_size,)))
    idx, tgt = make_batch(step, dev)
    # fused kernels refuse a mix of DTensor (sharded) and plain (replicated) parameters;
    # the per-tensor loop makes no full-size temporaries either
    opt = torch.optim.AdamW(tp.parameters(), lr=1e-4, foreach=False)
    out: dict = {"rank": rank, "world_size": world_size, "config": cfg.name}

    # 1. equal loss and gradients (this is also the warm-up step that creates AdamW state)
    loss = tp(idx, tgt)
    loss.backward()
    out["loss"] = loss.item()
    if check:  # the single-process model on the same batch
        ref_loss = ref(idx, tgt)
        ref_loss.backward()
        perm = qkv_head_permutation(cfg, world_size)
        ref_grads = dict(ref.named_parameters())
        out["ref_loss"] = ref_loss.item()
        out["max_grad_diff"] = max(
            (_full_grad(n, p, perm) - ref_grads[n].grad).abs().max().item()
            for n, p in tp.named_parameters())
    opt.step()
    opt.zero_grad(set_to_none=True)
    del ref

    out.update(tp_tracked_step(tp, opt, idx, tgt))
    out["formula"] = tp_activation_bytes(cfg, seq, batch, world_size)
    return out


def simulate_tensor_parallel(step: StepConfig | None = None, tensor_parallel: int = 2, *,
                             tp: int | None = None) -> ParallelResult:
    """Rank 0 of a ``tensor_parallel``-way step, in this process, without the memory:
    a fake process group (collectives return at once) and fake tensors, tracked exactly.

    Every rank holds the same shapes, so rank 0 stands for all; the numbers equal a real
    run's (lesson 12 checks it on the tiny model), for models no laptop could hold.

    Returns:
        A :class:`~memlab.distributed.parallel_common.ParallelResult` as
        :func:`measure_tensor_parallel` returns, whose ``per_rank`` holds rank 0 alone (the
        same keys as a measured rank's, without the loss check) and whose ``device`` is ``fake``.
    """
    tp = tensor_parallel if tp is None else tp  # ``tp=``: the old spelling lesson 12 uses
    step = step or StepConfig()
    cfg = step.model_config
    if not isinstance(cfg, GPTConfig):
        raise InputError("tensor parallelism needs a GPT model")
    cfg.check_tensor_parallel(tp)
    with fake_process_group(tp):
        mesh = init_device_mesh("cpu", (tp,))  # outside fake mode: it reads the ranks
        with FakeTensorMode(), torch.device("cpu"):
            model = apply_tensor_parallel(GPT(cfg), mesh)
            idx = torch.randint(0, cfg.vocab_size, (step.batch, step.seq))
            tgt = torch.randint(0, cfg.vocab_size, (step.batch, step.seq))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
            model(idx, tgt).backward()  # warm-up: the optimizer state exists from here on
            opt.step()
            opt.zero_grad(set_to_none=True)
            out = tp_tracked_step(model, opt, idx, tgt)
    out.update(rank=0, world_size=tp, config=cfg.name,
               formula=tp_activation_bytes(cfg, step.seq, step.batch, tp))
    return ParallelResult("tensor parallel, simulated (rank 0 stands for all)", step, [out], "fake")


def measure_tensor_parallel(step: StepConfig | None = None, tensor_parallel: int = 2, *,
                            tp: int | None = None, check: bool = True,
                            timeout: float = 300.0, backend: str | None = None,
                            placement: Placement | None = None) -> ParallelResult:
    """Run one TP step of ``step``'s GPT on ``tp`` spawned ranks: loss and gradients against
    one process (``check``), parameter bytes, activations per layer and the tracked peak.
    The ranks run where ``placement`` says (default :func:`~memlab.core.hardware.place_ranks`:
    NCCL with one GPU per rank, else gloo on the CPU); ``backend="gloo"`` asks for the CPU.

    Args:
        step: the step (``None``: ``StepConfig()``); its model must be a GPT.
        tensor_parallel: ranks (``tp`` is the old spelling); it must divide the heads.
        check, timeout, backend, placement: as above.

    Returns:
        A :class:`~memlab.distributed.parallel_common.ParallelResult`, one entry per rank.

    Raises:
        InputError: a model or ``tensor_parallel`` that is not allowed.
        RankError: a rank failed (:mod:`memlab.distributed.ranks`).
    """
    tp = tensor_parallel if tp is None else tp  # ``tp=``: the old spelling lesson 12 uses
    step = step or StepConfig()
    cfg = step.model_config
    if not isinstance(cfg, GPTConfig):
        raise InputError(f"tensor parallelism needs a GPT model, got {getattr(cfg, 'name', cfg)!r}")
    cfg.check_tensor_parallel(tp)  # before any rank starts
    placement = resolve_placement(tp, backend=backend, placement=placement)
    res = run_ranks(tp_worker, tp, timeout=timeout, placement=placement,
                    kwargs=dict(model=step.model, seq=step.seq, batch=step.batch,
                                attention=cfg.attention, check=check))
    return ParallelResult("tensor parallel", step, res, placement.device_type)
