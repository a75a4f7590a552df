"""Tensor and pipeline parallelism: formulas, the head-preserving qkv split, and 2-rank runs."""
import math

import pytest
import torch

import memlab as ml
from memlab.distributed.pipeline_parallel import in_flight, measure_pipeline, stage_bounds
from memlab.distributed.tensor_parallel import (
    measure_tensor_parallel,
    qkv_head_permutation,
    simulate_tensor_parallel,
    tp_attention_forward,
)
from memlab.lenses.parallel_formulas import bubble_fraction, tp_activation_bytes
from memlab.tracking.tracker import MemoryTracker


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
    attn = ml.models.gpt_unet.CausalSelfAttention(cfg)
    x = torch.randn(2, 16, 64)
    full = attn(x)
    perm = qkv_head_permutation(cfg, 2)
    w, b = attn.qkv.weight[perm], attn.qkv.bias[perm]
    total = 0
    for r in range(2):
        part = ml.models.gpt_unet.CausalSelfAttention(cfg)
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


@pytest.mark.parametrize("t", [1, 2, 4])
def test_gpt2_block_per_rank_is_the_papers_closed_form(t):
    """Korthikanti et al. 2022 sec. 4.2.1: ``sbh(10 + 24/t + 5as/(ht))`` for fp16 with dropout.
    In fp32 without dropout (the two dropout masks, ``2sbh``, and the attention one gone) with
    fused SDPA (a log-sum-exp per head and token instead of the ``as^2`` scores) that is
    ``16 sbh + 48 sbh / t`` plus LayerNorm's two fp32 statistics per row (``2 x 8 sb``) and
    the log-sum-exp ``4 a s b / t``. Written out here, not read from the estimate."""
    cfg = ml.get_config("tiny")  # GPT-2 block: LayerNorm, GELU MLP of 4h, learned positions
    s, b, h, a = 64, 2, cfg.d_model, cfg.n_head
    paper = 16 * s * b * h + 48 * s * b * h / t + 2 * 8 * s * b + 4 * a * s * b / t
    assert tp_activation_bytes(cfg, s, b, t)["total"] == paper


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
    res = measure_tensor_parallel(ml.StepConfig(seq=64, batch=4), tensor_parallel=2, timeout=180)
    for r in res.per_rank:
        assert r["loss"] == pytest.approx(r["ref_loss"], abs=1e-5)
        assert r["max_grad_diff"] < 1e-5
        assert r["block_param_bytes"] / r["full_block_param_bytes"] == pytest.approx(0.5, abs=0.01)
        assert r["layer_activation"] == pytest.approx(r["formula"]["total"], rel=0.01)
    assert res.report().per_rank[0].peak_bytes == res.per_rank[0]["peak_bytes"]
    sim = simulate_tensor_parallel(ml.StepConfig(seq=64, batch=4), tensor_parallel=2).per_rank[0]
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
    pp = json.loads(torchrun("memlab.distributed", "pp", "--seq", "32", "--batch", "4",
                              "--micro-batches", "2", "--schedule", "gpipe"))
    first, last = pp
    n_layer = ml.get_config("tiny").n_layer
    assert [first["blocks"], last["blocks"]] == [[0, n_layer // 2], [n_layer // 2, n_layer]]
    assert last["loss"] == pytest.approx(last["ref_loss"], abs=1e-5)
    assert [(r["schedule"], r["m"]) for r in first["runs"]] == [("gpipe", 2)]


# --------------------------------------------------------------------------------------
# Grouped-query attention and SwiGLU under tensor parallelism
# --------------------------------------------------------------------------------------
def _llama_like(kv: int | None, **over) -> ml.GPTConfig:
    """A tiny LLaMA-style block (SwiGLU, RMSNorm, rotary, no biases, untied head)."""
    shape = dict(n_layer=2, d_model=64, n_head=4, n_kv_head=kv, vocab_size=300, block_size=64,
                 mlp="swiglu", mlp_hidden=96, norm="rmsnorm", position="rope", bias=False,
                 tie_embeddings=False, name=f"tiny-gqa{kv}")
    return ml.GPTConfig(**{**shape, **over})


def test_kv_heads_split_or_replicated_as_megatron_core():
    assert _llama_like(2).check_tensor_parallel(2) == "split"        # 2 kv heads, 1 per rank
    assert _llama_like(2).check_tensor_parallel(4) == "replicated"   # 2 ranks share each
    assert _llama_like(1).check_tensor_parallel(4) == "replicated"   # MQA
    assert _llama_like(None).check_tensor_parallel(4) == "split"     # MHA, as before
    cfg = _llama_like(None, n_head=6, n_kv_head=3, d_model=96)
    with pytest.raises(ValueError, match="allowed: 1, 3"):  # 2 divides neither 3 nor n_head/3
        cfg.check_tensor_parallel(2)
    with pytest.raises(ValueError, match="must divide n_head=4"):
        qkv_head_permutation(_llama_like(2), 8)


@pytest.mark.parametrize("kv, t", [(2, 2), (2, 4), (1, 4)])
def test_gqa_permutation_gives_each_rank_whole_groups(kv, t):
    """Rows of chunk r after the permutation: split -> rank r's query heads and the kv heads
    they read; replicated -> a slice of one group block [q heads of g | k_g | v_g]."""
    cfg = _llama_like(kv)
    h, hd = cfg.n_head, cfg.head_dim
    perm = qkv_head_permutation(cfg, t)
    assert sorted(perm.tolist()) == list(range((h + 2 * kv) * hd))
    def head(row: int) -> tuple[str, int]:
        if row < h * hd:
            return "q", row // hd
        if row < (h + kv) * hd:
            return "k", (row - h * hd) // hd
        return "v", (row - (h + kv) * hd) // hd

    chunks = perm.view(t, -1)
    if kv % t == 0:
        for r, rows in enumerate(chunks):
            qs = {head(x)[1] for x in rows.tolist() if head(x)[0] == "q"}
            ks = {head(x)[1] for x in rows.tolist() if head(x)[0] == "k"}
            assert qs == set(range(r * h // t, (r + 1) * h // t))
            assert ks == {q // (h // kv) for q in qs}  # exactly the kv heads those q read
    else:
        groups = perm.view(kv, -1)
        for g, rows in enumerate(groups):
            kinds = [head(x) for x in rows.tolist()]
            assert {i for k, i in kinds if k == "q"} == set(range(g * h // kv, (g + 1) * h // kv))
            assert {i for k, i in kinds if k in "kv"} == {g}


@pytest.mark.parametrize("over", [dict(), dict(position="learned"), dict(attention="naive"),
                                  dict(gqa="native"), dict(mlp="gelu", mlp_hidden=None,
                                                          norm="layernorm")])
@pytest.mark.parametrize("kv", [None, 2, 1])
def test_activation_formula_at_t1_matches_one_process_gqa(kv, over):
    if over.get("gqa") == "native" and kv is None:
        pytest.skip("native GQA needs fewer kv heads than query heads")
    cfg = _llama_like(kv, **over)
    torch.manual_seed(0)
    model = ml.GPT(cfg)
    x = torch.randn(2, 32, cfg.d_model, requires_grad=True)
    with MemoryTracker() as mt:
        mt.track_model(model)
        before = mt.live_bytes
        for block in model.blocks:
            x = block(x)
        per_layer = (mt.live_bytes - before) / cfg.n_layer
    assert per_layer == tp_activation_bytes(cfg, 32, 2, 1)["total"]


@pytest.mark.parametrize("kv, t, attention", [(2, 2, "sdpa"), (2, 4, "sdpa"), (1, 4, "naive"),
                                              (1, 2, "sdpa")])
def test_gqa_tensor_parallel_simulated_per_rank(kv, t, attention):
    """Fake process group: every weight of a block is split (none held twice, also with
    replicated kv heads), and each layer keeps what the formula counts."""
    cfg = _llama_like(kv, n_head=8, attention=attention)
    res = simulate_tensor_parallel(ml.StepConfig(model=cfg, seq=32, batch=2), tensor_parallel=t)
    assert len(res.per_rank) == 1 and res.report().peak_bytes == res.per_rank[0]["peak_bytes"]
    sim = res.per_rank[0]
    d, f, hd, L = cfg.d_model, cfg.hidden, cfg.head_dim, cfg.n_layer
    weights = (cfg.n_head + 2 * kv) * hd * d + d * d + 3 * d * f  # qkv, proj, fc, gate, out
    assert sim["block_param_bytes"] == 4 * L * (weights / t + 2 * d)  # + the two RMSNorms
    assert sim["layer_activation"] == tp_activation_bytes(cfg, 32, 2, t)["total"]


@pytest.mark.distributed
@pytest.mark.parametrize("kv", [2, pytest.param(1, marks=pytest.mark.slow)])  # MQA's all-gather: slow
def test_gqa_swiglu_tensor_parallel_matches_one_process(kv):
    """Two gloo ranks: kv heads split (kv=2) or replicated through the all-gather (MQA).
    Five layers: gloo's own thread may free an all-reduce's input after the block's forward
    hook has read the live bytes (seen on a loaded machine: one layer +16 KiB), and the median
    of five layers is what every layer keeps even with two such late frees."""
    res = measure_tensor_parallel(ml.StepConfig(model=_llama_like(kv, n_layer=5), seq=32, batch=2),
                                  tensor_parallel=2, timeout=300)
    for r in res.per_rank:
        assert r["loss"] == pytest.approx(r["ref_loss"], abs=1e-5)
        assert r["max_grad_diff"] < 1e-5
        assert r["layer_activation"] == r["formula"]["total"]


def test_tp_is_the_old_spelling_of_tensor_parallel():
    """Lessons 12 and 16 still write ``tp=``: it means ``tensor_parallel=``."""
    from memlab.lenses.estimate import activation_bytes
    cfg = _llama_like(2)
    assert activation_bytes(cfg, 32, 2, "fp32", tp=2) == \
        activation_bytes(cfg, 32, 2, "fp32", tensor_parallel=2) != activation_bytes(cfg, 32, 2, "fp32")
