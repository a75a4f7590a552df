"""Activation offloading: every tensor autograd saves in forward copied to host memory and
brought back for backward (``torch.autograd.graph.save_on_cpu``; torchtune's
``OffloadActivations`` adds streams to overlap the copies).

What each lens counts, precisely:

* On a CUDA device (measure) the step runs ``save_on_cpu(pin_memory=True)``: each saved
  tensor is copied into its own pinned host tensor (views, and weights a matmul saves, are
  copied too: one copy per saved tensor, not per storage) and the device tensor is dropped
  unless something else holds it. Device bytes saved: the saved tensors nothing else holds;
  host bytes added: every saved tensor's own size, until backward unpacks it.
* On a CPU device the host *is* the device: ``save_on_cpu`` packs with ``tensor.cpu()``,
  which returns the tensor itself, so the real step moves nothing and its peak is the plain
  step's, byte for byte (``tests/test_activation_offload.py`` holds this).
* The simulation of a CUDA target runs the step on the fake CPU: the hook packs each saved
  tensor into an empty tensor on the ``meta`` device, which the tracker counts as host bytes
  (another device type), and unpacks it into a new device tensor in backward, as
  ``save_on_cpu`` does; its ``host_bytes`` are the bytes the copies move each way over PCIe.
* The estimate does not model it for an eager step (it says so in its notes): which tensors a
  matmul saves beside the activations (its weight, views of one storage) is the simulation's to
  count. A compiled step's estimate traces its pass under the simulation's hooks
  (:func:`memlab.lenses.estimate.compiled_pass_bytes`), so its device bytes are the offloaded step's.
"""
from __future__ import annotations

import contextlib

import torch


def _pack_to_meta(tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
    return tensor.device, torch.empty(tensor.size(), dtype=tensor.dtype, device="meta")


def _unpack_from_meta(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
    device, t = packed
    return torch.empty(t.size(), dtype=t.dtype, device=device)


def offload_context(device: torch.device, *, to_host: bool, fake: bool = False) -> contextlib.AbstractContextManager:
    """The saved-tensor hooks of an offloaded forward.

    Args:
        device: the step's device.
        to_host: whether saved tensors leave the device (a CUDA device, or a simulated CUDA target).
        fake: the step runs on fake tensors (the simulation): pack onto ``meta``, counted as host.

    Returns:
        A context manager to run the forward in.
    """
    if fake and to_host:
        return torch.autograd.graph.saved_tensors_hooks(_pack_to_meta, _unpack_from_meta)
    return torch.autograd.graph.save_on_cpu(pin_memory=to_host and device.type == "cuda")


def saved_bytes(fn) -> int:
    """Bytes ``save_on_cpu`` would copy to the host for one call of ``fn`` (a forward): every
    tensor autograd saves, each at its own size (numel x element size), counted by hooks that
    keep the tensor itself. The independent count the simulation's host bytes are checked by."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


__all__ = ["offload_context", "saved_bytes"]
