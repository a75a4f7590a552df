"""Activation compression: store what backward needs in fewer bits.

``torch.autograd.graph.saved_tensors_hooks(pack, unpack)`` lets us replace every tensor
autograd saves in forward by anything we like, and rebuild it when backward asks for it
(PyTorch docs, "Hooks for saved tensors"). Packing to bf16 halves an fp32 activation;
packing to int8 with an absmax scale (per tensor, or per row of the last dimension, as in
Chen et al. 2021 "ActNN", section 3, and LLM.int8's vector-wise quantization) quarters it.
Backward then runs on slightly wrong activations, so the gradients carry an error; the
lesson measures both.

Four things a naive hook gets wrong (all found on CPU, all handled here):

* **Parameters.** Linear saves its weight (as a transposed *view*) for the input gradient.
  Packing it would copy the weights and keep the original alive too: more memory, not less.
  Tensors whose storage belongs to a parameter pass through untouched.
* **Views share a storage.** q, k and v are views of one ``qkv`` output; packed one by one,
  the pieces cost as much as the whole. Each storage is packed once, whole, and every view
  saved from it is rebuilt with ``as_strided``.
* **A cache per forward.** The storage -> packed map lives for one forward only (weakly
  keyed, so a freed storage whose address is reused is never mistaken for the old one);
  a version counter check repacks a storage modified in place.
* **The loss.** Cross-entropy saves its log-softmax output (``4 s b V`` bytes, the largest
  tensor of a small-vocabulary model); int8 error there goes straight into every gradient.
  Hooks are active inside the transformer blocks only (``modules``), so the head, the final
  norm and the loss are left alone. Tiny tensors (norm statistics, attention's log-sum-exp)
  are skipped too: they save nothing and carry a lot of the error.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from memlab.core.errors import InputError
from memlab.core.torch_private import tensor_version
from memlab.lenses.guard import check_host
from memlab.lenses.measure import measure_trainer, time_steps
from memlab.step.training_step import (
    MemoryReport,
    StepConfig,
    autocast_for,
    batch_to,
    build_trainer,
    make_batch,
    resolve_step,
)
from memlab.techniques.sweeps import category_max, relative_error

MODES = ("bf16", "int8")
GRANULARITIES = ("row", "tensor")
# What the lesson compares: a label -> (compression mode, granularity) or a StepConfig override.
VARIANTS = {
    "none": None,
    "bf16": ("bf16", "row"),
    "int8 per-row": ("int8", "row"),
    "int8 per-tensor": ("int8", "tensor"),
    "checkpointing": {"checkpointing": "full"},
}


class _Packed:
    """One storage, compressed: ``unpack`` gives back a flat tensor of the original dtype."""

    __slots__ = ("data", "scale", "dtype", "version")

    def __init__(self, data: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype,
                 version: int):
        self.data, self.scale, self.dtype, self.version = data, scale, dtype, version

    @property
    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        return n + (0 if self.scale is None else self.scale.numel() * self.scale.element_size())

    def unpack(self) -> torch.Tensor:
        if self.scale is None:
            return self.data.to(self.dtype)
        return (self.data.float() * self.scale).to(self.dtype).view(-1)


def quantize(flat: torch.Tensor, mode: str, granularity: str = "row", row: int = 1) -> _Packed:
    """Compress a 1-D tensor: ``bf16`` casts; ``int8`` rounds ``x / scale`` with ``scale =
    absmax / 127`` of the whole tensor or of each row of ``row`` elements."""
    if mode == "bf16":
        return _Packed(flat.to(torch.bfloat16), None, flat.dtype, 0)
    if mode != "int8":
        raise InputError(f"mode={mode!r}; allowed: {', '.join(MODES)}")
    x = flat.float()
    if granularity == "row" and row > 1 and x.numel() % row == 0:
        x = x.view(-1, row)
        scale = x.abs().amax(dim=1, keepdim=True) / 127
    else:
        scale = x.abs().amax().reshape(1) / 127
    scale = scale.clamp_min(torch.finfo(torch.float32).tiny)
    q = (x / scale).round_().clamp_(-127, 127).to(torch.int8)
    return _Packed(q, scale, flat.dtype, 0)


class ActivationCompressor:
    """Compress the activations ``modules`` (default: ``model.blocks``) save for backward.

    >>> comp = ActivationCompressor(model, "int8")   # installs forward hooks
    >>> loss = model(idx, tgt); loss.backward()      # saved tensors packed, then unpacked
    >>> comp.saved_bytes, comp.packed_bytes          # what was compressed, into how much
    >>> comp.remove()

    ``min_numel``: smaller tensors are kept as they are. Combining with activation
    checkpointing is not supported (the recomputation has hooks of its own).
    """

    def __init__(self, model: nn.Module, mode: str = "int8", *, granularity: str = "row",
                 modules: Iterable[nn.Module] | None = None, min_numel: int = 65536):
        if mode not in MODES:
            raise InputError(f"mode={mode!r}; allowed: {', '.join(MODES)}")
        if granularity not in GRANULARITIES:
            raise InputError(f"granularity={granularity!r}; allowed: {', '.join(GRANULARITIES)}")
        cfg = getattr(model, "cfg", None)
        if getattr(cfg, "checkpointing", "none") != "none":
            raise InputError(f"checkpointing={cfg.checkpointing!r}: compression works on a model "
                             f"without activation checkpointing; allowed: 'none'")
        self.mode, self.granularity, self.min_numel = mode, granularity, min_numel
        self.model = model
        if modules is None:
            modules = list(model.blocks) if hasattr(model, "blocks") else [model]
        self.modules = list(modules)
        self.saved_bytes = self.packed_bytes = 0  # of the last forward
        self.n_packed = self.n_views = self.n_skipped = 0
        self._cache: WeakIdKeyDictionary | None = None
        self._params = WeakIdKeyDictionary()
        self._stack: list = []
        self._handles = [model.register_forward_pre_hook(self._new_forward),
                         model.register_forward_hook(self._end_forward, always_call=True)]
        for m in self.modules:
            self._handles += [m.register_forward_pre_hook(self._enter),
                              m.register_forward_hook(self._exit, always_call=True)]

    # -- hooks around the forward ---------------------------------------------------------
    def _new_forward(self, module, args) -> None:
        self._cache = WeakIdKeyDictionary()
        self._params = WeakIdKeyDictionary({p.untyped_storage(): True for p in module.parameters()})
        self.saved_bytes = self.packed_bytes = 0
        self.n_packed = self.n_views = self.n_skipped = 0

    def _end_forward(self, module, args, output) -> None:
        self._cache = None  # packed tensors now live only in the autograd graph

    def _enter(self, module, args) -> None:
        if torch.is_grad_enabled():
            ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            ctx.__enter__()
            self._stack.append(ctx)
        else:
            self._stack.append(None)

    def _exit(self, module, args, output) -> None:
        ctx = self._stack.pop()
        if ctx is not None:
            ctx.__exit__(None, None, None)

    # -- pack / unpack --------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        if (not t.is_floating_point() or t.numel() < self.min_numel or st in self._params
                or (self.mode == "bf16" and t.element_size() <= 2) or self._cache is None):
            self.n_skipped += 1
            return t
        packed = self._cache.get(st)
        if packed is None or packed.version != tensor_version(t):
            n = st.nbytes() // t.element_size()
            flat = t.detach().as_strided((n,), (1,), 0)  # the whole storage, once
            packed = quantize(flat, self.mode, self.granularity, t.shape[-1] if t.dim() else 1)
            packed.version = tensor_version(t)
            self._cache[st] = packed
            self.n_packed += 1
            self.saved_bytes += st.nbytes()
            self.packed_bytes += packed.nbytes
        else:
            self.n_views += 1
        return packed, tuple(t.shape), t.stride(), t.storage_offset()

    @staticmethod
    def _unpack(obj):
        if isinstance(obj, torch.Tensor):
            return obj
        packed, shape, stride, offset = obj
        return packed.unpack().as_strided(shape, stride, offset)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "ActivationCompressor":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def compressed_trainer(step: StepConfig, variant: str, seed: int = 0) -> tuple:
    """A trainer for ``step`` with ``variant`` (a key of :data:`VARIANTS`) applied: returns
    the trainer, its :class:`ActivationCompressor` (or ``None``) and the batch. Raises
    :class:`~memlab.lenses.guard.HostMemoryError` before building a step host RAM cannot hold."""
    if variant not in VARIANTS:
        raise InputError(f"variant={variant!r}; allowed: {', '.join(VARIANTS)}")
    how = VARIANTS[variant]
    if isinstance(how, dict):
        step = replace(step, **how)
    check_host(step)  # refuse before building what host RAM cannot hold
    trainer = build_trainer(step, "cpu", seed=seed)
    comp = ActivationCompressor(trainer.model, how[0], granularity=how[1]) if isinstance(how, tuple) else None
    return trainer, comp, batch_to(make_batch(step, "cpu"), step)


def measure_compressed(step: StepConfig | None = None, variant: str = "int8 per-row", *,
                       budget: int | str | None = None, **overrides) -> MemoryReport:
    """One tracked steady-state step with ``variant``: packed copies made in forward are
    counted as activations, the originals they replace are freed."""
    step = resolve_step(step, **overrides)
    trainer, comp, batch = compressed_trainer(step, variant)
    report = measure_trainer(trainer, batch, budget=budget)
    report.notes.append(f"activations: {variant}")
    if comp is not None:
        report.notes.append(f"packed {comp.n_packed} storages ({comp.n_views} more views of "
                            f"them, {comp.n_skipped} tensors left alone): {comp.saved_bytes} "
                            f"bytes into {comp.packed_bytes}")
        comp.remove()
    return report


def gradients(step: StepConfig, variant: str = "none", seed: int = 0) -> list[torch.Tensor]:
    """The gradients of one forward/backward with ``variant`` (same weights and batch)."""
    trainer, comp, batch = compressed_trainer(step, variant, seed)
    grads = _grads_of(trainer, batch)
    if comp is not None:
        comp.remove()
    return grads


def gradient_error(step: StepConfig, variant: str, *, reference: list[torch.Tensor] | None = None,
                   seed: int = 0) -> float:
    """Relative error ``||g - g_ref|| / ||g_ref||`` of all gradients against the step without
    compression (``reference``: those gradients, if already computed)."""
    ref = reference if reference is not None else gradients(step, "none", seed)
    return relative_error(gradients(step, variant, seed), ref)


def _grads_of(trainer, batch) -> list[torch.Tensor]:
    """Gradients of one forward/backward (no optimizer step), then cleared."""
    with autocast_for(trainer.step_config.precision, trainer.device):
        loss = trainer.model(*batch)
    loss.backward()
    grads = [p.grad.detach().clone() for p in trainer.model.parameters()]
    trainer.optimizer.zero_grad(set_to_none=True)
    return grads


@dataclass(frozen=True)
class CompressedRun:
    """One variant's step in :func:`compare`, with memory and time as ratios to ``"none"``."""

    peak_bytes: int
    """Peak of one tracked step."""
    activation_bytes: int
    """Most activations alive at once."""
    grad_error: float
    """``||g - g_ref|| / ||g_ref||`` of all gradients against the step without compression."""
    seconds: float | None
    """Median untracked step time (``None`` when not timed)."""
    peak_ratio: float
    """Peak against ``"none"``'s."""
    activation_ratio: float
    """Activations against ``"none"``'s."""
    time_ratio: float | None
    """Step time against ``"none"``'s (``None`` when not timed)."""


def compare(step: StepConfig | None = None, variants: Iterable[str] = tuple(VARIANTS), *,
            repeats: int = 3, **overrides) -> dict[str, CompressedRun]:
    """For each variant: peak, most activations alive, gradient error and step time, with
    memory and time as ratios to ``"none"``.

    One trainer per variant serves all three: the gradients of its first forward/backward
    (same seed, weights and batch as the reference), then a warm-up and a tracked step, then
    untracked steps timed round-robin with the other variants.
    """
    step = resolve_step(step, **overrides)
    variants = list(dict.fromkeys(["none", *variants]))
    runs, measured, ref = {}, {}, None
    for v in variants:
        trainer, comp, batch = runs[v] = compressed_trainer(step, v)
        grads = _grads_of(trainer, batch)
        ref = grads if v == "none" else ref
        rep = measure_trainer(trainer, batch)
        measured[v] = (rep.peak_bytes, category_max(rep, "activations"), relative_error(grads, ref))
    timed = (time_steps({v: (trainer, batch) for v, (trainer, _, batch) in runs.items()}, repeats)
             if repeats else {})
    for _, comp, _ in runs.values():
        if comp is not None:
            comp.remove()
    base_peak, base_acts, _ = measured["none"]
    return {v: CompressedRun(peak, acts, err, timed.get(v), peak / base_peak, acts / base_acts,
                             timed[v] / timed["none"] if repeats else None)
            for v, (peak, acts, err) in measured.items()}


__all__ = ["ActivationCompressor", "compressed_trainer", "quantize", "measure_compressed", "gradients",
           "gradient_error", "compare", "CompressedRun", "MODES", "GRANULARITIES", "VARIANTS"]
