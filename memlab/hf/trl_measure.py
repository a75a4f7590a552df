"""The measure lens of a post-training step: TRL's real ``DPOTrainer``, ``GRPOTrainer`` or ``RewardTrainer``, one
step, tracked by :class:`memlab.tracking.tracker.MemoryTracker`.

:func:`measure_trl` builds the model from a config (random weights, no download), a word-level
tokenizer made here (:func:`tiny_tokenizer`: ``tokenizers``' ``WordLevel`` model, ``w0 w1 ...``),
and a dataset of fixed lengths, so that every row of the step has the lengths the
:class:`memlab.hf.post_training.Objective` says. The trainer runs two optimizer steps; the second
(steady state: AdamW's moments exist) is tracked from ``on_step_begin`` to ``on_step_end``
(a ``TrainerCallback``), which covers GRPO's generation, its reference pass, the policy's
forward and backward, gradient clipping and the optimizer step. Generation runs in
``transformers`` (no vLLM); the GRPO reward is a Python function. CPU only: TRL's trainers
choose the accelerator themselves.
"""
from __future__ import annotations

import contextlib
import logging
import pathlib
import tempfile
import warnings
from dataclasses import dataclass

import torch

from memlab.core.errors import InputError
from memlab.hf.config import load_config
from memlab.step.fine_tune_config import LoraConfig
from memlab.tracking.tracker import MemoryTracker

#: the word-level tokenizer's special tokens (ids 0, 1, 2); every other id is a word ``w{i}``
SPECIALS = ("<pad>", "<eos>", "<bos>")


@dataclass
class TRLMeasurement:
    """One tracked step of a TRL trainer.

    Args:
        peak_bytes: the tracker's peak of live tensor bytes over the step.
        by_category: those bytes by category at the peak.
        peak_op: the op (name, module or autograd node, phase) at the peak.
        seq: tokens per sequence of the policy's training forward.
        rows: sequences in that forward.
        reference: whether a separate reference model was held.
    """

    peak_bytes: int
    by_category: dict[str, int]
    peak_op: tuple[str, str, str]
    seq: int
    rows: int
    reference: bool


def tiny_tokenizer(vocab: int):
    """A ``PreTrainedTokenizerFast`` over ``vocab`` ids, built locally: ``<pad>``, ``<eos>``,
    ``<bos>`` and the words ``w0 ... w{vocab-4}`` split on whitespace.

    Args:
        vocab: the vocabulary size (the model config's ``vocab_size``), at least 8.

    Returns:
        The tokenizer.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if not isinstance(vocab, int) or vocab < 8:
        raise InputError(f"vocab={vocab!r} for the tiny tokenizer; allowed: an integer >= 8")
    words = {t: i for i, t in enumerate(SPECIALS)}
    words.update({f"w{i}": i + len(SPECIALS) for i in range(vocab - len(SPECIALS))})
    tk = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")


def _words(n: int, seed: int, vocab: int) -> str:
    return " ".join(f"w{(seed * 7 + j) % (vocab - len(SPECIALS))}" for j in range(n))


def _peft(lora: LoraConfig | None, task_type: str = "CAUSAL_LM"):
    """peft's config of ``lora``; ``SEQ_CLS`` (the reward model) also trains the ``score`` head,
    as TRL's ``RewardTrainer`` docstring asks (peft adds it to ``modules_to_save``)."""
    if lora is None:
        return None
    from peft import LoraConfig as PeftLora
    targets = "all-linear" if lora.targets == "all-linear" else list(lora.targets)
    return PeftLora(r=lora.rank, lora_alpha=lora.alpha or 2 * lora.rank, target_modules=targets,
                    lora_dropout=lora.dropout, task_type=task_type)


@contextlib.contextmanager
def _quiet():
    """Progress bars and import warnings off while the trainer runs (a lesson's output is read
    later, where a bar is frozen at 0%), back on after: datasets' ``map``, transformers' shard
    writing and weight loading, DeepSpeed's accelerator line when TRL imports it."""
    import datasets
    from transformers.utils import logging as hf_logging

    # DeepSpeed sets its logger's level when it makes it, at its import (and warns then that
    # it found no GPU): a filter on the logger outlives that
    ds_log, verbosity = logging.getLogger("DeepSpeed"), hf_logging.get_verbosity()
    errors_only = logging.Filter()
    errors_only.filter = lambda record: record.levelno >= logging.ERROR
    ds_log.addFilter(errors_only)
    datasets.disable_progress_bar()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        datasets.enable_progress_bar()
        hf_logging.enable_progress_bar()
        hf_logging.set_verbosity(verbosity)
        ds_log.removeFilter(errors_only)


def measure_trl(cfg: dict | str | pathlib.Path, objective, *, batch: int, precision: str = "bf16",
                lora: LoraConfig | None = None, checkpointing: str | None = None) -> TRLMeasurement:
    """One steady-state step of TRL's trainer for ``objective``, tracked on CPU.

    Args:
        cfg: a config dict, config.json or shipped name (its ``vocab_size`` is the tokenizer's).
        objective: a :class:`memlab.hf.post_training.Objective` of kind ``dpo``, ``grpo`` or ``reward``.
        batch: ``per_device_train_batch_size`` (DPO and the reward model: pairs; GRPO: completions).
        precision: ``bf16`` (TRL's default, autocast on fp32 weights) or ``fp32``.
        lora: adapters through peft (the reference is then the disabled adapter).
        checkpointing: ``none`` or ``full`` (``gradient_checkpointing``).

    Returns:
        A :class:`TRLMeasurement`.

    Over 80 lines because its docstring documents each TRL argument; the body builds TRL's trainer
    and tracks one steady step.
    """
    from datasets import Dataset
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        PrinterCallback,
        TrainerCallback,
    )

    if objective.kind not in ("dpo", "grpo", "reward"):
        raise InputError(f"objective {objective.kind!r} for measure_trl; allowed: dpo, grpo, reward")
    if precision not in ("bf16", "fp32"):
        raise InputError(f"precision={precision!r} for a TRL step; allowed: bf16, fp32")
    d = load_config(cfg)
    hf_cfg = AutoConfig.for_model(**{k: v for k, v in d.items() if k not in ("architectures",)})
    vocab = hf_cfg.vocab_size
    tok = tiny_tokenizer(vocab)
    hf_cfg.pad_token_id, hf_cfg.eos_token_id, hf_cfg.bos_token_id = 0, 1, 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_cfg)
    # the trainers' output folder (GRPO loads the policy from it); removed on return, or when
    # the object is collected after an error
    scratch = tempfile.TemporaryDirectory(prefix="memlab-trl-")
    out = scratch.name
    holder: dict = {}

    class Track(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 1:
                tr = holder["trainer"]
                mt = holder["mt"] = MemoryTracker(device="cpu")
                mt.__enter__()
                mt.track_model(tr.model)
                if getattr(tr, "ref_model", None) is not None:
                    mt.track_model(tr.ref_model)
                mt.track_optimizer(getattr(tr.optimizer, "optimizer", tr.optimizer))
                mt.reset_peak()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 2 and "mt" in holder:
                holder["mt"].__exit__(None, None, None)

    common = dict(output_dir=out, per_device_train_batch_size=batch, max_steps=2, report_to=[],
                  logging_steps=100, save_strategy="no", use_cpu=True, bf16=precision == "bf16",
                  gradient_checkpointing=checkpointing == "full", dataloader_num_workers=0,
                  disable_tqdm=True)
    o = objective
    n_rows = max(16, 2 * batch)
    with _quiet(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if o.kind == "dpo":
            from trl import DPOConfig, DPOTrainer
            rows = [{"prompt": _words(o.prompt_len, i, vocab),
                     "chosen": " " + _words(o.completion_len - 1, i + 1, vocab),
                     "rejected": " " + _words(o.completion_len - 1, i + 2, vocab)} for i in range(n_rows)]
            args = DPOConfig(beta=o.beta, precompute_ref_log_probs=o.precompute_ref_log_probs,
                             max_length=None, **common)
            ref = None
            if lora is None and o.reference and not o.precompute_ref_log_probs:
                ref = AutoModelForCausalLM.from_config(hf_cfg)
            trainer = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                                 processing_class=tok, callbacks=[Track()], peft_config=_peft(lora))
            seq, n = o.prompt_len + o.completion_len, 2 * batch
        elif o.kind == "reward":
            from trl import RewardConfig, RewardTrainer
            # the EOS written out: RewardTrainer appends the eos string where a text lacks it, which
            # the whitespace tokenizer would glue to the last word
            rows = [{"prompt": _words(o.prompt_len, i, vocab),
                     "chosen": " " + _words(o.completion_len - 1, i + 1, vocab) + " " + SPECIALS[1],
                     "rejected": " " + _words(o.completion_len - 1, i + 2, vocab) + " " + SPECIALS[1]}
                    for i in range(n_rows)]
            hf_cfg.num_labels = 1
            torch.manual_seed(0)
            model = AutoModelForSequenceClassification.from_config(hf_cfg)
            trainer = RewardTrainer(model=model, args=RewardConfig(max_length=None, **common),
                                    train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[Track()],
                                    peft_config=_peft(lora, "SEQ_CLS"))
            seq, n = o.prompt_len + o.completion_len, 2 * batch
        else:
            from trl import GRPOConfig, GRPOTrainer
            rows = [{"prompt": _words(o.prompt_len, i, vocab)} for i in range(n_rows)]
            path = model
            if o.beta and lora is None:  # TRL builds the reference from the policy's path
                model.save_pretrained(out + "/policy")
                tok.save_pretrained(out + "/policy")
                path = out + "/policy"
            args = GRPOConfig(beta=o.beta, num_generations=o.num_generations, max_completion_length=o.completion_len,
                              generation_kwargs={"min_new_tokens": o.completion_len}, log_completions=False,
                              **common)

            def reward(completions, **kw):
                return [float(len(c)) for c in completions]

            trainer = GRPOTrainer(model=path, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                                  processing_class=tok, callbacks=[Track()], peft_config=_peft(lora))
            seq, n = o.prompt_len + o.completion_len, batch
        holder["trainer"] = trainer
        trainer.remove_callback(PrinterCallback)  # its metrics line is not the lesson's output
        trainer.train()
    scratch.cleanup()
    mt = holder["mt"]
    top = max(mt.timeline, key=lambda e: e.total)
    return TRLMeasurement(mt.peak_bytes, mt.peak_by_category(), (top.op, top.module, top.phase),
                          seq, n, getattr(trainer, "ref_model", None) is not None)


__all__ = ["SPECIALS", "TRLMeasurement", "measure_trl", "tiny_tokenizer"]
