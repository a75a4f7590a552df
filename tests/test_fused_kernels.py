"""Liger-Kernel's and torchao FP8's saved tensors (memlab.techniques.fused_kernels): counted from
their source; torchao's autograd function run on CPU where its casts can be switched off."""
import pytest
import torch

from memlab.core.errors import InputError
from memlab.hf.shape import decoder_shape
from memlab.techniques.fused_kernels import COUNTED, flce_chunks, fp8_linear, liger_saved


def test_flce_chunking_matches_the_example_in_liger_source():
    # fused_linear_cross_entropy.py:63: "BT = 4096*4, V = 32000, H = 4096 ==> inc_factor = 8, chunk_size = 2048"
    c = flce_chunks(4096 * 4, 32000, 4096)
    assert (c.inc_factor, c.chunk_size, c.num_chunks) == (8, 2048, 8)
    with pytest.raises(InputError, match="tokens"):
        flce_chunks(0, 32000, 4096)


def test_liger_counts_for_llama_3_8b_by_hand():
    s = decoder_shape("llama-3.1-8b")
    tokens, seq = 2 * 2048, 2048
    saved = liger_saved(s, tokens, seq)
    assert saved.swiglu == 2 * tokens * 14336 * 2                  # gate and up, bf16
    assert saved.rms_norms == 2 * tokens * (4096 * 2 + 4)           # input + fp32 RSTD, two norms
    assert saved.rope == 2 * seq * 128 * 2                          # cos and sin only
    assert saved.loss_saved == tokens * 4096 * 2 + 128256 * 4096 * 2  # grad_input + grad_weight
    # inc_factor ceil(128256 / 4096) = 32; chunk next_pow2(ceil(4096 / 32)) = 128 tokens of logits
    assert saved.chunks.chunk_size == 128 and saved.loss_transient == 128 * 128256 * 2
    assert saved.note == COUNTED


def test_torchao_float8_saves_its_high_precision_input():
    """torchao's matmul_with_hp_or_float8_args saves (input_hp, weight_hp_t) before casting
    (float8_linear.py:45): run on CPU with every cast disabled, the tensors its backward
    keeps are the bf16 input and the weight itself, what fp8_linear counts as saved."""
    float8 = pytest.importorskip("torchao.float8")
    from torchao.float8.config import CastConfig, Float8LinearConfig, ScalingType
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
    from torchao.float8.float8_training_tensor import LinearMMConfig
    off = CastConfig(scaling_type=ScalingType.DISABLED)
    config = Float8LinearConfig(cast_config_input=off, cast_config_weight=off, cast_config_grad_output=off)
    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, 32, dtype=torch.bfloat16, requires_grad=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        matmul_with_hp_or_float8_args.apply(x, w.t(), LinearMMConfig(), config)
    assert float8 is not None and len(kept) == 2
    assert kept[0].dtype == torch.bfloat16 and kept[0].data_ptr() == x.data_ptr()
    assert kept[1].data_ptr() == w.data_ptr()                      # the parameter, no new bytes
    assert fp8_linear(64, 32, 48).saved == kept[0].numel() * kept[0].element_size()
