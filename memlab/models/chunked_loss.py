"""The loss spike and its fix: linear + cross-entropy over chunks of tokens.

A language model's last two ops, ``logits = h @ W^T`` and ``cross_entropy(logits, y)``, make
the largest tensors of a small model's step: ``tokens x vocab`` logits, their fp32
log-softmax (saved for backward), and in backward the gradients flowing through both, each
``tokens x vocab`` again. With ``t`` tokens and vocabulary ``V`` the plain loss holds about::

    t * V * (c + 4)        in forward: logits (c bytes each) and the fp32 log-softmax
    t * V * (4 + 4 + 4)    in the log-softmax's backward: its saved output, the gradient
                           flowing in, and the gradient it produces (then the logits
                           gradient, c bytes each, replaces the last two)

where ``c`` is the compute dtype's size (4 in fp32, 2 under bf16 autocast); measured on CPU
the second is the step's peak for a small model with a 32000-word vocabulary
(tests/test_chunked_loss.py). For 8 x 2048 tokens and Llama 3's 128256-word vocabulary the
fp32 log-softmax alone is 8.4 GB.

:func:`linear_cross_entropy` computes the same loss and the same gradients without ever
holding more than ``chunk_size`` rows of logits. Forward runs the head matmul one chunk of
tokens at a time and keeps only each token's log-sum-exp (4 bytes per token); backward
recomputes each chunk's logits, turns them into ``softmax - one_hot`` in place, and adds the
chunk's share to the hidden-state and head-weight gradients. The recomputation costs one
more head matmul per step; the memory saved is the ``t x V`` tensors above.

This is the idea of Cut Cross-Entropy (Wijmans et al. 2024, "Cut Your Losses in
Large-Vocabulary Language Models", arXiv:2411.09009: the loss as the target logit minus a
log-sum-exp computed blockwise, logits recomputed in backward, never in global memory) and of
Liger Kernel's ``FusedLinearCrossEntropy`` (``linkedin/Liger-Kernel``,
``src/liger_kernel/ops/fused_linear_cross_entropy.py``: chunks of ``BT`` rows, each chunk's
logits gradient computed right after its loss). Liger computes the gradients already in
forward and keeps them until backward (no recomputation, but ``t x d`` and ``V x d`` gradient
buffers held across the step); here they are computed in backward, as in Cut Cross-Entropy,
so forward keeps nothing larger than ``t`` floats. Both use fused GPU kernels; this one is
plain PyTorch, so it runs on CPU and under ``FakeTensorMode`` and its memory shows in
:class:`~memlab.tracking.tracker.MemoryTracker` op by op.

Precision follows the plain path: under autocast the head matmul runs in the autocast dtype
(its logits rounded to it, as ``nn.Linear`` would) and the log-sum-exp in fp32, as autocast
runs ``log_softmax``. Without autocast the matmul runs in the hidden states' dtype and the
log-sum-exp in fp32 (the plain path keeps bf16 logits in bf16 there: chunked is slightly more
accurate, and not bitwise equal). The head-weight gradient is accumulated over chunks in the
weight's dtype (as Liger does by default).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from memlab.core.errors import InputError
from memlab.core.precision import precision_bytes

__all__ = ["chunked_loss_bytes", "linear_cross_entropy", "plain_linear_cross_entropy", "loss_spike_bytes",
           "GradientCheck", "check_linear_cross_entropy"]


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the head matmul runs in: the autocast dtype if autocast is on (as for
    ``nn.Linear``), else the hidden states' own."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T`` against ``target``, chunk by chunk.

    Saved for backward: the hidden states in the compute dtype (the plain path's
    ``nn.Linear`` saves the same), the weight (a parameter: no new memory), the targets and
    one fp32 log-sum-exp per token.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                chunk_size: int, ignore_index: int, dtype: torch.dtype) -> torch.Tensor:
        # Casts are explicit, so the chunk loop itself runs with autocast off: the same ops
        # in forward and in the recomputation of backward.
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            n = h.shape[0]
            lse = torch.empty(n, dtype=torch.float32, device=h.device)
            picked = torch.empty(n, dtype=torch.float32, device=h.device)
            safe_target = target.clamp(min=0)  # ignored rows gather any column, masked below
            for start in range(0, n, chunk_size):
                end = min(start + chunk_size, n)
                logits = (h[start:end] @ w.t()).float()
                picked[start:end] = logits.gather(1, safe_target[start:end, None]).squeeze(1)
                # log-sum-exp in place (torch.logsumexp would allocate two more chunks)
                top = logits.amax(dim=-1)
                lse[start:end] = logits.sub_(top[:, None]).exp_().sum(dim=-1).log_().add_(top)
                del logits
            keep = target != ignore_index
            count = keep.sum()
            loss = torch.where(keep, lse - picked, 0.0).sum() / count
        ctx.save_for_backward(h, weight, target, lse, count)
        ctx.chunk_size, ctx.ignore_index, ctx.dtype = chunk_size, ignore_index, dtype
        ctx.hidden_dtype = hidden.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        h, weight, target, lse, count = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = grad_w = None
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(ctx.dtype)
            n = h.shape[0]
            # d loss / d logits = (softmax - one_hot) * grad_loss / count on kept rows
            scale = (grad_loss.float() / count).reshape(1)
            keep = (target != ctx.ignore_index).float()
            safe_target = target.clamp(min=0)
            if need_h:
                grad_h = torch.empty(h.shape, dtype=ctx.hidden_dtype, device=h.device)
            if need_w:
                grad_w = torch.zeros_like(weight)
            for start in range(0, n, ctx.chunk_size):
                end = min(start + ctx.chunk_size, n)
                g = (h[start:end] @ w.t()).float()
                g.sub_(lse[start:end, None]).exp_()  # softmax, from the saved log-sum-exp
                g.scatter_add_(1, safe_target[start:end, None], -torch.ones_like(g[:, :1]))
                g.mul_((keep[start:end] * scale)[:, None])
                g = g.to(ctx.dtype)
                if need_h:
                    grad_h[start:end] = g @ w
                if need_w:
                    grad_w.add_(g.t() @ h[start:end])
                del g
        return grad_h, grad_w, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                         chunk_size: int = 1024, ignore_index: int = -100) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T, target)`` (mean over kept tokens) without the
    ``[tokens, vocab]`` logits: at most ``chunk_size`` rows of them exist at a time, in
    forward and in backward.

    ``hidden`` is ``(tokens, d)``, ``weight`` the LM head's ``(vocab, d)``, ``target``
    ``(tokens,)`` class indices; targets equal to ``ignore_index`` are left out of the mean,
    as in ``F.cross_entropy``.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise InputError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise InputError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be "
                         f"(tokens, d) and (vocab, d) with the same d")
    if target.shape != hidden.shape[:1] or target.is_floating_point():
        raise InputError(f"target {tuple(target.shape)} ({target.dtype}) must hold one class "
                         f"index per token: shape ({hidden.shape[0]},), an integer dtype")
    return _LinearCrossEntropy.apply(hidden, weight, target, chunk_size, ignore_index,
                                     _compute_dtype(hidden))


def plain_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                               ignore_index: int = -100) -> torch.Tensor:
    """The reference: full logits, then ``F.cross_entropy`` (what ``GPT`` does with
    ``loss="plain"``)."""
    return F.cross_entropy(F.linear(hidden, weight), target, ignore_index=ignore_index)


def loss_spike_bytes(tokens: int, vocab: int, precision: str = "fp32") -> int:
    """Bytes of the two ``tokens x vocab`` tensors the plain loss holds together in forward
    and :func:`linear_cross_entropy` never makes: the logits (4 bytes each in fp32, 2 under
    bf16/fp16 autocast or pure bf16) and the fp32 log-softmax (4 bytes, 2 in pure bf16).
    A lower bound of what chunking saves at a peak inside the loss."""
    param, logits, _ = precision_bytes(precision)
    return tokens * vocab * (logits + param)  # the log-softmax is in the weights' dtype


def chunked_loss_bytes(vocab: int, d_model: int, chunk: int, tokens: int, *, compute: int, hidden: int,
                       weight: int, head_grad: bool = True) -> dict[str, dict[str, float]]:
    """Bytes :func:`linear_cross_entropy` holds beyond the activations at its two largest
    moments, by category, read off its code: with ``c`` the head matmul's element size
    (``compute``: the autocast dtype, else the hidden states'), ``H`` the hidden states'
    (``hidden``), ``W`` the weight's (``weight``) and ``n = min(chunk, tokens)`` rows per chunk:

    * forward, at a chunk's upcast: the hidden states passed in (``tH``, when ``h`` is a cast
      copy of them), the cast head weight (``VdC`` unless ``W = c``), one chunk of logits and
      its fp32 copy (``nV(c + 4)``, or ``4nV`` in fp32) and a float per token;
    * backward: the weight's gradient (``VdW``, category gradients), the hidden states'
      gradient (``tdH``), the cast weight, and a chunk's logits being turned into their
      gradient (``nV(c + 4)`` at the casts, or a chunk and the ``V x d`` product of its
      gradient with the hidden states, whichever is larger), plus 12 bytes per token.

    The plain loss's ``t x V`` tensors (:func:`memlab.policy.cross_entropy_moments`) never
    exist: the saving is the loss spike, at the price of the head matmul run twice.
    ``head_grad=False`` (a frozen head, as under LoRA): backward makes no weight gradient and
    no ``V x d`` product (``needs_input_grad[1]`` is false); a chunk's logits and their
    ``n x d`` product with the weight remain.

    Args:
        vocab, d_model: the head's shape; chunk: rows per chunk; tokens: rows of the step.
        compute, hidden, weight: element sizes in bytes (above).
        head_grad: whether the head weight trains.

    Returns:
        ``{"chunked loss forward": {...}, "chunked loss backward": {...}}``: bytes by category.
    """
    v, dm, c, hid, w = vocab, d_model, compute, hidden, weight
    n = min(chunk, tokens)
    cast_hidden = tokens * dm * hid if hid != c else 0
    cast_weight = v * dm * c if w != c else 0
    logits = n * v * (c + 4) if c != 4 else 4 * n * v
    if not head_grad:  # a chunk's logits turned into their gradient, then its product with the weight
        back = max(logits, n * v * c + n * dm * c) if c != 4 else 4 * n * v + 4 * n * dm
    else:
        back = max(logits, n * v * c + v * dm * c) if c != 4 else 4 * n * v + 4 * v * dm
    return {"chunked loss forward": dict(temporaries=cast_hidden + cast_weight + logits + 4 * tokens),
            "chunked loss backward": dict(gradients=v * dm * w if head_grad else 0,
                                          temporaries=cast_weight + tokens * dm * hid + back + 12 * tokens)}


@dataclass(frozen=True)
class GradientCheck:
    """How far a loss function's value and gradients are from the plain reference's:
    each error is ``max |candidate - reference| / max |reference|``."""

    loss_error: float
    hidden_error: float
    weight_error: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return max(self.loss_error, self.hidden_error, self.weight_error) <= self.tolerance

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (f"{verdict}: relative error loss {self.loss_error:.2e}, d hidden "
                f"{self.hidden_error:.2e}, d weight {self.weight_error:.2e} "
                f"(tolerance {self.tolerance:.0e})")


def _relative_error(candidate: torch.Tensor | None, reference: torch.Tensor) -> float:
    if candidate is None or candidate.shape != reference.shape:
        return float("inf")
    scale = reference.detach().float().abs().max().clamp_min(1e-30)
    return float((candidate.detach().float() - reference.detach().float()).abs().max() / scale)


def check_linear_cross_entropy(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], *,
                               tokens: int = 96, d_model: int = 32, vocab: int = 500,
                               precision: str = "fp32", tolerance: float | None = None,
                               seed: int = 0) -> GradientCheck:
    """Compare ``fn(hidden, weight, target)`` with :func:`plain_linear_cross_entropy` on the
    same random inputs: loss, ``d loss / d hidden`` and ``d loss / d weight``.

    ``precision`` is ``"fp32"`` or ``"bf16"`` (both run under CPU bf16 autocast). The
    default tolerance is 1e-5 in fp32 (summation order only) and 2e-2 under bf16 (8
    mantissa bits: one rounding is up to 2^-8 = 3.9e-3 relative, and a sum of roundings
    a few of those).
    """
    if precision not in ("fp32", "bf16"):
        raise InputError(f"precision={precision!r}; allowed: fp32, bf16")
    tol = tolerance if tolerance is not None else (1e-5 if precision == "fp32" else 2e-2)
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, d_model, generator=g)
    weight = torch.randn(vocab, d_model, generator=g) * d_model ** -0.5
    target = torch.randint(0, vocab, (tokens,), generator=g)
    results = []
    for f in (fn, plain_linear_cross_entropy):
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = f(h, w, target)
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad))
    (lc, hc, wc), (lr, hr, wr) = results
    return GradientCheck(_relative_error(lc, lr), _relative_error(hc, hr),
                         _relative_error(wc, wr), tol)
