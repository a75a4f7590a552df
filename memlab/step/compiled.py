"""``torch.compile`` as a field of the run (``StepConfig.compile``,
``StepConfig.activation_memory_budget``): what a compiled step saves, counted from the graphs
inductor compiles, and how its peak is measured.

A compiled step saves what AOT autograd's min-cut partitioner chooses, not what eager
autograd saves: it recomputes cheap pointwise ops in backward rather than keep their
outputs, and with ``torch._functorch.config.activation_memory_budget`` below 1 it trades
more recompute for memory (0.5: about half of what the default keeps). Inductor also fuses
pointwise chains, so their intermediates never exist.

What each lens does with it, precisely:

* **measure** (a real CPU or CUDA step): the model is wrapped in ``torch.compile``
  (inductor); memlab's tracker, a dispatch mode, would make dynamo run the model eagerly,
  so the compiled step's peak is read from the allocator's own events (the profiler's
  memory events, :func:`memlab.core.torch_private.profiler_memory_events`) on top of the
  state tracked before the step. The categories inside the compiled step are not separated.
* **counted** (:func:`count_compiled_saved`): the tensors forward saves for backward are
  the backward graph's inputs other than the parameters and the incoming gradients; their
  bytes, one storage counted once, are read from the graph inductor receives. Counting
  needs a real compile on this CPU (a tiny model: minutes on two cores).
* **simulate** (:class:`PartitionedModel`, on fake tensors): the step is traced by AOT
  autograd and cut by inductor's own partitioner (inductor's decompositions, joint-graph
  passes and ``min_cut_rematerialization_partition``, parameters static), so forward saves
  exactly the tensors a real compile saves (checked against :func:`count_compiled_saved`);
  the two graphs then run op by op with inductor's fusion approximated: a pointwise or view
  op whose every user fuses with it (pointwise, view, reduction) is never materialised, and
  no lens sees it (gather and embedding count as pointwise: inductor lowers them to indexed
  loads). Against the measured peak (tests/test_compile.py): at the default budget within 2%
  (tiny GPT -1.8%, tiny Llama -0.0%); at a budget of 0.5 -12% and -14%, because inductor's
  scheduler fuses the backward's recomputation of several layers into one kernel run at the
  start of backward (read from its generated code), so those buffers live longer than the
  partitioned graph's order keeps them, which this model does not follow.
* **estimate** counts the eager step and says so in its notes.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from memlab.core.errors import InputError
from memlab.core.torch_private import (
    activation_memory_budget,
    aot_inductor_partition,
    inductor_backend_seeing_graphs,
    outside_dispatch_modes,
    reset_compiled,
)


def check_budget(budget: float | None, compile: bool) -> None:
    """``activation_memory_budget`` is a fraction in (0, 1] and needs ``compile``."""
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1:
        raise InputError(f"activation_memory_budget={budget!r}; allowed: None or a fraction in (0, 1]")
    if not compile:
        raise InputError(f"activation_memory_budget={budget!r} without compile: the partitioner that "
                         f"reads it runs only under torch.compile; allowed: compile=True")


def compile_model(model: nn.Module, backend: object = "inductor") -> nn.Module:
    """``torch.compile(model)``: compiled at its first call (under the budget the step sets).
    Dynamo's cache is reset first, so the model is partitioned afresh under this step's budget
    (:func:`memlab.core.torch_private.reset_compiled`)."""
    reset_compiled()
    return torch.compile(model, backend=backend)


@dataclass
class CompiledSaved:
    """What a compiled forward saves for backward, from the backward graph's inputs."""

    #: bytes of the saved tensors' storages, each storage once (parameters excluded)
    saved_bytes: int
    #: how many saved tensors the backward graph takes (views of one storage counted apart)
    tensors: int
    #: the budget the partitioner ran under (``None``: its default)
    budget: float | None


def saved_storages(gm: torch.fx.GraphModule) -> dict[int, int]:
    """``{storage id: bytes}`` of a partitioned backward graph's saved inputs: its
    placeholders other than ``primals_*`` (parameters and inputs, kept anyway) and
    ``tangents_*`` (the incoming gradients)."""
    out = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder" or node.name.startswith(("primals", "tangents")):
            continue
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            out[id(storage)] = storage.nbytes()
    return out


def count_compiled_saved(model: nn.Module, batch: tuple, budget: float | None = None) -> CompiledSaved:
    """Compile ``model`` with inductor on this machine, run one forward and backward of
    ``batch``, and count what the partitioned forward saved (:class:`CompiledSaved`).

    Args:
        model: a module returning the loss (memlab's models do, given targets).
        batch: its inputs. budget: ``activation_memory_budget`` (``None``: the default).
    """
    check_budget(budget, True)
    storages: dict[int, int] = {}
    counted = [0]

    def on_graph(gm: torch.fx.GraphModule, is_backward: bool) -> None:
        if is_backward:
            found = saved_storages(gm)
            storages.update(found)
            counted[0] += sum(1 for n in gm.graph.nodes if n.op == "placeholder"
                              and not n.name.startswith(("primals", "tangents")))

    compiled = compile_model(model, inductor_backend_seeing_graphs(on_graph))
    with activation_memory_budget(budget):
        compiled(*batch).backward()
    model.zero_grad(set_to_none=True)
    return CompiledSaved(sum(storages.values()), counted[0], budget)


#: reductions inductor fuses a pointwise producer into (the producer is never materialised)
REDUCTIONS = frozenset({"sum", "amax", "amin", "mean", "var_mean", "var", "prod", "argmax", "argmin", "any", "all"})


#: ops inductor lowers to pointwise loads (gather and embedding read through an index), fused as
#: pointwise ops are
INDEXED_LOADS = frozenset({"convert_element_type", "clone", "gather", "embedding", "index"})


def op_kind(node: torch.fx.Node) -> str:
    """``"view"``, ``"pointwise"``, ``"reduction"`` or ``"other"`` (a kernel inductor calls as
    is: matmuls, attention, gather/scatter, cat) for a node of an aten graph."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return "other"
    name = target._schema.name.split("::")[-1]
    if target.is_view:
        return "view"
    if name in REDUCTIONS:
        return "reduction"
    if torch.Tag.pointwise in target.tags or name in INDEXED_LOADS:
        return "pointwise"
    return "other"


def fused_nodes(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes of ``gm`` inductor would fuse away: pointwise ops with a tensor input whose
    value no unfusable op (``"other"``), view of a needed value, or graph output needs, and views
    of such nodes."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    needed: dict[torch.fx.Node, bool] = {}

    def is_needed(node: torch.fx.Node) -> bool:
        if node not in needed:
            needed[node] = any(u is output or op_kind(u) == "other" or (op_kind(u) == "view" and is_needed(u))
                               for u in node.users)
        return needed[node]

    fused: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        kind = op_kind(node)
        if kind == "pointwise" and node.all_input_nodes and not is_needed(node):
            fused.add(node)
        elif kind == "view" and node.all_input_nodes and node.all_input_nodes[0] in fused:
            fused.add(node)
    return fused


def run_fused(gm: torch.fx.GraphModule, _example_inputs: object = None):
    """A boxed callable running ``gm`` op by op: each value dropped after its last use, each
    input as soon as it is used last (inductor frees its inputs so), the nodes of
    :func:`fused_nodes` outside every dispatch mode (no tracker counts them)."""
    gm.graph.eliminate_dead_code()
    nodes = list(gm.graph.nodes)
    last_use: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in nodes:
        for source in node.all_input_nodes:
            last_use[source] = node
    dying: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for value, node in last_use.items():
        dying.setdefault(node, []).append(value)
    fused = fused_nodes(gm)

    def run(args: list):
        env: dict[torch.fx.Node, object] = {}
        args.reverse()   # popped one by one: no list keeps an input alive past its last use
        for node in nodes:
            if node.op == "placeholder":
                value = args.pop()
                if node in last_use:
                    env[node] = value
                del value
                continue
            if node.op == "output":
                return torch.fx.node.map_arg(node.args[0], env.__getitem__)
            a, kw = torch.fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
            with outside_dispatch_modes() if node in fused else contextlib.nullcontext():
                env[node] = node.target(*a, **kw)
            del a, kw
            for value in dying.get(node, ()):
                del env[value]
            if not node.users:
                del env[node]
        raise AssertionError("an FX graph ends in an output node")
    run._boxed_call = True
    return run


class PartitionedModel(nn.Module):
    """``model`` as a compiled step runs it, for the simulation (fake tensors): traced by AOT
    autograd at its first call, partitioned by inductor's partitioner under the budget set
    then, each graph run by :func:`run_fused`. Its parameters are ``model``'s."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self._compiled = None
        #: bytes of what the partitioned forward saves for backward (:func:`saved_storages`), once traced
        self.saved_bytes: int | None = None

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: object):
        if any(n.op == "placeholder" and n.name.startswith("tangents") for n in gm.graph.nodes):
            self.saved_bytes = sum(saved_storages(gm).values())
        return run_fused(gm, example_inputs)

    def forward(self, *args):
        state = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
        if self._compiled is None:
            self._compiled = aot_inductor_partition(
                lambda p, *a: torch.func.functional_call(self.model, p, a), self._compile, len(state))
        return self._compiled(state, *args)


__all__ = ["CompiledSaved", "PartitionedModel", "check_budget", "compile_model", "count_compiled_saved",
           "fused_nodes", "op_kind", "run_fused", "saved_storages"]
