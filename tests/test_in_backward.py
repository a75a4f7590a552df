"""The optimizer step fused into backward (memlab.step.optimizer_in_backward): the real step runs it, the
simulation (the same code on fake tensors) equals it, and the estimate counts it within 2%."""
from dataclasses import replace

import pytest
import torch

from memlab.app.cli import main
from memlab.core.errors import InputError
from memlab.hf.estimate import estimate_hf
from memlab.hf.measure import measure_hf
from memlab.hf.simulate import simulate_hf
from memlab.lenses.estimate import estimate_step
from memlab.lenses.measure import measure_step
from memlab.lenses.simulate import simulate_step
from memlab.models.gpt_unet import tiny_llama
from memlab.step.training_step import StepConfig, build_trainer, make_batch

LLAMA = tiny_llama(d_model=256, n_layer=4, mlp_hidden=512)
HF_LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=256,
                intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512,
                tie_word_embeddings=False)


def test_the_hooks_update_every_parameter_as_one_optimizer_step_would():
    """Same weights, same batch: the parameters after a step in backward equal those after
    backward then one fused AdamW step (the tutorial's claim), and no gradient is left."""
    step = StepConfig(model=LLAMA, seq=16, batch=2)
    batch = make_batch(step)
    plain, fused = build_trainer(step), build_trainer(replace(step, optimizer_in_backward=True))
    plain.step(batch)
    fused.step(batch)
    for (name, a), b in zip(plain.model.named_parameters(), fused.model.parameters(), strict=True):
        assert b.grad is None, name
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.parametrize("model, precision, checkpointing", [
    ("tiny", "fp32", None), ("tiny", "bf16", "full"), (LLAMA, "fp32", None), (LLAMA, "bf16", "full")])
def test_gpt_step_in_backward_measure_simulate_estimate(model, precision, checkpointing):
    step = StepConfig(model=model, seq=16, batch=2, precision=precision, checkpointing=checkpointing,
                      optimizer_in_backward=True)
    measured = measure_step(step)
    assert simulate_step(step, target="cpu").peak_bytes == measured.peak_bytes
    est = estimate_step(step, target="cpu").peak_bytes
    assert abs(est - measured.peak_bytes) <= 0.02 * measured.peak_bytes
    # the saving is the gradients: without the hooks the peak holds every one of them
    plain = measure_step(replace(step, optimizer_in_backward=False))
    grads = plain.category_peaks()["gradients"]
    assert plain.peak_bytes - measured.peak_bytes >= 0.5 * grads


@pytest.mark.parametrize("precision, checkpointing", [("fp32", None), ("bf16", "full")])
def test_hf_llama_step_in_backward_measure_simulate_estimate(precision, checkpointing):
    kw = dict(seq=16, batch=2, precision=precision, checkpointing=checkpointing, optimizer_in_backward=True)
    measured = measure_hf(HF_LLAMA, **kw).peak_bytes
    simulated = simulate_hf(HF_LLAMA, target="cpu", **kw).peak_bytes
    est = estimate_hf(HF_LLAMA, target="cpu", **kw).peak_bytes
    assert abs(simulated - measured) <= 0.001 * measured
    assert abs(est - measured) <= 0.02 * measured
    plain = estimate_hf(HF_LLAMA, target="cpu", **dict(kw, optimizer_in_backward=False)).peak_bytes
    assert plain - est >= 0.5 * (10970112 - 1024000)  # nearly all fp32 gradients, less the head's


@pytest.mark.parametrize("fields, needle", [
    (dict(micro_batches=2), "micro_batches=1"), (dict(precision="fp16"), "loss scaler"),
    (dict(zero=1), "zero=0"), (dict(optimizer_in_backward="yes"), "True, False")])
def test_what_the_step_in_backward_cannot_do_is_bad_input(fields, needle):
    with pytest.raises(InputError, match=needle):
        StepConfig(seq=16, batch=2, **{"optimizer_in_backward": True, **fields})


def test_hf_estimate_refuses_lora_with_the_step_in_backward():
    from memlab.step.fine_tune_config import LoraConfig
    with pytest.raises(InputError, match="no LoRA"):
        estimate_hf(HF_LLAMA, seq=16, batch=2, lora=LoraConfig(rank=8), optimizer_in_backward=True)


def test_cli_flag(capsys):
    assert main(["estimate", "--seq", "16", "--batch", "2", "--optimizer-in-backward", "--json"]) == 0
    assert '"optimizer_in_backward": true' in capsys.readouterr().out
    assert main(["estimate", "--optimizer-in-backward", "--micro-batches", "2"]) == 2
