"""torchao's low-bit AdamW (8-bit, 4-bit, FP8) as optimizer states memlab counts.

Expected numbers: the state torchao 0.18 itself allocates after one real step on this CPU (every
state tensor's bytes, a tensor subclass counted by its inner tensors: codes, block scales, code
table), against :func:`memlab.step.low_bit.torchao_state_bytes`, the layout read off torchao's
source (``adam.py:75`` floor and divisibility, ``subclass_*bit.py`` zeros).
"""
import pytest
import torch

from memlab.step.low_bit import TORCHAO, TORCHAO_STEP_BYTES, torchao_adamw, torchao_state_bytes

pytest.importorskip("torchao")

#: both sides of the 4096-element floor, a size no block divides (4160 = 65 * 64), a vector, 3-d
SHAPES = [(64, 128), (100,), (65, 64), (4096,), (3, 32, 256), (48, 48)]


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes ``t`` holds: its storage, or a torchao subclass's inner tensors (``__tensor_flatten__``)."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        return sum(_tensor_bytes(getattr(t, name)) for name in t.__tensor_flatten__()[0])
    return t.numel() * t.element_size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", TORCHAO)
def test_the_layout_is_torchaos_own_state_after_one_step(kind, dtype):
    params = [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in SHAPES]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torchao_adamw(params, kind)
    opt.step()
    for p, shape in zip(params, SHAPES, strict=True):
        state = opt.state[p]
        moments = _tensor_bytes(state["exp_avg"]) + _tensor_bytes(state["exp_avg_sq"])
        assert moments == torchao_state_bytes([p.numel()], kind, dtype.itemsize), shape
        assert _tensor_bytes(state["step"]) == TORCHAO_STEP_BYTES and state["step"].device.type == "cpu"
