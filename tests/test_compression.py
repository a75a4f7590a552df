"""Activation compression: measured savings, bounded gradient error, and the pitfalls."""
import math

import pytest
import torch
import torch.nn as nn

from memlab.lenses.estimate import activation_bytes
from memlab.step.training_step import StepConfig, build_trainer, make_batch
from memlab.techniques.compression import ActivationCompressor, gradient_error, gradients, measure_compressed, quantize
from memlab.techniques.sweeps import category_max

STEP = StepConfig(seq=128, batch=4)


@pytest.fixture(scope="module")
def reference():
    return gradients(STEP, "none")


@pytest.fixture(scope="module")
def baseline_activations():
    return category_max(measure_compressed(STEP, "none"), "activations")


def _expected_ratio(step: StepConfig, variant: str) -> float:
    """Activations kept with ``variant`` over those kept without, from the tensors' sizes.

    In each block, autograd saves (fp32, t tokens of width h, MLP width f): the inputs of the
    two norms (2 t h), their outputs (2 t h), qkv in one storage (3 t h), the attention output
    (t h), and the MLP's fc and GELU outputs (2 t f); all have at least the compressor's
    65536 elements and are packed. Norm statistics and SDPA's log-sum-exp are smaller and
    stay, as does everything outside the blocks. bf16 halves what it packs; int8 quarters it
    and adds one fp32 scale per row of the last dimension (one row per token for each of the
    eight tensors)."""
    cfg = step.model_config
    t, h, f = step.seq * step.batch, cfg.d_model, cfg.hidden
    assert t * h >= 65536  # every packed tensor is over the compressor's threshold
    packed = cfg.n_layer * 4 * t * (8 * h + 2 * f)
    kept = sum(activation_bytes(cfg, step.seq, step.batch, "fp32").values())
    if variant == "bf16":
        after = packed / 2
    else:
        after = packed / 4 + cfg.n_layer * 4 * (8 * t)
    return (kept - packed + after) / kept


# bf16 keeps 8 significant bits: each packed element is rounded with relative error at most
# u = 2^-8; a gradient inherits an error of that order, and independent roundings partly
# cancel in its sums, so it stays below u. int8 per row rounds to a step of absmax/127,
# an rms error of step/sqrt(12); for a row of n ~ Gaussian values absmax ~ sqrt(2 ln n) rms,
# so relative to the row's rms the error is about sqrt(2 ln n) / (127 sqrt 12) (n <= 1024).
BF16_BOUND = 2.0 ** -8
INT8_BOUND = math.sqrt(2 * math.log(1024)) / (127 * math.sqrt(12))


@pytest.mark.parametrize("variant, bound", [("bf16", BF16_BOUND), ("int8 per-row", INT8_BOUND)])
def test_compression_saves_activations_with_small_gradient_error(
        variant, bound, reference, baseline_activations):
    rep = measure_compressed(STEP, variant)
    ratio = category_max(rep, "activations") / baseline_activations
    err = gradient_error(STEP, variant, reference=reference)
    expected = _expected_ratio(STEP, variant.split()[0])
    assert ratio == pytest.approx(expected, abs=0.02), f"{variant}: activations {ratio:.3f} of the baseline"
    assert 0 < err < bound, f"{variant}: gradient error {err:.2e}"
    assert rep.fits is None and rep.oom is None


def test_int8_error_exceeds_bf16_error(reference):
    """int8's step (absmax/127) is coarser than bf16's rounding (2^-8 relative)."""
    bf16 = gradient_error(STEP, "bf16", reference=reference)
    assert bf16 < gradient_error(STEP, "int8 per-row", reference=reference)


def test_checkpointing_keeps_gradients_exact(reference):
    assert gradient_error(STEP, "checkpointing", reference=reference) < 1e-6


def test_int8_packs_a_quarter_and_views_once():
    trainer = build_trainer(STEP)
    comp = ActivationCompressor(trainer.model, "int8")
    trainer.model(*make_batch(STEP)).backward()
    assert comp.n_packed > 0 and comp.n_views > 0  # q, k, v: views of the qkv output
    # + one fp32 scale per row (rows of 64 to 1024 elements)
    assert comp.saved_bytes / 4 <= comp.packed_bytes <= comp.saved_bytes / 4 * 1.07
    first = comp.n_packed
    trainer.model(*make_batch(STEP)).backward()  # a new forward packs afresh (cache per forward)
    assert comp.n_packed == first
    comp.remove()


class _Toy(nn.Module):
    """A Linear (saves its input and a view of its weight), then a product of two views of
    one storage (saves both)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 128)

    def forward(self, x):
        a, b = self.fc(x).chunk(2, dim=-1)
        return (a * b).sum()


def test_parameters_are_skipped_and_a_storage_is_packed_once():
    torch.manual_seed(0)
    model, x = _Toy(), torch.randn(32, 64, requires_grad=True)
    model(x).backward()
    ref = [model.fc.weight.grad.clone(), x.grad.clone()]
    model.zero_grad(set_to_none=True)
    x.grad = None
    comp = ActivationCompressor(model, "bf16", modules=[model], min_numel=0)
    model(x).backward()
    # packed: x (the Linear's input) and the fc output (once, for both views); not the weight
    assert comp.n_packed == 2 and comp.n_views == 1
    assert comp.saved_bytes == (32 * 64 + 32 * 128) * 4
    for got, want in zip([model.fc.weight.grad, x.grad], ref, strict=True):
        assert ((got - want).norm() / want.norm()).item() < 1e-2  # bf16: ~3 significant digits
    comp.remove()
    model.zero_grad(set_to_none=True)
    x.grad = None
    model(x).backward()  # removed: exact again
    assert torch.equal(model.fc.weight.grad, ref[0])


def test_quantize_round_trip_error_is_bounded():
    x = torch.randn(64, 256)
    for gran in ("row", "tensor"):
        p = quantize(x.view(-1), "int8", gran, row=256)
        back = p.unpack().view(64, 256)
        step = x.abs().amax(dim=1, keepdim=True) / 127 if gran == "row" else x.abs().max() / 127
        assert ((back - x).abs() <= step / 2 + 1e-6).all()
    assert quantize(x.view(-1), "bf16").unpack().dtype == torch.float32


def test_bad_arguments():
    model = build_trainer(STEP).model
    with pytest.raises(ValueError, match="mode='int4'; allowed: bf16, int8"):
        ActivationCompressor(model, "int4")
    with pytest.raises(ValueError, match="granularity='col'; allowed: row, tensor"):
        ActivationCompressor(model, "int8", granularity="col")
    ck = build_trainer(StepConfig(seq=64, batch=2, checkpointing="full")).model
    with pytest.raises(ValueError, match="checkpointing='full'"):
        ActivationCompressor(ck, "int8")
    with pytest.raises(ValueError, match="variant='zip'; allowed: none, bf16"):
        measure_compressed(STEP, "zip")
