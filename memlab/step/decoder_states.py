"""The model states of a Hugging Face run, per rank: a full fine-tune or LoRA on a frozen base.

:func:`run_states` gives the estimate's peak moments (:mod:`memlab.lenses.decoder_estimate`) their model
states: :func:`memlab.step.states.model_states` over what trains (every parameter tensor of the
class, :meth:`memlab.models.decoder_shape.DecoderShape.param_numels`, or the LoRA adapters of
:func:`adapter_shapes`), a frozen base held beside the adapters in the run's dtype or in
bitsandbytes' 4-/8-bit layout (:func:`quantized_base_bytes`), and 8-bit, paged or Adafactor
state as bitsandbytes and transformers allocate it (:mod:`memlab.step.low_bit`). :class:`Adapters`
says which modules carry adapters and in which dtype (:func:`adapters_for`).
"""
from __future__ import annotations

from dataclasses import dataclass

from memlab.core.errors import InputError
from memlab.models.decoder_shape import DecoderShape
from memlab.policy import precision_bytes
from memlab.step.fine_tune_config import ALL_LINEAR, LoraConfig, QuantConfig
from memlab.step.low_bit import (
    OPTIMIZER_STATES,
    PAGED,
    TORCHAO,
    adafactor_state_bytes,
    adam_state_bytes,
    paged_note,
    paged_state_bytes,
    quantized_weight_bytes,
    torchao_update_bytes,
)
from memlab.step.states import ModelStates, ZeroBuckets, model_states, with_zero2_partition


@dataclass(frozen=True)
class Adapters:
    """A LoRA run as each layer sees it: every base weight frozen, adapters on ``names``.

    A frozen ``Linear`` keeps no input (autograd saves it only for the weight's gradient), and
    its weight's autocast copy is saved, uncached, wherever its input needs a gradient; a
    4-bit base (``quantized``) saves only the packed weight (bitsandbytes' ``MatMul4Bit``
    keeps ``ctx.tensors = (None, B)``). Each adapter keeps its input as ``lora_A`` sees it and
    ``lora_A``'s ``t x r`` output (:func:`adapter_saved`)."""

    config: LoraConfig
    names: frozenset[str]
    a: int                   # bytes of an adapter element (fp32 adapters: 4)
    quantized: bool = False

    def count(self, s: DecoderShape, i: int, *names: str) -> int:
        """Adapted modules of layer ``i`` among ``names``."""
        table = s.linears(i)
        return sum(len(table.get(n, ())) for n in names if n in self.names)


#: the output head's module name, which peft adapts when ``target_modules`` names it
LM_HEAD = "lm_head"


def adapters_for(s: DecoderShape, lora: LoraConfig, precision: str, quantized: bool = False) -> Adapters:
    """The :class:`Adapters` of ``lora`` on ``s``: the target names checked against the layers'
    ``Linear`` modules (``all-linear``: every one), the adapters' element size (fp32 unless
    ``adapter_dtype="base"`` on a 16-bit base)."""
    names = set(s.linear_names())
    if lora.targets == ALL_LINEAR:
        picked = names
    else:
        # peft adapts the output head too when it is named (all-linear leaves it out)
        unknown = sorted(set(lora.targets) - names - {LM_HEAD})
        if unknown:
            raise InputError(f"LoRA target modules {unknown} ({s.model_type}); allowed: "
                             f"{', '.join(sorted(names))} or {ALL_LINEAR}")
        picked = set(lora.targets)
    base16 = precision == "pure-bf16" and not quantized
    a = 2 if base16 and lora.adapter_dtype == "base" else 4
    return Adapters(lora, frozenset(picked), a, quantized)


def adapter_shapes(s: DecoderShape, ad: Adapters) -> list[tuple[int, int]]:
    """``A`` (r x in) and ``B`` (out x r) of every adapter, as matrices."""
    r = ad.config.rank
    head = [(r, s.d), (s.vocab, r)] if LM_HEAD in ad.names else []
    return [m for i in range(s.n_layer) for n, ios in s.linears(i).items() if n in ad.names
            for i_, o in ios for m in ((r, i_), (o, r))] + head


def quantized_base_bytes(s: DecoderShape, quant: QuantConfig) -> tuple[int, int]:
    """``(bytes, largest dequantised weight)`` of the base loaded in 4 or 8 bits: every decoder
    ``Linear`` in bitsandbytes' layout (:func:`memlab.step.low_bit.quantized_weight_bytes`), the rest
    (embeddings, head, norms, routed experts, which are not ``Linear`` modules) in the dtype the
    model was loaded in (:attr:`QuantConfig.rest_dtype`); a 4-bit matmul dequantises its weight
    to the compute dtype."""
    ios = [io for i in range(s.n_layer) for v in s.linears(i).values() for io in v]
    packed = sum(quantized_weight_bytes(o, i, quant.name, double_quant=quant.double_quant) for i, o in ios)
    rest = s.num_params() - sum(i * o for i, o in ios)
    return packed + rest * quant.rest_bytes, max(i * o for i, o in ios) * quant.compute_bytes


@dataclass(frozen=True)
class RunStates:
    """Model-state inputs of the estimate's peak moments (:meth:`memlab.step.states.ModelStates.peak_inputs`
    with a fine-tune's frozen base, low-bit state and host bytes applied)."""

    inputs: dict[str, float]
    run_precision: str
    host: dict[str, float]
    notes: list[str]
    dequantised: float = 0.0
    states: ModelStates | None = None
    """The :class:`memlab.step.states.ModelStates` of what trains (the frozen base not in it): the
    simulation puts its fake step's states in DeepSpeed's layout from these."""


def run_states(s: DecoderShape, *, precision: str, optimizer: str, zero: int, world_size: int,
               offload: str, ep: int, ad: Adapters | None, quant: QuantConfig | None,
               buckets: ZeroBuckets | None = None) -> RunStates:
    """Per-rank model states of a full or LoRA fine-tune: :func:`memlab.step.states.model_states`
    over the trainable tensors (the adapters under LoRA, in fp32 for peft's fp32 adapters
    outside DeepSpeed), a frozen base held beside them in the run's dtype or bitsandbytes'
    layout, and 8-bit, paged or Adafactor state as bitsandbytes and transformers allocate it."""
    if optimizer not in OPTIMIZER_STATES:
        raise InputError(f"optimizer={optimizer!r}; allowed: {', '.join(OPTIMIZER_STATES)}")
    low_bit = optimizer not in ("adamw", "sgd")
    if low_bit and (zero or offload != "none"):
        raise InputError(f"optimizer={optimizer!r} is bitsandbytes' or transformers' own, counted for "
                         f"plain PyTorch; allowed with it: zero=0, offload='none'")
    if quant is not None and ad is None:
        raise InputError(f"a {quant.name} base is frozen: give LoRA adapters to train")
    if optimizer == "adafactor" and ad is None:
        raise InputError("Adafactor's factored state is counted for LoRA adapters (give lora), or "
                         "simulated for a full fine-tune (memlab simulate --hf-config)")
    base = "sgd" if optimizer == "sgd" else "adamw"
    if ad is None:
        params = s.num_params() - s.expert_total() * (1 - 1 / ep)
        trainable = s.param_numels() if ep == 1 else [int(round(params))]
        ms = model_states(s if ep == 1 else int(round(params)), precision=precision, optimizer=base,
                          zero=zero, world_size=world_size, offload=offload, buckets=buckets)
    else:
        mats = adapter_shapes(s, ad)
        trainable = [r * c for r, c in mats]
        # peft's fp32 adapters outside DeepSpeed; 16-bit adapters (ad.a == 2) hold 16-bit states
        own = "pure-bf16" if ad.a == 2 else precision if zero else "fp32"
        ms = model_states(sum(trainable), precision=own, optimizer=base, zero=zero, world_size=world_size,
                          offload=offload, buckets=buckets)
    # ZeRO-2's gradient partition as DeepSpeed allocates it, on its largest rank (the closed form's
    # parameter order, which can differ from the class's by where one parameter straddles a share)
    ms = with_zero2_partition(ms, trainable, world_size)
    run = ms.compute_precision if ms.deepspeed else precision
    inputs, host, notes = ms.peak_inputs(), dict(ms.host), list(ms.notes)
    dequantised = 0.0
    if ad is not None:
        if quant is not None:
            frozen, largest = quantized_base_bytes(s, quant)
            dequantised = largest if quant.bits == 4 else 0.0
            notes.append(f"load_in_{quant.name}: base {frozen / s.num_params():.3f} B per parameter "
                         f"(bitsandbytes' layout; embeddings, head and norms in {quant.rest_dtype})")
        else:
            frozen = s.num_params() * precision_bytes(run)[0]
        inputs["parameters"] += frozen
        n = sum(trainable)
        notes.append(f"LoRA r={ad.config.rank} on {', '.join(sorted(ad.names))}"
                     f"{f', dropout {ad.config.dropout:g}' if ad.config.dropout else ''}: {n:,} trainable "
                     f"parameters of {s.num_params() + n:,}, adapters in {'fp32' if ad.a == 4 else 'bf16'}")
        if LM_HEAD in ad.names:
            notes.append("lm_head adapter: its A and B, gradients and AdamW state counted; what it saves "
                         "for backward (the final hidden states as lora_A reads them, tokens x hidden, and "
                         "its rank-r output) is not in the activations")
    if low_bit:
        # torch's paged moments follow the weights when the whole model is 16-bit
        moment = 2 if optimizer == "paged-adamw" and ad is None and precision == "pure-bf16" else 4
        if optimizer == "adafactor":
            state = adafactor_state_bytes(adapter_shapes(s, ad))
        else:
            # torchao's unquantised moments, and torch's paged ones, follow the weights' dtype
            weights = 2 if (ad.a == 2 if ad is not None else precision == "pure-bf16") else 4
            state = adam_state_bytes(trainable, optimizer, element_bytes=weights)
            if moment == 2:
                state //= 2
            if optimizer in TORCHAO:  # its compiled update of the largest quantised tensor
                inputs["step"] = float(max(torchao_update_bytes(n, optimizer) for n in trainable))
        if optimizer in PAGED:
            paged = paged_state_bytes(trainable, optimizer, moment_element_bytes=moment)
            inputs["optimizer"] = float(state - paged)
            host["optimizer"] = host.get("optimizer", 0.0) + paged
            notes.append(paged_note(optimizer, state, paged))
        else:
            inputs["optimizer"] = float(state)
            notes.append(f"{optimizer} state: {state / sum(trainable):.3f} B per trainable parameter")
    return RunStates(inputs, run, host, notes, dequantised, ms)


__all__ = ["LM_HEAD", "Adapters", "RunStates", "adapters_for", "adapter_shapes", "quantized_base_bytes", "run_states"]
