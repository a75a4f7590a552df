"""Elementwise bytes of a step (memlab.time.elementwise): the closed form against the op-by-op count
on the real step, the counting rule against bytes written out by hand, and the time they take
(memlab.time.step_time's roofline) against the rates measured."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from memlab.app import doctor
from memlab.models.gpt_unet import get_config, tiny_llama
from memlab.step.training_step import StepConfig
from memlab.time.elementwise import (
    ElementwiseCounter,
    ElementwiseWork,
    count_elementwise,
    gpt_elementwise,
    step_elementwise,
)
from memlab.time.step_time import ElementwiseRates, elementwise_seconds, step_time

GPT2 = replace(get_config("tiny"), n_layer=2)                          # LayerNorm, GELU, learned, tied
GPT2_BARE = replace(GPT2, tie_embeddings=False, bias=False)
LLAMA = tiny_llama(97, n_kv_head=None)                                 # RMSNorm, SwiGLU, rotary, MHA
LLAMA_GQA = tiny_llama(97)                                             # 8 query heads, 2 kv: repeated
LLAMA_NATIVE = tiny_llama(97, gqa="native")                            # SDPA's enable_gqa
MODELS = (GPT2, GPT2_BARE, LLAMA, LLAMA_GQA, LLAMA_NATIVE)


def close(formula: ElementwiseWork, counted: ElementwiseWork, micro_batches: int = 1) -> None:
    """The closed form leaves out the loss's scalar ops only (its division by the micro-batches,
    the loss scale's product, the running total): under 100 bytes a micro-batch."""
    for part in ("forward", "backward", "recompute"):
        assert abs(getattr(formula, part) - getattr(counted, part)) < 100 * micro_batches, part
    assert formula.activation_elements == counted.activation_elements
    assert formula.activation_bytes == counted.activation_bytes


# a covering set: every model and attention with every precision, and checkpointing and
# accumulation in turn (2 micro-batches of 2 sequences: one a micro-batch, which naive
# attention's matmuls fold without a copy)
CASES = [(replace(cfg, attention=attn), prec, ck, batch)
         for i, cfg in enumerate(MODELS) for attn in ("sdpa", "naive") if attn == "sdpa" or cfg.gqa != "native"
         for j, prec in enumerate(("fp32", "bf16", "pure-bf16", "fp16"))
         for ck, batch in [(("none", "full", "selective")[(i + j) % 3], (4, 2)[(i + j + (attn == "naive")) % 2])]]


@pytest.mark.parametrize("cfg,precision,ckpt,batch", CASES,
                         ids=[f"{c.name}-{c.norm}-{c.gqa}-{c.attention}-{p}-{k}-b{b}" for c, p, k, b in CASES])
def test_closed_form_equals_the_count_on_the_step(cfg, precision, ckpt, batch):
    step = StepConfig(model=cfg, seq=16, batch=batch, precision=precision, checkpointing=ckpt, micro_batches=2)
    counted = count_elementwise(step)
    close(gpt_elementwise(step.model_config, 16, batch, precision=precision, micro_batches=2), counted, 2)
    assert counted.recompute > 0 if ckpt != "none" and (cfg.attention == "naive" or ckpt == "full") else True


def test_fake_tensors_count_what_the_real_step_runs():
    step = StepConfig(model=LLAMA_GQA, seq=16, batch=4, precision="bf16", checkpointing="full", micro_batches=2)
    assert count_elementwise(step) == count_elementwise(step, fake=False)


def test_the_rule_on_a_norm_an_activation_and_an_add_by_hand():
    # LayerNorm (weight and bias), tanh-GELU, a residual add: t x d fp32, forward and backward
    t, d = 6, 8
    x = torch.randn(t, d, requires_grad=True)
    w, b = torch.ones(d, requires_grad=True), torch.zeros(d, requires_grad=True)
    grad = torch.randn(t, d)
    with ElementwiseCounter() as c:
        y = F.layer_norm(x, (d,), w, b)
        z = F.gelu(y, approximate="tanh") + x
        z.backward(grad)
    e = t * d * 4
    ln = e + 2 * d * 4 + e + 2 * t * 4                       # x, weight, bias in; y, mean, rstd out
    fwd = ln + 2 * e + 3 * e                                 # gelu: y in, out; add: two in, one out
    # gelu_backward (grad, y -> dy), LayerNorm's backward (dy, x, mean, rstd, weight, bias ->
    # dx, dw, db), and x's two gradients summed
    bwd = 3 * e + (2 * e + 2 * t * 4 + 2 * d * 4 + e + 2 * d * 4) + 3 * e
    assert c.work() == ElementwiseWork(fwd, bwd, 0, 2 * e + 3 * e, 2 * t * d, "counted")


def test_deepspeed_sizes_and_the_fallback_count():
    step = StepConfig(model=GPT2, seq=16, batch=4, precision="bf16", zero=2)
    assert step_elementwise(step, deepspeed=True) == gpt_elementwise(GPT2, 16, 4, precision="pure-bf16")
    unet = StepConfig(model="unet-small", seq=16, batch=2)  # no closed form: counted
    assert step_elementwise(unet) == count_elementwise(unet) and step_elementwise(unet).source == "counted"


@pytest.mark.parametrize("precision", ["fp32", "bf16", "pure-bf16"])
@pytest.mark.parametrize("cfg", [GPT2, LLAMA_GQA], ids=["gpt2", "llama-gqa"])
def test_chunked_loss_closed_form_equals_the_count(cfg, precision):
    # 5 tokens a chunk over 2 x 16: the last chunk short; the Function's forward runs with grad off
    chunked = replace(cfg, loss="chunked", loss_chunk=5)
    step = StepConfig(model=chunked, seq=16, batch=4, precision=precision, micro_batches=2)
    close(gpt_elementwise(chunked, 16, 4, precision=precision, micro_batches=2), count_elementwise(step), 2)


def test_roofline_streams_bytes_and_computes_activations():
    work = ElementwiseWork(600, 400, 0, 200, 50, "formula")
    # a card: no activation limit, every byte at the bandwidth
    assert elementwise_seconds(work, ElementwiseRates(100.0)) == pytest.approx(10.0)
    # a CPU: activations take 50 elements at 1/s, longer than their 200 bytes at 100 B/s
    assert elementwise_seconds(work, ElementwiseRates(100.0, 1.0)) == pytest.approx(8.0 + 50.0)


def test_the_time_lens_charges_the_bytes_and_files_recompute_under_recompute():
    step = StepConfig(model="gpt2-medium", seq=1024, batch=8, precision="bf16", checkpointing="full")
    rates = ElementwiseRates(1e12, math.inf)
    t = step_time(step, "A100-80GB", elementwise_rates=rates)
    ew = gpt_elementwise(step.model_config, 1024, 8, precision="bf16", target="cuda")
    assert t.elementwise == ew
    assert t.by_part.elementwise == pytest.approx((ew.forward + ew.backward) / 1e12)
    matmuls_again = t.by_part.recompute - ew.recompute / 1e12  # the FLOPs' share, at compute's rate
    assert matmuls_again == pytest.approx(t.flops.recompute / t.flops.model * t.by_part.compute, rel=1e-9)
    assert t.to_dict()["elementwise"]["bytes"] == ew.bytes


def test_doctor_measures_an_add_and_gelu(monkeypatch):
    monkeypatch.setattr(doctor, "fastest_seconds", lambda fn, device, repeats: (fn(), 0.5)[1])
    r = doctor.measure_elementwise("bf16", shape=(3, 5), repeats=1)
    assert r.bytes_per_s == 3 * 15 * 2 / 0.5            # two reads and a write of 15 bf16 elements
    assert r.activation_elements_per_s == 2 * 15 / 0.5  # GELU's forward and backward outputs
    monkeypatch.undo()
    real = doctor.measure_elementwise("fp32", shape=(64, 64), repeats=1)
    assert real.bytes_per_s > 1e7 and real.activation_elements_per_s > 1e5
