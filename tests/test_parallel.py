"""Tensor and pipeline parallelism: formulas, the head-preserving qkv split, and 2-rank runs."""
import math

import pytest
import torch

import memlab as ml
from memlab.parallel import (tp_attention_forward, bubble_fraction, in_flight,
                             measure_pipeline, measure_tensor_parallel, qkv_head_permutation,
                             simulate_tensor_parallel, stage_bounds, tp_activation_bytes)
from memlab.tracking import MemoryTracker


def test_bubble_fraction_matches_gpipe_formula():
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(2, 1) == 0.5
    assert math.isclose(bubble_fraction(4, 8), 3 / 11)
    assert bubble_fraction(2, 16) < bubble_fraction(2, 4) < bubble_fraction(2, 2)
    with pytest.raises(ValueError, match="m must be a positive integer"):
        bubble_fraction(2, 0)


def test_stage_bounds_cover_all_blocks():
    assert stage_bounds(4, 2) == [(0, 2), (2, 4)]
    assert stage_bounds(5, 3) == [(0, 2), (2, 3), (3, 5)]
    with pytest.raises(ValueError, match="exceeds n_layer"):
        stage_bounds(2, 3)


def test_in_flight_counts_held_micro_batches():
    gpipe = [("F", i, i, i + 1) for i in range(4)] + [("B", i, 10 + i, 11 + i) for i in range(4)]
    one_f_one_b = [("F", 0, 0, 1), ("F", 1, 1, 2), ("B", 0, 2, 3), ("F", 2, 3, 4),
                   ("B", 1, 4, 5), ("F", 3, 5, 6), ("B", 2, 6, 7), ("B", 3, 7, 8)]
    assert in_flight(gpipe) == 4
    assert in_flight(one_f_one_b) == 2


def test_head_permutation_lets_each_rank_compute_its_heads_alone():
    """Summing the row-parallel halves of two 'ranks' reproduces the full attention."""
    cfg = ml.get_config("tiny", n_head=4, d_model=64)
    torch.manual_seed(0)
    attn = ml.models.CausalSelfAttention(cfg)
    x = torch.randn(2, 16, 64)
    full = attn(x)
    perm = qkv_head_permutation(cfg, 2)
    w, b = attn.qkv.weight[perm], attn.qkv.bias[perm]
    total = 0
    for r in range(2):
        part = ml.models.CausalSelfAttention(cfg)
        rows, cols = slice(r * 96, (r + 1) * 96), slice(r * 32, (r + 1) * 32)
        part.qkv = torch.nn.Linear(64, 96)
        part.proj = torch.nn.Linear(32, 64, bias=False)
        with torch.no_grad():
            part.qkv.weight.copy_(w[rows]), part.qkv.bias.copy_(b[rows])
            part.proj.weight.copy_(attn.proj.weight[:, cols])
        total = total + tp_attention_forward(part, x)
    assert torch.allclose(total + attn.proj.bias, full, atol=1e-6)
    with pytest.raises(ValueError, match="must divide n_head"):
        qkv_head_permutation(cfg, 3)


@pytest.mark.parametrize("attention", ["sdpa", "naive"])
def test_activation_formula_at_t1_matches_one_process(attention):
    """t = 1 is the single-process block: the adapted formula must be exact there."""
    cfg = ml.get_config("tiny", attention=attention)
    torch.manual_seed(0)
    model = ml.GPT(cfg)
    x = torch.randn(2, 64, cfg.d_model, requires_grad=True)
    marks = []
    with MemoryTracker() as mt:
        mt.track_model(model)
        for block in model.blocks:
            marks.append(mt.live_bytes)
            x = block(x)
        marks.append(mt.live_bytes)
    per_layer = (marks[-1] - marks[0]) / cfg.n_layer
    assert per_layer == pytest.approx(tp_activation_bytes(cfg, 64, 2, 1)["total"], rel=1e-3)


@pytest.mark.distributed
def test_tensor_parallel_halves_block_params_and_matches_one_process():
    res = measure_tensor_parallel(ml.StepConfig(seq=64, batch=4), tp=2, timeout=180)
    for r in res.per_rank:
        assert r["loss"] == pytest.approx(r["ref_loss"], abs=1e-5)
        assert r["max_grad_diff"] < 1e-5
        assert r["block_param_bytes"] / r["full_block_param_bytes"] == pytest.approx(0.5, abs=0.01)
        assert r["layer_activation"] == pytest.approx(r["formula"]["total"], rel=0.01)
    assert res.report().per_rank[0].peak_bytes == res.per_rank[0]["peak_bytes"]
    sim = simulate_tensor_parallel(ml.StepConfig(seq=64, batch=4), tp=2)
    assert sim["peak_bytes"] == pytest.approx(res.per_rank[0]["peak_bytes"], rel=0.01)
    assert sim["layer_activation"] == pytest.approx(sim["formula"]["total"], rel=1e-3)


@pytest.mark.distributed
def test_pipeline_loss_and_1f1b_holds_fewer_micro_batches():
    res = measure_pipeline(ml.StepConfig(seq=64, batch=4), 2, micro_batches=(4,), repeats=1,
                           timeout=180)
    first, last = res.per_rank
    assert last["loss"] == pytest.approx(last["ref_loss"], abs=1e-5)
    runs = {r["schedule"]: r for r in first["runs"]}
    assert runs["gpipe"]["in_flight"] == 4 and runs["1f1b"]["in_flight"] == 2
    assert runs["1f1b"]["peak_bytes"] < runs["gpipe"]["peak_bytes"]
    assert 0 < runs["gpipe"]["bubble"] < 1
    assert res.report("1f1b", 4).per_rank[0].peak_bytes == runs["1f1b"]["peak_bytes"]


@pytest.mark.distributed
def test_parallel_module_runs_under_torchrun(torchrun):
    """The lesson's worker as a script: torchrun starts the ranks, rank 0 prints them all.
    (tp and pp share this entry point; pp also checks the loss against one process.)"""
    import json
    pp = json.loads(torchrun("memlab.parallel", "pp", "--seq", "32", "--batch", "4",
                              "--micro-batches", "2", "--schedule", "gpipe"))
    first, last = pp
    n_layer = ml.get_config("tiny").n_layer
    assert [first["blocks"], last["blocks"]] == [[0, n_layer // 2], [n_layer // 2, n_layer]]
    assert last["loss"] == pytest.approx(last["ref_loss"], abs=1e-5)
    assert [(r["schedule"], r["m"]) for r in first["runs"]] == [("gpipe", 2)]
