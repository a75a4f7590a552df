"""The offline reader of CUDA allocator snapshots, on the H200 snapshot memlab ships."""
import gzip
import json
import pickle
from importlib import resources

import pytest

from memlab.core.errors import InputError
from memlab.tracking.snapshot import REFERENCE_SNAPSHOT, live_timeline, load_snapshot

MiB = 2**20


def _peak_by_addresses(snap: dict, device: int = 0) -> int:
    """Max live bytes by another route: the set of live blocks, by address, walked back from
    the end (each traced alloc must be live at that point, each free must not)."""
    live = {b["address"]: b["requested_size"] for s in snap["segments"] if s["device"] == device
            for b in s["blocks"] if b["state"] == "active_allocated"}
    best = total = sum(live.values())
    for e in reversed(snap["device_traces"][device]):
        if e["action"] == "alloc":
            assert live.pop(e["addr"]) == e["size"]
        elif e["action"] == "free_completed":
            assert e["addr"] not in live
            live[e["addr"]] = e["size"]
        else:
            continue
        total = sum(live.values())
        best = max(best, total)
    return best


def test_reference_snapshot_peak_equals_its_own_live_maximum():
    snap = load_snapshot()
    t = live_timeline(snap)
    assert len(t.actions) == len(snap["device_traces"][0]) > 100
    assert t.peak_bytes == _peak_by_addresses(snap)
    assert t.live_bytes[t.peak_index] == t.peak_bytes
    # what the allocator still held at the end: its segments (cached, far above live)
    assert t.end_reserved_bytes == sum(s["total_size"] for s in snap["segments"])
    assert t.end_reserved_bytes > 2 * t.live_bytes[-1]
    # a steady-state step ends where it began: the same tensors live
    assert t.live_bytes[-1] == t.start_bytes


def test_reference_snapshot_peak_is_the_measured_step():
    """The snapshot is gpt2-small, seq 512, batch 4, fp32; gpu_check.json measured batch 8.
    What a step adds over its start (activations, gradients) is linear in the batch
    (lesson 01), so batch 4 should reach start + (peak - start) / 2 of the batch-8 row."""
    ref = json.loads(resources.files("memlab").joinpath(
        "data", "reference", "NVIDIA-H200", "gpu_check.json").read_text())
    row = next(r for r in ref["rows"] if (r["model"], r["seq"], r["batch"]) == ("gpt2-small", 512, 8)
               and not r.get("precision") and not r.get("checkpointing"))
    a = row["allocator"]
    expected = a["memory_allocated_at_start"] + (a["max_memory_allocated"] - a["memory_allocated_at_start"]) / 2
    peak = live_timeline(load_snapshot()).peak_bytes
    assert abs(peak / expected - 1) < 0.02, (peak / MiB, expected / MiB)


def test_plain_and_gzipped_pickles_read_the_same(tmp_path):
    snap = load_snapshot()
    plain, packed = tmp_path / "step.pickle", tmp_path / "step.pickle.gz"
    plain.write_bytes(pickle.dumps(snap))
    packed.write_bytes(gzip.compress(pickle.dumps(snap)))
    peaks = {live_timeline(load_snapshot(p)).peak_bytes for p in (plain, packed)}
    assert peaks == {live_timeline(snap).peak_bytes}


def test_what_is_not_a_snapshot_is_refused(tmp_path):
    junk = tmp_path / "junk.pickle"
    junk.write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="not a pickled allocator snapshot"):
        load_snapshot(junk)
    other = tmp_path / "other.pickle"
    other.write_bytes(pickle.dumps({"segments": []}))
    with pytest.raises(ValueError, match="device_traces"):
        load_snapshot(other)
    with pytest.raises(ValueError, match="device 3"):
        live_timeline(load_snapshot(), device=3)


def test_the_reference_is_package_data():
    assert resources.files("memlab").joinpath(*REFERENCE_SNAPSHOT).is_file()


class _Plant:
    """A pickle that, loaded by ``pickle.loads``, calls ``pathlib.Path.touch`` on a file."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        import pathlib
        return pathlib.Path.touch, (pathlib.Path(self.target),)


@pytest.mark.parametrize("gzipped", [False, True])
def test_a_snapshot_that_would_run_code_is_refused_and_nothing_runs(tmp_path, gzipped):
    planted = tmp_path / "ran"
    evil = {"segments": [], "device_traces": [[]], "payload": _Plant(planted)}
    data = pickle.dumps(evil)
    pickle.loads(data)  # the attack works on plain pickle: the file appears
    assert planted.exists()
    planted.unlink()
    path = tmp_path / ("evil.pickle.gz" if gzipped else "evil.pickle")
    path.write_bytes(gzip.compress(data) if gzipped else data)
    with pytest.raises(InputError, match="not a plain allocator snapshot") as info:
        load_snapshot(path)
    assert "\n" not in str(info.value) and "pathlib" in str(info.value)
    assert not planted.exists()


def test_plain_containers_of_every_protocol_load(tmp_path):
    snap = {"segments": [{"blocks": [], "device": 0, "total_size": 2**20}],
            "device_traces": [[{"action": "alloc", "size": 512, "time_us": 1.5}]],
            "tags": {"a", "b"}, "pair": (1, -2), "frozen": frozenset({3})}
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        path = tmp_path / f"p{protocol}.pickle"
        path.write_bytes(pickle.dumps(snap, protocol=protocol))
        assert load_snapshot(path) == snap


# What pickles use to run code: a callable looked up as a global, then called with REDUCE.
CODE_GLOBALS = [("os", "system"), ("posix", "system"), ("builtins", "eval"), ("builtins", "exec"),
                ("builtins", "__import__"), ("builtins", "getattr"), ("subprocess", "Popen"),
                ("torch", "load"), ("numpy", "load")]


@pytest.mark.parametrize("module,name", CODE_GLOBALS)
def test_every_global_outside_the_plain_containers_is_refused(tmp_path, module, name):
    # protocol 0 by hand: push module.name, call it with one harmless string argument
    path = tmp_path / "snap.pickle"
    path.write_bytes(f"c{module}\n{name}\n(S'true'\ntR.".encode())
    with pytest.raises(InputError, match=f"it asks for {module}.{name}"):
        load_snapshot(path)
