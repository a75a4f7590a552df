"""After supervised fine-tuning: the memory of a DPO or GRPO step (TRL 1.16), in closed form.

An :class:`Objective` says what the step trains on; :func:`estimate_post_training` counts the
peak of one step from the supervised estimate's pieces (:func:`memlab.hf.estimate.forward_activations`,
:func:`memlab.step.decoder_states.run_states`, :func:`memlab.hf.shape.decoder_shape`) plus what TRL adds,
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
optimizer step. The reward model (``RewardTrainer``) has no fused head: a score of ``hidden x 1``
(:func:`estimate_reward_step`).

Over 500 lines because it is the one closed form of TRL's three steps and the reading of their
three configs into it (:func:`read_trl_args`), which share the :class:`Objective` and its notes.
"""
from __future__ import annotations

import dataclasses
import pathlib
from dataclasses import dataclass

from memlab.core.errors import InputError
from memlab.core.hardware import resolve_budget
from memlab.core.precision import precision_bytes
from memlab.hf.config import check_seq, load_config
from memlab.hf.estimate import forward_activations
from memlab.hf.read_run_configs import trainer_precision
from memlab.hf.shape import decoder_shape
from memlab.lenses.decoder_estimate import (
    NORM_BACKWARD_TEMPORARIES,
    Sizes,
    attention_path,
    kept_activations,
    recomputed_layer,
)
from memlab.policy import resolve_target
from memlab.step.decoder_states import adapters_for, run_states
from memlab.step.fine_tune_config import LoraConfig, QuantConfig
from memlab.step.low_bit import HF_OPTIMIZERS
from memlab.step.training_step import MemoryReport, StepConfig
from memlab.tracking.tracker import CATEGORIES

KINDS = ("supervised", "dpo", "grpo", "reward")
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
    """``supervised`` (memlab's own step), ``dpo``, ``grpo`` or ``reward`` (``RewardTrainer``: a
    sequence-classification head scoring chosen and rejected, one ``2 x batch`` forward)."""
    prompt_len: int = 128
    """Prompt tokens per row (the padded prompt)."""
    completion_len: int = 128
    """Completion tokens per row: DPO and the reward model the longer of chosen and rejected (EOS
    included), GRPO ``max_completion_length``."""
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
        if lora is not None or self.kind in ("supervised", "reward"):
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
                           optimizer: str = "adamw", budget: int | str | None = None,
                           quantization: QuantConfig | None = None) -> MemoryReport:
    """Closed-form peak bytes of one TRL step of ``objective`` on the HF decoder of ``cfg``.

    Args:
        cfg: a config dict, config.json, its folder or a shipped name.
        objective: the :class:`Objective` (``dpo`` or ``grpo``).
        batch: ``per_device_train_batch_size`` (DPO: pairs; GRPO: completions).
        precision: ``bf16`` (TRL's default: autocast on fp32 weights), ``fp32`` or ``pure-bf16``.
        lora: LoRA adapters (the reference becomes the disabled adapter).
        checkpointing: ``none`` or ``full``.
        target: ``cpu`` or ``cuda`` (CUDA scores only completion tokens, in Triton).
        optimizer: as :func:`memlab.hf.estimate.estimate_hf`.
        budget: a device size to compare against.
        quantization: the base in 4 or 8 bits (needs ``lora``): bitsandbytes' packed linears, the
            rest in :attr:`QuantConfig.rest_dtype`, and no autocast copy of a base weight saved.

    Returns:
        A :class:`MemoryReport` (lens ``estimate``); its notes name the peak moment.

    Over 80 lines because its docstring documents each TRL argument; the body adds DPO's and GRPO's
    terms in the order TRL runs them.
    """
    o = objective
    if o.kind == "supervised":
        raise InputError("objective 'supervised' is memlab's own step; use memlab.hf.estimate.estimate_hf")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise InputError(f"batch={batch!r}; allowed: a positive integer")
    d_cfg = load_config(cfg)
    s = decoder_shape(d_cfg)
    check_seq(d_cfg, o.seq)
    tgt = resolve_target(target, budget)
    if o.kind == "reward":
        return estimate_reward_step(d_cfg, o, batch=batch, precision=precision, lora=lora,
                                    checkpointing=checkpointing, target=tgt, optimizer=optimizer, budget=budget)
    cuda = getattr(tgt, "is_cuda", False)
    w, c, auto = precision_bytes(precision)
    quantized = quantization is not None
    ad = None if lora is None else adapters_for(s, lora, precision, quantized)
    if ad is not None and quantized:
        # both trainers cast what trains on a 4-/8-bit base to bf16 (QLoRA's recommendation):
        # trl 1.16 grpo_trainer.py lines 538-541, dpo_trainer.py lines 725-729
        ad = dataclasses.replace(ad, a=2)
    rs = run_states(s, precision=precision, optimizer=optimizer, zero=0, world_size=1, offload="none",
                    ep=1, ad=ad, quant=quantization)
    st = rs.inputs
    P, G, opt, scratch = st["parameters"], st["gradients"], st["optimizer"], st["step"]
    ref = s.num_params() * w if o.holds_reference(lora) else 0
    rows = 2 * batch if o.kind == "dpo" else batch
    fwd_rows = rows if (o.kind != "dpo" or o.concatenated) else batch
    seq = o.seq
    V, D = s.vocab, s.d
    scored = fwd_rows * (seq - 1) if not cuda else fwd_rows * o.completion_len
    A = forward_activations(d_cfg, seq=seq, batch=fwd_rows, precision=precision, checkpointing=checkpointing,
                            target=target, lora=lora, quantized=quantized)
    # estimate_hf's head terms: the head's input and its autocast weight copy (not counted over a
    # quantised base), which the fused head saves neither of (it keeps its own hidden rows, below)
    A -= (0 if lora is not None else fwd_rows * seq * D * w) + (V * D * c if auto and not quantized else 0)
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
    info = StepConfig(s, seq=seq, batch=rows, precision=precision, checkpointing=checkpointing,
                      optimizer=optimizer, lora=lora)
    # the batch's ids, masks and labels (int64)
    moment, report = _report_at_peak(moments, info, tgt, budget, other=16 * rows * seq)
    report.notes.append(f"{o.kind} (TRL 1.16): peak moment: {moment}; {rows} rows of {seq} tokens"
                        + ("; a reference model held" if ref else ""))
    report.notes.extend(n for n in rs.notes if n.startswith("load_in_"))
    return report


def estimate_reward_step(cfg: dict, objective: Objective, *, batch: int, precision: str, lora: LoraConfig | None,
                         checkpointing: str | None, target, optimizer: str,
                         budget: int | str | None) -> MemoryReport:
    """Closed-form peak bytes of one step of TRL 1.16's ``RewardTrainer``: the decoder with a
    ``score`` head of ``hidden x 1`` in place of the LM head (``AutoModelForSequenceClassification``
    with ``num_labels=1``, ``reward_trainer.py`` line 396; ``transformers``'
    ``GenericForSequenceClassification``), chosen and rejected one ``2 x batch`` forward (the
    collator stacks them, ``reward_trainer.py`` line 209), the pairwise loss
    ``-logsigmoid(r_chosen - r_rejected)`` on the rewards pooled at each row's last token. No
    logits over the vocabulary: the peak is the final norm's backward with every activation
    held, the end of backward, the optimizer step, or (checkpointed) a recomputed layer.

    Args:
        cfg: the config dict; objective: the ``reward`` :class:`Objective`; batch: pairs.
        precision, lora, checkpointing, optimizer, budget: as :func:`estimate_post_training`.
        target: the resolved target.

    Returns:
        A :class:`MemoryReport` (lens ``estimate``).
    """
    s = decoder_shape(cfg)
    rm = dataclasses.replace(s, tied=True)  # no LM head: the vocabulary's one matrix is the embedding
    w, c, auto = precision_bytes(precision)
    z = Sizes(w=w, c=c, r=w, auto=auto is not None, target=target, precision=precision)
    rows, seq, D = 2 * batch, objective.seq, s.d
    t = rows * seq
    ad = None if lora is None else adapters_for(s, lora, precision)
    st = run_states(rm, precision=precision, optimizer=optimizer, zero=0, world_size=1, offload="none", ep=1,
                    ad=ad, quant=None).inputs
    # the score (hidden x 1) trains; peft's SEQ_CLS task keeps a trained copy beside the frozen one
    P = st["parameters"] + D * w * (2 if lora is not None else 1)
    G, opt, scratch = st["gradients"] + D * w, st["optimizer"] + 2 * D * w, st["step"] + D * w
    path = attention_path(s, z, rows, seq, None)
    full = checkpointing == "full"
    A, layers, embed, dense_w = kept_activations(s, z, rows, seq, path, full, s.num_params(), adapters=ad)
    # the LM head's terms out (its autocast weight copy; its input, with the final norm's normalised
    # input, gone with their backward by the norm's: a frozen norm and head under LoRA saved neither)
    A -= s.vocab * D * c * z.auto + (0 if lora is not None else 4 * t + t * D * (c + w))
    norm_grads = D * w * (2 if lora is None else 1)  # the score's gradient, and the norm weight's
    moments = {
        "final norm backward": dict(activations=A, gradients=norm_grads,
                                    temporaries=NORM_BACKWARD_TEMPORARIES.get(s.norm, 0) * t * D * 4),
        "end of backward": dict(gradients=G, temporaries=t * D * w),
        "optimizer step": dict(gradients=G, temporaries=scratch)}
    if full:
        moments["recomputed layer"] = recomputed_layer(s, z, t, layers=layers, embed=embed, dense_w=dense_w, G=G,
                                                       trains_base=lora is None)
    info = StepConfig(s, seq=seq, batch=rows, precision=precision, checkpointing=checkpointing,
                      optimizer=optimizer, lora=lora)
    # the batch's ids and masks (int64); the weights and state are the moments' in every one
    moment, report = _report_at_peak(moments, info, target, budget, other=16 * t,
                                     fixed=dict(parameters=int(P), optimizer=int(opt)))
    report.notes.append(f"reward (TRL 1.16): peak moment: {moment}; {rows} rows of {seq} tokens "
                        f"(chosen and rejected), a score head of {D} x 1 in place of the LM head")
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


#: ``GRPOConfig`` / ``DPOConfig`` fields (TRL 1.16, beyond ``TrainingArguments``) the estimate reads
GRPO_MODELLED = ("num_generations", "max_completion_length", "beta", "generation_batch_size", "steps_per_generation",
                 "cache_implementation", "use_vllm", "vllm_mode", "vllm_gpu_memory_utilization")
DPO_MODELLED = ("beta", "max_length", "precompute_ref_log_probs")
#: ``RewardConfig`` fields the estimate reads (the centring term is one scalar of the loss)
REWARD_MODELLED = ("max_length", "center_rewards_coefficient")
#: TRL fields that move no memory of the step (sampling, logging, loss shapes computed per token)
TRL_NO_MEMORY = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "log_", "num_completions_to_print",
                 "epsilon", "delta", "loss_type", "scale_rewards", "reward_weights", "learning_rate", "logging_steps",
                 "label_smoothing", "seed", "output_dir", "report_to", "run_name", "save_", "num_train_epochs",
                 "max_steps", "warmup", "lr_scheduler", "weight_decay", "adam_", "max_grad_norm", "disable_tqdm",
                 "hub_")
# keys only one of the configs has: what tells a GRPOConfig from a DPOConfig
_GRPO_KEYS = ("num_generations", "max_completion_length", "use_vllm", "vllm_gpu_memory_utilization",
              "generation_batch_size", "steps_per_generation", "num_iterations")
_DPO_KEYS = ("precompute_ref_log_probs", "precompute_ref_batch_size", "ld_alpha", "rpo_alpha", "f_divergence_type")
# RewardConfig's one field no other TRL config has (its to_dict() writes it, None or not)
_REWARD_KEYS = ("center_rewards_coefficient",)
_CONFIGS = {"grpo": "GRPOConfig", "dpo": "DPOConfig", "reward": "RewardConfig"}


@dataclass(frozen=True)
class TRLRun:
    """A ``DPOConfig``, ``GRPOConfig`` or ``RewardConfig`` mapped onto the step.

    Args:
        objective: the :class:`Objective`.
        batch: ``per_device_train_batch_size``.
        accumulation: ``gradient_accumulation_steps``.
        precision: ``bf16`` unless the file turns it off (TRL's default: autocast on fp32 weights),
            ``fp16``, ``fp32``, or ``pure-bf16`` when ``model_init_kwargs`` loads the weights in bf16.
        checkpointing: ``full`` unless ``gradient_checkpointing: false`` (TRL's default is on).
        optimizer: memlab's name of ``optim``.
        vllm_share: ``vllm_gpu_memory_utilization`` when vLLM is colocated, else ``None``.
        notes: what was mapped and every field not modelled.
    """

    objective: Objective
    batch: int
    accumulation: int
    precision: str
    checkpointing: str | None
    optimizer: str
    vllm_share: float | None
    notes: tuple[str, ...]


def trl_kind(d: dict) -> str | None:
    """``grpo``, ``dpo`` or ``reward`` when a ``--training-args`` dict has fields only that TRL
    config has, else ``None``."""
    if any(k in d for k in _GRPO_KEYS):
        return "grpo"
    if any(k in d for k in _DPO_KEYS):
        return "dpo"
    if any(k in d for k in _REWARD_KEYS):
        return "reward"
    return None


def trl_defaults(kind: str) -> dict:
    """The config class's field defaults (no instance: that would probe devices). A dict because
    it is TRL's ``GRPOConfig``/``DPOConfig``/``RewardConfig`` fields by name, as a ``--training-args``
    file has them."""
    import trl
    if kind not in _CONFIGS:
        raise InputError(f"TRL config kind={kind!r}; allowed: {', '.join(_CONFIGS)}")
    out = {}
    for f in dataclasses.fields(getattr(trl, _CONFIGS[kind])):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def read_trl_args(d: dict, *, prompt_len: int) -> TRLRun:
    """A ``GRPOConfig``, ``DPOConfig`` or ``RewardConfig`` (its dict, as ``to_dict()`` or a YAML
    writes it).

    Over 80 lines because each of the three configs maps its own fields, and every field left is
    named in a note.

    Args:
        d: the config's fields.
        prompt_len: GRPO's prompt tokens (``GRPOConfig`` has no prompt length: the data's); DPO
            reads ``max_length`` (default 1024) and scores every token but the first (the worst case);
            the reward model reads ``max_length`` too (its rows at that length, the worst case), or
            ``prompt_len`` tokens where ``max_length`` is ``None`` (no filter: the data's length).

    Returns:
        A :class:`TRLRun`.
    """
    kind = trl_kind(d)
    if kind is None:
        raise InputError("--training-args is not a GRPOConfig, DPOConfig or RewardConfig (none of its own fields); "
                         f"allowed: a config with one of {', '.join(_GRPO_KEYS + _DPO_KEYS + _REWARD_KEYS)}")

    def num(key, default, cast=int):
        v = d.get(key, default)
        try:
            return None if v is None else cast(v)
        except (TypeError, ValueError):
            raise InputError(f"--training-args {key}={v!r}; allowed: a number") from None

    batch, acc = num("per_device_train_batch_size", 8), num("gradient_accumulation_steps", 1)
    if batch < 1 or acc < 1:
        raise InputError(f"--training-args per_device_train_batch_size={batch}, gradient_accumulation_steps={acc}; "
                         f"allowed: positive integers")
    fp16 = bool(d.get("fp16"))
    bf16 = d.get("bf16")
    # TRL's own default (trl/trainer/base_config.py __post_init__): bf16 left out is not fp16
    precision = trainer_precision(not fp16 if bf16 is None else bf16, fp16)
    # TRL loads the model in fp32 unless model_init_kwargs says otherwise (trl/trainer/utils.py line 1332)
    init = d.get("model_init_kwargs") or {}
    if isinstance(init, dict) and init.get("dtype", init.get("torch_dtype")) in ("bfloat16", "auto"):
        precision = "pure-bf16"
    # transformers 5 renamed the field activation_checkpointing (to_dict() writes both); either off is off
    ckpt = "full" if d.get("gradient_checkpointing", True) and d.get("activation_checkpointing", True) else None
    optim = str(d.get("optim") or "adamw_torch")
    if optim not in HF_OPTIMIZERS:
        raise InputError(f"--training-args optim={optim!r} is not counted; allowed: {', '.join(HF_OPTIMIZERS)}")
    notes = [f"{_CONFIGS[kind]} (TRL 1.16): bf16 and gradient_checkpointing default to on"]
    share = None
    if kind == "grpo":
        spg = num("steps_per_generation", None) or acc
        gen = num("generation_batch_size", None) or batch * spg
        cache = "static" if d.get("cache_implementation") == "static" else "dynamic"
        o = Objective("grpo", prompt_len, num("max_completion_length", 512), beta=num("beta", 0.0, float),
                      num_generations=num("num_generations", 8), generation_batch=gen, cache=cache)
        modelled = GRPO_MODELLED
        if d.get("use_vllm"):
            if d.get("vllm_mode", "colocate") == "colocate":
                share = num("vllm_gpu_memory_utilization", 0.3, float)
                notes.append(f"vLLM colocated: it takes {share:g} of the card; training gets the rest, and "
                             f"generation's KV cache is vLLM's")
            else:
                notes.append("vLLM in server mode: generation runs on other GPUs")
        notes.append(f"GRPO: prompt {prompt_len} tokens (--seq), completion {o.completion_len}, "
                     f"{o.num_generations} generations per prompt, {gen} completions generated at once")
    elif kind == "reward":
        total = num("max_length", 1024) or prompt_len
        if total < 2:
            raise InputError(f"--training-args max_length={total}; allowed: an integer >= 2 (a prompt and an EOS)")
        o = Objective("reward", 1, total - 1)
        modelled = REWARD_MODELLED
        notes.append(f"reward model: chosen and rejected at {total} tokens (max_length, the worst case), one "
                     f"forward of 2 x {batch} rows through a score head of hidden x 1")
    else:
        total = num("max_length", 1024)
        o = Objective("dpo", 1, max(total - 1, 1), beta=num("beta", 0.1, float),
                      precompute_ref_log_probs=bool(d.get("precompute_ref_log_probs")))
        modelled = DPO_MODELLED
        notes.append(f"DPO: chosen and rejected at max_length={total} tokens (the worst case)")
    common = ("per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16", "gradient_checkpointing",
              "activation_checkpointing", "optim", "model_init_kwargs")
    defaults = trl_defaults(kind)
    left = sorted(k for k, v in d.items() if k not in modelled and k not in common
                  and not k.startswith(TRL_NO_MEMORY) and v not in (None, "", [], {})
                  and not (k in defaults and v == defaults[k]))
    if left:
        notes.append(f"--training-args: not modelled: {', '.join(left)}")
    return TRLRun(o, batch, acc, precision, ckpt, HF_OPTIMIZERS[optim], share, tuple(notes))


def estimate_trl_run(cfg: dict | str | pathlib.Path, run: TRLRun, *, lora: LoraConfig | None = None,
                     card: int | str | None = None, target: str | None = None,
                     quantization: QuantConfig | None = None) -> MemoryReport:
    """:func:`estimate_post_training` of a :class:`TRLRun`, its budget the card less vLLM's share.

    Args:
        cfg: the model's config.
        run: from :func:`read_trl_args`.
        lora: adapters (the reference is the disabled adapter).
        card: the GPU (bytes or a preset); with a colocated vLLM the budget is what it leaves.
        target: ``cpu`` or ``cuda`` (a card implies ``cuda``).
        quantization: a 4- or 8-bit base; with no ``base_dtype`` the rest is in the dtype TRL
            loads (fp32 under bf16/fp16 autocast, bf16 under ``model_init_kwargs`` dtype bf16).

    Returns:
        The estimate's :class:`MemoryReport`, its notes the run's.
    """
    budget = card
    if card is not None and run.vllm_share is not None:
        budget = vllm_training_budget(card, run.vllm_share)
    o = run.objective
    if run.vllm_share is not None:  # vLLM generates in its own share: no transformers KV cache here
        o = Objective(o.kind, o.prompt_len, o.completion_len, beta=o.beta, reference=o.reference,
                      num_generations=o.num_generations, generation_batch=1, cache=o.cache)
    precision = "bf16" if run.precision == "fp16" else run.precision
    if quantization is not None and quantization.base_dtype is None:
        # the modules bitsandbytes leaves alone keep the dtype the model was loaded in
        quantization = dataclasses.replace(quantization, base_dtype="bf16" if precision == "pure-bf16" else "fp32")
    report = estimate_post_training(cfg, o, batch=run.batch, precision=precision, lora=lora,
                                    checkpointing=run.checkpointing, target=target or ("cuda" if card else None),
                                    optimizer=run.optimizer, budget=budget, quantization=quantization)
    report.notes.extend(run.notes)
    if run.precision == "fp16":
        report.notes.append("fp16 counted as bf16 autocast (same bytes; the loss scaler's scalar aside)")
    if run.vllm_share is not None and card is not None:
        report.notes.append(f"budget: {run.vllm_share:g} of the card to vLLM leaves {budget / 2**30:.1f} GiB")
    return report



def _report_at_peak(moments: dict[str, dict[str, float]], info: StepConfig, target, budget,
                    other: int, fixed: dict[str, int] | None = None) -> tuple[str, MemoryReport]:
    """The estimate's report at the largest of ``moments`` (each a dict of categories to bytes).

    Args:
        moments: the step's candidate peak moments by name.
        info: the run the report describes.
        target: the device predicted for (its resident workspace is added).
        budget: the report's budget, as :func:`memlab.core.hardware.resolve_budget` takes it.
        other: the batch's bytes, added to ``other``.
        fixed: categories set outright, whatever the moment.

    Returns:
        The peak moment's name and the :class:`MemoryReport`.
    """
    moment, best = max(moments.items(), key=lambda kv: sum(kv[1].values()))
    cats = dict.fromkeys(CATEGORIES, 0)
    cats.update({k: int(round(v)) for k, v in best.items()})
    cats.update(fixed or {})
    cats["other"] += other
    cats["workspace"] += target.resident_workspace()
    return moment, MemoryReport("estimate", info, f"formula ({target.name})", sum(cats.values()), cats,
                                resolve_budget(budget))


__all__ = ["CACHES", "CPU_TILE_BYTES", "DPO_MODELLED", "GRPO_MODELLED", "KINDS", "Objective", "REWARD_MODELLED",
           "TOKEN_TILE",
           "TRLRun", "TRL_NO_MEMORY", "VOCAB_TILE", "estimate_post_training", "estimate_reward_step",
           "estimate_trl_run", "fused_head_backward", "fused_head_saved", "kv_cache_bytes", "read_trl_args",
           "trl_defaults", "trl_kind", "vllm_training_budget"]
