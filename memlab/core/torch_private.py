"""PyTorch's private APIs that memlab uses, in one place.

Every name below lives under an underscored module or attribute (``torch._C``,
``torch._subclasses``, ``torch.utils._pytree``, ``torch.testing._internal``, ...): PyTorch
promises nothing about them between releases. memlab's modules import them from here, so a
torch upgrade that moves one breaks this file, not ten.

Each entry says which torch versions it was checked on: **2.13** is this repository's CPU
test run (tests/test_torch_private.py exercises every wrapper); **2.11** (2.11.0+cu130) is
the H200 reference run in ``memlab/data/reference/NVIDIA-H200/`` where that run used the
code path (its simulate and measure lenses, its memory snapshot).
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import torch

# Fake tensors: the simulate lens, FSDP2 and tensor parallelism on fake tensors, HF models on
# fake tensors. Checked: 2.11 (H200 simulate rows), 2.13.
# FakeCopyMode: a module's deep copy kept in its fake mode (peft's modules_to_save deep-copies)
from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensor, FakeTensorMode

# The fake process group: importing fake_pg registers the "fake" backend for
# ``dist.init_process_group("fake", store=FakeStore(), ...)`` (rank 0 of N alone).
# Checked: 2.13.
from torch.testing._internal.distributed.fake_pg import FakeStore

# The tracker is a dispatch mode; tensor subclasses (DTensor) are unwrapped to what they hold.
# Checked: 2.11 (H200 measure rows), 2.13.
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, is_traceable_wrapper_subclass

# Pytree over (args, kwargs) of a dispatched op. Checked: 2.11 (H200 simulate rows), 2.13.
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map_only

#: The CPU autocast dispatch key, which the emulation's own kernels step past.
#: Checked: 2.11 (H200 simulate rows), 2.13.
AUTOCAST_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def exclude_dispatch_keys(keys: torch._C.DispatchKeySet) -> contextlib.AbstractContextManager:
    """A guard under which ops skip ``keys`` (``torch._C._ExcludeDispatchKeyGuard``).

    Checked: 2.11 (H200 simulate rows), 2.13.
    """
    return torch._C._ExcludeDispatchKeyGuard(keys)


def aten_ops_with_kernel(key: str) -> set[str]:
    """The aten op names (without ``aten::``) that register a kernel for dispatch key ``key``
    (``torch._C._dispatch_get_all_op_names``, ``_dispatch_has_kernel_for_dispatch_key``).

    Checked: 2.11 (H200 simulate rows), 2.13.
    """
    return {n[len("aten::"):] for n in torch._C._dispatch_get_all_op_names()
            if n.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(n, key)}


def current_autograd_node() -> torch.autograd.graph.Node | None:
    """The autograd node running now, or None outside backward (``torch._C._current_autograd_node``).

    Checked: 2.11 (H200 measure rows), 2.13.
    """
    return torch._C._current_autograd_node()


def in_backward() -> bool:
    """Whether the autograd engine is running a graph task now (``torch._C._current_graph_task_id``).

    Checked: 2.11 (H200 measure rows), 2.13.
    """
    return torch._C._current_graph_task_id() != -1


def op_schema(op: torch._ops.OpOverload) -> torch._C.FunctionSchema:
    """The schema of an aten op overload: its arguments' names, types and which are keyword-only
    (``OpOverload._schema``; the op has no public accessor).

    Checked: 2.11 (H200 simulate rows), 2.13.
    """
    return op._schema


def tensor_version(t: torch.Tensor) -> int:
    """How many in-place writes ``t``'s storage has seen (``Tensor._version``, the counter
    autograd checks saved tensors against).

    Checked: 2.13.
    """
    return t._version


def parse_to(*args, **kwargs) -> tuple[torch.device | None, torch.dtype | None]:
    """The device and dtype a ``Module.to(*args, **kwargs)`` call asks for (``torch._C._nn._parse_to``).

    Checked: 2.13.
    """
    device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
    return device, dtype


def record_memory_history(max_entries: int) -> None:
    """Start recording CUDA allocator events (``torch.cuda.memory._record_memory_history``).

    Checked: 2.11 (the H200 snapshot ``gpt2-small-step.pickle.gz``); on CPU-only 2.13 it is
    never called.
    """
    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def stop_memory_history() -> None:
    """Stop recording CUDA allocator events. Checked: as :func:`record_memory_history`."""
    torch.cuda.memory._record_memory_history(enabled=None)


def dump_memory_snapshot(path: str) -> None:
    """Write the CUDA allocator's snapshot to ``path`` as a pickle
    (``torch.cuda.memory._dump_snapshot``, what ``memory_viz`` reads).

    Checked: as :func:`record_memory_history`.
    """
    torch.cuda.memory._dump_snapshot(path)


def memory_snapshot() -> dict:
    """The CUDA allocator's snapshot (``torch.cuda.memory._snapshot``): segments and traces.

    Checked: as :func:`record_memory_history`.

    A dict because it is torch's own snapshot format (``torch.cuda.memory._snapshot``).
    """
    return torch.cuda.memory._snapshot()


def fsdp2_mem_tracker() -> type:
    """``FSDPMemTracker`` (``torch.distributed._tools.fsdp2_mem_tracker``), imported on first
    use: its module loads FSDP (seconds) and ``import memlab`` does not need it.

    Checked: 2.13.
    """
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    return FSDPMemTracker



def activation_memory_budget(budget: float | None) -> contextlib.AbstractContextManager:
    """``torch._functorch.config.activation_memory_budget`` set for what is compiled inside
    (the min-cut partitioner reads it when AOT autograd partitions a graph, at the first call
    of a compiled module); ``None``: the default (1.0, save what min-cut chooses).
    Checked: 2.13."""
    if budget is None:
        return contextlib.nullcontext()
    import torch._functorch.config as functorch_config
    return functorch_config.patch(activation_memory_budget=budget)


def inductor_backend_seeing_graphs(on_graph) -> object:
    """A ``torch.compile`` backend that is inductor (``compile_fx``) with its inner compile
    step wrapped: ``on_graph(graph_module, is_backward)`` sees each partitioned forward and
    backward graph before inductor compiles it. AOT autograd's cache is bypassed for such a
    backend (so the graphs are always seen). Checked: 2.13 (CPU inductor)."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(gm, example_inputs, **kwargs):
        on_graph(gm, bool(kwargs.get("is_backward")))
        return compile_fx_inner(gm, example_inputs, **kwargs)

    def backend(gm, example_inputs):
        import torch._functorch.config as functorch_config
        with functorch_config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, inner_compile=inner)
    return backend


def reset_compiled() -> None:
    """``torch._dynamo.reset()``: forget every compiled frame. Dynamo reuses a module class's
    compiled code for a new instance (parameters are graph inputs) and does not guard on the
    functorch config, so a model compiled under another activation_memory_budget would run the
    old partition. Checked: 2.13."""
    torch._dynamo.reset()


def aot_inductor_partition(fn, compiler, num_params: int):
    """``aot_function(fn)`` partitioned as ``torch.compile``'s inductor backend partitions a graph:
    inductor's decompositions (``select_decomp_table``) and its ``partition_fn`` (inductor's
    joint-graph passes, then the min-cut partitioner with ``compiler="inductor"``), the first
    ``num_params`` inputs marked static (dynamo marks a module's parameters so, and the
    partitioner then saves them for free). ``compiler(gm, example_inputs)`` receives the
    forward and the backward graph and returns a boxed callable. Works on fake tensors (no
    dynamo, so fake parameters are allowed). Checked: 2.13 (CPU)."""
    from torch._functorch.aot_autograd import aot_function
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.decomposition import select_decomp_table

    def partition(gm, joint_inputs, **kwargs):
        kwargs["static_lifetime_input_indices"] = list(range(num_params))
        return partition_fn(gm, joint_inputs, **kwargs)
    return aot_function(fn, fw_compiler=compiler, bw_compiler=compiler, partition_fn=partition,
                        decompositions=select_decomp_table(), num_params_buffers=num_params)


def outside_dispatch_modes() -> contextlib.AbstractContextManager:
    """Run ops with every dispatch mode (memlab's tracker, the fake mode) off: a fake tensor's
    op still runs fake (the tensor brings its own mode), and no mode sees it. Checked: 2.13."""
    return _disable_current_modes()


def profiler_memory_events(fn) -> list[tuple[int, int]]:
    """``(time_ns, bytes)`` of every allocation (positive) and free (negative) the c10
    allocators report to the profiler while ``fn()`` runs, in time order: what compiled
    (inductor) code allocates too, which no dispatch mode sees. Checked: 2.13 (CPU)."""
    from torch.profiler import ProfilerActivity, profile
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    # kineto writes "USDT: ... profiler_start" / "profiler_stop" to file descriptor 2 at each
    # (a lesson's cell printed them); fn's own output is left alone
    with _stderr_fd_dropped():
        prof.start()
    try:
        fn()
    finally:
        with _stderr_fd_dropped():
            prof.stop()
    events = [(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]"]
    return sorted(events)


@contextlib.contextmanager
def fake_grouped_mm_any_dtype() -> Iterator[None]:
    """While open, fake tensors run ``aten._grouped_mm`` in any dtype: the output its meta kernel
    makes (``_meta_registrations._create_grouped_mm_output_tensor``: shape, dtype, strides),
    without ``_meta_grouped_mm_common``'s bf16-only check, which no real kernel of an fp32 run
    reaches (the CPU kernel takes fp32). The op itself, and so its autograd node
    (``GroupedMmBackward0``, which saves ``mat2`` only for ``self``'s gradient and ``self`` only
    for ``mat2``'s), stay torch's own. The rule sits in FakeTensorMode's table of op rules
    (``fake_impls.op_implementations_dict``, consulted before the meta kernel) while open.

    FakeTensorMode's dispatch cache is one dict for every mode (``FakeTensorMode.cache``,
    ``fake_tensor.py`` 1433), so the op's entries made while open are dropped on leaving: an fp32
    call after the block is refused again, as torch refuses it.

    Checked: 2.13 (``_meta_registrations.py`` 8569-8647, ``fake_impls.py`` 163-205).
    """
    from torch._meta_registrations import _create_grouped_mm_output_tensor
    from torch._subclasses import fake_impls
    from torch._subclasses.fake_tensor import in_kernel_invocation_manager
    op = torch.ops.aten._grouped_mm.default

    def rule(fake_mode, func, mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        device = mat_a.device
        with in_kernel_invocation_manager(fake_mode):
            out = _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)
        return FakeTensor(fake_mode, out, device)
    table = fake_impls.op_implementations_dict
    saved = table.get(op)
    table[op] = rule
    try:
        yield
    finally:
        if saved is None:
            table.pop(op, None)
        else:
            table[op] = saved
        for key in [k for k in FakeTensorMode.cache if k.key and k.key[0] is op]:
            del FakeTensorMode.cache[key]


@contextlib.contextmanager
def _stderr_fd_dropped() -> Iterator[None]:
    """File descriptor 2 to ``os.devnull`` for the block (C++ code writes there, past ``sys.stderr``)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)

__all__ = ["aot_inductor_partition", "outside_dispatch_modes", "activation_memory_budget",
           "inductor_backend_seeing_graphs", "profiler_memory_events", "reset_compiled", "AUTOCAST_CPU_KEYS",
           "FakeCopyMode", "FakeStore", "FakeTensor", "FakeTensorMode", "TorchDispatchMode",
           "aten_ops_with_kernel", "current_autograd_node", "exclude_dispatch_keys", "fsdp2_mem_tracker",
           "dump_memory_snapshot", "fake_grouped_mm_any_dtype", "in_backward", "is_traceable_wrapper_subclass",
           "memory_snapshot",
           "op_schema", "parse_to", "record_memory_history", "stop_memory_history", "tensor_version",
           "tree_flatten", "tree_leaves", "tree_map_only"]
