"""``torchrun --nproc-per-node N -m memlab.distributed tp|pp``: one process per rank (torchrun
sets RANK, WORLD_SIZE, ...); rank 0 prints every rank's numbers as JSON."""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from memlab.core.hardware import place_ranks
from memlab.distributed.launch_env import exit_rank, launcher_env
from memlab.distributed.pipeline_parallel import pp_worker
from memlab.distributed.tensor_parallel import tp_worker
from memlab.lenses.parallel_formulas import SCHEDULES


def main(argv: list[str] | None = None) -> list[dict] | None:
    """``torchrun --nproc-per-node N -m memlab.distributed tp|pp ...``: rank 0 prints JSON."""
    ap = argparse.ArgumentParser(prog="python -m memlab.distributed",
                                 description="tensor (tp) or pipeline (pp) parallel step, "
                                             "per-rank memory as JSON")
    ap.add_argument("mode", choices=("tp", "pp"))
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--attention", default="sdpa", choices=("sdpa", "naive"))
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--schedule", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    ap.add_argument("--no-check", dest="check", action="store_false",
                    help="skip the single-process reference (needed when the whole model "
                         "does not fit one rank)")
    args = ap.parse_args(argv)
    # torchrun's (or deepspeed's, Slurm's) variables, exported for init_process_group
    job = launcher_env()
    job.apply()
    # the launcher started local_world_size ranks on this machine: they share its GPUs
    placement = place_ranks(job.local_world_size)
    os.environ.update(placement.rank_env())
    if placement.backend == "nccl":
        torch.cuda.set_device(job.local_rank)
    dist.init_process_group(placement.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        common = dict(model=args.model, seq=args.seq, batch=args.batch, attention=args.attention,
                      check=args.check)
        if args.mode == "tp":
            out = tp_worker(rank, world, **common)
        else:
            out = pp_worker(rank, world, micro_batches=tuple(args.micro_batches),
                            schedules=tuple(args.schedule), **common)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(out, gathered, dst=0)
        if rank == 0:
            print(json.dumps(gathered, indent=1, default=str))
        return gathered
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_rank()
