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
  exactly the tensors a real compile saves (checked against :func:`count_compiled_saved`).
  Each graph is then handed to inductor up to its generated Python wrapper, which runs with
  its kernels left out (:func:`memlab.core.torch_private.inductor_wrapper_call`): every
  allocation, free and in-place reuse happens where inductor's code does it. That order is not
  the partitioned graph's: at a budget of 0.5 inductor's scheduler fuses the backward's
  recomputed residual stream of several layers into one kernel (it reads the recomputed
  attention output of an earlier layer), so that recomputation and its buffers move to the
  start of backward; its wrapper reuses a freed buffer of the same size in place and the saved
  tensors AOT autograd donates. Against the measured peak (tests/test_compile.py, when written):
  tiny GPT +0.00% and -0.09%, tiny Llama +0.00% and +0.00% at budgets 1.0 and 0.5 (the
  partitioned graph's order, run op by op with fusion approximated, was 12-14% low at 0.5).
  The GPT's -0.09% is scratch the CPU flash-attention backward allocates inside its kernel
  (64 KiB + 128 B on the two-thread test machine, read from the allocator's events), which no
  tensor returns and the fake step does not see.
  Lowering and generating the code of both graphs takes seconds (no C++ is compiled). The
  graphs are lowered for the fake tensors' device, the CPU, also for a CUDA target: there
  inductor writes Triton kernels, whose fusion and order this does not follow.
* **estimate** (:func:`memlab.lenses.estimate.compiled_pass_bytes`): a GPT's compiled forward
  and backward are traced as the simulation runs them (cached per shape; only for a compiled
  step; with the optimizer step in backward and activation offloading when the step has them),
  beside the closed-form model states and optimizer step.

``compile="layers"`` (:func:`compile_layers`) compiles as torchtune does, each block and the loss
apart with the rest eager; each lens then does the above per compiled region. Against measured CPU
steps (tests/test_torchtune_switches.py): +0.26% and +0.20% with the plain loss, -3.4% with
torchtune's chunked loss (its eight compiled chunk losses; not yet explained). With
``checkpointing="full"`` the checkpoint wraps each compiled block, torchtune's order
(:class:`CheckpointedRegion`); the optimizer step in backward runs from the parameters' hooks after
each region's compiled backward, and activation offloading's hooks see what the eager parts save
(each checkpointed block's input among them). Against measured CPU steps
(tests/test_torchtune_compose.py): -0.06% checkpointed, -0.10% with the step in backward, -0.10%
with saved tensors leaving the device, for the simulation and the estimate alike.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from memlab.core.errors import InputError
from memlab.core.torch_private import (
    activation_memory_budget,
    aot_inductor_partition,
    boxed_graph,
    inductor_backend_seeing_graphs,
    inductor_wrapper_call,
    reset_compiled,
)
from memlab.models.gpt_unet import GPT, CrossEntropy

#: what the estimate and the simulation add for a compiled step on a CUDA target
CUDA_LOWERING_NOTE = ("compiled on a CUDA target: the graphs are lowered and code-generated for the CPU (the fake "
                      "tensors' device), so the fusion and order followed are CPU inductor's, not those of the "
                      "Triton code inductor writes for a GPU; measure a compiled step there")

#: torch releases whose inductor internals :func:`memlab.core.torch_private.inductor_wrapper_call`
#: was checked on (its private API moves between releases)
LOWERED_ON = ("2.13.",)
#: what the lenses add where this torch is not one of those
UNLOWERED_NOTE = ("compiled on a torch whose inductor internals memlab has not checked (checked: "
                  + ", ".join(v.rstrip(".") for v in LOWERED_ON) + "): the partitioned graphs ran in their own "
                  "order, without inductor's fusion, reordering and buffer reuse (on CPU at a budget of 0.5 that "
                  "read 12-14% low); the saved set is still the partitioner's")


def inductor_lowering_available() -> bool:
    """Whether this torch is one whose inductor the lenses run up to its generated code
    (:data:`LOWERED_ON`); elsewhere a compiled step's partitioned graphs run as they are."""
    return torch.__version__.startswith(LOWERED_ON)


def lowering_notes(is_cuda: bool) -> list[str]:
    """The notes a lens adds to a compiled step's report: a CUDA target's graphs are lowered for
    the CPU (:data:`CUDA_LOWERING_NOTE`); an unchecked torch runs them unlowered (:data:`UNLOWERED_NOTE`)."""
    return ([CUDA_LOWERING_NOTE] if is_cuda else []) + ([] if inductor_lowering_available() else [UNLOWERED_NOTE])


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


def compile_layers(model: nn.Module, fake: bool, backend: object = "inductor") -> nn.Module:
    """torchtune's compile (``StepConfig(compile="layers")``): each block of a GPT compiled on its
    own (``m.compile()`` on every decoder layer, torchtune/training/_compile.py:51-55 at 1814feb17)
    and the loss on its own (``torch.compile(loss)``, :81), the embedding, the final norm, the head
    and a cast of its logits eager between them. Each compiled region is partitioned apart, so its
    forward saves its own inputs and outputs, which one whole graph may fuse away.

    Args:
        model: a :class:`memlab.models.gpt_unet.GPT` with the plain loss.
        fake: for the simulation (fake tensors): each region a :class:`PartitionedModel`.
        backend: the real compile's backend.

    Returns:
        ``model``, its blocks and loss compiled in place.
    """
    if not isinstance(model, GPT) or model.cfg.loss not in ("plain", "chunked_output"):
        raise InputError(f"compile='layers' compiles a GPT's blocks and its plain loss apart, got "
                         f"{type(model).__name__}; allowed: a GPTConfig model with loss='plain' or "
                         f"'chunked_output', or compile=True")
    # chunked_output: torchtune compiles only compute_cross_entropy, one chunk a call (_compile.py:74-77)
    loss = CrossEntropy(summed_fp32=model.cfg.loss == "chunked_output")
    checkpointed = model.cfg.checkpointing == "full"
    if checkpointed:  # the checkpoint moves outside the compiled block (CheckpointedRegion)
        for block in model.blocks:
            block.cfg = replace(block.cfg, checkpointing="none")
    if fake:
        regions = [PartitionedModel(block) for block in model.blocks]
        model.compiled_loss = PartitionedModel(loss)
    else:
        reset_compiled()
        for block in model.blocks:
            block.compile(backend=backend)
        regions = list(model.blocks)
        model.compiled_loss = torch.compile(loss, backend=backend)
    if checkpointed:
        model.blocks = nn.ModuleList(CheckpointedRegion(region) for region in regions)
    elif fake:
        model.blocks = nn.ModuleList(regions)
    return model


class CheckpointedRegion(nn.Module):
    """A compiled block under activation checkpointing in torchtune's order: the recipe compiles
    each layer first (recipes/full_finetune_single_device.py:424-425 at 1814feb17), then
    ``set_activation_checkpointing`` wraps it (:427-430) in ``checkpoint_wrapper``, non-reentrant
    (torch/distributed/algorithms/_checkpoint/checkpoint_wrapper.py), so the checkpoint runs eager
    around the compiled call: forward keeps only the block's input (saved by checkpoint's
    ``_NoopSaveInputs``, under any outer saved-tensor hooks such as activation offloading); what
    the compiled forward saves is dropped by checkpoint's hooks, and backward re-runs the compiled
    forward, then the compiled backward on what it saved. Compiling a block that checkpoints itself
    would trace the checkpoint into the graph instead (the partitioner then recomputes inside one
    backward graph), which is not the step torchtune ran.

    Args:
        region: the compiled block (a :class:`PartitionedModel` in the simulation).
    """

    def __init__(self, region: nn.Module):
        super().__init__()
        self.region = region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return checkpoint(self.region, x, use_reentrant=False)
        return self.region(x)


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


class PartitionedModel(nn.Module):
    """``model`` as a compiled step runs it, for the simulation (fake tensors): traced by AOT
    autograd at its first call, partitioned by inductor's partitioner under the budget set
    then, each graph run as the wrapper inductor generates for it with its kernels left out
    (:func:`memlab.core.torch_private.inductor_wrapper_call`). Its parameters are ``model``'s."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self._compiled = None
        #: bytes of what the partitioned forward saves for backward (:func:`saved_storages`), once traced
        self.saved_bytes: int | None = None

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: list, is_backward: bool, donated: tuple[int, ...]):
        if is_backward:  # counted before inductor's post-grad passes rewrite the graph
            self.saved_bytes = sum(saved_storages(gm).values())
        if not inductor_lowering_available():  # another torch's inductor: the graph as partitioned
            return boxed_graph(gm)
        return inductor_wrapper_call(gm, example_inputs, is_backward, donated)

    def forward(self, *args):
        state = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
        if self._compiled is None:
            self._compiled = aot_inductor_partition(
                lambda p, *a: torch.func.functional_call(self.model, p, a), self._compile, len(state))
        return self._compiled(state, *args)


__all__ = ["CUDA_LOWERING_NOTE", "LOWERED_ON", "UNLOWERED_NOTE", "CheckpointedRegion", "CompiledSaved",
           "PartitionedModel", "check_budget", "compile_layers", "compile_model", "count_compiled_saved",
           "inductor_lowering_available", "lowering_notes", "saved_storages"]
