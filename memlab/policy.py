"""What a target device does with a training step's tensors: one source for both lenses.

The simulation runs on fake *CPU* tensors (fake CUDA aborts a CPU-only torch build), and the
estimate is a formula; both used to follow the CPU's rules. A GPU differs in three ways, each
written here as a general rule with its source, and used by :mod:`memlab.simulate` (as
dispatcher overrides and tracker accounting) and by :mod:`memlab.estimate` (as element sizes):

1. **Autocast op lists.** :data:`CUDA_AUTOCAST` and :data:`CPU_AUTOCAST` are the cast policies
   PyTorch registers for the ``AutocastCUDA`` and ``AutocastCPU`` dispatch keys, copied from
   ``aten/src/ATen/autocast_mode.h`` (macros ``AT_FORALL_LOWER_PRECISION_FP``,
   ``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``,
   ``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE``, ``AT_FORALL_PROMOTE``) and
   ``aten/src/ATen/autocast_mode.cpp`` (``TORCH_LIBRARY_IMPL(aten, Autocast, m)`` and
   ``TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)``), torch 2.11-2.13. CUDA runs softmax,
   log_softmax, layer_norm, rms_norm, group_norm, nll_loss and upsampling in fp32; CPU does
   not, but runs ``cross_entropy_loss`` whole in fp32 (CUDA decomposes it, and its
   ``log_softmax`` keeps the logits' 16-bit dtype because ``cross_entropy_loss`` passes it
   explicitly: ``aten/src/ATen/native/LossNLL.cpp``). :func:`emulate` installs CUDA's policy
   on the ``AutocastCPU`` key for the duration of a simulation, so casts happen above
   autograd and autograd saves the cast tensors as it would on the GPU, the weight-cast
   cache included (``cached_cast`` in ``autocast_mode.cpp``).
2. **Kernels that save or allocate differently.** LayerNorm's saved mean and rstd are fp32
   for 16-bit inputs on CUDA, in the input dtype on CPU (``layer_norm_cuda`` in
   ``aten/src/ATen/native/cuda/layer_norm_kernel.cu``). ``rms_norm`` calls
   ``_fused_rms_norm``, which has a CUDA kernel saving only input and ``rstd`` (on CPU it is
   the composite that also saves ``x * rstd``; ``rms_norm_symint`` in
   ``aten/src/ATen/native/layer_norm.cpp``).
   ``softmax``/``log_softmax`` of a half input asked for float output run as one
   ``half_to_float`` kernel on CUDA (``aten/src/ATen/native/SoftMax.cpp``). Scaled dot-product
   attention picks FlashAttention-2 for 16-bit inputs and the memory-efficient kernel for fp32
   (``priority_order`` in ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``: flash,
   efficient, math; recent builds put cuDNN attention first on sm90 with a new cuDNN, which
   saves the same ``(b, h, s)`` statistics): flash saves an
   fp32 log-sum-exp of ``(b, h, s)``, the efficient kernel pads its last dim to a multiple of
   32 (``kAlignLSE`` in ``transformers/cuda/attention.cu``); neither keeps a philox RNG
   state on the device without dropout or graph capture (``flash_attn/flash_api.cpp``,
   ``mha_fwd``: ``seed_t = at::empty({}, at::dtype(at::kLong))``, a host tensor). The flash
   backward allocates ``dq_accum`` ``(b, round(s, 128), h, round(d, 32))`` and ``softmax_d``
   ``(b, h, round(s, 128))`` in fp32 inside the kernel, and with grouped-query attention
   ``dk``/``dv`` expanded to every query head (``mha_bwd``).
3. **Memory the dispatcher never sees** (category ``workspace``). Each thread that runs a
   matmul gets a cuBLAS workspace from the caching allocator: ``CUBLAS_WORKSPACE_CONFIG``,
   else 4096 KiB x 8 = 32 MiB on sm90 (Hopper) and 4096 KiB x 2 + 16 KiB x 8 elsewhere,
   plus a cuBLASLt workspace of ``CUBLASLT_WORKSPACE_SIZE`` KiB (default 1024)
   (``aten/src/ATen/cuda/CublasHandlePool.cpp``; cuBLAS docs, ``cublasSetWorkspace``: 32 MiB
   recommended on Hopper). A training step has two such threads (the caller's for forward
   and the autograd engine's device thread for backward), so 66 MiB on an H100/H200: the
   reference H200 kept 64-66 MiB allocated after every step. cuDNN convolutions take a
   workspace for the call; its size depends on the algorithm its heuristics pick, which is
   not knowable offline. The stated model: the explicit-GEMM algorithm's buffer, the im2col
   matrix of one image (``C_in k_h k_w`` x ``H_out W_out`` elements; cuDNN API reference,
   ``cudnnConvolutionFwdAlgo_t``: ``CUDNN_CONVOLUTION_FWD_ALGO_GEMM`` "needs a significant
   memory workspace to store the matrix that holds the input tensor data"), none for a 1x1
   stride-1 convolution, held during the convolution and its backward.

Finally the CUDA caching allocator rounds every block up to a multiple of 512 bytes
(``kMinBlockSize`` in ``c10/cuda/CUDACachingAllocator.cpp``), which :class:`TargetAccounting`
applies to every storage.
"""
from __future__ import annotations

import contextlib
import os
import re
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.utils._pytree import tree_map_only

from .states import PLAIN
from .tracking import DeviceAccounting
from .errors import InputError

TARGETS = ("cuda", "cpu")


# --------------------------------------------------------------------------------------
# 1. Autocast op lists
# --------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------
# 2. Kernels
# --------------------------------------------------------------------------------------
def sdpa_backend(target: str, elem_bytes: int, head_dim: int, last_dim_contiguous: bool = True) -> str:
    """The fused attention kernel a device runs for ``F.scaled_dot_product_attention``.

    All fused kernels need the last dim of q, k, v contiguous (else ``math``, the composite
    with a materialised score matrix, on both devices). CUDA tries FlashAttention-2 first
    (16-bit inputs, head dim a multiple of 8 up to 256), then the memory-efficient kernel
    (``sdp_utils.cpp``: ``priority_order``, ``check_last_dim_stride_equals_1_dense``,
    ``check_head_dim_size_flash``); CPU runs its own flash kernel for any float dtype.
    """
    if not last_dim_contiguous:
        return "math"
    if target == "cpu":
        return "cpu_flash"
    if elem_bytes == 2 and head_dim % 8 == 0 and head_dim <= 256:
        return "flash"
    return "efficient"


def sdpa_lse_bytes(backend: str, batch: int, heads: int, seq: int) -> int:
    """The fp32 log-sum-exp a fused attention kernel saves for backward (the philox RNG
    state of the CUDA kernels is a host tensor without dropout: 0 device bytes)."""
    if backend == "math":
        return 0
    rows = -(-seq // 32) * 32 if backend == "efficient" else seq  # kAlignLSE = 32
    return 4 * batch * heads * rows


def sdpa_backward_workspace(backend: str, batch: int, heads: int, seq: int, head_dim: int,
                            kv_heads: int | None = None, elem_bytes: int = 2) -> int:
    """Bytes FlashAttention-2's backward allocates inside the kernel (``mha_bwd``):
    ``dq_accum`` and ``softmax_d`` in fp32, sequence rounded to 128 and head dim to 32, and
    for grouped-query attention (``kv_heads < heads``) ``dk`` and ``dv`` expanded to all
    query heads before they are summed per group."""
    if backend != "flash":
        return 0
    s128, d32 = -(-seq // 128) * 128, -(-head_dim // 32) * 32
    total = 4 * (batch * s128 * heads * d32 + batch * heads * s128)
    if kv_heads is not None and kv_heads != heads:
        total += 2 * batch * seq * heads * head_dim * elem_bytes
    return total


def conv_workspace(in_channels: int, kernel: tuple[int, ...], out_spatial: tuple[int, ...],
                   stride: tuple[int, ...], elem_bytes: int) -> int:
    """Modelled cuDNN workspace of one convolution call: the im2col matrix of one image
    (``C_in * prod(kernel)`` x ``prod(out_spatial)`` elements); a 1x1 stride-1 convolution
    is a plain GEMM and needs none. A transposed convolution lowers the other side: pass its
    output channels and its input's spatial size (the col2im matrix has the same shape).
    See the module docstring for why this is a model."""
    n_kernel, n_out = 1, 1
    for k in kernel:
        n_kernel *= k
    for o in out_spatial:
        n_out *= o
    if n_kernel == 1 and all(s == 1 for s in stride):
        return 0
    return in_channels * n_kernel * n_out * elem_bytes


def layer_norm_stat_bytes(target: str, elem_bytes: int) -> int:
    """Bytes per row of LayerNorm's saved mean and rstd: CUDA keeps them in the
    accumulation type, fp32 for 16-bit inputs (``layer_norm_cuda`` in
    ``aten/src/ATen/native/cuda/layer_norm_kernel.cu``); the CPU kernel in the input's."""
    return 4 if target == "cuda" else elem_bytes


def rms_norm_fused(target: str) -> bool:
    """Whether ``rms_norm`` runs as one kernel saving only its input and ``rstd``."""
    return target == "cuda"


# --------------------------------------------------------------------------------------
# The same rules as element sizes, for the estimate
# --------------------------------------------------------------------------------------
def precision_bytes(precision: str) -> tuple[int, int, int | None]:
    """``(parameter, compute, autocast)`` bytes per element of a precision (parameters as
    :data:`memlab.states.PLAIN` keeps them): autocast's dtype is ``None`` when autocast is
    off (fp32, pure-bf16), and matmuls compute in it when on."""
    autocast = {"fp32": None, "bf16": 2, "fp16": 2, "pure-bf16": None}
    if precision not in autocast:
        raise InputError(f"precision={precision!r}; allowed: {', '.join(autocast)}")
    param = PLAIN[precision][0]
    return param, autocast[precision] or param, autocast[precision]


def op_bytes(target: str, op: str, input_bytes: int, precision: str,
             explicit_dtype_bytes: int | None = None) -> int:
    """Bytes per element an op computes (and returns) in on a target, by its autocast list."""
    _, _, lower = precision_bytes(precision)
    if lower is None:
        return input_bytes if explicit_dtype_bytes is None else explicit_dtype_bytes
    return AUTOCAST[target].run_dtype(op, input_bytes, lower, explicit_dtype_bytes)


def attention_probs_bytes(target: str, precision: str) -> int:
    """Bytes per score that materialised attention (``softmax(q k^T) @ v``) keeps for
    backward: softmax's output in the dtype softmax runs in, plus the cast copy the
    following matmul saves when that dtype is not the matmul's."""
    _, compute, lower = precision_bytes(precision)
    probs = op_bytes(target, "softmax.int", compute, precision)
    matmul_in = op_bytes(target, "matmul", probs, precision)
    return probs + (matmul_in if matmul_in != probs else 0)


def cross_entropy_moments(target: str, precision: str) -> list[tuple[str, int, int]]:
    """Bytes per logit alive at each moment of the loss, as ``(moment, saved, scratch)``:
    what the forward saved and is still held, and the other tensors in flight.

    ``F.cross_entropy`` is ``log_softmax(x, dtype=x.dtype)`` then ``nll_loss``
    (``LossNLL.cpp``). Autocast may run it whole in fp32 (CPU's list has
    ``cross_entropy_loss``: ``x`` is an fp32 copy of the logits), or run log_softmax in the
    logits' dtype (its dtype is explicit, so ``fp32_set_opt_dtype`` keeps it) and cast its
    output to fp32 for ``nll_loss`` (CUDA), which saves that copy.
    """
    _, logits, _ = precision_bytes(precision)
    x = op_bytes(target, "cross_entropy_loss", logits, precision)   # the composite's input
    lsm = op_bytes(target, "log_softmax.int", x, precision, explicit_dtype_bytes=x)
    nll = op_bytes(target, "nll_loss", lsm, precision)
    copy = nll if nll != lsm else 0     # a cast copy for nll_loss, saved by it
    upcast = x if x != logits else 0    # the composite's own input cast
    moments = [("loss forward", lsm + copy, logits + upcast),  # at nll_loss: logits still held
               ("loss backward", lsm + copy, nll)]             # NllLossBackward: its gradient
    if copy:
        moments.append(("loss backward, cast", lsm, nll + lsm))   # gradient cast back
    moments.append(("log-softmax backward", lsm, 2 * lsm))        # gradients in and out
    if upcast:
        moments.append(("loss input cast backward", 0, x + logits))
    return moments


def activation_copies(precision: str, consumers: int) -> int:
    """Copies of an fp32 activation that matmuls reading it save: under autocast each
    call casts its input anew (``cached_cast`` caches only leaf tensors that require grad,
    i.e. weights), so one per consumer; without autocast the tensor itself, once."""
    return consumers if precision_bytes(precision)[2] is not None else 1


def norm_saves(target: str, norm: str, input_bytes: int) -> tuple[bool, int, int]:
    """What a norm keeps for backward beyond its output: ``(keeps its input, bytes per
    element, bytes per row)``. LayerNorm: its input, mean and rstd. RMSNorm fused (CUDA): its
    input and an fp32 rstd. RMSNorm composite (CPU): ``x * rstd`` and rstd in fp32, and
    the input itself or, for a 16-bit input, its fp32 upcast instead."""
    if norm == "layernorm":
        return True, 0, 2 * layer_norm_stat_bytes(target, input_bytes)
    if rms_norm_fused(target):
        return True, 0, 4
    if input_bytes == 2:
        return False, 4 + 4, 4
    return True, 4, 4


# Compute capability of the GPU presets of :mod:`memlab.hardware` (NVIDIA's CUDA GPUs list).
PRESET_CAPABILITY = {"T4-16GB": (7, 5), "RTX4090-24GB": (8, 9), "A100-40GB": (8, 0),
                     "A100-80GB": (8, 0), "H100-80GB": (9, 0), "H200-141GB": (9, 0)}
DEFAULT_CAPABILITY = (9, 0)  # the reference GPU's (H200)


def cublas_workspace_bytes(capability: tuple[int, int] = DEFAULT_CAPABILITY,
                           env: dict[str, str] | None = None) -> int:
    """cuBLAS workspace of one (handle, stream), as torch chooses it: ``CUBLAS_WORKSPACE_CONFIG``
    (``:SIZE_KiB:COUNT`` pairs, summed) if set, else 32 MiB on sm90 and 8 MiB + 128 KiB
    otherwise (``parseChosenWorkspaceSize`` in ``CublasHandlePool.cpp``)."""
    env = os.environ if env is None else env
    default = 4096 * 8 * 1024 if tuple(capability) == (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    if not config:
        return default
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    return sum(int(size) * 1024 * int(count) for size, count in pairs) if pairs else default


def cublaslt_workspace_bytes(env: dict[str, str] | None = None) -> int:
    """cuBLASLt workspace of one (handle, stream): ``CUBLASLT_WORKSPACE_SIZE`` KiB, default
    1024 (``parseCUDABlasLtWorkspaceSize``)."""
    env = os.environ if env is None else env
    try:
        return int(env.get("CUBLASLT_WORKSPACE_SIZE", "1024")) * 1024
    except ValueError:
        return 1024 * 1024


MATMUL_THREADS = 2  # the caller's thread (forward) and the autograd device thread (backward)
CUDA_BLOCK_BYTES = 512  # kMinBlockSize of the CUDA caching allocator


# --------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """A device the step is predicted for: its autocast policy, kernels and allocator."""

    name: str
    autocast: AutocastPolicy
    block_bytes: int = 1
    capability: tuple[int, int] | None = None

    @property
    def is_cuda(self) -> bool:
        return self.name == "cuda"

    def resident_workspace(self) -> int:
        """Workspace bytes allocated before the step and kept through it."""
        if not self.is_cuda:
            return 0
        return MATMUL_THREADS * (cublas_workspace_bytes(self.capability) + cublaslt_workspace_bytes())

    def block(self, nbytes: int) -> int:
        """Bytes the device's allocator takes for a tensor of ``nbytes``."""
        b = self.block_bytes
        return nbytes if b <= 1 or nbytes == 0 else -(-nbytes // b) * b

    def accounting(self) -> DeviceAccounting:
        """The tracker's view of this device (see :class:`TargetAccounting`)."""
        return TargetAccounting(self) if self.is_cuda else DeviceAccounting()


def get_target(name: str = "cuda", budget: int | str | None = None) -> Target:
    """The target named ``cuda`` or ``cpu``. For CUDA, a GPU preset given as the budget
    (``"T4-16GB"``) sets the compute capability that sizes the cuBLAS workspace; otherwise
    the reference H200's (sm90)."""
    if name not in TARGETS:
        raise InputError(f"target={name!r}; allowed: {', '.join(TARGETS)}")
    if name == "cpu":
        return Target("cpu", CPU_AUTOCAST)
    cap = PRESET_CAPABILITY.get(budget, DEFAULT_CAPABILITY) if isinstance(budget, str) else DEFAULT_CAPABILITY
    return Target("cuda", CUDA_AUTOCAST, CUDA_BLOCK_BYTES, cap)


# --------------------------------------------------------------------------------------
# The tracker's accounting for a CUDA target
# --------------------------------------------------------------------------------------
_aten = torch.ops.aten


class TargetAccounting(DeviceAccounting):
    """Bytes as the CUDA caching allocator would hold them for a step run on fake CPU
    tensors: 512-byte blocks, the cuBLAS workspaces, per-call cuDNN and flash-backward
    workspaces, and CUDA's attention log-sum-exp."""

    def __init__(self, target: Target):
        self.target = target

    def block_bytes(self, nbytes: int) -> int:
        return self.target.block(nbytes)

    def resident_workspace(self) -> int:
        return self.target.resident_workspace()

    def output_bytes(self, func, outputs: list, index: int, nbytes: int) -> int:
        if func is _aten._scaled_dot_product_flash_attention_for_cpu.default and index == 1:
            out, lse = outputs[0], outputs[1]
            b, h, s = lse.shape
            backend = sdpa_backend("cuda", out.element_size(), out.shape[-1])
            return sdpa_lse_bytes(backend, b, h, s)
        if func is _aten.native_layer_norm.default and index in (1, 2):
            return outputs[index].numel() * layer_norm_stat_bytes("cuda", outputs[0].element_size())
        return nbytes

    def op_workspace(self, func, args, kwargs, out) -> int:
        if func is _aten.convolution.default:
            x, w, y = args[0], args[1], out
        elif func is _aten.convolution_backward.default:
            x, w, y = args[1], args[2], args[0]  # input, weight, gradient of the output
        else:
            x = None
        if x is not None:
            forward = func is _aten.convolution.default
            stride, transposed = (args[3], args[6]) if forward else (args[4], args[7])
            # a transposed convolution's lowering is its forward twin's: channels of its
            # output, positions of its input
            lowered, positions = (y, x) if transposed else (x, y)
            return conv_workspace(lowered.shape[1], tuple(w.shape[2:]), tuple(positions.shape[2:]),
                                  tuple(stride), x.element_size())
        if func is _aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
            q, k = args[1], args[2]
            b, h, s, d = q.shape
            backend = sdpa_backend("cuda", q.element_size(), d)
            return sdpa_backward_workspace(backend, b, h, s, d, k.shape[1], q.element_size())
        return 0


# --------------------------------------------------------------------------------------
# Emulating CUDA's autocast and kernels on CPU tensors
# --------------------------------------------------------------------------------------
_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
_lock = threading.Lock()
_active = 0
_library: torch.library.Library | None = None


def _op(name: str):
    base, _, overload = name.partition(".")
    return getattr(getattr(_aten, base), overload or "default")


def _eligible(t) -> bool:
    # is_autocast_eligible + is_eligible: a floating tensor, never double
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


class _CastCache:
    """``cached_cast`` of autocast_mode.cpp: casts of fp32 leaf weights to the autocast
    dtype are kept until the outermost autocast region exits."""

    def __init__(self):
        self._casts: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def cast(self, t, dtype: torch.dtype):
        if not _eligible(t) or t.dtype == dtype:
            return t
        lower = torch.get_autocast_dtype("cpu")
        if (dtype == lower and t.dtype == torch.float32 and t.requires_grad and t.is_leaf
                and not t._is_view() and torch.is_autocast_cache_enabled()):
            hit = self._casts.get(id(t))
            if hit is not None and hit[0]() is t:
                return hit[1]
            cast = t.to(dtype)
            self._casts[id(t)] = (weakref.ref(t), cast)
            return cast
        return t.to(dtype)

    def clear(self) -> None:
        self._casts.clear()


_cache = _CastCache()
_original_clear = torch.clear_autocast_cache


def _clear_autocast_cache() -> None:
    # torch.autocast.__exit__ calls torch.clear_autocast_cache() when the outermost region
    # ends; our casts follow the same lifetime
    _original_clear()
    _cache.clear()


def _lower_kernel(op):
    def kernel(*args, **kwargs):
        dtype = torch.get_autocast_dtype("cpu")
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            args, kwargs = tree_map_only(torch.Tensor, lambda t: _cache.cast(t, dtype), (args, kwargs))
            return op(*args, **kwargs)
    return kernel


def _fp32_kernel(op):
    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            args, kwargs = tree_map_only(torch.Tensor, lambda t: _cache.cast(t, torch.float32),
                                         (args, kwargs))
            return op(*args, **kwargs)
    return kernel


def _promote_kernel(op):
    def kernel(*args, **kwargs):
        lower = torch.get_autocast_dtype("cpu")
        widest = lower
        for t in torch.utils._pytree.tree_leaves((args, kwargs)):
            if _eligible(t):
                if widest == torch.float32 or t.dtype == torch.float32:
                    widest = torch.float32
                elif t.dtype != lower:
                    raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            args, kwargs = tree_map_only(torch.Tensor, lambda t: _cache.cast(t, widest), (args, kwargs))
            return op(*args, **kwargs)
    return kernel


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor)


def _set_opt_dtype_kernel(op, name: str):
    index = [a.name for a in op._schema.arguments].index("dtype")
    kw_only = op._schema.arguments[index].kwarg_only
    softmax = name in ("softmax.int", "log_softmax.int")

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            if not _eligible(args[0]):
                return op(*args, **kwargs)
            given = kwargs.get("dtype") if (kw_only or len(args) <= index) else args[index]
            if given is not None:
                return op(*args, **kwargs)
            x = args[0]
            if softmax and x.dtype == torch.float16 and _is_fake(x):
                # SoftMax.cpp: CUDA runs half -> float in one kernel (half_to_float), whose
                # backward returns a half gradient; CPU kernels lack it, fake tensors do not.
                fused = _aten._softmax if name == "softmax.int" else _aten._log_softmax
                return fused.default(x, args[1], True)
            if kw_only or len(args) <= index:
                kwargs = {**kwargs, "dtype": torch.float32}
            else:
                args = (*args[:index], torch.float32, *args[index + 1:])
            return op(*args, **kwargs)
    return kernel


def _append_dtype_kernel(target_name: str):
    target = _op(target_name)

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            out_type = torch.float32 if _eligible(args[0]) else args[0].dtype
            return target(*args, **kwargs, dtype=out_type)
    return kernel


def _banned_kernel(*args, **kwargs):
    raise RuntimeError("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe "
                       "to autocast; use binary_cross_entropy_with_logits (autocast_mode.cpp)")


class _FusedRMSNorm(torch.autograd.Function):
    """``_fused_rms_norm`` as CUDA registers it: one kernel, saving input and ``rstd``."""

    @staticmethod
    def forward(ctx, x, shape, weight, eps):
        if _is_fake(x):
            # the CUDA kernel allocates its two outputs and nothing else
            k = len(shape)
            acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
            rstd = x.new_empty((*x.shape[:x.dim() - k], *([1] * k)), dtype=acc)
        else:
            out, rstd = _aten._fused_rms_norm.default(x, shape, weight, eps)
        ctx.save_for_backward(x, rstd, weight)
        ctx.shape, ctx.eps = shape, eps
        return out

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        want_w = weight is not None and ctx.needs_input_grad[2]
        if _is_fake(x):
            gx, gw = _aten._fused_rms_norm_backward.default(grad, x, ctx.shape, rstd, weight,
                                                             [True, want_w])
        else:  # the CPU build has no backward kernel for it: differentiate the composite
            with torch.enable_grad():
                xd = x.detach().requires_grad_()
                wd = weight.detach().requires_grad_() if want_w else weight
                y = _aten._fused_rms_norm.default(xd, ctx.shape, wd, ctx.eps)[0]
                grads = torch.autograd.grad(y, [xd, wd] if want_w else [xd], grad)
            gx, gw = grads[0], (grads[1] if want_w else None)
        return gx, None, gw if want_w else None, None


def _channels_last(x: torch.Tensor) -> bool:
    # Tensor::suggest_memory_format: channels-last strides on a tensor that is not contiguous
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    return fmt is not None and not x.is_contiguous() and x.is_contiguous(memory_format=fmt)


def _rms_norm_kernel(x, normalized_shape, weight=None, eps=None):
    fused = (not x.is_complex() and not _channels_last(x)
             and (weight is None or weight.dtype == x.dtype))
    if not fused:  # layer_norm.cpp: mixed dtypes, complex, channels-last take the composite
        return _aten.rms_norm.default.decompose(x, normalized_shape, weight, eps)
    return _FusedRMSNorm.apply(x, list(normalized_shape), weight, eps)


def _registered(key: str) -> set[str]:
    return {n[len("aten::"):] for n in torch._C._dispatch_get_all_op_names()
            if n.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(n, key)}


def _install(target: Target) -> torch.library.Library:
    lib = torch.library.Library("aten", "IMPL")
    policy = target.autocast
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
        for name in sorted(policy.ops):
            rule = policy.rule(name)
            if rule == "fp32_append_dtype":
                kernel = _append_dtype_kernel(dict(policy.fp32_append_dtype)[name])
            elif rule == "banned":
                kernel = _banned_kernel
            elif rule == "fp32_set_opt_dtype":
                kernel = _set_opt_dtype_kernel(_op(name), name)
            else:
                make = {"lower_precision_fp": _lower_kernel, "fp32": _fp32_kernel,
                        "promote": _promote_kernel}[rule]
                kernel = make(_op(name))
            lib.impl(name, kernel, "AutocastCPU")
        # ops CPU autocast casts and the target does not: no cast at all
        for name in sorted(_registered("AutocastCPU") - policy.ops):
            lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
        if rms_norm_fused(target.name):
            lib.impl("rms_norm", _rms_norm_kernel, "AutogradCPU")
    return lib


@contextlib.contextmanager
def emulate(target: Target | str) -> Iterator[Target]:
    """Run CPU tensors under a target's autocast policy and kernels while inside.

    For ``cuda``: CUDA's cast lists replace CPU autocast's on the ``AutocastCPU`` key (casts
    recorded by autograd, weight casts cached until the outermost autocast exits) and
    ``rms_norm`` runs as the fused CUDA kernel. Everything is removed on exit, also after an
    exception; for ``cpu`` nothing changes. The overrides are process-wide while active.
    """
    global _active, _library
    target = get_target(target) if isinstance(target, str) else target
    if not target.is_cuda:
        yield target
        return
    with _lock:
        _active += 1
        if _active == 1:
            try:
                _library = _install(target)
            except BaseException:
                _active -= 1
                raise
            torch.clear_autocast_cache = _clear_autocast_cache
    try:
        yield target
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                torch.clear_autocast_cache = _original_clear
                _library._destroy()
                _library = None
                _cache.clear()


__all__ = ["activation_copies", "attention_probs_bytes", "cross_entropy_moments", "norm_saves", "op_bytes",
           "precision_bytes", "AutocastPolicy", "AUTOCAST", "CPU_AUTOCAST", "CUDA_AUTOCAST", "Target", "TARGETS",
           "TargetAccounting", "conv_workspace", "cublas_workspace_bytes",
           "cublaslt_workspace_bytes", "emulate", "get_target", "layer_norm_stat_bytes", "rms_norm_fused", "sdpa_backend",
           "sdpa_backward_workspace", "sdpa_lse_bytes", "PRESET_CAPABILITY"]
