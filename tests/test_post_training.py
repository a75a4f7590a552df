"""Post-training steps (TRL 1.16's DPO and GRPO): the closed-form estimate against TRL's real
trainer for one step, tracked on CPU; generation's KV cache against transformers' cache
tensors; the vLLM share."""
from __future__ import annotations

import pytest
import torch

from memlab.core.errors import InputError
from memlab.core.hardware import resolve_budget
from memlab.hf.post_training import Objective, estimate_post_training, kv_cache_bytes, vllm_training_budget

pytest.importorskip("trl")

from tiny_llama import LORA, TINY, WIDE  # noqa: E402

CASES = {
    "dpo-ref": (Objective("dpo", 16, 16), None, 4),
    "dpo-precompute": (Objective("dpo", 16, 16, precompute_ref_log_probs=True), None, 4),
    "dpo-lora": (Objective("dpo", 16, 16), LORA, 4),
    "grpo-beta0": (Objective("grpo", 16, 16, beta=0.0, num_generations=4), None, 8),
    "grpo-ref": (Objective("grpo", 16, 16, beta=0.04, num_generations=4), None, 8),
    "grpo-lora-ref": (Objective("grpo", 16, 16, beta=0.04, num_generations=4), LORA, 8),
}


#: every test: the real loop leaves no scratch folder (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("no_memlab_scratch_left")


def _check(cfg, name, scale=1, checkpointing=None):
    from memlab.hf.trl_measure import measure_trl
    o, lora, batch = CASES[name]
    if scale > 1:
        o = Objective(o.kind, 16 * scale, 16 * scale, beta=o.beta, num_generations=o.num_generations,
                      precompute_ref_log_probs=o.precompute_ref_log_probs)
    m = measure_trl(cfg, o, batch=batch, lora=lora, checkpointing=checkpointing)
    e = estimate_post_training(cfg, o, batch=batch, lora=lora, target="cpu", checkpointing=checkpointing)
    assert m.reference == o.holds_reference(lora)
    err = e.peak_bytes / m.peak_bytes - 1
    # achieved: within 0.25% on every case (the issue asks 5%)
    assert abs(err) < 0.01, (name, m.peak_bytes, e.peak_bytes, m.by_category, e.by_category)


def test_dpo_step_estimate_within_1_percent_of_trl():
    _check(TINY, "dpo-precompute")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_every_case_estimate_within_1_percent_of_trl(name):
    _check(TINY, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dpo-ref", "grpo-ref", "grpo-lora-ref"])
def test_wide_model_estimate_within_1_percent_of_trl(name):
    _check(WIDE, name, scale=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo-ref", "dpo-lora"])
def test_checkpointed_step_estimate_within_1_percent_of_trl(name):
    _check(WIDE, name, scale=2, checkpointing="full")


# TRL's RewardTrainer (a score head of hidden x 1, chosen and rejected one forward): 4 pairs of
# 16 + 16 tokens; with and without LoRA, with and without checkpointing (WIDE: the layers outweigh
# the embedding there)
REWARD = {"reward": (TINY, None, None), "reward-lora": (TINY, LORA, None),
          "reward-ckpt": (WIDE, None, "full"), "reward-lora-ckpt": (WIDE, LORA, "full")}


def _check_reward(name):
    from memlab.hf.trl_measure import measure_trl
    cfg, lora, ckpt = REWARD[name]
    o = Objective("reward", 16, 16)
    m = measure_trl(cfg, o, batch=4, lora=lora, checkpointing=ckpt)
    e = estimate_post_training(cfg, o, batch=4, lora=lora, target="cpu", checkpointing=ckpt)
    assert (m.rows, m.seq, m.reference) == (8, 32, False)
    err = e.peak_bytes / m.peak_bytes - 1
    # the issue asks 5%; achieved +0.6%, +1.0%, -0.3%, -0.6%
    assert abs(err) < 0.015, (name, m.peak_bytes, e.peak_bytes, m.by_category, e.by_category)
    # the weights byte for byte: the decoder without its LM head, a score of hidden x 1 (peft's
    # SEQ_CLS keeps a trained copy of it)
    assert e.by_category["parameters"] == m.by_category["parameters"]


def test_reward_step_estimate_within_1_5_percent_of_trl():
    _check_reward("reward-lora")


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in REWARD if n != "reward-lora"])
def test_every_reward_case_estimate_within_1_5_percent_of_trl(name):
    _check_reward(name)


def test_reference_weights_and_lora():
    """A reference model adds exactly the policy's weights; LoRA's disabled adapter adds none."""
    o = Objective("dpo", 16, 16)
    full = estimate_post_training(TINY, o, batch=4, target="cpu")
    pre = estimate_post_training(TINY, Objective("dpo", 16, 16, precompute_ref_log_probs=True), batch=4,
                                 target="cpu")
    n = sum(p.numel() for p in _model(TINY).parameters())
    assert full.by_category["parameters"] - pre.by_category["parameters"] == 4 * n
    assert not o.holds_reference(LORA) and o.runs_reference()
    assert not Objective("grpo", beta=0.0).runs_reference()


def _model(cfg):
    from transformers import AutoConfig, AutoModelForCausalLM
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_kv_cache_equals_the_cache_tensors(cache):
    torch.manual_seed(0)
    model = _model(TINY).eval()
    ids = torch.randint(3, 200, (3, 10))
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, return_dict_in_generate=True, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    out = model.generate(ids, **kw)
    layers = out.past_key_values.layers
    got = sum(t.nbytes for layer in layers for t in (layer.keys, layer.values))
    # the last token is never fed back; a static cache is sized max_length - 1 up front
    tokens = 10 + 6 - 1
    assert got == kv_cache_bytes(TINY, batch=3, tokens=tokens, dtype_bytes=4)


def test_vllm_share():
    total = resolve_budget("H100-80GB")
    assert vllm_training_budget("H100-80GB", 0.3) == int(total * 0.7)
    assert vllm_training_budget(100, 1.0) == 0
    for bad in (0, 1.5, -0.1, True):
        with pytest.raises(InputError, match="vllm_gpu_memory_utilization"):
            vllm_training_budget("H100-80GB", bad)


@pytest.mark.parametrize("kw", [dict(kind="ppo"), dict(prompt_len=0), dict(num_generations=True),
                                dict(cache="paged")])
def test_objective_refuses_bad_fields(kw):
    with pytest.raises(InputError):
        Objective(**kw)


GRPO_YAML = """\
per_device_train_batch_size: 8
num_generations: 8
max_completion_length: 1024
beta: 0.04
use_vllm: true
vllm_gpu_memory_utilization: 0.3
temperature: 0.9
num_iterations: 1
mask_truncated_completions: true
top_entropy_quantile: 0.2
"""


def test_grpo_yaml_in_the_cli_names_what_it_did_not_model(tmp_path, capsys):
    import json

    from memlab.app.cli import main
    path = tmp_path / "grpo.yaml"
    path.write_text(GRPO_YAML)
    main(["estimate", "--hf-config", "llama-3.1-8b", "--training-args", str(path), "--gpu", "H100-80GB",
          "--seq", "512", "--json"])
    out = json.loads(capsys.readouterr().out)
    notes = " ".join(out["notes"])
    # temperature moves no memory and num_iterations is GRPOConfig's default: neither is named
    assert "not modelled: mask_truncated_completions, top_entropy_quantile" in notes
    assert out["budget_bytes"] == int(resolve_budget("H100-80GB") * 0.7)
    # 8 completions of 512 + 1024 tokens; a reference model (beta 0.04) beside the fp32 policy
    assert out["config"]["seq"] == 1536 and out["config"]["batch"] == 8
    n = 8_030_261_248  # Llama 3.1 8B's parameters (its model card: 8.03B)
    assert out["by_category"]["parameters"] == 2 * 4 * n


def test_trl_reader_maps_the_defaults_and_refuses_bad_values():
    from memlab.hf.post_training import read_trl_args
    run = read_trl_args({"num_generations": 4}, prompt_len=64)
    assert (run.precision, run.checkpointing, run.objective.beta, run.objective.completion_len) == \
        ("bf16", "full", 0.0, 512)  # TRL 1.16's GRPOConfig defaults
    assert read_trl_args({"precompute_ref_log_probs": True, "max_length": 256}, prompt_len=1).objective.seq == 256
    assert read_trl_args({"num_generations": 4, "model_init_kwargs": {"dtype": "bfloat16"}},
                         prompt_len=8).precision == "pure-bf16"
    # transformers 5 names gradient checkpointing activation_checkpointing (a YAML may have only that)
    assert read_trl_args({"num_generations": 4, "activation_checkpointing": False}, prompt_len=8).checkpointing is None
    with pytest.raises(InputError, match="not a GRPOConfig, DPOConfig or RewardConfig"):
        read_trl_args({"learning_rate": 1e-5}, prompt_len=8)
    with pytest.raises(InputError, match="per_device_train_batch_size"):
        read_trl_args({"num_generations": 4, "per_device_train_batch_size": 0}, prompt_len=8)


def test_reward_config_in_the_cli(tmp_path, capsys):
    """``--training-args`` takes a RewardConfig (told apart by ``center_rewards_coefficient``):
    estimate and simulate count 2 x batch rows of max_length; a field not modelled is named."""
    import json

    from memlab.app.cli import main
    from memlab.hf.post_training import read_trl_args
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    path = tmp_path / "reward.yaml"
    path.write_text("per_device_train_batch_size: 2\nmax_length: 24\ncenter_rewards_coefficient: 0.01\n"
                    "gradient_checkpointing: false\nactivation_offloading: true\n")
    outs = {}
    for lens in ("estimate", "simulate"):
        main([lens, "--hf-config", str(cfg), "--training-args", str(path), "--target", "cpu", "--json"])
        outs[lens] = json.loads(capsys.readouterr().out)
        assert outs[lens]["config"]["seq"] == 24 and outs[lens]["config"]["batch"] == 4
        notes = " ".join(outs[lens]["notes"])
        assert "RewardConfig" in notes and "not modelled: activation_offloading" in notes
    # the decoder without its LM head (the embedding alone is vocab x hidden) and a score of hidden x 1
    n = sum(p.numel() for p in _model(TINY).parameters()) - 256 * 64 + 64
    assert outs["estimate"]["by_category"]["parameters"] == outs["simulate"]["by_category"]["parameters"] == 4 * n
    assert outs["estimate"]["peak_bytes"] == pytest.approx(outs["simulate"]["peak_bytes"], rel=0.015)
    # RewardConfig's defaults: max_length 1024; None (no filter) leaves the rows at --seq
    assert read_trl_args({"center_rewards_coefficient": None}, prompt_len=8).objective.seq == 1024
    assert read_trl_args({"center_rewards_coefficient": None, "max_length": None}, prompt_len=8).objective.seq == 8
    with pytest.raises(InputError, match="max_length"):
        read_trl_args({"center_rewards_coefficient": None, "max_length": 1}, prompt_len=8)


def test_grpo_config_to_dict_in_the_cli(tmp_path, capsys):
    """A real ``GRPOConfig(...).to_dict()`` (all 191 fields, TrainingArguments' included, as
    ``__post_init__`` leaves them): ``memlab estimate`` on Llama 3.1 8B and an H100 answers; the
    note names the GRPO fields that move memory and are not counted, and none it did count
    (``activation_checkpointing``, transformers 5's name for gradient checkpointing, is read)."""
    import json

    from trl import GRPOConfig

    from memlab.app.cli import main
    kw = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=8, num_generations=8,
              max_completion_length=1024, beta=0.04, use_vllm=True, vllm_gpu_memory_utilization=0.3,
              mask_truncated_completions=True, top_entropy_quantile=0.2, temperature=0.9)
    outs = {}
    for ckpt in (True, False):
        path = tmp_path / f"grpo-{ckpt}.json"
        path.write_text(json.dumps(GRPOConfig(gradient_checkpointing=ckpt, **kw).to_dict()))
        main(["estimate", "--hf-config", "llama-3.1-8b", "--training-args", str(path), "--gpu", "H100-80GB",
              "--seq", "512", "--json"])
        outs[ckpt] = json.loads(capsys.readouterr().out)
    notes = " ".join(outs[True]["notes"])
    named = notes.split("not modelled: ")[1].split(";")[0].split(", ")
    assert {"mask_truncated_completions", "top_entropy_quantile"} <= set(named)
    # counted fields (and sampling, which moves no memory) are not named
    assert not {"activation_checkpointing", "gradient_checkpointing", "beta", "num_generations", "use_vllm",
                "vllm_gpu_memory_utilization", "max_completion_length", "temperature"} & set(named)
    assert outs[True]["config"]["checkpointing"] == "full" and outs[False]["config"]["checkpointing"] in (None, "none")
    assert outs[False]["peak_bytes"] > outs[True]["peak_bytes"]
