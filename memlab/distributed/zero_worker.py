"""ZeRO step as a plain script, for launchers that start the ranks themselves.

One machine or many, the same file::

    torchrun --nproc-per-node 2 -m memlab.distributed.zero_worker --zero 2
    deepspeed --hostfile hostfile -m memlab.distributed.zero_worker --zero 3 --offload optimizer
    srun --ntasks 2 python -m memlab.distributed.zero_worker --zero 2

(every launcher's variables: :func:`memlab.distributed.launch_env.launcher_env`)

Each rank prints one JSON line: its exact ZeRO accounting and tracked peak (bytes).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from memlab.core.hardware import place_ranks
from memlab.distributed.deepspeed_zero import zero_rank_step
from memlab.distributed.launch_env import exit_rank, launcher_env
from memlab.distributed.ranks import set_cache_env
from memlab.step.training_step import StepConfig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4, help="per-rank batch")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--zero", type=int, default=2, choices=(0, 1, 2, 3))
    ap.add_argument("--offload", default="none", choices=("none", "optimizer", "all"))
    ap.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    args = ap.parse_args(argv)
    # torchrun's, deepspeed's, accelerate's or Slurm's variables (launch_env.launcher_env), exported
    # as the RANK/WORLD_SIZE/MASTER_* that DeepSpeed's init_distributed reads
    job = launcher_env()
    job.apply()
    rank, world = job.rank, job.world_size
    # the launcher started local_world_size ranks on this machine: they share its GPUs
    placement = place_ranks(job.local_world_size)
    os.environ.update(placement.rank_env())
    set_cache_env()
    if placement.backend == "nccl":
        torch.cuda.set_device(job.local_rank)
    import deepspeed  # optional and heavy; after rank_env(), which it reads at import
    deepspeed.init_distributed(dist_backend=placement.backend)
    step = StepConfig(model=args.model, seq=args.seq, batch=args.batch, precision=args.precision,
                      zero=args.zero, world_size=world, offload=args.offload)
    out = zero_rank_step(rank, world, step).to_dict()  # RankResult.from_dict reads it back
    # One write per rank: the ranks share torchrun's stdout, where print() writes the line and
    # its newline as two writes when stdout is unbuffered, and two ranks' lines then run
    # together (seen in CI). One write of less than PIPE_BUF bytes to a pipe is atomic (POSIX).
    sys.stdout.write(json.dumps({"world_size": world, **out}) + "\n")
    sys.stdout.flush()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_rank()
