"""Today's models at their real scale: grouped-query attention and the loss spike in the
estimate, long context, and the sharded simulation of a 70B model."""
import itertools
import json

import pytest
import torch.nn as nn

import memlab as ml
from memlab.distributed.fsdp import simulate_sharded
from memlab.lenses.estimate import activation_bytes, estimate_step
from memlab.lenses.simulate import simulate_step
from memlab.models.chunked_loss import loss_spike_bytes
from memlab.policy import get_target


def llama_like(vocab: int, kv: int | None = 2, **over) -> ml.GPTConfig:
    """A tiny LLaMA-style model: SwiGLU, RMSNorm, rotary, untied head, 8 query heads."""
    shape = dict(n_layer=2, d_model=64, n_head=8, n_kv_head=kv, vocab_size=vocab, block_size=2048,
                 mlp="swiglu", mlp_hidden=128, norm="rmsnorm", position="rope", bias=False,
                 tie_embeddings=False, loss_chunk=256, name=f"tiny-gqa-v{vocab}")
    return ml.GPTConfig(**{**shape, **over})


def _without_resident_workspace(report, target: str) -> int:
    """The peak less the workspace a CUDA target holds all step (66 MiB: larger than a tiny
    model's step, it would hide any error of the rest)."""
    return report.peak_bytes - get_target(target).resident_workspace()


def _in_the_loss(report) -> bool:
    """Whether the estimate's peak moment is one of the plain loss's (memlab.policy's
    cross-entropy moments, and the head's backward)."""
    moment = report.notes[0].removeprefix("peak moment: ")
    return moment in ("loss forward", "loss backward", "loss backward, cast", "head backward",
                      "log-softmax backward", "loss input cast backward")


# (target, precision) pairs cycle through the grid: every vocabulary and sequence length
# meets both targets and both precisions, in 12 simulations rather than 48
PAIRS = itertools.cycle([("cpu", "fp32"), ("cuda", "bf16"), ("cpu", "bf16"), ("cuda", "fp32")])
GRID = [(vocab, seq, loss, *next(PAIRS)) for vocab, seq, loss in
        itertools.product([1000, 32000, 128256], [128, 1024], ["plain", "chunked"])]


@pytest.mark.parametrize("vocab, seq, loss, target, precision", GRID,
                         ids=[f"V{v}-s{s}-{lo}-{t}-{p}" for v, s, lo, t, p in GRID])
def test_gqa_estimate_within_5_percent_of_simulate(vocab, seq, loss, target, precision):
    step = ml.StepConfig(model=llama_like(vocab, loss=loss), seq=seq, batch=2, precision=precision)
    est, sim = estimate_step(step, target=target), simulate_step(step, target=target)
    e, s = _without_resident_workspace(est, target), _without_resident_workspace(sim, target)
    assert abs(e - s) / s < 0.05
    if target == "cpu":  # CUDA rounds each parameter to 512-byte blocks, the formula does not
        assert est.by_category["parameters"] == sim.by_category["parameters"]


@pytest.mark.parametrize("over", [dict(kv=1), dict(kv=None), dict(gqa="native"),
                                  dict(position="learned"), dict(checkpointing="selective"),
                                  dict(checkpointing="full")])
def test_attention_variants_within_5_percent(over):
    over = dict(over)
    kv = over.pop("kv", 2)
    step = ml.StepConfig(model=llama_like(1000, kv, **over), seq=512, batch=2)
    est, sim = estimate_step(step), simulate_step(step)
    assert abs(est.peak_bytes - sim.peak_bytes) / sim.peak_bytes < 0.05


def test_autocast_weight_copies_follow_the_smaller_kv_projection():
    """Under bf16 autocast every matmul weight gets a 2-byte copy; with grouped-query
    attention qkv has (n_head + 2 n_kv_head) * head_dim rows, not 3 * d_model."""
    cfg = llama_like(1000, kv=2)
    model = ml.GPT(cfg)
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert activation_bytes(cfg, 64, 2, "bf16")["weight_copies"] == 2 * weights
    mha = llama_like(1000, kv=None)
    assert activation_bytes(mha, 64, 2, "bf16")["weight_copies"] > 2 * weights


@pytest.mark.parametrize("target, precision", [("cpu", "fp32"), ("cpu", "bf16"), ("cuda", "bf16")])
def test_chunked_loss_removes_the_logits_spike_from_the_estimate(target, precision):
    """With a large vocabulary the loss is the peak; chunking it saves at least the logits
    and their log-softmax (loss_spike_bytes, from the tensor sizes alone)."""
    tokens = 2 * 512
    plain = ml.StepConfig(model=llama_like(32000), seq=512, batch=2, precision=precision)
    chunked = ml.StepConfig(model=llama_like(32000, loss="chunked"), seq=512, batch=2,
                            precision=precision)
    saved = estimate_step(plain, target=target).peak_bytes - estimate_step(chunked, target=target).peak_bytes
    assert saved >= loss_spike_bytes(tokens, 32000, precision)
    assert _in_the_loss(estimate_step(plain, target=target))


@pytest.mark.slow
@pytest.mark.parametrize("model, seq, loss", [("llama-3-8b", 8192, "plain"),
                                              ("mistral-7b", 32768, "plain"),
                                              ("mistral-7b", 32768, "chunked")])
def test_long_context_estimate_matches_simulate(model, seq, loss):
    """8k and 32k tokens on the real shapes (bf16, full checkpointing): at 32k Mistral's
    loss is the peak of the step, and chunking it moves the peak elsewhere."""
    step = ml.StepConfig(model=ml.get_config(model, loss=loss), seq=seq, batch=1,
                         precision="bf16", checkpointing="full")
    est, sim = estimate_step(step), simulate_step(step)
    assert abs(est.peak_bytes - sim.peak_bytes) / sim.peak_bytes < 0.05
    if model == "mistral-7b":
        assert _in_the_loss(est) == (loss == "plain")


def test_sharded_simulation_of_a_gqa_model_in_bf16():
    """FSDP2 on a fake process group: parameters, gradients and optimizer state are 1/N of
    the model's fp32 bytes (the mixed-precision policy keeps an fp32 sharded master)."""
    cfg = llama_like(1000, n_layer=2, d_model=128, n_head=8, n_kv_head=2, mlp_hidden=256)
    step = ml.StepConfig(model=cfg, seq=64, batch=2, precision="bf16", checkpointing="full")
    rep = simulate_sharded(step, 8)
    n = cfg.num_params()
    assert rep.by_category["parameters"] == pytest.approx(4 * n / 8, rel=0.02)
    assert rep.by_category["optimizer"] == pytest.approx(8 * n / 8, rel=0.02)
    assert len(rep.per_rank) == 8 and "MixedPrecisionPolicy" in " ".join(rep.notes)
    with pytest.raises(ValueError, match="allowed: fp32, bf16"):
        simulate_sharded(ml.StepConfig(precision="fp16"), 2)


def test_cli_simulates_zero3_over_many_ranks_with_fsdp(capsys):
    from memlab.app.cli import main
    assert main(["simulate", "--model", "tiny", "--seq", "64", "--batch", "2", "--precision",
                 "bf16", "--zero", "3", "--world-size", "16", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert len(rep["per_rank"]) == 16
    n = ml.get_config("tiny").num_params()
    assert rep["by_category"]["optimizer"] == pytest.approx(8 * n / 16, rel=0.05)
