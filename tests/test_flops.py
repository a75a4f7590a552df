"""FLOPs of a step: the closed form (memlab.time.flops.gpt_step_flops) against torch's own
FlopCounterMode on the real step, part by part and in total."""
from __future__ import annotations

import pytest
from hf_gpt_mapping import gpt_config
from torch.utils.flop_counter import FlopCounterMode

from memlab.core.errors import InputError
from memlab.hf import config as hf
from memlab.models.gpt_unet import get_config, tiny_llama
from memlab.step.training_step import StepConfig, build_trainer, make_batch
from memlab.time.flops import CPU_SDPA, PhaseFlopCounter, count_step_flops, gpt_step_flops, step_flops_formula

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def torch_count(step: StepConfig) -> int:
    """FlopCounterMode's total over one real step (after a warm-up step)."""
    trainer = build_trainer(step)
    batch = make_batch(step)
    trainer.step(batch)
    with FlopCounterMode(display=False, custom_mapping=CPU_SDPA) as counter:
        trainer.step(batch)
    return counter.get_total_flops()


def close(a: int, b: int, rel: float = 0.01) -> bool:
    return abs(a - b) <= rel * b


@pytest.mark.parametrize("model", ["tiny", "llama"])
@pytest.mark.parametrize("ckpt", ["none", "full", "selective"])
@pytest.mark.parametrize("attention", ["sdpa", "naive"])
def test_formula_equals_flop_counter_on_memlabs_gpt(model, ckpt, attention):
    cfg = tiny_llama() if model == "llama" else get_config("tiny", n_layer=2)
    step = StepConfig(model=cfg, seq=32, batch=2, micro_batches=2, checkpointing=ckpt,
                      attention=attention)
    formula = step_flops_formula(step)
    assert close(formula.total, torch_count(step))
    counted = count_step_flops(step)  # on fake tensors, by part
    for part in ("forward", "backward", "recompute", "attention"):
        assert close(getattr(formula, part), getattr(counted, part), 1e-3), part
    assert (formula.recompute > 0) == (ckpt != "none")


def test_recompute_skips_the_last_matmul_and_selective_costs_the_core():
    cfg = get_config("tiny")
    t, s, h, f = 64 * 2, 64, cfg.d_model, cfg.hidden
    full = gpt_step_flops(cfg, 64, 2, checkpointing="full", attention="naive")
    block = 2 * t * sum(cfg.matmul_numels()[0]) + 4 * 2 * s * s * h
    assert full.recompute == cfg.n_layer * (block - 2 * t * f * h)  # mlp.out is not re-run
    sel = gpt_step_flops(cfg, 64, 2, checkpointing="selective", attention="naive")
    assert sel.recompute == cfg.n_layer * 2 * 2 * s * s * h  # q k^T only


def hf_step_counts(ckpt: str, attention: str, lora: dict | None):
    d = tiny_hf_llama()
    model, opt = hf.build_fn(d, checkpointing=ckpt, attention=attention, lora=lora)()
    step = hf.causal_lm_step(32, 2)
    step(model, opt)
    with PhaseFlopCounter() as phases:
        step(model, opt)
    with FlopCounterMode(display=False, custom_mapping=CPU_SDPA) as counter:
        step(model, opt)
    return gpt_config(d, seq=32), phases.flops(), counter.get_total_flops()


def tiny_hf_llama() -> dict:
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=128, max_position_embeddings=256).to_dict()


@pytest.mark.parametrize("ckpt", ["none", "full"])
@pytest.mark.parametrize("targets", [None, ["q_proj", "v_proj"], LLAMA_TARGETS])
def test_formula_equals_flop_counter_on_hf_llama_and_lora(ckpt, targets):
    lora = None if targets is None else dict(r=4, target_modules=targets, lora_dropout=0.0)
    cfg, phases, total = hf_step_counts(ckpt, "sdpa", lora)
    formula = gpt_step_flops(cfg, 32, 2, checkpointing=ckpt, attention="sdpa",
                             lora_rank=4 if lora else None, lora_targets=targets or ())
    assert phases.total == total  # the phase counter is FlopCounterMode's formulas
    assert close(formula.total, total)
    for part in ("forward", "backward", "recompute"):
        assert close(getattr(formula, part), getattr(phases, part), 1e-3), part


def test_lora_has_no_weight_gradients():
    cfg = tiny_llama()
    plain = gpt_step_flops(cfg, 32, 2)
    lora = gpt_step_flops(cfg, 32, 2, lora_rank=4, lora_targets=["q_proj", "v_proj"])
    assert lora.forward > plain.forward  # the adapters' matmuls
    assert lora.backward < 0.55 * plain.backward  # about half: input gradients only


def test_eager_hf_lora_counts_only_needed_attention_gradients():
    lora = dict(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    cfg, phases, total = hf_step_counts("none", "naive", lora)
    formula = gpt_step_flops(cfg, 32, 2, attention="naive", lora_rank=4, lora_targets=["q_proj", "v_proj"])
    assert close(formula.total, total, 1e-3)


def test_bad_input_is_named():
    cfg = get_config("tiny")
    with pytest.raises(InputError, match="checkpointing"):
        gpt_step_flops(cfg, 8, 1, checkpointing="some")
    with pytest.raises(InputError, match="q_proj"):
        gpt_step_flops(tiny_llama(), 8, 1, lora_rank=4, lora_targets=["nope"])
    with pytest.raises(InputError, match="rank"):
        gpt_step_flops(tiny_llama(), 8, 1, lora_rank=0, lora_targets=["q_proj"])


def test_unet_is_counted_on_fake_tensors_as_on_real_ones():
    step = StepConfig(model="unet-small", seq=16, batch=1)
    assert step_flops_formula(step).source == "counted"
    assert close(step_flops_formula(step).total, torch_count(step), 1e-6)
