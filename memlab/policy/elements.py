"""The device rules as element sizes, for the closed-form estimate: bytes per element each
kind of tensor takes under a precision on a target (its autocast list, :mod:`.autocast`, and
its kernels, :mod:`.kernels`). ``target`` is ``"cuda"``/``"cpu"`` or a
:class:`~memlab.policy.Target`."""
from __future__ import annotations

from memlab.core.precision import precision_bytes
from memlab.policy.autocast import AUTOCAST
from memlab.policy.kernels import layer_norm_stat_bytes, rms_norm_fused, target_name


def op_bytes(target, op: str, input_bytes: int, precision: str,
             explicit_dtype_bytes: int | None = None) -> int:
    """Bytes per element an op computes (and returns) in on a target, by its autocast list."""
    _, _, lower = precision_bytes(precision)
    if lower is None:
        return input_bytes if explicit_dtype_bytes is None else explicit_dtype_bytes
    return AUTOCAST[target_name(target)].run_dtype(op, input_bytes, lower, explicit_dtype_bytes)


def attention_probs_bytes(target, precision: str) -> int:
    """Bytes per score that materialised attention (``softmax(q k^T) @ v``) keeps for
    backward: softmax's output in the dtype softmax runs in, plus the cast copy the
    following matmul saves when that dtype is not the matmul's."""
    _, compute, lower = precision_bytes(precision)
    probs = op_bytes(target, "softmax.int", compute, precision)
    matmul_in = op_bytes(target, "matmul", probs, precision)
    return probs + (matmul_in if matmul_in != probs else 0)


def cross_entropy_moments(target, precision: str, upcast_logits: bool = False) -> list[tuple[str, int, int]]:
    """Bytes per logit alive at each moment of the loss, as ``(moment, saved, scratch)``:
    what the forward saved and is still held, and the other tensors in flight.

    ``F.cross_entropy`` is ``log_softmax(x, dtype=x.dtype)`` then ``nll_loss``
    (``LossNLL.cpp``). Autocast may run it whole in fp32 (CPU's list has
    ``cross_entropy_loss``: ``x`` is an fp32 copy of the logits), or run log_softmax in the
    logits' dtype (its dtype is explicit, so ``fp32_set_opt_dtype`` keeps it) and cast its
    output to fp32 for ``nll_loss`` (CUDA), which saves that copy.

    ``upcast_logits``: the model casts its logits to fp32 before the loss and drops its
    16-bit ones (``GPTConfig.logits_fp32``, torchtune's ``.float()``): the loss runs on the
    fp32 copy alone, and its gradient is cast back at the end.

    Returns:
        ``[(moment, saved bytes per logit, scratch bytes per logit), ...]`` in the loss's order.
    """
    _, logits, _ = precision_bytes(precision)
    # the caller's 16-bit logits are gone once cast; its fp32 ones are the loss's input
    held = 0 if upcast_logits and logits != 4 else logits
    x = 4 if upcast_logits else op_bytes(target, "cross_entropy_loss", logits, precision)
    lsm = op_bytes(target, "log_softmax.int", x, precision, explicit_dtype_bytes=x)
    nll = op_bytes(target, "nll_loss", lsm, precision)
    copy = nll if nll != lsm else 0     # a cast copy for nll_loss, saved by it
    upcast = x if x != logits else 0    # the composite's own input cast
    moments = [("loss forward", lsm + copy, held + upcast),  # at nll_loss: logits still held
               ("loss backward", lsm + copy, nll)]             # NllLossBackward: its gradient
    if copy:
        moments.append(("loss backward, cast", lsm, nll + lsm))   # gradient cast back
    moments.append(("log-softmax backward", lsm, 2 * lsm))        # gradients in and out
    if upcast:
        moments.append(("loss input cast backward", 0, x + logits))
    return moments


def activation_copies(precision: str, consumers: int) -> int:
    """Copies of an fp32 activation that matmuls reading it save: under autocast each
    call casts its input anew (``cached_cast`` caches only leaf tensors that require grad,
    i.e. weights), so one per consumer; without autocast the tensor itself, once."""
    return consumers if precision_bytes(precision)[2] is not None else 1


def norm_saves(target, norm: str, input_bytes: int, fp32_python: bool = False) -> tuple[bool, int, int]:
    """What a norm keeps for backward beyond its output: ``(keeps its input, bytes per
    element, bytes per row)``. LayerNorm: its input, mean and rstd. RMSNorm fused (CUDA): its
    input and an fp32 rstd. RMSNorm composite (CPU): ``x * rstd`` and rstd in fp32, and
    the input itself or, for a 16-bit input, its fp32 upcast instead. ``fp32_python``
    (``GPTConfig.norm_fp32``, torchtune's RMSNorm, on any target): the fp32 upcast (the input
    itself when it is fp32), rstd in fp32, and ``x * rstd`` cast back to the input's dtype."""
    if norm == "rmsnorm" and fp32_python:
        return (True, 4, 4) if input_bytes == 4 else (False, 4 + input_bytes, 4)
    if norm == "layernorm":
        return True, 0, 2 * layer_norm_stat_bytes(target, input_bytes)
    if rms_norm_fused(target):
        return True, 0, 4
    if input_bytes == 2:
        return False, 4 + 4, 4
    return True, 4, 4


__all__ = ["activation_copies", "attention_probs_bytes", "cross_entropy_moments", "norm_saves",
           "op_bytes", "precision_bytes"]
