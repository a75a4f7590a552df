"""The floating-point operations of one training step: counted on the step, and in closed form.

Two ways to the same number, so each checks the other (``tests/test_flops.py``):

* **Counted** (:func:`count_step_flops`, the simulation's ``time.flops``): the step runs under
  :class:`PhaseFlopCounter`, which applies ``torch.utils.flop_counter``'s formulas (the ones
  ``FlopCounterMode`` uses) op by op, on real or fake tensors, and files each op under the
  part of the step it belongs to: ``forward``; ``backward`` (ops the autograd engine runs);
  ``recompute`` (ops run inside the engine with grad mode on: what non-reentrant
  checkpointing re-runs of the forward). torch counts matmuls and attention kernels only, at
  2 FLOPs a multiply-add; elementwise ops, norms and the optimizer are not counted (a few
  percent of a transformer's work, and memory-bound). torch has no formula for the CPU's
  fused attention (``_scaled_dot_product_flash_attention_for_cpu``): :data:`CPU_SDPA` gives it
  the CUDA kernels' formula, so the CPU and a card count the same step the same.
* **Closed form** (:func:`gpt_step_flops`, the estimate's ``time.flops``), per layer, with
  ``t = b s`` tokens of the whole step (micro-batches split the batch, not the work):

  - every matmul ``W`` (``in x out``) costs ``2 t |W|`` forward and ``4 t |W|`` backward (the
    input's gradient and the weight's, ``2 t |W|`` each): summed over the model that is the
    "6N per token" rule (Kaplan et al. 2020, sec. 2.1), N the matmul weights, embeddings
    excluded (a lookup is no matmul);
  - attention adds ``4 b s^2 h`` forward (``q k^T`` and ``p v``, ``h = n_head d_head``), and
    backward ``8 b s^2 h`` for naive attention (two products per matmul) or ``10 b s^2 h`` for
    a fused kernel, which recomputes ``q k^T`` in its backward (torch's
    ``sdpa_backward_flop_count``). **Causality:** these are the full ``s x s`` square, as torch
    counts them and as PaLM's MFU does (Chowdhery et al. 2022, appendix B); a causal
    FlashAttention kernel skips the masked upper triangle, so it does about half of the
    attention term's work;
  - recompute: full checkpointing re-runs each block's forward except its last matmul
    (``mlp.out``): non-reentrant checkpointing stops once every tensor backward needs exists
    again, and a matmul saves its inputs before it runs (``torch.utils.checkpoint``'s early
    stop); selective checkpointing re-runs the attention core: the fused kernel whole
    (backward needs its output and log-sum-exp), naive attention only ``q k^T`` (the last
    product is skipped for the same reason);
  - LoRA (Hu et al. 2021, sec. 4.1): a frozen weight passes gradients through (``2 t |W|``
    backward) but gets none; a matmul whose input and weight need no gradient (the first
    layer's projections before any adapter, on a frozen embedding) has no backward at all;
    each adapter is two matmuls ``A`` (r x in), ``B`` (out x r) with their own 2 + 4;
  - the chunked loss (:mod:`memlab.models.chunked_loss`) recomputes each chunk's logits in its
    backward: the head costs ``6 t h V`` backward instead of ``4 t h V`` (filed under
    backward, where the counter finds it: the autograd engine runs it).

Mixtures of experts are not in memlab's models; their FLOPs would be those of the active
parameters (the experts a token is routed to), which this per-matmul rule gives when the
expert matmuls are counted once per routed token.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch.utils import flop_counter

from memlab.core.errors import InputError
from memlab.core.torch_private import FakeTensorMode, TorchDispatchMode, in_backward
from memlab.models.gpt_unet import GPTConfig, UNetConfig
from memlab.step.training_step import batch_to, build_trainer, make_batch

PARTS = ("forward", "backward", "recompute")

aten = torch.ops.aten


def _sdpa_shapes(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query, key, value)


def _sdpa_backward_shapes(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)


#: torch's formulas for the CPU's fused attention (the CUDA kernels' formulas, on the same
#: leading arguments: query, key, value; backward: grad_out, query, key, value), on shapes:
#: ``FlopCounterMode(custom_mapping=CPU_SDPA)`` counts a CPU step as a card's
CPU_SDPA = {
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_shapes,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward_shapes,
}


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one optimizer step (all its micro-batches), by part.

    ``attention`` is the ``s^2`` term inside the three parts (the full square, see the module
    doc); ``source`` says how they were found (``"formula"`` or ``"counted"``).
    """

    forward: int
    backward: int
    recompute: int = 0
    attention: int = 0
    source: str = "formula"
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def total(self) -> int:
        """Every FLOP the step runs: forward + backward + recompute."""
        return self.forward + self.backward + self.recompute

    @property
    def model(self) -> int:
        """The FLOPs MFU counts: forward and backward, without recomputation (PaLM, app. B)."""
        return self.forward + self.backward

    def to_dict(self) -> dict:
        return {"forward": self.forward, "backward": self.backward, "recompute": self.recompute,
                "attention": self.attention, "total": self.total, "source": self.source}


class PhaseFlopCounter(TorchDispatchMode):
    """``FlopCounterMode``'s formulas, op by op, filed by part of the step (module doc).

    Use as a context manager around a whole step; read :attr:`counts` or :meth:`flops`.
    Under the autograd engine (a backward pass) an op with grad mode on is recomputation: the
    engine runs backward functions with grad mode off, and non-reentrant checkpointing turns
    it on to re-run the forward.
    """

    def __init__(self) -> None:
        super().__init__()
        registry = dict(flop_counter.flop_registry)
        registry.update({k: flop_counter.shape_wrapper(v) for k, v in CPU_SDPA.items()})
        self.registry = registry
        self.counts = dict.fromkeys(PARTS, 0)
        self.attention = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.registry.get(func.overloadpacket)
        if formula is not None:
            n = int(formula(*args, **kwargs, out_val=out))
            part = ("recompute" if torch.is_grad_enabled() else "backward") if in_backward() else "forward"
            self.counts[part] += n
            name = func.overloadpacket.__name__
            if "attention" in name or (name == "bmm" and _is_score_bmm(args)):
                self.attention += n
        return out

    def flops(self) -> StepFlops:
        """What was counted, as :class:`StepFlops` (``source="counted"``)."""
        c = self.counts
        return StepFlops(c["forward"], c["backward"], c["recompute"], self.attention, "counted")


def _is_score_bmm(args) -> bool:
    """A batched matmul of attention: memlab's GPT and HF's Llama have no other ``bmm``
    but HF's rotary angles, whose inner dimension is 1."""
    return (len(args) >= 2 and all(isinstance(a, torch.Tensor) and a.dim() == 3 for a in args[:2])
            and args[0].shape[-1] > 1)


def count_step_flops(step, *, fake: bool = True, device: str = "cpu") -> StepFlops:
    """Count one steady-state step of ``step`` (a :class:`memlab.step.training_step.StepConfig`) with
    :class:`PhaseFlopCounter`: on fake tensors (no memory, no arithmetic; the default) or on
    a real model on ``device``. The optimizer's state is made first, so only the step is counted.

    Returns:
        :class:`StepFlops` with ``source="counted"``.
    """
    counter, = run_counted_step(step, PhaseFlopCounter(), fake=fake, device=device)
    return counter.flops()


def run_counted_step(step, *modes: TorchDispatchMode, fake: bool = True, device: str = "cpu") -> tuple:
    """Run one steady-state step of ``step`` inside ``modes`` (counters such as
    :class:`PhaseFlopCounter`), on fake tensors (the default) or a real model on ``device``;
    the optimizer's state is made first, so only the step runs inside them.

    Returns:
        ``modes``, having counted the step.
    """
    with FakeTensorMode() if fake else contextlib.nullcontext():
        trainer = build_trainer(step, "cpu" if fake else device, fake=fake)
        trainer.warm_up_optimizer()
        batch = batch_to(random_batch(step) if fake else make_batch(step, device), step)
        with contextlib.ExitStack() as stack:
            for mode in modes:
                stack.enter_context(mode)
            trainer.step(batch)
    return modes


def random_batch(step) -> tuple:
    """A step's inputs of its shapes, made inside a fake mode (the corpus is a real tensor), or
    anywhere random inputs will do.

    Returns:
        ``(idx, targets)`` for a GPT, ``(x, t, noise)`` for a UNet.
    """
    cfg = step.model_config
    if isinstance(cfg, UNetConfig):
        x = torch.randn(step.batch, cfg.channels, step.seq, step.seq)
        return x, torch.randint(0, 1000, (step.batch,)), torch.randn_like(x)
    return tuple(torch.randint(0, cfg.vocab_size, (step.batch, step.seq)) for _ in range(2))


# ------------------------------------------------------------------------------------------
# Closed form
# ------------------------------------------------------------------------------------------
def _block_matmuls(cfg: GPTConfig) -> list[tuple[str, int, int, tuple[str, ...]]]:
    """(part, in, out, the Hugging Face LoRA names of it) for each matmul of one block."""
    d, f, hd = cfg.d_model, cfg.hidden, cfg.head_dim
    q, kv = cfg.n_head * hd, cfg.kv_heads * hd
    if cfg.mlp == "swiglu":
        return [("q", d, q, ("q_proj",)), ("k", d, kv, ("k_proj",)), ("v", d, kv, ("v_proj",)),
                ("o", q, d, ("o_proj",)), ("gate", d, f, ("gate_proj",)), ("up", d, f, ("up_proj",)),
                ("down", f, d, ("down_proj",))]
    return [("qkv", d, q + 2 * kv, ("c_attn",)), ("o", q, d, ("c_proj",)),
            ("up", d, f, ("c_fc",)), ("down", f, d, ("c_proj",))]


def lora_matmuls(cfg: GPTConfig, targets: Iterable[str]) -> list[tuple[str, int, int]]:
    """(part, in, out) of each matmul of one block that a LoRA adapter on ``targets`` (Hugging
    Face names) tunes; an unknown name is bad input."""
    blocks = _block_matmuls(cfg)
    wanted = set(targets)
    known = {n for *_, names in blocks for n in names}
    if not wanted or wanted - known:
        raise InputError(f"LoRA targets {sorted(wanted - known) or sorted(wanted)!r}; "
                         f"allowed: {', '.join(sorted(known))}")
    return [(part, i, o) for part, i, o, names in blocks if wanted & set(names)]


def block_matmuls(cfg: GPTConfig) -> list[tuple[str, int, int]]:
    """The matmuls of one block of ``cfg`` as the closed form counts them.

    Args:
        cfg: memlab's GPT config.

    Returns:
        ``(part, in, out)`` per matmul (the time lens times each GEMM by its shape).
    """
    return [(part, i, o) for part, i, o, _ in _block_matmuls(cfg)]


def gpt_step_flops(cfg: GPTConfig, seq: int, batch: int, *, checkpointing: str | None = None,
                   attention: str | None = None, lora_rank: int | None = None,
                   lora_targets: Iterable[str] = ()) -> StepFlops:
    """Closed-form FLOPs of one training step of a GPT-shaped model (module doc's rules).

    Args:
        cfg: the model (memlab's GPT, or a Hugging Face config mapped by :func:`memlab.hf.config.gpt_config`).
        seq, batch: tokens per sequence and sequences per step (all micro-batches).
        checkpointing, attention: override ``cfg``'s (``none``/``full``/``selective``,
            ``sdpa``/``naive``).
        lora_rank, lora_targets: LoRA adapters on the named modules of every layer (Hugging
            Face names, :mod:`memlab.techniques.finetune`); the rest of the model is frozen.

    Returns:
        :class:`StepFlops` (``source="formula"``).

    Over 80 lines because it is the FLOP count's closed form, one line per matmul and attention term
    (module doc's rules).
    """
    ckpt = checkpointing or cfg.checkpointing
    attn = attention or cfg.attention
    if ckpt not in ("none", "full", "selective", "op"):
        raise InputError(f"checkpointing={ckpt!r}; allowed: none, full, selective, op")
    if attn not in ("sdpa", "naive"):
        raise InputError(f"attention={attn!r}; allowed: sdpa, naive")
    targets = set(lora_targets)
    lora = lora_rank is not None
    if lora and (not targets or isinstance(lora_rank, bool) or lora_rank < 1):
        raise InputError(f"LoRA needs a positive rank and target modules, got rank={lora_rank!r}, "
                         f"targets={sorted(targets)!r}")
    t, s, r = seq * batch, seq, lora_rank or 0
    h = cfg.n_head * cfg.head_dim
    matmuls = _block_matmuls(cfg)
    known = {n for *_, names in matmuls for n in names}
    if targets - known:
        raise InputError(f"LoRA targets {sorted(targets - known)!r}; allowed: {', '.join(sorted(known))}")
    att_fwd = 4 * batch * s * s * h
    att_bwd = (10 if attn == "sdpa" else 8) * batch * s * s * h
    fwd = bwd = rec = att = 0
    # does the residual stream entering the block need a gradient? A trainable embedding: yes;
    # a frozen one: no, unless checkpointing is on, where peft makes the embedding's output
    # require grad so that checkpointed blocks pass one (PeftModel's
    # _prepare_model_for_gradient_checkpointing -> enable_input_require_grads)
    stream = not lora or ckpt == "full"
    for _layer in range(cfg.n_layer):
        grads: dict[str, bool] = {}  # does this matmul's output need a gradient?
        layer_fwd = 0
        for part, i, o, names in matmuls:
            tuned = bool(targets & set(names))
            x_grad = stream if part in ("q", "k", "v", "qkv") else _input_grad(part, grads, stream)
            f = 2 * t * i * o + (2 * t * r * (i + o) if tuned else 0)
            fwd += f
            # the last matmul is not re-run; with an adapter on it, the base and A are (B is last)
            layer_fwd += f if part != "down" else (2 * t * i * o + 2 * t * r * i if tuned else 0)
            if not lora:
                bwd += 4 * t * i * o
            else:
                bwd += 2 * t * i * o if x_grad else 0  # frozen weight: the input's gradient only
                if tuned:  # B: weight and input grads; A: weight grad, input grad if x needs one
                    bwd += 4 * t * r * o + 2 * t * r * i + (2 * t * r * i if x_grad else 0)
            grads[part] = x_grad or tuned
        q_g, k_g, v_g = ((grads["qkv"],) * 3 if "qkv" in grads
                         else (grads["q"], grads["k"], grads["v"]))
        fwd += att_fwd
        att += att_fwd
        if attn == "sdpa":
            b = att_bwd if (q_g or k_g or v_g) else 0
        else:  # autograd computes only the gradients that are needed
            half = att_bwd // 4  # one product of the two that each matmul's backward has
            b = half * ((q_g + k_g) + (q_g or k_g) + v_g)
        bwd += b
        att += b
        if ckpt == "full":
            rec += layer_fwd + att_fwd
            att += att_fwd
        elif ckpt == "op":  # every second matmul of the call order is not saved (qkv, o, gate, up,
            # down: o and up; GELU's qkv, o, up, down: o and down), and the recompute stops once
            # backward's tensors exist, so GELU's down (the last) is never re-run
            again = {"o", "up"} if cfg.mlp == "swiglu" else {"o"}
            rec += sum(2 * t * i * o for part, i, o, _ in matmuls if part in again)
        elif ckpt == "selective":
            a = att_fwd if attn == "sdpa" else att_fwd // 2
            rec += a
            att += a
        stream = stream or any(grads.values())
    head = 2 * t * cfg.d_model * cfg.vocab_size
    fwd += head
    if lora:
        bwd += head if stream else 0
    else:
        bwd += (3 if cfg.loss == "chunked" else 2) * head
    notes = ("attention counted as the full s x s square (a causal kernel does about half)",)
    return StepFlops(int(fwd), int(bwd), int(rec), int(att), "formula", notes)


def _input_grad(part: str, grads: dict[str, bool], stream: bool) -> bool:
    """Whether a matmul's input needs a gradient, from what came before it in the block."""
    attn_out = grads.get("qkv") or grads.get("q") or grads.get("k") or grads.get("v") or False
    if part == "o":
        return attn_out
    after_attn = stream or attn_out or grads.get("o", False)
    if part in ("up", "gate"):
        return after_attn
    if part == "down":
        return after_attn or grads.get("up", False) or grads.get("gate", False)
    raise InputError(f"unknown matmul {part!r}")


def step_flops_formula(step) -> StepFlops:
    """:func:`gpt_step_flops` of a :class:`memlab.step.training_step.StepConfig` (its model, seq, batch and
    switches); a UNet's FLOPs are counted on fake tensors instead (:func:`count_step_flops`)."""
    cfg = step.model_config
    if not isinstance(cfg, GPTConfig):
        return count_step_flops(step)
    return gpt_step_flops(cfg, step.seq, step.batch, checkpointing=cfg.checkpointing,
                          attention=cfg.attention)


__all__ = ["CPU_SDPA", "PARTS", "PhaseFlopCounter", "StepFlops", "block_matmuls", "lora_matmuls", "count_step_flops",
           "gpt_step_flops", "random_batch", "run_counted_step", "step_flops_formula"]
