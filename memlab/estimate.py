"""Estimate: the bytes of one training step, in closed form.

Two parts, as in the literature:

* **Model states** (:mod:`memlab.states`, the one source): plain PyTorch keeps 4 + 4 + 8
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
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .hardware import resolve_budget
from .step import MemoryReport, StepConfig, autocast_for, resolve_step
from .models import GPTConfig, UNet, UNetConfig
from .policy import (Target, activation_copies, attention_probs_bytes, cross_entropy_moments,
                     emulate, get_target, norm_saves, precision_bytes, sdpa_backend,
                     sdpa_lse_bytes)
from .states import model_state_bytes, model_states, zero_formula  # noqa: F401 (re-exported)
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
    # DeepSpeed's own buffers (memlab.states.ModelStates.peak_inputs; zero for plain PyTorch):
    # gradient bytes held all step, a gradient partition allocated at the first reduce bucket
    # (ZeRO-2), the optimizer step's scratch, ZeRO-3's gathered parameters
    held, late = states.get("held", 0.0), states.get("late", 0.0)
    scratch, gathered = states.get("step", 0.0), states.get("gathered", 0.0)
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
    for moment, saved, scratch_per_logit in d.loss_moments:
        cast_cache = cached if moment == "loss forward" else 0
        m[moment] = dict(activations=A - lse + t * v * saved, gradients=G_prev + held,
                         temporaries=t * v * scratch_per_logit + cast_cache + gathered)
    # the head's backward: logits gradient, gradient of the final norm's output, head grad
    m["head backward"] = dict(activations=A - lse, gradients=max(G_prev, head_grad) + held,
                              temporaries=t * v * d.compute + t * h * d.compute + gathered)
    layer = (layer_activation_bytes(cfg, seq, batch, step.precision, target.name)
             + d.weight_copy * _linear_weights(cfg)[0])
    # one block's backward: the MLP's two hidden-size gradients and the residual gradient
    transient = t * f * d.compute + t * h * d.residual
    if cfg.checkpointing == "full":
        # the block recomputed last (block 0) holds its activations again, with nearly all grads
        m["recomputed block"] = dict(activations=acts["embedding"],
                                     gradients=max(G_prev, G - layer_grad, late) + held,
                                     temporaries=layer + transient + gathered)
        m["first recomputed block"] = dict(
            activations=A - lse - acts["final_norm"],
            gradients=max(G_prev, head_grad + late) + held,
            temporaries=layer + transient + gathered)
    else:
        m["first block backward"] = dict(activations=A - lse - acts["final_norm"],
                                         gradients=max(G_prev, head_grad + late) + held,
                                         temporaries=transient + t * f * d.compute + gathered)
    # end of backward: all gradients; a tied embedding adds its dense gradient, then the sum
    tied = 2 * head_grad if cfg.tie_embeddings else 0.0
    m["end of backward"] = dict(gradients=G + held, temporaries=tied + t * h * d.residual)
    m["optimizer step"] = dict(gradients=G + held, temporaries=scratch)
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
    grads = states["gradients"] if step.micro_batches > 1 else 0
    out.update(parameters=states["parameters"], optimizer=states["optimizer"], other=other,
               activations=acts, gradients=grads + states.get("held", 0.0),
               temporaries=states.get("gathered", 0.0), workspace=workspace)
    return out, "start of backward"


def estimate_step(step: StepConfig | None = None, *, budget: int | str | None = None,
                  target: str = "cpu", **overrides) -> MemoryReport:
    """Closed-form peak bytes of one steady-state training step, by category, per rank.

    ``batch`` is per rank; ``zero``, ``world_size`` and ``offload`` shard and move the model
    states as :func:`memlab.states.model_states` describes (DeepSpeed's layout, and its
    16-bit forward without autocast, when ZeRO or offload is on). ``host_bytes`` are the
    model states kept in host memory. ``target`` is the device whose autocast policy,
    kernels and workspaces the formulas follow (``"cpu"`` or ``"cuda"``,
    :mod:`memlab.policy`); a GPU preset budget picks the card's cuBLAS workspace.
    """
    tgt = get_target(target, budget)
    step = resolve_step(step, **overrides)
    cfg = step.model_config
    ms = model_states(cfg, precision=step.precision, optimizer=step.optimizer, zero=step.zero,
                      world_size=step.world_size, offload=step.offload)
    states = ms.peak_inputs()
    # the forward runs in the precision the model is cast to (DeepSpeed: 16 bits, no autocast)
    run = replace(step, precision=ms.compute_precision) if ms.deepspeed else step
    if isinstance(cfg, UNetConfig):
        cats, moment = _unet_peak(run, cfg, states, tgt)
    else:
        cats, moment = _gpt_peak(run, cfg, states, tgt)
    cats = {c: int(round(v)) for c, v in cats.items()}
    host = {c: int(round(ms.host.get(c, 0.0))) for c in CATEGORIES}
    report = MemoryReport("estimate", step, f"formula ({tgt.name})", sum(cats.values()), cats,
                          resolve_budget(budget), None, host_bytes=sum(host.values()),
                          host_by_category=host)
    report.notes.append(f"peak moment: {moment}")
    report.notes.extend(ms.notes)
    if report.host_bytes:
        report.notes.append("host_bytes: the model states in host memory (pinned buffers at the "
                            "CUDA host allocator's power-of-two sizes); the CPU optimizer's "
                            "scratch during its step is not counted")
    if step.world_size > 1:
        report.per_rank = [replace(report, per_rank=None, notes=list(report.notes))
                           for _ in range(step.world_size)]
    return report
