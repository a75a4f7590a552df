"""ZeRO-3's gathered parameters through one step, as DeepSpeed 0.19.8's coordinator holds them.

Stage 3 keeps each parameter as a partition and gathers it whole for the module that runs. What
is gathered at a moment follows ``PartitionedParameterCoordinator``
(``deepspeed/runtime/zero/partitioned_param_coordinator.py``, DeepSpeed 0.19.8), replayed here
for a step whose trace is complete (every step after the first):

* ``fetch_sub_module``: at each module's pre-forward (and pre-backward) hook its parameters that
  are not available are gathered, then parameters are prefetched from the step's trace (the
  parameters of every module, forward then backward, in order) until
  ``min(stage3_max_live_parameters - available, stage3_prefetch_bucket_size)`` elements, the root
  module's hook included, so a model smaller than the bucket is gathered whole before its first op;
* ``all_gather_coalesced`` (``partition_parameters.py``): a group of more than one parameter is
  gathered into one flat buffer (each rank's padded partition, times the ranks); at the first
  wait every parameter of the group becomes a copy of its own (``torch.cat``), and the flat buffer
  lives while any parameter of the group is still in the in-flight registry, that is until the
  last of them is fetched by its module; one parameter alone is a view of its padded buffer;
* ``__params_to_release``: after a module runs, its parameters are freed unless the trace uses
  them again within ``stage3_max_reuse_distance`` elements or a prefetch already claimed them for
  a later use; parameters below ``stage3_param_persistence_threshold`` elements are never freed
  (:mod:`memlab.step.states` counts them with the parameters).

DeepSpeed's linear (``LinearFunctionForZeroStage3``) saves the parameter itself for backward, so
autograd holds nothing of a freed parameter. What this module does not replay: the first step
(no trace yet, so no prefetch), NVMe, and a trace whose modules run in a different order from one
step to the next (a mixture of experts routing differently). The estimate, which has no trace,
keeps the rules that decide its peak in closed form (:func:`gathered_in_closed_form`): whether
the root's prefetch takes the whole model, and so whether the forward's end holds the flat buffer
beside the copies.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from memlab.core.errors import InputError


def persists(numel: int, threshold: int) -> bool:
    """Whether stage 3 keeps a parameter of ``numel`` elements whole on every rank, never gathered:
    ``ds_numel <= param_persistence_threshold`` (DeepSpeed 0.19.8 ``partition_parameters.py``
    line 1292, in ``Init._convert_to_deepspeed_param``; its ``model_persistence_threshold`` cap is unbounded by
    default and not modelled)."""
    return numel <= threshold


@dataclass(frozen=True)
class TraceModule:
    """One module of the trace: its name and its own parameters (``(key, elements)``; one key for
    a parameter shared by several modules, as a tied embedding is)."""

    name: str
    params: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class GatherSchedule:
    """Gathered bytes through a step. ``forward[i]``: after the forward fetch of module ``i`` of the
    trace (``-1``-th, before any: 0); ``backward[j]``: after the backward fetch of the ``j``-th
    module of the backward order; ``released[j]``: after that module's release. ``backward_order``:
    the trace's modules in backward order (indices into the forward list)."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    released: tuple[float, ...]
    backward_order: tuple[int, ...]


class _Group:
    """One all-gather: its flat buffer's bytes and the parameters still in the in-flight registry."""

    def __init__(self, params: list[str], flat: float) -> None:
        self.params, self.pending, self.flat, self.waited = params, set(params), flat, False


class _Coordinator:
    """The state ``PartitionedParameterCoordinator`` keeps for one step, in bytes and elements."""

    def __init__(self, trace: list[TraceModule], world_size: int, element_bytes: int, prefetch: int,
                 max_live: int, reuse_distance: int, persistence: int) -> None:
        self.trace, self.ws, self.e = trace, world_size, element_bytes
        self.prefetch, self.max_live, self.reuse = prefetch, max_live, reuse_distance
        self.numel = {k: n for m in trace for k, n in m.params}
        self.persist = {k for k, n in self.numel.items() if persists(n, persistence)}
        # the parameter trace: each module's parameters at its step
        self.queue = [(k, step) for step, m in enumerate(trace) for k, _ in m.params]
        self.pos = 0
        self.status = {k: "available" if k in self.persist else "none" for k in self.numel}
        self.registry: dict[str, _Group] = {}
        self.copies: dict[str, float] = {}
        self.claimed = dict.fromkeys(self.numel, -1)  # __most_recent_step_id_param_fetched_for
        self.flat, self.available = 0.0, 0

    def total(self) -> float:
        return sum(self.copies.values()) + self.flat

    def _padded(self, k: str) -> int:
        return math.ceil(self.numel[k] / self.ws) * self.ws

    def _gather(self, keys: list[str]) -> None:
        keys = sorted(set(keys))
        if not keys:
            return
        self.available += sum(self.numel[k] for k in keys)
        if len(keys) == 1:  # _all_gather_sequential: the parameter is a view of its padded buffer
            self.status[keys[0]], self.copies[keys[0]] = "available", self.e * self._padded(keys[0])
            return
        g = _Group(keys, self.e * sum(self._padded(k) for k in keys))
        self.flat += g.flat
        for k in keys:
            self.status[k], self.registry[k] = "inflight", g

    def _wait(self, k: str) -> None:
        g = self.registry.pop(k, None)
        if g is None:
            return
        if not g.waited:  # AllGatherCoalescedHandle.wait makes every parameter of the group whole
            g.waited = True
            for q in g.params:
                self.status[q], self.copies[q] = "available", self.e * self.numel[q]
        g.pending.discard(k)
        if not g.pending:
            self.flat -= g.flat

    def fetch(self, step: int) -> None:
        """``fetch_sub_module``: gather the module's own parameters, wait, then prefetch."""
        own = [k for k, _ in self.trace[step].params]
        self._gather([k for k in own if self.status[k] == "none"])
        for k in own:
            self._wait(k)
        fresh = {k for k in own if self.claimed[k] < step}
        popped: set[str] = set()
        while self.pos < len(self.queue) and len(popped) < len(fresh):
            k, used = self.queue[self.pos]
            self.pos += 1
            self.claimed[k] = used
            popped.add(k)
        budget = min(self.max_live - self.available, self.prefetch)
        chosen: list[str] = []
        n = 0
        while self.pos < len(self.queue) and n < budget:
            k, used = self.queue[self.pos]
            self.pos += 1
            self.claimed[k] = max(self.claimed[k], used)
            if self.status[k] == "none" and k not in chosen:
                chosen.append(k)
                n += self.numel[k]
        self._gather(chosen)

    def release(self, step: int) -> None:
        """``release_sub_module``: free what ``__params_to_release`` lets go."""
        # DeepSpeed's step id is one past this module's fetch when it releases it
        own = {k for k, _ in self.trace[step].params if k not in self.persist and self.claimed[k] <= step + 1}
        traversed = 0
        for m in self.trace[step + 1:]:
            if traversed >= self.reuse:
                break
            for k, n in m.params:
                own.discard(k)
                traversed += n
        for k in own:
            if self.status[k] == "available" and k not in self.registry:
                self.status[k] = "none"
                self.available -= self.numel[k]
                self.copies.pop(k, None)


def replay_gathers(modules: list[TraceModule], *, world_size: int, element_bytes: int,
                   prefetch: int, max_live: int, reuse_distance: int,
                   persistence: int) -> GatherSchedule:
    """Replay DeepSpeed's stage-3 coordinator over one step of ``modules`` (forward order; the
    backward runs them in reverse).

    Args:
        modules: every module whose hook fires, in forward order, with its own parameters.
        world_size: ranks the parameters are partitioned over.
        element_bytes: bytes of a gathered element (the model's dtype).
        prefetch, max_live, reuse_distance, persistence: ``stage3_prefetch_bucket_size``,
            ``stage3_max_live_parameters``, ``stage3_max_reuse_distance``,
            ``stage3_param_persistence_threshold`` (elements).

    Returns:
        The :class:`GatherSchedule`.
    """
    if world_size < 1 or element_bytes < 1:
        raise InputError(f"world_size={world_size}, element_bytes={element_bytes}: both must be >= 1")
    order = list(range(len(modules))) + [i for i in reversed(range(len(modules))) if modules[i].params]
    c = _Coordinator([modules[i] for i in order], world_size, element_bytes, prefetch, max_live,
                     reuse_distance, persistence)
    forward, backward, released = [], [], []
    for step in range(len(order)):
        c.fetch(step)
        (forward if step < len(modules) else backward).append(c.total())
        c.release(step)
        if step >= len(modules):
            released.append(c.total())
    return GatherSchedule(tuple(forward), tuple(backward), tuple(released), tuple(order[len(modules):]))


def gathered_in_closed_form(numels: list[int], *, world_size: int, element_bytes: int, prefetch: int,
                            max_live: int, persistence: int) -> tuple[float, float]:
    """ZeRO-3's gathered bytes without a trace, from the parameters' sizes in the model's order
    (the estimate's; :func:`replay_gathers` replays the step). DeepSpeed 0.19.8's rules of the
    module doc decide by the gathered (not persistent) elements ``W``:

    * all but the last of them under ``min(prefetch, max_live)``: the root's prefetch
      (``partitioned_param_coordinator.py`` lines 453-476: ``max_params_to_prefetch``, taken
      until reached) gathers every one into one flat buffer, each partition padded to a multiple
      of the ranks (``partition_parameters.py`` line 1343: ``partition_sz * world_size``), and
      the first wait copies each out (line 795: ``torch.cat``). The forward holds both until its
      last parameter is fetched (the head; under a tied head the last layer's last projection),
      then the copies until each module's backward; one parameter alone is a view of its padded
      buffer (line 1598: ``_all_gather_sequential``);
    * ``W`` under ``max_live``: each fetch prefetches up to ``min(max_live - available,
      prefetch)`` more, so the forward gathers the whole model a bucket at a time and keeps it
      to backward (memlab's config writes ``max_live`` as the reuse distance; the prefetch
      claims the rest for its backward use): the copies, and at most a bucket's flat buffer in
      flight, a bound: a group that gathers with the forward's last parameters one released in
      forward (beyond the reuse distance) again for backward waits for its backward fetch (memlab's
      GPT of 3.7M elements holds half a bucket so; a Llama of 3.4M none, where this is 5-8% high);
    * larger: the running module's parameters (at most the largest) and a bucket ahead.

    Args:
        numels: every parameter's elements, in the order the forward uses them.
        world_size, element_bytes, prefetch, max_live, persistence: as :func:`replay_gathers`.

    Returns:
        ``(forward, held)``: bytes the forward's end holds (the flat buffer still there in the
        first case), and what the loss and the backward hold (equal beyond the first case).
    """
    gathered = [n for n in numels if not persists(n, persistence)]  # persistent ones are never gathered
    if not gathered:
        return 0.0, 0.0
    whole, e = sum(gathered), element_bytes
    if whole - gathered[-1] < min(prefetch, max_live):
        if len(gathered) == 1:  # _all_gather_sequential: a view of its padded buffer, no copy
            return (e * math.ceil(whole / world_size) * world_size,) * 2
        flat = sum(math.ceil(n / world_size) * world_size for n in gathered)
        return e * (flat + whole), e * whole
    if whole <= max_live:
        held = e * (whole + min(prefetch, whole))
    else:
        held = e * min(max(gathered) + min(prefetch, max_live), whole)
    return held, held


#: the module name the tracker gives an op of autograd's gradient accumulation into ``.grad``
ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"


def module_params(model: nn.Module) -> tuple[dict[str, tuple[tuple[str, int], ...]], set[str]]:
    """Each module's own parameters by the tracker's name for it (the root's class, then the
    module's path), and the keys of the trainable ones; a shared parameter keeps one key.

    Args:
        model: the model (real, fake or meta tensors).

    Returns:
        ``(params_of, trainable)`` for :func:`gathered_by_op`.
    """
    root = type(model).__name__
    keys = {id(p): n for n, p in model.named_parameters()}
    params_of = {}
    for path, mod in model.named_modules():
        own = tuple((keys[id(p)], p.numel()) for p in mod.parameters(recurse=False))
        if own:
            params_of[f"{root}.{path}" if path else root] = own
    return params_of, {n for n, p in model.named_parameters() if p.requires_grad}


def gathered_by_op(timeline: list, params_of: dict[str, tuple[tuple[str, int], ...]], trainable: set[str],
                   **knobs: int) -> list[float]:
    """ZeRO-3's gathered bytes at each op of a simulated unsharded step.

    The forward order is the order in which the timeline's ops enter modules (a module's hook
    fires before its first op, its parents' before it); the backward releases a module once the
    gradients of the trainable parameters it used first in forward are accumulated (autograd's
    ``AccumulateGrad``, which DeepSpeed's post-backward hook follows), and fetches the next one.

    Args:
        timeline: the step's events (``phase``, ``module`` as the tracker names them).
        params_of: each module's own parameters, ``(key, elements)``, by the tracker's name.
        trainable: keys of the parameters with gradients.
        **knobs: :func:`replay_gathers`'s keywords.

    Returns:
        Bytes gathered at each event of ``timeline``.
    """
    first_backward = next((i for i, ev in enumerate(timeline) if ev.phase == "backward"), len(timeline))
    order: list[str] = []
    entered: list[int] = []  # modules entered by each forward op
    for ev in timeline[:first_backward]:
        parts = [] if ev.module == "Global" else ev.module.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name not in order:
                order.append(name)
        entered.append(len(order))
    order += [m for m in params_of if m not in order]
    modules = [TraceModule(m, params_of.get(m, ())) for m in order]
    sched = replay_gathers(modules, **knobs)
    out = [sched.forward[n - 1] if n else 0.0 for n in entered]
    # the trainable parameters whose gradient completes at each module of the backward order
    owner: dict[str, int] = {}
    for i, m in enumerate(modules):
        for k, _ in m.params:
            owner.setdefault(k, i)
    done, cum = 0, []
    for i in sched.backward_order:
        done += sum(1 for k, _ in modules[i].params if owner[k] == i and k in trainable)
        cum.append(done)
    accumulated = 0
    for ev in timeline[first_backward:]:
        if ev.phase != "backward":
            out.append(0.0)
            continue
        # a module is released by the hook that runs after its last gradient's accumulation
        seen = accumulated
        accumulated += ev.module == ACCUMULATE_GRAD
        j = sum(1 for c in cum if c <= seen)
        out.append(sched.backward[j] if j < len(cum) else sched.released[-1])
    return out


__all__ = ["ACCUMULATE_GRAD", "GatherSchedule", "TraceModule", "gathered_by_op", "gathered_in_closed_form",
           "module_params", "persists", "replay_gathers"]
