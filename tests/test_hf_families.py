"""Today's decoder families in all three lenses, from small configs built with each family's
``transformers`` config class (tests/hf_families.py), fp32 and bf16 autocast, on CPU.

Expected numbers come from a second source: torch's own ``MemTracker`` on the real step, the
real step tracked (``track_step``) for the simulation and the estimate, and the real class
built on the meta device for the parameter counts.
"""
import functools
import json
import time

import pytest
import torch

pytest.importorskip("transformers")

from hf_families import BATCH, FAMILIES, SEQ, family_marks  # noqa: E402
from torch_reference import memtracker_peak  # noqa: E402

from memlab.app.cli import main  # noqa: E402
from memlab.core.errors import InputError  # noqa: E402
from memlab.hf import config as hf  # noqa: E402
from memlab.hf.estimate import estimate_hf
from memlab.hf.shape import decoder_shape  # noqa: E402
from memlab.hf.simulate import simulate_hf  # noqa: E402
from memlab.lenses.your_model import track_step  # noqa: E402

CASES = [pytest.param(name, prec, marks=family_marks(name)) for name in FAMILIES for prec in ("fp32", "bf16")]


def _real(name, prec):
    torch.manual_seed(0)
    model, opt = hf.build_fn(FAMILIES[name], precision=prec)()
    step = hf.causal_lm_step(SEQ, BATCH, prec)
    return model, opt, (lambda: step(model, opt))


@functools.lru_cache(maxsize=None)
def _measured(name, prec):
    model, opt, step = _real(name, prec)
    return track_step(step, model=model, optimizer=opt)


@pytest.mark.parametrize("name,prec", CASES)
def test_track_step_equals_torch_memtracker(name, prec):
    model, opt, step = _real(name, prec)
    theirs = memtracker_peak(model, opt, step)
    assert track_step(step, model=model, optimizer=opt, warmup=False).peak_bytes == theirs


@pytest.mark.parametrize("name,prec", CASES)
def test_simulate_within_1_percent_of_the_real_step(name, prec):
    real = _measured(name, prec)
    sim = simulate_hf(FAMILIES[name], seq=SEQ, batch=BATCH, precision=prec, target="cpu")
    assert sim.peak_bytes == pytest.approx(real.peak_bytes, rel=0.01)
    assert sim.by_category["parameters"] == real.by_category["parameters"]


@pytest.mark.parametrize("name,prec", CASES)
def test_estimate_within_2_and_3_percent_of_the_real_step(name, prec):
    """The issue's band, [-2%, +3%] (it was 5%, which Gemma 3's +4.4% in fp32 passed); achieved
    -0.31% (DeepSeek-V3, fp32) .. +0.12% (GPT-OSS)."""
    real = _measured(name, prec)
    est = estimate_hf(FAMILIES[name], seq=SEQ, batch=BATCH, precision=prec, target="cpu")
    assert -0.02 <= est.peak_bytes / real.peak_bytes - 1 <= 0.03, (est.peak_bytes, real.peak_bytes)
    assert est.by_category["parameters"] == real.by_category["parameters"]


@pytest.mark.parametrize("name", FAMILIES)
def test_parameter_count_equals_the_meta_model(name):
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf.hf_config(FAMILIES[name]))
    assert decoder_shape(FAMILIES[name]).num_params() == sum(p.numel() for p in model.parameters())


_BASE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024)
OTHERS = {  # shapes not among the fixtures, with their own seq, batch and precision
    "gemma3 MQA, 3 layers": (dict(FAMILIES["gemma3"], num_key_value_heads=1, num_hidden_layers=3), 192, 1, "bf16"),
    "qwen3_moe dense layer 0": (dict(FAMILIES["qwen3_moe"], mlp_only_layers=[0], num_experts=16,
                                     num_experts_per_tok=4), 64, 3, "fp32"),
    "gpt2 no dropout": (dict(FAMILIES["gpt2"], attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0), 96, 2, "fp32"),
    "mistral sliding window": (dict(_BASE, model_type="mistral", sliding_window=64), 128, 2, "fp32"),
    "qwen2 biases": (dict(_BASE, model_type="qwen2"), 128, 2, "bf16"),
    "gemma": (dict(_BASE, model_type="gemma", head_dim=48), 128, 2, "bf16"),
}


@pytest.mark.parametrize("label", OTHERS)
def test_other_shapes_agree_too(label):
    cfg, seq, batch, prec = OTHERS[label]
    sim = simulate_hf(cfg, seq=seq, batch=batch, precision=prec, target="cpu")
    est = estimate_hf(cfg, seq=seq, batch=batch, precision=prec, target="cpu")
    assert est.peak_bytes == pytest.approx(sim.peak_bytes, rel=0.05)
    assert est.by_category["parameters"] == sim.by_category["parameters"]


@pytest.mark.parametrize("kv_heads,prec", [(1, "fp32"), (1, "pure-bf16"), (1, "bf16"), (2, "fp32")])
def test_sliding_window_sdpa_saves_k_and_v_as_repeat_kv_leaves_them(kv_heads, prec):
    """Gemma 3's sliding-window layers pass SDPA a mask, so grouped k and v go through
    ``repeat_kv``: copied to every head with 2 kv heads, but a stride-0 view with one (multi-query),
    which SDPA saves as it is unless autocast casts it (bf16: a copy per head). Counting the
    multi-query view as a copy read +4.4% in fp32 and +3.5% in pure bf16 (estimate.sdpa_kv_repeated);
    the bound is the real step's, tracked."""
    cfg = dict(FAMILIES["gemma3"], num_key_value_heads=kv_heads)
    torch.manual_seed(0)
    model, opt = hf.build_fn(cfg, precision=prec)()
    step = hf.causal_lm_step(SEQ, BATCH, prec)
    real = track_step(lambda: step(model, opt), model=model, optimizer=opt)
    est = estimate_hf(cfg, seq=SEQ, batch=BATCH, precision=prec, target="cpu")
    assert abs(est.peak_bytes / real.peak_bytes - 1) <= 0.005, (est.peak_bytes, real.peak_bytes)


def test_dropout_keeps_masks_and_forces_the_math_path():
    """GPT-2's dropout (0.1 on attention, residual, embeddings): without its masks and the
    math attention they force on CPU the estimate would be far low (the issue: 38.65%)."""
    cfg = FAMILIES["gpt2"]
    with_dropout = estimate_hf(cfg, seq=SEQ, batch=BATCH, target="cpu")
    assert "attention: math" in with_dropout.notes[0]
    without = estimate_hf(dict(cfg, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0), seq=SEQ, batch=BATCH,
                          target="cpu")
    assert "attention: cpu_flash" in without.notes[0]
    # per layer: attention probabilities, mask and dropped probabilities (3 b a s^2 fp32) at least
    assert with_dropout.by_category["activations"] - without.by_category["activations"] >= \
        2 * 3 * 4 * BATCH * 4 * SEQ * SEQ


SHIPPED_TOTALS = {  # (published total, published active, tolerance): model cards, in billions
    "llama-3.1-8b": (8.03, None, 0.005), "llama-3.1-70b": (70.6, None, 0.05),
    "qwen3-8b": (8.2, None, 0.05),                       # card: 8.2B, 6.95B non-embedding
    "qwen3-30b-a3b": (30.5, 3.3, 0.06),                  # card: 30.5B total, 3.3B activated
    "mixtral-8x7b": (46.7, 12.9, 0.05),                  # Mixtral paper: 46.7B, 12.9B active
    "mistral-nemo-12b": (12.2, None, 0.05), "phi-3-mini": (3.8, None, 0.05),
    "deepseek-v3": (671.0, 37.0, 0.6),                   # card: 671B main model, 37B activated
    "gpt-oss-20b": (20.91, 3.61, 0.005),                 # card: 20.91B total, 3.61B active
}


@pytest.mark.parametrize("name", list(SHIPPED_TOTALS) + ["gemma-3-12b"])
def test_shipped_configs_have_their_published_totals(name):
    from transformers import AutoModelForCausalLM
    s = decoder_shape(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf.hf_config(name))
    assert s.num_params() == sum(p.numel() for p in model.parameters())
    if name == "gemma-3-12b":  # Gemma 3 report, Table 1: 10,759M non-embedding parameters (text)
        assert (s.num_params() - s.vocab * s.d) / 1e6 == pytest.approx(10_759, abs=0.5)
        return
    total, active, tol = SHIPPED_TOTALS[name]
    assert s.num_params() / 1e9 == pytest.approx(total, abs=tol)
    if active is not None:
        assert s.active_params(embedding=name != "gpt-oss-20b") / 1e9 == pytest.approx(active, abs=tol)


def test_long_context_up_to_the_models_own(capsys):
    assert hf.context_length("llama-3-8b") == 8192
    assert hf.context_length("llama-3.1-8b") == 131072
    assert hf.context_length(dict(hf.shipped_config("qwen3-8b"), max_position_embeddings=32768,
                                  rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 32768})) == 131072
    assert main(["estimate", "--hf-config", "llama-3-8b", "--seq", "8192", "--batch", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["seq"] == 8192
    assert main(["estimate", "--hf-config", "llama-3-8b", "--seq", "8193"]) == 2
    assert "context of 8192 tokens" in capsys.readouterr().err


def test_gemma2_simulates_with_eager_attention_and_refuses_sdpa():
    """Gemma 2's class has no SDPA path (softcapped attention logits): the simulation runs its
    eager attention, which keeps b x h x s x s scores, so it equals torch's MemTracker on
    transformers' own eager model (built here without memlab), where those scores are a large
    share of the step; asking for SDPA is refused."""
    from transformers import AutoConfig, AutoModelForCausalLM
    seq, batch = 256, 1
    cfg = dict(FAMILIES["gemma2"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), attn_implementation="eager")
    assert type(model).__name__ == "Gemma2ForCausalLM" and not type(model)._supports_sdpa
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        ids = torch.randint(0, cfg["vocab_size"], (batch, seq))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    real = memtracker_peak(model, opt, step)
    # eager_attention_forward keeps the softmax's fp32 probabilities, b x h x s x s a layer
    scores = cfg["num_hidden_layers"] * batch * cfg["num_attention_heads"] * seq * seq * 4
    assert scores > 0.1 * real  # so a simulation without the eager path misses by far more than 1%
    sim = simulate_hf(cfg, seq=seq, batch=batch, target="cpu")
    assert sim.peak_bytes == pytest.approx(real, rel=0.01)
    with pytest.raises(Exception, match="(does not support|has no) SDPA"):
        simulate_hf(cfg, seq=seq, batch=batch, target="cpu", attention="sdpa")


def test_refusals_name_the_field(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 512}))
    assert main(["estimate", "--hf-config", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "'t5'" in err and "simulate" in err and len(err.strip().splitlines()) == 1
    cfg = dict(FAMILIES["gpt2"], activation_function="relu")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["estimate", "--hf-config", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "activation_function='relu'" in err and "simulate" in err


def test_expert_parallel_divides_the_experts_states(capsys):
    cfg = FAMILIES["qwen3_moe"]
    s = decoder_shape(cfg)
    one = estimate_hf(cfg, seq=SEQ, batch=BATCH, target="cpu")
    four = estimate_hf(cfg, seq=SEQ, batch=BATCH, target="cpu", expert_parallel=4)
    # fp32 weights: 4 bytes a parameter; a rank keeps the dense part and a quarter of the experts
    assert four.by_category["parameters"] == 4 * (s.num_params() - s.expert_total() * 3 // 4)
    assert one.by_category["parameters"] - four.by_category["parameters"] == 3 * s.expert_total()
    # the all-to-all's send and receive buffers: t * top_k rows of d in the compute dtype
    hot = estimate_hf(cfg, seq=SEQ, batch=BATCH, target="cpu", expert_parallel=4, imbalance=2.0)
    assert hot.peak_bytes > four.peak_bytes
    assert main(["estimate", "--hf-config", "qwen3-30b-a3b", "--expert-parallel", "3"]) == 2
    assert "allowed: 1, 2, 4, 8, 16, 32, 64, 128" in capsys.readouterr().err


def test_measure_hf_config_is_the_real_step(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(FAMILIES["mixtral"]))
    common = ["--hf-config", str(tmp_path), "--seq", str(SEQ), "--batch", str(BATCH), "--json"]
    assert main(["measure", *common]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["peak_bytes"] == pytest.approx(_measured("mixtral", "fp32").peak_bytes, rel=0.01)
    assert main(["measure", *common, "--budget", "4MiB"]) == 0  # model states over it: refused at build
    assert json.loads(capsys.readouterr().out)["fits"] is False


def test_small_moe_simulates_fast():
    start = time.process_time()
    simulate_hf(dict(FAMILIES["qwen3_moe"], num_experts=128, num_experts_per_tok=8), seq=256, batch=1,
                   precision="bf16", checkpointing="full", target="cuda")
    assert time.process_time() - start < 20


@pytest.mark.slow
def test_qwen3_30b_a3b_simulates_in_under_two_minutes():
    start = time.process_time()
    rep = simulate_hf("qwen3-30b-a3b", seq=4096, batch=1, precision="bf16", checkpointing="full",
                         target="cuda")
    assert time.process_time() - start < 120
    assert rep.by_category["parameters"] == 4 * decoder_shape("qwen3-30b-a3b").num_params()


@pytest.mark.slow
def test_llama_3_8b_at_8k_estimate_and_simulate_within_3_percent():
    kw = dict(seq=8192, batch=1, precision="bf16", checkpointing="full")
    est = estimate_hf("llama-3-8b", target="cuda", **kw)
    sim = simulate_hf("llama-3-8b", target="cuda", **kw)
    assert est.peak_bytes == pytest.approx(sim.peak_bytes, rel=0.03)


def test_expert_states_checker_passes_the_formula_and_names_the_mistake():
    from memlab.classroom import exercises
    exercises.check_expert_states(lambda s, ep: 16 * (s.num_params() - s.expert_total() * (1 - 1 / ep)))
    with pytest.raises(AssertionError, match="divided every parameter"):
        exercises.check_expert_states(lambda s, ep: 16 * s.num_params() / ep)


def _meta_numels(cfg):
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf.hf_config(cfg))
    return sorted(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", [*FAMILIES, "qwen3-30b-a3b", "gpt-oss-20b", "phi-3-mini"])
def test_parameter_tensors_are_the_meta_models(name):
    # DeepSpeed's buffers follow the largest tensor and the small ones (ZeRO-3 keeps those whole)
    cfg = FAMILIES.get(name, name)
    assert sorted(decoder_shape(cfg).param_numels()) == _meta_numels(cfg)


@pytest.mark.parametrize("name", FAMILIES)
def test_estimate_shards_every_family_as_the_zero_paper_says(name):
    # sec. 5.1 of Rajbhandari et al. 2020: 2 + 2 + 12 bytes per parameter in mixed precision, stage 1
    # divides the 12 by N, stage 3 also the 2 bytes of parameters (the small tensors stay whole)
    psi, n = sum(_meta_numels(FAMILIES[name])), 4
    small = sum(x for x in _meta_numels(FAMILIES[name]) if x < 10_000)
    kw = dict(seq=SEQ, batch=BATCH, precision="bf16", target="cpu", world_size=n)
    z1 = estimate_hf(FAMILIES[name], zero=1, **kw).by_category
    z3_report = estimate_hf(FAMILIES[name], zero=3, **kw)
    z3 = z3_report.by_category
    assert z1["optimizer"] == 12 * psi // n and z1["parameters"] == 2 * psi
    assert z3["optimizer"] == 12 * psi // n and z3["parameters"] == pytest.approx(2 * psi / n + 2 * small, abs=1)
    # DeepSpeed runs the bf16 model cast to 16 bits: the activations of a pure-bf16 step (at stage 3,
    # whose bucket is held all step, the peak is the plain step's moment, or the end of forward, before
    # the loss's fp32 log-softmax and the softcap's tanh, where the root's flat buffer is there beside
    # the copies; stages 1-2 allocate theirs at the first gradient's hook, a later moment)
    pure = estimate_hf(FAMILIES[name], seq=SEQ, batch=BATCH, precision="pure-bf16", target="cpu")
    s = decoder_shape(FAMILIES[name])
    before_logits = SEQ * BATCH * s.vocab * (4 + 2 * bool(s.final_softcap))
    end = z3_report.notes[0].startswith("peak moment: end of forward")
    # or the last experts' forward (Mixtral, GPT-OSS), before the final RMSNorm's fp32 copy of its
    # 16-bit input, its rsqrt and bf16 normalised rows, and the head's input (8 t d + 4 t bytes)
    experts = z3_report.notes[0].startswith("peak moment: last experts' forward")
    t = SEQ * BATCH
    assert z3["activations"] == (pure.by_category["activations"] - (end or experts) * before_logits
                                 - experts * (8 * t * s.d + 4 * t))
    off = estimate_hf(FAMILIES[name], zero=2, offload="optimizer", **kw)
    assert off.by_category["optimizer"] == 0 and off.host_by_category["optimizer"] >= 12 * psi / n


def test_estimate_accumulates_micro_batches_for_any_family():
    cfg = FAMILIES["qwen3_moe"]
    one = estimate_hf(cfg, seq=SEQ, batch=1, precision="fp32", target="cpu")
    four = estimate_hf(cfg, seq=SEQ, batch=4, precision="fp32", target="cpu", micro_batches=4)
    # each micro-batch keeps one sequence's activations; the earlier ones' gradients are held
    assert four.by_category["activations"] == one.by_category["activations"]
    assert four.by_category["gradients"] == 4 * sum(_meta_numels(cfg))
    with pytest.raises(InputError, match="into 3 micro-batches"):
        estimate_hf(cfg, seq=SEQ, batch=4, micro_batches=3)


def test_cli_estimates_zero_for_families_memlab_gpt_cannot_map(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(FAMILIES["qwen3"]))
    argv = ["estimate", "--hf-config", str(path), "--seq", str(SEQ), "--batch", "2", "--precision", "bf16",
            "--zero", "3", "--world-size", "4", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["by_category"]["optimizer"] == 12 * sum(_meta_numels(FAMILIES["qwen3"])) // 4
