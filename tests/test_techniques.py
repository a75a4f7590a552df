"""Single-device techniques: accumulation, fp16 loss scaling, finding the largest batch."""
from dataclasses import replace

import pytest

from memlab import GPTConfig, StepConfig, measure_step
from memlab.accumulation import accumulation_check
from memlab.max_batch import find_max_batch_search, predict_max_batch
from memlab.mixed_precision import FP16_TINY, fp16_underflow
from memlab.sweeps import step_flops, sweep

# smaller than ``tiny`` so that a batch search of ~8 real steps takes seconds
MICRO = GPTConfig(n_layer=2, n_head=2, d_model=64, vocab_size=256, block_size=256, name="micro")
SMALL = StepConfig(model=MICRO, seq=32, batch=4)


def test_accumulation_gives_the_big_batch_gradients():
    chk = accumulation_check(SMALL, 4)
    assert chk.same
    assert chk.max_abs_diff < 1e-5 * max(chk.max_grad, 1.0)


def test_accumulation_holds_one_micro_batch_of_activations():
    """4 micro-batches of a batch of 8: each forward keeps the activations of 2 samples.
    Every saved tensor is batch x (seq x ...), so that is a quarter of batch 8's (measured:
    0.2501; a graph kept alive across micro-batches would hold a half or more)."""
    one = measure_step(SMALL, seq=128, batch=8)
    four = measure_step(SMALL, seq=128, batch=8, micro_batches=4)
    assert four.by_category["activations"] == pytest.approx(one.by_category["activations"] / 4, rel=0.002)
    assert four.peak_bytes < one.peak_bytes


def test_accumulation_rejects_a_non_divisor():
    with pytest.raises(ValueError, match="divisor"):
        accumulation_check(SMALL, 3)


def test_fp16_underflow_and_loss_scaling():
    plain = fp16_underflow(None)
    scaled = fp16_underflow(2.0**16)
    assert plain.below_fp16 > 0.05          # the fp32 reference has gradients fp16 cannot hold
    assert plain.zero_fraction > 0.05       # ... and fp16 flushed them to zero
    assert plain.rel_error > 0.1
    assert scaled.zero_fraction == 0.0
    assert scaled.rel_error < 0.01
    assert FP16_TINY == 2.0**-24


def test_fp16_underflow_rejects_bad_scale():
    with pytest.raises(ValueError, match="loss_scale"):
        fp16_underflow(-1.0)


def test_search_and_prediction_agree():
    budget = 8 * 2**20
    found = find_max_batch_search(SMALL, budget, max_batch=64)
    pred = predict_max_batch(SMALL, budget)
    assert found.batch >= 1
    tried = {b: fits for b, fits, _ in found.trials}
    assert tried[found.batch] and tried.get(found.batch + 1) is False
    assert abs(pred.batch - found.batch) <= 1
    assert len(pred.calibration) == 2 and found.n_trials > 2
    # the per-op lines predict the measured peak at the found batch
    peak = measure_step(SMALL, batch=found.batch).peak_bytes
    assert pred.peak_at(found.batch) == pytest.approx(peak, rel=0.01)


def test_batch_finders_need_a_budget():
    with pytest.raises(ValueError, match="budget"):
        find_max_batch_search(SMALL, None)
    with pytest.raises(ValueError, match="calibrate"):
        predict_max_batch(SMALL, "1GiB", calibrate=(4, 2))


def test_sweep_grows_activations_with_seq():
    reports = sweep(replace(SMALL, batch=8), "seq", [64, 128], progress=False)
    acts = [r.by_category["activations"] for r in reports]
    assert acts[1] > 1.8 * acts[0]
    with pytest.raises(ValueError, match="not a StepConfig field"):
        sweep(SMALL, "sequence", [1])
    with pytest.raises(ValueError, match="lens"):
        sweep(SMALL, "seq", [32], lens="guess")


def test_full_checkpointing_recomputes_each_block_up_to_its_last_linear():
    """FLOPs of MICRO's step from its shapes: a Linear costs 2 x tokens x in x out forward and
    twice that backward; the fused attention core costs what torch's own ``sdpa_flop_count``
    and ``sdpa_backward_flop_count`` give it, 4 b s^2 d forward and 10 b s^2 d backward (the
    backward recomputes q k^T). Full checkpointing runs each block's forward again in backward,
    but non-reentrant ``checkpoint`` stops recomputing once it has every tensor backward saved
    (its early stop): a block's last Linear (``mlp.out``, whose output nothing saves) is not run
    again, and the LM head is outside the blocks. So the step grows by less than one whole
    forward more (the 1.33 of 3 -> 4 forwards)."""
    b, s, t = SMALL.batch, SMALL.seq, SMALL.seq * SMALL.batch
    d, v, layers = MICRO.d_model, MICRO.vocab_size, MICRO.n_layer

    def linear(fan_in: int, fan_out: int) -> int:
        return 2 * t * fan_in * fan_out

    block = linear(d, 3 * d) + linear(d, d) + linear(d, 4 * d) + linear(4 * d, d)  # qkv, proj, fc, out
    attention = 4 * b * s * s * d  # forward: q k^T and p v, the full s x s square (torch counts no mask)
    forward = layers * (block + attention) + linear(d, v)
    base = step_flops(SMALL)
    full = step_flops(replace(SMALL, checkpointing="full"))
    assert base == 3 * (forward - layers * attention) + layers * (attention + 10 * b * s * s * d)
    assert full == base + layers * (block - linear(4 * d, d) + attention)
    assert 1.1 < full / base < 4 / 3
