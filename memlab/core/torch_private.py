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


def outside_dispatch_modes() -> contextlib.AbstractContextManager:
    """While open, no dispatch mode (fake tensors, memlab's tracker) sees the ops run: real tensors
    made from constants (torchao's code tables) stay real."""
    return _disable_current_modes()


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
    partitioner then saves them for free). ``compiler(gm, example_inputs, is_backward, donated)``
    receives the forward and the backward graph and returns a boxed callable; ``donated`` are the
    backward's inputs inductor may reuse in place (:func:`backward_donated_inputs`; empty for the
    forward). Works on fake tensors (no dynamo, so fake parameters are allowed). Checked: 2.13 (CPU)."""
    from torch._functorch.aot_autograd import aot_function
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.decomposition import select_decomp_table

    donated: list[int] = []

    def partition(gm, joint_inputs, **kwargs):
        kwargs["static_lifetime_input_indices"] = list(range(num_params))
        fw, bw = partition_fn(gm, joint_inputs, **kwargs)
        donated[:] = backward_donated_inputs(fw, bw, kwargs["num_fwd_outputs"])
        return fw, bw
    return aot_function(fn, fw_compiler=lambda gm, inputs: compiler(gm, inputs, False, ()),
                        bw_compiler=lambda gm, inputs: compiler(gm, inputs, True, tuple(donated)),
                        partition_fn=partition, decompositions=select_decomp_table(),
                        num_params_buffers=num_params)


def boxed_graph(gm: torch.fx.GraphModule):
    """``gm`` as the boxed callable AOT autograd's compilers return, run as it is (no lowering).
    Checked: 2.13."""
    from torch._functorch.aot_autograd import make_boxed_func
    return make_boxed_func(gm)


def backward_donated_inputs(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, num_fwd_outputs: int) -> list[int]:
    """The backward graph's inputs AOT autograd donates to inductor: saved tensors that alias no
    forward input, user output or gradient, whose storage inductor may then reuse in place
    (``buf1 = mm_10; del mm_10  # reuse``). Under ``torch.compile`` AOT autograd records them in
    ``fw_metadata.bw_donated_idxs`` (torch/_functorch/_aot_autograd/graph_compile.py:2036, when
    ``functorch.config.donated_buffer``) and inductor reads them from the tracing context
    (torch/_inductor/graph.py:585, :1316); ``aot_function`` has no tracing context, so they are
    computed here by the same rule (``collect_fw_donated_buffer_idxs``, graph_compile.py:587).
    The forward's outputs are the user's ``num_fwd_outputs``, then the saved tensors, then saved
    symbolic ints, which come first among the backward's inputs. Checked: 2.13."""
    import torch._functorch.config as functorch_config
    try:
        from torch._functorch._aot_autograd.graph_compile import (
            collect_fw_donated_buffer_idxs,
            contain_metadata_mutation_ops,
        )
    except ImportError:  # another release's layout: nothing donated (only the lowered wrapper reads it)
        return []
    if not functorch_config.donated_buffer or contain_metadata_mutation_ops(fw) or contain_metadata_mutation_ops(bw):
        return []

    def values(nodes) -> list:
        return [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in nodes]
    fw_outs = values(fw.graph.find_nodes(op="output")[-1].args[0])
    saved = fw_outs[num_fwd_outputs:]
    symbolic = sum(1 for v in saved if not isinstance(v, torch.Tensor))
    found = collect_fw_donated_buffer_idxs(values(fw.graph.find_nodes(op="placeholder")), fw_outs[:num_fwd_outputs],
                                           values(bw.graph.find_nodes(op="output")[-1].args[0]),
                                           saved[:len(saved) - symbolic])
    return [symbolic + i for i in found]


class _KernelsNotCompiled:
    """Stands for inductor's ``AsyncCompile`` in a wrapper memlab runs on fake tensors
    (:func:`inductor_wrapper_call`): each generated C++ kernel becomes a no-op, as it only
    writes into buffers the wrapper allocated, and nothing is compiled."""

    def cpp_pybinding(self, argtypes: list[str], source_code: str):
        return _no_kernel

    def cpp(self, source_code: str):
        return _no_kernel

    def wait(self, scope: dict) -> None:
        pass


def _no_kernel(*args) -> None:
    """A generated kernel, not run: on fake tensors there is nothing to compute."""


def inductor_wrapper_call(gm: torch.fx.GraphModule, example_inputs: list, is_backward: bool,
                          donated: tuple[int, ...] = ()):
    """The Python wrapper inductor generates for ``gm`` on this CPU, as a boxed callable whose
    kernels do nothing: its allocations, frees, in-place buffer reuses and extern calls (mm,
    attention) run as written, so on fake tensors a dispatch mode sees the memory of the
    compiled graph step by step. ``example_inputs`` are fake tensors; ``donated``: the backward
    inputs inductor may reuse (:func:`backward_donated_inputs`).

    Inductor's own pipeline up to the code (torch/_inductor/compile_fx.py:1251
    ``codegen_and_compile``): ``view_to_reshape``, fake propagation, the post-grad passes, the
    lowering (``GraphLowering.run``), then ``GraphLowering.codegen`` (graph.py:2603), whose
    scheduler fuses (scheduler.py:4139) and reorders for peak memory (scheduler.py:4173,
    memory.py:998 ``reorder_for_peak_memory``: the least of a few topological orders) and whose
    wrapper plans buffers (codegen/wrapper.py:916 ``AllocateLine.plan``: a freed buffer of the
    same size is reused, its free dropped). The generated module is executed with
    ``AsyncCompile`` replaced (no C++ is compiled) and the C++ allocation helpers
    (``torch._C._dynamo.guards._empty_strided_cpu``, ``_reinterpret_tensor``), which bypass the
    dispatcher, replaced by ``torch.empty_strided`` and ``as_strided``. Checked: 2.13 (CPU)."""
    import torch._inductor.async_compile as async_compile
    from torch._inductor.compile_fx import (
        _recursive_post_grad_passes,
        _recursive_record_original_output_strides,
        fake_tensor_prop,
    )
    from torch._inductor.debug import DebugContext
    from torch._inductor.fx_passes.post_grad import view_to_reshape
    from torch._inductor.graph import GraphLowering
    from torch._inductor.utils import shape_env_from_inputs
    from torch._inductor.virtualized import V

    with _disable_current_modes(), DebugContext():
        view_to_reshape(gm)
        with torch.no_grad():
            fake_mode = fake_tensor_prop(gm, example_inputs)
        _recursive_record_original_output_strides(gm)
        with V.set_fake_mode(fake_mode):
            _recursive_post_grad_passes(gm, is_inference=False)
            graph = GraphLowering(gm, example_inputs=example_inputs, shape_env=shape_env_from_inputs(example_inputs),
                                  is_inference=False, is_backward=is_backward)
            graph.bw_donated_idxs = list(donated) if is_backward else None
            graph.freeze_runtime_asserts()
            with V.set_graph_handler(graph), V.set_extern_kernel_nodes([]):
                graph.run(*example_inputs)
                wrapper, _ = graph.codegen()
    scope: dict = {"__name__": "memlab_inductor_wrapper"}
    real_async_compile = async_compile.AsyncCompile
    async_compile.AsyncCompile = _KernelsNotCompiled
    try:
        exec(compile(wrapper.value, "<inductor wrapper>", "exec"), scope)
    finally:
        async_compile.AsyncCompile = real_async_compile
    scope.update(empty_strided_cpu=_empty_strided_cpu, reinterpret_tensor=_reinterpret_tensor,
                 assert_size_stride=_no_kernel, assert_alignment=_no_kernel)
    call = scope["call"]   # a bound method (Runner.call): it takes the argument list and clears it

    def run(args: list):
        return call(args)
    run._boxed_call = True
    return run


def _empty_strided_cpu(size, stride, dtype: torch.dtype) -> torch.Tensor:
    """``torch._C._dynamo.guards._empty_strided_cpu`` through the dispatcher (fake mode, tracker)."""
    return torch.empty_strided(size, stride, dtype=dtype, device="cpu")


def _reinterpret_tensor(base: torch.Tensor, size, stride, offset: int) -> torch.Tensor:
    """``torch._C._dynamo.guards._reinterpret_tensor``: a view of ``base``'s storage, ``offset``
    elements past ``base``'s own (torch/csrc/dynamo/guards.cpp)."""
    return base.as_strided(size, stride, base.storage_offset() + offset)


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

__all__ = ["aot_inductor_partition", "backward_donated_inputs", "boxed_graph", "inductor_wrapper_call",
           "activation_memory_budget",
           "inductor_backend_seeing_graphs", "profiler_memory_events", "reset_compiled", "AUTOCAST_CPU_KEYS",
           "FakeCopyMode", "FakeStore", "FakeTensor", "FakeTensorMode", "TorchDispatchMode",
           "aten_ops_with_kernel", "current_autograd_node", "exclude_dispatch_keys", "fsdp2_mem_tracker",
           "dump_memory_snapshot", "fake_grouped_mm_any_dtype", "in_backward", "is_traceable_wrapper_subclass",
           "memory_snapshot",
           "op_schema", "parse_to", "record_memory_history", "stop_memory_history", "tensor_version",
           "tree_flatten", "tree_leaves", "tree_map_only"]
