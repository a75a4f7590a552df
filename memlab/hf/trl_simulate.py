"""The simulation lens of a post-training step: TRL 1.16's DPO and GRPO steps on fake tensors.

:func:`simulate_post_training` builds the policy as :func:`memlab.hf.simulate.build_run` does (the
``transformers`` class on fake tensors, peft's adapters, the optimizer), a reference model beside
it where :meth:`memlab.hf.post_training.Objective.holds_reference` says, and runs one step of the
trainer's own code on them, tracked (:func:`memlab.lenses.your_model.simulate_model`):

* **TRL's fused head**: ``trl.trainer.utils.add_fused_lm_head`` patches each model as the trainer
  does (DPO ``dpo_trainer.py`` line 960, GRPO ``grpo_trainer.py`` line 1068, with the outputs
  each asks for), so every log-probability pass runs TRL's ``ChunkedLogProbFunction``
  (``trl/kernels/chunked_logprob.py``) itself.
* **accelerate's autocast**: under bf16, ``Accelerator.prepare_model`` wraps each model's forward
  in autocast and converts its outputs to fp32 (accelerate 1.15, ``accelerator.py`` lines
  1824-1835); the Trainer adds no autocast of its own (``autocast_smart_context_manager`` is a
  ``nullcontext``), so the loss outside the forward runs in fp32, as here.
* **GRPO**: ``transformers``' own ``generate`` with TRL's ``GenerationConfig`` (``grpo_trainer.py``
  lines 1155-1173; ``min_new_tokens`` equal to the completion, as the measured run sets), its
  KV cache allocated by the cache classes themselves; then TRL's
  ``GRPOTrainer._get_per_token_logps_and_entropies`` for the reference and TRL's
  ``GRPOTrainer._compute_loss`` for the policy, bound to a stand-in for the trainer
  (:class:`TrainerStandIn`) that holds the config's fields.
* **DPO**: ``DPOTrainer._compute_loss`` (lines 1285-1340 and its ``sigmoid`` loss) line by line up
  to the loss: its metric block indexes by boolean masks, which fake tensors cannot (the output
  shape depends on the data); the metrics are scalars made after the forward, freed before the
  backward.
* then the Trainer's ``clip_grad_norm_`` (``max_grad_norm`` 1.0), the optimizer's step and
  ``model.zero_grad()``.

A fake tensor has no values, so where ``transformers`` or TRL branch on data (``.item()``,
``bool(t)``) :class:`KnownData` answers as the simulated data is: every row full length and
unpadded, no EOS before the last token; an ``all(...)`` is true, anything else zero or false.

Off CUDA, TRL folds each ``[tokens, vocab]`` tile in torch and scores every position; Triton does
not run on fake tensors, so a ``cuda`` target runs that same torch path (a note says so).
"""
from __future__ import annotations

import contextlib
import pathlib
import types
import weakref
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memlab.core.errors import InputError
from memlab.hf.config import attn_implementation, check_seq, fake_grouped_mm, hf_config, load_config
from memlab.hf.post_training import Objective, TRLRun, trl_defaults
from memlab.hf.shape import decoder_shape
from memlab.hf.simulate import build_run
from memlab.lenses.your_model import simulate_model
from memlab.policy import resolve_target
from memlab.step.fine_tune_config import LoraConfig
from memlab.step.training_step import MemoryReport, StepConfig, autocast_for

#: the tiny tokenizer's ids (:data:`memlab.hf.trl_measure.SPECIALS`): pad, eos, bos
PAD, EOS, BOS = 0, 1, 2
#: ``TrainingArguments.max_grad_norm``'s default, which the Trainer clips to every step
MAX_GRAD_NORM = 1.0
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class KnownData(TorchDispatchMode):
    """Answers the data-dependent scalars of a step on fake tensors as its data is: full-length,
    unpadded rows (an ``all`` over a mask is true; an ``any``, such as right padding, a negative
    id or a finished row, is false; any other scalar is 0)."""

    def __init__(self):
        super().__init__()
        self._all: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            ref = self._all.get(id(t))
            truth = ref is not None and ref() is t
            return truth if t.dtype == torch.bool else (1.0 if truth else 0.0) if t.is_floating_point() \
                else int(truth)
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.all and isinstance(out, torch.Tensor):
            self._all[id(out)] = weakref.ref(out)
        return out


@contextlib.contextmanager
def known_masks():
    """While open, ``transformers``' mask code reads a fake attention mask as data (it takes a fake
    tensor for a traced one and builds the 4D mask it skips on real data, ``masking_utils.py``
    ``_ignore_causal_mask_sdpa``): ``is_tracing`` asks only whether a compiler traces, and
    ``fast_all`` (``sum() == numel()``) is the ``all`` that :class:`KnownData` answers."""
    from transformers import masking_utils
    from transformers.utils.import_utils import is_tracing
    saved = masking_utils.is_tracing, masking_utils.fast_all
    masking_utils.is_tracing = lambda tensor=None: is_tracing()
    masking_utils.fast_all = lambda tensor: tensor.all()
    try:
        yield
    finally:
        masking_utils.is_tracing, masking_utils.fast_all = saved


class _Accelerator:
    """What TRL's loss code asks of ``self.accelerator`` on one process: its autocast (accelerate's
    ``Accelerator.autocast``: ``torch.autocast`` in the mixed precision) and identity gathers."""

    num_processes = 1
    sync_gradients = True
    is_main_process = True  # TRL's profiling decorator reads it

    def __init__(self, precision: str):
        self.precision = precision
        self.device = torch.device("cpu")

    def autocast(self):
        return autocast_for(self.precision, self.device)

    def gather(self, t):
        return t

    gather_for_metrics = gather

    def reduce(self, t, reduction: str = "sum"):
        return t

    def unwrap_model(self, model):
        return model


def trainer_stand_in(cls: type, objective: Objective, *, batch: int, precision: str, policy: nn.Module):
    """An instance of TRL's trainer class ``cls`` made without its ``__init__`` (which loads data
    and devices), holding the fields its loss code reads, set from the config's defaults and the
    objective as ``__init__`` sets them (``grpo_trainer.py`` lines 782-983)."""
    kind = "grpo" if cls.__name__.startswith("GRPO") else "dpo"
    fields = trl_defaults(kind)
    fields.update(per_device_train_batch_size=batch, per_device_eval_batch_size=batch, beta=objective.beta,
                  max_completion_length=objective.completion_len, gradient_checkpointing_kwargs=None,
                  # GRPOConfig.__post_init__: one generation per optimizer step unless the generation batch is larger
                  steps_per_generation=max(1, (objective.generation_batch or batch) // batch))
    args = types.SimpleNamespace(**fields)
    me = object.__new__(cls)
    me.__dict__.update(
        args=args, model=policy, accelerator=_Accelerator(precision), beta=objective.beta,
        loss_type=args.loss_type, epsilon_low=args.epsilon,
        epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        importance_sampling_level=args.importance_sampling_level,
        off_policy_mask_threshold=args.off_policy_mask_threshold, top_entropy_quantile=args.top_entropy_quantile,
        use_vllm=False, vllm_importance_sampling_correction=args.vllm_importance_sampling_correction,
        aux_loss_enabled=False, max_completion_length=objective.completion_len,
        _entropy_bonus_enabled=False, current_gradient_accumulation_steps=1, temperature=args.temperature,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)})
    return me


def accelerate_forward(model: nn.Module, precision: str) -> None:
    """``Accelerator.prepare_model`` under native AMP (accelerate 1.15, ``accelerator.py`` lines
    1824-1835): the forward in autocast, its outputs converted to fp32."""
    if precision not in _DTYPES:
        return
    from accelerate.utils import convert_outputs_to_fp32
    new_forward = torch.autocast("cpu", dtype=_DTYPES[precision])(model.forward.__func__)
    model.forward = types.MethodType(new_forward, model)
    model.forward = types.MethodType(convert_outputs_to_fp32(model.forward.__func__), model)


@contextlib.contextmanager
def fixed_length_generation(model: nn.Module, new_tokens: int):
    """While open, ``model.generate`` runs exactly ``new_tokens`` decoding steps: the stop a
    fake tensor cannot read (``_has_unfinished_sequences``) answered as the measured run's
    ``min_new_tokens = max_new_tokens`` makes it."""
    left = [new_tokens]

    def has_unfinished(this_peer_finished, synced_gpus, device):
        left[0] -= 1
        return left[0] >= 0
    model._has_unfinished_sequences = has_unfinished
    try:
        yield
    finally:
        del model._has_unfinished_sequences


def _disable_ckpt(model):
    from trl.models.utils import disable_gradient_checkpointing
    return disable_gradient_checkpointing(model, None)


def _reference(policy, ref, lora):
    """The model the reference pass runs on and its context: a reference model, or under peft the
    policy with its adapters disabled (TRL's ``use_adapter(model, None)``)."""
    if ref is not None or lora is None:
        return ref, contextlib.nullcontext()
    from trl.trainer.utils import use_adapter
    return policy, use_adapter(policy, adapter_name=None)


def dpo_loss(policy: nn.Module, ref: nn.Module | None, inputs: dict, objective: Objective,
             lora: LoraConfig | None) -> torch.Tensor:
    """TRL 1.16's ``DPOTrainer._compute_loss`` up to its loss (``dpo_trainer.py`` lines 1285-1340,
    ``loss_type="sigmoid"``, ``f_divergence_type="reverse_kl"``): the policy's fused
    log-probabilities over ``[chosen; rejected]``, the reference's under ``no_grad`` (or the
    precomputed ones in ``inputs``), ``-logsigmoid(beta * delta)``."""
    completion_mask = inputs["completion_mask"]
    model_kwargs = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"], "use_cache": False}
    shift_completion_mask = completion_mask[..., 1:]
    labels = inputs["input_ids"].masked_fill(completion_mask == 0, -100)
    outputs = policy(**model_kwargs, labels=labels, fused_lm_head=True)
    seq_len = shift_completion_mask.size(1)
    logps = outputs.log_probs[:, -seq_len:].sum(dim=1)
    chosen_logps, rejected_logps = logps.chunk(2, dim=0)
    if objective.precompute_ref_log_probs:
        ref_chosen_logps, ref_rejected_logps = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
    else:
        model, ctx = _reference(policy, ref, lora)
        with torch.no_grad(), _disable_ckpt(policy), ctx:
            ref_outputs = model(**model_kwargs, labels=labels, fused_lm_head=True)
        ref_logps = ref_outputs.log_probs[:, -seq_len:].sum(dim=1)
        ref_chosen_logps, ref_rejected_logps = ref_logps.chunk(2, dim=0)
    delta_score = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)
    return -F.logsigmoid(objective.beta * delta_score).mean()


def _step_end(policy: nn.Module, optimizer) -> None:
    """The Trainer after the backward: ``clip_grad_norm_`` over the model's parameters, the
    optimizer's step, ``model.zero_grad()``."""
    torch.nn.utils.clip_grad_norm_(policy.parameters(), MAX_GRAD_NORM)
    optimizer.step()
    policy.zero_grad()


def _dpo_step(o: Objective, batch: int, vocab: int, precision: str, lora):
    def step(run, optimizer):
        policy, ref = run["policy"], run["reference"] if "reference" in run else None
        rows = 2 * batch
        ids = torch.randint(3, vocab, (rows, o.seq))
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                  "completion_mask": torch.cat([torch.zeros(rows, o.prompt_len, dtype=torch.long),
                                                torch.ones(rows, o.completion_len, dtype=torch.long)], dim=1)}
        if o.precompute_ref_log_probs:
            inputs["ref_chosen_logps"] = torch.zeros(batch)
            inputs["ref_rejected_logps"] = torch.zeros(batch)
        with KnownData(), known_masks():
            loss = dpo_loss(policy, ref, inputs, o, lora)
            loss.backward()
            del loss
            _step_end(policy, optimizer)
    return step


def _grpo_step(o: Objective, batch: int, vocab: int, precision: str, lora):
    from transformers import GenerationConfig
    from trl import GRPOTrainer

    gen = o.generation_batch or batch
    d = trl_defaults("grpo")
    # GRPOTrainer.__init__'s generation kwargs (grpo_trainer.py lines 1155-1173), min_new_tokens as measured
    config = GenerationConfig(max_new_tokens=o.completion_len, do_sample=True, pad_token_id=PAD, bos_token_id=BOS,
                              eos_token_id=[EOS], temperature=d["temperature"], top_p=d["top_p"], top_k=d["top_k"],
                              min_p=d["min_p"], repetition_penalty=d["repetition_penalty"],
                              cache_implementation="static" if o.cache == "static" else None,
                              min_new_tokens=o.completion_len, disable_compile=True)

    def step(run, optimizer):
        policy, ref = run["policy"], run["reference"] if "reference" in run else None
        me = trainer_stand_in(GRPOTrainer, o, batch=batch, precision=precision, policy=policy)
        base = policy.get_base_model() if lora is not None else policy
        with KnownData(), known_masks():
            prompt_ids = torch.randint(3, vocab, (gen, o.prompt_len))
            prompt_mask = torch.ones_like(prompt_ids)
            with torch.no_grad(), _disable_ckpt(policy), fixed_length_generation(base, o.completion_len):
                out = policy.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config)
            # TRL keeps the completions as lists and pads them back into tensors
            completion_ids = out[:, o.prompt_len:].clone()
            del out
            completion_mask = torch.ones_like(completion_ids, dtype=torch.int)
            inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                      "completion_mask": completion_mask, "num_items_in_batch": completion_mask.sum(),
                      "advantages": torch.zeros(gen)}
            if o.beta != 0:
                ids = torch.cat([prompt_ids, completion_ids], dim=1)
                mask = torch.cat([prompt_mask, completion_mask], dim=1)
                model, ctx = _reference(policy, ref, lora)
                with torch.no_grad(), _disable_ckpt(policy), ctx:
                    inputs["ref_per_token_logps"] = me._get_per_token_logps_and_entropies(
                        model, ids, mask, o.completion_len, batch_size=batch)[0]
                del ids, mask
            if gen > batch:  # TRL buffers the generation batch and trains on one slice per step
                inputs = {k: v[:batch] if v.dim() else v for k, v in inputs.items()}
            loss = me._compute_loss(policy, inputs)
            loss.backward()
            del loss, inputs
            _step_end(policy, optimizer)
    return step


def _reward_step(o: Objective, batch: int, vocab: int, precision: str, lora):
    from trl import RewardTrainer

    def step(run, optimizer):
        model = run["policy"]
        # RewardTrainer.compute_loss bound to a stand-in holding what it reads (reward_trainer.py lines 778-818)
        me = object.__new__(RewardTrainer)
        me.__dict__.update(model=model, args=types.SimpleNamespace(center_rewards_coefficient=None),
                           accelerator=_Accelerator(precision), _total_train_tokens=0, _tp_size=1,
                           _metrics={"train": defaultdict(list), "eval": defaultdict(list)})
        rows = 2 * batch  # DataCollatorForPreference: the chosen rows, then the rejected ones
        ids = torch.randint(3, vocab, (rows, o.seq))
        with KnownData(), known_masks():
            loss = me.compute_loss(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
            loss.backward()
            del loss
            _step_end(model, optimizer)
    return step


def simulate_post_training(cfg: dict | str | pathlib.Path, objective: Objective, *, batch: int,
                           precision: str = "bf16", lora: LoraConfig | None = None,
                           checkpointing: str | None = None, target: str | None = "cpu",
                           optimizer: str = "adamw", budget: int | str | None = None) -> MemoryReport:
    """One TRL step of ``objective`` on fake tensors (see the module doc).

    Args:
        cfg: a config dict, config.json, its folder or a shipped name.
        objective: a :class:`memlab.hf.post_training.Objective` of kind ``dpo`` or ``grpo``.
        batch: ``per_device_train_batch_size`` (DPO: pairs; GRPO: completions).
        precision: ``bf16`` (autocast on fp32 weights, TRL's default), ``fp32`` or ``pure-bf16``.
        lora: adapters through peft (the reference is then the disabled adapter).
        checkpointing: ``none`` or ``full``.
        target: ``cpu`` (the measured run's) or ``cuda``.
        optimizer: as :func:`memlab.hf.simulate.simulate_hf`.
        budget: a device size to compare against.

    Returns:
        A :class:`MemoryReport` (lens ``simulate``).
    """
    o = objective
    if o.kind not in ("dpo", "grpo", "reward"):
        raise InputError(f"objective {o.kind!r} for simulate_post_training; allowed: dpo, grpo, reward "
                         f"(supervised: memlab.hf.simulate.simulate_hf)")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise InputError(f"batch={batch!r}; allowed: a positive integer")
    if precision not in ("bf16", "fp32", "pure-bf16"):
        raise InputError(f"precision={precision!r} for a TRL step; allowed: bf16, fp32, pure-bf16")
    d = load_config(cfg)
    check_seq(d, o.seq)
    s = decoder_shape(d)
    tgt = resolve_target(target, budget)
    conf = hf_config(d)
    attn = attn_implementation(conf, None)
    reward = o.kind == "reward"
    policy_build = build_run(d, precision=precision, checkpointing=checkpointing, optimizer=optimizer, lora=lora,
                             reward_head=reward)
    held = o.holds_reference(lora)
    amp = "bf16" if precision == "bf16" else "fp32"

    def build():
        from transformers import AutoModelForCausalLM
        from trl.trainer.utils import add_fused_lm_head
        policy, opt = policy_build()
        if reward:  # a sequence classifier: no LM head to fuse
            if lora is not None and checkpointing == "full":
                policy.enable_input_require_grads()  # as RewardTrainer.__init__ does (reward_trainer.py line 542)
            accelerate_forward(policy, amp)
            return nn.ModuleDict({"policy": policy}), opt
        base = policy.get_base_model() if lora is not None else policy
        outputs = ("log_probs", "entropy", "mean_logits", "is_top1") if o.kind == "dpo" else ("log_probs", "entropy")
        add_fused_lm_head(base, outputs=outputs)
        accelerate_forward(policy, amp)
        run = nn.ModuleDict({"policy": policy})
        if held:
            ref = AutoModelForCausalLM.from_config(
                conf, dtype=torch.bfloat16 if precision == "pure-bf16" else torch.float32, attn_implementation=attn)
            ref.eval().requires_grad_(False)
            add_fused_lm_head(ref)
            accelerate_forward(ref, amp)
            run["reference"] = ref
        return run, opt

    make = {"dpo": _dpo_step, "grpo": _grpo_step, "reward": _reward_step}[o.kind]
    rows = 2 * batch if o.kind in ("dpo", "reward") else batch
    with fake_grouped_mm():
        report = simulate_model(build, make(o, batch, s.vocab, amp, lora), target=tgt, budget=budget, seq=o.seq,
                                batch=rows, precision=precision, checkpointing=checkpointing or "none")
    report.step = StepConfig(s, seq=o.seq, batch=rows, precision=precision, checkpointing=checkpointing,
                             optimizer=optimizer, lora=lora)
    report.notes.append(f"{o.kind} (TRL 1.16) on fake tensors: {rows} rows of {o.seq} tokens"
                        + ("; a reference model held" if held else ""))
    if getattr(tgt, "is_cuda", False):
        report.notes.append("TRL's Triton log-prob kernel does not run on fake tensors: its torch fold (the "
                            "path off CUDA) scores every position, above what CUDA's compact pass holds")
    return report


def simulate_trl_run(cfg: dict | str | pathlib.Path, run: TRLRun, *, lora: LoraConfig | None = None,
                     card: int | str | None = None, target: str | None = None) -> MemoryReport:
    """:func:`simulate_post_training` of a :class:`memlab.hf.post_training.TRLRun` (a ``DPOConfig`` or
    ``GRPOConfig`` read by ``--training-args``), its budget the card.

    Raises:
        InputError: a run that generates in vLLM (its engine is not simulated), or accumulates.
    """
    if run.vllm_share is not None:
        raise InputError("--training-args use_vllm: vLLM's generation is not simulated; allowed: use_vllm false "
                         "(transformers' generate), or memlab estimate (which takes vLLM's share)")
    if run.accumulation != 1:
        raise InputError(f"--training-args gradient_accumulation_steps={run.accumulation}: one micro-batch is "
                         f"simulated; allowed: 1 (the peak of each micro-batch is the same)")
    precision = "bf16" if run.precision == "fp16" else run.precision
    report = simulate_post_training(cfg, run.objective, batch=run.batch, precision=precision, lora=lora,
                                    checkpointing=run.checkpointing, target=target or ("cuda" if card else "cpu"),
                                    optimizer=run.optimizer, budget=card)
    report.notes.extend(run.notes)
    if run.precision == "fp16":
        report.notes.append("fp16 simulated as bf16 autocast (same bytes; the loss scaler's scalar aside)")
    return report


__all__ = ["KnownData", "MAX_GRAD_NORM", "accelerate_forward", "dpo_loss", "fixed_length_generation", "known_masks",
           "simulate_post_training", "simulate_trl_run", "trainer_stand_in"]
