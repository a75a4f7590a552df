"""Estimate: the bytes of one training step, in closed form.

Two parts, as in the literature:

* **Model states** (:mod:`memlab.step.states`, the one source): plain PyTorch keeps 4 + 4 + 8
  bytes per parameter with AdamW in fp32 and under autocast; under DeepSpeed (ZeRO or
  offload) mixed precision is 2 + 2 + K with K = 12 (Rajbhandari et al. 2020, "ZeRO",
  sections 3.1 and 5.1), stage 1 dividing the K bytes by the data-parallel degree N, stage 2
  also the gradients, stage 3 also the parameters, offload moving them to host memory.
  DeepSpeed's 16-bit mode runs the model in 16 bits without autocast, so its activations are
  those of a ``pure-bf16`` step.
* **Activations** (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", section 4): per layer ``sbh(34 + 5as/h)`` bytes for fp16 with dropout.
  memlab's blocks have no dropout and keep the residual stream in fp32 under autocast, so
  :func:`activation_bytes` counts the tensors *this* model saves for backward, one by one; the
  structure (a term linear in ``sbh``, an ``as^2 b`` term for materialised attention scores,
  and a ``4 s b V`` term for the fp32 log-softmax) is the paper's.

The peak is the largest of a few moments of the step (the loss's forward and each op of its
backward, the language model head's backward, the backward of one recomputed block, the end
of backward, the optimizer step); :func:`estimate_step` returns the categories at that moment.

Element sizes depend on the device (``target``): which ops autocast runs in fp32, what
kernels save, the workspaces no op returns. Each such rule lives in :mod:`memlab.policy`,
which the simulation applies to its fake step, so both lenses follow the same source.

Over 500 lines because every switch of a GPT step (checkpointing none/selective/op/full, the
optimizer step in backward, the chunked loss, tensor parallelism) changes the same peak
moments, which read best beside each other.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, replace

import torch

from memlab.core.cards import Card
from memlab.core.errors import InputError
from memlab.core.hardware import resolve_budget
from memlab.core.torch_private import FakeTensorMode, activation_memory_budget
from memlab.lenses.decoder_estimate import estimate_run
from memlab.models.chunked_loss import chunked_loss_bytes
from memlab.models.decoder_shape import DecoderShape
from memlab.models.gpt_unet import GPTConfig, UNet, UNetConfig
from memlab.policy import (
    Target,
    activation_copies,
    attention_probs_bytes,
    cross_entropy_moments,
    emulate,
    get_target,
    norm_saves,
    precision_bytes,
    resolve_target,
    sdpa_backend,
    sdpa_dtype,
    sdpa_lse_bytes,
    sdpa_math_extra_bytes,
)
from memlab.step.activation_offload import offload_context
from memlab.step.compiled import lowering_notes
from memlab.step.low_bit import EIGHT_BIT, PAGED, TORCHAO, torchao_update_bytes
from memlab.step.parallel_dims import ParallelDims
from memlab.step.states import ZeroBuckets, data_parallel_ranks, step_model_states, tensor_parallel_share
from memlab.step.training_step import MemoryReport, StepConfig, autocast_for, build_trainer, resolve_step
from memlab.time.step_time import report_time
from memlab.tracking.tracker import CATEGORIES, MemoryTracker


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element for each kind of tensor of a step, for a precision on a target
    device. Every field comes from a rule of :mod:`memlab.policy`."""

    param: int      # stored weights
    grad: int       # .grad
    compute: int    # matmul outputs and their saved inputs
    residual: int   # the residual stream (adds, norm inputs)
    softmax: int    # the loss's saved log-probabilities (and their cast copy), per logit
    weight_copy: int  # autocast's low-precision copies of matmul weights (0: none)
    probs: int      # naive attention's saved probabilities (and their cast copy), per score
    # (moment, saved, scratch) bytes per logit through the loss (policy.cross_entropy_moments)
    loss_moments: tuple[tuple[str, int, int], ...]
    # the same for logits the model casts to fp32 first (GPTConfig.logits_fp32)
    upcast_loss_moments: tuple[tuple[str, int, int], ...]
    target: "str | Target"  # the device the sizes are for (a Target: also its card)


def dtypes(precision: str, target: str = "cpu") -> Dtypes:
    """Element sizes for ``fp32``, ``bf16``/``fp16`` autocast (fp32 master weights) and
    ``pure-bf16`` on a ``target`` (``cpu`` or ``cuda``). Under autocast, matmuls run in 16
    bits; what else does depends on the device's op lists (:data:`memlab.policy.AUTOCAST`):
    on CUDA softmax and the loss's ``nll_loss`` run in fp32, on CPU the whole cross-entropy.
    """
    if isinstance(target, str):
        get_target(target)  # validates the name
    param, compute, lower = precision_bytes(precision)
    residual = param  # the embedding output and the residual adds stay in the weights' dtype
    moments = tuple(cross_entropy_moments(target, precision))
    return Dtypes(param=param, grad=param, compute=compute, residual=residual,
                  softmax=moments[0][1], weight_copy=lower or 0,
                  probs=attention_probs_bytes(target, precision), loss_moments=moments,
                  upcast_loss_moments=tuple(cross_entropy_moments(target, precision, upcast_logits=True)),
                  target=target)


def attention_saved_elements(cfg: GPTConfig, seq: int, batch: int, tensor_parallel: int = 1) -> int:
    """Elements of q, k, v that one block keeps for backward, and the attention output
    ``proj`` reads, for multi-head and grouped-query attention.

    With ``Q = s b n_head d_head`` and ``K = s b n_kv_head d_head``: q, k and v are views of
    the fused ``qkv`` output (``Q + 2K``), and whatever saves a view keeps all of it alive.
    Rotary positions make new q (``Q``) and k (``K``); ``gqa="repeat"`` makes new k and v of
    ``Q`` each, which attention saves instead of the views; naive attention's matmuls fold
    batch and heads into one dimension and save contiguous copies unless the batch or the
    heads are one (a view cannot be folded otherwise); a selectively checkpointed core keeps
    its inputs as they were passed (before any repeat).

    Per rank of ``tp``-way tensor parallelism (:mod:`memlab.distributed.tensor_parallel`) a rank has
    ``n_head / tp`` query heads and ``n_kv_head / tp`` key/value heads, or, when ``tp``
    exceeds ``n_kv_head``, one replicated key/value head read from the all-gathered ``qkv``
    output (which the views then keep whole). :func:`memlab.lenses.parallel_formulas.tp_activation_bytes`
    uses this count, and the tests check it against the tracker for every combination.
    """
    t, hd, tp = seq * batch, cfg.head_dim, tensor_parallel
    split = cfg.kv_heads % tp == 0
    heads, kv_heads = cfg.n_head // tp, (cfg.kv_heads // tp if split else 1)
    fused = t * (cfg.n_head + 2 * cfg.kv_heads) * hd // (tp if split else 1)
    q, kv = t * heads * hd, t * kv_heads * hd
    rope = cfg.position == "rope"
    if cfg.checkpointing == "selective":
        return (q + kv if rope else 0) + fused + q
    repeat = kv_heads < heads and cfg.gqa == "repeat"
    in_place = cfg.attention == "sdpa" or batch == 1 or heads == 1
    new = ((q if rope or not in_place else 0)
           + (q if repeat else kv if rope or not in_place else 0)
           + (q if repeat else 0 if in_place else kv))
    views = in_place and (not rope or not repeat)
    return new + (fused if views else 0) + q


def layer_activation_bytes(cfg: GPTConfig, seq: int, batch: int, precision: str,
                           target: str = "cpu", tensor_parallel: int = 1) -> float:
    """Bytes one transformer block saves for backward (no checkpointing).

    With ``t = s*b`` tokens, ``h = d_model``, ``f`` the MLP width and ``a`` heads, in element
    sizes of :func:`dtypes` (R residual, C compute): two residual adds ``2thR`` (when the
    norms keep their input); per norm its output ``thC`` plus what :func:`memlab.policy.norm_saves`
    says it keeps; q, k, v and the attention output (:func:`attention_saved_elements`: ``4thC``
    for multi-head attention with learned positions, ``6thC`` with rotary ones); with naive
    attention the probabilities ``a s^2 b P`` (P: :func:`memlab.policy.attention_probs_bytes`)
    and the causal mask ``s^2`` bytes, with SDPA the kernel's log-sum-exp; the MLP ``2tfC``
    (SwiGLU ``4tfC``).

    On each of ``tp`` tensor-parallel ranks (Megatron's layout, Korthikanti et al. 2022 sec.
    4.2.1, without sequence parallelism) the heads, the MLP width and what they save are
    divided by ``tp``; the residual stream, the norms and the inputs of the first matmuls
    are not.
    """
    return sum(layer_activation_parts(cfg, seq, batch, precision, target, tensor_parallel).values())


def layer_activation_parts(cfg: GPTConfig, seq: int, batch: int, precision: str,
                           target: str = "cpu", tensor_parallel: int = 1) -> dict[str, float]:
    """:func:`layer_activation_bytes` in three parts, per rank of ``tensor_parallel`` (tp):
    ``replicated`` (the residual adds, the norms and their outputs, the causal mask: whole on
    every rank),
    ``sharded`` (q, k, v, the attention output and the MLP: divided by ``tp``) and
    ``attention_core`` (naive attention's probabilities or SDPA's log-sum-exp)."""
    d, tp = dtypes(precision, target), tensor_parallel
    t, h, f, a, s = seq * batch, cfg.d_model, cfg.hidden, cfg.n_head // tp, seq
    C = d.compute
    replicated = 2 * t * h * _residual_saved(cfg, d) + 2 * _norm_bytes(cfg, d, t)
    if cfg.mlp == "swiglu":  # the second norm's output feeds two matmuls (gate, up)
        replicated += (activation_copies(precision, 2) - 1) * t * h * C
    if cfg.position == "rope" and C != 4:
        replicated += 2 * s * cfg.head_dim * C  # cos and sin cast to the compute dtype
    core = 0
    if cfg.checkpointing != "selective":
        if cfg.attention == "naive":
            core = a * s * s * batch * d.probs
            replicated += s * s  # the boolean causal mask
        else:
            backend = sdpa_backend(target, C, cfg.head_dim, dtype=sdpa_dtype(precision))
            core = sdpa_lse_bytes(backend, batch, a, s)
            if backend == "math":  # the card has no fused kernel for this dtype
                core += sdpa_math_extra_bytes(C, batch, a, s, cfg.head_dim)
    sharded = (attention_saved_elements(cfg, seq, batch, tp) * C
               + (4 if cfg.mlp == "swiglu" else 2) * t * f * C / tp)
    return {"replicated": replicated, "sharded": sharded, "attention_core": core}


def op_layer_bytes(cfg: GPTConfig, seq: int, batch: int, precision: str, target: str = "cpu") -> float:
    """Bytes one block keeps under op-level selective checkpointing (:func:`memlab.models.gpt_unet.op_sac_context`):
    its input (``thR``), the outputs of the odd-numbered matmuls in call order (``qkv``, then
    the MLP's first: ``fc`` for GELU; SwiGLU calls ``gate``, ``fc``, ``out``, so ``gate`` and
    ``out``), and the attention kernel's outputs (its output ``thC`` and log-sum-exp)."""
    d = dtypes(precision, target)
    t, h, f, C = seq * batch, cfg.d_model, cfg.hidden, d.compute
    qkv = t * (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim
    mlp = t * f + t * h if cfg.mlp == "swiglu" else t * f
    backend = sdpa_backend(target, C, cfg.head_dim, dtype=sdpa_dtype(precision))
    core = t * cfg.n_head * cfg.head_dim * C + sdpa_lse_bytes(backend, batch, cfg.n_head, seq)
    return t * h * d.residual + (qkv + mlp) * C + core


def _residual_saved(cfg: GPTConfig, d: Dtypes) -> int:
    """Bytes per element of the residual stream kept for the norms' backward (none when
    the norm keeps an fp32 upcast instead, counted in :func:`_norm_bytes`)."""
    keeps_input, _, _ = norm_saves(d.target, cfg.norm, d.residual, cfg.norm_fp32)
    return d.residual if keeps_input else 0


def _norm_bytes(cfg: GPTConfig, d: Dtypes, t: int) -> int:
    """One norm's saved bytes: its output as the next matmul saves it (``thC``) and what
    the norm itself keeps per element and per row (:func:`memlab.policy.norm_saves`)."""
    _, per_element, per_row = norm_saves(d.target, cfg.norm, d.residual, cfg.norm_fp32)
    return t * cfg.d_model * (d.compute + per_element) + t * per_row


def activation_bytes(cfg: GPTConfig, seq: int, batch: int, precision: str,
                     target: str = "cpu", tensor_parallel: int = 1, *,
                     tp: int | None = None) -> dict[str, float]:
    """Saved-for-backward bytes of the whole forward, split into its parts; per rank of
    ``tp``-way tensor parallelism (the embedding output, the final norm and, under full
    checkpointing, every block's input stay whole on each rank: that is what sequence
    parallelism would divide; the loss is vocabulary-parallel, as in Megatron-LM)."""
    tp = tensor_parallel if tp is None else tp  # ``tp=``: the old spelling lesson 16 uses
    d = dtypes(precision, target)
    t, h, v = seq * batch, cfg.d_model, cfg.vocab_size
    layer_w, head_w = sum(cfg.matmul_numels()[0]), cfg.matmul_numels()[1]
    final_norm = _norm_bytes(cfg, d, t)
    embed = t * h * _residual_saved(cfg, d) + (8 * seq if cfg.position == "learned" else 0)
    # the chunked loss casts the head weight itself, uncached, and keeps no logits: only a
    # log-sum-exp per token (memlab.models.chunked_loss)
    chunked = cfg.loss == "chunked"
    head_copy = 0 if chunked else head_w
    if cfg.checkpointing == "full":
        layers = cfg.n_layer * t * h * d.residual  # each block keeps its input only
        copies = d.weight_copy * head_copy / tp
    elif cfg.checkpointing == "op":
        layers = cfg.n_layer * op_layer_bytes(cfg, seq, batch, precision, target)
        copies = d.weight_copy * head_copy / tp  # autocast's casts are recomputed, not kept
    else:
        layers = cfg.n_layer * layer_activation_bytes(cfg, seq, batch, precision, target, tp)
        copies = d.weight_copy * (cfg.n_layer * layer_w + head_copy) / tp
    return {"embedding": embed, "layers": layers, "final_norm": final_norm,
            "weight_copies": copies,
            # chunked_output: every chunk's log-softmax, fp32 (each chunk is cast first)
            "log_softmax": 4 * t if chunked else t * v * (4 if cfg.loss == "chunked_output"
                                                          else _loss_moments(cfg, d)[0][1]) / tp}


def _loss_moments(cfg: GPTConfig, d: Dtypes) -> tuple[tuple[str, int, int], ...]:
    """The plain loss's ``(moment, saved, scratch)`` bytes per logit for this model: those of
    its fp32 copy when it casts its logits first (``cfg.logits_fp32``)."""
    return d.upcast_loss_moments if cfg.logits_fp32 else d.loss_moments


def chunked_loss_moments(cfg: GPTConfig, tokens: int, precision: str,
                         target: str = "cpu", head_grad: bool = True) -> dict[str, dict[str, float]]:
    """:func:`memlab.models.chunked_loss.chunked_loss_bytes` of memlab's GPT under ``precision`` on
    ``target``: the head matmul in the compute dtype, the hidden states in the residual's,
    the weight in the parameters'; ``cfg.loss_chunk`` rows per chunk.

    Returns:
        ``{"chunked loss forward": {...}, "chunked loss backward": {...}}`` bytes by category.
    """
    d = dtypes(precision, target)
    return chunked_loss_bytes(cfg.vocab_size, cfg.d_model, cfg.loss_chunk, tokens, compute=d.compute,
                              hidden=d.residual, weight=d.param, head_grad=head_grad)


def _gpt_peak(step: StepConfig, cfg: GPTConfig, states: dict[str, float],
              target: Target, tp: int = 1) -> tuple[dict, str]:
    """Categories at the step's peak moment, and which moment that is, on one rank of
    ``tp``-way tensor parallelism.

    Over 80 lines because it is the GPT's closed form, one line per tensor of the step's peak moment
    (module doc's table).
    """
    d = dtypes(step.precision, target)
    k = step.micro_batches
    seq, batch = step.seq, step.batch // k
    t, h, f, v, L = seq * batch, cfg.d_model, cfg.hidden, cfg.vocab_size, cfg.n_layer
    P, G, Opt = states["parameters"], states["gradients"], states["optimizer"]
    # DeepSpeed's own buffers (memlab.step.states.ModelStates.peak_inputs; zero for plain PyTorch):
    # gradient bytes held all step, a gradient partition allocated at the first reduce bucket
    # (ZeRO-2), stages 1-2's reduce bucket (from backward's first gradient to its end), the
    # optimizer step's scratch, ZeRO-3's gathered parameters
    held, late = states.get("held", 0.0), states.get("late", 0.0)
    bucket = states.get("bucket", 0.0)
    # ZeRO-2's partition comes at its first flush: in the last block's backward only if the head's
    # gradient and that block's (unsharded bytes) fill a bucket
    made = d.grad * (v * h * (not cfg.tie_embeddings) + (cfg.num_params() - v * h) / max(L, 1))
    early_late = late if made >= states.get("flush", 0.0) else 0.0
    scratch, gathered = states.get("step", 0.0), states.get("gathered", 0.0)
    acts = activation_bytes(cfg, seq, batch, step.precision, target, tp)
    A = sum(acts.values()) - states.get("frozen", 0.0)
    v = -(-v // tp)  # from here on: this rank's share of the vocabulary
    head_grad = min(G, v * h * d.grad / (step.world_size // tp if step.zero >= 2 else 1))
    layer_grad = G * (1 - cfg.vocab_size * h / cfg.num_params()) / L if L else 0
    # With accumulation, gradients of earlier micro-batches are already there.
    G_prev = G if k > 1 else 0.0
    lse = acts["log_softmax"]
    # Autocast's weight casts live until the forward ends; under full checkpointing autograd
    # does not keep them, so at the loss they are scratch (policy._CastCache).
    layer_w = sum(cfg.matmul_numels()[0])
    cached = d.weight_copy * L * layer_w / tp if cfg.checkpointing in ("full", "op") else 0
    cached = 0 if "frozen" in states else cached
    # the final norm's output before the head runs: ZeRO-3's flat buffer is there while the root's
    # prefetch of the whole model waits for its last parameter's fetch (ModelStates.gathered_forward)
    m = {"end of forward": dict(activations=A - lse, gradients=G_prev + held,
                                temporaries=states["gathered_forward"] + cached)}
    if step.compile:  # one compiled graph each way: its traced peak, then the optimizer step
        grown = compiled_pass_bytes(cfg, seq, batch, step.precision, step.activation_memory_budget, target,
                                    step.compile, step.optimizer_in_backward, step.activation_offload)
        m = {"compiled forward and backward": dict(
                 activations=grown["activations"], gradients=G_prev + held + grown["gradients"],
                 temporaries=grown["temporaries"] + gathered)}
        if not step.optimizer_in_backward:  # in backward each update ran in the traced pass
            m["optimizer step"] = dict(gradients=G + held, temporaries=scratch)
        name, best = max(m.items(), key=lambda kv: sum(kv[1].values()))
        out = dict.fromkeys(CATEGORIES, 0.0)
        out.update(parameters=P, optimizer=Opt, other=_gpt_other(cfg, step),
                   workspace=target.resident_workspace(), **best)
        return out, name
    if cfg.loss == "chunked":
        # under LoRA ("frozen" states) the head is frozen: no head-weight gradient in the loss
        for moment, cats in chunked_loss_moments(replace(cfg, vocab_size=v), t, step.precision,
                                                 target, head_grad="frozen" not in states).items():
            forward = moment.endswith("forward")
            in_bwd = bucket if cats.get("gradients", 0) and not forward else 0.0
            m[moment] = dict(activations=A, gradients=G_prev + held + in_bwd + cats.get("gradients", 0),
                             temporaries=cats["temporaries"] + gathered
                             + (cached if forward else 0))
    elif cfg.loss == "chunked_output":
        m.update(_chunked_output_moments(cfg, d, seq, batch, v, A=A, lse=lse, held=G_prev + held,
                                         head=max(G_prev, head_grad) + held, gathered=gathered, cached=cached))
    else:
        # the loss's forward and backward, one moment per tensor it makes, all activations alive
        for moment, saved, scratch_per_logit in _loss_moments(cfg, d):
            cast_cache = cached if moment == "loss forward" else 0
            m[moment] = dict(activations=A - lse + t * v * saved, gradients=G_prev + held,
                             temporaries=t * v * scratch_per_logit + cast_cache + gathered)
        # the head's backward: logits gradient, gradient of the final norm's output, head grad
        m["head backward"] = dict(activations=A - lse, gradients=max(G_prev, head_grad) + held,
                                  temporaries=t * v * d.compute + t * h * d.compute + gathered)
    layer = (layer_activation_bytes(cfg, seq, batch, step.precision, target, tp)
             + d.weight_copy * layer_w / tp)
    # one block's backward: the MLP's two hidden-size gradients and the residual gradient
    f = f / tp
    transient = t * f * d.compute + t * h * d.residual
    if cfg.checkpointing == "full":
        # the block recomputed last (block 0) holds its activations again, with nearly all grads
        m["recomputed block"] = dict(activations=acts["embedding"],
                                     gradients=max(G_prev, G - layer_grad, late) + held + bucket,
                                     temporaries=layer + transient + gathered)
        m["first recomputed block"] = dict(
            activations=A - lse - acts["final_norm"],
            gradients=max(G_prev, head_grad + early_late) + held + bucket,
            temporaries=layer + transient + gathered)
    elif cfg.checkpointing == "op":
        # the last block's backward re-runs what its policy did not save, beside every block's
        # saved outputs, and makes its MLP output weight's gradient
        redo = max(0.0, layer - op_layer_bytes(cfg, seq, batch, step.precision, target))
        m["first recomputed block"] = dict(
            activations=A - lse - acts["final_norm"],
            gradients=max(G_prev, head_grad + early_late + f * h * d.grad) + held + bucket,
            temporaries=redo + transient + gathered)
    else:
        m["first block backward"] = dict(activations=A - lse - acts["final_norm"],
                                         gradients=max(G_prev, head_grad + early_late) + held + bucket,
                                         temporaries=transient + t * f * d.compute + gathered)
    # end of backward: all gradients; a tied embedding adds its dense gradient, then the sum
    tied = 2 * head_grad if cfg.tie_embeddings else 0.0
    m["end of backward"] = dict(gradients=G + held + bucket, temporaries=tied + t * h * d.residual)
    m["optimizer step"] = dict(gradients=G + held, temporaries=scratch)
    if step.optimizer_in_backward:
        _in_backward_gradients(m, cfg, d.grad / tp, head_grad, scratch, step.optimizer)
    name, best = max(m.items(), key=lambda kv: sum(kv[1].values()))
    out = dict.fromkeys(CATEGORIES, 0.0)
    out.update(parameters=P, optimizer=Opt, other=_gpt_other(cfg, step),
               workspace=target.resident_workspace(), **best)
    return out, name


def _chunked_output_moments(cfg: GPTConfig, d: Dtypes, seq: int, batch: int, v: int, *, A: float, lse: float,
                            held: float, head: float, gathered: float, cached: float) -> dict[str, dict]:
    """The moments of ``loss="chunked_output"`` (torchtune's chunked head and loss, eager): every
    chunk's logits exist at the last chunk's loss, beside its fp32 cast and every chunk's fp32
    log-softmax (``lse``, in ``A``); backward runs every chunk's loss before any chunk's head matmul
    (their nodes are younger), the first (largest) chunk's log-softmax gradients in and out beside
    all saved log-softmaxes; then all chunks' logit gradients meet the head's backward.

    Args:
        cfg, d: the model and its element sizes. seq, batch: one micro-batch. v: this rank's vocabulary.
        A, lse: the activations saved and the log-softmaxes among them. held, head: the gradients
        held in the loss and in the head's backward. gathered, cached: ZeRO-3's and autocast's buffers.

    Returns:
        ``{moment: {category: bytes}}``.
    """
    logits = seq * batch * v
    chunk = batch * -(-seq // cfg.output_chunks) * v   # torch.chunk: the first chunks are the largest
    cast = 4 * chunk if d.compute != 4 else 0           # .float() of fp32 logits is the tensor itself
    return {"loss forward": dict(activations=A, gradients=held, temporaries=logits * d.compute + cast + cached
                                 + gathered),
            "log-softmax backward": dict(activations=A, gradients=held, temporaries=8 * chunk + gathered),
            "head backward": dict(activations=A - lse, gradients=head,
                                  temporaries=logits * d.compute + seq * batch * cfg.d_model * d.compute + gathered)}


def _in_backward_gradients(m: dict[str, dict], cfg: GPTConfig, grad_bytes: float,
                           head_grad: float, scratch: float = 0.0, optimizer: str = "adamw") -> None:
    """The moments of a step whose optimizer runs in backward (:mod:`memlab.step.optimizer_in_backward`):
    no moment holds every gradient. In a block's backward the gradient alive is the one being
    applied (at most the block's largest matrix) plus, with a tied head, the head's gradient,
    which autograd keeps in flight until the embedding's backward adds to it; the head's
    backward holds its own; the end of backward the embedding's. The optimizer-step moment
    is gone: its updates happened one parameter at a time, each with its own scratch once the
    gradient is whole, after the op that made it freed its temporaries (so the larger of the two; torchao's
    compiled update, :func:`memlab.step.low_bit.torchao_update_bytes`: a block's largest matrix's in
    the block, the step's largest, ``scratch``, at an untied head and the embedding)."""
    numel = max(cfg.matmul_numels()[0])
    largest = numel * grad_bytes
    block_scratch = torchao_update_bytes(numel, optimizer) if optimizer in TORCHAO else 0.0
    in_flight = head_grad if cfg.tie_embeddings else 0.0
    for name, cats in m.items():
        if name == "head backward":  # an untied head is updated here, a tied one with the embedding
            cats["gradients"] = head_grad
            cats["temporaries"] = max(cats.get("temporaries", 0.0), 0.0 if cfg.tie_embeddings else scratch)
        elif name.endswith(("block", "block backward")):
            cats["gradients"] = largest + in_flight
            cats["temporaries"] = max(cats.get("temporaries", 0.0), block_scratch)
        elif name == "end of backward":
            cats["gradients"] = head_grad
            cats["temporaries"] = max(cats.get("temporaries", 0.0), scratch)
        else:
            cats["gradients"] = 0.0
    del m["optimizer step"]


def _gpt_other(cfg: GPTConfig, step: StepConfig) -> int:
    """Token ids and targets (int64) and the rotary tables (fp32 buffers)."""
    rope = 2 * cfg.block_size * cfg.head_dim * 4 * cfg.n_layer if cfg.position == "rope" else 0
    return 2 * 8 * step.seq * step.batch + rope


@functools.lru_cache(maxsize=32)
def compiled_pass_bytes(cfg: GPTConfig, seq: int, batch: int, precision: str, budget: float | None,
                        target: Target, scope: bool | str = True, in_backward: bool = False,
                        offload: bool = False) -> dict[str, int]:
    """The compiled forward and backward of one micro-batch (``torch.compile``, inductor), traced on
    fake tensors: the bytes they add, by category, at their peak, over what was held before them
    (parameters, buffers, the batch).

    Traced, not tabled: what a compiled forward saves is the min-cut partitioner's choice under
    ``budget`` (a knapsack over the joint graph), and what is alive at once follows the order of
    inductor's generated code, which moves the backward's recomputation
    (:mod:`memlab.step.compiled`). So the step's model runs as the simulation runs it
    (:class:`memlab.step.compiled.PartitionedModel`): partitioned by inductor's partitioner, then
    inductor's wrapper with its kernels left out. Seconds (lowering and code generation of two
    graphs), paid only by a compiled step's estimate; cached per shape.

    Args:
        cfg: the model. seq, batch: one micro-batch's shape. precision: the step's (its autocast).
        budget: ``activation_memory_budget`` (``None``: the default). target: whose autocast policy.
        scope: ``StepConfig.compile``: ``True`` (one graph) or ``"layers"`` (torchtune's blocks and loss apart).
        in_backward: ``StepConfig.optimizer_in_backward``: each parameter's update runs in the traced
            backward as its gradient is ready, which then frees it (its optimizer state, made in the
            untraced first pass, is the formula's).
        offload: ``StepConfig.activation_offload``: the forward under the simulation's offload hooks
            (saved tensors leave the device on a CUDA target, :mod:`memlab.step.activation_offload`).

    Returns:
        ``{category: bytes}`` added at the pass's peak on the device.
    """
    step = StepConfig(model=cfg, seq=seq, batch=batch, precision=precision, compile=scope,
                      activation_memory_budget=budget, optimizer_in_backward=in_backward)
    with FakeTensorMode(), emulate(target):
        trainer = build_trainer(step, "cpu", fake=True)
        model = trainer.model
        batch_ids = tuple(torch.randint(0, cfg.vocab_size, (batch, seq)) for _ in range(2))

        def forward_backward() -> None:
            hooks = (offload_context(torch.device("cpu"), to_host=target.is_cuda, fake=True) if offload
                     else contextlib.nullcontext())
            with hooks, activation_memory_budget(budget), autocast_for(precision, torch.device("cpu")):
                loss = model(*batch_ids)
            loss.backward()
        forward_backward()   # the first call traces, partitions and lowers: not counted
        model.zero_grad(set_to_none=True)
        with MemoryTracker(accounting=target.accounting()) as mt:
            mt.track_model(model)
            # in backward the updates touch the state the first pass made: held before, not grown
            mt.track_optimizer(trainer.optimizer)
            mt.track_tensors(batch_ids)
            before = mt.by_category()
            forward_backward()
            peak = mt.peak_by_category()
    return {c: peak[c] - before[c] for c in CATEGORIES}


@functools.lru_cache(maxsize=64)
def unet_saved_bytes(cfg: UNetConfig, batch: int, size: int, precision: str, target: Target) -> tuple[int, int]:
    """A UNet's activations at the start of backward and its forward's largest per-call kernel
    workspace, counted on a fake forward (no memory) under ``target``'s autocast policy and
    kernels (:mod:`memlab.policy`).

    A conv net's saved tensors depend on every resolution, so they are counted, not tabled.
    Cached per shape: the count is a fake run of seconds, and a plan over many cards or a
    lesson's slider asks for the same shapes again.

    Args:
        cfg: the UNet.
        batch: images in one micro-batch.
        size: the images' side in pixels.
        precision: the step's precision (its autocast).
        target: the device the step is predicted for.

    Returns:
        ``(activations, workspace)`` in bytes.
    """
    with FakeTensorMode(), emulate(target):
        model = UNet(cfg)
        x = torch.randn(batch, cfg.channels, size, size)
        with MemoryTracker(accounting=target.accounting()) as mt:
            mt.track_model(model)
            with autocast_for(precision, torch.device("cpu")):
                loss = model(x, torch.randint(0, 1000, (batch,)), torch.randn_like(x))
            mt.mark_phase("backward")
            acts = mt.by_category()["activations"]
            # backward's calls on the same shapes need as much workspace (policy.conv_workspace)
            workspace = max((e.by_category[CATEGORIES.index("workspace")] for e in mt.timeline),
                            default=0)
        del loss, model
    return int(acts), int(workspace)


def _unet_peak(step: StepConfig, cfg: UNetConfig, states: dict[str, float],
               target: Target) -> tuple[dict, str]:
    """UNet activations by counting each module's saved tensors on a shape walk."""
    acts, workspace = unet_saved_bytes(cfg, step.batch // step.micro_batches, step.seq,
                                       step.precision, target)
    out = dict.fromkeys(CATEGORIES, 0.0)
    # images, timesteps and noise of the whole batch
    other = 4 * step.batch * (2 * cfg.channels * step.seq ** 2) + 8 * step.batch
    grads = states["gradients"] if step.micro_batches > 1 else 0
    out.update(parameters=states["parameters"], optimizer=states["optimizer"], other=other,
               activations=acts, gradients=grads + states.get("held", 0.0),
               temporaries=states.get("gathered", 0.0), workspace=workspace)
    return out, "start of backward"


#: What the formula leaves out on a CUDA target, in numbers from the H200 reference steps
#: (``tests/test_gpu_reference.py``).
ALLOCATOR_NOTE = ("the CUDA caching allocator's block choices are not in this formula: it can "
                  "hand a request a whole cached block up to 1 MiB larger, depending on what the "
                  "process ran before; on the H200 reference steps max_memory_allocated read up "
                  "to 1.5% more than this estimate (simulate_step replays the allocator)")


#: what the estimate says of a compiled step (memlab.step.compiled, compiled_pass_bytes)
COMPILE_NOTE = ("compiled: the forward and backward are counted as inductor runs them, traced on fake tensors "
                "(the partitioner's saved set under the budget, the order and buffer reuse of inductor's generated "
                "code: seconds, not a closed form; compiled_pass_bytes); the model states and the optimizer step "
                "are the formula's. Within 0.1% of the measured compiled peak on the CPU test steps at budgets "
                "1.0 and 0.5 (tests/test_compile.py)")

#: what the estimate says of a compiled step's activation offloading: traced with the compiled pass
COMPILED_OFFLOAD_NOTE = ("activation_offload: the compiled pass is traced under the simulation's offload hooks "
                         "(memlab.step.activation_offload), so the device bytes are the offloaded step's; the "
                         "host bytes it moves are simulate's to report")

#: what the estimate says of a compiled UNet step: its compiled pass is not traced
UNET_COMPILE_NOTE = ("compile is not in this lens for a UNet: the peak is the eager step's; simulate traces "
                     "inductor's code on fake tensors (memlab.step.compiled), measure reads the compiled step's peak")


def _decoder_estimate(step: StepConfig, tgt, budget: int | str | None, trainable_params: int | None,
                      frozen_activation_bytes: float, buckets: ZeroBuckets | None) -> MemoryReport:
    """A decoder's run (its shape the model) through :func:`memlab.lenses.decoder_estimate.estimate_run`,
    timed as every estimate is. LoRA and DeepSpeed's buffers are fields of its run."""
    if trainable_params is not None or frozen_activation_bytes:
        raise InputError("trainable_params and frozen_activation_bytes count adapters on memlab's GPT; a "
                         "decoder's LoRA is a field of its run: StepConfig(..., lora=LoraConfig(...))")
    if buckets is not None:
        step = replace(step, buckets=buckets)
    report = estimate_run(step, target=tgt, budget=budget)
    report.time = report_time(step, tgt.card)
    return report


def estimate_step(step: StepConfig | None = None, *, budget: int | str | None = None,
                  target: str | None = None, card: "Card | str | None" = None,
                  trainable_params: int | None = None,
                  frozen_activation_bytes: float = 0.0, buckets: ZeroBuckets | None = None,
                  **overrides) -> MemoryReport:
    """Closed-form peak bytes of one steady-state training step, by category, per rank: the one
    estimate of every model. memlab's GPT and UNet are counted here; a run whose model is a
    decoder's shape (a Hugging Face config read by :func:`memlab.hf.shape.decoder_shape`) by
    :func:`memlab.lenses.decoder_estimate.estimate_run`, the transformers class's own terms.

    ``batch`` is per rank; ``zero``, ``world_size`` and ``offload`` shard and move the model
    states as :func:`memlab.step.states.model_states` describes (DeepSpeed's layout, and its
    16-bit forward without autocast, when ZeRO or offload is on). ``host_bytes`` are the
    model states kept in host memory. ``target`` is the device whose autocast policy,
    kernels and workspaces the formulas follow (``"cpu"`` or ``"cuda"``,
    :mod:`memlab.policy`). Left out, it follows the card: ``card`` (a profile or preset name,
    :mod:`memlab.core.cards`) or a GPU preset budget means CUDA on that card, else the GPU this
    process sees, else (a CPU machine) the CPU (:func:`memlab.policy.resolve_target`).

    ``step.parallel.tensor`` (t, dividing ``world_size``): Megatron-style tensor parallelism
    inside groups of t ranks, data parallelism (and ZeRO) across the ``world_size / t``
    groups. A rank holds ``1/t`` of the ZeRO-sharded model states (norm weights, replicated,
    are counted as sharded: a fraction of a percent), its heads' and MLP columns' share of
    each block's activations, and a vocabulary-parallel loss; without sequence parallelism the
    residual stream, the norms and the checkpointed block inputs stay whole on every rank
    (:func:`activation_bytes`).

    ``trainable_params``: adapters trained on a frozen model (LoRA, :mod:`memlab.techniques.finetune`):
    the parameters grow by them, gradients and optimizer state are theirs alone, and autocast
    caches no weight copies (it caches casts of leaves that require grad only);
    ``frozen_activation_bytes`` are the activations the frozen layers do not keep.

    ``buckets``: DeepSpeed's bucket sizes as a run's config sets them
    (:class:`memlab.step.states.ZeroBuckets`, read by :mod:`memlab.hf.read_run_configs`) instead of memlab's.

    ``compile`` (``StepConfig.compile``, with ``activation_memory_budget``): a compiled GPT's
    forward and backward have no closed form (the partitioner's saved set, inductor's order of
    the backward's recomputation); they are traced once per shape on fake tensors as inductor
    runs them (:func:`compiled_pass_bytes`: seconds, only for a compiled step; the optimizer step in
    backward and activation offloading are traced with it), beside the closed-form model states and
    optimizer step.

    Args:
        step: the step (``None``: ``StepConfig()``); ``overrides`` replace its fields.
        budget: bytes, a size string or a GPU preset; the report says whether the step fits.
        target, card, trainable_params, frozen_activation_bytes, buckets: as above.

    Returns:
        A :class:`MemoryReport` (lens ``"estimate"``) of one rank.

    Raises:
        InputError: a field, preset, budget or tensor-parallel degree that is not allowed.

    Over 80 lines because its docstring documents each lens option; the body, about 50 lines,
    dispatches to the model's closed form.
    """
    tgt = resolve_target(target, budget, card)
    step = resolve_step(step, **overrides)
    cfg = step.model_config
    tp = step.parallel.tensor
    if isinstance(cfg, DecoderShape):
        return _decoder_estimate(step, tgt, budget, trainable_params, frozen_activation_bytes, buckets)
    if step.compile and not isinstance(cfg, UNetConfig) and (tp != 1 or trainable_params is not None):
        raise InputError("compile with a tensor-parallel degree or trainable_params is not in the estimate (its "
                         "compiled pass traces a whole, fully trained model on one rank); allowed: compile "
                         "without them, or simulate_step")
    if trainable_params is not None and step.optimizer in EIGHT_BIT:
        raise InputError(f"trainable_params with optimizer={step.optimizer!r}: 8-bit state is laid out per "
                         f"tensor, not per parameter; allowed: memlab.techniques.finetune.estimate_finetune "
                         f"(lora=..., optimizer={step.optimizer!r}), which lays it out over the adapters")
    if tp != 1:
        if not isinstance(cfg, GPTConfig):
            raise InputError(f"parallel.tensor={tp!r} needs a GPT model, got {cfg.name!r}")
        cfg.check_tensor_parallel(tp)
    # the states sharded over the data-parallel replicas, then split t ways (tensor_parallel_share)
    replicas = replace(step, world_size=data_parallel_ranks(step.world_size, tp), parallel=ParallelDims())
    ms = step_model_states(replicas, buckets)
    states = tensor_parallel_share(ms.peak_inputs(), tp)
    if trainable_params is not None:  # bytes per parameter are uniform: scale by the count
        share = trainable_params / cfg.num_params()
        states.update(parameters=states["parameters"] * (1 + share), frozen=frozen_activation_bytes,
                      gradients=states["gradients"] * share, optimizer=states["optimizer"] * share)
    # the forward runs in the precision the model is cast to (DeepSpeed: 16 bits, no autocast)
    run = replace(step, precision=ms.compute_precision) if ms.deepspeed else step
    if isinstance(cfg, UNetConfig):
        cats, moment = _unet_peak(run, cfg, states, tgt)
    else:
        cats, moment = _gpt_peak(run, cfg, states, tgt, tp)
    cats = {c: int(round(v)) for c, v in cats.items()}
    host = {c: int(round(v)) for c, v in tensor_parallel_share(
        {c: ms.host.get(c, 0.0) for c in CATEGORIES}, tp).items()}
    report = MemoryReport("estimate", step, f"formula ({tgt.name})", sum(cats.values()), cats,
                          resolve_budget(budget), None, host_bytes=sum(host.values()),
                          host_by_category=host)
    report.notes.append(f"peak moment: {moment}")
    if step.compile:
        report.notes.append(UNET_COMPILE_NOTE if isinstance(cfg, UNetConfig) else COMPILE_NOTE)
        if not isinstance(cfg, UNetConfig):
            report.notes.extend(lowering_notes(tgt.is_cuda))
    if step.activation_offload and step.compile and not isinstance(cfg, UNetConfig):
        report.notes.append(COMPILED_OFFLOAD_NOTE)
    elif step.activation_offload:
        report.notes.append("activation_offload is not in this formula (the peak is the plain step's): "
                            "save_on_cpu copies every saved tensor, weights and views included; "
                            "simulate counts its device and host bytes (memlab.step.activation_offload)")
    if tgt.is_cuda:
        report.notes.append(ALLOCATOR_NOTE)
    report.notes.extend(ms.notes)
    if tp > 1:
        report.notes.append(f"tensor parallel t={tp} (Megatron layout, no sequence parallelism: "
                            f"block inputs and norms whole on every rank) x data parallel "
                            f"{step.world_size // tp}")
    if report.host_bytes and step.optimizer not in PAGED:  # a paged state's note is ms.notes'
        report.notes.append("host_bytes: the model states in host memory (pinned buffers at the "
                            "CUDA host allocator's power-of-two sizes); the CPU optimizer's "
                            "scratch during its step is not counted")
    report.time = report_time(step, tgt.card)
    if step.world_size > 1:
        report.per_rank = [replace(report, per_rank=None, notes=list(report.notes))
                           for _ in range(step.world_size)]
    return report
