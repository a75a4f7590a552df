"""Token-budget batching: every sample once, budgets kept, padding ordered as the strategies
promise, and packed samples that cannot see each other."""
import math
import statistics

import pytest
import torch

import memlab as ml
from memlab.models.gpt_unet import GPT
from memlab.techniques import batching as bt

BUDGET, MAX_LEN = 2048, 256


@pytest.fixture(scope="module")
def lengths():
    return bt.sample_lengths(600, seed=3)


@pytest.fixture(scope="module")
def plans(lengths):
    return {s: bt.plan_batches(s, lengths, BUDGET, MAX_LEN) for s in bt.STRATEGIES}


def test_lengths_are_seeded_clipped_and_fitted_to_the_corpus():
    a, b = bt.sample_lengths(500, seed=1), bt.sample_lengths(500, seed=1)
    assert a == b and a != bt.sample_lengths(500, seed=2)
    assert min(a) >= 8 and max(a) <= 256
    # the defaults are the lognormal fit of the corpus paragraphs: geometric mean and log-sd
    logs = [math.log(n) for n in bt.corpus_paragraph_lengths()]
    assert math.exp(statistics.mean(logs)) == pytest.approx(90.0, rel=0.02)
    assert statistics.stdev(logs) == pytest.approx(0.91, rel=0.02)
    wide = bt.sample_lengths(20000, max_len=10**6, min_len=1, seed=0)
    assert statistics.median(wide) == pytest.approx(90, rel=0.05)


@pytest.mark.parametrize("strategy", bt.STRATEGIES)
def test_every_sample_exactly_once_and_no_batch_over_budget(plans, lengths, strategy):
    plan = plans[strategy]
    seen = sorted(i for b in plan.batches for i in b.samples)
    assert seen == list(range(len(lengths)))
    for b in plan.batches:
        assert b.slots <= BUDGET
        for row in b.rows:  # what a row holds fits its padded length
            assert sum(lengths[i] for i in row) <= b.row_len
    assert plan.tokens == sum(lengths)


def test_padding_packed_below_bucketed_below_fixed(plans, lengths):
    # fixed-size batches pad every sample to MAX_LEN: the waste follows from the lengths alone
    fixed_waste = 1 - sum(lengths) / (len(lengths) * MAX_LEN)
    assert plans["fixed"].padding_fraction == pytest.approx(fixed_waste)
    assert {length for _, length in plans["fixed"].shapes} == {MAX_LEN}
    assert (plans["packed"].padding_fraction < plans["bucketed"].padding_fraction
            < plans["fixed"].padding_fraction)
    # fewer, fuller batches for the same data
    assert len(plans["packed"].batches) < len(plans["bucketed"].batches) < len(plans["fixed"].batches)
    # packing leaves at most a row's worth of slack per batch
    assert plans["packed"].padding_fraction < 0.05


def test_bucketed_batches_stay_inside_one_bucket(lengths):
    plan = bt.bucketed_batches(lengths, BUDGET, MAX_LEN, bucket_width=32)
    for b in plan.batches:
        buckets = {(lengths[i] - 1) // 32 for i in b.samples}
        assert len(buckets) == 1
        assert b.row_len == max(lengths[i] for i in b.samples)  # padded to its longest


def test_bad_input_is_refused_with_the_value():
    with pytest.raises(ValueError, match="exceeds max_len=16"):
        bt.fixed_batches([4, 20], 64, 16)
    with pytest.raises(ValueError, match="token_budget=8 is below max_len=16"):
        bt.packed_batches([4], 8, 16)
    with pytest.raises(ValueError, match="strategy='sorted'"):
        bt.plan_batches("sorted", [4], 64, 16)
    with pytest.raises(ValueError, match="n must be a positive integer"):
        bt.sample_lengths(0)


def test_collate_resets_positions_and_marks_boundaries():
    samples = [torch.arange(10, 15), torch.arange(20, 27), torch.arange(30, 33)]
    batch = bt.Batch(((0, 1), (2,)), 16)
    c = bt.collate(batch, samples)
    assert c.positions[0, :12].tolist() == list(range(5)) + list(range(7))
    assert c.doc_ids[0].tolist() == [0] * 5 + [1] * 7 + [-1] * 4
    # next-token targets inside a sample only; its last token and padding are ignored
    assert c.targets[0, :5].tolist() == [11, 12, 13, 14, bt.IGNORE]
    assert c.targets[0, 11].item() == bt.IGNORE and (c.targets[0, 12:] == bt.IGNORE).all()
    # cu_seqlens: the samples' boundaries in their concatenation without padding
    assert c.cu_seqlens.dtype == torch.int32
    assert c.cu_seqlens.tolist() == [0, 5, 12, 15]
    flat = torch.cat([c.idx[r][c.doc_ids[r] >= 0] for r in range(2)])
    for k, s in enumerate(samples):
        assert torch.equal(flat[c.cu_seqlens[k]:c.cu_seqlens[k + 1]], s)


def test_mask_is_block_diagonal_and_causal():
    doc = torch.tensor([[0, 0, 1, 1, 1, -1]])
    m = bt.packed_attention_mask(doc)[0, 0]
    assert m.shape == (6, 6)
    assert m[1, 0] and not m[0, 1]          # causal inside a sample
    assert not m[2, 1] and not m[4, 0]      # no attention across samples
    assert m[4, 2] and m[4, 3] and not m[4, 5]
    assert m.any(dim=1).all()               # no empty row (padding sees itself): no NaN


def test_packed_samples_do_not_attend_to_each_other():
    """Logits of a packed row equal each sample's logits run alone; without the mask and
    the position reset they do not."""
    torch.manual_seed(0)
    cfg = ml.GPTConfig(n_layer=2, n_head=2, d_model=32, vocab_size=50, block_size=32)
    gpt = GPT(cfg).eval()
    samples = [torch.randint(0, 50, (n,)) for n in (5, 7, 3)]
    c = bt.collate(bt.Batch(((0, 1, 2),), 16), samples)
    with torch.no_grad():
        packed = bt.PackedGPT(gpt)(c.idx, None, c.positions, c.doc_ids)
        alone = [gpt(s[None]) for s in samples]
        mixed = bt.PackedGPT(gpt)(c.idx, None, torch.arange(16)[None],
                                  torch.zeros_like(c.doc_ids))  # one document: cross-talk
    for k in range(len(samples)):
        got = packed[0, c.cu_seqlens[k]:c.cu_seqlens[k + 1]]
        torch.testing.assert_close(got, alone[k][0], rtol=1e-5, atol=1e-5)
    second = slice(c.cu_seqlens[1], c.cu_seqlens[2])
    assert not torch.allclose(mixed[0, second], alone[1][0], atol=1e-3)


def test_packed_loss_is_the_token_mean_over_samples():
    torch.manual_seed(0)
    cfg = ml.GPTConfig(n_layer=1, n_head=2, d_model=32, vocab_size=50, block_size=32)
    gpt = GPT(cfg)
    samples = [torch.randint(0, 50, (n,)) for n in (6, 9)]
    c = bt.collate(bt.Batch(((0, 1),), 16), samples)
    loss = bt.PackedGPT(gpt)(c.idx, c.targets, c.positions, c.doc_ids)
    per_token = [torch.nn.functional.cross_entropy(gpt(s[None, :-1])[0], s[1:], reduction="sum")
                 for s in samples]
    n_pred = sum(len(s) - 1 for s in samples)
    assert loss.item() == pytest.approx((sum(per_token) / n_pred).item(), rel=1e-5)


def test_same_budget_same_shape_but_packing_carries_more_tokens():
    """Fixed and packed batches have the same shape under one budget, so the same peak
    up to the packed mask; packing's batch carries far more real tokens."""
    lengths = bt.sample_lengths(64, median=20, seed=0, max_len=64)
    samples = bt.corpus_samples(lengths, 1000)
    step = ml.StepConfig(model="tiny")
    fixed = bt.fixed_batches(lengths, 256, 64)
    packed = bt.packed_batches(lengths, 256, 64)
    rf, rp = bt.measure_plan(fixed, samples, step), bt.measure_plan(packed, samples, step)
    assert (fixed.largest().slots, packed.largest().slots) == (256, 256)
    # the block-diagonal mask: SDPA on CPU keeps it as fp32, rows x L^2 x 4 bytes per layer
    extra = step.model_config.n_layer * 4 * 64 * 64 * 4
    assert rp.peak_bytes - rf.peak_bytes <= extra + 2 * 4 * 64 * 64
    real = [sum(lengths[i] for i in p.largest().samples) for p in (fixed, packed)]
    assert real[1] > 1.3 * real[0]
