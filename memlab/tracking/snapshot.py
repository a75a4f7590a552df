"""CUDA allocator snapshots, read offline: live bytes over time without the browser viewer.

``torch.cuda.memory._record_memory_history()`` then ``torch.cuda.memory._snapshot()`` give a
dict (see ``torch/cuda/_memory_viz.py``): ``segments`` (what the allocator holds at the end,
each with its ``blocks`` and their state) and ``device_traces`` (per device, the allocator's
actions in order: ``alloc``, ``free_requested``, ``free_completed``, ``segment_alloc``,
``segment_free``, ``segment_map``, ``segment_unmap``, ``oom``, ...). memlab writes one with
``measure_step(..., snapshot_path=...)``; one from an H200 ships with the package.

The trace starts when recording started, so tensors allocated before (the model, Adam's
state) appear only as blocks still allocated at the end. :func:`live_timeline` starts from
those and replays the trace backwards, like pytorch.org/memory_viz does. Sizes are the
sizes asked for; ``max_memory_allocated`` counts blocks rounded up to 512 bytes.

To open a snapshot in the browser viewer: gunzip a ``.pickle.gz`` first, then drag the
``.pickle`` onto https://pytorch.org/memory_viz (it runs locally in the page).
"""
from __future__ import annotations

import gzip
import io
import pickle
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from memlab.core.errors import InputError

# one steady-state gpt2-small step (seq 512, batch 4, fp32) on an H200: data/reference/README.md
REFERENCE_SNAPSHOT = ("data", "reference", "NVIDIA-H200", "gpt2-small-step.pickle.gz")


# the only names a snapshot's pickle may load: harmless containers (older protocols pickle
# a set as a call of ``builtins.set``). Everything else (a function to call, a class to
# build) is how a pickle runs code, and an allocator snapshot never needs it. Protocols 0-2
# spell builtins ``__builtin__``.
PLAIN_GLOBALS = frozenset({(m, n) for m in ("builtins", "__builtin__")
                           for n in ("set", "frozenset")} | {("collections", "OrderedDict")})


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle asked for a global outside :data:`PLAIN_GLOBALS`."""


class PlainUnpickler(pickle.Unpickler):
    """Unpickles containers, strings and numbers only: any other global is refused before
    it is looked up, so nothing a pickle names is imported or called."""

    def find_class(self, module: str, name: str):
        if (module, name) not in PLAIN_GLOBALS:
            raise RefusedGlobal(f"it asks for {module}.{name}")
        return super().find_class(module, name)


def load_snapshot(path: str | Path | None = None) -> dict:
    """A snapshot from ``path`` (``.pickle`` or gzip'ed ``.pickle.gz``), or the H200
    reference shipped with memlab. Only plain containers, strings and numbers are unpickled
    (:class:`PlainUnpickler`): a file that would import or call anything is refused with an
    InputError, so a snapshot from someone else cannot run code here.

    A dict because it is torch's snapshot format, as ``torch.cuda.memory._dump_snapshot`` writes it.
    """
    if path is None:
        data = resources.files("memlab").joinpath(*REFERENCE_SNAPSHOT).read_bytes()
        where = "/".join(REFERENCE_SNAPSHOT)
    else:
        data, where = Path(path).read_bytes(), str(path)
    if data[:2] == b"\x1f\x8b":  # gzip's magic number
        data = gzip.decompress(data)
    try:
        snap = PlainUnpickler(io.BytesIO(data)).load()
    except RefusedGlobal as e:
        raise InputError(f"{where} is not a plain allocator snapshot ({e}); memlab unpickles "
                         f"only dicts, lists, strings and numbers") from None
    except Exception as e:
        raise InputError(f"{where} is not a pickled allocator snapshot: {e}") from None
    if not isinstance(snap, dict) or not {"segments", "device_traces"} <= snap.keys():
        raise InputError(f"{where} is not an allocator snapshot: expected a dict with "
                         f"'segments' and 'device_traces' (torch.cuda.memory._snapshot())")
    return snap


@dataclass
class SnapshotTimeline:
    """Live and reserved bytes after each traced allocator action of one device."""

    device: int
    time_ms: list[float]        # since the first traced action
    live_bytes: list[int]       # allocated to tensors
    reserved_bytes: list[int]   # held by the allocator (segments)
    actions: list[str]
    start_bytes: int            # live before the first traced action (allocated before recording)
    peak_bytes: int
    peak_index: int             # -1: the peak was before the trace began
    ooms: list[int] = field(default_factory=list)  # indices of 'oom' actions

    @property
    def end_reserved_bytes(self) -> int:
        """What the allocator held when the snapshot was taken."""
        return self.reserved_bytes[-1] if self.reserved_bytes else 0


_ALLOC, _FREE = {"alloc"}, {"free_completed"}
_SEG_UP, _SEG_DOWN = {"segment_alloc", "segment_map"}, {"segment_free", "segment_unmap"}


def live_timeline(snapshot: dict, device: int = 0) -> SnapshotTimeline:
    """Live and reserved bytes after each action in ``device``'s trace.

    Ends where the snapshot ends: live = the blocks still allocated, reserved = the segments
    held. Walking the trace backwards undoes each action (a free gives its bytes back to the
    moment before it), which also recovers what was live before recording began.
    """
    traces = snapshot["device_traces"]
    if not 0 <= device < len(traces):
        raise InputError(f"device {device} not in the snapshot; it has {len(traces)} device trace(s)")
    segs = [s for s in snapshot["segments"] if s.get("device", 0) == device]
    live = sum(b["requested_size"] for s in segs for b in s["blocks"]
               if b["state"] == "active_allocated")
    reserved = sum(s["total_size"] for s in segs)
    trace = traces[device]
    lives, resv = [0] * len(trace), [0] * len(trace)
    for i in range(len(trace) - 1, -1, -1):
        lives[i], resv[i] = live, reserved
        action, size = trace[i]["action"], trace[i]["size"]
        live += -size if action in _ALLOC else size if action in _FREE else 0
        reserved += -size if action in _SEG_UP else size if action in _SEG_DOWN else 0
    t0 = trace[0]["time_us"] if trace else 0
    times = [(e["time_us"] - t0) / 1e3 for e in trace]
    peak_index = max(range(len(lives)), key=lives.__getitem__) if lives else -1
    if peak_index < 0 or lives[peak_index] < live:
        peak_index = -1
    peak = lives[peak_index] if peak_index >= 0 else live
    return SnapshotTimeline(device, times, lives, resv, [e["action"] for e in trace], live, peak,
                            peak_index, [i for i, e in enumerate(trace) if e["action"] == "oom"])


__all__ = ["PLAIN_GLOBALS", "PlainUnpickler", "REFERENCE_SNAPSHOT", "SnapshotTimeline", "load_snapshot",
           "live_timeline"]
