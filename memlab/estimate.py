"""Estimate: the bytes of one training step, in closed form.

Two parts, as in the literature:

* **Model states** (Rajbhandari et al. 2020, "ZeRO", section 3.1): with mixed-precision Adam
  every parameter costs 2 + 2 + K bytes (fp16 weights and gradients, K = 12 for the fp32
  master copy, momentum and variance); in fp32 it costs 4 + 4 + 8. ZeRO stage 1 divides the
  optimizer states by the data-parallel degree N, stage 2 also the gradients, stage 3 also the
  parameters (section 5, figure 1).
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
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .hardware import resolve_budget
from .step import MemoryReport, StepConfig, autocast_for, resolve_step
from .models import GPTConfig, UNet, UNetConfig
from .policy import (Target, activation_copies, attention_probs_bytes, cross_entropy_moments,
                     emulate, get_target, norm_saves, precision_bytes, sdpa_backend,
                     sdpa_lse_bytes)
from .tracking import CATEGORIES


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
    target: str     # the device the sizes are for


def dtypes(precision: str, target: str = "cpu") -> Dtypes:
    """Element sizes for ``fp32``, ``bf16``/``fp16`` autocast (fp32 master weights) and
    ``pure-bf16`` on a ``target`` (``cpu`` or ``cuda``). Under autocast, matmuls run in 16
    bits; what else does depends on the device's op lists (:data:`memlab.policy.AUTOCAST`):
    on CUDA softmax and the loss's ``nll_loss`` run in fp32, on CPU the whole cross-entropy.
    """
    get_target(target)  # validates the name
    param, compute, lower = precision_bytes(precision)
    residual = param  # the embedding output and the residual adds stay in the weights' dtype
    moments = tuple(cross_entropy_moments(target, precision))
    return Dtypes(param=param, grad=param, compute=compute, residual=residual,
                  softmax=moments[0][1], weight_copy=lower or 0,
                  probs=attention_probs_bytes(target, precision), loss_moments=moments,
                  target=target)


def optimizer_bytes_per_param(optimizer: str, precision: str) -> int:
    """AdamW keeps two moments per parameter, SGD with momentum one, in the parameter dtype."""
    per = {"adamw": 2, "sgd": 1}
    if optimizer not in per:
        raise ValueError(f"optimizer={optimizer!r}; allowed: adamw, sgd")
    return per[optimizer] * dtypes(precision).param


def model_state_bytes(num_params: int, *, precision: str = "fp32", optimizer: str = "adamw",
                      zero: int = 0, world_size: int = 1, offload: str = "none") -> dict[str, float]:
    """Parameters, gradients and optimizer state per rank, with ZeRO and offload.

    Stage 0 replicates everything; stages 1-3 shard optimizer state (with DeepSpeed's fp32
    master partition, counted as optimizer state as in the paper's K), then gradients, then
    parameters over ``world_size`` ranks. ``offload="optimizer"`` moves optimizer state and
    master weights to host memory (ZeRO-Offload, Ren et al. 2021); ``"all"`` also the
    parameters (ZeRO-3 offload): those bytes leave the device and are reported as host bytes.
    """
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {zero!r} is outside 0-3")
    if world_size < 1:
        raise ValueError(f"world size {world_size!r} must be >= 1")
    d = dtypes(precision)
    n = world_size
    params = d.param * num_params
    grads = d.grad * num_params
    opt = optimizer_bytes_per_param(optimizer, precision) * num_params
    if zero >= 1:
        opt = (opt + 4 * num_params) / n  # the fp32 master partition DeepSpeed keeps
    if zero >= 2:
        grads /= n
    if zero >= 3:
        params /= n
    host = 0.0
    if offload in ("optimizer", "all"):
        host += opt
        opt = 0.0
    if offload == "all":
        host += params
        params = 0.0
    return {"parameters": params, "gradients": grads, "optimizer": opt, "host": host}


def zero_formula(num_params: int, stage: int, world_size: int, *, param_bytes: int = 2,
                 grad_bytes: int = 2, k: int = 12) -> dict[str, float]:
    """Model-state bytes per rank from the ZeRO paper (Rajbhandari et al. 2020, sec. 5.1):
    (2 + 2 + K) psi for mixed-precision Adam (K = 12: fp32 master, momentum, variance);
    stage 1 divides K psi by N_d, stage 2 also the gradients, stage 3 also the parameters."""
    if stage not in (0, 1, 2, 3) or world_size < 1:
        raise ValueError(f"stage must be 0-3 and world_size >= 1, got {stage}, {world_size}")
    n = world_size
    return {"parameters": param_bytes * num_params / (n if stage >= 3 else 1),
            "gradients": grad_bytes * num_params / (n if stage >= 2 else 1),
            "optimizer": k * num_params / (n if stage >= 1 else 1)}


def _linear_weights(cfg: GPTConfig) -> tuple[int, int]:
    """Elements of matmul weights per layer and in the head (autocast copies these)."""
    d, f = cfg.d_model, cfg.hidden
    per_layer = 4 * d * d + (3 if cfg.mlp == "swiglu" else 2) * d * f
    return per_layer, cfg.vocab_size * d


def layer_activation_bytes(cfg: GPTConfig, seq: int, batch: int, precision: str,
                           target: str = "cpu") -> float:
    """Bytes one transformer block saves for backward (no checkpointing).

    With ``t = s*b`` tokens, ``h = d_model``, ``f`` the MLP width and ``a`` heads, in element
    sizes of :func:`dtypes` (R residual, C compute): two residual adds ``2thR`` (when the
    norms keep their input); per norm its output ``thC`` plus what :func:`memlab.policy.norm_saves`
    says it keeps; q, k, v ``3thC``; the attention output ``thC``; with naive attention the
    probabilities ``a s^2 b P`` (P: :func:`memlab.policy.attention_probs_bytes`) and the
    causal mask ``s^2`` bytes, with SDPA the kernel's log-sum-exp; the MLP ``2tfC`` (SwiGLU
    ``4tfC``); rotary q, k ``2thC``.
    """
    d = dtypes(precision, target)
    t, h, f, a, s = seq * batch, cfg.d_model, cfg.hidden, cfg.n_head, seq
    C = d.compute
    total = 2 * t * h * _residual_saved(cfg, d) + 2 * _norm_bytes(cfg, d, t) + 4 * t * h * C
    if cfg.mlp == "swiglu":  # the second norm's output feeds two matmuls (gate, up)
        total += (activation_copies(precision, 2) - 1) * t * h * C
    if cfg.checkpointing != "selective":
        if cfg.attention == "naive":
            total += a * s * s * batch * d.probs + s * s
        else:
            total += sdpa_lse_bytes(sdpa_backend(target, C, cfg.head_dim), batch, a, s)
    total += (4 if cfg.mlp == "swiglu" else 2) * t * f * C
    if cfg.position == "rope":
        if cfg.attention == "sdpa" or cfg.checkpointing == "selective":
            total += 2 * t * h * C  # rotated q and k (naive attention saves copies instead)
        if C != 4:
            total += 2 * s * cfg.head_dim * C  # cos and sin cast to the compute dtype
    return total


def _residual_saved(cfg: GPTConfig, d: Dtypes) -> int:
    """Bytes per element of the residual stream kept for the norms' backward (none when
    the norm keeps an fp32 upcast instead, counted in :func:`_norm_bytes`)."""
    keeps_input, _, _ = norm_saves(d.target, cfg.norm, d.residual)
    return d.residual if keeps_input else 0


def _norm_bytes(cfg: GPTConfig, d: Dtypes, t: int) -> int:
    """One norm's saved bytes: its output as the next matmul saves it (``thC``) and what
    the norm itself keeps per element and per row (:func:`memlab.policy.norm_saves`)."""
    _, per_element, per_row = norm_saves(d.target, cfg.norm, d.residual)
    return t * cfg.d_model * (d.compute + per_element) + t * per_row


def activation_bytes(cfg: GPTConfig, seq: int, batch: int, precision: str,
                     target: str = "cpu") -> dict[str, float]:
    """Saved-for-backward bytes of the whole forward, split into its parts."""
    d = dtypes(precision, target)
    t, h, v = seq * batch, cfg.d_model, cfg.vocab_size
    layer_w, head_w = _linear_weights(cfg)
    final_norm = _norm_bytes(cfg, d, t)
    embed = t * h * _residual_saved(cfg, d) + (8 * seq if cfg.position == "learned" else 0)
    if cfg.checkpointing == "full":
        layers = cfg.n_layer * t * h * d.residual  # each block keeps its input only
        copies = d.weight_copy * head_w
    else:
        layers = cfg.n_layer * layer_activation_bytes(cfg, seq, batch, precision, target)
        copies = d.weight_copy * (cfg.n_layer * layer_w + head_w)
    return {"embedding": embed, "layers": layers, "final_norm": final_norm,
            "weight_copies": copies, "log_softmax": t * v * d.softmax}


def _gpt_peak(step: StepConfig, cfg: GPTConfig, states: dict[str, float],
              target: Target) -> tuple[dict, str]:
    """Categories at the step's peak moment, and which moment that is."""
    d = dtypes(step.precision, target.name)
    k = step.micro_batches
    seq, batch = step.seq, step.batch // k
    t, h, f, v, L = seq * batch, cfg.d_model, cfg.hidden, cfg.vocab_size, cfg.n_layer
    P, G, O = states["parameters"], states["gradients"], states["optimizer"]
    acts = activation_bytes(cfg, seq, batch, step.precision, target.name)
    A = sum(acts.values())
    head_grad = v * h * d.grad / (step.world_size if step.zero >= 2 else 1)
    layer_grad = G * (1 - v * h / cfg.num_params()) / L if L else 0
    # With accumulation, gradients of earlier micro-batches are already there.
    G_prev = G if k > 1 else 0.0
    lse = acts["log_softmax"]
    # Autocast's weight casts live until the forward ends; under full checkpointing autograd
    # does not keep them, so at the loss they are scratch (policy._CastCache).
    cached = d.weight_copy * L * _linear_weights(cfg)[0] if cfg.checkpointing == "full" else 0
    m = {}
    # the loss's forward and backward, one moment per tensor it makes, all activations alive
    for moment, saved, scratch in d.loss_moments:
        m[moment] = dict(activations=A - lse + t * v * saved, gradients=G_prev,
                         temporaries=t * v * scratch + (cached if moment == "loss forward" else 0))
    # the head's backward: logits gradient, gradient of the final norm's output, head grad
    m["head backward"] = dict(activations=A - lse, gradients=max(G_prev, head_grad),
                              temporaries=t * v * d.compute + t * h * d.compute)
    layer = (layer_activation_bytes(cfg, seq, batch, step.precision, target.name)
             + d.weight_copy * _linear_weights(cfg)[0])
    # one block's backward: the MLP's two hidden-size gradients and the residual gradient
    transient = t * f * d.compute + t * h * d.residual
    if cfg.checkpointing == "full":
        # the block recomputed last (block 0) holds its activations again, with nearly all grads
        m["recomputed block"] = dict(activations=acts["embedding"],
                                     gradients=max(G_prev, G - layer_grad),
                                     temporaries=layer + transient)
        m["first recomputed block"] = dict(
            activations=A - lse - acts["final_norm"], gradients=max(G_prev, head_grad),
            temporaries=layer + transient)
    else:
        m["first block backward"] = dict(activations=A - lse - acts["final_norm"],
                                         gradients=max(G_prev, head_grad),
                                         temporaries=transient + t * f * d.compute)
    # end of backward: all gradients; a tied embedding adds its dense gradient, then the sum
    tied = 2 * head_grad if cfg.tie_embeddings else 0.0
    m["end of backward"] = dict(gradients=G, temporaries=tied + t * h * d.residual)
    m["optimizer step"] = dict(gradients=G)
    name, best = max(m.items(), key=lambda kv: sum(kv[1].values()))
    out = dict.fromkeys(CATEGORIES, 0.0)
    out.update(parameters=P, optimizer=O, other=_gpt_other(cfg, step),
               workspace=target.resident_workspace(), **best)
    return out, name


def _gpt_other(cfg: GPTConfig, step: StepConfig) -> int:
    """Token ids and targets (int64) and the rotary tables (fp32 buffers)."""
    rope = 2 * cfg.block_size * cfg.head_dim * 4 * cfg.n_layer if cfg.position == "rope" else 0
    return 2 * 8 * step.seq * step.batch + rope


def _unet_peak(step: StepConfig, cfg: UNetConfig, states: dict[str, float],
               target: Target) -> tuple[dict, str]:
    """UNet activations by counting each module's saved tensors on a shape walk."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .tracking import MemoryTracker

    # A conv net's saved tensors depend on every resolution, so we count them on a fake
    # forward (no memory, milliseconds) rather than in a hand-written table, under the
    # target's autocast policy and kernels (memlab.policy).
    accounting = target.accounting()
    with FakeTensorMode(), emulate(target):
        model = UNet(cfg)
        b = step.batch // step.micro_batches
        x = torch.randn(b, cfg.channels, step.seq, step.seq)
        with MemoryTracker(accounting=accounting) as mt:
            mt.track_model(model)
            with autocast_for(step.precision, torch.device("cpu")):
                loss = model(x, torch.randint(0, 1000, (b,)), torch.randn_like(x))
            mt.mark_phase("backward")
            acts = mt.by_category()["activations"]
            # the largest per-call workspace of the forward's kernels; backward's calls on
            # the same shapes need as much (policy.conv_workspace)
            workspace = max((e.by_category[CATEGORIES.index("workspace")] for e in mt.timeline),
                            default=0)
        del loss, model
    out = dict.fromkeys(CATEGORIES, 0.0)
    # images, timesteps and noise of the whole batch
    other = 4 * step.batch * (2 * cfg.channels * step.seq ** 2) + 8 * step.batch
    out.update(parameters=states["parameters"], optimizer=states["optimizer"], other=other,
               activations=acts, gradients=states["gradients"] if step.micro_batches > 1 else 0,
               workspace=workspace)
    return out, "start of backward"


def estimate_step(step: StepConfig | None = None, *, budget: int | str | None = None,
                  target: str = "cpu", **overrides) -> MemoryReport:
    """Closed-form peak bytes of one steady-state training step, by category, per rank.

    ``batch`` is per rank; ``zero``, ``world_size`` and ``offload`` shard and move the model
    states as :func:`model_state_bytes` describes. ``target`` is the device whose autocast
    policy, kernels and workspaces the formulas follow (``"cpu"`` or ``"cuda"``,
    :mod:`memlab.policy`); a GPU preset budget picks the card's cuBLAS workspace.
    """
    tgt = get_target(target, budget)
    step = resolve_step(step, **overrides)
    cfg = step.model_config
    states = model_state_bytes(cfg.num_params(), precision=step.precision,
                               optimizer=step.optimizer, zero=step.zero,
                               world_size=step.world_size, offload=step.offload)
    if isinstance(cfg, UNetConfig):
        cats, moment = _unet_peak(step, cfg, states, tgt)
    else:
        cats, moment = _gpt_peak(step, cfg, states, tgt)
    cats = {c: int(round(v)) for c, v in cats.items()}
    report = MemoryReport("estimate", step, f"formula ({tgt.name})", sum(cats.values()), cats,
                          resolve_budget(budget), None)
    report.notes.append(f"peak moment: {moment}")
    if states["host"]:
        report.notes.append(f"host memory (offloaded): {int(states['host'])} bytes")
    if step.world_size > 1:
        report.per_rank = [replace(report, per_rank=None, notes=list(report.notes))
                           for _ in range(step.world_size)]
    return report
