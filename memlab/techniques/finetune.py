"""What a fine-tuner reaches for: LoRA adapters and 8-bit optimizer state, counted.

**LoRA** (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", sec. 4.1)
freezes the model and trains, beside each targeted ``Linear(in, out)``, a pair ``A`` (r x in)
and ``B`` (out x r): ``r * (in + out)`` parameters per targeted module. Gradients and
optimizer state exist only for those; the frozen weights are still held, and so are the
activations (the adapters read the same inputs; the base layers still pass gradients
through). :func:`lora_params` counts adapters from the rank and the target module names
(the Hugging Face names of Llama/Mistral/Qwen2 and GPT-2 layers, as ``peft`` matches them),
and :func:`estimate_lora` gives the estimate of such a step.

The byte layouts of 8-bit, paged and Adafactor state and of 4-/8-bit weights are
:mod:`memlab.step.low_bit`'s.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable

import torch

from memlab.core.errors import InputError
from memlab.lenses.estimate import dtypes, estimate_step
from memlab.models.gpt_unet import GPT, GPTConfig
from memlab.step.low_bit import (
    BLOCKWISE,
    OPTIMIZER_STATES,
    PAGED,
    QUANTIZATIONS,
    adafactor_state_bytes,
    adam_state_bytes,
    paged_note,
    paged_state_bytes,
    quantized_weight_bytes,
)
from memlab.step.training_step import MemoryReport, StepConfig, resolve_step


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






def param_shapes(cfg: GPTConfig) -> list[tuple[int, ...]]:
    """Shapes of every parameter of memlab's GPT of ``cfg``, read off the model built on the
    ``meta`` device (nothing is allocated)."""
    with torch.device("meta"):
        return [tuple(p.shape) for p in GPT(cfg).parameters()]


def optimizer_state_of(cfg: GPTConfig, kind: str = "adamw") -> int:
    """State bytes of optimizer ``kind`` (:data:`OPTIMIZER_STATES`) over every parameter of
    ``cfg`` (:meth:`memlab.models.gpt_unet.GPTConfig.param_numels`; Adafactor over the shapes)."""
    if kind == "adafactor":
        return adafactor_state_bytes(param_shapes(cfg))
    return adam_state_bytes(cfg.param_numels(), kind)




def quantized_model_bytes(cfg: GPTConfig, quantization: str, *, compute_bytes: int = 2,
                          double_quant: bool = True) -> tuple[int, int]:
    """``(parameter bytes, largest dequantised weight)`` of ``cfg`` loaded with
    ``load_in_4bit``/``load_in_8bit``: every decoder ``Linear`` quantised
    (:func:`quantized_weight_bytes`), the embedding, the head and the norms (and biases) in
    ``compute_bytes``; the second number is the largest quantised weight in the compute dtype
    (what a 4-bit matmul's backward dequantises)."""
    linears = [(o, i) for ios in _shapes(cfg).values() for i, o in ios]
    quant = cfg.n_layer * sum(quantized_weight_bytes(o, i, quantization, double_quant=double_quant)
                              for o, i in linears)
    rest = cfg.num_params() - cfg.n_layer * sum(o * i for o, i in linears)
    largest = max(o * i for o, i in linears) * compute_bytes
    return quant + rest * compute_bytes, largest


def optimizer_state_bytes(step: StepConfig, kind: str = "adamw") -> int:
    """Optimizer state bytes of a memlab step's model (:func:`optimizer_state_of`; compare
    ``estimate_step(step).by_category["optimizer"]``)."""
    cfg = step.model_config
    if not isinstance(cfg, GPTConfig):
        raise InputError(f"optimizer state is counted for GPT-shaped models, not {cfg.name!r}")
    return optimizer_state_of(cfg, kind)


def estimate_8bit(step: StepConfig | None = None, *, budget: int | str | None = None,
                  target: str = "cpu", **overrides) -> MemoryReport:
    """The estimate of a step whose AdamW keeps 8-bit moments (:func:`estimate_finetune`
    with ``optimizer="adamw-8bit"``)."""
    return estimate_finetune(resolve_step(step, **overrides), optimizer="adamw-8bit",
                             budget=budget, target=target)


def estimate_finetune(step: StepConfig, *, lora: tuple[int, Iterable[str]] | None = None,
                      eight_bit: bool = False, optimizer: str = "adamw",
                      quantization: str = "none", double_quant: bool = True,
                      budget: int | str | None = None, target: str = "cuda") -> MemoryReport:
    """The estimate of a fine-tuning step with the knobs a fine-tuner turns.

    ``lora`` as ``(rank, target modules)`` (:func:`estimate_lora`); ``optimizer`` one of
    :data:`OPTIMIZER_STATES` (``eight_bit=True``: ``"adamw-8bit"``), its state counted over
    the trainable tensors (the adapters under LoRA), a paged one in host memory; a full
    fine-tune's 8-bit AdamW, plain or paged, is the run's own field
    (``StepConfig(optimizer="adamw-8bit")``, which :func:`memlab.lenses.estimate.estimate_step` counts);
    ``quantization`` ``"4bit"`` (QLoRA) or ``"8bit"``: the frozen base as bitsandbytes holds
    it (:func:`quantized_model_bytes`), needing ``lora``, plus the dequantised weight of the
    largest matmul as a temporary (4-bit). Optimizer state and weights are held all step, so
    replacing them moves every moment of the step alike: the peak moment stays the estimate's.
    """
    kind = "adamw-8bit" if eight_bit else optimizer
    if kind not in OPTIMIZER_STATES:
        raise InputError(f"optimizer {kind!r}; allowed: {', '.join(OPTIMIZER_STATES)}")
    if quantization not in QUANTIZATIONS:
        raise InputError(f"quantization {quantization!r}; allowed: {', '.join(QUANTIZATIONS)}")
    if quantization != "none" and lora is None:
        raise InputError(f"a {quantization} base model is frozen: give LoRA adapters to train "
                         f"(--lora-rank/--lora-targets or --lora-config)")
    if (kind != "adamw" or quantization != "none") and (step.zero or step.offload != "none"):
        raise InputError("8-bit, paged and Adafactor state and quantised weights are estimated "
                         "for plain PyTorch; allowed: zero=0, offload='none'")
    cfg = step.model_config
    if not isinstance(cfg, GPTConfig):
        raise InputError(f"fine-tuning is counted for GPT-shaped models, not {cfg.name!r}")
    base = replace(step, optimizer="sgd" if kind == "sgd" else "adamw")
    # a full fine-tune's 8-bit state is a field of the run (StepConfig.optimizer): the one path every lens takes
    run_field = lora is None and kind in BLOCKWISE
    if lora is None:
        report = estimate_step(replace(step, optimizer=kind) if run_field else base, budget=budget, target=target)
        trainable: list = cfg.param_numels()
    else:
        rank, targets = lora
        report = estimate_lora(base, rank=rank, targets=targets, budget=budget, target=target)
        trainable = lora_shapes(cfg, rank, targets)
    cats, host = dict(report.by_category), dict(report.host_by_category)
    notes = list(report.notes)
    if kind not in ("adamw", "sgd") and not run_field:  # the adapters' state, or Adafactor's
        w = dtypes(step.precision, target).param
        moment = 2 if w == 2 and kind == "paged-adamw" else 4  # pure-bf16: torch's moments follow the weights
        if kind == "adafactor":
            shapes = param_shapes(cfg) if lora is None else _lora_matrix_shapes(cfg, *lora)
            state = adafactor_state_bytes(shapes)
        else:
            state = adam_state_bytes(trainable, kind, element_bytes=w)
            if moment == 2:
                state //= 2
        if kind in PAGED:
            paged = paged_state_bytes(trainable, kind, moment_element_bytes=moment)
            cats["optimizer"] = state - paged
            host["optimizer"] = host.get("optimizer", 0) + paged
            notes.append(paged_note(kind, state, paged))
        else:
            cats["optimizer"] = state
            notes.append(f"{kind} state: {state / sum(trainable):.3f} B per trainable parameter")
    if quantization != "none":
        compute = dtypes(step.precision, target).compute
        frozen, largest = quantized_model_bytes(cfg, quantization, compute_bytes=compute,
                                                double_quant=double_quant)
        adapters = sum(trainable) * dtypes(step.precision, target).param
        cats["parameters"] = frozen + adapters
        if quantization == "4bit":
            cats["temporaries"] = cats.get("temporaries", 0) + largest
        notes.append(f"load_in_{quantization}: base weights {frozen / cfg.num_params():.3f} B per "
                     f"parameter (bitsandbytes layout"
                     f"{', NF4 blocks of 64, double quantization' if quantization == '4bit' else ''}"
                     f"), embeddings, head and norms in {compute} bytes"
                     + (f"; the dequantised weight of the largest matmul ({largest / 2**20:.1f} "
                        f"MiB) as a temporary" if quantization == "4bit" else ""))
    return replace(report, by_category=cats, peak_bytes=sum(cats.values()), notes=notes,
                   host_by_category=host, host_bytes=sum(host.values()))


def _lora_matrix_shapes(cfg: GPTConfig, rank: int, targets: Iterable[str]) -> list[tuple[int, int]]:
    """``A`` (r x in) and ``B`` (out x r) of every adapter, as matrices (for Adafactor)."""
    shapes = _shapes(cfg)
    return cfg.n_layer * [m for t in set(targets) for i, o in shapes[t] for m in ((rank, i), (o, rank))]


__all__ = ["lora_shapes", "lora_params", "frozen_saved_bytes", "estimate_lora",
           "param_shapes", "optimizer_state_of", "quantized_model_bytes", "optimizer_state_bytes", "estimate_8bit",
           "estimate_finetune"]
