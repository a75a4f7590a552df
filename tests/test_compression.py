"""Activation compression: measured savings, bounded gradient error, and the pitfalls."""
import pytest
import torch
import torch.nn as nn

from memlab.compression import (ActivationCompressor, gradient_error, gradients,
                                measure_compressed, quantize)
from memlab.step import StepConfig, build_trainer, make_batch
from memlab.techniques import category_max

STEP = StepConfig(seq=128, batch=4)


@pytest.fixture(scope="module")
def reference():
    return gradients(STEP, "none")


@pytest.fixture(scope="module")
def baseline_activations():
    return category_max(measure_compressed(STEP, "none"), "activations")


@pytest.mark.parametrize("variant, max_ratio, max_error", [
    ("bf16", 0.60, 1e-3),          # measured 0.54, 3.8e-4
    ("int8 per-row", 0.35, 5e-3),  # measured 0.32, 1.9e-3
])
def test_compression_saves_activations_with_small_gradient_error(
        variant, max_ratio, max_error, reference, baseline_activations):
    rep = measure_compressed(STEP, variant)
    ratio = category_max(rep, "activations") / baseline_activations
    err = gradient_error(STEP, variant, reference=reference)
    assert ratio <= max_ratio, f"{variant}: activations {ratio:.3f} of the baseline"
    assert 0 < err < max_error, f"{variant}: gradient error {err:.2e}"
    assert rep.fits is None and rep.oom is None


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
    for got, want in zip([model.fc.weight.grad, x.grad], ref):
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
