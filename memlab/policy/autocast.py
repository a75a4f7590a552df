"""Autocast op lists: the cast policies PyTorch registers for the ``AutocastCUDA`` and
``AutocastCPU`` dispatch keys, copied from ``aten/src/ATen/autocast_mode.h`` (macros
``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``,
``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE``, ``AT_FORALL_PROMOTE``) and
``aten/src/ATen/autocast_mode.cpp`` (``TORCH_LIBRARY_IMPL(aten, Autocast, m)`` and
``TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)``), torch 2.11-2.13. ``tests/test_policy.py`` checks
them against the installed torch's registrations."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AutocastPolicy:
    """One device's autocast cast policies by op overload (``"softmax.int"``, ``"linear"``).

    ``lower_precision_fp``: inputs cast to the autocast dtype; ``fp32``: inputs cast to fp32;
    ``fp32_set_opt_dtype``: run in fp32 unless the caller passed a ``dtype``;
    ``fp32_append_dtype``: overload -> the dtype-taking overload it redispatches to;
    ``promote``: inputs cast to the widest floating type among them; ``banned``: raises.
    """

    device: str
    lower_precision_fp: frozenset[str]
    fp32: frozenset[str]
    fp32_set_opt_dtype: frozenset[str] = frozenset()
    fp32_append_dtype: tuple[tuple[str, str], ...] = ()
    promote: frozenset[str] = frozenset()
    banned: frozenset[str] = frozenset()

    def rule(self, op: str) -> str | None:
        """The cast policy of an op overload, or ``None`` when autocast leaves it alone."""
        for name in ("lower_precision_fp", "fp32", "fp32_set_opt_dtype", "promote", "banned"):
            if op in getattr(self, name):
                return name
        return "fp32_append_dtype" if op in dict(self.fp32_append_dtype) else None

    @property
    def ops(self) -> frozenset[str]:
        return (self.lower_precision_fp | self.fp32 | self.fp32_set_opt_dtype | self.promote
                | self.banned | frozenset(dict(self.fp32_append_dtype)))

    def run_dtype(self, op: str, input_bytes: int, lower_bytes: int,
                  explicit_dtype_bytes: int | None = None) -> int:
        """Bytes per element an op computes in under autocast, for a floating input of
        ``input_bytes`` (``lower_bytes``: the autocast dtype). Ops outside the lists run in
        their input's dtype."""
        rule = self.rule(op)
        if rule == "lower_precision_fp":
            return lower_bytes
        if rule in ("fp32", "fp32_append_dtype"):
            return 4
        if rule == "fp32_set_opt_dtype":
            return 4 if explicit_dtype_bytes is None else explicit_dtype_bytes
        return input_bytes if explicit_dtype_bytes is None else explicit_dtype_bytes


def _ops(text: str) -> frozenset[str]:
    return frozenset(text.split())


# autocast_mode.h, AT_FORALL_LOWER_PRECISION_FP, plus autocast_mode.cpp's two cudnn entries
CUDA_AUTOCAST = AutocastPolicy(
    device="cuda",
    lower_precision_fp=_ops("""
        _convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d
        conv_transpose2d.input conv_transpose3d.input convolution prelu addmm addmv addr
        matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm chain_matmul
        linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell
        rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention
        scaled_dot_product_attention cudnn_convolution cudnn_convolution_transpose"""),
    # AT_FORALL_FP32
    fp32=_ops("""
        acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan
        pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm
        rms_norm group_norm frobenius_norm.dim nuclear_norm nuclear_norm.dim cosine_similarity
        poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div
        l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss
        soft_margin_loss triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits
        dist pdist cdist renorm logsumexp upsample_nearest1d _upsample_nearest_exact1d
        upsample_nearest2d _upsample_nearest_exact2d upsample_nearest3d
        _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d
        _upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d
        _upsample_bicubic2d_aa"""),
    # AT_FORALL_FP32_SET_OPT_DTYPE
    fp32_set_opt_dtype=_ops("""
        prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm
        linalg_matrix_norm linalg_matrix_norm.str_ord sum sum.dim_IntList"""),
    # AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE
    fp32_append_dtype=(("norm.Scalar", "norm.ScalarOpt_dtype"),
                       ("norm.ScalarOpt_dim", "norm.ScalarOpt_dim_dtype")),
    # AT_FORALL_PROMOTE
    promote=_ops("addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put "
                 "tensordot scatter_add"),
    banned=_ops("binary_cross_entropy"),
)

# autocast_mode.cpp, TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)
CPU_AUTOCAST = AutocastPolicy(
    device="cpu",
    lower_precision_fp=_ops("""
        conv1d conv1d.padding conv2d conv2d.padding conv3d conv3d.padding bmm mm
        linalg_vecdot baddbmm addmm _addmm_activation addbmm linear _convolution.deprecated
        matmul conv_tbc mkldnn_rnn_layer conv_transpose1d conv_transpose2d.input
        conv_transpose3d.input prelu scaled_dot_product_attention
        _native_multi_head_attention"""),
    fp32=_ops("""
        avg_pool3d binary_cross_entropy grid_sampler polar prod prod.dim_int quantile
        quantile.scalar nanquantile nanquantile.scalar stft stft.center cdist grid_sampler_2d
        _grid_sampler_2d_cpu_fallback grid_sampler_3d trace view_as_complex cholesky
        cholesky_inverse cholesky_solve inverse lu_solve orgqr ormqr pinverse max_pool3d
        max_unpool2d max_unpool3d adaptive_avg_pool3d reflection_pad1d reflection_pad2d
        replication_pad1d replication_pad2d replication_pad3d mse_loss cosine_embedding_loss
        nll_loss nll_loss2d hinge_embedding_loss poisson_nll_loss smooth_l1_loss
        cross_entropy_loss l1_loss huber_loss margin_ranking_loss soft_margin_loss
        triplet_margin_loss multi_margin_loss ctc_loss.IntList ctc_loss.Tensor kl_div
        multilabel_margin_loss binary_cross_entropy_with_logits fft_fft fft_ifft fft_fft2
        fft_ifft2 fft_fftn fft_ifftn fft_rfft fft_irfft fft_rfft2 fft_irfft2 fft_rfftn
        fft_irfftn fft_hfft fft_ihfft linalg_cond linalg_cond.p_str linalg_matrix_rank
        linalg_matrix_rank.tol_tensor linalg_matrix_rank.atol_rtol_tensor
        linalg_matrix_rank.atol_rtol_float linalg_solve linalg_cholesky linalg_svdvals
        linalg_eigvals linalg_eigvalsh linalg_inv linalg_householder_product
        linalg_tensorinv linalg_tensorsolve fake_quantize_per_tensor_affine geqrf
        _lu_with_info qr svd triangular_solve fractional_max_pool2d fractional_max_pool3d
        adaptive_max_pool3d multilabel_margin_loss_forward linalg_qr linalg_cholesky_ex
        linalg_svd linalg_eig linalg_eigh linalg_lstsq linalg_inv_ex"""),
    promote=_ops("stack cat index_copy"),
)

AUTOCAST = {"cuda": CUDA_AUTOCAST, "cpu": CPU_AUTOCAST}


__all__ = ["AUTOCAST", "AutocastPolicy", "CPU_AUTOCAST", "CUDA_AUTOCAST"]
