"""Trainer.evaluate's accumulated logits (transformers issue #15466): the estimate against a real
evaluation loop tracked on CPU."""
from __future__ import annotations

import pytest

from memlab.core.errors import InputError
from memlab.hf.evaluation import estimate_eval, measure_eval

TINY = dict(model_type="llama", vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
RUN = dict(seq=32, batch=4, batches=8)
#: every test: the real loop leaves no scratch folder (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("no_memlab_scratch_left")


@pytest.mark.parametrize("acc,pre", [(None, "none"), (2, "none"), (3, "none"), (None, "argmax")])
def test_eval_peak_within_3_percent_of_the_real_loop(acc, pre):
    measured = measure_eval(TINY, eval_accumulation_steps=acc, preprocess=pre, **RUN)
    est = estimate_eval(TINY, eval_accumulation_steps=acc, preprocess=pre, target="cpu", **RUN)
    # achieved: within 0.2% (logits stored) and 3% (argmax: the forward's no-grad scratch is not counted)
    assert abs(est.peak_bytes / measured - 1) < (0.01 if pre == "none" else 0.03), (measured, est)


def test_the_store_grows_with_the_batches_and_the_fixes_bound_it():
    logits = 4 * 32 * 1024 * 4
    full = estimate_eval(TINY, **RUN)
    assert full.moment == "concatenation" and full.store >= 16 * logits  # old + new store at the 8th batch
    assert estimate_eval(TINY, eval_accumulation_steps=2, target="cuda", **RUN).store < 4.1 * logits
    assert estimate_eval(TINY, preprocess="argmax", **RUN).moment == "forward"


@pytest.mark.parametrize("kw", [dict(eval_accumulation_steps=0), dict(preprocess="topk"), dict(batches=0)])
def test_bad_eval_input(kw):
    with pytest.raises(InputError):
        estimate_eval(TINY, **{**RUN, **kw})
