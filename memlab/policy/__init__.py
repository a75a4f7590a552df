"""What a target device does with a training step's tensors: one source for both lenses.

The simulation runs on fake *CPU* tensors (fake CUDA aborts a CPU-only torch build), and the
estimate is a formula; both used to follow the CPU's rules. A GPU differs in three ways, each
written here as a general rule with its source, and used by :mod:`memlab.lenses.simulate` (as
dispatcher overrides and tracker accounting) and by :mod:`memlab.lenses.estimate` (as element sizes):

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
   attention picks the first kernel the card has (:class:`memlab.core.cards.Card`): FlashAttention-2
   for 16-bit inputs from sm80, the memory-efficient kernel for fp32 (and fp16 below sm80),
   else the ``math`` composite (bf16 below sm80) (``priority_order`` in
   ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``: flash,
   efficient, math; recent builds put cuDNN attention first on sm90 with a new cuDNN, which
   saves the same ``(b, h, s)`` statistics): flash saves an
   fp32 log-sum-exp of ``(b, h, s)``, the efficient kernel pads its last dim to a multiple of
   32 (``kAlignLSE`` in ``transformers/cuda/attention.cu``); neither keeps a philox RNG
   state on the device without dropout or graph capture (``flash_attn/flash_api.cpp``,
   ``mha_fwd``: ``seed_t = at::empty({}, at::dtype(at::kLong))``, a host tensor). The flash
   backward allocates ``dq_accum`` ``(b, round(s, 128), h, round(d, 32))`` and ``softmax_d``
   ``(b, h, round(s, 128))`` in fp32 inside the kernel, and with grouped-query attention
   ``dk``/``dv`` expanded to every query head (``mha_bwd``).
3. **Memory the dispatcher never sees** (category ``workspace``): a cuBLAS and a cuBLASLt
   workspace for each thread that runs a matmul (their sizes written once, in
   :func:`memlab.core.cards.cublas_workspace_bytes` and :func:`memlab.core.cards.cublaslt_workspace_bytes`),
   two such threads in a training step (the caller's for forward, the autograd engine's device
   thread for backward), and the model of cuDNN's per-call convolution workspace: both in
   :mod:`memlab.policy.workspaces`, with their sources.

Finally the CUDA caching allocator rounds every block up to a multiple of 512 bytes
(``kMinBlockSize`` in ``c10/cuda/CUDACachingAllocator.cpp``), which :class:`TargetAccounting`
applies to every storage.

The rules live in one module each: :mod:`.autocast` (op lists), :mod:`.elements` (element
sizes for the estimate), :mod:`.kernels` (kernels that save or allocate differently, the
attention kernel per card), :mod:`.workspaces` (workspaces and blocks), :mod:`.target` (the
target and its tracker accounting, which card it is for) and :mod:`.emulation` (the
dispatcher overrides of the simulation).
"""
from __future__ import annotations

from memlab.policy.autocast import AUTOCAST, CPU_AUTOCAST, CUDA_AUTOCAST, AutocastPolicy
from memlab.policy.elements import (
                       activation_copies,
                       attention_probs_bytes,
                       cross_entropy_moments,
                       norm_saves,
                       op_bytes,
                       precision_bytes,
)
from memlab.policy.emulation import emulate
from memlab.policy.kernels import (
                       layer_norm_stat_bytes,
                       rms_norm_fused,
                       sdpa_backend,
                       sdpa_backward_workspace,
                       sdpa_dtype,
                       sdpa_lse_bytes,
                       sdpa_math_extra_bytes,
                       target_card,
                       target_name,
)
from memlab.policy.target import TARGETS, Target, TargetAccounting, get_target, resolve_target
from memlab.policy.workspaces import (
                       CUDA_BLOCK_BYTES,
                       MATMUL_THREADS,
                       conv_workspace,
                       cublas_workspace_bytes,
                       cublaslt_workspace_bytes,
)

__all__ = ["AUTOCAST", "AutocastPolicy", "CPU_AUTOCAST", "CUDA_AUTOCAST", "CUDA_BLOCK_BYTES",
           "MATMUL_THREADS", "TARGETS", "Target", "TargetAccounting", "activation_copies",
           "attention_probs_bytes", "conv_workspace", "cross_entropy_moments",
           "cublas_workspace_bytes", "cublaslt_workspace_bytes", "emulate", "get_target",
           "layer_norm_stat_bytes", "norm_saves", "op_bytes", "precision_bytes", "resolve_target",
           "rms_norm_fused", "sdpa_backend", "sdpa_backward_workspace", "sdpa_dtype",
           "sdpa_lse_bytes", "sdpa_math_extra_bytes", "target_card", "target_name"]
