"""The estimate of a decoder's training step in closed form: :func:`estimate_run`.

It reads a run (:class:`memlab.step.training_step.StepConfig`) whose model is a decoder's shape
(:class:`memlab.models.decoder_shape.DecoderShape`, read from a Hugging Face config by
:func:`memlab.hf.shape.decoder_shape`) and returns the bytes of one training step, by category,
as :func:`memlab.lenses.estimate.estimate_step` does for memlab's own GPT (which hands a decoder's
run to this module: one estimate entry for every model). The terms are the tensors
``transformers``' code saves for backward, op by op, read off each family's ``modeling_*.py``
(transformers 5) and named where they are counted:

* **norms**: HF's RMSNorms are Python (``x.float()``, ``pow``, ``rsqrt``, ``weight * x``):
  they save their input in fp32 (a copy when it is 16-bit), an fp32 ``rsqrt`` per row and the
  normalised rows (Llama-style in the input's dtype; Gemma-style, ``x * (1 + w)``, in fp32).
  GPT-2's LayerNorm is the kernel: its input and two statistics per row.
* **attention**: projections (separate or fused q/k/v, biases, q/k norms on each head,
  DeepSeek's multi-head latent attention with its compressed q and kv and their norms), then
  one of three paths. SDPA's fused kernels keep q, k, v, the output and a log-sum-exp; the
  ``math`` composite (taken on CPU when dropout is on or when q/k and v head dims differ, as
  in MLA) keeps fp32 scaled q and k, v, and the ``(b, a, s, s)`` probabilities, plus the
  dropout mask and the dropped probabilities; HF's eager path (Gemma 2's logit softcapping,
  which SDPA cannot do, gpt-oss's attention sinks) keeps q, k and v repeated to every head,
  the softcap's ``tanh``, the fp32 softmax (gpt-oss's in its logits' dtype,
  :func:`eager_softmax_bytes`) and its cast copy, and the dropout mask.
* **MLP**: gated (SwiGLU/GeGLU: four hidden-size tensors a token) or GPT-2's ``gelu_new``
  (five); dropout masks on the residual branches and the embeddings.
* **mixtures of experts** (transformers' ``grouped_mm`` experts, :data:`memlab.hf.config.ROUTING_NOTE`):
  the router's scores (softmax or DeepSeek's sigmoid with group top-k), top-k indices and
  weights; the ``tokens x top_k`` gathered rows, their expert hidden states (in the experts'
  weight dtype: the grouped GEMM is not autocast) and the sort and inverse-sort indices;
  shared experts as a dense MLP. With balanced routing (the default) this does not depend on
  which experts are picked; ``expert_parallel`` ranks each hold ``1/E`` of the experts' states
  and receive the tokens routed to them through an all-to-all (``imbalance`` scales the
  busiest rank's share).

Parameter counts are the real class's (:meth:`memlab.models.decoder_shape.DecoderShape.num_params`,
checked against the model built on the meta device). A config this module cannot count in
closed form is refused with the field named and :func:`memlab.hf.simulate.simulate_hf`
(``memlab simulate --hf-config``) pointed at.

**LoRA** (:class:`memlab.step.decoder_states.Adapters`): every base weight frozen, a frozen ``Linear``
keeps no input and its autocast weight copy only where its input needs a gradient; the first
layer's inputs need none (the embedding is frozen); each adapter keeps its input as
``lora_A`` reads it and its rank-r output (:func:`adapter_saved`). The model states of the run
(full, LoRA, QLoRA, low-bit optimizers, ZeRO) are :mod:`memlab.step.decoder_states`'.

Over 500 lines because one layer's saved tensors (dense, MLA, experts, LoRA) read best in
one place, op by op, beside the peak moments they feed.
"""
from __future__ import annotations

from dataclasses import dataclass

from memlab.core.errors import InputError
from memlab.core.hardware import resolve_budget
from memlab.lenses.litgpt_estimate import check_implementation, implementation_notes, implementation_peak
from memlab.models.chunked_loss import chunked_loss_bytes
from memlab.models.decoder_shape import DecoderShape
from memlab.policy import op_bytes, precision_bytes, resolve_target, sdpa_backend, sdpa_dtype, sdpa_lse_bytes
from memlab.policy.kernels import layer_norm_stat_bytes, sdpa_backward_workspace
from memlab.step.decoder_states import Adapters, adapter_shapes, adapters_for, run_states
from memlab.step.fine_tune_config import LoraConfig
from memlab.step.states import data_parallel_ranks, tensor_parallel_share
from memlab.step.training_step import MemoryReport, StepConfig
from memlab.tracking.tracker import CATEGORIES


@dataclass(frozen=True)
class Sizes:
    """Bytes per element of a step's tensors (from :mod:`memlab.policy` via :func:`memlab.lenses.estimate.dtypes`)."""

    w: int          # weights (and the experts' grouped GEMMs, which autocast leaves alone)
    c: int          # matmul outputs
    r: int          # the residual stream
    auto: bool      # under autocast: matmul inputs are cast copies, weights cast once
    target: object
    precision: str


def _rms(z: Sizes, rows: int, width: int, in_bytes: int, style: str, input_counted: bool,
         frozen: bool = False) -> float:
    """Bytes an HF RMSNorm over ``rows x width`` saves: its input in fp32 (the input itself
    when it is fp32 and counted elsewhere, else a new fp32 tensor), an fp32 rsqrt per row,
    the normalised rows (Llama-style in the input's dtype, Gemma-style in fp32 with the
    ``1 + w`` vector). A ``frozen`` weight needs no gradient: the weight's multiply keeps
    no normalised rows (Gemma's still keeps ``1 + w`` for its input's gradient)."""
    upcast = 0 if in_bytes == 4 and input_counted else rows * width * 4
    normed = 0 if frozen else rows * width * (4 if style == "gemma" else in_bytes)
    return upcast + 4 * rows + normed + (4 * width if style == "gemma" else 0)


def _norm(z: Sizes, s: DecoderShape, rows: int, width: int, in_bytes: int, input_counted: bool = True,
          frozen: bool = False) -> float:
    if s.norm == "layer":  # the LayerNorm kernel: input and mean/rstd per row, frozen or not
        return (0 if input_counted else rows * width * in_bytes) + 2 * rows * layer_norm_stat_bytes(z.target, in_bytes)
    return _rms(z, rows, width, in_bytes, s.norm, input_counted, frozen)


def _post_norm(z: Sizes, s: DecoderShape, t: int, frozen: bool = False) -> float:
    """Bytes a post-attention or post-MLP norm (Gemma's four a layer) keeps of its ``t x d``
    input, a projection's output in the compute dtype: the input itself when fp32 (nothing
    else keeps it), else its fp32 copy, with the rsqrt and the normalised rows (:func:`_norm`)."""
    c = z.c
    return _norm(z, s, t, s.d, c, input_counted=c == 4, frozen=frozen) + (t * s.d * c if c == 4 else 0)


def _norm_input(s: DecoderShape, rows: int, width: int, in_bytes: int) -> int:
    """The residual stream a norm reads, as the norm keeps it: GPT-2's LayerNorm kernel saves
    it; an HF RMSNorm saves only ``x.float()`` (``modeling_llama.py`` ``LlamaRMSNorm.forward``:
    ``pow`` and the ``rsqrt`` multiply read the fp32 copy, counted by :func:`_rms`), which is
    the input itself when it is fp32, a new tensor when it is 16-bit (pure bf16, a QLoRA base in
    its compute dtype): then nothing keeps the 16-bit input (a residual add saves nothing)."""
    return rows * width * in_bytes if s.norm == "layer" or in_bytes == 4 else 0


def _mask_bytes(z: Sizes, elem: int) -> int:
    """A dropout mask per element: the CUDA kernel's bool mask, CPU's mask in the input's dtype
    (``input * noise / (1 - p)``, ``Dropout.cpp``)."""
    return 1 if getattr(z.target, "is_cuda", False) else elem


def _linear_inputs(z: Sizes, t: int, width: int, consumers: int, in_bytes: int) -> float:
    """What the linears reading one tensor save of it: under autocast a cast copy each when it
    is fp32 (``cached_cast`` caches leaves only); else the tensor itself, counted by its maker."""
    if z.auto and in_bytes != z.c:
        return consumers * t * width * z.c
    return 0


def adapter_saved(z: Sizes, ad: Adapters, t: int, width: int, in_bytes: int, count: int,
                  input_saved: bool, input_grad: bool = True) -> float:
    """Bytes ``count`` adapters reading one ``t x width`` tensor (of ``in_bytes`` elements)
    keep: peft casts the input to the adapters' dtype (``_cast_input_dtype``), drops it when
    ``lora_dropout > 0`` (each adapter its own mask and copy), and ``lora_A`` saves what it
    reads (a cast copy each under autocast; the tensor itself, once, when nothing changed
    it and nothing else saves it); ``lora_B`` saves ``lora_A``'s output. Dropout keeps its mask
    only for its input's gradient: not where the input needs none (``input_grad``)."""
    if not count:
        return 0.0
    src, c = ad.a, (z.c if z.auto else ad.a)
    n = count * t * ad.config.rank * c
    if ad.config.dropout > 0:
        mask = _mask_bytes(z, src) if input_grad else 0
        n += count * t * width * (mask + (z.c if z.auto and z.c != src else src))
    elif z.auto and z.c != src:
        n += count * t * width * z.c
    elif in_bytes != src:
        n += count * t * width * src
    elif not input_saved:
        n += t * width * src
    return n


def sdpa_masked(s: DecoderShape, i: int, seq: int) -> bool:
    """Whether layer ``i``'s SDPA call gets a mask tensor: a sliding-window layer over a sequence
    longer than its window (a causal mask alone is SDPA's ``is_causal``)."""
    return i in s.sliding_layers and seq > (s.window or seq)


def key_bytes(s: DecoderShape, z: Sizes) -> int:
    """Bytes per element of the keys after rope: fp32 under autocast over an fp32 residual
    (``cos``/``sin`` take the residual's dtype, ``modeling_llama.py`` line 116, and rope's
    multiplies are not autocast), else the projections'."""
    return 4 if z.auto and z.r == 4 and not s.positions else z.c


def sdpa_kv_repeated(s: DecoderShape, z: Sizes, i: int, seq: int, cache: bool = True) -> tuple[bool, bool]:
    """Whether layer ``i``'s SDPA saves its k and v (each) as new tensors repeated to every
    query head, rather than the kv heads' own tensors (``transformers`` 5.23,
    ``integrations/sdpa_attention.py``): grouped k/v with a mask take ``repeat_kv`` (line 137;
    ``use_gqa_in_sdpa``, line 52, wants no mask), whose ``reshape`` (line 29) copies unless
    there is one kv head (multi-query: the expanded size-1 dimension reshapes as a stride-0
    view of the kv head's tensor, which SDPA saves as it is). A view is still copied to every
    head where autocast casts it for SDPA: keys after rope in fp32 (:func:`key_bytes`), and
    values when the KV cache (``cache``: the config's ``use_cache``, off under checkpointing)
    promoted them to the keys' dtype (``cache_utils.py`` lines 114-116, 136-137)."""
    if not (sdpa_masked(s, i, seq) and s.kv_heads < s.heads):
        return False, False
    if s.kv_heads > 1:
        return True, True
    k = key_bytes(s, z)
    v = k if cache and s.use_cache else z.c
    return k != z.c, v != z.c


def attention_path(s: DecoderShape, z: Sizes, batch: int, seq: int, attention: str | None) -> str:
    """Which attention code runs: ``eager`` (HF's own matmul-softmax: asked for, or the class
    has no SDPA path, as Gemma 2 with its softcapping and gpt-oss with its sinks), or SDPA's
    backend on the target: a fused kernel, or ``math`` where the target's kernels refuse the
    inputs (CPU's flash kernel with dropout or unequal q/k and v head dims)."""
    if attention == "naive" or s.eager_only:
        return "eager"
    if getattr(z.target, "is_cuda", False):
        backend = sdpa_backend(z.target, z.c, max(s.head_dim, s.v_head_dim), dtype=sdpa_dtype(z.precision))
        if backend == "flash" and s.head_dim != s.v_head_dim:
            backend = "efficient"
        return backend
    if s.attn_dropout > 0 or s.head_dim != s.v_head_dim:
        return "math"
    return "cpu_flash"


ATTENTION_INPUTS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "c_attn", "q_a_proj", "kv_a_proj_with_mqa")
MLP_INPUTS = ("gate_up_proj", "gate_proj", "up_proj", "c_fc")


def _no_grad_inputs(s: DecoderShape, ad: Adapters) -> set[str]:
    """The first layer's Linears whose input needs no gradient under LoRA (the embedding is
    frozen: until an adapter's output joins, nothing needs one), whose weights' autocast copies
    are therefore not kept."""
    names = set(ATTENTION_INPUTS) | {"q_b_proj", "kv_b_proj"}
    if ad.count(s, 0, *ATTENTION_INPUTS, "q_b_proj", "kv_b_proj"):
        return names
    names |= {"o_proj"} if s.mlp != "gelu_new" else set()
    if ad.count(s, 0, "o_proj") or (s.mlp == "gelu_new" and "c_proj" in ad.names):
        return names
    names |= set(MLP_INPUTS)
    if not ad.count(s, 0, *MLP_INPUTS):
        names |= {"down_proj"}
    return names


@dataclass(frozen=True)
class _Layer:
    """What every part of one decoder layer's count shares: the shape ``s``, the sizes ``z``,
    the layer's index ``i``, its ``t`` tokens and LoRA's adapters ``ad`` (``None``: a full run)."""

    s: DecoderShape
    z: Sizes
    i: int
    t: int
    ad: Adapters | None

    @property
    def frozen(self) -> bool:
        """Under LoRA the base weights are frozen: nothing is kept for their gradients."""
        return self.ad is not None

    def w_only(self, x: float) -> float:
        """``x``, kept only for a weight's gradient."""
        return 0.0 if self.frozen else x

    def lora(self, width: int, in_bytes: int, names: tuple[str, ...], input_saved: bool = False,
             input_grad: bool = True) -> float:
        """What the adapters on ``names`` of this layer keep (:func:`adapter_saved`)."""
        ad = self.ad
        return 0.0 if ad is None else adapter_saved(self.z, ad, self.t, width, in_bytes,
                                                    ad.count(self.s, self.i, *names), input_saved, input_grad)

    def adapted(self, *names: str) -> bool:
        """Whether LoRA adapts any of ``names`` in this layer."""
        return self.ad is not None and self.ad.count(self.s, self.i, *names) > 0


def layer_activations(s: DecoderShape, z: Sizes, i: int, batch: int, seq: int, path: str,
                      ep: int = 1, imbalance: float = 1.0, adapters: Adapters | None = None,
                      grad_in: bool = True, cache: bool = True) -> float:
    """Bytes one decoder layer keeps for backward (see the module doc), ``i`` its index.

    ``adapters``: a LoRA run (:class:`Adapters`); ``grad_in``: whether the layer's input needs
    a gradient (under LoRA the first layer's does not: the embedding is frozen, so nothing
    before the first adapter saves anything); ``cache``: whether the forward builds a KV cache
    (not under checkpointing: :func:`sdpa_kv_repeated`). The parts: :func:`_attention_inputs` (the
    input, its norm, the projections), :func:`_attention_core` (scores, softmax, o_proj's
    input), then the residual branch and the MLP or experts."""
    t, d, c, r = batch * seq, s.d, z.c, z.r
    ly = _Layer(s, z, i, t, adapters)
    frozen = ly.frozen
    attn_grad = grad_in or ly.adapted(*ATTENTION_INPUTS)
    n = (_norm_input(s, t, d, r) + _norm(z, s, t, d, r, frozen=frozen)) if grad_in else 0.0  # the input, its norm
    normed = r  # the norm's output is in the residual's dtype (Gemma's: cast back by type_as)
    n += _attention_inputs(ly, normed, grad_in, attn_grad)
    core, o_in, o_in_saved = _attention_core(s, z, i, batch, seq, path, cache)
    n += core if attn_grad else 0.0  # nothing is kept when none of q, k and v needs a gradient
    a, vd = s.heads, s.v_head_dim
    n += ly.w_only(o_in + _linear_inputs(z, t, a * vd, 1, c))
    n += ly.lora(a * vd, c, ("o_proj",) if s.mlp != "gelu_new" else (), o_in_saved and attn_grad)
    if s.mlp == "gelu_new" and adapters is not None and "c_proj" in adapters.names:  # GPT-2's attention c_proj
        n += adapter_saved(z, adapters, t, d, c, 1, False)
    branch_grad = attn_grad or ly.adapted("o_proj", "c_proj")
    mid_grad = grad_in or branch_grad
    # ---- residual branch after attention
    if s.resid_dropout > 0 and branch_grad:
        n += t * d * _mask_bytes(z, c)
    if s.norms_per_layer == 4:
        if branch_grad:  # post-attention norm
            n += _post_norm(z, s, t, frozen)
        n += (_norm_input(s, t, d, r) + _norm(z, s, t, d, r, frozen=frozen)) if mid_grad else 0  # the sum, its norm
    elif mid_grad:
        n += _norm_input(s, t, d, r) + _norm(z, s, t, d, r, frozen=frozen)  # the residual sum, its norm
    # ---- MLP or experts
    if i in s.moe_layers:
        n += moe_activations(s, z, t, normed, ep, imbalance, frozen) if mid_grad else 0.0
        n += ly.lora(d, normed, ("gate_proj", "up_proj")) + ly.lora(s.shared_ffn, c, ("down_proj",))
    else:
        n += _mlp(s, z, t, s.ffn, normed, frozen, adapters, i, mid_grad)
    if s.resid_dropout > 0:
        n += t * d * _mask_bytes(z, c)
    if s.norms_per_layer == 4:
        n += _post_norm(z, s, t, frozen)  # post-MLP norm
    return n


def _attention_inputs(ly: _Layer, normed: int, grad_in: bool, attn_grad: bool) -> float:
    """What the attention's projections keep: their inputs (for the weights' gradients), their
    adapters', and MLA's low-rank ``q_a``/``kv_a`` outputs and norms, or q and k's per-head
    norms (``qk_norm``)."""
    s, z, t, frozen = ly.s, ly.z, ly.t, ly.frozen
    d, c, r = s.d, z.c, z.r
    n = 0.0
    if s.kv_lora_rank is not None:  # multi-head latent attention
        ql, kl, rope = s.q_lora_rank, s.kv_lora_rank, s.qk_rope_dim
        n += ly.w_only(_linear_inputs(z, t, d, 1 + (ql is not None), r) or t * d * r)   # q_a / kv_a inputs
        n += ly.lora(d, r, ("q_proj", "q_a_proj", "kv_a_proj_with_mqa"), input_grad=grad_in)
        if ql is not None:
            n += _rms(z, t, ql, c, "rms", False, frozen) if attn_grad else 0        # q_a's output, its norm
            n += ly.w_only(_linear_inputs(z, t, ql, 1, c) or t * ql * c)             # q_b's input
            n += ly.lora(ql, c, ("q_b_proj",))
        # kv_a's output (t x (kl + rope)) in fp32 for the norm of its kl columns, rsqrt, normed
        n += (t * (kl + rope) * 4 + 4 * t + (0 if frozen else t * kl * c)) if attn_grad else 0
        n += ly.w_only(_linear_inputs(z, t, kl, 1, c) or (t * kl * c if frozen else 0))  # kv_b's input
        n += ly.lora(kl, c, ("kv_b_proj",))
        return n
    consumers = 1 if s.fused_qkv else 3
    n += ly.w_only(_linear_inputs(z, t, d, consumers, r) or t * d * normed)
    n += ly.lora(d, normed, ("qkv_proj", "c_attn", "q_proj", "k_proj", "v_proj"), input_grad=grad_in)
    if s.qk_norm:
        for heads, name in ((s.heads, "q_proj"), (s.kv_heads, "k_proj")):  # each head's q and k
            if grad_in or ly.adapted(name):
                n += _rms(z, t * heads, s.head_dim, c, s.norm, False, frozen)
    return n


def eager_softmax_bytes(s: DecoderShape, z: Sizes) -> int:
    """Bytes per element of the eager path's softmax. HF's eager attention takes it in fp32
    (``modeling_llama.py`` line 197: ``softmax(..., dtype=torch.float32)``,
    then cast to the query's dtype). gpt-oss's takes it in the dtype of its logits
    (``modeling_gpt_oss.py`` lines 239-252, ``transformers`` 5.23: ``softmax(combined_logits,
    dtype=combined_logits.dtype)``), which ``attn_weights + attention_mask`` and
    ``torch.cat([attn_weights, sinks])`` promote from the scores (the compute dtype ``c``), the
    additive mask (the embeddings', ``r``: :func:`eager_mask`) and the sinks (a parameter,
    ``w``): fp32 under autocast over fp32 weights, 16-bit in a 16-bit model (pure bf16, a QLoRA
    base in its compute dtype), where ``.to(value_states.dtype)`` then copies nothing."""
    return max(z.c, z.r, z.w) if s.sinks else 4


def _attention_core(s: DecoderShape, z: Sizes, i: int, batch: int, seq: int,
                    path: str, cache: bool = True) -> tuple[float, float, bool]:
    """The attention core of layer ``i`` on ``path`` (``eager``, ``math`` or an SDPA kernel):
    the bytes it keeps, o_proj's input when that is a tensor of its own, and whether o_proj's
    input is one the core already keeps (an SDPA output). ``cache``: whether the forward
    builds a KV cache (:func:`sdpa_kv_repeated`)."""
    t, c = batch * seq, z.c
    a, hd, vd = s.heads, s.head_dim, s.v_head_dim
    hs = batch * a * seq * seq                      # scores per layer
    core = 0.0
    if path == "eager":
        core += t * s.q_dim * c + t * a * hd * c + t * a * vd * c  # q, k and v repeated (matmul inputs)
        if s.attn_softcap:
            core += hs * c                          # tanh's output
        cols = seq + 1 if s.sinks else seq
        if s.sinks:
            core += 8 * batch * a * seq             # the row max's indices (stabilised sinks)
        soft = eager_softmax_bytes(s, z)
        core += batch * a * seq * cols * soft       # the softmax's output
        if s.attn_dropout > 0:
            core += hs * _mask_bytes(z, c) + hs * c  # mask, dropped probabilities (matmul input)
        elif soft != c:
            core += hs * c                          # the probabilities cast for the matmul
        o_in, o_in_saved = t * a * vd * c, False    # the transposed output, o_proj's input
    elif path == "math":
        # the composite in fp32: scaled q and k (k repeated for GQA), v, probabilities
        core += t * a * hd * 4 * 2 + t * a * vd * 4 + hs * 4
        if s.attn_dropout > 0:
            core += hs * 4 + hs * 4                 # the mask (CPU: fp32) and dropped probabilities
        o_in, o_in_saved = t * a * vd * c, False    # o_proj's input (a contiguous copy)
    else:
        # k and v as SDPA saves them: each kv head once, or repeated to every query head
        k_rep, v_rep = sdpa_kv_repeated(s, z, i, seq, cache)
        kv_read = t * c * ((a if k_rep else s.kv_heads) * hd + (a if v_rep else s.kv_heads) * vd)
        core += t * s.q_dim * c + kv_read + t * s.q_dim * c  # q, k, v and the output (o_proj's input)
        o_in, o_in_saved = 0, True
        if s.fused_qkv:
            o_in, o_in_saved = t * s.q_dim * c, False  # q sliced from the fused output: copied for o_proj
            if not v_rep and not (cache and s.use_cache):
                # v is a slice of the fused output (``modeling_phi3.py`` line 222) that SDPA saves as it
                # is: the whole output stays, its q and k columns too (a KV cache's copy is saved instead)
                core += t * (s.q_dim + s.kv_dim) * c
        core += sdpa_lse_bytes(path if path != "cpu_flash" else "flash", batch, a, seq)
    if path != "eager" and sdpa_masked(s, i, seq):
        core += batch * seq * seq * c  # the sliding window's mask, a tensor SDPA keeps (not is_causal)
    return core, o_in, o_in_saved


def _mlp(s: DecoderShape, z: Sizes, t: int, f: int, normed: int, frozen: bool = False,
         ad: Adapters | None = None, i: int = 0, grad_in: bool = True) -> float:
    """A dense MLP of hidden size ``f``: its input as the linears save it, then four hidden
    tensors (gated: gate, up, act(gate), the product) or GPT-2's ``gelu_new`` five
    (input, tanh, ``0.5 x``, ``1 + tanh``, the output), the ones CUDA's autocast runs in fp32
    (``pow``'s consumers) at 4 bytes. ``frozen`` (LoRA): the linears keep no inputs, so
    neither the MLP's input nor the down projection's (the product; GPT-2's output) is kept
    but by an adapter."""
    c = z.c

    def lora(width: int, in_bytes: int, names: tuple[str, ...]) -> float:
        return 0.0 if ad is None else adapter_saved(z, ad, t, width, in_bytes, ad.count(s, i, *names), False)

    if s.mlp == "gelu_new":
        n = 0.0 if frozen else (_linear_inputs(z, t, s.d, 1, normed) or t * s.d * normed)
        p = op_bytes(z.target, "pow", c, z.precision)
        hidden = t * f * (3 * c + 2 * p if p != c else 5 * c)
        n += lora(s.d, normed, ("c_fc",))  # GPT-2's MLP c_proj adapter: counted with the attention's
        if ad is not None and "c_proj" in ad.names:
            n += adapter_saved(z, ad, t, f, c, 1, False)
        grad = grad_in or ad is None or ad.count(s, i, "c_fc") > 0
        return n + ((hidden - (t * f * c if frozen else 0)) if grad else 0.0)
    fused = s.model_type == "phi3"
    n = 0.0 if frozen else (_linear_inputs(z, t, s.d, 1 if fused else 2, normed) or t * s.d * normed)
    n += lora(s.d, normed, ("gate_up_proj", "gate_proj", "up_proj")) + lora(f, c, ("down_proj",))
    grad = grad_in or ad is None or ad.count(s, i, "gate_up_proj", "gate_proj", "up_proj") > 0
    return n + ((3 if frozen else 4) * t * f * c if grad else 0.0)


def moe_activations(s: DecoderShape, z: Sizes, t: int, normed: int, ep: int = 1,
                    imbalance: float = 1.0, frozen: bool = False) -> float:
    """An MoE block: the router (see the module doc), the grouped experts over ``t x top_k``
    (token, expert) rows in the experts' weight dtype (``w``; on ``ep`` ranks a rank's rows
    are ``imbalance / ep`` of all rows of the world, i.e. ``t k imbalance`` per rank when every
    rank sends as many as it receives), and shared experts as a dense MLP. ``frozen`` (LoRA):
    the gathered rows and the down projections' inputs are kept for the experts' weight
    gradients only, and go."""
    E, k, f, d, w, c = s.experts, s.top_k, s.moe_ffn, s.d, z.w, z.c
    n = 0.0 if frozen else (_linear_inputs(z, t, d, 1 + (s.shared_ffn > 0) * 2, normed) or t * d * normed)
    if s.router == "softmax":
        n += t * E * 4 + t * k * 8 + t * 4 + t * k * 4    # fp32 softmax, top-k indices, sum, weights
    elif s.router == "sigmoid_group":
        g, tg = s.router_groups, s.router_topk_groups
        n += t * E * 4 + t * g * 2 * 8 + t * tg * 8 + t * E + t * k * 8 + t * 4 + t * k * 4
    else:  # gpt-oss: top-k of the logits, softmax over the k in the logits' (the linear's) dtype
        n += t * k * 8 + t * k * z.c  # modeling_gpt_oss.py lines 126-128
    rows = t * k * imbalance if ep > 1 else t * k
    idx = 4 if s.expert_bias else 3               # sort/gather/inverse-sort indices (+ bias gather)
    hidden = 7 * f if s.gate == "clamped_glu" else 4 * f   # gate_up out, then act and product
    if frozen:
        hidden -= f                                # the product, the down projection's input
    gathered = 0 if frozen else d * w
    n += rows * (8 * idx + gathered + hidden * w + d * w + (4 if w == 4 or not z.auto else c))
    if s.shared_ffn:
        n += (3 if frozen else 4) * t * s.shared_ffn * c
    return n


def kept_activations(s: DecoderShape, z: Sizes, batch: int, seq: int, path: str, full: bool, params: float,
                     ep: int = 1, imbalance: float = 1.0,
                     adapters: Adapters | None = None,
                     chunked: bool = False) -> tuple[float, list[float], float, float]:
    """Activations alive when the forward reaches the loss (before its log-softmax), each
    layer's, the embedding's, and the weights autocast casts (per rank of ``ep``). Under the
    chunked loss (``chunked``) the head is no ``Linear``: it saves the final hidden states as
    they are and a log-sum-exp per token, no cast input and no cast weight.

    Args:
        s, z, batch, seq, path: the shape, the sizes, the micro-batch, the attention path.
        full: full checkpointing; params: the parameters' elements; ep, imbalance: expert parallelism;
        adapters: a LoRA run; chunked: the chunked loss.

    Returns:
        The bytes kept, each layer's, the embedding's, and the dense weights' elements.
    """
    t, V, D, L = seq * batch, s.vocab, s.d, s.n_layer
    ad = adapters
    frozen = ad is not None
    layers = [layer_activations(s, z, i, batch, seq, path, ep, imbalance, ad, grad_in=not frozen or i > 0,
                                cache=not full) for i in range(L)]
    # autocast's weight casts (saved by each linear; the experts' grouped GEMMs are not cast)
    dense_w = params - s.vocab * D * (1 + (not s.tied)) - s.positions * D - (s.expert_total() / ep)
    # a quantised base's head is 16-bit already; the chunked loss casts it per call, keeping nothing
    head_copy = V * D * z.c if z.auto and not chunked and not (frozen and ad.quantized) else 0
    if not frozen:
        copies = (dense_w * z.c if z.auto and not full else 0) + head_copy
    else:  # frozen weights are cast at every use, kept where the input needs a gradient
        lin = sum(o * i_ for i in range(L) for ios in s.linears(i).values() for i_, o in ios)
        pre = sum(o * i_ for n_, ios in s.linears(0).items() if n_ in _no_grad_inputs(s, ad) for i_, o in ios)
        base = 0 if ad.quantized else lin - pre
        cached = sum(r * c for r, c in adapter_shapes(s, ad))  # the adapters' cached casts
        copies = ((base if not full else 0) * z.c + head_copy + cached * z.c) if z.auto else 0
    # the embeddings' dropout keeps its mask where its output needs a gradient: a trained embedding,
    # or HF's checkpointing, which makes the embeddings' output require one (``modeling_utils.py``
    # line 3189, ``enable_input_require_grads``: ``output.requires_grad_(True)``, line 2144)
    embed = (t * D * s.embd_dropout and t * D * _mask_bytes(z, z.r)) if not frozen or full else 0
    if frozen and full and (s.positions or s.embd_dropout > 0):
        # a frozen embedding's output so made a leaf that needs a gradient: its AccumulateGrad node
        # holds it all step, a tensor of its own where positions are added or dropout follows (GPT-2)
        embed += t * D * z.r
    kept = sum(layers) if not full else L * t * D * z.r
    A = embed + kept + step_inputs(s, t, frozen) + copies + after_layers(s, z, t, frozen, chunked)
    return A, layers, embed, dense_w


def after_layers(s: DecoderShape, z: Sizes, t: int, frozen: bool, chunked: bool) -> float:
    """Bytes the forward keeps after its last decoder layer: the final norm's (its input and
    its own, :func:`_norm`), the head's input (none when the head is frozen; the chunked loss's
    log-sum-exp instead) and the softcap's ``tanh`` output (Gemma 2). Autocast's copy of the head's
    weight is also made after the layers; :func:`kept_activations` counts it with the other casts."""
    D = s.d
    final = _norm(z, s, t, D, z.r, frozen=frozen) + _norm_input(s, t, D, z.r)
    head_in = 0 if frozen or chunked else (_linear_inputs(z, t, D, 1, z.r) or t * D * z.r)
    head_in += 4 * t if chunked else 0  # linear_cross_entropy's log-sum-exp
    return final + head_in + (t * s.vocab * z.c if s.final_softcap else 0)


def last_experts_forward(s: DecoderShape, z: Sizes, batch: int, seq: int, path: str, *, ep: int = 1,  # noqa: PLR0913 keyword-only: the run's options by name
                         imbalance: float = 1.0, frozen: bool = False, chunked: bool = False,
                         quantized: bool = False) -> tuple[float, float] | None:
    """The last experts' forward, ``weighted_out[inv_perm]`` in transformers' grouped experts
    (``integrations/moe.py`` line 529, 5.23) when the last layer is an MoE layer (``None``
    otherwise, or under checkpointing, whose forward keeps no layer's activations): the bytes
    of the forward's activations not yet made (:func:`after_layers`, autocast's copy of the head's
    weight, the shared experts' and the layer's residual branch's), and the temporaries alive
    then that no backward saves (ZeRO-3's gathered parameters apart):

    * ``weighted_out`` and its reordered copy, ``tokens x top_k`` rows of ``d`` each
      (lines 524, 529; a plain index saves only ``inv_perm``), in the experts' weight dtype;
    * the down projection's bias gathered per row (line 508, ``selected_biases``, a local
      alive to the return: gpt-oss's experts' biases);
    * ``histc``'s float (CPU) or int32 (CUDA) expert ids and the two per-expert counts (lines 448-450);
    * the router's logits, which the MoE block holds as ``_`` to its return (``modeling_mixtral.py``
      line 126, ``modeling_qwen3_moe.py`` line 278, ``modeling_gpt_oss.py`` line 142,
      ``modeling_deepseek_v3.py`` line 218; DeepSeek's fp32, line 135);
    * the model's forward holds its inputs to every layer: the position ids (int64, ``modeling_gpt_oss.py``
      line 455), the eager path's additive masks (one per attention kind, lines 466-469;
      :func:`eager_mask`) and the KV cache every layer's attention has filled (:func:`kv_cache_held`).

    A pure 16-bit run whose router weights stay fp32 (Mixtral's) promotes ``weighted_out`` to fp32:
    there this moment is low, and the loss's is the peak."""
    L, E, d, t = s.n_layer, s.experts, s.d, batch * seq
    if (L - 1) not in s.moe_layers:
        return None
    gone = after_layers(s, z, t, frozen, chunked)
    gone += s.vocab * d * z.c if z.auto and not chunked and not (frozen and quantized) else 0
    if s.shared_ffn:  # the shared experts run after the routed ones (modeling_deepseek_v3.py line 221)
        gone += (3 if frozen else 4) * t * s.shared_ffn * z.c
        gone += 0 if frozen else 2 * t * d * z.c * (z.auto and z.r != z.c)  # their gate and up's cast input
    if s.resid_dropout > 0:
        gone += t * d * _mask_bytes(z, z.c)
    if s.norms_per_layer == 4:
        gone += _post_norm(z, s, t, frozen)
    rows = t * s.top_k * (imbalance if ep > 1 else 1)
    temps = 2 * rows * d * z.w + rows * d * z.w * s.expert_bias + rows * 4 + 2 * E * 4
    temps += t * E * (4 if s.router == "sigmoid_group" else z.c) + 8 * seq
    kinds = 1 + (0 < len(s.sliding_layers) < L)
    temps += kinds * eager_mask(s, z, batch, seq, path) + kv_cache_held(s, z, batch, seq, path, frozen, False)
    return gone, temps


def eager_mask(s: DecoderShape, z: Sizes, batch: int, seq: int, path: str) -> int:
    """Bytes of the additive mask HF's eager attention adds to the scores: ``eager_mask``
    (``transformers`` 5.23 ``masking_utils.py`` lines 612-633) turns SDPA's boolean mask into a
    ``(batch, 1, seq, seq)`` tensor of the embeddings' dtype with ``torch.where``. It is an input
    of every decoder layer: gone with the forward unless checkpointing holds it (each
    checkpointed layer keeps its inputs until its backward)."""
    return batch * seq * seq * z.r if path == "eager" else 0


def step_inputs(s: DecoderShape, t: int, frozen: bool) -> int:
    """Bytes the whole backward keeps of the step's inputs: the token ids the embedding saves for
    its weight's gradient (int64; none when it is frozen, under LoRA) and the rotary table (fp32
    ``cos`` and ``sin`` of ``t`` rows between them) the first layer's rope keeps."""
    rope = 0 if s.positions else (s.qk_rope_dim or s.head_dim)
    return (0 if frozen else 8 * t) + 4 * t * rope


def output_held(s: DecoderShape, z: Sizes, batch: int, seq: int, path: str, frozen: bool, full: bool,
                chunked: bool) -> float:
    """Bytes the model's output holds at the loss forward that no backward saves, gone with
    the output before backward (``transformers`` 5.23, read in the installed package):

    * ``last_hidden_state``: the final norm's output (``modeling_qwen3.py`` ``Qwen3Model.forward``
      line 415 returns it; ``Qwen3ForCausalLM.forward`` keeps ``outputs`` through the loss, line
      485), saved by no one when the head reads a cast copy of it (autocast) or keeps no input
      (a frozen head under LoRA).
    * the KV cache: ``use_cache`` is the config's (True by default) and a training forward
      without checkpointing builds a ``DynamicCache`` (``modeling_qwen3.py`` line 375;
      checkpointing turns it off, ``modeling_layers.py`` line 98); each layer's ``update``
      concatenates its keys and values into new tensors (``cache_utils.py`` lines 136-137;
      the sliding window's full states, lines 242-243, kept through its slices). The cache
      takes the keys' dtype (``lazy_initialization``, line 114): fp32 under autocast over an
      fp32 residual once rope (fp32 ``cos``/``sin``) has run, and ``torch.cat`` promotes the
      values to it. A cache
      tensor the attention saves as it is costs nothing more: SDPA's fused kernels save it when
      its dtype is the compute dtype; the eager path's ``repeat_kv`` returns it unrepeated when
      every head has its own; the ``math`` composite scales k (and upcasts a 16-bit v).
      DeepSeek's MLA caches its latent (``kv_a_layernorm``'s output, which ``kv_b_proj`` saves
      when its dtype is the compute dtype and the weight trains) and the rope key (expanded to
      every head, so never saved as cached): ``modeling_deepseek_v3.py`` lines 444-459.
    """
    t, n = batch * seq, 0.0
    if not chunked and (frozen or _linear_inputs(z, t, s.d, 1, z.r)):
        n += t * s.d * z.r
    return n + kv_cache_held(s, z, batch, seq, path, frozen, full)


def kv_cache_held(s: DecoderShape, z: Sizes, batch: int, seq: int, path: str, frozen: bool, full: bool) -> float:
    """The KV cache's bytes that no backward saves (:func:`output_held`'s second item): there
    from each layer's attention to the end of the loss's forward; none under checkpointing."""
    t, n = batch * seq, 0.0
    if not s.use_cache or full:
        return n
    elem = key_bytes(s, z)  # the cache takes the keys' dtype
    if s.kv_lora_rank is not None:
        latent_saved = elem == z.c and not frozen
        return s.n_layer * t * elem * (s.kv_lora_rank * (not latent_saved) + s.qk_rope_dim)
    mha = s.kv_heads == s.heads
    for i in range(s.n_layer):
        fused = path not in ("eager", "math") and not any(sdpa_kv_repeated(s, z, i, seq))  # else repeat_kv's copies
        k_as_is = elem == z.c and (fused or (path == "eager" and mha))
        v_as_is = elem == z.c and (fused or (mha and (path == "eager" or elem == 4)))
        n += t * elem * s.kv_heads * (s.head_dim * (not k_as_is) + s.v_head_dim * (not v_as_is))
    return n


#: tokens x hidden fp32 tensors alive at the peak of a Python RMSNorm's backward, read off the
#: classes' code (``transformers`` 5, ``modeling_llama.py`` ``LlamaRMSNorm.forward``: ``x.float()``,
#: ``pow(2).mean(-1)``, ``x * rsqrt(var + eps)``, ``weight * x``): in ``PowBackward0`` the incoming
#: gradient, the ``x * rsqrt`` branch's input gradient, ``MeanBackward0``'s expanded gradient,
#: ``2 * x`` and their product: 5. Gemma's ``x * (1 + weight.float())`` (``modeling_gemma3.py``
#: line 148) frees its two products (the input's and the weight's gradients) before
#: ``PowBackward0``: 5 as well (the real step's timeline; it was 7, which over-counted the chunked
#: loss's peak by ``2 t d`` fp32 and, at ``t = V / 2``, stood in for a tied head's gradient).
NORM_BACKWARD_TEMPORARIES = {"rms": 5, "gemma": 5}


def check_run(s: DecoderShape, *, attention: str | None, ep: int, zero: int, world_size: int, offload: str,
              micro_batches: int, lora: LoraConfig | None) -> None:
    """Refuse a run neither lens of a Hugging Face run counts, beyond :class:`memlab.step.training_step.StepConfig`'s
    own checks (the estimate and the simulation both call this).

    Raises:
        InputError: the argument, its value and what is allowed.
    """
    if attention == "sdpa" and s.eager_only:
        raise InputError(f"attention='sdpa': {s.model_type} has no SDPA path in transformers; allowed: naive")
    if ep > 1 and (not s.experts or s.experts % ep):
        allowed = [e for e in range(1, s.experts + 1) if s.experts % e == 0] if s.experts else [1]
        raise InputError(f"expert_parallel={ep!r} for {s.experts} experts; allowed: "
                         f"{', '.join(map(str, allowed))}")
    if ep > 1 and (zero, world_size, offload, micro_batches, lora) != (0, 1, "none", 1, None):
        raise InputError("expert_parallel counts one full-fine-tune step per expert-parallel rank; allowed "
                         "with it: zero=0, world_size=1, offload='none', micro_batches=1, no LoRA")
    if lora is not None and zero == 3:
        raise InputError("LoRA under ZeRO-3 (the frozen base partitioned too) is not counted; allowed with "
                         "LoRA: zero 0-2")


def estimate_run(run: StepConfig, *, target: str | None = None, budget: int | str | None = None,
                 card=None) -> MemoryReport:
    """Closed-form peak bytes, per rank, of one training step of a run whose model is a decoder's
    shape (:class:`memlab.step.training_step.StepConfig` with a
    :class:`memlab.models.decoder_shape.DecoderShape`): the one estimate of every fine-tune option
    (:func:`memlab.lenses.estimate.estimate_step` hands a decoder's run here).

    ``run.parallel.tensor`` (t, dividing ``world_size``): Megatron-LM's layout in groups of ``t``
    ranks, data parallelism (and ZeRO) across the ``world_size / t`` groups, as
    :func:`memlab.lenses.estimate.estimate_step` counts it for memlab's GPT: a rank's model states are
    :func:`memlab.step.states.tensor_parallel_share` of those over the data-parallel ranks, and its
    activations those of :meth:`memlab.models.decoder_shape.DecoderShape.tensor_parallel_shard`
    (``1/t`` of the heads, MLP columns and vocabulary; without sequence parallelism the residual
    stream, the norms and the checkpointed layer inputs stay whole). A full fine-tune, no expert
    parallelism.

    Args:
        run: the step (every field of the run: precision, LoRA, quantisation, ZeRO, the loss, ...).
        target: ``cpu`` or ``cuda`` (:func:`memlab.policy.resolve_target`; left out, it follows the card).
        budget: bytes, a size string or a GPU preset; the report says whether the step fits.
        card: a card profile or preset name (CUDA on that card).

    Returns:
        A :class:`MemoryReport` (lens ``estimate``) per rank; its ``step`` is ``run``.

    Raises:
        InputError: ``run``'s model is not a decoder's shape, or a combination not counted.

    Over 80 lines because it is the one place every fine-tune option (LoRA, quantisation, ZeRO,
    offload, the loss) meets the decoder's closed form, one short term each.
    """
    s = run.model_config
    if not isinstance(s, DecoderShape):
        raise InputError(f"estimate_run counts a decoder's run (a DecoderShape model), got {type(s).__name__}; "
                         f"memlab's own models: memlab.estimate_step")
    seq, batch, precision, checkpointing = run.seq, run.batch, run.precision, run.checkpointing
    attention, optimizer, zero = run.attention, run.optimizer, run.zero
    world_size, offload = run.world_size, run.offload
    lora, quantization, buckets, loss_chunk = run.lora, run.quantization, run.buckets, run.loss_chunk
    ep, imbalance = run.parallel.expert, run.parallel.expert_imbalance
    check_run(s, attention=attention, ep=ep, zero=zero, world_size=world_size, offload=offload,
              micro_batches=run.micro_batches, lora=lora)
    tp = run.parallel.tensor
    dp = data_parallel_ranks(world_size, tp)
    if tp != 1:
        s.check_tensor_parallel(tp)
        if lora is not None or ep > 1 or run.optimizer_in_backward or offload != "none":
            raise InputError(f"tensor_parallel={tp} is counted for a full fine-tune without offload; allowed "
                             f"with it: no LoRA or quantisation, expert_parallel=1, optimizer_in_backward=False, "
                             f"offload='none'")
    chunked = run.loss == "chunked"
    if chunked and s.final_softcap:
        raise InputError(f"loss='chunked' on {s.model_type}: its logits are soft-capped "
                         f"(final_logit_softcapping={s.final_softcap}); allowed: loss='transformers'")
    optimizer_in_backward = run.optimizer_in_backward
    if optimizer_in_backward and (s.experts or lora is not None):
        raise InputError("optimizer_in_backward is counted for a full fine-tune of a dense decoder (no "
                         "experts, no LoRA)")
    tgt = resolve_target(target, budget, card)
    ad = None if lora is None else adapters_for(s, lora, precision, quantization is not None)
    rs = run_states(s, precision=precision, optimizer=optimizer, zero=zero, world_size=dp,
                    offload=offload, ep=ep, ad=ad, quant=quantization, buckets=buckets)
    full_shape, s = s, s.tensor_parallel_shard(tp)  # from here on: what one TP rank runs
    param, compute, lower = precision_bytes(rs.run_precision)
    if quantization is not None:  # the unquantised rest (embeddings, norms, head) is in the compute dtype
        param = compute = quantization.compute_bytes
    z = Sizes(w=param, c=compute, r=param, auto=lower is not None, target=tgt, precision=rs.run_precision)
    k = run.micro_batches
    batch //= k
    t, V, D = seq * batch, s.vocab, s.d
    path = attention_path(s, z, batch, seq, attention)
    states = tensor_parallel_share(rs.inputs, tp)
    P, G, opt = states["parameters"], states["gradients"], states["optimizer"]
    scratch, gathered, gathered_forward = states["step"], states["gathered"], states["gathered_forward"]
    # DeepSpeed's gradient bytes held all step, and ZeRO-2's partition from the first bucket;
    # with accumulation the earlier micro-batches' gradients are there from the start
    held, late, bucket = states["held"], states["late"], states["bucket"]
    # ZeRO-2's partition comes at its first flush: with the head's gradient only if that fills a bucket
    early_late = late if V * D * z.w * (not s.tied) * (ad is None) >= states["flush"] else 0.0
    G_prev = G if k > 1 else 0.0
    # ZeRO-1's bucket, made at the first micro-batch's first gradient, is there as the last one starts
    bucket_early = states["bucket_step"] if k > 1 else 0.0
    trains_base = ad is None
    head_grad = min(G, V * D * z.w * (not s.tied) / (dp if zero >= 2 else 1)) if trains_base else 0.0
    full = checkpointing == "full"
    params = s.num_params() - s.expert_total() * (1 - 1 / ep)
    check_implementation(run)
    A, layers, embed, dense_w = kept_activations(s, z, batch, seq, path, full, params, ep, imbalance, ad, chunked)
    moment, best = _peak_moment(s, z, t, A=A, layers=layers, embed=embed, dense_w=dense_w, G=G, G_prev=G_prev,
                                held=held, late=late, early_late=early_late, bucket=bucket,
                                bucket_early=bucket_early, partitioned=zero >= 2, head_grad=head_grad,
                                gathered=gathered, gathered_forward=gathered_forward, scratch=scratch,
                                full=full, trains_base=trains_base, quantized=quantization is not None,
                                chunk=loss_chunk if chunked else None,
                                largest_grad=_largest_matrix(s) * z.w if optimizer_in_backward else None,
                                out_held=output_held(s, z, batch, seq, path, ad is not None, full, chunked),
                                mask=eager_mask(s, z, batch, seq, path),
                                experts=None if full else last_experts_forward(
                                    s, z, batch, seq, path, ep=ep, imbalance=imbalance, frozen=ad is not None,
                                    chunked=chunked, quantized=quantization is not None), adapters=ad)
    # litgpt's own model and loop replace the class's terms (transformers' pass through)
    P, moment, best = implementation_peak(run, s, batch, P, moment, best, G_prev + held)
    cats = dict.fromkeys(CATEGORIES, 0.0)
    cats.update(parameters=P, optimizer=opt, other=16 * t, workspace=tgt.resident_workspace(), **best)
    # the attention's backward workspace and a 4-bit weight dequantised live only while a layer's
    # backward runs: at the loss's moments no layer runs (the simulation's timeline shows it)
    if tgt.is_cuda and moment == "recomputed layer":
        cats["workspace"] += sdpa_backward_workspace(path, batch, s.heads, seq, s.head_dim, s.kv_heads, z.c)
    if ep > 1:  # the all-to-all's send and receive buffers of one MoE layer's rows
        cats["temporaries"] += 2 * t * s.top_k * imbalance * D * z.c
    if rs.dequantised and moment == "recomputed layer":
        cats["temporaries"] += rs.dequantised  # MatMul4Bit dequantises its whole weight
    cats = {k: int(round(v)) for k, v in cats.items()}
    host = {c: int(round(v)) for c, v in tensor_parallel_share(
        {c: rs.host.get(c, 0.0) for c in CATEGORIES}, tp).items()}
    report = MemoryReport("estimate", run, f"formula ({tgt.name})", sum(cats.values()), cats,
                          resolve_budget(budget), None, host_bytes=sum(host.values()), host_by_category=host)
    report.notes.append(f"peak moment: {moment}; attention: {path}")
    report.notes.extend(implementation_notes(run, rs.notes))
    if k > 1:
        report.notes.append(f"{k} micro-batches of {batch}: activations of one, gradients held throughout")
    if ad is not None and full and lora_recompute_tail(s, z, t, ad) is None:
        report.notes.append("LoRA with full checkpointing and no adapter on the last layer's MLP projection (or "
                            "experts there): the first recomputed layer's temporaries are approximate (with "
                            "adapters on every linear they are counted: within 0.3% of the real step on CPU); "
                            "memlab simulate --hf-config runs it")
    if tp > 1:
        report.notes.append(f"tensor parallel t={tp} (Megatron layout, no sequence parallelism: layer inputs "
                            f"and norms whole on every rank) x data parallel {dp}")
    if s.experts:
        report.notes.append(f"experts: {s.experts} routed, top-{s.top_k}; parameters "
                            f"{full_shape.num_params() / 1e9:.2f}B total, "
                            f"{full_shape.active_params() / 1e9:.2f}B active; "
                            f"routing balanced" + (f" x{imbalance} on the busiest rank" if imbalance != 1 else ""))
    if ep > 1:
        report.notes.append(f"expert parallel E={ep}: each rank holds {s.experts // ep} experts per layer "
                            f"and the all-to-all's send and receive buffers")
    return report


def _largest_matrix(s: DecoderShape) -> int:
    """Elements of a dense decoder layer's largest weight matrix (its MLP's or attention's)."""
    return s.d * max(s.ffn, s.q_dim, s.kv_dim)


def recomputed_layer(s: DecoderShape, z: Sizes, t: int, *, layers: list[float], embed: float, dense_w: float,  # noqa: PLR0913 keyword-only: the peak's terms by name
                     G: float, G_prev: float = 0.0, held: float = 0.0, late: float = 0.0, gathered: float = 0.0,
                     trains_base: bool = True, quantized: bool = False, mask: float = 0.0,
                     adapters: Adapters | None = None) -> dict[str, float]:
    """The categories of a full-checkpointing step's peak layer in backward. A full fine-tune: the
    last recomputed layer (layer 0) holds its activations with nearly all gradients
    (:func:`_layer_zero_backward`). LoRA (``trains_base`` False), whose gradients are small: the
    first recomputed one, with every layer's checkpointed input still held. Under autocast either
    holds the layer's weights cast to 16 bits.

    Args:
        s, z, t: the shape, the sizes, the tokens of the micro-batch.
        layers: each layer's kept bytes (:func:`layer_activations`); embed: the embedding's kept bytes;
        dense_w: the dense weights' elements; G, G_prev: the step's and earlier micro-batches' gradients;
        held: gradient bytes held all step (with ZeRO's bucket); late: ZeRO-2's partition;
        gathered: ZeRO-3's gathered weights; quantized: a 4/8-bit base (dequantised, not autocast's
        casts: counted by the caller); mask: layer 0's attention mask, an input its checkpoint holds
        (:func:`eager_mask`); adapters: LoRA's (its peak's tail: :func:`lora_recompute_tail`).

    Returns:
        A dict of categories (activations, gradients, temporaries) to bytes.
    """
    D, L = s.d, s.n_layer
    if not trains_base:
        # the recomputed matmuls save the layer's frozen weights cast by autocast (a frozen weight is
        # not in autocast's cache, so the first forward's casts were transient)
        casts = 0 if quantized or not z.auto else sum(o * i for ios in s.linears(L - 1).values() for i, o in ios) * z.c
        # every layer's checkpoint still holds its inputs: the mask of each attention kind, one tensor
        # the layers of a kind share (``modeling_gemma2.py`` lines 431-432: full and sliding)
        kinds = 1 + (0 < len(s.sliding_layers) < L)
        held_in = embed + L * t * D * z.r + step_inputs(s, t, True) + kinds * mask + casts
        tail = None if adapters is None else lora_recompute_tail(s, z, t, adapters)
        if tail is None:  # no adapter on the MLP's last projection (or experts there): the bound of old
            return dict(activations=held_in + layers[-1], gradients=G_prev + held,
                        temporaries=t * D * z.r + t * s.ffn * z.c + gathered)
        # the layer's input is its checkpoint's (counted in held_in), not a tensor of its own
        saved = layers[-1] - _norm_input(s, t, D, z.r)
        gone, transients = max(tail, key=lambda m: m[1] - m[0])
        return dict(activations=held_in + saved - gone, gradients=G_prev + held,
                    temporaries=t * D * z.r + transients + gathered)
    return _layer_zero_backward(s, z, t, layers[0], embed=embed + mask, dense_w=dense_w, G=G, G_prev=G_prev,
                                held=held, late=late, gathered=gathered)


def lora_recompute_tail(s: DecoderShape, z: Sizes, t: int, ad: Adapters) -> list[tuple[float, float]] | None:
    """LoRA under full checkpointing: the end of the first recomputed forward (the last layer's),
    the step's peak. Non-reentrant checkpointing reruns the layer's forward at its backward's first
    unpack and stops it once the last tensor the layer saves is made (``torch/utils/checkpoint.py``
    2.13, line 1131, ``_StopRecomputationError``): with adapters on the MLP's last projection, that is
    ``lora_A``'s output (Llama's layout), or, where the layer saves more after the projection (GPT-2's
    residual dropout mask, Gemma's post-MLP norm), the rest, through the adapter's
    ``lora_B(...) * scaling`` (peft ``tuners/lora/layer.py`` line 1102). Returns the bytes of the
    moments, each as the bytes of the layer's saved tensors not there (not yet made, or freed) and
    the transients alive beside the output's gradient (``None`` where the last projection has no
    adapter or the last layer has experts): the ends of ``lora_A`` and of ``* scaling``, where


    * the MLP's input, the last projection's input (the gated product, GPT-2's ``gelu_new`` output)
      and its frozen ``base_layer``'s output (``layer.py`` line 1082): frames' locals no frozen
      weight saves (an input ``lora_A`` keeps as it is, dropout-free and uncast, is counted there);
    * peft's cast of the projection's input to the adapters' dtype (line 1100, a local to the loop's
      end) and autocast's casts of the layer's adapter weights (the recompute reenters autocast,
      line 1682, whose cache keeps a trained leaf's cast; ``lora_B``'s is not made at ``lora_A``'s end);
    * the gradients the layer's backward made before its first unpack, by ops that save nothing: a
      16-bit branch's cast of the output's gradient at the residual add, and where nothing follows the
      projection ``* scaling``'s; Gemma's post-MLP norm's ``type_as`` makes an fp32 copy instead;
    * at ``lora_A``'s end under autocast, the dropped copy ``lora_A`` casts again; at ``* scaling``,
      ``lora_B``'s output and its scaled copy;
    * GPT-2's block keeps the attention's output in ``attn_output`` to its return
      (``modeling_gpt2.py`` lines 274, 282);

    and, without autocast and with adapters in the compute dtype, the projection's backward: its
    input's gradient through the frozen base and through the adapter, and their sum (autograd's
    input buffer adds out of place), once the adapter's saved input (the projection's input kept
    as it is, or the dropout's mask and dropped copy) and ``lora_A``'s output went with its backward
    and the tensors saved after the projection with theirs (the real step's peak without dropout).
    """
    L, d, c, r, a = s.n_layer, s.d, z.c, z.r, ad.a
    gelu = s.mlp == "gelu_new"
    if (L - 1) in s.moe_layers or not ad.count(s, L - 1, "c_proj" if gelu else "down_proj") or (
            gelu and "c_fc" not in ad.names):
        return None
    f, rank, drop = s.ffn, ad.config.rank, ad.config.dropout > 0
    b = c if z.auto else a                        # lora_B's output dtype
    kept_as_is = not drop and not z.auto          # lora_A saves an uncast, undropped input itself
    n = 0 if kept_as_is and a == r else t * d * r                 # the MLP's input
    n += (0 if kept_as_is and a == c else t * f * c) + t * d * c  # the projection's input, base output
    n += t * f * a if a != c else 0                               # peft's cast of it
    n += t * d * c if gelu else 0                                 # GPT-2's attn_output
    if z.auto:  # the layer's adapters' weights, cast and cached by the recompute's autocast
        n += sum(rank * (i + o) for name, ios in s.linears(L - 1).items() if name in ad.names for i, o in ios) * c
    later = (t * d * _mask_bytes(z, c) if s.resid_dropout > 0 else 0) + (
        _post_norm(z, s, t, frozen=True) if s.norms_per_layer == 4 else 0)
    if s.norms_per_layer == 4:
        n += t * d * 4 if c != 4 else 0
    else:
        n += (t * d * c if c != r else 0) + (0 if later else t * d * b)
    at_a = n + (t * f * a if drop and z.auto and a != c else 0) - (d * rank * c if z.auto else 0)
    moments = [(later, at_a)] + ([(later, n + 2 * t * d * b)] if later else [])
    if not z.auto and a == c:
        kept = t * f * (_mask_bytes(z, a) + a) if drop else t * f * c  # lora_A's input, as saved
        moments.append((later + kept + t * rank * c, 3 * t * f * c))
    return moments


def _layer_zero_backward(s: DecoderShape, z: Sizes, t: int, saved: float, *, embed: float, dense_w: float,  # noqa: PLR0913 keyword-only: the peak's terms by name
                         G: float, G_prev: float, held: float, late: float, gathered: float) -> dict[str, float]:
    """A full fine-tune's peak under full checkpointing: layer 0's backward, the last recomputed.

    Non-reentrant checkpointing (``torch/utils/checkpoint.py`` 2.13, ``unpack_hook`` lines
    1165-1207) reruns the whole layer's forward at the first unpack of one of its saved tensors
    (line 1183) and hands each recomputed tensor out once (line 1206): at the layer's first
    backward op every tensor the layer saves (``saved``, :func:`layer_activations`, less its own
    input, which the checkpoint holds as layer 0's input) is alive with

    * the gradient of the layer's output (``t x d`` in the residual's dtype);
    * the step's inputs (:func:`step_inputs`): the token ids and the rotary table;
    * a tied head's weight gradient, in autograd's input buffer until the embedding's backward;
    * every gradient but layer 0's and the embedding's, produced after this layer's backward.

    Then the larger of two moments (the real step's timeline, ``tests/test_hf_checkpointing.py``):
    the gated MLP's product's backward (``modeling_llama.py`` line 164, ``act(gate) * up``):
    ``MulBackward0`` holds the product's gradient and makes the gradients of both factors (the
    product itself freed with ``down_proj``'s backward, whose weight gradient is now there): net
    two MLP-wide tensors. Gemma's four norms a layer put a post-MLP norm first, whose backward
    holds :data:`NORM_BACKWARD_TEMPORARIES` fp32 ``t x d`` tensors, the output's gradient among them.
    An MoE layer 0 has the experts' product over ``tokens x top_k`` rows (in the experts' weight
    dtype), and, before any of its gradients, the recompute's end at the reordering and the
    reordering's backward (the real step's timeline: Mixtral's peak is the product's, Qwen3-MoE's
    the reordering's backward, GPT-OSS's the recompute's end).
    """
    D, V = s.d, s.vocab
    params = s.num_params()
    pending = s.layer_params(0) + V * D + s.positions * D  # layer 0's and the embeddings' gradients
    if 0 in s.moe_layers:
        # the experts' product ``act(gate) * up`` over ``tokens x top_k`` rows, in the experts' weight
        # dtype (the grouped GEMM casts its input to it: ``integrations/moe.py`` lines 378-382); its
        # backward follows the down projection's, whose weight (and bias) gradients are then there,
        # and the routing weights' multiply's and the reordering's (lines 524-529), whose saved
        # down-projection output, routing weights and ``inv_perm`` went with them
        rows = t * s.top_k
        f, fb, down = s.moe_ffn * s.top_k, z.w, s.experts * s.moe_ffn * D + s.experts * D * s.expert_bias
        gone = rows * (D * z.w + 8 + (4 if z.w == 4 or not z.auto else z.c))
    else:
        f, fb, down, gone = s.ffn, z.c, (s.ffn * D if s.mlp != "gelu_new" else 0), 0

    def grads(done: float) -> float:
        return max(G_prev, G * (1 - (pending - done) / params), late) + held

    base = saved - _norm_input(s, t, D, z.r) + (V * D * z.w if s.tied else 0) + gathered
    acts = embed + t * D * z.r + step_inputs(s, t, False) + dense_w / s.n_layer * z.c * z.auto
    mlp = base + t * D * z.r + 2 * t * f * fb - gone
    if 0 in s.moe_layers:
        # before its first unpack the layer's backward makes the reordered rows' gradient: the final
        # ``.view(tokens, top_k, d).sum(1)``'s expanded gradient, copied by the view's backward
        # (``integrations/moe.py`` line 535); then the recompute stops once the layer's last saved
        # tensor, the reordering's ``inv_perm`` (lines 527-529), is made, with ``weighted_out``,
        # ``arange``'s positions, the gathered down-projection biases, ``histc``'s ids and counts and
        # the router's logits alive; then the reordering's backward (``new_zeros`` and an
        # out-of-place ``index_put``): no gradient of layer 0 yet at either
        E, pre = s.experts, rows * D * z.w
        tail = rows * (D * z.w * (1 + s.expert_bias) + 8 + 4) + 2 * E * 4
        tail += t * E * (4 if s.router == "sigmoid_group" else z.c)
        early = base + t * D * z.r + pre + max(tail, 2 * rows * D * z.w)
        return max(dict(activations=acts, gradients=grads(down), temporaries=mlp),
                   dict(activations=acts, gradients=grads(0.0), temporaries=early),
                   key=lambda cats: sum(cats.values()))
    if s.norms_per_layer != 4 or s.norm not in NORM_BACKWARD_TEMPORARIES:
        return dict(activations=acts, gradients=grads(down), temporaries=mlp)
    # by the MLP's backward the post-MLP norm's saved tensors went with its backward, which left
    # its input's gradient (in the compute dtype)
    mlp += t * D * z.c - _post_norm(z, s, t)
    # the post-MLP norm's backward first: the layer's output gradient is the norm's incoming one
    norm = base + NORM_BACKWARD_TEMPORARIES[s.norm] * t * D * 4
    return max(dict(activations=acts, gradients=grads(down), temporaries=mlp),
               dict(activations=acts, gradients=grads(0.0), temporaries=norm), key=lambda cats: sum(cats.values()))


def _last_mlp_backward(s: DecoderShape, z: Sizes, t: int, A: float, partitioned: bool, head_grad: float,
                       G_prev: float, early_late: float, held: float, gathered: float) -> dict:
    """GPT-2's peak under stages 1-2: the last MLP's ``gelu_new`` backward, composed of elementwise
    ops (tanh, pow, mul), holds its incoming gradient and two temporaries of the MLP's width while
    the bucket is there (``held`` includes it). The head's input, the final norm's, the MLP
    output's dropout mask and c_proj's input went with their backward (``A`` less the softcap);
    ZeRO-1 keeps the final norm's and c_proj's gradients; the tied head's weight gradient waits
    for the embedding's backward."""
    D, V = s.d, s.vocab
    gone = (t * D * z.r + _norm_input(s, t, D, z.r) + _norm(z, s, t, D, z.r)
            + (t * D * _mask_bytes(z, z.c) if s.resid_dropout > 0 else 0) + t * s.ffn * z.c)
    kept = 0.0 if partitioned else head_grad + (2 * D + s.ffn * D + D) * z.w
    return dict(activations=A - gone, gradients=max(G_prev, kept + early_late) + held,
                temporaries=V * D * z.w * s.tied + t * D * z.c + 3 * t * s.ffn * z.c + gathered)


def _chunked_loss_moments(s: DecoderShape, z: Sizes, t: int, chunk: int, *, A: float, G_prev: float,  # noqa: PLR0913 keyword-only: the peak's terms by name
                          held: float, gathered: float, head_grad: float, late: float, bucket: float,
                          trains_base: bool) -> dict[str, dict]:
    """The moments of a chunked loss (:func:`memlab.models.chunked_loss.chunked_loss_bytes`), which
    replace the loss's and the head's in :func:`_peak_moment`, and the final norm's backward, which
    with no logits alive can be the peak. Arguments as :func:`_peak_moment`'s."""
    V, D = s.vocab, s.d
    loss = chunked_loss_bytes(V, D, chunk, t, compute=z.c, hidden=z.r, weight=z.w, head_grad=trains_base)
    tied_grad = loss["chunked loss backward"]["gradients"] if trains_base and s.tied else 0
    grad_w = max(G_prev, head_grad + late) if trains_base and not s.tied else G_prev
    m = {"chunked loss forward": dict(activations=A, gradients=G_prev + held,
                                      temporaries=loss["chunked loss forward"]["temporaries"] + gathered),
         "chunked loss backward": dict(activations=A, gradients=grad_w + held + tied_grad,
                                       temporaries=loss["chunked loss backward"]["temporaries"] + gathered)}
    if s.norm in NORM_BACKWARD_TEMPORARIES:
        m["final norm backward"] = dict(
            activations=A - 4 * t, gradients=grad_w + held + bucket * trains_base + D * z.w * trains_base + tied_grad,
            temporaries=NORM_BACKWARD_TEMPORARIES[s.norm] * t * D * 4 + gathered)
    return m


def _gradient_hooks(s: DecoderShape, z: Sizes, t: int, *, A: float, softcap: float, partitioned: bool,  # noqa: PLR0913 keyword-only: the peak's terms by name
                    head_grad: float, trains_base: bool, early_late: float, G_prev: float, held: float,
                    bucket: float, gathered: float) -> dict[str, dict[str, float]]:
    """The moments where ZeRO stages 1-2 allocate their reduce bucket (``bucket``) in the first
    trained gradient's hook, with the class's loss (no chunks): the final norm's backward, and an
    untied head's gradient hook. Args as :func:`_peak_moment`'s; returns moment -> categories."""
    D, V = s.d, s.vocab
    m: dict[str, dict[str, float]] = {}
    if s.norm in NORM_BACKWARD_TEMPORARIES:
        # the first trained gradient's hook allocates stages 1-2's bucket while nearly every
        # activation is alive: the final norm's backward (its weight's hook, or the last layer's
        # first adapter's under LoRA); ZeRO-1 keeps the head's gradient, ZeRO-2 copied it into
        # the bucket (the partition is there once a bucket was flushed: ``late``)
        kept = 0.0 if partitioned else head_grad + D * z.w * trains_base
        # the head's input (autocast's cast), the norm's normalised input and the softcap's tanh
        # output (Gemma 2) went with their backward; a tied head's weight gradient waits in
        # autograd's input buffer for the embedding's backward
        tied_grad = V * D * z.w if s.tied and trains_base else 0
        m["first gradient hook"] = dict(activations=A - 4 * t - t * D * (z.c + z.r) - softcap,
                                        gradients=max(G_prev, kept + early_late) + held + bucket,
                                        temporaries=NORM_BACKWARD_TEMPORARIES[s.norm] * t * D * 4 + gathered
                                        + tied_grad)
    if trains_base and not s.tied:
        # an untied head's weight has the first trained gradient: its hook allocates stages 1-2's
        # bucket with that gradient alive (the hook copies it in) beside the hidden state's; the
        # head's input went with its backward; after the first micro-batch the partition is there
        m["head gradient hook"] = dict(activations=A - t * D * z.c, gradients=G_prev + held + bucket,
                                       temporaries=V * D * z.w + t * D * z.c + gathered)
    return m


def _peak_moment(s: DecoderShape, z: Sizes, t: int, *, A: float, layers: list[float], embed: float,  # noqa: PLR0913 keyword-only: the peak's terms by name
                 dense_w: float, G: float, G_prev: float, held: float, late: float, early_late: float,
                 bucket: float, partitioned: bool, head_grad: float, gathered: float, scratch: float, full: bool,
                 trains_base: bool, quantized: bool = False, bucket_early: float = 0.0,
                 chunk: int | None = None, largest_grad: float | None = None,
                 out_held: float = 0.0, gathered_forward: float = 0.0, mask: float = 0.0,
                 experts: tuple[float, float] | None = None, adapters: Adapters | None = None) -> tuple[str, dict]:
    """The moment of the step whose bytes are largest, and its categories: the loss
    (HF's ``ForCausalMLoss``: ``logits.float()``, then cross-entropy in fp32; or, with a
    ``chunk``, :func:`memlab.models.chunked_loss.chunked_loss_bytes`' two moments), the head's
    backward, the end of backward, the optimizer step, a recomputed layer (the last one, layer 0,
    with nearly every gradient; under LoRA, whose gradients are small, the first one, with every
    layer's checkpointed input still held). ``bucket``: stages 1-2's reduce bucket, there from
    the first trained parameter's gradient (an untied head's, whose hook holds it beside the
    bucket) to the end of backward; ``bucket_early``: the part of it there before the last
    micro-batch's first gradient (ZeRO-1 with accumulation holds it from the first one's:
    :class:`memlab.step.states.ModelStates` ``bucket_until``); ``early_late``: ``late`` where
    the head's gradient alone fills ZeRO-2's first bucket, else 0; ``partitioned``: ZeRO-2 or 3
    (a gradient leaves ``param.grad`` at its hook). ``gathered_forward``: ZeRO-3's gathered
    parameters at the end of forward (``gathered`` after it), the root's flat buffer with the
    copies when its prefetch took the whole model (:func:`memlab.step.zero3_gathers.gathered_in_closed_form`).
    ``mask``: the eager attention's mask, which the checkpoint of layer 0 holds (:func:`eager_mask`).
    ``experts``: the last experts' forward, activations not yet made and temporaries
    (:func:`last_experts_forward`): with ZeRO-3's flat buffer it can be the step's peak.

    ``largest_grad`` (the optimizer step in backward, :mod:`memlab.step.optimizer_in_backward`): no moment holds
    every gradient; a layer's backward holds the one being applied (at most ``largest_grad``) and a
    tied head's, in flight until the embedding's backward; the optimizer-step moment is gone."""
    V, D = s.vocab, s.d
    # an early bucket is held like the earlier micro-batches' gradients; a hook adds the rest
    G_prev, whole_bucket, bucket = G_prev + bucket_early, bucket, bucket - bucket_early
    lsm, softcap = t * V * 4, t * V * z.c if s.final_softcap else 0  # softcap: in A until the loss's backward
    cast = t * V * 4 if z.c != 4 else 0
    # autocast's cache keeps every trained weight's 16-bit cast until the forward's autocast
    # region closes, after the loss: under checkpointing nothing else keeps them
    cache = dense_w * z.c if z.auto and full and trains_base else 0
    m = {"loss forward": dict(activations=A + lsm, temporaries=t * V * z.c + cast + gathered + cache + out_held,
                              gradients=G_prev + held),
         # the final norm's output, before the head runs: no logits yet (nor the softcap's tanh),
         # ZeRO-3's flat buffer still there until the head's fetch (a tied head's goes with the
         # last layer's last projection, a few activations earlier: A bounds them)
         "end of forward": dict(activations=A - softcap, temporaries=gathered_forward + cache + out_held,
                                gradients=G_prev + held),
         # the 16-bit logits went with the model's output; the fp32 gradients of the loss and of the
         # log-softmax are live (measured: tests/test_hf_simulate_run.py)
         "log-softmax backward": dict(activations=A + lsm, gradients=G_prev + held,
                                      temporaries=2 * t * V * 4 + gathered),
         "head backward": dict(activations=A, temporaries=t * V * z.c + t * D * z.c + gathered,
                               gradients=max(G_prev, head_grad + early_late) + held),
         "end of backward": dict(gradients=G + held + whole_bucket,
                                 temporaries=(2 * V * D * z.w if trains_base and s.tied else 0) + t * D * z.r),
         "optimizer step": dict(gradients=G + held, temporaries=scratch)}
    if chunk is not None:  # no logits: the chunked loss's own moments replace the loss and the head's
        for key in ("loss forward", "log-softmax backward", "head backward"):
            del m[key]
        m.update(_chunked_loss_moments(s, z, t, chunk, A=A, G_prev=G_prev, held=held, gathered=gathered,
                                       head_grad=head_grad, late=late, bucket=bucket, trains_base=trains_base))
    if whole_bucket and chunk is None:
        m.update(_gradient_hooks(s, z, t, A=A, softcap=softcap, partitioned=partitioned, head_grad=head_grad,
                                 trains_base=trains_base, early_late=early_late, G_prev=G_prev, held=held,
                                 bucket=bucket, gathered=gathered))
    if whole_bucket and chunk is None and s.mlp == "gelu_new" and trains_base and not full:
        m["last MLP backward"] = _last_mlp_backward(s, z, t, A - softcap, partitioned, head_grad,
                                                    G_prev, early_late, held + bucket, gathered)
    if experts is not None:  # the last experts' forward: ZeRO-3's flat buffer is still there
        gone, temps = experts
        m["last experts' forward"] = dict(activations=A - gone, temporaries=temps + gathered_forward,
                                          gradients=G_prev + held)
    if full:
        m["recomputed layer"] = recomputed_layer(s, z, t, layers=layers, embed=embed, dense_w=dense_w, G=G,
                                                 G_prev=G_prev, held=held + (bucket if trains_base else 0),
                                                 late=late, gathered=gathered, trains_base=trains_base,
                                                 quantized=quantized, mask=mask, adapters=adapters)
    if largest_grad is not None:
        embed_grad = V * D * z.w
        for name, cats in m.items():
            cats["gradients"] = {"head backward": head_grad, "end of backward": embed_grad,
                                 "recomputed layer": largest_grad + embed_grad * s.tied}.get(name, 0.0)
        del m["optimizer step"]
    return max(m.items(), key=lambda kv: sum(kv[1].values()))


__all__ = ["NORM_BACKWARD_TEMPORARIES", "Sizes", "adapter_saved", "after_layers", "attention_path", "check_run",
           "kv_cache_held", "last_experts_forward", "lora_recompute_tail", "output_held",
           "sdpa_masked", "sdpa_kv_repeated", "key_bytes", "kept_activations", "layer_activations",
           "recomputed_layer", "moe_activations", "estimate_run"]
