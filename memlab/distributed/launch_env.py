"""Where this process stands in a job that a launcher started.

:func:`launcher_env` reads it from the variables each launcher sets, so that the workers (``python -m memlab.distributed
.zero_worker``, ``python -m memlab.distributed tp|pp``) run under any of them::

    torchrun --nproc-per-node 2 -m memlab.distributed.zero_worker --zero 2
        # RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, GROUP_RANK
    deepspeed --num_gpus 2 --module memlab.distributed.zero_worker --zero 3
        # RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, MASTER_ADDR, MASTER_PORT (and --local_rank)
    deepspeed --launcher openmpi --hostfile hosts --module memlab.distributed.zero_worker
        # OMPI_COMM_WORLD_RANK, _LOCAL_RANK, _SIZE, _LOCAL_SIZE (MASTER_ADDR from --master_addr)
    accelerate launch --num_processes 2 -m memlab.distributed.zero_worker --zero 2
        # torchrun's variables (accelerate starts the ranks with torch's elastic launcher)
    srun --ntasks 4 --ntasks-per-node 2 python -m memlab.distributed.zero_worker --zero 2
        # SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_NTASKS_PER_NODE or
        # SLURM_TASKS_PER_NODE, SLURM_NODEID; the rendezvous is SLURM_LAUNCH_NODE_IPADDR or
        # the first host of SLURM_NODELIST, port MASTER_PORT or 29500

A launcher's own variables win over Slurm's (``srun torchrun ...`` is torchrun's job).
"""
from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from memlab.core.errors import InputError

#: torch.distributed's default rendezvous port (torchrun's --master-port default)
DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class LaunchEnv:
    """This process in a job: ``launcher`` ("torchrun", "deepspeed", "mpi", "slurm" or
    "none" for a process nobody launched), its global ``rank`` and ``local_rank`` on its node,
    ``world_size`` and ``local_world_size`` (ranks on this node), ``node_rank`` and the
    rendezvous ``master_addr``/``master_port``."""

    launcher: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int

    def apply(self, environ: "os._Environ | dict | None" = None) -> None:
        """Write the variables ``init_process_group("env://")`` and DeepSpeed read (RANK,
        LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) into ``environ``
        (default ``os.environ``); what a launcher already set stays as it set it."""
        env = os.environ if environ is None else environ
        for key, value in (("RANK", self.rank), ("LOCAL_RANK", self.local_rank),
                           ("WORLD_SIZE", self.world_size), ("LOCAL_WORLD_SIZE", self.local_world_size),
                           ("MASTER_ADDR", self.master_addr), ("MASTER_PORT", self.master_port)):
            env.setdefault(key, str(value))


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``"gpu[03-05,9],cpu1"`` -> ``"gpu03"``
    (what ``scontrol show hostnames`` prints first)."""
    head = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not head or not head.group(1):
        raise InputError(f"SLURM_NODELIST={nodelist!r} names no host")
    if head.group(2) is None:
        return head.group(1)
    first = head.group(2).split(",")[0].split("-")[0]
    return head.group(1) + first


def _tasks_on_node(env: Mapping[str, str], world: int) -> int:
    if "SLURM_NTASKS_PER_NODE" in env:
        return int(env["SLURM_NTASKS_PER_NODE"])
    if "SLURM_TASKS_PER_NODE" in env:  # "2(x3),1": 2 tasks on each of 3 nodes, then 1
        return int(re.match(r"\d+", env["SLURM_TASKS_PER_NODE"]).group(0))
    nodes = int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1")))
    return max(1, world // max(1, nodes))


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise InputError(f"{key}={env[key]!r} is not a whole number") from None


def launcher_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Where this process stands, read from what its launcher set (module docstring):
    torchrun's and ``accelerate launch``'s, DeepSpeed's (its own launcher or OpenMPI), or
    Slurm's ``srun``; a process started by none of them is rank 0 of 1.

    Args:
        environ: the variables (default ``os.environ``).
    Returns:
        a :class:`LaunchEnv`; ``.apply()`` exports it for ``init_process_group``.
    """
    env = os.environ if environ is None else environ
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_MASTER_PORT
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        if "LOCAL_WORLD_SIZE" in env:  # torchrun (also under accelerate launch)
            launcher, local_world = "torchrun", _int(env, "LOCAL_WORLD_SIZE")
        elif "LOCAL_SIZE" in env:  # deepspeed/launcher/launch.py
            launcher, local_world = "deepspeed", _int(env, "LOCAL_SIZE")
        else:
            launcher, local_world = "torchrun", world
        local = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank % local_world
        node = _int(env, "GROUP_RANK") if "GROUP_RANK" in env else rank // local_world
    elif "OMPI_COMM_WORLD_RANK" in env:
        launcher = "mpi"
        rank, world = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
        local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
        node = rank // local_world
    elif "SLURM_PROCID" in env:
        launcher = "slurm"
        rank = _int(env, "SLURM_PROCID")
        world = _int(env, "SLURM_NTASKS") if "SLURM_NTASKS" in env else 1
        local = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        local_world = _tasks_on_node(env, world)
        node = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else rank // local_world
        if "MASTER_ADDR" not in env:
            if "SLURM_LAUNCH_NODE_IPADDR" in env:
                addr = env["SLURM_LAUNCH_NODE_IPADDR"]
            elif "SLURM_NODELIST" in env or "SLURM_JOB_NODELIST" in env:
                addr = first_host(env.get("SLURM_NODELIST", env.get("SLURM_JOB_NODELIST", "")))
    else:
        return LaunchEnv("none", 0, 0, 1, 1, 0, addr, port)
    if not (0 <= rank < world) or not (0 <= local < local_world) or world < 1:
        raise InputError(f"{launcher}: rank {rank} (local {local}) outside world {world} "
                         f"(local {local_world})")
    return LaunchEnv(launcher, rank, local, world, local_world, node, addr, port)


def exit_rank(code: int = 0) -> None:
    """End a launched rank's process once its work is done and printed: flush stdout and stderr,
    then ``os._exit(code)``, as :mod:`multiprocessing` ends a forked child.

    Why not a normal exit: after the last Python line, in the interpreter's and the C++
    libraries' exit handlers, a gloo rank under torchrun sometimes aborts ("terminate called
    without an active exception", SIGABRT, ``faulthandler`` shows no Python frame). On a loaded
    2-core machine ``python -m memlab.distributed pp`` did so in 5 of 166 runs, every time
    after rank 0 had printed the complete result; torchrun then reports the job failed. The
    caller destroys its process group first; nothing is left to run.

    Args:
        code: the exit status.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


__all__ = ["DEFAULT_MASTER_PORT", "LaunchEnv", "exit_rank", "first_host", "launcher_env"]
