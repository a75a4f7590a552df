"""Measure: exact live tensor bytes by category, on CPU, CUDA and fake tensors.

:class:`MemoryTracker` is a ``TorchDispatchMode``. Every op's output storages are recorded
once (weakly keyed) and their bytes subtracted when the storage is finalized, so the live
total is exact at op granularity, on any device, including under ``FakeTensorMode`` where no
memory exists at all. Each storage gets one category:

``parameters``  storages of registered model parameters
``gradients``   storages that become a ``.grad`` of a registered parameter
``optimizer``   optimizer state (found through the optimizer step hooks)
``activations`` allocated in forward and still alive when forward ends: what autograd
                keeps for backward (plus the loss)
``temporaries`` everything else the step allocates: forward scratch, backward buffers,
                recomputation under checkpointing, optimizer scratch
``other``       buffers, inputs, anything registered as such
``workspace``   bytes the CUDA allocator holds that no tensor accounts for (cuBLAS and
                cuDNN workspaces, block rounding): filled in by the measure lens from the
                allocator's own peak; the tracker counts it only when a
                :class:`DeviceAccounting` models a device the step does not run on (the
                simulation's ``target="cuda"``, :mod:`memlab.policy`)

Every storage is also attributed to the device it lives on. The tracker has one *device*
(the step's: the accelerator, or the CPU on a CPU-only run); a storage elsewhere (optimizer
state or parameters offloaded to host memory, ``save_on_cpu`` activations) is *host*
memory and is counted apart: ``peak_bytes`` and the budget are the device's, ``host_peak_bytes``
and :meth:`host_peak_by_category` the host's.

Categories are settled at phase changes (forward, backward, optimizer), then the whole
timeline is replayed with them, so a stacked plot shows activations as activations from the
moment they were made.

A *budget* turns the tracker into a simulated device: the op that takes live bytes over it
raises ``torch.OutOfMemoryError`` with a CUDA-like message. On CUDA the tracker also records
the caching allocator's own figures and, if asked, a ``_record_memory_history`` snapshot.

Over 500 lines because the dispatch mode, the hooks that name parameters, gradients and
optimizer state, the replay that settles categories and the budget's OOM all read and write
one record per storage: split apart, each would reach into the others' private state.
"""
from __future__ import annotations

import pickle
import re
import weakref
from dataclasses import dataclass, field

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from memlab.core.errors import InputError
from memlab.core.hardware import resolve_budget
from memlab.core.torch_private import (
    TorchDispatchMode,
    current_autograd_node,
    in_backward,
    is_traceable_wrapper_subclass,
    memory_snapshot,
    record_memory_history,
    stop_memory_history,
    tree_flatten,
)
from memlab.core.units import fmt_bytes
from memlab.tracking.oom_messages import requested_bytes

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries", "other",
              "workspace")
_IDX = {c: i for i, c in enumerate(CATEGORIES)}
_DEVICE_QUERY = torch.ops.prim.device.default


class DeviceAccounting:
    """How a device turns the step's tensors into bytes. This default is the exact tracker:
    a storage costs its ``nbytes`` and there is no workspace. A target device (see
    :class:`memlab.policy.TargetAccounting`) overrides the hooks to count as its allocator
    and kernels would while the step itself runs elsewhere (on fake CPU tensors)."""

    def block_bytes(self, nbytes: int) -> int:
        """Bytes the allocator takes for a storage of ``nbytes``."""
        return nbytes

    def output_bytes(self, func, outputs: list, index: int, nbytes: int) -> int:
        """Bytes of output ``index`` of ``func`` when the device's kernel allocates a
        different size than this one did."""
        return nbytes

    def op_workspace(self, func, args: tuple, kwargs: dict, out) -> int:
        """Bytes the device's kernel for ``func`` holds while it runs and frees afterwards."""
        return 0

    def resident_workspace(self) -> int:
        """Bytes held through the whole step that no op returns (library workspaces)."""
        return 0


def _storages(t: torch.Tensor) -> list[tuple[torch.UntypedStorage, torch.device]]:
    """The storages holding a tensor's bytes, with the device each lives on. A wrapper
    subclass (a DTensor shard, an async collective's result) reports its global size; its
    bytes live in its inner tensors. The device is the tensor's: a fake tensor's storage is
    ``meta`` while the tensor is (fake) ``cpu`` or ``cuda``."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        inner = (getattr(t, a) for a in attrs)
        return [s for i in inner if isinstance(i, torch.Tensor) for s in _storages(i)]
    return [(t.untyped_storage(), t.device)]


# What torch's CPU allocator says when malloc fails (Linux/macOS: "can't allocate memory",
# Windows: "not enough memory"); both name DefaultCPUAllocator.
_HOST_OOM = re.compile(r"DefaultCPUAllocator|can't allocate memory|not enough memory")


def is_host_oom(error: BaseException) -> bool:
    """Whether ``error`` is the host allocator failing (``RuntimeError ... DefaultCPUAllocator:
    can't allocate memory``) rather than a bug."""
    return (isinstance(error, RuntimeError) and not isinstance(error, torch.OutOfMemoryError)
            and bool(_HOST_OOM.search(str(error))))


@dataclass
class _Storage:
    nbytes: int
    phase: str
    hint: str | None = None
    host: bool = False
    survived_forward: bool = False
    alive: bool = True

    @property
    def category(self) -> str:
        if self.hint is not None:
            return self.hint
        if self.phase == "forward" and self.survived_forward:
            return "activations"
        return "temporaries"


@dataclass(frozen=True)
class Event:
    """Live bytes after one op: ``by_category`` (the device's) and ``host_by_category``
    (host memory on an accelerator run) follow :data:`CATEGORIES`."""

    index: int
    op: str
    module: str
    phase: str
    by_category: tuple[int, ...]
    host_by_category: tuple[int, ...] = ()

    @property
    def total(self) -> int:
        """Device bytes live after the op."""
        return sum(self.by_category)

    @property
    def host_total(self) -> int:
        return sum(self.host_by_category)


@dataclass
class OOMInfo:
    """What broke the budget: the op, how much it asked for, and what was live.

    ``by_category`` is the device's live bytes when it broke; ``allocator`` holds the CUDA
    allocator's own figures for a real OOM (``allocated_bytes``, ``reserved_bytes``,
    ``free_bytes``, ``total_bytes``), empty for the tracker's simulated budget."""

    op: str
    module: str
    phase: str
    requested_bytes: int
    live_bytes: int
    budget_bytes: int
    message: str
    by_category: dict[str, int] = field(default_factory=dict)
    allocator: dict[str, int] = field(default_factory=dict)

    @property
    def culprit(self) -> str:
        """The category holding the most bytes when the budget broke."""
        return max(self.by_category, key=self.by_category.get) if self.by_category else "unknown"



def quant_state_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors of every 4-bit quantisation state in ``model``: bitsandbytes keeps a packed
    weight's block maxima, their own maxima and offset (double quantisation) and its code table in
    a ``QuantState`` on the parameter (``Params4bit.quant_state``) or the layer, outside
    ``parameters()`` and ``buffers()``; they are stored with the weight all step (CUDA's allocator
    counts them), so the tracker counts them as parameters.

    Args:
        model: any module (read by attribute: no bitsandbytes import here).

    Returns:
        The state's tensors (a shared code table once per state; the tracker counts a storage once).
    """
    states = [getattr(p, "quant_state", None) for p in model.parameters()]
    states += [getattr(m, "quant_state", None) for m in model.modules()]
    out: list[torch.Tensor] = []
    for qs in states:
        while qs is not None and hasattr(qs, "absmax"):  # the state, then its nested state2
            out += [t for t in (qs.absmax, getattr(qs, "offset", None), getattr(qs, "code", None))
                    if isinstance(t, torch.Tensor)]
            qs = getattr(qs, "state2", None)
    return out

class MemoryTracker(TorchDispatchMode):
    """Track live tensor bytes by category.

    >>> with MemoryTracker(budget="512MiB") as mt:
    ...     mt.track_model(model); mt.track_optimizer(opt)
    ...     loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    >>> mt.peak_bytes, mt.peak_by_category()

    ``budget`` is bytes, a size string or a GPU preset name; ``cuda_history=True`` records a
    CUDA allocator history (switched off again on exit, also after an exception).
    ``device`` is the step's device (``"cuda"``, ``"cpu"``, ...): storages on another device
    type are host memory. ``None`` takes the device of the first model tracked (or of the
    first tensor seen). ``accounting`` counts the device's bytes as another device would
    (default: exact bytes).

    Args:
        budget, cuda_history, device, accounting: as above.
        cuda: also read CUDA's allocator statistics (``None``: when the device is CUDA).
        max_history_entries: the CUDA history's length.

    Raises:
        InputError: a budget that is not a size or a GPU preset.
    """

    def __init__(self, budget: int | str | None = None, *, cuda: bool | None = None,
                 cuda_history: bool = False, max_history_entries: int = 100_000,
                 device: str | torch.device | None = None,
                 accounting: DeviceAccounting | None = None):
        super().__init__()
        self.accounting = accounting or DeviceAccounting()
        self.device: torch.device | None = None if device is None else torch.device(device)
        # cuda: read the CUDA allocator too; None = whenever CUDA is available
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self.budget_bytes = resolve_budget(budget)
        self.cuda_history = cuda_history
        self.max_history_entries = max_history_entries
        self._records: list[_Storage] = []
        # StorageImpl address -> record; an entry leaves when its storage is freed
        self._by_storage: dict[int, int] = {}
        # event: (op index or -1, sid, +1 alloc / -1 free / 0 op marker)
        self._log: list[tuple[int, int]] = []
        self._ops: list[tuple[str, str, str]] = []
        self._modules: list[weakref.ref] = []
        self._optimizers: list[weakref.ref] = []
        self.live_bytes = 0  # on the device
        self.peak_bytes = 0
        self.host_live_bytes = 0
        self.host_peak_bytes = 0
        self._host_peak_op = -1
        self._peak_op = -1
        self._peak_live: tuple[int, ...] | None = None
        self._phase = "idle"
        self._in_optimizer = False
        self._active = False
        self.oom: OOMInfo | None = None
        self.cuda_stats: dict[str, int] = {}
        self.snapshot: dict | None = None
        self._module_names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._module_stack: list[str] = []
        self._hooks: list = []
        self._replayed: list[Event] | None = None
        self._resident: int | None = None

    # -- registration --------------------------------------------------------------------
    def track_tensors(self, tensors, category: str = "other") -> None:
        """Register tensors that existed before tracking started."""
        if category not in _IDX:
            raise InputError(f"unknown category {category!r}; allowed: {', '.join(CATEGORIES)}")
        for t in tensors:
            if isinstance(t, torch.Tensor):
                for st, dev in _storages(t):
                    self._record(st, category, dev)

    def track_model(self, model: torch.nn.Module) -> None:
        """Register a model's parameters, buffers and existing gradients."""
        self._modules.append(weakref.ref(model))
        if self.device is None:
            first = next(model.parameters(), None)
            if first is not None:
                self.device = first.device
        for name, sub in model.named_modules(prefix=type(model).__name__):
            self._module_names.setdefault(sub, name)
        self._scan_module(model)

    def track_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Register an optimizer's state (and its parameters' gradients)."""
        if not any(r() is optimizer for r in self._optimizers):
            self._optimizers.append(weakref.ref(optimizer))
        self._scan_optimizer(optimizer)

    def _scan_module(self, model: torch.nn.Module) -> None:
        self.track_tensors(model.parameters(), "parameters")
        self.track_tensors(quant_state_tensors(model), "parameters")
        self.track_tensors(model.buffers(), "other")
        self.track_tensors((p.grad for p in model.parameters() if p.grad is not None), "gradients")

    def _scan_optimizer(self, opt: torch.optim.Optimizer) -> None:
        for group in opt.param_groups:
            self.track_tensors((p.grad for p in group["params"] if p.grad is not None), "gradients")
        for state in opt.state.values():
            self.track_tensors(state.values(), "optimizer")

    def _rescan(self) -> None:
        for ref in self._modules:
            if (m := ref()) is not None:
                self.track_tensors((p.grad for p in m.parameters() if p.grad is not None),
                                   "gradients")
        for ref in self._optimizers:
            if (o := ref()) is not None:
                self._scan_optimizer(o)

    # -- bookkeeping ---------------------------------------------------------------------
    def _record(self, storage: torch.UntypedStorage, hint: str | None,
                device: torch.device, nbytes: int | None = None) -> int:
        """Register a storage (of ``nbytes`` when the accounting says it is not its own
        size); returns the *device* bytes it adds (0 if known or on host)."""
        key = storage._cdata
        sid = self._by_storage.get(key)
        if sid is not None:
            rec = self._records[sid]
            if hint is not None and hint != "other" and rec.hint in (None, "other"):
                rec.hint = hint
            elif hint is not None and rec.hint is None:
                rec.hint = hint
            return 0
        if self.device is None:
            self.device = device
        host = device.type != self.device.type
        nbytes = storage.nbytes() if nbytes is None else nbytes
        if not host:
            nbytes = self.accounting.block_bytes(nbytes)
        sid = len(self._records)
        self._records.append(_Storage(nbytes, self._phase, hint, host))
        self._by_storage[key] = sid
        weakref.finalize(storage, self._free, sid, key)
        self._log.append((sid, +1))
        self._replayed = None
        if host:
            self.host_live_bytes += nbytes
            return 0
        self.live_bytes += nbytes
        return nbytes

    def _hold(self, nbytes: int, category: str) -> int:
        """Count device bytes that belong to no storage (a workspace); returns its record."""
        sid = len(self._records)
        self._records.append(_Storage(nbytes, self._phase, category))
        self._log.append((sid, +1))
        self.live_bytes += nbytes
        self._replayed = None
        return sid

    def _release(self, sid: int) -> None:
        rec = self._records[sid]
        if rec.alive:
            rec.alive = False
            self.live_bytes -= rec.nbytes
            self._log.append((sid, -1))
            self._replayed = None

    def _free(self, sid: int, key: int) -> None:
        if self._by_storage.get(key) == sid:
            del self._by_storage[key]
        rec = self._records[sid]
        if rec.alive:
            rec.alive = False
            if rec.host:
                self.host_live_bytes -= rec.nbytes
            else:
                self.live_bytes -= rec.nbytes
            self._log.append((sid, -1))
            self._replayed = None

    def mark_phase(self, phase: str) -> None:
        """Say that the step has entered ``phase`` (``"backward"``, ``"optimizer"``, ...).

        The tracker finds phases by itself from the dispatcher; a caller that stops a step
        early (a forward with no backward, say) calls this to settle what forward kept:
        storages made in forward and alive now become ``activations``.
        """
        self._set_phase(phase)

    def _set_phase(self, phase: str) -> None:
        if phase == self._phase:
            return
        self._module_stack.clear()
        if self._phase == "forward":
            for rec in self._records:
                if rec.alive and rec.phase == "forward":
                    rec.survived_forward = True
        self._rescan()
        self._phase = phase

    def _current_module(self) -> str:
        """The innermost module running forward (also when recomputed in backward), else
        the autograd node running backward."""
        if self._module_stack:
            return self._module_stack[-1]
        node = current_autograd_node()
        return node.name() if node is not None else "Global"

    def _push_module(self, module, args) -> None:
        self._module_stack.append(self._module_names.get(module) or type(module).__name__)

    def _pop_module(self, module, args, output) -> None:
        if self._module_stack:
            self._module_stack.pop()

    # -- the dispatch mode ---------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE_QUERY:  # allocates nothing; under fake tensors 2/3 of all calls
            return func(*args, **(kwargs or {}))
        if self._in_optimizer:
            phase = "optimizer"
        elif in_backward():
            phase = "backward"
        else:
            phase = "forward"
        self._set_phase(phase)
        op = func.__name__
        module = self._current_module()
        try:
            out = func(*args, **(kwargs or {}))
        except (torch.OutOfMemoryError, RuntimeError) as e:
            # the allocator itself ran out (a real CUDA OOM, or the host's malloc failing):
            # we know the op it was running
            if self.oom is None and (isinstance(e, torch.OutOfMemoryError) or is_host_oom(e)):
                self._record_real_oom(op, module, phase, e)
            raise
        new = 0
        acc = self.accounting
        outputs = tree_flatten(out)[0]
        for i, t in enumerate(outputs):
            if isinstance(t, torch.Tensor):
                for st, dev in _storages(t):
                    size = acc.output_bytes(func, outputs, i, st.nbytes())
                    new += self._record(st, None, dev, size)
        # a kernel's own workspace lives for the op only: counted at its event, then freed
        workspace = acc.op_workspace(func, args, kwargs or {}, out)
        held = self._hold(acc.block_bytes(workspace), "workspace") if workspace else None
        self._ops.append((op, module, phase))
        self._log.append((len(self._ops) - 1, 0))
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self._peak_op = len(self._ops) - 1
        if held is not None:
            self._release(held)
        if self.host_live_bytes > self.host_peak_bytes:
            self.host_peak_bytes = self.host_live_bytes
            self._host_peak_op = len(self._ops) - 1
        # like a real allocator, only an op that asks for memory can run out of it
        if new and self.budget_bytes is not None and self.live_bytes > self.budget_bytes:
            self._raise_oom(op, module, phase, new)
        return out

    def _settled_by_category(self) -> dict[str, int]:
        """Device bytes live now by category, with what forward kept settled as activations."""
        self._set_phase("oom")
        return self.by_category()

    def _record_real_oom(self, op: str, module: str, phase: str, error: BaseException) -> None:
        message = str(error).split("\n")[0]
        allocator = {}
        if self.device is not None and self.device.type == "cuda" and torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info(self.device)
            allocator = {"allocated_bytes": torch.cuda.memory_allocated(self.device),
                         "reserved_bytes": torch.cuda.memory_reserved(self.device),
                         "free_bytes": free, "total_bytes": total}
        self.oom = OOMInfo(op, module, phase, requested_bytes(message), self.live_bytes,
                           self.budget_bytes or 0, message, self._settled_by_category(),
                           allocator)

    def _raise_oom(self, op: str, module: str, phase: str, requested: int) -> None:
        by_cat = self._settled_by_category()
        in_use = self.live_bytes - requested
        msg = (f"Simulated device out of memory. Tried to allocate {fmt_bytes(requested)} in "
               f"{op} ({module}, {phase}). {fmt_bytes(in_use)} already in use; "
               f"budget {fmt_bytes(self.budget_bytes)}, so {fmt_bytes(self.live_bytes - self.budget_bytes)} "
               f"short. Largest category: {max(by_cat, key=by_cat.get)} "
               f"({fmt_bytes(max(by_cat.values()))}).")
        self.oom = OOMInfo(op, module, phase, requested, self.live_bytes, self.budget_bytes,
                           msg, by_cat)
        raise torch.OutOfMemoryError(msg)

    # -- context -------------------------------------------------------------------------
    def __enter__(self):
        self._active = True

        def pre(opt, args, kwargs):
            self.track_optimizer(opt)
            self._in_optimizer = True
            self._set_phase("optimizer")

        def post(opt, args, kwargs):
            self._scan_optimizer(opt)
            self._in_optimizer = False

        # Our own module stack: torch's ModuleTracker keeps checkpointed graphs alive.
        self._hooks = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post),
                       register_module_forward_pre_hook(self._push_module),
                       register_module_forward_hook(self._pop_module)]
        self._cuda_start()
        resident = self.accounting.resident_workspace()
        if resident:
            self._resident = self._hold(resident, "workspace")
        return super().__enter__()

    def __exit__(self, exc_type, exc, tb):
        try:
            return super().__exit__(exc_type, exc, tb)
        finally:
            self._set_phase("idle")
            for h in self._hooks:
                h.remove()
            self._hooks = []
            self._in_optimizer = False
            self._cuda_stop()
            if self._resident is not None:
                self._release(self._resident)
                self._resident = None
            self._active = False

    def _cuda_start(self) -> None:
        if not self.cuda:
            return
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self._cuda_base = torch.cuda.memory_allocated()
        if self.cuda_history:
            record_memory_history(self.max_history_entries)

    def _cuda_stop(self) -> None:
        if not self.cuda:
            return
        try:
            torch.cuda.synchronize()
            self.cuda_stats = {
                "max_memory_allocated": torch.cuda.max_memory_allocated(),
                "max_memory_reserved": torch.cuda.max_memory_reserved(),
                "memory_allocated_at_start": self._cuda_base,
                "memory_allocated_at_end": torch.cuda.memory_allocated(),
            }
            if self.cuda_history:
                self.snapshot = memory_snapshot()
        finally:
            if self.cuda_history:
                stop_memory_history()

    def dump_snapshot(self, path: str) -> str:
        """Write the CUDA allocator snapshot as a ``.pickle`` for pytorch.org/memory_viz."""
        if self.snapshot is None:
            raise RuntimeError("no CUDA snapshot recorded: use MemoryTracker(cuda_history=True) "
                               "on a CUDA device")
        with open(path, "wb") as f:
            pickle.dump(self.snapshot, f)
        return path

    # -- results -------------------------------------------------------------------------
    @property
    def timeline(self) -> list[Event]:
        """One event per op, live bytes by category with settled categories."""
        if self._replayed is None:
            self._replayed = self._replay()
        return self._replayed

    def _replay(self) -> list[Event]:
        live = [0] * len(CATEGORIES)
        host = [0] * len(CATEGORIES)
        cats = [_IDX[r.category] for r in self._records]
        events = []
        for key, kind in self._log:
            if kind == 0:
                op, module, phase = self._ops[key]
                events.append(Event(key, op, module, phase, tuple(live), tuple(host)))
            else:
                (host if self._records[key].host else live)[cats[key]] += \
                    kind * self._records[key].nbytes
        return events

    def _live(self, host: bool) -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        for rec in self._records:
            if rec.alive and rec.host == host:
                out[rec.category] += rec.nbytes
        return out

    def by_category(self) -> dict[str, int]:
        """Live device bytes now, by category."""
        return self._live(False)

    def host_by_category(self) -> dict[str, int]:
        """Live host bytes now, by category (zero when the device is the CPU)."""
        return self._live(True)

    def peak_by_category(self) -> dict[str, int]:
        """Device bytes by category at the op where the device total peaked (sums to
        ``peak_bytes`` unless the peak was set by registration before the first op)."""
        if self._peak_op < 0:
            return self.by_category()
        ev = self.timeline[self._peak_op]
        return dict(zip(CATEGORIES, ev.by_category, strict=True))

    def host_peak_by_category(self) -> dict[str, int]:
        """Host bytes by category at the op where the host total peaked."""
        if self._host_peak_op < 0:
            return self.host_by_category()
        ev = self.timeline[self._host_peak_op]
        return dict(zip(CATEGORIES, ev.host_by_category, strict=True))

    def allocation_log(self) -> tuple[list[tuple[int, int, str]], list[tuple[str, int, int]]]:
        """The device allocations in the order the allocator saw them, for replaying them
        through an allocator model (:mod:`memlab.policy.caching_allocator`): what was registered before
        the first op, as ``(key, bytes, category)``, then the ops' events, ``("alloc", key,
        bytes)``, ``("free", key, 0)``, and ``(phase, -1, 0)`` where the ops enter a new
        phase (``"forward"``, ``"backward"``, ``"optimizer"``, ...). Host storages are left out."""
        recs, log = self._records, self._log
        first = next((i for i, (_, kind) in enumerate(log) if kind == 0), len(log))
        held = [(k, recs[k].nbytes, recs[k].category) for k, kind in log[:first]
                if kind == 1 and not recs[k].host]
        events, phase = [], None
        for key, kind in log[first:]:
            if kind == 0:
                if self._ops[key][2] != phase:
                    phase = self._ops[key][2]
                    events.append((phase, -1, 0))
            elif not recs[key].host:
                events.append(("alloc" if kind > 0 else "free", key, recs[key].nbytes if kind > 0 else 0))
        return held, events

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now (e.g. after a warm-up step)."""
        self.peak_bytes = self.live_bytes
        self._peak_op = len(self._ops) - 1 if self._ops else -1
        self.host_peak_bytes = self.host_live_bytes
        self._host_peak_op = self._peak_op
