"""After supervised fine-tuning: the memory of a DPO or GRPO step (TRL 1.16), in closed form.

An :class:`Objective` says what the step trains on; :func:`estimate_post_training` counts the
peak of one step from the supervised estimate's pieces (:func:`memlab.hf_estimate.forward_activations`,
:func:`memlab.hf_states.run_states`, :func:`memlab.hf_shape.decoder_shape`) plus what TRL adds,
read off its source (trl 1.16.0):

* **the fused log-probabilities**: both trainers call the model with ``fused_lm_head=True``
  (``trl/trainer/utils.py`` ``add_fused_lm_head``, line 1548; DPO ``dpo_trainer.py`` line 1306,
  GRPO ``grpo_trainer.py`` line 1498), which never builds the ``(rows, seq, vocab)`` logits:
  ``trl/kernels/chunked_logprob.py`` ``ChunkedLogProbFunction`` (line 299) projects tiles of
  ``[min(N, 4096), 32768]`` tokens x vocabulary into one buffer ``mm_buf`` allocated at that
  full width in the compute dtype (lines 347 and 413, whatever the vocabulary), keeps the
  hidden rows, the targets and ``log_z``, and in backward accumulates the hidden's and the
  head's gradients in fp32 (lines 407-410). Off CUDA there is no Triton: every position is
  scored (``compact`` is False, utils.py line 1638) and each tile is folded by torch ops
  (``_backward_tile``, line 257), whose fp32 ``[tokens, vocab]`` temporaries peak at seven plus a
  bool mask at ``is_target.float() - p``; on CUDA only the completion tokens are scored and
  the Triton kernel works in place.
* **DPO**: chosen and rejected are one batch of ``2 x batch`` rows (the collator repeats the
  prompt, ``dpo_trainer.py`` line 146); the policy's forward, then the reference's under
  ``no_grad`` (line 1327: a separate model, or the policy with its adapter disabled under
  peft), then the backward. ``precompute_ref_log_probs`` runs the reference before training
  and keeps no reference model (line 909).
* **GRPO**: ``transformers``' ``generate`` of ``num_generations`` completions per prompt
  (``grpo_trainer.py`` line 1873, under ``no_grad``), its KV cache in the model's dtype
  (:func:`kv_cache_bytes`); the reference's log-probabilities when ``beta != 0``
  (line 2711), before the policy's training forward on prompt + completion.

The peak is the largest of the moments: the fused head's backward (every activation held,
``mm_buf`` and the gradient accumulators), the reference's forward, generation, and the
optimizer step.
"""
from __future__ import annotations

import pathlib
from dataclasses import dataclass

from .errors import InputError
from .hardware import resolve_budget
from .hf import check_seq, load_config
from .hf_estimate import forward_activations
from .hf_shape import decoder_shape
from .hf_states import adapter_shapes, adapters_for, run_states
from .policy import resolve_target
from .precision import precision_bytes
from .run import HFRun, LoraConfig
from .step import MemoryReport
from .tracking import CATEGORIES

KINDS = ("supervised", "dpo", "grpo")
#: ``trl/kernels/chunked_logprob.py``: tokens per projection tile, and the vocabulary tile
#: (``_CHUNKED_LOGPROB_CHUNK_SIZE`` in ``trl/trainer/utils.py``)
TOKEN_TILE = 4096
VOCAB_TILE = 32768
#: bytes per ``[tokens, vocab]`` element live in ``_backward_tile`` at its peak (``y``, ``z``,
#: ``log_p``, ``p``, ``grad``, ``is_target.float()``, ``... - p`` in fp32; ``is_target`` a bool)
CPU_TILE_BYTES = 7 * 4 + 1
CACHES = ("dynamic", "static")


@dataclass(frozen=True)
class Objective:
    """What a post-training step trains on (TRL 1.16's ``DPOConfig`` / ``GRPOConfig``).

    Raises:
        InputError: a field value that is not allowed (checked when made).
    """

    kind: str = "supervised"
    """``supervised`` (memlab's own step), ``dpo`` or ``grpo``."""
    prompt_len: int = 128
    """Prompt tokens per row (the padded prompt)."""
    completion_len: int = 128
    """Completion tokens per row: DPO the longer of chosen and rejected (EOS included), GRPO
    ``max_completion_length``."""
    beta: float = 0.1
    """The KL coefficient. GRPO keeps (and runs) a reference model only when it is not 0
    (TRL's GRPO default is 0.0); DPO always needs the reference's log-probabilities."""
    reference: bool = True
    """Whether a reference model exists as weights of its own: a DPO reference model, GRPO with
    ``beta != 0``. Under LoRA the reference is the policy with its adapter disabled (no extra
    weights); with ``precompute_ref_log_probs`` none is kept."""
    precompute_ref_log_probs: bool = False
    """DPO: the reference's log-probabilities computed once over the dataset before training:
    no reference weights and no reference forward in the step."""
    concatenated: bool = True
    """DPO: chosen and rejected run as one ``2 x batch`` forward (TRL 1.16 always does; ``False``
    counts two forwards of ``batch`` rows each, as older TRL's ``concatenated_forward=False``,
    the first half's activations kept until the loss)."""
    num_generations: int = 8
    """GRPO: completions per prompt (``num_generations``); the batch counts completions."""
    generation_batch: int | None = None
    """GRPO: completions generated at once (``generation_batch_size``; ``None``: the batch, one
    generation per optimizer step)."""
    cache: str = "dynamic"
    """GRPO: the generation's KV cache, ``dynamic`` (``DynamicCache``, grown by ``torch.cat``)
    or ``static`` (``StaticCache``, preallocated to prompt + completion)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InputError(f"objective kind={self.kind!r}; allowed: {', '.join(KINDS)}")
        for name in ("prompt_len", "completion_len", "num_generations"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"{name}={v!r}; allowed: a positive integer")
        if self.generation_batch is not None and (not isinstance(self.generation_batch, int)
                                                  or self.generation_batch < 1):
            raise InputError(f"generation_batch={self.generation_batch!r}; allowed: a positive integer or None")
        if self.cache not in CACHES:
            raise InputError(f"cache={self.cache!r}; allowed: {', '.join(CACHES)}")

    @property
    def seq(self) -> int:
        """Tokens per row of the policy's training forward."""
        return self.prompt_len + self.completion_len

    def holds_reference(self, lora: LoraConfig | None) -> bool:
        """Whether the step holds a reference model's weights beside the policy."""
        if lora is not None or self.kind == "supervised":
            return False
        if self.kind == "dpo":
            return self.reference and not self.precompute_ref_log_probs
        return self.reference and self.beta != 0

    def runs_reference(self) -> bool:
        """Whether the step runs a reference forward (separate or the disabled adapter)."""
        if self.kind == "dpo":
            return not self.precompute_ref_log_probs
        return self.kind == "grpo" and self.beta != 0


def kv_cache_bytes(cfg: dict | str | pathlib.Path, *, batch: int, tokens: int, dtype_bytes: int = 2) -> int:
    """Bytes of a KV cache as ``transformers``' ``DynamicCache`` holds it after ``tokens``
    positions (``StaticCache`` preallocates the same shapes at ``max_length - 1`` before the
    first token, ``transformers/generation/utils.py`` line 2962): every layer a key and a value
    of ``[batch, kv_heads, tokens, head_dim]`` in the model's dtype (``transformers/cache_utils.py``,
    ``DynamicLayer.update`` and ``StaticLayer.lazy_initialization``). Generating ``n`` new
    tokens after a ``p``-token prompt caches ``p + n - 1`` positions (the last token is never fed back).

    Args:
        cfg: a config dict, config.json or shipped name.
        batch, tokens: rows and positions cached (a static cache: its maximum length).
        dtype_bytes: bytes per element of the model's weights (4 fp32, 2 bf16).

    Returns:
        The bytes, an int.
    """
    s = decoder_shape(cfg)
    if batch < 1 or tokens < 1:
        raise InputError(f"batch={batch!r}, tokens={tokens!r}; allowed: positive integers")
    return s.n_layer * batch * s.kv_heads * tokens * (s.head_dim + s.v_head_dim) * dtype_bytes


def fused_head_backward(n: int, vocab: int, d: int, compute: int, hidden: int, cuda: bool,
                        head_trains: bool) -> float:
    """Temporaries and gradients of ``ChunkedLogProbFunction.backward`` at its peak for ``n``
    scored positions: ``mm_buf`` (tile rows x 32768 in the compute dtype), the fp32 gradient
    accumulators of the hidden rows and (when the head trains) the head, the hidden rows and
    the head cast to the compute dtype, and (off CUDA) ``_backward_tile``'s fp32 temporaries."""
    rows = min(n, TOKEN_TILE)
    width = min(vocab, VOCAB_TILE)
    out = rows * VOCAB_TILE * compute + n * d * 4 + (vocab * d * 4 if head_trains else 0)
    out += (rows * d * compute if compute != hidden else 0) + (width * d * compute if compute != hidden else 0)
    out += 2 * n * 4  # the incoming gradient of the log-probabilities, made contiguous in fp32
    if not cuda:
        out += rows * width * CPU_TILE_BYTES
    return out


def fused_head_saved(n: int, d: int, hidden: int) -> float:
    """What ``ChunkedLogProbFunction`` keeps for backward: the ``n`` hidden rows (a copy: the
    shifted slice reshaped or masked), the targets (int64), ``log_z`` and the entropy (fp32)."""
    return n * d * hidden + n * 8 + 2 * n * 4


def estimate_post_training(cfg: dict | str | pathlib.Path, objective: Objective, *, batch: int,
                           precision: str = "bf16", lora: LoraConfig | None = None,
                           checkpointing: str | None = None, target: str | None = None,
                           optimizer: str = "adamw", budget: int | str | None = None) -> MemoryReport:
    """Closed-form peak bytes of one TRL step of ``objective`` on the HF decoder of ``cfg``.

    Args:
        cfg: a config dict, config.json, its folder or a shipped name.
        objective: the :class:`Objective` (``dpo`` or ``grpo``).
        batch: ``per_device_train_batch_size`` (DPO: pairs; GRPO: completions).
        precision: ``bf16`` (TRL's default: autocast on fp32 weights), ``fp32`` or ``pure-bf16``.
        lora: LoRA adapters (the reference becomes the disabled adapter).
        checkpointing: ``none`` or ``full``.
        target: ``cpu`` or ``cuda`` (CUDA scores only completion tokens, in Triton).
        optimizer: as :func:`memlab.hf_estimate.estimate_hf`.
        budget: a device size to compare against.

    Returns:
        A :class:`MemoryReport` (lens ``estimate``); its notes name the peak moment.
    """
    o = objective
    if o.kind == "supervised":
        raise InputError("objective 'supervised' is memlab's own step; use memlab.hf_estimate.estimate_hf")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise InputError(f"batch={batch!r}; allowed: a positive integer")
    d_cfg = load_config(cfg)
    s = decoder_shape(d_cfg)
    check_seq(d_cfg, o.seq)
    tgt = resolve_target(target, budget)
    cuda = getattr(tgt, "is_cuda", False)
    w, c, auto = precision_bytes(precision)
    ad = None if lora is None else adapters_for(s, lora, precision)
    rs = run_states(s, precision=precision, optimizer=optimizer, zero=0, world_size=1, offload="none",
                    ep=1, ad=ad, quant=None)
    st = rs.inputs
    P, G, opt, scratch = st["parameters"], st["gradients"], st["optimizer"], st["step"]
    ref = s.num_params() * w if o.holds_reference(lora) else 0
    rows = 2 * batch if o.kind == "dpo" else batch
    fwd_rows = rows if (o.kind != "dpo" or o.concatenated) else batch
    seq = o.seq
    V, D = s.vocab, s.d
    scored = fwd_rows * (seq - 1) if not cuda else fwd_rows * o.completion_len
    A = forward_activations(d_cfg, seq=seq, batch=fwd_rows, precision=precision, checkpointing=checkpointing,
                            target=target, lora=lora)
    # estimate_hf's head terms: the head's input and its autocast weight copy, which the fused
    # head saves neither of (it keeps its own hidden rows, below)
    A -= (0 if lora is not None else fwd_rows * seq * D * w) + (V * D * c if auto else 0)
    A += fused_head_saved(scored, D, w)
    if o.kind == "dpo" and not o.concatenated:
        A *= 2  # both halves' graphs are alive when the loss's backward starts
    head_trains = lora is None and not s.tied
    moments = {
        "fused log-prob backward": dict(parameters=P + ref, optimizer=opt, activations=A,
                                        temporaries=fused_head_backward(scored, V, D, c, w, cuda, head_trains)
                                        - (V * D * 4 if head_trains else 0),
                                        gradients=V * D * 4 if head_trains else 0),
        "optimizer step": dict(parameters=P + ref, optimizer=opt, gradients=G, temporaries=scratch),
    }
    if o.runs_reference():
        ref_rows = fwd_rows if o.kind == "dpo" else rows
        ref_scored = ref_rows * (seq - 1) if not cuda else ref_rows * o.completion_len
        held = A if o.kind == "dpo" else 0  # DPO: after the policy's forward; GRPO: before it
        tile = min(ref_scored, TOKEN_TILE)
        moments["reference forward"] = dict(
            parameters=P + ref, optimizer=opt, activations=held,
            temporaries=tile * VOCAB_TILE * c + ref_scored * D * w + (0 if cuda else 4 * tile * min(V, VOCAB_TILE) * 4))
    if o.kind == "grpo":
        gen = o.generation_batch or batch
        cache = kv_cache_bytes(d_cfg, batch=gen, tokens=seq - 1, dtype_bytes=w)
        moments["generation"] = dict(parameters=P + ref, optimizer=opt, other=cache,
                                     temporaries=gen * V * 4 + gen * o.prompt_len * s.ffn * c * 3)
    moment, best = max(moments.items(), key=lambda kv: sum(kv[1].values()))
    cats = dict.fromkeys(CATEGORIES, 0)
    cats.update({k: int(round(v)) for k, v in best.items()})
    cats["other"] += 16 * rows * seq  # the batch's ids, masks and labels (int64)
    cats["workspace"] += tgt.resident_workspace()
    n_ad = 0 if ad is None else sum(r * k for r, k in adapter_shapes(s, ad))
    info = HFRun(s.name, s.num_params() + n_ad, n_ad or s.num_params(), seq=seq, batch=rows,
                 precision=precision, checkpointing=checkpointing or "none", optimizer=optimizer, lora=lora)
    report = MemoryReport("estimate", info, f"formula ({tgt.name})", sum(cats.values()), cats,
                          resolve_budget(budget))
    report.notes.append(f"{o.kind} (TRL 1.16): peak moment: {moment}; {rows} rows of {seq} tokens"
                        + ("; a reference model held" if ref else ""))
    return report


def vllm_training_budget(card: int | str, gpu_memory_utilization: float) -> int:
    """Bytes of the card left to training when a colocated vLLM engine takes its share.

    vLLM's ``gpu_memory_utilization`` is "the fraction of GPU memory to be used for the model
    executor" (its weights, activations and KV cache), of the whole card's memory, not of what is
    free: vLLM asks for ``total x u`` and refuses to start when less is free (vLLM engine
    arguments, ``--gpu-memory-utilization``; vllm-project/vllm PR #9505). TRL passes
    ``vllm_gpu_memory_utilization`` (``GRPOConfig`` default 0.3) to ``vllm.LLM`` in colocate mode
    (``trl/generation/vllm_generation.py`` line 350). What is left, ``(1 - u)`` of the card, is the
    budget the training step must fit.

    Args:
        card: the card's bytes or a GPU preset (``"H100-80GB"``).
        gpu_memory_utilization: vLLM's fraction, in (0, 1].

    Returns:
        The bytes left to training, an int.
    """
    total = resolve_budget(card)
    if total is None:
        raise InputError(f"card={card!r}; allowed: bytes, a size such as '80GiB', or a GPU preset")
    u = gpu_memory_utilization
    if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
        raise InputError(f"vllm_gpu_memory_utilization={u!r}; allowed: a fraction in (0, 1]")
    return int(total * (1 - u))


__all__ = ["CACHES", "CPU_TILE_BYTES", "KINDS", "Objective", "TOKEN_TILE", "VOCAB_TILE", "estimate_post_training",
           "fused_head_backward", "fused_head_saved", "kv_cache_bytes", "vllm_training_budget"]
