"""litgpt's own LoRA step: the code litgpt's published resource tables ran, counted op by op.

A run's ``implementation`` (:data:`memlab.step.training_step.DECODER_IMPLEMENTATIONS`) says whose
code trains the decoder: ``transformers`` (the default) is the Hugging Face class
(:mod:`memlab.lenses.decoder_estimate`); ``litgpt-<commit>`` is Lightning-AI/litgpt's model and
``finetune/lora.py`` at that commit, run under Lightning Fabric ``bf16-true`` (Lightning commit
``71aed751``, the one litgpt's ``requirements.txt`` pins). Two commits are counted, read in
litgpt's history: ``8641822``, the one ``tutorials/resource-tables.md`` names, and ``6178c7cc``
("Half precision fixes", #606, merged 2023-10-24, three days before the table's PR #663), which
changed only the RMSNorm for these runs (:data:`NORM_BYTES`). What that code keeps for backward:

* ``lit_gpt/rmsnorm.py`` (lines 17-21 at 8641822): ``x * x``, ``mean``, ``rsqrt``, ``x * rsqrt``,
  ``weight * x``: the norm keeps the tensor it computes in (8641822: its 16-bit input;
  6178c7cc: ``x.float()``, an fp32 copy) and an rsqrt per row in that dtype; the frozen weight's
  multiply keeps nothing.
* ``lit_gpt/lora.py`` lines 372-386 (``LoRAQKVLinear.forward``): q, k and v are one fused
  ``Linear``; one dropout (its mask and the dropped input, which ``lora_A`` keeps) serves every
  adapted projection, ``conv1d`` keeps ``lora_A``'s rank-r output, and where not all of q, k, v
  are adapted ``zero_pad`` (lines 290-296) scatters the adapters' output with ``index_copy``,
  which keeps its source (the adapted columns, a reshaped copy) for its gradient.
* ``lit_gpt/model.py`` lines 196-232: q, k and v are views of the fused output; v reaches SDPA
  as a view, so the whole ``tokens x 3 hidden`` output stays; q and k are new tensors after
  rope (``torch.cat``, lines 219-220); SDPA keeps q, k, v, its output and a log-sum-exp.
  ``LLaMAMLP`` (lines 301-305) keeps the gate's input, ``silu``'s output and ``fc_2``'s output.
* ``lit_gpt/lora.py`` line 502 and ``lit_gpt/utils.py`` lines 255-262: the head runs in chunks
  of 128 tokens (``finetune/lora.py`` line 216), and Fabric casts the model's output, the chunk
  list, to the default dtype, fp32 (Lightning ``src/lightning/fabric/wrappers.py`` line 123,
  ``plugins/precision/half.py`` line 51); each chunk's cross-entropy keeps its fp32
  log-probabilities, and the loop keeps the fp32 list through backward.
* QLoRA (``--quantize bnb.nf4``): Lightning's ``BitsandbytesPrecision`` makes every
  ``torch.nn.Linear``, the head included, a ``Linear4bit`` (``plugins/precision/bitsandbytes.py``
  line 130), quantised from ``weight.half()`` (lines 218-229), so each weight is dequantised in
  fp16 and cast to bf16 (:data:`DEQUANTISED_BYTES`: the head's two copies are the peak's
  temporaries); what its matmul keeps is :attr:`memlab.step.fine_tune_config.QuantConfig.matmul_keeps_input`'s,
  the attention's projection's input among it: a copy of SDPA's output (``reshape`` of its
  transpose), not a view.

8641822's code run on fake CUDA tensors (:func:`memlab.lenses.your_model.simulate_model`, this
torch) peaks where this count does, to 0.2%, and reproduces the table's GPT-NeoX rows (phi-1.5,
StableLM-Alpha 3B: LayerNorm, no RMSNorm) within 0.2%; its Llama 2 rows read 3-5% low. With
6178c7cc's fp32 RMSNorm they read within 0.4%, the QLoRA rows too (``tests/test_published_lora.py``);
the ``simulate`` lens runs memlab's copy of this code (:mod:`memlab.hf.litgpt_simulate`), within 0.4% of each row.
"""
from __future__ import annotations

import re

from memlab.core.errors import InputError
from memlab.models.decoder_shape import DecoderShape
from memlab.policy import sdpa_lse_bytes
from memlab.step.fine_tune_config import LoraConfig, QuantConfig
from memlab.step.low_bit import quantized_weight_bytes
from memlab.step.parallel_dims import ParallelDims
from memlab.step.training_step import StepConfig

#: bytes per element of what litgpt's RMSNorm keeps (its input in the dtype it computes in, and an
#: rsqrt per row), by implementation: 8641822 computes in the input's dtype (bf16); 6178c7cc's
#: ``x = x.float()`` (``lit_gpt/rmsnorm.py`` line 19 there) in fp32
NORM_BYTES = {"litgpt-8641822": 2, "litgpt-6178c7cc": 4}
#: tokens per chunk of the head and the loss (``finetune/lora.py`` line 216: ``lm_head_chunk_size=128``)
LITGPT_HEAD_CHUNK = 128
#: litgpt's LoRA on the fused attention input: ``to_query``, ``to_key``, ``to_value`` (peft's names)
LITGPT_TARGETS = ("q_proj", "k_proj", "v_proj")
#: bytes of a 16-bit element (``bf16-true``: every tensor, the adapters too)
_E = 2
#: bytes per weight ``dequantize_4bit`` makes under litgpt's 4-bit base: Lightning's
#: ``_Linear4bit._quantize_weight`` (``plugins/precision/bitsandbytes.py`` lines 218-229 at 71aed751)
#: quantises ``weight.to(torch.half)``, so the state's dtype, the dequantised weight's, is fp16;
#: ``MatMul4Bit`` then casts it to the input's dtype (bitsandbytes 0.41.1 ``_functions.py`` line 516)
DEQUANTISED_BYTES = 2


def check_litgpt_run(run: StepConfig) -> None:
    """Refuse a run litgpt's count (either commit) does not cover: ``finetune/lora.py`` on one GPU
    in ``bf16-true`` (``pure-bf16``) with LoRA on q, k or v of a Llama decoder with one key/value
    head per query head (litgpt's GQA repeats k and v into copies, not counted here).

    Raises:
        InputError: the field, its value and what is allowed.
    """
    s, who = run.model_config, f"implementation={run.implementation!r}"
    if not isinstance(s, DecoderShape) or s.model_type != "llama" or s.kv_heads != s.heads or s.qkv_bias:
        name = s.model_type if isinstance(s, DecoderShape) else type(s).__name__
        raise InputError(f"{who} for {name} (kv heads {getattr(s, 'kv_heads', '?')} of "
                         f"{getattr(s, 'heads', '?')}); allowed: a llama config with as many key/value heads as "
                         f"query heads and no biases (Llama 2 7B and 13B)")
    if run.precision != "pure-bf16":
        raise InputError(f"{who} with precision={run.precision!r}; allowed: pure-bf16 "
                         f"(litgpt's --precision bf16-true)")
    lora = run.lora
    if lora is None or isinstance(lora.targets, str) or not set(lora.targets) <= set(LITGPT_TARGETS) \
            or lora.adapter_dtype != "base":
        raise InputError(f"{who} with lora={lora!r}; allowed: LoraConfig with targets among "
                         f"{', '.join(LITGPT_TARGETS)} and adapter_dtype='base' (finetune/lora.py's "
                         f"lora_query/lora_key/lora_value, adapters in bf16)")
    extras = dict(checkpointing=(run.checkpointing or "none", "none"), zero=(run.zero, 0),
                  world_size=(run.world_size, 1), offload=(run.offload, "none"),
                  micro_batches=(run.micro_batches, 1), attention=(run.attention or "sdpa", "sdpa"),
                  loss=("chunked" if run.loss == "chunked" else "its own", "its own"),
                  parallel=(run.parallel, ParallelDims()), compile=(run.compile, False),
                  activation_offload=(run.activation_offload, False),
                  optimizer_in_backward=(run.optimizer_in_backward, False))
    for name, (value, allowed) in extras.items():
        if value != allowed:
            raise InputError(f"{who} with {name}={value!r}; allowed: {allowed!r} "
                             f"(finetune/lora.py on one device, its own chunked loss)")


def check_implementation(run: StepConfig) -> None:
    """Refuse what the run's implementation is not counted with: litgpt's limits
    (:func:`check_litgpt_run`), and bitsandbytes' old matmul under ``transformers``' class.

    Raises:
        InputError: the field, its value and what is allowed.
    """
    if run.implementation in NORM_BYTES:
        check_litgpt_run(run)
    elif run.quantization is not None and run.quantization.matmul_keeps_input:
        raise InputError(f"matmul_keeps_input=True (bitsandbytes before 0.43.2) is counted for litgpt's code "
                         f"(implementation {', '.join(NORM_BYTES)}); allowed with transformers' class: False")


def implementation_peak(run: StepConfig, s: DecoderShape, batch: int, parameters: float, moment: str,
                        best: dict[str, float], gradients: float) -> tuple[float, str, dict[str, float]]:
    """The peak of the run's implementation: ``transformers``' (the class's, passed in, returned as
    it is) or litgpt's (:func:`litgpt_moments`' largest, its 4-bit head in the parameters).

    Args:
        run: the step; s: its shape (one rank's); batch: the micro-batch; parameters, moment,
            best: the class's parameter bytes, peak moment and its categories; gradients: the
            gradient bytes held at litgpt's moments.

    Returns:
        ``(parameter bytes, moment, categories)``.
    """
    if run.implementation not in NORM_BYTES:
        return parameters, moment, best
    moments = litgpt_moments(s, batch, run.seq, run.lora, run.quantization, NORM_BYTES[run.implementation])
    name, cats = max(moments.items(), key=lambda kv: sum(kv[1].values()))
    return parameters + litgpt_head_bytes(s, run.quantization), name, dict(cats, gradients=gradients)


def implementation_notes(run: StepConfig, notes: list[str], simulated: bool = False) -> list[str]:
    """The model states' notes as the run's implementation holds them: under litgpt a 4-bit base
    quantises the head too (Lightning's ``BitsandbytesPrecision`` replaces every ``Linear``), so
    the class's "embeddings, head and norms" in 16 bits reads "embeddings and norms"; and a
    line saying whose code was counted.

    Args:
        run: the step; notes: the notes the model states gave; simulated: the line names the
            simulation (memlab's copy of litgpt's code on fake tensors), not this count.

    Returns:
        The notes to print.
    """
    if run.implementation not in NORM_BYTES:
        return notes
    out = [re.sub(r"embeddings, head and norms in (\w+)", r"embeddings and norms in \1; the head in 4 bits too", n)
           if run.quantization is not None else n for n in notes]
    how = ("memlab's copy run on fake tensors (memlab.hf.litgpt_simulate)" if simulated
           else "counted op by op (memlab.lenses.litgpt_estimate)")
    return out + [f"implementation {run.implementation}: litgpt's model and finetune/lora.py under Fabric "
                  f"bf16-true, {how}"]


def litgpt_layer_bytes(s: DecoderShape, batch: int, seq: int, i: int, lora: LoraConfig,
                       quant: QuantConfig | None, norm: int = 2) -> float:
    """Bytes layer ``i`` of litgpt's LoRA model keeps for backward (the module doc's terms).

    Args:
        s: the decoder's shape; batch, seq: the micro-batch; i: the layer's index (layer 0's
            input needs no gradient: the embedding is frozen); lora: the adapters; quant: a
            4-bit base (its matmul may keep its input) or ``None``; norm: bytes per element the
            RMSNorm computes in (:data:`NORM_BYTES`).

    Returns:
        The bytes.
    """
    t, d, f = batch * seq, s.d, s.ffn
    grad_in = i > 0
    widths = dict(zip(LITGPT_TARGETS, (s.q_dim, s.kv_dim, s.kv_dim), strict=True))
    adapted = [widths[n] for n in LITGPT_TARGETS if n in lora.targets]
    n = (t * d * norm + t * norm) if grad_in else 0.0         # norm_1: its input as it computes, rsqrt per row
    if lora.dropout > 0:
        n += (t * d if grad_in else 0) + t * d * _E            # the bool mask (input's gradient), the dropped copy
    else:
        n += t * d * _E                                        # lora_A's input: the norm's output itself
    n += t * lora.rank * len(adapted) * _E                     # lora_A's output, conv1d's input
    if len(adapted) < len(LITGPT_TARGETS):
        n += t * sum(adapted) * _E + 8 * sum(adapted)          # index_copy's source and its int64 index
    n += t * (s.q_dim + 2 * s.kv_dim) * _E                     # the fused q/k/v output, v a view of it
    n += t * (s.q_dim + s.kv_dim) * _E                         # q and k after rope (torch.cat)
    n += t * s.q_dim * _E + sdpa_lse_bytes("flash", batch, s.heads, seq)  # SDPA's output, log-sum-exp
    n += t * d * norm + t * norm                               # norm_2 on the residual sum
    n += 3 * t * f * _E                                        # fc_1's output, silu's, fc_2's
    if quant is not None and quant.matmul_keeps_input:
        # MatMul4Bit keeps A where any input needs a gradient: q/k/v's input (not layer 0's, and
        # kept already as lora_A's input without dropout), fc_1/fc_2's shared input, the MLP's
        # proj's input and the attention's proj's: ``y.transpose(1, 2).reshape(B, T, C)``
        # (lit_gpt/model.py line 229 at 8641822) copies SDPA's output, which flash writes in q's layout,
        # (B, heads, T, head dim) here (``mha_fwd``'s ``out = at::empty_like(q_padded)``, PyTorch's
        # aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp), so the copy is a tensor of its own
        n += (t * d * _E if grad_in and lora.dropout > 0 else 0) + 2 * t * d * _E + t * f * _E
    return n


def litgpt_moments(s: DecoderShape, batch: int, seq: int, lora: LoraConfig,
                   quant: QuantConfig | None, norm: int = 2) -> dict[str, dict[str, float]]:
    """The candidate peak moments of litgpt's step (the activations kept, the loss's tensors):
    the logits cast to fp32 (the bf16 chunk list and its fp32 copy both alive), the loss's
    backward (the fp32 list, every chunk's fp32 log-probabilities or their gradients, one chunk's
    two gradients: where litgpt's code run on fake CUDA tensors peaks) and, on a
    4-bit base, the head's chunks dequantising the head's weight, forward and backward (the
    autograd engine runs every chunk's log-softmax backward before the head's: all their fp32
    gradients are there when the first chunk's ``MatMul4Bit.backward`` dequantises the weight).

    Args:
        s, batch, seq, lora, quant, norm: as :func:`litgpt_layer_bytes`.

    Returns:
        ``{moment: {"activations": bytes, "temporaries": bytes}}``.
    """
    t, d, V = batch * seq, s.d, s.vocab
    A = sum(litgpt_layer_bytes(s, batch, seq, i, lora, quant, norm) for i in range(s.n_layer))
    A += t * d * norm + t * norm                               # the final norm
    if quant is not None and quant.matmul_keeps_input:
        A += t * d * _E                                        # the 4-bit head's input: the final norm's output
    logits = t * V * 4                                         # the fp32 chunk list the loop holds
    moments = {"logits cast to fp32": dict(activations=A, temporaries=t * V * _E + logits),
               # a chunk's log-softmax backward: the fp32 list, each chunk's log-probabilities or (those
               # done) their gradients, and the chunk's incoming and outgoing fp32 gradients
               "loss backward": dict(activations=A, temporaries=logits + batch * (seq - 1) * V * 4
                                     + 2 * batch * LITGPT_HEAD_CHUNK * V * 4)}
    if quant is not None:
        # the head's weight dequantised in the state's fp16 (Lightning quantises ``weight.half()``)
        # and cast to the compute dtype: both copies at the cast (:data:`DEQUANTISED_BYTES`)
        weight = V * d * (DEQUANTISED_BYTES + quant.compute_bytes)
        moments["4-bit head forward"] = dict(activations=A, temporaries=t * V * _E + weight)
        # the first chunk's MatMul4Bit.backward: every chunk's fp32 gradient already cast to
        # bf16 (the casts' nodes are younger than the head's, so the engine runs them all first)
        moments["4-bit head backward"] = dict(activations=A, temporaries=logits + batch * (seq - 1) * V * _E
                                              + weight)
    return moments


def litgpt_head_bytes(s: DecoderShape, quant: QuantConfig | None) -> float:
    """Bytes litgpt's 4-bit base adds over memlab's QLoRA base: Lightning quantises the head too
    (every ``torch.nn.Linear``), which transformers' bitsandbytes loading leaves in 16 bits.

    Args:
        s: the decoder's shape; quant: the base's layout or ``None`` (a 16-bit base: 0).

    Returns:
        The bytes (negative: fewer).
    """
    if quant is None:
        return 0.0
    packed = quantized_weight_bytes(s.vocab, s.d, quant.name, double_quant=quant.double_quant)
    return packed - s.vocab * s.d * quant.rest_bytes


__all__ = ["NORM_BYTES", "DEQUANTISED_BYTES", "LITGPT_HEAD_CHUNK", "LITGPT_TARGETS", "check_implementation",
           "check_litgpt_run", "implementation_notes", "implementation_peak", "litgpt_layer_bytes", "litgpt_moments",
           "litgpt_head_bytes"]
