"""Workers as launchers start them: torchrun's, deepspeed's (its launcher and OpenMPI),
accelerate launch's and Slurm's variables, set by hand."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memlab.core.errors import InputError
from memlab.distributed import zero_worker
from memlab.distributed.launch_env import DEFAULT_MASTER_PORT, LaunchEnv, first_host, launcher_env

# what each launcher sets in rank 3's environment, 2 nodes x 2 ranks
TORCHRUN = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "29511",
            "TORCHELASTIC_RUN_ID": "none"}
# deepspeed/launcher/launch.py: LOCAL_SIZE, not LOCAL_WORLD_SIZE
DEEPSPEED = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_SIZE": "2",
             "MASTER_ADDR": "node0", "MASTER_PORT": "29500", "CROSS_RANK": "1", "CROSS_SIZE": "2"}
OPENMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "node0"}
SLURM = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_NODEID": "1",
         "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NODELIST": "gpu[07-08]",
         "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.7"}


@pytest.mark.parametrize("env, launcher, addr, port", [
    (TORCHRUN, "torchrun", "node0", 29511),
    (DEEPSPEED, "deepspeed", "node0", 29500),
    (OPENMPI, "mpi", "node0", DEFAULT_MASTER_PORT),
    (SLURM, "slurm", "127.0.0.7", DEFAULT_MASTER_PORT),
])
def test_every_launcher_gives_rank_3_of_4_on_node_1(env, launcher, addr, port):
    assert launcher_env(env) == LaunchEnv(launcher, 3, 1, 4, 2, 1, addr, port)


def test_slurm_without_the_launch_node_address_uses_the_first_host():
    env = {k: v for k, v in SLURM.items() if k != "SLURM_LAUNCH_NODE_IPADDR"}
    env.pop("SLURM_TASKS_PER_NODE")
    env["SLURM_NTASKS_PER_NODE"] = "2"
    assert launcher_env(env).master_addr == "gpu07" and launcher_env(env).local_world_size == 2
    assert first_host("gpu[03-05,9],cpu1") == "gpu03"
    assert first_host("login2") == "login2"
    assert first_host("a100-[1,4]") == "a100-1"


def test_srun_torchrun_is_torchruns_job():
    assert launcher_env({**SLURM, **TORCHRUN, "RANK": "2", "LOCAL_RANK": "0"}).rank == 2


def test_no_launcher_is_rank_0_of_1_and_bad_values_are_named():
    assert launcher_env({}) == LaunchEnv("none", 0, 0, 1, 1, 0, "127.0.0.1", DEFAULT_MASTER_PORT)
    with pytest.raises(InputError, match="SLURM_NTASKS='four'"):
        launcher_env({**SLURM, "SLURM_NTASKS": "four"})
    with pytest.raises(InputError, match="rank 5"):
        launcher_env({**SLURM, "SLURM_PROCID": "5"})


def test_apply_exports_what_init_process_group_reads():
    env = dict(SLURM)
    launcher_env(env).apply(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"],
            env["MASTER_ADDR"], env["MASTER_PORT"]) == ("3", "4", "1", "2", "127.0.0.7", "29500")


def test_exit_rank_flushes_what_the_rank_printed_and_exits_with_the_code():
    """``os._exit`` skips the interpreter's own flush: a rank's last JSON line to a pipe would be
    lost without exit_rank's (torchrun starts ranks with ``python -u``; srun and mpirun do not)."""
    code = "from memlab.distributed.launch_env import exit_rank; print(17); exit_rank(3); print(18)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).parent.parent, env=env)
    assert (done.stdout, done.returncode) == ("17\n", 3)


def test_zero_worker_under_srun_reads_slurm_not_rank(monkeypatch, capsys):
    """``srun python -m memlab.distributed.zero_worker`` sets no RANK: it used to KeyError."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "LOCAL_SIZE", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {**SLURM, "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2",
                       "SLURM_TASKS_PER_NODE": "2", "SLURM_NODEID": "0"}.items():
        monkeypatch.setenv(key, value)
    seen = {}
    deepspeed = pytest.importorskip("deepspeed")
    monkeypatch.setattr(deepspeed, "init_distributed", lambda dist_backend: seen.setdefault("backend", dist_backend))

    from memlab.distributed.deepspeed_zero import RankResult

    def rank_step(rank, world, step):
        seen.update(rank=rank, world=world, zero=step.zero, world_size=step.world_size)
        return RankResult(rank=rank, device="cpu", optimizer="AdamW", host_accounts=())

    monkeypatch.setattr(zero_worker, "zero_rank_step", rank_step)
    saved = dict(os.environ)
    try:
        zero_worker.main(["--zero", "2"])  # exports RANK, MASTER_ADDR, ... into os.environ
    finally:  # monkeypatch restores only what it set: the exports must not reach later tests' ranks
        os.environ.clear()
        os.environ.update(saved)
    assert seen == {"backend": "gloo", "rank": 1, "world": 2, "zero": 2, "world_size": 2}
    last = capsys.readouterr().out.strip().splitlines()[-1]  # DeepSpeed may log before it
    line = json.loads(last)
    assert (line["world_size"], line["rank"], line["host_accounts"]) == (2, 1, [])
    assert RankResult.from_dict(line).rank == 1


# --------------------------------------------------------------------------------------
# FSDP2 measured on real ranks, against its simulation on a fake process group
# --------------------------------------------------------------------------------------
def _fsdp_pair(**kw):
    from memlab.distributed.fsdp import measure_sharded, simulate_sharded
    from memlab.step.training_step import StepConfig

    step = StepConfig(model="tiny", seq=32, batch=2)
    return measure_sharded(step, 2, backend="gloo", **kw), simulate_sharded(step, 2, **kw)


# slow: under a loaded 2-core run (make test, two workers) its ranks once timed out at the
# rendezvous and once read rank 0 1.5% above rank 1; alone it passes in about 16 s
@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_on_two_gloo_ranks_equals_its_simulation():
    """FSDP2's default (reshard_after_forward): the real ranks and the fake group run the same
    FSDPMemTracker over the same step; both ranks hold equal padded shards."""
    real, fake = _fsdp_pair()
    assert len(real.per_rank) == 2
    assert abs(real.peak_bytes / fake.peak_bytes - 1) < 0.02
    assert real.per_rank[0].peak_bytes == real.per_rank[1].peak_bytes
    for cat in ("parameters", "gradients", "optimizer"):
        assert real.by_category[cat] == fake.by_category[cat], cat


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_without_resharding_holds_gathered_parameters_longer():
    real, fake = _fsdp_pair(reshard_after_forward=False)
    default, _ = _fsdp_pair()
    assert abs(real.peak_bytes / fake.peak_bytes - 1) < 0.02
    assert real.peak_bytes > default.peak_bytes  # gathered weights kept to the backward


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_cpu_offload_on_cpu_ranks_moves_nothing_and_says_so():
    from memlab.distributed.fsdp import measure_sharded
    from memlab.step.training_step import StepConfig

    step = StepConfig(model="tiny", seq=32, batch=2)
    off, on = measure_sharded(step, 2, cpu_offload=True), measure_sharded(step, 2)
    assert off.by_category["optimizer"] == on.by_category["optimizer"]
    assert any("one memory" in n for n in off.notes)


def test_cli_measure_fsdp_refuses_what_it_cannot_honour(capsys):
    from memlab.app import cli

    assert cli.main(["measure", "--fsdp", "--zero", "2", "--world-size", "2"]) == 2
    assert "ZeRO-3" in capsys.readouterr().err
    assert cli.main(["measure", "--fsdp", "--offload", "optimizer", "--world-size", "2"]) == 2
    assert cli.main(["measure", "--cpu-offload"]) == 2
    assert "add --fsdp" in capsys.readouterr().err
