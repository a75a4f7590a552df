"""What a fine-tuner reaches for: LoRA adapters and 8-bit optimizer state, counted.

**LoRA** (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", sec. 4.1)
freezes the model and trains, beside each targeted ``Linear(in, out)``, a pair ``A`` (r x in)
and ``B`` (out x r): ``r * (in + out)`` parameters per targeted module. Gradients and
optimizer state exist only for those; the frozen weights are still held, and so are the
activations (the adapters read the same inputs; the base layers still pass gradients
through). :func:`lora_params` counts adapters from the rank and the target module names
(the Hugging Face names of Llama/Mistral/Qwen2 and GPT-2 layers, as ``peft`` matches them),
and :func:`estimate_lora` gives the estimate of such a step.

**8-bit optimizer state** (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
Quantization", sec. 2.1 and 2.2): each Adam moment is stored in one byte, quantised in
independent blocks that each keep one fp32 absolute maximum, with a 256-entry fp32 dynamic
quantisation map per state. The paper uses blocks of 2048; bitsandbytes 0.50's ``AdamW8bit``
uses 256 (``blocksize = 256`` in its ``Optimizer2State``), and keeps tensors under
``min_8bit_size = 4096`` elements in fp32 (its documentation). :func:`adam_state_bytes` is
that layout, byte for byte (the tests compare it with bitsandbytes where it runs).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Iterable

from .errors import InputError
from .estimate import dtypes, estimate_step
from .models import GPTConfig
from .step import MemoryReport, StepConfig, resolve_step

#: LoRA target module names per family: name -> (in_features, out_features) of one layer.
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GPT2_TARGETS = ("c_attn", "c_proj", "c_fc")
#: bitsandbytes 8-bit Adam layout (module doc)
BNB_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096
QMAP_ENTRIES = 256
OPTIMIZER_STATES = ("adamw", "adamw-8bit")


def _shapes(cfg: GPTConfig) -> dict[str, list[tuple[int, int]]]:
    """(in, out) of every Linear a target name matches in one layer."""
    d, f, hd = cfg.d_model, cfg.hidden, cfg.head_dim
    if cfg.mlp == "gelu":  # GPT-2: fused c_attn; "c_proj" names the attention's and the MLP's output
        return {"c_attn": [(d, 3 * d)], "c_proj": [(d, d), (f, d)], "c_fc": [(d, f)]}
    q, kv = cfg.n_head * hd, cfg.kv_heads * hd
    return {"q_proj": [(d, q)], "k_proj": [(d, kv)], "v_proj": [(d, kv)], "o_proj": [(q, d)],
            "gate_proj": [(d, f)], "up_proj": [(d, f)], "down_proj": [(f, d)]}


def lora_shapes(cfg: GPTConfig, rank: int, targets: Iterable[str]) -> list[int]:
    """Element counts of every adapter tensor (``A`` r x in, ``B`` out x r, per targeted
    module per layer) of LoRA of ``rank`` on the named modules."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InputError(f"LoRA rank must be a positive integer, got {rank!r}")
    shapes = _shapes(cfg)
    targets = list(targets)
    unknown = [t for t in targets if t not in shapes]
    if unknown or not targets:
        raise InputError(f"LoRA target modules {unknown or targets!r}; allowed: {', '.join(shapes)}")
    return cfg.n_layer * [n for t in set(targets) for i, o in shapes[t] for n in (rank * i, rank * o)]


def lora_params(cfg: GPTConfig, rank: int, targets: Iterable[str]) -> int:
    """Adapter parameters of LoRA of ``rank`` on the named modules of every layer."""
    return sum(lora_shapes(cfg, rank, targets))


def frozen_saved_bytes(cfg: GPTConfig, seq: int, batch: int, precision: str, rank: int,
                       targets: Iterable[str], target: str = "cpu") -> float:
    """Activation bytes a LoRA step does *not* keep, net of what its adapters add.

    Autograd saves a ``Linear``'s input only to form its weight gradient: a frozen layer keeps
    none. Per block that is the attention input when no q/k/v projection is targeted, the
    attention output (made contiguous for the output projection) when that is not, the MLP
    input when neither its gate nor its up projection is, the down projection's input when it
    is not; and the head's input (the final norm's output) once. A targeted module's adapter
    reads the same input (``lora_dropout=0`` is an identity), so it keeps that input alive,
    and adds its ``t x r`` intermediate. Hugging Face's Llama-family RMSNorm multiplies by its
    weight in Python: with the weight frozen its normalised input (``t x h`` fp32, two per
    block and the final one) is not kept either; GPT-2's fused LayerNorm saves the same.
    Under full checkpointing only what is outside the recomputed blocks counts (the head's
    input and the final norm).
    """
    C = dtypes(precision, target).compute
    t, h, f = seq * batch, cfg.d_model, cfg.hidden
    picked = set(targets)
    if cfg.mlp == "gelu":  # GPT-2 names
        inputs = [({"c_attn"}, t * h), ({"c_fc"}, t * h), ({"c_proj"}, t * (h + f))]
        norm = 0
    else:
        inputs = [({"q_proj", "k_proj", "v_proj"}, t * h), ({"o_proj"}, t * h),
                  ({"gate_proj", "up_proj"}, t * h), ({"down_proj"}, t * f)]
        norm = t * h * 4
    per_layer = sum(n for names, n in inputs if not names & picked) * C + 2 * norm
    adapters = sum(len(v) for k, v in _shapes(cfg).items() if k in picked) * t * rank * C
    blocks = 0 if cfg.checkpointing == "full" else cfg.n_layer * (per_layer - adapters)
    return blocks + t * h * C + norm


def estimate_lora(step: StepConfig | None = None, *, rank: int, targets: Iterable[str],
                  budget: int | str | None = None, target: str = "cpu", **overrides) -> MemoryReport:
    """The estimate of a LoRA step: the frozen model plus adapters held, gradients and AdamW
    state for the adapters only, activations as in the full step less what frozen layers do
    not keep (:func:`frozen_saved_bytes`), no cached autocast weight copies."""
    step = resolve_step(step, **overrides)
    cfg = step.model_config
    if not isinstance(cfg, GPTConfig):
        raise InputError(f"LoRA is counted for GPT-shaped models, not {cfg.name!r}")
    targets = list(targets)
    n = lora_params(cfg, rank, targets)
    saved = frozen_saved_bytes(cfg, step.seq, step.batch // step.micro_batches, step.precision,
                               rank, targets, target)
    report = estimate_step(step, budget=budget, target=target, trainable_params=n,
                           frozen_activation_bytes=saved)
    report.notes.append(f"LoRA r={rank} on {', '.join(sorted(set(targets)))}: {n:,} trainable "
                        f"parameters of {cfg.num_params() + n:,}; frozen layers keep "
                        f"{saved / 2**20:.1f} MiB fewer activations")
    return report


def adam_state_bytes(shapes: Iterable[int], kind: str = "adamw") -> int:
    """Optimizer state bytes of Adam/AdamW over tensors of ``shapes`` (element counts):
    ``"adamw"`` two fp32 moments (8 B per parameter); ``"adamw-8bit"`` bitsandbytes' layout
    (module doc): per tensor of n >= 4096 elements ``2 n`` bytes of moments, ``2 * 4 *
    ceil(n / 256)`` of block maxima and ``2 * 256 * 4`` of quantisation maps, else fp32.
    The step counters (a few bytes per tensor, or none) are not counted."""
    if kind not in OPTIMIZER_STATES:
        raise InputError(f"optimizer state {kind!r}; allowed: {', '.join(OPTIMIZER_STATES)}")
    total = 0
    for n in shapes:
        if kind == "adamw" or n < BNB_MIN_8BIT_SIZE:
            total += 8 * n
        else:
            total += 2 * n + 2 * 4 * math.ceil(n / BNB_BLOCK) + 2 * 4 * QMAP_ENTRIES
    return total


def gpt_param_shapes(cfg: GPTConfig) -> list[int]:
    """Element counts of the parameter tensors of memlab's GPT of ``cfg`` (closed form,
    matching ``[p.numel() for p in GPT(cfg).parameters()]`` as a multiset)."""
    d, f, v = cfg.d_model, cfg.hidden, cfg.vocab_size
    q, kv = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    norm = [d, d] if cfg.norm == "layernorm" and cfg.bias else [d]
    layer = [d * (q + 2 * kv), d * q] + ([q + 2 * kv] if cfg.has_qkv_bias else []) \
        + ([d] if cfg.bias else []) + 2 * norm
    layer += ([d * f] * 3 if cfg.mlp == "swiglu" else [d * f] * 2)
    layer += ([f, f, d] if cfg.mlp == "swiglu" else [f, d]) if cfg.bias else []
    shapes = cfg.n_layer * layer + [v * d] + norm
    shapes += [cfg.block_size * d] if cfg.position == "learned" else []
    return shapes + ([] if cfg.tie_embeddings else [v * d])


def optimizer_state_bytes(step: StepConfig, kind: str = "adamw") -> int:
    """AdamW state bytes of a memlab step's model with fp32 or 8-bit moments (the estimate
    lens of an 8-bit optimizer; compare ``estimate_step(step).by_category["optimizer"]``)."""
    cfg = step.model_config
    if not isinstance(cfg, GPTConfig):
        raise InputError(f"8-bit optimizer state is counted for GPT-shaped models, not {cfg.name!r}")
    return adam_state_bytes(gpt_param_shapes(cfg), kind)


def estimate_8bit(step: StepConfig | None = None, *, budget: int | str | None = None,
                  target: str = "cpu", **overrides) -> MemoryReport:
    """The estimate of a step whose AdamW keeps 8-bit moments: the optimizer category
    becomes :func:`optimizer_state_bytes` with ``"adamw-8bit"``, the rest as estimated."""
    step = resolve_step(step, **overrides)
    if step.optimizer != "adamw" or step.zero or step.offload != "none":
        raise InputError("an 8-bit optimizer is estimated for plain AdamW on one device; "
                         "allowed: optimizer='adamw', zero=0, offload='none'")
    report = estimate_step(step, budget=budget, target=target)
    eight = optimizer_state_bytes(step, "adamw-8bit")
    cats = dict(report.by_category, optimizer=eight)
    out = replace(report, by_category=cats, peak_bytes=sum(cats.values()), notes=list(report.notes))
    out.notes.append(f"AdamW 8-bit (bitsandbytes layout, Dettmers et al. 2022 sec. 2.1): "
                     f"{eight / step.model_config.num_params():.3f} B per parameter instead of 8")
    return out


def estimate_finetune(step: StepConfig, *, lora: tuple[int, Iterable[str]] | None = None,
                      eight_bit: bool = False, budget: int | str | None = None,
                      target: str = "cuda") -> MemoryReport:
    """The estimate of a fine-tuning step with the knobs a fine-tuner turns: ``lora`` as
    ``(rank, target modules)`` (:func:`estimate_lora`), ``eight_bit`` AdamW moments in
    bitsandbytes' layout (over the adapters when LoRA is on). The "will it fit?" panel draws it."""
    if lora is None:
        return (estimate_8bit if eight_bit else estimate_step)(step, budget=budget, target=target)
    rank, targets = lora
    report = estimate_lora(step, rank=rank, targets=targets, budget=budget, target=target)
    if eight_bit:
        shapes = lora_shapes(step.model_config, rank, targets)
        report.by_category["optimizer"] = adam_state_bytes(shapes, "adamw-8bit")
        report.peak_bytes = sum(report.by_category.values())
        report.notes.append("AdamW 8-bit on the adapters (bitsandbytes layout)")
    return report


__all__ = ["LLAMA_TARGETS", "GPT2_TARGETS", "BNB_BLOCK", "BNB_MIN_8BIT_SIZE", "OPTIMIZER_STATES",
           "lora_shapes", "lora_params", "frozen_saved_bytes", "estimate_lora", "adam_state_bytes",
           "gpt_param_shapes", "optimizer_state_bytes", "estimate_8bit", "estimate_finetune"]
