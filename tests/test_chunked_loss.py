"""The chunked linear + cross-entropy: same loss and gradients as the plain one, without the
tokens x vocab spike."""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from memlab.lenses.measure import measure_step
from memlab.lenses.simulate import simulate_step
from memlab.models.chunked_loss import (
    check_linear_cross_entropy,
    linear_cross_entropy,
    loss_spike_bytes,
    plain_linear_cross_entropy,
)
from memlab.models.gpt_unet import GPT, GPTConfig, get_config
from memlab.step.training_step import StepConfig


# -- against the plain loss --------------------------------------------------------------
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("chunk", [1, 7, 96, 1000])  # 96 tokens: one chunk, and more than all
def test_chunked_loss_and_gradients_equal_the_plain_ones(precision, chunk):
    check = check_linear_cross_entropy(
        lambda h, w, t: linear_cross_entropy(h, w, t, chunk_size=chunk), precision=precision)
    assert check.passed, str(check)


def test_ignored_targets_are_left_out_of_the_mean_as_in_cross_entropy():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(40, 8, generator=g, requires_grad=True)
    w = torch.randn(50, 8, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (40,), generator=g)
    t[::3] = -100
    got = linear_cross_entropy(h, w, t, chunk_size=9)
    want = plain_linear_cross_entropy(h, w, t)
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(want, (h, w)), strict=True):
        torch.testing.assert_close(a, b)


class _SumNotMean(torch.autograd.Function):
    """A wrong idea: the right mean loss, but a backward that forgets to divide the
    logits gradient by the token count."""

    @staticmethod
    def forward(ctx, h, w, t):
        logits = h @ w.t()
        ctx.save_for_backward(h, w, t, logits)
        return F.cross_entropy(logits, t)

    @staticmethod
    def backward(ctx, grad):
        h, w, t, logits = ctx.saved_tensors
        g = torch.softmax(logits, dim=-1) - F.one_hot(t, logits.shape[1]).to(logits.dtype)
        g = g * grad  # missing: / number of tokens
        return g @ w, g.t() @ h, None


def test_the_check_catches_a_backward_that_does_not_divide_by_the_token_count():
    tokens = 96
    check = check_linear_cross_entropy(_SumNotMean.apply, tokens=tokens)
    assert not check.passed
    assert check.loss_error < check.tolerance  # the loss alone would not show it
    # every gradient is tokens times too large: relative error tokens - 1
    assert check.hidden_error == pytest.approx(tokens - 1, rel=1e-4)
    assert check.weight_error == pytest.approx(tokens - 1, rel=1e-4)


def test_the_check_catches_a_summed_loss():
    tokens = 64
    check = check_linear_cross_entropy(
        lambda h, w, t: F.cross_entropy(h @ w.t(), t, reduction="sum"), tokens=tokens)
    assert not check.passed
    assert check.loss_error == pytest.approx(tokens - 1, rel=1e-4)


# -- in the model: every parameter's gradient ----------------------------------------------
MODELS = {
    "gpt2-like-tied": GPTConfig(n_layer=2, n_head=4, d_model=64, vocab_size=300, block_size=64),
    "qwen-like-gqa": GPTConfig(n_layer=2, n_head=4, d_model=64, vocab_size=300, block_size=64,
                               mlp="swiglu", norm="rmsnorm", position="rope", bias=False,
                               qkv_bias=True, tie_embeddings=False, n_kv_head=2),
}


def _model_grads(cfg: GPTConfig, idx, tgt, bf16: bool) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(0)
    model = GPT(cfg)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(idx, tgt)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("name", list(MODELS))
def test_whole_model_gradients_equal_the_plain_loss(name, bf16):
    # tolerance: fp32 summation order only; bf16 as in check_linear_cross_entropy
    tol = 2e-2 if bf16 else 1e-5
    cfg = MODELS[name]
    g = torch.Generator().manual_seed(3)
    idx, tgt = (torch.randint(0, cfg.vocab_size, (3, 40), generator=g) for _ in range(2))
    plain_loss, plain = _model_grads(cfg, idx, tgt, bf16)
    chunk_loss, chunked = _model_grads(replace(cfg, loss="chunked", loss_chunk=17), idx, tgt, bf16)
    assert abs(chunk_loss - plain_loss) / plain_loss < tol
    assert plain.keys() == chunked.keys()
    for n in plain:
        err = (chunked[n] - plain[n]).abs().max() / plain[n].abs().max()
        assert err < tol, f"{n}: relative error {err:.2e}"


# -- the memory: the spike is gone ---------------------------------------------------------
def _big_vocab(loss: str, chunk: int) -> GPTConfig:
    # a tiny body under a 32000-word head: the loss is the whole story
    return get_config("tiny", n_layer=2, n_head=2, d_model=64, vocab_size=32000, loss=loss,
                      loss_chunk=chunk, name=f"big-vocab-{loss}")


@pytest.mark.parametrize("precision,seq,batch", [("fp32", 256, 4), ("bf16", 64, 2)])
def test_chunked_loss_removes_the_logits_and_log_softmax_from_the_peak(precision, seq, batch):
    tokens, vocab = seq * batch, 32000
    reports = {loss: measure_step(StepConfig(model=_big_vocab(loss, tokens // 8), seq=seq, batch=batch,
                                             precision=precision)) for loss in ("plain", "chunked")}
    plain, chunked = reports["plain"], reports["chunked"]
    # the plain step peaks inside the loss's backward (the log-softmax gradient)
    assert max(plain.timeline, key=lambda e: e.total).op.startswith("_log_softmax_backward")
    assert plain.peak_bytes - chunked.peak_bytes >= loss_spike_bytes(tokens, vocab, precision)
    # forward saves one fp32 log-sum-exp per token (and a few scalars: the int64 token
    # count) instead of the fp32 log-softmax, tokens x vocab x 4 bytes
    saved_drop = plain.by_category["activations"] - chunked.by_category["activations"]
    assert saved_drop >= tokens * vocab * 4 - tokens * 4 - 16


def test_chunked_loss_simulates_equal_to_measure():
    step = StepConfig(model=_big_vocab("chunked", 48), seq=64, batch=2)  # chunks of 48, 48, 32
    real, fake = measure_step(step), simulate_step(step)
    assert (fake.peak_bytes, fake.by_category) == (real.peak_bytes, real.by_category)


# -- bad input -----------------------------------------------------------------------------
@pytest.mark.parametrize("args,kw,needle", [
    (((8, 4), (10, 4), (8,)), dict(chunk_size=0), "chunk_size must be a positive integer, got 0"),
    (((8, 4), (10, 5), (8,)), {}, "must be (tokens, d) and (vocab, d) with the same d"),
    (((8, 4), (10, 4), (7,)), {}, "one class index per token: shape (8,)"),
])
def test_bad_input_names_the_value_and_what_is_allowed(args, kw, needle):
    h, w, t = torch.randn(*args[0]), torch.randn(*args[1]), torch.zeros(*args[2], dtype=torch.long)
    with pytest.raises(ValueError) as e:
        linear_cross_entropy(h, w, t, **kw)
    assert needle in str(e.value)
    with pytest.raises(ValueError, match="precision='fp8'; allowed: fp32, bf16, fp16, pure-bf16"):
        loss_spike_bytes(10, 10, "fp8")
