"""Evaluation's own out-of-memory: ``Trainer.evaluate`` keeping every batch's logits.

``transformers``' ``Trainer.evaluation_loop`` (``transformers/trainer.py``, 5.x, line 2896) adds
each batch's ``prediction_step`` logits to an ``EvalLoopContainer`` on the device; with
``eval_do_concat_batches`` (the default) ``nested_concat`` → ``torch_pad_and_concatenate``
(``trainer_pt_utils.py`` lines 80 and 116) rebuilds the whole store with ``torch.cat`` at every
batch, so while batch ``m`` is added the old store, the new batch and the new store are alive:
``2 m`` batches of ``(batch, seq, vocab)`` logits (transformers issue #15466). Two fixes:

* ``eval_accumulation_steps=k``: every ``k`` batches the store goes to the host as numpy
  (``to_cpu_and_numpy``), so the device holds at most ``2 k`` batches' logits. On a CPU run the
  "host" is the same memory: the previous flush's arrays are numpy views of the last store,
  alive until the next flush concatenates them (``k`` more batches).
* ``preprocess_logits_for_metrics`` (e.g. ``logits.argmax(-1)``): what is stored is its output
  (one int64 per token), and the peak falls back to one batch's forward and loss.

:func:`estimate_eval` counts the peak of the loop from these terms; :func:`measure_eval` runs a
real ``Trainer.evaluate`` on CPU under :class:`memlab.tracking.tracker.MemoryTracker`.
"""
from __future__ import annotations

import pathlib
import tempfile
from dataclasses import dataclass

import torch

from memlab.core.errors import InputError
from memlab.hf.config import load_config
from memlab.hf.shape import decoder_shape
from memlab.policy import resolve_target
from memlab.tracking.tracker import MemoryTracker

PREPROCESS = ("none", "argmax")


@dataclass(frozen=True)
class EvalEstimate:
    """The peak of ``Trainer.evaluate`` over ``batches`` batches.

    Args:
        peak_bytes: weights plus the larger of the two moments.
        weights: the model's parameters.
        store: the concatenation's peak (old store, new batch, new store, the labels').
        forward: one batch's forward and loss beside what is stored by then.
        moment: ``"concatenation"`` or ``"forward"``, the larger.
    """

    peak_bytes: int
    weights: int
    store: int
    forward: int
    moment: str


def estimate_eval(cfg: dict | str | pathlib.Path, *, seq: int, batch: int, batches: int,
                  eval_accumulation_steps: int | None = None, preprocess: str = "none",
                  dtype_bytes: int = 4, target: str | None = None) -> EvalEstimate:
    """Peak bytes of ``Trainer.evaluate`` on a causal LM of ``cfg`` (no grad, weights in one dtype).

    Args:
        cfg: a config dict, config.json or shipped name.
        seq, batch: tokens per row and rows per eval batch (``per_device_eval_batch_size``).
        batches: eval batches in the dataset.
        eval_accumulation_steps: flush the store to the host every this many batches (``None``: never).
        preprocess: ``none`` (the logits are stored) or ``argmax`` (``preprocess_logits_for_metrics``
            returning ``logits.argmax(-1)``: one int64 per token).
        dtype_bytes: bytes per element of the weights and the logits (4 fp32, 2 bf16).
        target: ``cpu`` or ``cuda`` (on CPU the previous flush's numpy views stay in the same memory).

    Returns:
        An :class:`EvalEstimate`.
    """
    for name, v in (("seq", seq), ("batch", batch), ("batches", batches)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"{name}={v!r}; allowed: a positive integer")
    k = eval_accumulation_steps
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise InputError(f"eval_accumulation_steps={k!r}; allowed: a positive integer or None")
    if preprocess not in PREPROCESS:
        raise InputError(f"preprocess={preprocess!r}; allowed: {', '.join(PREPROCESS)}")
    s = decoder_shape(cfg)
    cuda = getattr(resolve_target(target), "is_cuda", False)
    tokens = batch * seq
    logits = tokens * s.vocab * dtype_bytes
    item = logits if preprocess == "none" else tokens * 8
    labels = tokens * 8
    m = batches if k is None else min(k, batches)
    views = m * (item + labels) if (k is not None and batches > k and not cuda) else 0
    store = 2 * m * (item + labels) + views if m > 1 else item + labels + views
    # ForCausalLMLoss: logits.float() (a copy when 16-bit) and cross-entropy's fp32 log-softmax
    loss = tokens * s.vocab * 4 + (tokens * s.vocab * 4 if dtype_bytes != 4 else 0)
    forward = (m - 1) * (item + labels) + views + logits + loss
    weights = s.num_params() * dtype_bytes
    moment = "concatenation" if store >= forward else "forward"
    return EvalEstimate(weights + max(store, forward), weights, store, forward, moment)


def measure_eval(cfg: dict | str | pathlib.Path, *, seq: int, batch: int, batches: int,
                 eval_accumulation_steps: int | None = None, preprocess: str = "none") -> int:
    """The tracker's peak of a real ``Trainer.evaluate`` on CPU (random weights, random tokens
    as inputs and labels, a ``compute_metrics`` that reads the predictions).

    Args:
        cfg, seq, batch, batches, eval_accumulation_steps, preprocess: as :func:`estimate_eval`.

    Returns:
        Peak live tensor bytes over the evaluation, weights included.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, PrinterCallback, Trainer, TrainingArguments
    from transformers import logging as hf_logging

    if preprocess not in PREPROCESS:
        raise InputError(f"preprocess={preprocess!r}; allowed: {', '.join(PREPROCESS)}")
    d = load_config(cfg)
    hf_cfg = AutoConfig.for_model(**{k: v for k, v in d.items() if k != "architectures"})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_cfg)
    ids = torch.randint(0, hf_cfg.vocab_size, (batch * batches, seq))
    rows = [{"input_ids": r, "labels": r} for r in ids]
    hf_logging.set_verbosity_error()
    # Trainer wants an output folder; evaluate() writes nothing to it, and it goes with the call
    with tempfile.TemporaryDirectory(prefix="memlab-eval-") as out:
        args = TrainingArguments(output_dir=out, per_device_eval_batch_size=batch, report_to=[], use_cpu=True,
                                 eval_accumulation_steps=eval_accumulation_steps, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, eval_dataset=rows,
                          compute_metrics=lambda p: {"rows": float(len(p.predictions))},
                          preprocess_logits_for_metrics=(lambda logits, labels: logits.argmax(-1))
                          if preprocess == "argmax" else None)
        trainer.remove_callback(PrinterCallback)  # its metrics line is not the lesson's output
        with MemoryTracker(device="cpu") as mt:
            mt.track_model(model)
            mt.reset_peak()
            trainer.evaluate()
    return mt.peak_bytes


__all__ = ["EvalEstimate", "PREPROCESS", "estimate_eval", "measure_eval"]
