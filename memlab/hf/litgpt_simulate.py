"""litgpt's LoRA and QLoRA step on fake tensors: what :func:`memlab.hf.simulate.simulate_hf` runs
for ``implementation="litgpt-<commit>"`` (:data:`memlab.lenses.litgpt_estimate.NORM_BYTES`).

The model is memlab's copy of litgpt's (:mod:`memlab.models.litgpt_model`), the step one iteration
of its ``finetune/lora.py``. A 4-bit base (``--quantize bnb.nf4`` / ``bnb.nf4-dq``) is what
Lightning's ``BitsandbytesPrecision`` (Lightning ``71aed751``,
``src/lightning/fabric/plugins/precision/bitsandbytes.py``) made of it with bitsandbytes 0.41.1
(commit ``18e827d6``), the table's:

* every ``torch.nn.Linear``, the head included, becomes a ``Linear4bit`` (line 130: the
  class replaced while the model is built); ``lora_A`` and ``lora_B`` are parameters, not
  ``Linear`` modules, and stay bf16;
* ``_Linear4bit._quantize_weight`` (lines 218-229) quantises ``weight.to(torch.half)``, so the
  quantisation state's dtype is fp16: ``dequantize_4bit`` makes an fp16 weight and
  ``MatMul4Bit`` casts it to the input's bf16 (``autograd/_functions.py`` line 516 at 18e827d6:
  ``F.dequantize_4bit(B, state).to(A.dtype).t()``), in forward and again in backward (line 547):
  for a moment both copies, 4 bytes per weight;
* ``MatMul4Bit.forward`` keeps ``ctx.tensors = (A, B)`` when any input needs a gradient (lines
  522-523) as attributes of its node, not saved tensors: autograd frees saved tensors as
  backward passes them, a node's attributes only with the node, when the graph goes (the loop's
  ``loss`` holds it to the next iteration). With :attr:`QuantConfig.matmul_keeps_input` off (the
  later bitsandbytes) only the packed weight is saved.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from memlab.core.errors import InputError
from memlab.models.decoder_shape import DecoderShape
from memlab.models.litgpt_model import LitGPTConfig, build_litgpt
from memlab.step.fine_tune_config import LoraConfig, QuantConfig
from memlab.step.low_bit import NF4_BLOCK, QMAP_ENTRIES

#: LoRA's target names (peft's, as memlab's LoraConfig names them) to litgpt's ``to_query``, ``to_key``, ``to_value``
_QKV = ("q_proj", "k_proj", "v_proj")


def _dequantized(B: torch.Tensor, state) -> torch.Tensor:
    """``bitsandbytes.functional.dequantize_4bit``: the weight in the state's dtype (fp16 here)."""
    import bitsandbytes as bnb
    return bnb.functional.dequantize_4bit(B, state)


class MatMul4BitLit(torch.autograd.Function):
    """bitsandbytes 0.41.1's ``MatMul4Bit`` (``autograd/_functions.py`` lines 494-549 at
    18e827d6) as Lightning's 4-bit layer ran it (the module doc): the fp16 weight cast to the
    input's dtype in forward and backward; ``A`` (with ``keeps_input``) and ``B`` kept as the
    node's attributes."""

    @staticmethod
    def forward(ctx, A, B, state, keeps_input):
        # one expression, as line 516: the fp16 copy dies when the cast returns
        out = F.linear(A, _dequantized(B, state).to(A.dtype))
        ctx.state = state
        if keeps_input:
            ctx.tensors = (A, B) if ctx.needs_input_grad[0] else (None, None)
        else:
            ctx.save_for_backward(B)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        B = ctx.tensors[1] if hasattr(ctx, "tensors") else ctx.saved_tensors[0]
        grad_A = None
        if ctx.needs_input_grad[0]:
            grad_A = torch.matmul(grad_output, _dequantized(B, ctx.state).to(grad_output.dtype))
        return grad_A, None, None, None


class Linear4bitLit(nn.Module):
    """Lightning's ``_NF4Linear`` / ``_NF4DQLinear`` on fake tensors: the weight quantised from
    fp16 (bitsandbytes' own ``quantize_4bit``, blocks of 64, nested maxima for ``-dq``), no bias,
    :class:`MatMul4BitLit` (``Linear4bit.forward``: compute dtype bf16, the input's)."""

    def __init__(self, linear: nn.Linear, quant: QuantConfig):
        import bitsandbytes as bnb
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        packed, state = bnb.functional.quantize_4bit(
            linear.weight.detach().to(torch.half), blocksize=NF4_BLOCK, compress_statistics=quant.double_quant,
            quant_type=quant.quant_type, quant_storage=torch.uint8)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.quant_state = state
        # the state's own tensors as buffers, so a tracker counts them with the weight: the maxima
        # (fp32 per block, or uint8 with their fp32 maxima per 256 and an offset when nested)
        self.register_buffer("absmax", state.absmax, persistent=False)
        if state.nested:
            self.register_buffer("absmax2", state.state2.absmax, persistent=False)
            self.register_buffer("offset", state.offset, persistent=False)
        self.keeps_input = quant.matmul_keeps_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return MatMul4BitLit.apply(x, self.weight, self.quant_state, self.keeps_input)


def quantize_linears(model: nn.Module, quant: QuantConfig) -> nn.Module:
    """Every ``nn.Linear`` of ``model`` (the head too) a :class:`Linear4bitLit`."""
    import bitsandbytes as bnb
    if quant.bits != 4:
        raise InputError(f"quantization bits={quant.bits} with litgpt's code; allowed: 4 (bnb.nf4, bnb.nf4-dq)")
    qmaps = bnb.functional.name2qmap
    saved = dict(qmaps)
    qmaps["dynamic"] = torch.empty(QMAP_ENTRIES, dtype=torch.float32)  # the nested maxima's map, fake
    try:
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, Linear4bitLit(child, quant))
    finally:
        qmaps.clear()
        qmaps.update(saved)
    return model


def litgpt_config(s: DecoderShape, lora: LoraConfig, implementation: str) -> LitGPTConfig:
    """litgpt's ``Config`` for the shape and adapters (``fp32_norm`` from 6178c7cc on)."""
    return LitGPTConfig(n_embd=s.d, n_head=s.heads, n_layer=s.n_layer, intermediate_size=s.ffn, vocab=s.vocab,
                        r=lora.rank, alpha=lora.alpha or 2 * lora.rank, dropout=lora.dropout,
                        enable=tuple(n in lora.targets for n in _QKV), fp32_norm=implementation != "litgpt-8641822")


def build_litgpt_run(s: DecoderShape, seq: int, lora: LoraConfig, quant: QuantConfig | None,
                     implementation: str, optimizer: Callable[[list], object]) -> Callable:
    """A ``build_fn`` for :func:`memlab.lenses.your_model.simulate_model`: memlab's litgpt model
    (:func:`memlab.models.litgpt_model.build_litgpt`) for sequences up to ``seq``, its Linears in
    4 bits under ``quant`` (:func:`quantize_linears`), and ``optimizer(params)`` over the adapters."""
    config = litgpt_config(s, lora, implementation)

    def build():
        model = build_litgpt(config, seq)
        if quant is not None:
            quantize_linears(model, quant)
        return model, optimizer([p for p in model.parameters() if p.requires_grad])
    return build


__all__ = ["MatMul4BitLit", "Linear4bitLit", "quantize_linears", "litgpt_config", "build_litgpt_run"]
