"""GPT shapes: grouped-query attention, Qwen-style q/k/v biases, rope_theta, and presets of
today's open models whose parameter counts match their published totals."""
import itertools
import math
from dataclasses import replace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memlab.lenses.measure import measure_step
from memlab.lenses.simulate import simulate_step
from memlab.models.gpt_unet import GPT, PRESETS, GPTConfig, get_config
from memlab.step.training_step import StepConfig

SMALL = dict(n_layer=2, n_head=4, d_model=64, vocab_size=97, block_size=64)


# -- num_params is exact -----------------------------------------------------------------
GRID = [dict(SMALL, n_kv_head=kv, bias=bias, qkv_bias=qkv_bias, mlp=mlp, norm=norm, position=pos,
             tie_embeddings=tie)
        for kv, bias, qkv_bias, (mlp, norm, pos), tie in itertools.product(
            [None, 2, 1], [True, False], [None, True, False],
            [("gelu", "layernorm", "learned"), ("swiglu", "rmsnorm", "rope"), ("swiglu", "layernorm", "rope")],
            [True, False])]


@pytest.mark.parametrize("kw", GRID, ids=lambda kw: "-".join(
    f"{k}={kw[k]}" for k in ("n_kv_head", "bias", "qkv_bias", "mlp", "norm", "tie_embeddings")))
def test_num_params_equals_the_parameters_the_model_builds(kw):
    cfg = GPTConfig(**kw)
    assert cfg.num_params() == sum(p.numel() for p in GPT(cfg).parameters())


# -- presets of published models ---------------------------------------------------------
# Each count is written out from the model's config.json (Hugging Face hub), not from
# num_params: per layer q (d x n_head*hd), k and v (d x n_kv*hd each), o (n_head*hd x d),
# SwiGLU gate/up/down (3 x d x ff), two RMSNorm weights (2d); then the input embedding and
# the untied LM head (V x d each) and the final norm (d).
def _llama_like(d: int, ff: int, layers: int, heads: int, kv: int, hd: int, vocab: int,
                qkv_bias: bool = False) -> int:
    """The count above for one shape; ``qkv_bias`` adds q, k and v biases per layer."""
    bias = heads * hd + 2 * kv * hd if qkv_bias else 0
    per_layer = d * heads * hd + 2 * d * kv * hd + heads * hd * d + bias + 3 * d * ff + 2 * d
    return layers * per_layer + 2 * vocab * d + d


def llama_3_8b() -> int:
    # meta-llama/Meta-Llama-3-8B: hidden_size 4096, intermediate_size 14336, 32 layers,
    # 32 attention heads, 8 key/value heads (head_dim 4096/32 = 128), vocab 128256, untied
    return _llama_like(4096, 14336, 32, 32, 8, 128, 128256)


def llama_3_70b() -> int:
    # meta-llama/Meta-Llama-3-70B: 8192, 28672, 80 layers, 64 heads, 8 kv heads (hd 128),
    # vocab 128256, untied
    return _llama_like(8192, 28672, 80, 64, 8, 128, 128256)


def mistral_7b() -> int:
    # mistralai/Mistral-7B-v0.1: 4096, 14336, 32 layers, 32 heads, 8 kv heads (hd 128),
    # vocab 32000, untied
    return _llama_like(4096, 14336, 32, 32, 8, 128, 32000)


def qwen2_5_7b() -> int:
    # Qwen/Qwen2.5-7B: 3584, 18944, 28 layers, 28 heads, 4 kv heads (hd 3584/28 = 128),
    # vocab 152064, untied; biases on q, k and v (3584 + 512 + 512 per layer), none elsewhere
    return _llama_like(3584, 18944, 28, 28, 4, 128, 152064, qkv_bias=True)


# (preset, written-out count, published total: the hub's safetensors "Model size")
PUBLISHED = [("llama-3-8b", llama_3_8b, 8.03e9), ("llama-3-70b", llama_3_70b, 70.6e9),
             ("mistral-7b", mistral_7b, 7.24e9), ("qwen2.5-7b", qwen2_5_7b, 7.62e9)]


@pytest.mark.parametrize("name,formula,published", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_preset_count_matches_the_written_out_shape_and_the_published_total(name, formula, published):
    n = get_config(name).num_params()
    assert n == formula()
    assert abs(n - published) / published < 1e-3


@pytest.mark.parametrize("name,context,theta,kv", [
    ("llama-3-8b", 8192, 500000.0, 8), ("llama-3-70b", 8192, 500000.0, 8),
    ("mistral-7b", 32768, 10000.0, 8), ("qwen2.5-7b", 131072, 1000000.0, 4)])
def test_preset_context_and_rope_follow_the_config_json(name, context, theta, kv):
    cfg = get_config(name)
    assert (cfg.block_size, cfg.rope_theta, cfg.n_kv_head) == (context, theta, kv)
    assert not cfg.tie_embeddings and cfg.mlp == "swiglu" and cfg.position == "rope"
    StepConfig(model=name, seq=context)  # the whole context is a valid step
    with pytest.raises(ValueError, match=f"seq {context + 1} exceeds the model's block size; "
                                         f"allowed: 1-{context}"):
        StepConfig(model=name, seq=context + 1)


@pytest.mark.parametrize("name", [p[0] for p in PUBLISHED])
def test_large_presets_build_under_fake_tensors_with_the_counted_parameters(name):
    # Never built for real: 70.6 B fp32 parameters would be 282 GB.
    cfg = get_config(name)
    with FakeTensorMode():
        model = GPT(cfg)
        total = sum(p.numel() for p in model.parameters())
        qkv = model.blocks[0].attn.qkv
        rows = (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim
        assert tuple(qkv.weight.shape) == (rows, cfg.d_model)
        assert (qkv.bias is not None) == (name == "qwen2.5-7b")
        assert model.blocks[0].attn.proj.bias is None
    assert total == cfg.num_params()


def test_existing_presets_keep_their_shapes():
    # n_kv_head=None and qkv_bias=None keep pre-GQA configs as they were
    assert get_config("gpt2-small").num_params() == 124_439_808  # GPT-2 small, tied head
    assert get_config("llama-7b").num_params() == 6_738_415_616  # LLaMA-7B as published
    for name in ("tiny", "gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl", "llama-7b", "llama-13b"):
        cfg = PRESETS[name]
        assert (cfg.n_kv_head, cfg.qkv_bias, cfg.rope_theta, cfg.loss) == (None, None, 10000.0, "plain")


# -- bad input ---------------------------------------------------------------------------
@pytest.mark.parametrize("kw,needle", [
    (dict(n_kv_head=3), "n_kv_head=3 must divide n_head=4; allowed: None (= n_head), 1, 2, 4"),
    (dict(n_kv_head=0), "n_kv_head=0 must divide n_head=4"),
    (dict(n_kv_head=8), "n_kv_head=8 must divide n_head=4"),
    (dict(n_kv_head=2.0), "n_kv_head=2.0 must divide"),
    (dict(gqa="fused"), "gqa='fused'; allowed: repeat, native"),
    (dict(n_kv_head=2, gqa="native", attention="naive"), "gqa='native' needs attention='sdpa'"),
    (dict(loss="fused"), "loss='fused'; allowed: plain, chunked, chunked_output"),
    (dict(output_chunks=0), "output_chunks must be a positive integer, got 0"),
    (dict(loss_chunk=0), "loss_chunk must be a positive integer, got 0"),
    (dict(rope_theta=0.0), "rope_theta must be a positive number, got 0.0"),
    (dict(position="rope", n_head=64), "rotary positions need an even head_dim"),
    (dict(norm_fp32=True), "norm_fp32=True is torchtune's RMSNorm; it needs norm='rmsnorm' (got norm='layernorm')"),
    (dict(norm_fp32=1), "norm_fp32 must be True or False, got 1"),
    (dict(logits_fp32="yes"), "logits_fp32 must be True or False, got 'yes'"),
    (dict(logits_fp32=True, loss="chunked"), "logits_fp32=True casts whole logits before the plain loss; "
                                             "it needs loss='plain' (got loss='chunked')"),
])
def test_bad_config_values_name_the_value_and_what_is_allowed(kw, needle):
    with pytest.raises(ValueError) as e:
        GPTConfig(**{**SMALL, **kw})
    assert needle in str(e.value)


# -- grouped-query attention -------------------------------------------------------------
def _mha_twin(gqa: GPT) -> GPT:
    """The MHA model that GQA is by definition: each kv head's weights copied to the
    n_head / n_kv_head query heads that read it (query head j reads kv head j // groups)."""
    cfg = gqa.cfg
    mha = GPT(replace(cfg, n_kv_head=None, gqa="repeat"))
    h, kv, hd, groups = cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.n_head // cfg.kv_heads
    src = gqa.state_dict()
    dst = {}
    for key, value in src.items():
        if key.endswith("attn.qkv.weight") or key.endswith("attn.qkv.bias"):
            q, k, v = value.split([h * hd, kv * hd, kv * hd])
            k, v = (t.unflatten(0, (kv, hd)).repeat_interleave(groups, 0).flatten(0, 1) for t in (k, v))
            value = torch.cat([q, k, v])
        dst[key] = value
    mha.load_state_dict(dst)
    return mha


@pytest.mark.parametrize("attention,gqa", [("naive", "repeat"), ("sdpa", "repeat"), ("sdpa", "native")])
@pytest.mark.parametrize("kv", [2, 1])
def test_gqa_equals_mha_with_each_kv_head_shared_by_its_group(attention, gqa, kv):
    torch.manual_seed(0)
    cfg = GPTConfig(**SMALL, n_kv_head=kv, gqa=gqa, attention=attention, mlp="swiglu",
                    norm="rmsnorm", position="rope", bias=False, qkv_bias=True, rope_theta=500000.0)
    model = GPT(cfg)
    for p in model.parameters():  # non-zero biases, so their layout is tested too
        torch.nn.init.normal_(p, std=0.2)
    idx = torch.randint(0, cfg.vocab_size, (2, 48))
    expected = _mha_twin(model)(idx)
    torch.testing.assert_close(model(idx), expected, rtol=1e-5, atol=1e-5)


def test_rope_theta_sets_the_rotary_frequencies():
    cfg = GPTConfig(**SMALL, position="rope", rope_theta=500000.0)
    attn = GPT(cfg).blocks[0].attn
    hd = cfg.head_dim
    # position p, frequency index i: angle p * theta^(-2i/hd); columns i and i + hd/2 repeat it
    for p, i in [(1, 1), (7, 3), (63, hd // 2 - 1)]:
        angle = p * 500000.0 ** (-2 * i / hd)
        assert attn.cos[p, i].item() == pytest.approx(math.cos(angle), abs=1e-6)
        assert attn.sin[p, i + hd // 2].item() == pytest.approx(math.sin(angle), abs=1e-6)


def test_repeat_saves_two_repeated_copies_per_layer_that_native_does_not():
    # Learned positions: q, k and v are views of one qkv output, which SDPA saves either way.
    # "repeat" adds k and v repeated to n_head heads: (b, n_head, s, hd) fp32 each, per layer.
    seq, batch, L, d = 128, 2, 3, 256
    reports = {g: simulate_step(StepConfig(model=get_config("tiny", n_layer=L, n_kv_head=2, gqa=g),
                                           seq=seq, batch=batch)) for g in ("repeat", "native")}
    saved = {g: r.by_category["activations"] for g, r in reports.items()}
    assert saved["repeat"] - saved["native"] == L * 2 * (seq * batch) * d * 4


def test_n_kv_head_equal_to_n_head_is_plain_mha_to_the_byte():
    step = StepConfig(seq=64, batch=2)
    mha = simulate_step(step)
    same = simulate_step(step, model=get_config("tiny", n_kv_head=4, gqa="native"))
    assert (same.peak_bytes, same.by_category) == (mha.peak_bytes, mha.by_category)


@pytest.mark.parametrize("gqa", ["repeat", "native"])
def test_gqa_step_simulates_equal_to_measure(gqa):
    cfg = get_config("tiny", n_layer=2, n_kv_head=1, gqa=gqa, mlp="swiglu", norm="rmsnorm",
                     position="rope", bias=False, qkv_bias=True, tie_embeddings=False)
    step = StepConfig(model=cfg, seq=64, batch=2)
    real, fake = measure_step(step), simulate_step(step)
    assert (fake.peak_bytes, fake.by_category) == (real.peak_bytes, real.by_category)
