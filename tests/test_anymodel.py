"""memlab on a model it did not build: a Hugging Face Llama from a config, its own step.

Expected numbers come from a second source: torch's own MemTracker on the same step, the
published parameter totals of the shipped configs, and one lens against another.
"""
import json

import pytest
import torch
from torch_reference import memtracker_peak

pytest.importorskip("transformers")

from hf_gpt_mapping import gpt_config, step_config

from memlab import estimate_step
from memlab.app.cli import main
from memlab.hf import config as hf
from memlab.hf.simulate import simulate_hf
from memlab.lenses.your_model import simulate_model, track_step, tracking

SMALL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
         "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 4, "vocab_size": 1000, "max_position_embeddings": 512,
         "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
SEQ, BATCH = 128, 4


def _real(cfg=SMALL, **kw):
    torch.manual_seed(0)
    model, opt = hf.build_fn(cfg, **kw)()
    step = hf.causal_lm_step(SEQ, BATCH)
    return model, opt, (lambda: step(model, opt))


@pytest.fixture(scope="module")
def measured():
    model, opt, step = _real()
    return track_step(step, model=model, optimizer=opt, seq=SEQ, batch=BATCH)


def test_track_step_equals_torch_memtracker_to_the_byte(measured):
    model, opt, step = _real()
    theirs = memtracker_peak(model, opt, step)
    ours = track_step(step, model=model, optimizer=opt, warmup=False)
    assert ours.peak_bytes == theirs
    assert measured.peak_bytes == theirs  # a fresh model: the same step, the same bytes
    # fp32 AdamW on all parameters: 8 bytes of state per parameter (plus fused step counters)
    n = sum(p.numel() for p in model.parameters())
    assert 8 * n <= measured.by_category["optimizer"] <= 8 * n + 4 * 64


def test_context_manager_equals_track_step(measured):
    model, opt, step = _real()
    step()
    with tracking(model, opt) as t:
        step()
    assert t.report.peak_bytes == measured.peak_bytes


def test_simulate_model_cpu_within_1_percent(measured):
    sim = simulate_model(hf.build_fn(SMALL), hf.causal_lm_step(SEQ, BATCH), target="cpu")
    assert sim.peak_bytes == pytest.approx(measured.peak_bytes, rel=0.01)
    assert sim.by_category["parameters"] == measured.by_category["parameters"]


def test_cli_simulate_and_estimate_of_the_config(measured, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    common = ["--hf-config", str(tmp_path), "--target", "cpu", "--seq", str(SEQ),
              "--batch", str(BATCH), "--json"]
    assert main(["simulate", *common]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["peak_bytes"] == pytest.approx(measured.peak_bytes, rel=0.02)
    assert main(["estimate", *common]) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["peak_bytes"] == pytest.approx(measured.peak_bytes, rel=0.05)
    assert est["config"]["num_params"] == measured.step.num_params


def test_budget_oom_is_explained_and_released():
    model, opt, step = _real()
    report = track_step(step, model=model, optimizer=opt, budget="60MiB")
    assert report.fits is False and report.oom.phase in ("forward", "backward")
    assert "Simulated device out of memory" in report.oom.message
    assert all(p.grad is None for p in model.parameters())
    # model states alone over the budget: refused before running, counted
    refused = track_step(step, model=model, optimizer=opt, budget="20MiB")
    n = sum(p.numel() for p in model.parameters())
    assert refused.oom.phase == "build" and refused.peak_bytes >= 16 * n


@pytest.mark.parametrize("name,total", [("llama-3-8b", 8_030_261_248), ("qwen2.5-7b", 7_615_616_512),
                                        ("mistral-7b", 7_241_732_096), ("gpt2", 124_439_808)])
def test_shipped_configs_have_the_published_parameter_counts(name, total):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM
    assert gpt_config(name).num_params() == total
    with FakeTensorMode():
        model = AutoModelForCausalLM.from_config(hf.hf_config(name))
        assert sum(p.numel() for p in model.parameters()) == total


@pytest.mark.parametrize("name,seq", [("gpt2", 1024), ("llama-3-8b", 2048), ("qwen2.5-7b", 2048),
                                      ("mistral-7b", 2048)])  # 3-10 s each on fake tensors
def test_estimate_within_5_percent_of_simulate_for_shipped(name, seq):
    kw = dict(seq=seq, batch=1, precision="bf16", checkpointing="full")
    est = estimate_step(step_config(name, **kw), target="cuda")
    sim = simulate_hf(name, target="cuda", **kw)
    assert est.peak_bytes == pytest.approx(sim.peak_bytes, rel=0.05)


def test_unsupported_architecture_is_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 512}))
    assert main(["estimate", "--hf-config", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "'t5'" in err and "llama, mistral, qwen2, qwen3" in err
    assert main(["estimate", "--hf-config", str(tmp_path / "nothing.json")]) == 2
    assert main(["simulate", "--hf-config", "gpt2", "--seq", "2048"]) == 2
    assert "1-1024" in capsys.readouterr().err


def test_simulate_refuses_model_states_over_the_budget():
    """Qwen2.5-7B's fp32 weights, gradients and AdamW moments (16 B per parameter, 114 GiB)
    exceed an 80 GB card before any activation: said at build, not at the first op."""
    rep = simulate_hf("qwen2.5-7b", seq=4096, batch=1, precision="bf16", checkpointing="full",
                         budget="A100-80GB")
    assert rep.fits is False and rep.oom.phase == "build"
    assert rep.peak_bytes == 16 * gpt_config("qwen2.5-7b").num_params()


def test_a_rope_theta_left_null_is_transformers_default():
    """``"rope_theta": null`` (a field written but unset, as the fuzz test found) maps to the
    default base 10000, as transformers' Llama config fills it, instead of a TypeError."""
    cfg = {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "rope_theta": None}
    assert gpt_config(cfg).rope_theta == 10000.0
