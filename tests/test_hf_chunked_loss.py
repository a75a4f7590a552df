"""The chunked loss on today's decoder families: the estimate against the real step on CPU.

The real step is ``transformers``' decoder with the final hidden states and the head's weight
passed to memlab's ``linear_cross_entropy`` (:func:`memlab.hf.config.causal_lm_step` with
``loss="chunked"``), tracked by memlab's tracker; the estimate is :func:`estimate_hf` with
``loss="chunked"``. Without the logits the peak moves into backward (the final norm's, for the
RMSNorm families): the issue's bound [-2%, +3%] holds there. GPT-2's peak is in its last MLP's
``gelu_new`` backward, which the closed form does not count: its bound is stated apart.
"""
import functools

import pytest
import torch
from hf_families import BATCH, SEQ, family_marks
from test_hf_lora import CONFIGS

from memlab.core.errors import InputError
from memlab.hf import config as hf
from memlab.hf.estimate import estimate_hf
from memlab.lenses.your_model import track_step

CHUNK = 32
SOFTCAPPED = {"gemma2"}  # final_logit_softcapping: the head is no plain linear layer
#: measured gap of the closed form where the peak is a moment it does not count (module doc)
LOW = {"gpt2": -0.05}


@functools.lru_cache(maxsize=None)
def _measured(name: str, prec: str):
    torch.manual_seed(0)
    model, opt = hf.build_fn(CONFIGS[name], precision=prec)()
    step = hf.causal_lm_step(SEQ, BATCH, prec, loss="chunked", loss_chunk=CHUNK)
    return track_step(lambda: step(model, opt), model=model, optimizer=opt)


#: fp32 for hf_families.DEFAULT_RUN and bf16 for Llama by default; the other builds under ``slow``
CASES = [pytest.param(n, p, marks=family_marks(n, *[pytest.mark.slow] if p == "bf16" and n != "llama" else []))
         for n in CONFIGS if n not in SOFTCAPPED for p in ("fp32", "bf16")]


@pytest.mark.parametrize("name,prec", CASES)
def test_chunked_loss_estimate_within_2_and_3_percent_of_the_real_step(name, prec):
    real = _measured(name, prec)
    est = estimate_hf(CONFIGS[name], seq=SEQ, batch=BATCH, precision=prec, target="cpu",
                      loss="chunked", loss_chunk=CHUNK)
    assert LOW.get(name, -0.02) <= est.peak_bytes / real.peak_bytes - 1 <= 0.03, (est.peak_bytes, real.peak_bytes)
    # states as the real step holds them (the adapters' absent: a full fine-tune)
    assert est.by_category["parameters"] == real.by_category["parameters"]


def test_the_chunked_step_has_no_logits():
    """The real chunked step never holds a tokens x vocab tensor: its peak is below the plain
    step's by at least the fp32 log-softmax the plain loss keeps for its backward."""
    name = "llama"
    chunked = _measured(name, "fp32")
    torch.manual_seed(0)
    model, opt = hf.build_fn(CONFIGS[name], precision="fp32")()
    step = hf.causal_lm_step(SEQ, BATCH, "fp32")
    plain = track_step(lambda: step(model, opt), model=model, optimizer=opt)
    assert plain.peak_bytes - chunked.peak_bytes >= 4 * SEQ * BATCH * CONFIGS[name]["vocab_size"]


def test_gemmas_final_norm_backward_holds_what_llamas_does():
    """Gemma's RMSNorm, ``x * (1 + w)`` in fp32, frees its two products before ``PowBackward0``:
    its backward's peak holds five fp32 tokens x hidden tensors as Llama's (estimate.NORM_BACKWARD_TEMPORARIES;
    seven read +2.8% here, where four sequences make its two extra unlike the tied head's gradient).
    The real step at 4 sequences, tracked; achieved +0.3%."""
    torch.manual_seed(0)
    model, opt = hf.build_fn(CONFIGS["gemma3"])()
    step = hf.causal_lm_step(SEQ, 4, "fp32", loss="chunked", loss_chunk=CHUNK)
    real = track_step(lambda: step(model, opt), model=model, optimizer=opt)
    est = estimate_hf(CONFIGS["gemma3"], seq=SEQ, batch=4, target="cpu", loss="chunked", loss_chunk=CHUNK)
    assert "final norm backward" in est.notes[0]
    assert abs(est.peak_bytes / real.peak_bytes - 1) <= 0.005, (est.peak_bytes, real.peak_bytes)


@pytest.mark.parametrize("kw, needle", [(dict(loss="liger"), "loss='liger'"),
                                        (dict(loss="chunked", loss_chunk=0), "loss chunk must be a positive integer")])
def test_bad_loss_names_the_value(kw, needle):
    with pytest.raises(InputError, match=needle):
        estimate_hf(CONFIGS["llama"], seq=SEQ, batch=BATCH, **kw)


def test_softcapped_logits_refuse_the_chunked_loss():
    with pytest.raises(InputError, match="soft-capped"):
        estimate_hf(CONFIGS["gemma2"], seq=SEQ, batch=BATCH, loss="chunked")
