"""Op-level selective checkpointing (checkpointing="op", torchtitan's policy): between
"selective" and "full" in the real step; the simulation equals it and the estimate counts it
within 2%."""
import pytest

from memlab.core.errors import InputError
from memlab.lenses.estimate import estimate_step
from memlab.lenses.measure import measure_step
from memlab.lenses.simulate import simulate_step
from memlab.models.gpt_unet import UNetConfig, get_config, tiny_llama
from memlab.step.training_step import StepConfig
from memlab.time.flops import gpt_step_flops

LLAMA = tiny_llama(d_model=256, n_layer=4, mlp_hidden=512)


@pytest.mark.parametrize("model, precision", [("tiny", "fp32"), ("tiny", "bf16"), (LLAMA, "fp32"), (LLAMA, "bf16")])
def test_op_checkpointing_measure_simulate_estimate(model, precision):
    step = StepConfig(model=model, seq=128, batch=4, precision=precision, checkpointing="op")
    measured = measure_step(step).peak_bytes
    assert simulate_step(step, target="cpu").peak_bytes == measured
    est = estimate_step(step, target="cpu").peak_bytes
    assert abs(est - measured) <= 0.02 * measured


def test_op_sits_between_selective_and_full():
    peaks = {c: measure_step(StepConfig(model=LLAMA, seq=128, batch=4, checkpointing=c)).peak_bytes
             for c in ("selective", "op", "full")}
    assert peaks["full"] < peaks["op"] < peaks["selective"]


@pytest.mark.parametrize("model", ["tiny", LLAMA])
def test_op_recompute_flops_are_what_torch_counts(model):
    """The formula's recompute (o and up re-run for LLaMA, o only for GELU: the recompute stops
    before the last matmul) equals torch's FLOP counter on the simulated step."""
    step = StepConfig(model=model, seq=128, batch=4, checkpointing="op")
    counted = simulate_step(step, target="cpu").time.flops
    formula = gpt_step_flops(step.model_config, 128, 4)
    assert formula.recompute == counted.recompute > 0
    assert formula.attention == counted.attention


def test_a_unet_has_no_op_policy():
    with pytest.raises(InputError, match="checkpointing='op'"):
        UNetConfig(checkpointing="op")
    assert get_config("tiny", checkpointing="op").checkpointing == "op"
