"""The decoder estimate under full activation checkpointing (transformers' gradient checkpointing
of every decoder layer) against the real step, tracked, on CPU: issue 36's band [-2%, +3%].

The peak is layer 0's backward, the last recomputed (``memlab.lenses.decoder_estimate._layer_zero_backward``).
Expected numbers come from the real step (``track_step``, itself held to torch's ``MemTracker`` in
tests/test_hf_families.py), never from memlab's other lenses.
"""
import functools

import pytest
import torch

pytest.importorskip("transformers")

from hf_families import BATCH, FAMILIES, SEQ  # noqa: E402

from memlab.hf import config as hf  # noqa: E402
from memlab.hf.estimate import estimate_hf  # noqa: E402
from memlab.lenses.your_model import track_step  # noqa: E402

#: the reference dense decoder (grouped k/v, SDPA, two norms a layer), not among the fixtures
LLAMA = dict(model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
CONFIGS = dict(FAMILIES, llama=LLAMA)
#: fast by default: Llama (the gated MLP's product backward is the peak), Qwen3 (q/k norms) and
#: Gemma 2 (eager attention, whose mask the checkpoint holds; four norms a layer, whose post-MLP
#: norm's backward is the peak); the others under ``make test-slow``
FAST = ("llama", "qwen3", "gemma2")
SLOW = ("gemma3", "gpt2")
CASES = [pytest.param(name, prec, marks=[] if name in FAST else [pytest.mark.slow])
         for name in FAST + SLOW for prec in ("fp32", "bf16")]


@functools.lru_cache(maxsize=None)
def _measured(name: str, prec: str) -> int:
    """Peak bytes of the real checkpointed step of family ``name`` in ``prec``."""
    torch.manual_seed(0)
    model, opt = hf.build_fn(CONFIGS[name], precision=prec, checkpointing="full")()
    step = hf.causal_lm_step(SEQ, BATCH, prec)
    return track_step(lambda: step(model, opt), model=model, optimizer=opt).peak_bytes


@pytest.mark.parametrize("name,prec", CASES)
def test_full_checkpointing_estimate_within_2_and_3_percent_of_the_real_step(name, prec):
    """It read 1.4-7.2% low (Llama fp32 -4.71%, Gemma 2 bf16 -7.19%, GPT-2 bf16 -1.45%): the
    closed form missed the layer's output gradient, the MLP backward's second MLP-wide gradient,
    the token ids and rotary table, a tied head's gradient, the eager mask the checkpoint holds,
    and counted the embedding's gradient as there. Achieved -0.13% (Gemma 3 fp32) .. +0.83%
    (Llama bf16)."""
    real = _measured(name, prec)
    est = estimate_hf(CONFIGS[name], seq=SEQ, batch=BATCH, precision=prec, checkpointing="full", target="cpu")
    assert "peak moment: recomputed layer" in est.notes[0]
    assert -0.02 <= est.peak_bytes / real - 1 <= 0.03, (est.peak_bytes, real, est.by_category)
