"""The multi-rank runner, and ZeRO's per-rank memory measured with real DeepSpeed."""
import os
import time

import pytest

from memlab.distributed import RankError, allreduce_worker, run_ranks

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
    out = run_ranks("memlab.distributed:allreduce_worker", 2, kwargs={"value": 2.0})
    assert [r["rank"] for r in out] == [0, 1]
    assert all(r["sum"] == 2.0 * (1 + 2) for r in out)
    assert out[0]["backend"] == "gloo"
    assert not any(_alive(r["pid"]) for r in out)


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
