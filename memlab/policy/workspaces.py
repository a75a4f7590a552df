"""Memory the dispatcher never sees (category ``workspace``), and the allocator's blocks.

Each thread that runs a matmul gets a cuBLAS workspace from the caching allocator, its size
a rule of the card's capability (:func:`memlab.core.cards.cublas_workspace_bytes`, from
``aten/src/ATen/cuda/CublasHandlePool.cpp``; cuBLAS docs, ``cublasSetWorkspace``: 32 MiB
recommended on Hopper). A training step has two such threads (the caller's for forward and
the autograd engine's device thread for backward), so 66 MiB on an H100/H200: the reference
H200 kept 64-66 MiB allocated after every step. cuDNN convolutions take a workspace for the
call; its size depends on the algorithm its heuristics pick, which is not knowable offline.
The stated model: the explicit-GEMM algorithm's buffer, the im2col matrix of one image
(``C_in k_h k_w`` x ``H_out W_out`` elements; cuDNN API reference,
``cudnnConvolutionFwdAlgo_t``: ``CUDNN_CONVOLUTION_FWD_ALGO_GEMM`` "needs a significant memory
workspace to store the matrix that holds the input tensor data"), none for a 1x1 stride-1
convolution, held during the convolution and its backward.

The CUDA caching allocator rounds every block up to a multiple of 512 bytes
(``kMinBlockSize`` in ``c10/cuda/CUDACachingAllocator.cpp``).
"""
from __future__ import annotations

from memlab.core.cards import cublas_workspace_bytes, cublaslt_workspace_bytes
from memlab.policy.caching_allocator import kMinBlockSize


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


MATMUL_THREADS = 2  # the caller's thread (forward) and the autograd device thread (backward)
CUDA_BLOCK_BYTES = kMinBlockSize  # of the CUDA caching allocator (memlab.policy.caching_allocator)


__all__ = ["CUDA_BLOCK_BYTES", "MATMUL_THREADS", "conv_workspace", "cublas_workspace_bytes",
           "cublaslt_workspace_bytes"]
