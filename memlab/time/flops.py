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

The same rule reads a Hugging Face decoder's shape (:func:`decoder_step_flops`): its real
``Linear`` modules, heads and head dims (q/k and v apart, as multi-head latent attention has
them), and for a mixture of experts the router and the routed experts' matmuls once per routed
token (``top_k`` rows a token: the active parameters).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch.utils import flop_counter

from memlab.core.errors import InputError
from memlab.core.torch_private import FakeTensorMode, TorchDispatchMode, in_backward
from memlab.models.decoder_shape import DecoderShape
from memlab.models.gpt_unet import GPTConfig, UNetConfig
from memlab.step.decoder_states import LM_HEAD, adapters_for
from memlab.step.fine_tune_config import ALL_LINEAR, LoraConfig
from memlab.step.training_step import DECODER_CHECKPOINTING, DECODER_LOSSES, batch_to, build_trainer, make_batch

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
#: one matmul of a layer: (part, in, out, the Hugging Face LoRA names of it, rows per token).
#: ``part`` places it in the layer (q, k, v, qkv, o, router, gate, up, down), which says whose
#: gradient its input needs; ``rows`` is 1, or ``top_k`` for routed experts (each token's rows
#: go through the ``top_k`` experts it is routed to: the active parameters' matmuls)
Matmul = tuple[str, int, int, tuple[str, ...], int]


def _gpt_block_matmuls(cfg: GPTConfig) -> list[Matmul]:
    d, f, hd = cfg.d_model, cfg.hidden, cfg.head_dim
    q, kv = cfg.n_head * hd, cfg.kv_heads * hd
    if cfg.mlp == "swiglu":
        return [("q", d, q, ("q_proj",), 1), ("k", d, kv, ("k_proj",), 1), ("v", d, kv, ("v_proj",), 1),
                ("o", q, d, ("o_proj",), 1), ("gate", d, f, ("gate_proj",), 1), ("up", d, f, ("up_proj",), 1),
                ("down", f, d, ("down_proj",), 1)]
    return [("qkv", d, q + 2 * kv, ("c_attn",), 1), ("o", q, d, ("c_proj",), 1),
            ("up", d, f, ("c_fc",), 1), ("down", f, d, ("c_proj",), 1)]


#: a decoder's Linear module names (:meth:`DecoderShape.linears`) -> their part in the layer
_DECODER_PARTS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "qkv_proj": "qkv", "c_attn": "qkv",
                  "q_a_proj": "q", "q_b_proj": "q", "kv_a_proj_with_mqa": "k", "kv_b_proj": "v",
                  "o_proj": "o", "gate_proj": "gate", "up_proj": "up", "gate_up_proj": "up", "c_fc": "up",
                  "down_proj": "down"}


def _decoder_layer_matmuls(s: DecoderShape, i: int) -> list[Matmul]:
    """Layer ``i``'s matmuls in the order its forward runs them: every ``Linear`` of
    :meth:`DecoderShape.linears` (GPT-2's two ``c_proj``: attention's, then the MLP's), and in
    a mixture-of-experts layer the router (``d x E``) and the routed experts' ``gate_up`` and
    ``down`` on ``top_k`` rows a token, before the shared experts' MLP."""
    lin = s.linears(i)
    if s.mlp == "gelu_new":
        (o_in, o_out), (m_in, m_out) = lin["c_proj"]
        (a_in, a_out), = lin["c_attn"]
        (f_in, f_out), = lin["c_fc"]
        return [("qkv", a_in, a_out, ("c_attn",), 1), ("o", o_in, o_out, ("c_proj",), 1),
                ("up", f_in, f_out, ("c_fc",), 1), ("down", m_in, m_out, ("c_proj",), 1)]
    attn = [n for n in lin if _DECODER_PARTS[n] in ("q", "k", "v", "qkv", "o")]
    mlp = [n for n in lin if n not in attn]
    out: list[Matmul] = [(_DECODER_PARTS[n], a, b, (n,), 1) for n in attn for a, b in lin[n]]
    if i in s.moe_layers:
        out += [("router", s.d, s.experts, (), 1),
                ("up", s.d, 2 * s.moe_ffn, (), s.top_k), ("down", s.moe_ffn, s.d, (), s.top_k)]
    return out + [(_DECODER_PARTS[n], a, b, (n,), 1) for n in mlp for a, b in lin[n]]


def layer_matmuls(cfg: GPTConfig | DecoderShape, i: int = 0) -> list[Matmul]:
    """The matmuls of layer ``i`` of memlab's GPT (every block alike) or of a decoder's shape,
    as the closed form counts them: ``(part, in, out, LoRA names, rows per token)``."""
    if isinstance(cfg, DecoderShape):
        if not 0 <= i < cfg.n_layer:
            raise InputError(f"layer {i!r}; allowed: 0-{cfg.n_layer - 1}")
        return _decoder_layer_matmuls(cfg, i)
    return _gpt_block_matmuls(cfg)


def _lora_names(cfg: GPTConfig | DecoderShape, targets) -> set[str]:
    """The adapted module names: a decoder's through its adapters' own check
    (:func:`memlab.step.decoder_states.adapters_for`, ``all-linear`` spelled out)."""
    if isinstance(cfg, DecoderShape):
        lora = targets if isinstance(targets, LoraConfig) else LoraConfig(
            targets=ALL_LINEAR if targets == ALL_LINEAR else tuple(targets))
        names = set(adapters_for(cfg, lora, "fp32").names)
        if LM_HEAD in names:
            raise InputError(f"LoRA on {LM_HEAD!r}: the closed form counts adapters on the decoder "
                             f"layers' Linear modules; allowed: {', '.join(cfg.linear_names())}")
        return names
    wanted = set(targets)
    known = {n for *_, names, _ in _gpt_block_matmuls(cfg) for n in names}
    if not wanted or wanted - known:
        raise InputError(f"LoRA targets {sorted(wanted - known) or sorted(wanted)!r}; "
                         f"allowed: {', '.join(sorted(known))}")
    return wanted


def lora_matmuls(cfg: GPTConfig | DecoderShape, targets: Iterable[str], i: int = 0) -> list[tuple[str, int, int]]:
    """(part, in, out) of each matmul of layer ``i`` that a LoRA adapter on ``targets``
    (Hugging Face names; a decoder also takes ``"all-linear"``) tunes; an unknown name is bad input."""
    wanted = _lora_names(cfg, targets)
    return [(part, a, b) for part, a, b, names, _ in layer_matmuls(cfg, i) if wanted & set(names)]


def block_matmuls(cfg: GPTConfig | DecoderShape, i: int = 0) -> list[tuple[str, int, int]]:
    """The matmuls of layer ``i`` of ``cfg`` as the closed form counts them.

    Args:
        cfg: memlab's GPT config or a decoder's shape; i: the layer (a decoder's differ).

    Returns:
        ``(part, in, out)`` per matmul (the time lens times each GEMM by its shape; a routed
        expert's ``in`` and ``out`` are one expert's, run on ``top_k`` rows a token).
    """
    return [(part, a, b) for part, a, b, _, _ in layer_matmuls(cfg, i)]


def _attention_widths(cfg: GPTConfig | DecoderShape) -> tuple[int, int]:
    """(query-key, value) widths over all heads: ``heads x head_dim`` and ``heads x v_head_dim``
    (torch's SDPA formula reads the query's heads: grouped k and v count once per query head)."""
    if isinstance(cfg, DecoderShape):
        return cfg.heads * cfg.head_dim, cfg.heads * cfg.v_head_dim
    h = cfg.n_head * cfg.head_dim
    return h, h


def gpt_step_flops(cfg: GPTConfig, seq: int, batch: int, *, checkpointing: str | None = None,
                   attention: str | None = None, lora_rank: int | None = None,
                   lora_targets: Iterable[str] = ()) -> StepFlops:
    """Closed-form FLOPs of one training step of memlab's GPT (module doc's rules).

    Args:
        cfg: the model.
        seq, batch: tokens per sequence and sequences per step (all micro-batches).
        checkpointing, attention: override ``cfg``'s (``none``/``full``/``selective``/``op``,
            ``sdpa``/``naive``).
        lora_rank, lora_targets: LoRA adapters on the named modules of every layer (Hugging
            Face names, :mod:`memlab.techniques.finetune`); the rest of the model is frozen.

    Returns:
        :class:`StepFlops` (``source="formula"``).

    Over 80 lines because it is the FLOP count's closed form, one line per matmul and attention term
    (module doc's rules).
    """
    ckpt = checkpointing or cfg.checkpointing
    if ckpt not in ("none", "full", "selective", "op"):
        raise InputError(f"checkpointing={ckpt!r}; allowed: none, full, selective, op")
    return _step_flops(cfg, seq, batch, ckpt, attention or cfg.attention, lora_rank, lora_targets,
                       cfg.loss, last_rerun=frozenset())


def decoder_step_flops(s: DecoderShape, seq: int, batch: int, *, checkpointing: str | None = None,
                       attention: str | None = None, lora_rank: int | None = None,
                       lora_targets: Iterable[str] | str = (), loss: str | None = None) -> StepFlops:
    """Closed-form FLOPs of one training step of a Hugging Face decoder from its shape (module
    doc's rules, on the shape's real GEMMs): every ``Linear`` of each layer
    (:meth:`DecoderShape.linears`), attention's ``q k^T`` and ``p v`` over all query heads at the
    real q/k and v head dims, a mixture of experts' router and its ``top_k`` routed experts a
    token (the active parameters), and the output head over the whole vocabulary. Norms,
    rotary angles, softcaps and the loss are elementwise (:mod:`memlab.time.elementwise`).

    Args:
        s: the decoder's shape (:func:`memlab.hf.shape.decoder_shape`).
        seq, batch: tokens per sequence and sequences per step (all micro-batches).
        checkpointing: ``none`` or ``full`` (HF re-runs each decoder layer; non-reentrant
            checkpointing stops before the layer's last matmul unless an op after it saves
            its output, which then has to exist again: a residual dropout (GPT-2, Phi-3), Gemma
            2/3's norm after the MLP, the routing weights' product of a mixture of experts
            whose routed experts run last (Mixtral, Qwen3-MoE, gpt-oss; DeepSeek's shared
            experts run after them and are added unsaved).
        attention: ``sdpa`` (a fused kernel: a card's, or the CPU's flash kernel) or
            ``naive`` (HF's eager matmuls, or SDPA's ``math`` composite the CPU takes with
            dropout); ``None``: ``naive`` for a class without SDPA (Gemma 2, gpt-oss), else ``sdpa``.
        lora_rank, lora_targets: LoRA on the named ``Linear`` modules (or ``"all-linear"``).
        loss: ``transformers`` or ``chunked`` (:data:`memlab.step.training_step.DECODER_LOSSES`).

    Returns:
        :class:`StepFlops` (``source="formula"``).
    """
    ckpt = checkpointing or "none"
    if ckpt not in DECODER_CHECKPOINTING:
        raise InputError(f"checkpointing={ckpt!r} for a decoder; allowed: {', '.join(DECODER_CHECKPOINTING)}")
    if (loss or "transformers") not in DECODER_LOSSES:
        raise InputError(f"loss={loss!r}; allowed: {', '.join(DECODER_LOSSES)}")
    if lora_rank is not None and s.kv_lora_rank is not None:
        raise InputError("LoRA FLOPs of multi-head latent attention (DeepSeek) are not in the closed form "
                         "(its compressed q and kv change which inputs need gradients); count the step "
                         "(memlab.time.flops.count_step_flops) or leave lora out")
    attn = attention or ("naive" if s.eager_only else "sdpa")
    saves_last = s.resid_dropout > 0 or s.norms_per_layer == 4
    rerun = frozenset(i for i in range(s.n_layer) if saves_last or (i in s.moe_layers and not s.shared_ffn))
    return _step_flops(s, seq, batch, ckpt, attn, lora_rank, lora_targets,
                       "chunked" if loss == "chunked" else "full", last_rerun=rerun)


def _step_flops(cfg: GPTConfig | DecoderShape, seq: int, batch: int, ckpt: str, attn: str,
                lora_rank: int | None, lora_targets, loss: str, *, last_rerun: frozenset[int]) -> StepFlops:
    """The per-matmul rule of the module doc over every layer of ``cfg`` (:func:`layer_matmuls`);
    ``last_rerun``: the layers whose last matmul full checkpointing re-runs too."""
    if attn not in ("sdpa", "naive"):
        raise InputError(f"attention={attn!r}; allowed: sdpa, naive")
    lora = lora_rank is not None
    given = lora_targets if isinstance(lora_targets, str) else tuple(lora_targets)
    if lora and (not given or isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 1):
        raise InputError(f"LoRA needs a positive rank and target modules, got rank={lora_rank!r}, "
                         f"targets={given!r}")
    targets = _lora_names(cfg, given) if lora else set()
    t, s, r = seq * batch, seq, lora_rank or 0
    qk, vv = _attention_widths(cfg)
    qk_half, v_half = 2 * batch * s * s * qk, 2 * batch * s * s * vv  # one product of each matmul
    att_fwd = qk_half + v_half
    fwd = bwd = rec = att = 0
    # does the residual stream entering the layer need a gradient? A trainable embedding: yes;
    # a frozen one: no, unless checkpointing is on, where peft makes the embedding's output
    # require grad so that checkpointed layers pass one (PeftModel's
    # _prepare_model_for_gradient_checkpointing -> enable_input_require_grads)
    stream = not lora or ckpt == "full"
    d_model = cfg.d if isinstance(cfg, DecoderShape) else cfg.d_model
    vocab = cfg.vocab if isinstance(cfg, DecoderShape) else cfg.vocab_size
    for layer in range(cfg.n_layer):
        matmuls = layer_matmuls(cfg, layer)
        grads: dict[str, bool] = {}  # does this part's output need a gradient?
        layer_fwd = 0
        for n, (part, i, o, names, rows) in enumerate(matmuls):
            tuned = bool(targets & set(names))
            x_grad = stream if part in ("q", "k", "v", "qkv") else _input_grad(part, grads, stream)
            f = 2 * t * rows * i * o + (2 * t * r * (i + o) if tuned else 0)
            fwd += f
            last = n == len(matmuls) - 1 and layer not in last_rerun
            # the last matmul is not re-run; with an adapter on it, the base and A are (B is last)
            layer_fwd += f if not last else (2 * t * i * o + 2 * t * r * i if tuned else 0)
            if not lora:
                bwd += 4 * t * rows * i * o
            else:
                bwd += 2 * t * rows * i * o if x_grad else 0  # frozen weight: the input's gradient only
                if tuned:  # B: weight and input grads; A: weight grad, input grad if x needs one
                    bwd += 4 * t * r * o + 2 * t * r * i + (2 * t * r * i if x_grad else 0)
            grads[part] = grads.get(part, False) or x_grad or tuned
        if "qkv" in grads:
            q_g = k_g = v_g = grads["qkv"]
        else:
            q_g, k_g, v_g = grads["q"], grads["k"], grads["v"]
        fwd += att_fwd
        att += att_fwd
        if attn == "sdpa":  # torch's sdpa_backward_flop_count: q k^T again, then four products
            b = qk_half * 3 + v_half * 2 if (q_g or k_g or v_g) else 0
        else:  # autograd computes only the gradients that are needed
            b = qk_half * (q_g + k_g) + v_half * ((q_g or k_g) + v_g)
        bwd += b
        att += b
        if ckpt == "full":
            rec += layer_fwd + att_fwd
            att += att_fwd
        elif ckpt == "op":  # every second matmul of the call order is not saved (qkv, o, gate, up,
            # down: o and up; GELU's qkv, o, up, down: o and down), and the recompute stops once
            # backward's tensors exist, so GELU's down (the last) is never re-run
            again = {"o", "up"} if cfg.mlp == "swiglu" else {"o"}
            rec += sum(2 * t * i * o for part, i, o, *_ in matmuls if part in again)
        elif ckpt == "selective":
            a = att_fwd if attn == "sdpa" else qk_half
            rec += a
            att += a
        stream = stream or any(grads.values())
    head = 2 * t * d_model * vocab
    fwd += head
    if lora:
        bwd += head if stream else 0
    else:
        bwd += (3 if loss == "chunked" else 2) * head
    notes = ("attention counted as the full s x s square (a causal kernel does about half)",)
    return StepFlops(int(fwd), int(bwd), int(rec), int(att), "formula", notes)


def _input_grad(part: str, grads: dict[str, bool], stream: bool) -> bool:
    """Whether a matmul's input needs a gradient, from what came before it in the layer."""
    attn_out = grads.get("qkv") or grads.get("q") or grads.get("k") or grads.get("v") or False
    if part == "o":
        return attn_out
    after_attn = stream or attn_out or grads.get("o", False)
    if part in ("up", "gate", "router"):
        return after_attn
    if part == "down":
        return after_attn or grads.get("up", False) or grads.get("gate", False)
    raise InputError(f"unknown matmul {part!r}")


def step_flops_formula(step) -> StepFlops:
    """The closed-form FLOPs of a :class:`memlab.step.training_step.StepConfig`: memlab's GPT
    (:func:`gpt_step_flops`) or a decoder's shape (:func:`decoder_step_flops`, its LoRA, loss
    and checkpointing from the run); a UNet's FLOPs are counted on fake tensors instead
    (:func:`count_step_flops`)."""
    cfg = step.model_config
    if isinstance(cfg, DecoderShape):
        lora = step.lora
        return decoder_step_flops(cfg, step.seq, step.batch, checkpointing=step.checkpointing_used,
                                  attention=step.attention, loss=step.loss,
                                  lora_rank=None if lora is None else lora.rank,
                                  lora_targets=() if lora is None else lora.targets)
    if not isinstance(cfg, GPTConfig):
        return count_step_flops(step)
    return gpt_step_flops(cfg, step.seq, step.batch, checkpointing=cfg.checkpointing,
                          attention=cfg.attention)


__all__ = ["CPU_SDPA", "PARTS", "Matmul", "PhaseFlopCounter", "StepFlops", "block_matmuls", "layer_matmuls",
           "lora_matmuls", "count_step_flops", "decoder_step_flops", "gpt_step_flops", "random_batch",
           "run_counted_step", "step_flops_formula"]
