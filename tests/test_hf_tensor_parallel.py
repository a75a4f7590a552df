"""Tensor parallelism in the estimate of a Hugging Face decoder (memlab.lenses.decoder_estimate.estimate_run with
tensor_parallel=t) against memlab's GPT estimate of the same Llama shapes, where both apply: one
formula of the per-rank model states (memlab.step.states.tensor_parallel_share), and per layer the
same replicated bytes and a sharded part that falls as 1/t (Korthikanti et al. 2022, sec. 4.2.1)."""
import pytest
import torch

from memlab.core.errors import InputError
from memlab.hf.estimate import estimate_hf
from memlab.hf.shape import decoder_shape
from memlab.lenses.decoder_estimate import Sizes, attention_path, layer_activations
from memlab.lenses.estimate import estimate_step, layer_activation_parts
from memlab.models.gpt_unet import GPTConfig
from memlab.policy import resolve_target
from memlab.step.fine_tune_config import LoraConfig
from memlab.step.parallel_dims import ParallelDims
from memlab.step.training_step import StepConfig

SEQ, BATCH, WORLD = 128, 4, 4


def llama() -> dict:
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=4, vocab_size=1024, max_position_embeddings=512).to_dict()


def same_gpt() -> GPTConfig:
    """memlab's GPT of the same shapes, written out by hand from the config above."""
    return GPTConfig(n_layer=4, n_head=8, d_model=256, vocab_size=1024, block_size=SEQ, mlp="swiglu",
                     mlp_hidden=512, norm="rmsnorm", position="rope", bias=False, tie_embeddings=False,
                     n_kv_head=4, name="llama")


def real_params() -> int:
    from transformers import AutoModelForCausalLM, LlamaConfig
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**llama()))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("t", [1, 2, 4])
def test_model_states_per_rank_agree_with_memlabs_gpt(t, zero):
    hf = estimate_hf(llama(), seq=SEQ, batch=BATCH, precision="bf16", target="cuda", world_size=WORLD,
                     zero=zero, tensor_parallel=t)
    gpt = estimate_step(StepConfig(same_gpt(), seq=SEQ, batch=BATCH, precision="bf16", world_size=WORLD, zero=zero,
                                   parallel=ParallelDims(tensor=t)), target="cuda")
    for cat in ("parameters", "optimizer"):
        assert hf.by_category[cat] == gpt.by_category[cat], cat
    if zero == 0:  # plain PyTorch under autocast: fp32 weights, 1/t of every matrix on a rank
        assert hf.by_category["parameters"] == pytest.approx(4 * real_params() / t, abs=1)


@pytest.mark.parametrize(("target", "precision"), [("cpu", "fp32"), ("cuda", "bf16")])
def test_a_layer_keeps_its_replicated_bytes_and_a_sharded_part_over_t(target, precision):
    """X(t) = R + S / t: the residual stream and the norms whole on every rank, q/k/v, attention's
    output and the MLP's hidden tensors divided; in fp32 on the CPU R is what memlab's GPT layer
    keeps whole (the two count one layer alike there)."""
    s = decoder_shape(llama())
    c = 4 if precision == "fp32" else 2
    z = Sizes(w=4, c=c, r=4, auto=precision != "fp32", target=resolve_target(target), precision=precision)
    x = {}
    for t in (1, 2, 4):
        shard = s.tensor_parallel_shard(t)
        x[t] = layer_activations(shard, z, 1, BATCH, SEQ, attention_path(shard, z, BATCH, SEQ, None))
    sharded = 2 * (x[1] - x[2])
    replicated = x[1] - sharded
    assert x[4] == pytest.approx(replicated + sharded / 4, rel=1e-12)
    assert sharded > 0.3 * x[1]
    if precision == "fp32":
        assert replicated == layer_activation_parts(same_gpt(), SEQ, BATCH, precision, target, 2)["replicated"]


def test_the_peak_per_rank_falls_with_t_and_the_vocabulary_is_split():
    peaks = [estimate_hf(llama(), seq=SEQ, batch=BATCH, precision="bf16", target="cuda", world_size=WORLD,
                         tensor_parallel=t) for t in (1, 2, 4)]
    assert peaks[0].peak_bytes > peaks[1].peak_bytes > peaks[2].peak_bytes
    # the loss forward's temporaries (the fp32 logits and what the output holds): their
    # vocabulary-sized part is 1/t of the vocabulary a rank, so T(1) - T(2) = 2 (T(2) - T(4))
    temps = [p.by_category["temporaries"] for p in peaks]
    assert all("loss forward" in p.notes[0] for p in peaks)
    assert temps[0] - temps[1] == 2 * (temps[1] - temps[2]) > 0


def test_bad_tensor_parallel_is_named():
    with pytest.raises(InputError, match="allowed: 1, 2, 4"):
        estimate_hf(llama(), seq=SEQ, batch=BATCH, world_size=6, tensor_parallel=3)
    with pytest.raises(InputError, match="= 8 on world_size=4 ranks; allowed: a divisor"):
        estimate_hf(llama(), seq=SEQ, batch=BATCH, world_size=4, tensor_parallel=8)
    with pytest.raises(InputError, match="LoRA"):
        estimate_hf(llama(), seq=SEQ, batch=BATCH, world_size=2, tensor_parallel=2, lora=LoraConfig(rank=4))
