"""Emulating a CUDA card's autocast and kernels on CPU tensors, for the simulation.

:func:`emulate` installs CUDA's cast policy (:mod:`.autocast`) on the ``AutocastCPU`` key for
the duration of a simulation, so casts happen above autograd and autograd saves the cast
tensors as it would on the GPU, the weight-cast cache included (``cached_cast`` in
``autocast_mode.cpp``); ``rms_norm`` and ``dropout`` run as CUDA's fused kernels, and on a card without a
fused attention kernel for a dtype, ``scaled_dot_product_attention`` runs the ``math``
composite as that card would (:mod:`.kernels`).
"""
from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from typing import Iterator

import torch

from memlab.core.torch_private import (
    AUTOCAST_CPU_KEYS,
    FakeTensor,
    aten_ops_with_kernel,
    exclude_dispatch_keys,
    op_schema,
    tree_leaves,
    tree_map_only,
)
from memlab.policy.kernels import DTYPE_NAMES, rms_norm_fused, sdpa_backend
from memlab.policy.target import Target, get_target

_aten = torch.ops.aten


_lock = threading.Lock()
_active = 0
_library: torch.library.Library | None = None


def _op(name: str):
    base, _, overload = name.partition(".")
    return getattr(getattr(_aten, base), overload or "default")


def _eligible(t) -> bool:
    # is_autocast_eligible + is_eligible: a floating tensor, never double
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


class _CastCache:
    """``cached_cast`` of autocast_mode.cpp: casts of fp32 leaf weights to the autocast
    dtype are kept until the outermost autocast region exits."""

    def __init__(self):
        self._casts: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def cast(self, t, dtype: torch.dtype):
        if not _eligible(t) or t.dtype == dtype:
            return t
        lower = torch.get_autocast_dtype("cpu")
        if (dtype == lower and t.dtype == torch.float32 and t.requires_grad and t.is_leaf
                and not t._is_view() and torch.is_autocast_cache_enabled()):
            hit = self._casts.get(id(t))
            if hit is not None and hit[0]() is t:
                return hit[1]
            cast = t.to(dtype)
            self._casts[id(t)] = (weakref.ref(t), cast)
            return cast
        return t.to(dtype)

    def clear(self) -> None:
        self._casts.clear()


_cache = _CastCache()
_original_clear = torch.clear_autocast_cache


def _clear_autocast_cache() -> None:
    # torch.autocast.__exit__ calls torch.clear_autocast_cache() when the outermost region
    # ends; our casts follow the same lifetime
    _original_clear()
    _cache.clear()


def _lower_kernel(op):
    def kernel(*args, **kwargs):
        dtype = torch.get_autocast_dtype("cpu")
        with exclude_dispatch_keys(AUTOCAST_CPU_KEYS):
            args, kwargs = tree_map_only(torch.Tensor, lambda t: _cache.cast(t, dtype), (args, kwargs))
            return op(*args, **kwargs)
    return kernel


def _fp32_kernel(op):
    def kernel(*args, **kwargs):
        with exclude_dispatch_keys(AUTOCAST_CPU_KEYS):
            args, kwargs = tree_map_only(torch.Tensor, lambda t: _cache.cast(t, torch.float32),
                                         (args, kwargs))
            return op(*args, **kwargs)
    return kernel


def _promote_kernel(op):
    def kernel(*args, **kwargs):
        lower = torch.get_autocast_dtype("cpu")
        widest = lower
        for t in tree_leaves((args, kwargs)):
            if _eligible(t):
                if widest == torch.float32 or t.dtype == torch.float32:
                    widest = torch.float32
                elif t.dtype != lower:
                    raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
        with exclude_dispatch_keys(AUTOCAST_CPU_KEYS):
            args, kwargs = tree_map_only(torch.Tensor, lambda t: _cache.cast(t, widest), (args, kwargs))
            return op(*args, **kwargs)
    return kernel


def _is_fake(t) -> bool:
    return isinstance(t, FakeTensor)


def _set_opt_dtype_kernel(op, name: str):
    arguments = op_schema(op).arguments
    index = [a.name for a in arguments].index("dtype")
    kw_only = arguments[index].kwarg_only
    softmax = name in ("softmax.int", "log_softmax.int")

    def kernel(*args, **kwargs):
        with exclude_dispatch_keys(AUTOCAST_CPU_KEYS):
            if not _eligible(args[0]):
                return op(*args, **kwargs)
            given = kwargs.get("dtype") if (kw_only or len(args) <= index) else args[index]
            if given is not None:
                return op(*args, **kwargs)
            x = args[0]
            if softmax and x.dtype == torch.float16 and _is_fake(x):
                # SoftMax.cpp: CUDA runs half -> float in one kernel (half_to_float), whose
                # backward returns a half gradient; CPU kernels lack it, fake tensors do not.
                fused = _aten._softmax if name == "softmax.int" else _aten._log_softmax
                return fused.default(x, args[1], True)
            if kw_only or len(args) <= index:
                kwargs = {**kwargs, "dtype": torch.float32}
            else:
                args = (*args[:index], torch.float32, *args[index + 1:])
            return op(*args, **kwargs)
    return kernel


def _append_dtype_kernel(target_name: str):
    target = _op(target_name)

    def kernel(*args, **kwargs):
        with exclude_dispatch_keys(AUTOCAST_CPU_KEYS):
            out_type = torch.float32 if _eligible(args[0]) else args[0].dtype
            return target(*args, **kwargs, dtype=out_type)
    return kernel


def _banned_kernel(*args, **kwargs):
    raise RuntimeError("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe "
                       "to autocast; use binary_cross_entropy_with_logits (autocast_mode.cpp)")


class _FusedRMSNorm(torch.autograd.Function):
    """``_fused_rms_norm`` as CUDA registers it: one kernel, saving input and ``rstd``."""

    @staticmethod
    def forward(ctx, x, shape, weight, eps):
        if _is_fake(x):
            # the CUDA kernel allocates its two outputs and nothing else
            k = len(shape)
            acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
            rstd = x.new_empty((*x.shape[:x.dim() - k], *([1] * k)), dtype=acc)
        else:
            out, rstd = _aten._fused_rms_norm.default(x, shape, weight, eps)
        ctx.save_for_backward(x, rstd, weight)
        ctx.shape, ctx.eps = shape, eps
        return out

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        want_w = weight is not None and ctx.needs_input_grad[2]
        if _is_fake(x):
            gx, gw = _aten._fused_rms_norm_backward.default(grad, x, ctx.shape, rstd, weight,
                                                             [True, want_w])
        else:  # the CPU build has no backward kernel for it: differentiate the composite
            with torch.enable_grad():
                xd = x.detach().requires_grad_()
                wd = weight.detach().requires_grad_() if want_w else weight
                y = _aten._fused_rms_norm.default(xd, ctx.shape, wd, ctx.eps)[0]
                grads = torch.autograd.grad(y, [xd, wd] if want_w else [xd], grad)
            gx, gw = grads[0], (grads[1] if want_w else None)
        return gx, None, gw if want_w else None, None


def _channels_last(x: torch.Tensor) -> bool:
    # Tensor::suggest_memory_format: channels-last strides on a tensor that is not contiguous
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    return fmt is not None and not x.is_contiguous() and x.is_contiguous(memory_format=fmt)


def _rms_norm_kernel(x, normalized_shape, weight=None, eps=None):
    fused = (not x.is_complex() and not _channels_last(x)
             and (weight is None or weight.dtype == x.dtype))
    if not fused:  # layer_norm.cpp: mixed dtypes, complex, channels-last take the composite
        return _aten.rms_norm.default.decompose(x, normalized_shape, weight, eps)
    return _FusedRMSNorm.apply(x, list(normalized_shape), weight, eps)


def _dropout_kernel(x, p, train):
    """``dropout`` as CUDA runs it (``Dropout.cpp``: the fused kernel where ``0 < p < 1``):
    ``native_dropout``, whose backward keeps a bool mask, not CPU's noise in the input's dtype."""
    if train and 0 < p < 1 and x.numel() > 0:
        return _aten.native_dropout.default(x, p, train)[0]
    return _aten.dropout.default.decompose(x, p, train)


def _sdpa_kernel(target: Target):
    """``scaled_dot_product_attention`` as the card dispatches it: the ``math`` composite
    where it has no fused kernel for the inputs' dtype (bf16 below sm80), else torch's own
    choice on the CPU (whose saved statistics :class:`TargetAccounting` sizes as the card's)."""
    def kernel(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        backend = sdpa_backend(target, q.element_size(), q.shape[-1], dtype=DTYPE_NAMES.get(q.dtype))
        if backend == "math":
            return _aten._scaled_dot_product_attention_math.default(
                q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]
        return _aten.scaled_dot_product_attention.default.decompose(
            q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    return kernel


def _install(target: Target) -> torch.library.Library:
    lib = torch.library.Library("aten", "IMPL")
    policy = target.autocast
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
        for name in sorted(policy.ops):
            rule = policy.rule(name)
            if rule == "fp32_append_dtype":
                kernel = _append_dtype_kernel(dict(policy.fp32_append_dtype)[name])
            elif rule == "banned":
                kernel = _banned_kernel
            elif rule == "fp32_set_opt_dtype":
                kernel = _set_opt_dtype_kernel(_op(name), name)
            else:
                make = {"lower_precision_fp": _lower_kernel, "fp32": _fp32_kernel,
                        "promote": _promote_kernel}[rule]
                kernel = make(_op(name))
            lib.impl(name, kernel, "AutocastCPU")
        # ops CPU autocast casts and the target does not: no cast at all
        for name in sorted(aten_ops_with_kernel("AutocastCPU") - policy.ops):
            lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
        if rms_norm_fused(target.name):
            lib.impl("rms_norm", _rms_norm_kernel, "AutogradCPU")
        if target.is_cuda:
            lib.impl("dropout", _dropout_kernel, "AutogradCPU")
        if any(target.card.sdpa_kernels(2, dtype)[0] == "math" for dtype in ("bf16", "fp16")):
            lib.impl("scaled_dot_product_attention", _sdpa_kernel(target), "AutogradCPU")
    return lib


@contextlib.contextmanager
def emulate(target: Target | str) -> Iterator[Target]:
    """Run CPU tensors under a target's autocast policy and kernels while inside.

    For ``cuda``: CUDA's cast lists replace CPU autocast's on the ``AutocastCPU`` key (casts
    recorded by autograd, weight casts cached until the outermost autocast exits) and
    ``rms_norm`` runs as the fused CUDA kernel. Everything is removed on exit, also after an
    exception; for ``cpu`` nothing changes. The overrides are process-wide while active.
    """
    global _active, _library
    target = get_target(target) if isinstance(target, str) else target
    if not target.is_cuda:
        yield target
        return
    with _lock:
        _active += 1
        if _active == 1:
            try:
                _library = _install(target)
            except BaseException:
                _active -= 1
                raise
            torch.clear_autocast_cache = _clear_autocast_cache
    try:
        yield target
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                torch.clear_autocast_cache = _original_clear
                _library._destroy()
                _library = None
                _cache.clear()


__all__ = ["emulate"]
