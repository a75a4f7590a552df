"""The bytes a training step's elementwise ops read and write: counted on the step, and in closed form.

:mod:`memlab.time.flops` counts the matmuls and attention kernels; everything else forward and
backward run is elementwise work: norms, activation functions, residual adds, autocast's
casts, bias gradients (a sum over tokens), the loss's log-softmax, the embedding's gradient,
gradient accumulation. It does few FLOPs per byte, so a GPU runs it at its memory bandwidth
(the "memory-bound operators" of Ivanov et al. 2021, "Data Movement Is All You Need",
sec. 3: on BERT they take a third of the runtime while doing 0.2% of the FLOPs). On a CPU the
activation functions (``tanh``-GELU, SiLU, softmax) are compute-bound instead: their
elements are counted apart, for :mod:`memlab.time.step_time` to time at a measured rate.

The rule, op by op (the optimizer and ``zero_grad`` are the engine part of
:mod:`memlab.time.step_time`, not counted here):

* an op reads every tensor it is given, whole, and writes every tensor it returns;
* ops that pick (``embedding``, ``gather``, ``nll_loss_forward``) read only what they pick,
  ``nll_loss_backward`` reads its gradient and targets (its ``self`` gives a shape), and fills
  (``zero_``, ``zeros_like``, ...) only write;
* views, ``empty`` allocations and the matmul and attention kernels (FLOPs) move nothing here.

Over 500 lines because the closed form writes out every op of every block variant (norms,
MLPs, positions, attention kernels, losses) beside the counter it is checked against; split,
a reader would match an op's bytes across files.

Two ways to the number, each checking the other (``tests/test_elementwise.py``):

* **Counted** (:func:`count_elementwise`): the step runs under :class:`ElementwiseCounter`,
  on fake tensors or real ones, filed by part as :class:`memlab.time.flops.PhaseFlopCounter` files
  FLOPs (forward, backward, recompute).
* **Closed form** (:func:`gpt_elementwise`): memlab's GPT block written out op by op in the
  element sizes of the step's precision on a target (:mod:`memlab.policy`); a Hugging Face
  decoder's shape through the same op list at its widths (:func:`decoder_elementwise`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch
from torch.utils import flop_counter

from memlab.core.errors import InputError
from memlab.core.torch_private import TorchDispatchMode, in_backward, tree_leaves
from memlab.models.decoder_shape import DecoderShape
from memlab.models.gpt_unet import GPTConfig
from memlab.policy import layer_norm_stat_bytes, op_bytes, precision_bytes, rms_norm_fused
from memlab.time.flops import CPU_SDPA, PARTS, PhaseFlopCounter, StepFlops, run_counted_step

aten = torch.ops.aten

#: activation functions and their gradients: on a CPU each element costs a ``tanh``/``exp``
#: (compute-bound), on a GPU they stream at HBM speed like any elementwise op
ACTIVATIONS = frozenset({
    "gelu", "gelu_backward", "silu", "silu_backward", "sigmoid", "sigmoid_backward", "tanh",
    "tanh_backward", "_softmax", "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data",
    "exp", "exp_",
})
#: ops that write their output and read nothing of their input but its shape
WRITE_ONLY = frozenset({"zero_", "fill_", "zeros_like", "ones_like", "full_like", "zeros", "ones", "full"})
#: ops that move nothing: allocations without a write, and aliases not flagged as views
NO_TRAFFIC = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                        "_unsafe_view", "lift_fresh"})


@dataclass(frozen=True)
class ElementwiseWork:
    """Bytes the elementwise ops of one step read and write, by part (forward, backward,
    recompute), and of them the ``activation_bytes`` and ``activation_elements`` (outputs) of
    :data:`ACTIVATIONS`; ``source``: ``"counted"`` or ``"formula"``."""

    forward: int
    backward: int
    recompute: int = 0
    activation_bytes: int = 0
    activation_elements: int = 0
    source: str = "formula"
    notes: tuple[str, ...] = field(default=(), compare=False)
    #: of ``forward + backward`` and of ``recompute``, the bytes of the ops over the d-wide residual
    #: stream (norms, their casts, residual adds and their gradients): the ops Megatron-LM's tensor
    #: parallelism leaves unsplit, which every TP rank runs whole without sequence parallelism
    #: (Korthikanti et al. 2022, sec. 4.2.1-4.2.2); the MLP's and attention's ops are split
    residual: int = field(default=0, compare=False)
    residual_recompute: int = field(default=0, compare=False)

    @property
    def bytes(self) -> int:
        """Every byte the step's elementwise ops move."""
        return self.forward + self.backward + self.recompute

    def to_dict(self) -> dict:
        return {"forward": self.forward, "backward": self.backward, "recompute": self.recompute,
                "bytes": self.bytes, "activation_bytes": self.activation_bytes,
                "activation_elements": self.activation_elements, "source": self.source}


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def op_traffic(name: str, args: tuple, kwargs: dict, out) -> int:
    """Bytes one op reads and writes, by the module doc's rule."""
    written = sum(_size(t) for t in _tensors(out))
    if name in WRITE_ONLY:             # fills: their input gives a shape (or is overwritten)
        return written
    if name == "embedding":           # (weight, indices): the picked rows, as many as written
        return _size(args[1]) + 2 * written
    if name == "gather":              # (self, dim, index): one element picked per index
        return _size(args[2]) + 2 * written
    if name == "nll_loss_forward":    # (self, target, ...): one log-probability per target
        return _size(args[1]) + args[1].numel() * args[0].element_size() + written
    if name == "nll_loss_backward":   # (grad, self, target, weight, ..., total_weight)
        return sum(_size(t) for t in _tensors((args[0], args[2:], kwargs))) + written
    return sum(_size(t) for t in _tensors((args, kwargs))) + written


class ElementwiseCounter(TorchDispatchMode):
    """Counts the elementwise bytes of the ops run inside it, by part (module doc).

    Use as a context manager around a whole step; read :meth:`work`. An op outside the
    autograd engine with grad mode off is an autograd Function's forward when more of the step
    follows it, else the optimizer's or ``zero_grad``'s: not counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.kernels = set(flop_counter.flop_registry) | set(CPU_SDPA)
        self.counts = dict.fromkeys(PARTS, 0)
        self.activation_bytes = self.activation_elements = 0
        self.pending = (0, 0, 0)  # grad-mode-off ops outside backward: (bytes, activation bytes, elements)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.overloadpacket in self.kernels or func in self.kernels or func.is_view \
                or name in NO_TRAFFIC or not _tensors(out):
            return out
        backward = in_backward()
        n = op_traffic(name, args, kwargs, out)
        act = (n, sum(t.numel() for t in _tensors(out))) if name in ACTIVATIONS else (0, 0)
        if not backward and not torch.is_grad_enabled():
            # an autograd Function's forward, or the optimizer's step: which one, the next op says
            b, ab, ae = self.pending
            self.pending = (b + n, ab + act[0], ae + act[1])
            return out
        b, ab, ae = self.pending  # more of the step follows: what was pending was a forward's
        self.pending = (0, 0, 0)
        self.counts["forward"] += b
        part = ("recompute" if torch.is_grad_enabled() else "backward") if backward else "forward"
        self.counts[part] += n
        self.activation_bytes += ab + act[0]
        self.activation_elements += ae + act[1]
        return out

    def work(self) -> ElementwiseWork:
        """What was counted, as :class:`ElementwiseWork` (``source="counted"``)."""
        c = self.counts
        return ElementwiseWork(c["forward"], c["backward"], c["recompute"], self.activation_bytes,
                               self.activation_elements, "counted")


def count_elementwise(step, *, fake: bool = True, device: str = "cpu") -> ElementwiseWork:
    """Count one steady-state step of ``step`` (a :class:`memlab.step.training_step.StepConfig`) with
    :class:`ElementwiseCounter`, on fake tensors (the default) or a real model on ``device``.

    Returns:
        :class:`ElementwiseWork` with ``source="counted"``.
    """
    counter, = run_counted_step(step, ElementwiseCounter(), fake=fake, device=device)
    return counter.work()


# ------------------------------------------------------------------------------------------
# Closed form
# ------------------------------------------------------------------------------------------
class _Ledger:
    """Bytes and activation elements by part, added op by op."""

    def __init__(self) -> None:
        self.parts = dict.fromkeys(PARTS, 0)
        self.residual = dict.fromkeys(PARTS, 0)
        self.activation_bytes = self.activation_elements = 0

    def op(self, part: str, nbytes: float, activation_elements: float = 0, *, residual: bool = False) -> None:
        self.parts[part] += int(nbytes)
        if residual:  # an op over the d-wide residual stream: outside tensor parallelism's split
            self.residual[part] += int(nbytes)
        if activation_elements:
            self.activation_bytes += int(nbytes)
            self.activation_elements += int(activation_elements)


@dataclass(frozen=True)
class _Sizes:
    """Bytes per element of a step's tensors (module doc of :mod:`memlab.lenses.estimate`)."""

    param: int       # weights, their gradients, the embeddings' outputs, the residual stream
    compute: int     # matmul outputs, attention, the MLP's activations
    lower: int | None  # autocast's dtype, None when off
    norm: int        # a norm's output
    target: object
    precision: str

    @property
    def casts_norm(self) -> bool:
        """Each matmul reading a norm's output casts it (autocast, a norm in another dtype)."""
        return self.lower is not None and self.norm != self.compute


def _norm_forward(led: _Ledger, part: str, cfg: GPTConfig, t: int, z: _Sizes) -> None:
    d, r, p = cfg.d_model, z.param, z.param
    weights = d * p * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
    if cfg.norm == "layernorm":
        led.op(part, t * d * r + weights + t * d * z.norm + 2 * t * layer_norm_stat_bytes(z.target, r),
               residual=True)
    elif rms_norm_fused(z.target):
        led.op(part, t * d * r + weights + t * d * z.norm + 4 * t, residual=True)
    else:  # the composite (rms_norm_symint): in fp32, a 16-bit input upcast and cast back
        up = 6 * t * d if r == 2 else 0
        led.op(part, up + 2 * t * d * 4 + (t * d * 4 + 4 * t) + 2 * 4 * t + 2 * 4 * t
               + (2 * t * d * 4 + 4 * t) + (2 * t * d * 4 + weights) + up, residual=True)


def _norm_backward(led: _Ledger, cfg: GPTConfig, t: int, z: _Sizes) -> None:
    d, r, p = cfg.d_model, z.param, z.param
    weights = d * p * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
    if cfg.norm == "layernorm":
        stats = 2 * t * layer_norm_stat_bytes(z.target, r)
        led.op("backward", t * d * z.norm + t * d * r + stats + weights + t * d * r + weights, residual=True)
    elif rms_norm_fused(z.target):
        led.op("backward", t * d * z.norm + t * d * r + 4 * t + weights + t * d * r + weights, residual=True)
    else:  # the composite's autograd graph, op by op (fp32 inside)
        e = t * d * 4
        casts = (6 * t * d + 6 * t * d + 6 * d) if r == 2 else 0   # grad in, grad out, weight grad
        led.op("backward", casts + 3 * 3 * e + (2 * e + weights) + (e + 4 * d) + (2 * e + 4 * t) + (e + 4 * t)
               + 2 * 4 * t + 2 * 4 * t + 3 * 4 * t + 2 * e + 2 * e + 2 * e + 3 * e, residual=True)


def _weight_casts(led: _Ledger, part: str, z: _Sizes, elements: int) -> None:
    """Autocast's cast of the weights a matmul reads (cached for the forward, or recompute)."""
    if z.lower is not None:
        led.op(part, elements * (z.param + z.lower))


def _block_matmul_weights(cfg: GPTConfig) -> list[tuple[int, int]]:
    """(weight elements, bias elements) of one block's Linears."""
    d, f, hd = cfg.d_model, cfg.hidden, cfg.head_dim
    qkv = (cfg.n_head + 2 * cfg.kv_heads) * hd
    bias = int(cfg.bias)
    mlp = [(d * f, f * bias)] * (2 if cfg.mlp == "swiglu" else 1) + [(f * d, d * bias)]
    return [(d * qkv, qkv * int(cfg.has_qkv_bias)), (d * d, d * bias)] + mlp


def _repeats(cfg: GPTConfig) -> bool:
    """Whether the core repeats k and v for its query heads (``repeat_interleave``): grouped
    heads with ``gqa="repeat"``, or naive attention, which always does."""
    return cfg.kv_heads < cfg.n_head and (cfg.gqa == "repeat" or cfg.attention == "naive")


def _folds(cfg: GPTConfig, rows: int) -> bool:
    """Whether naive attention's batched matmuls copy their 4-d inputs to fold batch and heads
    into one dimension (a view cannot, unless the batch or the heads are one)."""
    return rows > 1 and cfg.n_head > 1


def _core_forward(led: _Ledger, part: str, cfg: GPTConfig, s: int, rows: int, z: _Sizes) -> None:
    """The attention core ``softmax(q k^T / sqrt(d)) v``: SDPA is one kernel (FLOPs); naive
    attention's scale, causal mask and softmax stream its ``b h s^2`` scores, and under autocast
    on a card whose list runs softmax in fp32 each side casts them."""
    t, c, q, kv = s * rows, z.compute, cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    repeat = _repeats(cfg)
    if repeat:
        led.op(part, 2 * (2 * t * q * c))  # repeat_interleave of k and v: a clone of each, expanded
    if cfg.attention == "sdpa":
        return
    if _folds(cfg, rows):  # q always; k^T and v unless repeating made them contiguous
        led.op(part, 2 * t * q * c + (0 if repeat else 2 * 2 * t * kv * c))
    scores, square = rows * cfg.n_head * s * s, s * s
    sm = op_bytes(z.target, "softmax.int", c, z.precision)
    led.op(part, 2 * scores * c)                        # x 1/sqrt(d)
    led.op(part, square + 2 * square)                   # the causal mask: ones, triu_
    led.op(part, 2 * scores * c + square)               # masked_fill
    if sm != c:
        led.op(part, scores * (c + sm))
    led.op(part, 2 * scores * sm, scores)               # softmax
    if sm != c:
        led.op(part, scores * (sm + c))                 # p @ v casts p back


def _core_backward(led: _Ledger, cfg: GPTConfig, s: int, rows: int, z: _Sizes) -> None:
    if cfg.attention == "sdpa":
        return
    t, c, q = s * rows, z.compute, cfg.n_head * cfg.head_dim
    scores, square = rows * cfg.n_head * s * s, s * s
    sm = op_bytes(z.target, "softmax.int", c, z.precision)
    bw = "backward"
    if _folds(cfg, rows):
        led.op(bw, 2 * t * q * c)                       # the output's gradient copied for p @ v's backward
    if sm != c:
        led.op(bw, scores * (c + sm))
    led.op(bw, 3 * scores * sm, scores)                 # softmax's backward: gradient and output in
    if sm != c:
        led.op(bw, scores * (sm + c))
    led.op(bw, 2 * scores * c + square)                 # masked_fill's backward
    led.op(bw, 2 * scores * c)                          # the scale's


def _block_forward(led: _Ledger, part: str, cfg: GPTConfig, s: int, rows: int, z: _Sizes) -> None:
    """One block's forward (``part="recompute"``: as full checkpointing re-runs it, all but the
    last residual add: non-reentrant checkpointing stops once backward's tensors exist)."""
    t, d, f, hd, c, r = s * rows, cfg.d_model, cfg.hidden, cfg.head_dim, z.compute, z.param
    q, kv = cfg.n_head * hd, cfg.kv_heads * hd
    _norm_forward(led, part, cfg, t, z)
    if z.casts_norm:
        led.op(part, t * d * (z.norm + c), residual=True)
    for w, b in _block_matmul_weights(cfg):
        _weight_casts(led, part, z, w + b)
    if cfg.position == "rope":
        if c != 4:  # the fp32 cos and sin tables cast to q's dtype
            led.op(part, 2 * s * hd * (4 + c))
        for x in (t * q, t * kv):
            led.op(part, 10 * x * c + 2 * s * hd * c)  # x cos, -x2, cat, x sin, +
    _core_forward(led, part, cfg, s, rows, z)
    if cfg.attention == "naive":
        led.op(part, 2 * t * q * c)  # (b, h, s, hd) back to (b, s, h * hd): a copy
    led.op(part, t * d * (2 * r + c), residual=True)  # x + attn(...)
    _norm_forward(led, part, cfg, t, z)
    consumers = 2 if cfg.mlp == "swiglu" else 1
    if z.casts_norm:
        led.op(part, consumers * t * d * (z.norm + c), residual=True)
    if cfg.mlp == "swiglu":
        led.op(part, 2 * t * f * c, t * f)  # silu
        led.op(part, 3 * t * f * c)         # silu(gate) * up
    else:
        led.op(part, 2 * t * f * c, t * f)  # gelu
    if part != "recompute":
        led.op(part, t * d * (2 * r + c), residual=True)  # x + mlp(...)


def _block_backward(led: _Ledger, cfg: GPTConfig, s: int, rows: int, z: _Sizes) -> None:
    t, d, f, hd, c, r = s * rows, cfg.d_model, cfg.hidden, cfg.head_dim, z.compute, z.param
    q, kv = cfg.n_head * hd, cfg.kv_heads * hd
    bw = "backward"
    branch_cast = t * d * (r + c) if c != r else 0
    for w, b in _block_matmul_weights(cfg):
        if b:
            led.op(bw, t * b * c + b * c)  # the bias's gradient: a sum over tokens
        _weight_casts(led, bw, z, w + b)  # the gradients cast back to the weights' dtype
    # MLP branch
    led.op(bw, branch_cast, residual=True)
    if cfg.mlp == "swiglu":
        led.op(bw, 2 * 3 * t * f * c)       # the product's two gradients
        led.op(bw, 3 * t * f * c, t * f)    # silu_backward
    else:
        led.op(bw, 3 * t * f * c, t * f)    # gelu_backward
    consumers = 2 if cfg.mlp == "swiglu" else 1
    into_norm = z.norm if z.casts_norm else c
    if z.casts_norm:
        led.op(bw, consumers * t * d * (c + z.norm), residual=True)
    if consumers == 2:  # the gate's and the up projection's input gradients summed
        led.op(bw, 3 * t * d * into_norm, residual=True)
    _norm_backward(led, cfg, t, z)
    led.op(bw, 3 * t * d * r, residual=True)  # the residual's gradient and the branch's summed
    # attention branch
    led.op(bw, branch_cast, residual=True)
    _core_backward(led, cfg, s, rows, z)
    repeat = _repeats(cfg)
    if repeat:
        led.op(bw, 2 * (t * q * c + t * kv * c))  # repeat_interleave's backward: a sum over the groups
    rope = cfg.position == "rope"
    if rope:
        for x in (t * q, t * kv):
            led.op(bw, 10 * x * c + 2 * s * hd * c)
    # the q, k, v gradients that arrive in (b, h, s, hd) order are copied to (b, s, h, hd) for
    # the split's backward: SDPA returns them in its inputs' strides, naive attention's batched
    # matmuls contiguous (k's, through its transpose, keeps a viewable order)
    naive = cfg.attention == "naive"
    copied_q = rope or naive
    copied_k = rope or repeat
    copied_v = repeat or naive
    led.op(bw, 2 * c * (t * q * copied_q + t * kv * (copied_k + copied_v)))
    led.op(bw, 2 * t * (q + 2 * kv) * c)    # the split's backward: a cat
    if z.casts_norm:
        led.op(bw, t * d * (c + z.norm), residual=True)
    _norm_backward(led, cfg, t, z)
    led.op(bw, 3 * t * d * r, residual=True)


def _head_and_loss(led: _Ledger, cfg: GPTConfig, t: int, z: _Sizes) -> None:
    """The head's casts and ``F.cross_entropy`` over the whole logits (autocast's lists decide
    where the log-softmax runs and what is cast around it)."""
    fw, bw, d, V, c = "forward", "backward", cfg.d_model, cfg.vocab_size, z.compute
    if z.casts_norm:
        led.op(fw, t * d * (z.norm + c))
        led.op(bw, t * d * (c + z.norm))
    _weight_casts(led, fw, z, V * d)
    _weight_casts(led, bw, z, V * d)
    x = op_bytes(z.target, "cross_entropy_loss", c, z.precision)
    lsm = op_bytes(z.target, "log_softmax.int", x, z.precision, explicit_dtype_bytes=x)
    nll = op_bytes(z.target, "nll_loss", lsm, z.precision)
    for part in (fw, bw):
        if x != c:
            led.op(part, t * V * (c + x))
        if nll != lsm:
            led.op(part, t * V * (lsm + nll))
    led.op(fw, t * V * (x + lsm), t * V)               # log_softmax
    led.op(fw, 8 * t + t * nll + 2 * nll)              # nll_loss picks one log-probability a token
    led.op(bw, 2 * nll + 8 * t + t * V * nll)          # nll_loss_backward writes every logit's
    led.op(bw, 2 * t * V * lsm + t * V * x, t * V)     # log_softmax's backward


def _chunked_loss(led: _Ledger, cfg: GPTConfig, t: int, z: _Sizes) -> None:
    """:func:`memlab.models.chunked_loss.linear_cross_entropy`, op by op: per chunk of tokens its fp32
    logits, their log-sum-exp in place, and in backward the logits again, their softmax from
    the saved log-sum-exp, and both gradients (the weight's added chunk by chunk)."""
    fw, bw, d, V, p, n = "forward", "backward", cfg.d_model, cfg.vocab_size, z.param, z.norm
    dt = z.lower or n                                   # the chunks' matmul dtype
    up = t * V * (dt + 4) if dt != 4 else 0             # each chunk's logits cast to fp32
    chunks = -(-t // cfg.loss_chunk)
    for part in (fw, bw):
        if p != dt:
            led.op(part, V * d * (p + dt))              # weight.to(dtype), in both passes
    if n != dt:
        led.op(fw, t * d * (n + dt))                    # hidden.to(dtype)
    led.op(fw, 16 * t + up)                             # targets clamped; logits up
    led.op(fw, (8 * t + 8 * t) + 2 * 12 * t)            # gather, and two slice copies
    led.op(fw, (4 * t * V + 4 * t) + (8 * t * V + 4 * t) + (4 * t * V + 4 * t) + 8 * t + 12 * t)
    led.op(fw, 8 * t * V, t * V)                        # exp_ (amax, sub_, sum, log_, add_ above)
    led.op(fw, 9 * t + t + 12 * t + 9 * t + 4 * t)      # ne, count, lse - picked, where, sum
    led.op(bw, 9 * t + 5 * t + 16 * t + V * d * p)      # keep, as float; clamp; grad_w zeros
    led.op(bw, up + (8 * t * V + 4 * t) + 4 * t + 8 * t + (8 * t * V + 12 * t) + (8 * t + 4 * chunks)
           + (8 * t * V + 4 * t))                       # sub_, ones, neg, scatter_add_, keep*scale, mul_
    led.op(bw, 8 * t * V, t * V)                        # exp_: the softmax
    led.op(bw, (t * V * (4 + dt) if dt != 4 else 0) + t * d * (2 * n + dt))  # g down; grad_h rows
    led.op(bw, chunks * V * d * (2 * p + dt))           # grad_w.add_(g^T h), a chunk at a time


@dataclass(frozen=True)
class _DecoderBlock:
    """A decoder's shape in the terms the op-by-op closed form reads (the fields of memlab's
    GPT block it uses), so that one list of ops counts both; see :func:`decoder_elementwise`."""

    d_model: int
    hidden: int
    head_dim: int
    n_head: int
    kv_heads: int
    norm: str
    bias: bool
    has_qkv_bias: bool
    mlp: str
    position: str
    attention: str
    gqa: str
    n_layer: int
    vocab_size: int
    tie_embeddings: bool
    loss: str
    loss_chunk: int
    block_size: int
    params: int
    checkpointing: str = "none"

    def num_params(self) -> int:
        return self.params


def _decoder_block(s: DecoderShape, seq: int, attention: str | None, loss: str | None,
                   loss_chunk: int) -> _DecoderBlock:
    """The op list's view of a decoder: its widths and switches; a mixture of experts' MLP
    width is what one token's rows go through (``top_k`` experts and the shared ones),
    averaged over the layers (DeepSeek's first layers are dense)."""
    widths = [s.top_k * s.moe_ffn + s.shared_ffn if i in s.moe_layers else s.ffn for i in range(s.n_layer)]
    attn = "naive" if attention == "naive" or s.eager_only else "sdpa"
    return _DecoderBlock(
        d_model=s.d, hidden=round(sum(widths) / max(1, s.n_layer)), head_dim=s.head_dim, n_head=s.heads,
        kv_heads=s.kv_heads, norm="layernorm" if s.norm == "layer" else "rmsnorm",
        bias=s.mlp_bias or s.o_bias, has_qkv_bias=s.qkv_bias, mlp="gelu" if s.mlp == "gelu_new" else "swiglu",
        position="learned" if s.positions else "rope", attention=attn,
        # transformers' SDPA path passes grouped k and v with enable_gqa; its eager path repeats them
        gqa="native" if attn == "sdpa" else "repeat", n_layer=s.n_layer, vocab_size=s.vocab,
        tie_embeddings=s.tied, loss="chunked" if loss == "chunked" else "full", loss_chunk=loss_chunk,
        block_size=s.positions or seq, params=s.num_params())


def decoder_elementwise(s: DecoderShape, seq: int, batch: int, *, precision: str = "fp32",
                        micro_batches: int = 1, target="cpu", checkpointing: str | None = None,
                        attention: str | None = None, loss: str | None = None,
                        loss_chunk: int = 1024) -> ElementwiseWork:
    """Closed-form elementwise bytes of one training step of a Hugging Face decoder, from its
    shape: the op list of :func:`gpt_elementwise` at the decoder's widths (heads, kv heads and
    head dim, the MLP's width, GELU or gated, LayerNorm or RMSNorm, biases, learned or rotary
    positions, tied head, the loss), in the step's element sizes on ``target``.

    What it does not follow of ``transformers``' code: HF's RMSNorm is Python (an fp32 upcast
    and four ops where memlab's fused norm is one), Gemma's extra norms and softcaps, q/k norms,
    dropout, the routers and the experts' gather and scatter; these move bytes this count
    leaves out (``notes`` says so). Checkpointing is ``none`` or ``full``.

    Returns:
        :class:`ElementwiseWork` (``source="formula"``).
    """
    ckpt = checkpointing or "none"
    if ckpt not in ("none", "full"):
        raise InputError(f"checkpointing={ckpt!r} for a decoder; allowed: none, full")
    work = gpt_elementwise(_decoder_block(s, seq, attention, loss, loss_chunk), seq, batch, precision=precision,
                           micro_batches=micro_batches, target=target, checkpointing=ckpt)
    return replace(work, notes=work.notes + ("memlab's op list at the decoder's widths: HF's Python norms, "
                                              "extra norms, dropout and routing are not counted",))


def gpt_elementwise(cfg: GPTConfig | _DecoderBlock, seq: int, batch: int, *, precision: str = "fp32",
                    micro_batches: int = 1,
                    target="cpu", checkpointing: str | None = None) -> ElementwiseWork:
    """Closed-form elementwise bytes of one training step of memlab's GPT (module doc's rule).

    Args:
        cfg: the model (SDPA or naive attention, the whole or the chunked loss).
        seq, batch: tokens per sequence and sequences per step (all micro-batches).
        precision: the step's (:data:`memlab.core.precision.PRECISIONS`).
        micro_batches: gradient accumulation's slices of ``batch``.
        target: the device whose autocast lists and kernels apply (``"cpu"``, ``"cuda"``).
        checkpointing: overrides ``cfg``'s.

    Returns:
        :class:`ElementwiseWork` (``source="formula"``; scalar ops are left out).
    """
    ckpt = checkpointing or cfg.checkpointing
    if ckpt not in ("none", "full", "selective", "op"):
        raise InputError(f"checkpointing={ckpt!r}; allowed: none, full, selective, op")
    if micro_batches < 1 or batch % micro_batches:
        raise InputError(f"micro_batches={micro_batches!r} must divide batch={batch!r}")
    p, c, lower = precision_bytes(precision)
    norm_op = "layer_norm" if cfg.norm == "layernorm" else "rms_norm"
    z = _Sizes(p, c, lower, op_bytes(target, norm_op, p, precision), target, precision)
    rows, s, d, V = batch // micro_batches, seq, cfg.d_model, cfg.vocab_size
    t = rows * s
    led = _Ledger()
    for _layer in range(cfg.n_layer):
        _block_forward(led, "forward", cfg, s, rows, z)
        if ckpt in ("full", "op"):  # op: the policy saves matmuls only, every elementwise op re-runs
            _block_forward(led, "recompute", cfg, s, rows, z)
        elif ckpt == "selective":  # the core again, up to p @ v
            _core_forward(led, "recompute", cfg, s, rows, z)
        _block_backward(led, cfg, s, rows, z)
    fw, bw = "forward", "backward"
    # embeddings
    led.op(fw, 8 * t + 2 * t * d * p)
    led.op(bw, 8 * t + t * d * p + V * d * p)          # embedding_dense_backward: the whole table
    if cfg.position == "learned":
        led.op(fw, 8 * s + (8 * s + 2 * s * d * p) + (2 * t * d * p + s * d * p))   # arange, lookup, add
        led.op(bw, (t * d * p + s * d * p) + 8 * s + s * d * p + cfg.block_size * d * p)  # the sum over the batch
    if cfg.tie_embeddings:
        led.op(bw, 3 * V * d * p)                      # the lookup's and the head's gradients summed
    # final norm, head, loss
    _norm_forward(led, fw, cfg, t, z)
    _norm_backward(led, cfg, t, z)
    if cfg.loss == "chunked":
        _chunked_loss(led, cfg, t, z)
    else:
        _head_and_loss(led, cfg, t, z)
    # every micro-batch does the same; from the second on, each gradient is added to .grad
    parts = {k: v * micro_batches for k, v in led.parts.items()}
    parts[bw] += (micro_batches - 1) * 3 * cfg.num_params() * p
    residual = {k: v * micro_batches for k, v in led.residual.items()}
    return ElementwiseWork(parts[fw], parts[bw], parts["recompute"], led.activation_bytes * micro_batches,
                           led.activation_elements * micro_batches, "formula",
                           ("scalar ops left out",), residual[fw] + residual[bw], residual["recompute"])


def step_elementwise(step, target="cpu", *, deepspeed: bool = False) -> ElementwiseWork:
    """The elementwise bytes of a :class:`memlab.step.training_step.StepConfig`: in closed form
    (:func:`gpt_elementwise`) for memlab's GPT, a decoder's shape (:func:`decoder_elementwise`),
    else counted on fake tensors (:func:`count_elementwise`, by the CPU's autocast lists).

    Args:
        step: the step (its model, seq, batch, precision, micro-batches, checkpointing).
        target: the device whose autocast lists and kernels the closed form follows.
        deepspeed: the step runs under DeepSpeed, whose 16-bit mode casts the model itself
            (``pure-bf16``'s sizes: :mod:`memlab.core.precision`) instead of autocasting it.

    Returns:
        :class:`ElementwiseWork` of the whole step (every micro-batch).
    """
    cfg = step.model_config
    precision = deepspeed_precision(step) if deepspeed else step.precision
    if isinstance(cfg, DecoderShape):
        return decoder_elementwise(cfg, step.seq, step.batch, precision=precision, micro_batches=step.micro_batches,
                                   target=target, checkpointing=step.checkpointing_used, attention=step.attention,
                                   loss=step.loss, loss_chunk=step.loss_chunk)
    if isinstance(cfg, GPTConfig):
        return gpt_elementwise(cfg, step.seq, step.batch, precision=precision,
                               micro_batches=step.micro_batches, target=target)
    return count_elementwise(replace(step, precision=precision))


def deepspeed_precision(step) -> str:
    """The precision DeepSpeed runs ``step``'s model in: its 16-bit mode casts the model
    (``pure-bf16``'s sizes, :mod:`memlab.core.precision`), fp32 stays fp32."""
    return "pure-bf16" if step.precision in ("bf16", "fp16", "pure-bf16") else step.precision


@functools.lru_cache(maxsize=64)
def count_flops_and_elementwise(step) -> tuple[StepFlops, ElementwiseWork]:
    """Both counts of one steady-state step on fake tensors, in one run: its FLOPs
    (:class:`memlab.time.flops.PhaseFlopCounter`) and its elementwise bytes (for a model without a
    closed form: a UNet, the chunked loss).

    Cached per step (a frozen ``StepConfig``; both results are frozen too): the count depends on
    the step's shapes alone, not on the card it is timed for, and a UNet's fake step takes
    seconds, which a lesson's slider or a plan over every card would otherwise pay each time."""
    flops, counter = run_counted_step(step, PhaseFlopCounter(), ElementwiseCounter())
    return flops.flops(), counter.work()


__all__ = ["ACTIVATIONS", "NO_TRAFFIC", "WRITE_ONLY", "ElementwiseCounter", "ElementwiseWork", "count_elementwise",
           "count_flops_and_elementwise", "deepspeed_precision",
           "decoder_elementwise", "gpt_elementwise", "op_traffic", "step_elementwise"]
