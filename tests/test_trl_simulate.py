"""The simulation lens of TRL 1.16's DPO and GRPO steps against TRL's real trainers for one step,
tracked on CPU (memlab.hf.trl_measure); generation on fake tensors against transformers' own
cache tensors."""
from __future__ import annotations

import pytest
import torch

from memlab.core.errors import InputError
from memlab.hf.post_training import Objective

pytest.importorskip("trl")

from tiny_llama import LORA, TINY, WIDE  # noqa: E402

# DPO and GRPO x {a reference, none} x {LoRA, full}: under LoRA the reference is the disabled
# adapter (no weights of its own); "none" is DPO's precomputed log-probabilities, GRPO's beta 0
CASES = {
    "dpo-ref": (Objective("dpo", 16, 16), None, 4),
    "dpo-noref": (Objective("dpo", 16, 16, precompute_ref_log_probs=True), None, 4),
    "dpo-lora-ref": (Objective("dpo", 16, 16), LORA, 4),
    "dpo-lora-noref": (Objective("dpo", 16, 16, precompute_ref_log_probs=True), LORA, 4),
    "grpo-ref": (Objective("grpo", 16, 16, beta=0.04, num_generations=4), None, 8),
    "grpo-noref": (Objective("grpo", 16, 16, beta=0.0, num_generations=4), None, 8),
    "grpo-lora-ref": (Objective("grpo", 16, 16, beta=0.04, num_generations=4), LORA, 8),
    "grpo-lora-noref": (Objective("grpo", 16, 16, beta=0.0, num_generations=4), LORA, 8),
    # few decoding steps: the fast GRPO representative
    "grpo-short": (Objective("grpo", 16, 4, beta=0.04, num_generations=4), LORA, 8),
}


def _check(cfg, name, checkpointing=None, scale=1):
    from memlab.hf.trl_measure import measure_trl
    from memlab.hf.trl_simulate import simulate_post_training
    o, lora, batch = CASES[name]
    if scale > 1:
        o = Objective(o.kind, o.prompt_len * scale, o.completion_len * scale, beta=o.beta,
                      num_generations=o.num_generations, precompute_ref_log_probs=o.precompute_ref_log_probs)
    m = measure_trl(cfg, o, batch=batch, lora=lora, checkpointing=checkpointing)
    r = simulate_post_training(cfg, o, batch=batch, lora=lora, checkpointing=checkpointing, target="cpu")
    assert m.reference == o.holds_reference(lora)
    err = r.peak_bytes / m.peak_bytes - 1
    # the issue asks 1%; achieved within 0.03% (the batch's own tensors, made inside the simulated step)
    assert abs(err) < 0.002, (name, m.peak_bytes, r.peak_bytes, m.by_category, r.by_category)


# TRL's RewardTrainer, 4 pairs of 16 + 16 tokens, x {LoRA, full} x {checkpointing, none}
REWARD = {"reward": (TINY, None, None), "reward-lora": (TINY, LORA, None),
          "reward-ckpt": (WIDE, None, "full"), "reward-lora-ckpt": (WIDE, LORA, "full")}


def _check_reward(name):
    from memlab.hf.trl_measure import measure_trl
    from memlab.hf.trl_simulate import simulate_post_training
    cfg, lora, ckpt = REWARD[name]
    o = Objective("reward", 16, 16)
    m = measure_trl(cfg, o, batch=4, lora=lora, checkpointing=ckpt)
    r = simulate_post_training(cfg, o, batch=4, lora=lora, checkpointing=ckpt, target="cpu")
    err = r.peak_bytes / m.peak_bytes - 1
    # the issue asks 1%; achieved within 0.11% (the batch's ids, made inside the simulated step)
    assert abs(err) < 0.002, (name, m.peak_bytes, r.peak_bytes, m.by_category, r.by_category)
    assert r.by_category["parameters"] == m.by_category["parameters"]


def test_reward_simulation_within_0_2_percent_of_trl():
    _check_reward("reward-lora")


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in REWARD if n != "reward-lora"])
def test_every_reward_case_simulation_within_0_2_percent_of_trl(name):
    _check_reward(name)


def test_dpo_simulation_within_0_2_percent_of_trl():
    _check(TINY, "dpo-ref")


def test_grpo_simulation_within_0_2_percent_of_trl():
    _check(TINY, "grpo-short")


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in CASES if n not in ("dpo-ref", "grpo-short")])
def test_every_case_simulation_within_0_2_percent_of_trl(name):
    _check(TINY, name)


# the GRPO case was a strict xfail ("generate one step long under checkpointing"); with the pinned
# stack (transformers 5.23, trl 1.16, peft 0.21.2, torch 2.13) it passes, at the commit that marked
# it too (2feaff8), alone and in this file's whole run: the simulated generate takes 32 steps
@pytest.mark.slow
@pytest.mark.parametrize("name", ["dpo-ref", "grpo-lora-ref", "grpo-ref"])
def test_wide_checkpointed_simulation_within_0_2_percent_of_trl(name):
    _check(WIDE, name, checkpointing="full", scale=2)


def _model(cfg):
    from transformers import AutoConfig, AutoModelForCausalLM
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg)).eval()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_fake_generation_caches_what_real_generation_caches(cache):
    """generate on fake tensors (KnownData, fixed_length_generation) allocates the cache tensors
    that generate on real tensors does."""
    from transformers import GenerationConfig

    from memlab.core.torch_private import FakeTensorMode
    from memlab.hf.trl_simulate import KnownData, fixed_length_generation, known_masks
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=True, pad_token_id=0, eos_token_id=[1],
              return_dict_in_generate=True, disable_compile=True,
              cache_implementation="static" if cache == "static" else None)
    torch.manual_seed(0)
    ids = torch.randint(3, 200, (3, 10))
    real = _model(TINY).generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 generation_config=GenerationConfig(**kw))
    with FakeTensorMode(allow_non_fake_inputs=False):
        model = _model(TINY)
        ids = torch.randint(3, 200, (3, 10))
        with torch.no_grad(), KnownData(), known_masks(), fixed_length_generation(model, 6):
            fake = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  generation_config=GenerationConfig(**kw))

    def cached(out):
        return [(t.shape, t.dtype) for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
    assert fake.sequences.shape == real.sequences.shape == (3, 16)
    assert cached(fake) == cached(real)


def test_known_data_answers_as_the_data_is():
    from memlab.core.torch_private import FakeTensorMode
    from memlab.hf.trl_simulate import KnownData
    with FakeTensorMode(allow_non_fake_inputs=False):
        mask = torch.ones(2, 3, dtype=torch.long)
        with KnownData():
            assert bool((mask == 1).all()) is True
            assert bool((mask == 0).any()) is False
            assert mask.sum().item() == 0


@pytest.mark.parametrize("kw", [dict(objective=Objective("supervised")), dict(batch=0),
                                dict(precision="fp16")])
def test_simulation_refuses_bad_input(kw):
    from memlab.hf.trl_simulate import simulate_post_training
    args = dict(objective=Objective("dpo", 8, 8), batch=2) | kw
    with pytest.raises(InputError):
        simulate_post_training(TINY, args.pop("objective"), **args)


def test_simulate_cli_takes_a_grpo_config(tmp_path, capsys):
    """``memlab simulate --training-args grpo.yaml`` runs the GRPO step; a vLLM run is refused."""
    import json

    from memlab.app.cli import main
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    path = tmp_path / "grpo.yaml"
    path.write_text("per_device_train_batch_size: 4\nnum_generations: 4\nmax_completion_length: 2\nbeta: 0.04\n"
                    "gradient_checkpointing: false\n")
    main(["simulate", "--hf-config", str(cfg), "--training-args", str(path), "--seq", "8", "--target", "cpu",
          "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["seq"] == 10 and out["config"]["batch"] == 4
    assert any("grpo (TRL 1.16) on fake tensors" in n for n in out["notes"])
    # policy and reference: two fp32 copies of the weights (on CPU: no 512-byte blocks)
    n = sum(p.numel() for p in _model(TINY).parameters())
    assert out["by_category"]["parameters"] == 2 * 4 * n
    path.write_text("num_generations: 4\nuse_vllm: true\n")
    assert main(["simulate", "--hf-config", str(cfg), "--training-args", str(path), "--seq", "8"]) == 2
    assert "use_vllm" in capsys.readouterr().err
