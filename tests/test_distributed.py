"""The multi-rank runner, and ZeRO's per-rank memory measured with real DeepSpeed."""
import os
import time

import pytest

from memlab.distributed.deepspeed_zero import measure_zero
from memlab.distributed.fsdp import fsdp_worker, simulate_sharded
from memlab.distributed.offload import measure_offload
from memlab.distributed.ranks import RankError, allreduce_worker, run_ranks
from memlab.step.training_step import StepConfig
from memlab.step.write_deepspeed_config import deepspeed_config

pytestmark = pytest.mark.distributed


def raise_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom from the second rank")
    time.sleep(60)  # rank 0 would wait: the runner must kill it, not wait
    return rank


def exit_on_rank_1(rank: int, world_size: int, how: str = "exit") -> int:
    if rank == 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), 9)
    time.sleep(60)
    return rank


def sleep_forever(rank: int, world_size: int) -> int:
    time.sleep(600)
    return rank


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_runner_returns_results_by_rank():
    out = run_ranks("memlab.distributed.ranks:allreduce_worker", 2, kwargs={"value": 2.0})
    assert [r["rank"] for r in out] == [0, 1]
    assert all(r["sum"] == 2.0 * (1 + 2) for r in out)
    assert out[0]["backend"] == "gloo"
    assert not any(_alive(r["pid"]) for r in out)


def test_a_port_taken_before_rank_0_binds_it_is_launched_again(monkeypatch, capsys):
    """The port _free_port found free is taken (by another launch, here by a socket listening on
    it) before rank 0's store binds it: the group cannot form, so the ranks are launched again on
    a new port and the run answers, saying so in one line."""
    import socket

    import memlab.distributed.ranks as ranks
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    free = ranks._free_port
    monkeypatch.setattr(ranks, "_free_port", lambda: next(ports, None) or free())
    try:
        out = run_ranks("memlab.distributed.ranks:allreduce_worker", 2, timeout=120)
    finally:
        taken.close()
    assert [r["sum"] for r in out] == [3.0, 3.0]
    err = capsys.readouterr().err
    assert err.count("launching again on another port") == 1, err


def test_raising_rank_names_rank_and_message():
    start = time.monotonic()
    with pytest.raises(RankError, match="boom from the second rank") as info:
        run_ranks(raise_on_rank_1, 2, timeout=60)
    assert info.value.rank == 1
    assert "rank 1" in str(info.value)
    assert time.monotonic() - start < 30  # not the 60 s rank 0 sleeps


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_killed_rank_is_an_error(how):
    start = time.monotonic()
    with pytest.raises(RankError, match="without a result") as info:
        run_ranks(exit_on_rank_1, 2, kwargs={"how": how}, timeout=60)
    assert info.value.rank == 1
    assert time.monotonic() - start < 30


def test_timeout_is_an_error_not_a_hang():
    with pytest.raises(RankError, match="timed out"):
        run_ranks(sleep_forever, 2, timeout=3)


def test_unimportable_worker_is_refused():
    with pytest.raises(ValueError, match="top-level function"):
        run_ranks(lambda r, w: r, 2)
    with pytest.raises(ValueError, match="world_size"):
        run_ranks(allreduce_worker, 0)
    with pytest.raises(ValueError, match="module:function"):
        run_ranks("no_colon_here", 2)


# --- ZeRO with DeepSpeed: one 2-rank launch serves all the assertions below -------------
SMALL = dict(seq=128, batch=4, world_size=2)


@pytest.fixture(scope="module")
def zero_reports():
    steps = [StepConfig(zero=z, **SMALL) for z in range(4)]
    steps.append(StepConfig(zero=3, offload="all", **SMALL))
    return measure_zero(steps, timeout=600)


def _acc(rep, key, rank=0):
    return rep.per_rank[rank].allocator[key]


def test_zero_stages_shard_as_the_paper_says(zero_reports):
    z0, z1, z2, z3, _ = zero_reports
    n_bytes = StepConfig(**SMALL).model_config.num_params() * 4
    assert _acc(z0, "parameters") == n_bytes
    assert _acc(z0, "optimizer_state") == 2 * n_bytes  # Adam: two fp32 moments
    # stage 1: optimizer state (and the fp32 master) halve at 2 ranks, within padding
    assert _acc(z1, "optimizer_state") == pytest.approx(_acc(z0, "optimizer_state") / 2, rel=0.01)
    assert _acc(z1, "fp32_master") == pytest.approx(n_bytes / 2, rel=0.01)
    # stage 2: gradients halve
    assert _acc(z2, "gradients") == pytest.approx(_acc(z0, "gradients") / 2, rel=0.01)
    # stage 3: parameters halve (plus the small persistent parameters kept whole)
    assert _acc(z3, "parameters") == pytest.approx(n_bytes / 2, rel=0.02)
    assert _acc(z3, "parameters") < _acc(z2, "parameters") * 0.55
    for rep in zero_reports:
        assert len(rep.per_rank) == 2 and rep.peak_bytes > 0


def test_offload_moves_model_states_to_host(zero_reports):
    z3, off = zero_reports[3], zero_reports[4]
    host = off.per_rank[0].allocator["host_bytes"]
    assert host == _acc(off, "fp32_master") + _acc(off, "optimizer_state") \
        + _acc(off, "host_gradients") + _acc(off, "gradients") + _acc(off, "parameters")
    # the optimizer side on the host: fp32 master + two moments + the fp32 gradient partition,
    # 16 bytes per parameter / N (Ren et al. 2021, ZeRO-Offload, sec. 3.5), whatever the precision
    n = StepConfig(**SMALL).model_config.num_params()
    assert host - _acc(off, "parameters") - _acc(off, "gradients") == pytest.approx(16 * n / 2, rel=0.01)
    # what left the device; the fp32 gradient partition is offload's own (without offload
    # DeepSpeed makes it only inside step())
    assert _acc(off, "device_bytes") < _acc(z3, "device_bytes") - (host - _acc(off, "host_gradients")) * 0.9
    assert z3.per_rank[0].allocator["host_bytes"] == 0
    # on CPU the host is the device: the report's host memory is 0, and DeepSpeed's accounting
    # says what a GPU would keep (the peak less the offloaded master, moments and gradients)
    rank = off.per_rank[0]
    assert rank.host_bytes == 0 and rank.to_dict()["host_bytes"] == 0
    assert rank.allocator["device_peak_bytes"] == rank.peak_bytes - _acc(off, "fp32_master") \
        - _acc(off, "optimizer_state") - _acc(off, "host_gradients") - _acc(off, "gradients")


def test_to_dict_has_per_rank(zero_reports):
    d = zero_reports[2].to_dict()
    assert [r["lens"] for r in d["per_rank"]] == ["measure", "measure"]
    assert d["per_rank"][1]["allocator"]["gradients"] == _acc(zero_reports[2], "gradients", 1)


def test_simulated_sharding_matches_real_ranks(zero_reports):
    step = StepConfig(**SMALL)
    sim = simulate_sharded(step, 2)
    real = run_ranks(fsdp_worker, 2, kwargs={"step": step})
    assert [r["peak_bytes"] for r in real] == [sim.per_rank[r].peak_bytes for r in range(2)]
    # the sharded model states agree with DeepSpeed's ZeRO-3 (which adds an fp32 master)
    z3 = zero_reports[3].per_rank[0].allocator
    assert sim.by_category["optimizer"] == pytest.approx(z3["optimizer_state"], rel=0.01)
    assert sim.by_category["parameters"] == pytest.approx(z3["parameters"], rel=0.02)


def test_deepspeed_config_is_validated():
    cfg = deepspeed_config(StepConfig(zero=3, offload="optimizer", micro_batches=2, **SMALL))
    assert cfg["train_batch_size"] == 8 and cfg["gradient_accumulation_steps"] == 2
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 2**20
    with pytest.raises(ValueError, match="needs ZeRO stage 3"):
        deepspeed_config(StepConfig(zero=2, offload="all", **SMALL))
    with pytest.raises(ValueError, match="fp16"):
        deepspeed_config(StepConfig(zero=1, precision="fp16", **SMALL))
    # DeepSpeed's compiled CPU Adam runs on the host: only where the optimizer is offloaded
    assert deepspeed_config(StepConfig(zero=2, offload="optimizer", **SMALL),
                            torch_adam=False)["optimizer"]["params"]["torch_adam"] is False
    with pytest.raises(ValueError, match="DeepSpeedCPUAdam"):
        deepspeed_config(StepConfig(zero=2, **SMALL), torch_adam=False)
    with pytest.raises(ValueError, match="DeepSpeedCPUAdam"):  # refused before any rank starts
        measure_offload(StepConfig(**SMALL), cases=[(2, "none")], cpu_adam=True)


def test_zero_worker_runs_as_a_script_under_torchrun(torchrun):
    import json

    from memlab.models.gpt_unet import get_config
    out = torchrun("memlab.distributed.zero_worker", "--zero", "2", "--seq", "32", "--batch", "2")
    ranks = sorted((json.loads(line) for line in out.splitlines() if line.startswith("{")),
                   key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1] and {r["world_size"] for r in ranks} == {2}
    n = get_config("tiny").num_params()
    for r in ranks:  # ZeRO-2, 2 ranks, fp32: whole parameters, half the gradients and Adam state
        acc = r["accounting"]
        assert acc["parameters"] == 4 * n
        assert acc["gradients"] == pytest.approx(4 * n / 2, rel=0.01)
        assert acc["optimizer_state"] == pytest.approx(8 * n / 2, rel=0.01)
        assert r["peak_bytes"] > acc["parameters"]


def test_a_dead_builds_lock_is_cleared_and_a_live_builds_kept(tmp_path):
    # torch's FileBaton waits as long as the lock file exists: a build killed midway (a rank past
    # its timeout) left it behind, and every later DeepSpeed start hung on it
    import os
    import time

    from memlab.distributed.ranks import STALE_BUILD_SECONDS, clear_stale_build_locks
    dead, live = tmp_path / "cpu_adam", tmp_path / "deepspeed_shm_comm"
    for op in (dead, live):
        op.mkdir()
        (op / "lock").touch()
        (op / "build.ninja").touch()
    old = time.time() - STALE_BUILD_SECONDS - 60
    for f in (dead / "lock", dead / "build.ninja", dead):
        os.utime(f, (old, old))
    (live / "cpu_adam.o").touch()  # a build still compiling writes its objects
    assert clear_stale_build_locks(tmp_path) == [str(dead / "lock")]
    assert not (dead / "lock").exists() and (live / "lock").exists()
