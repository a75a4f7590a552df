"""DeepSpeed as rank 0 of N in this process: a fake process group, DeepSpeed's own reading of a
config's batch keys, and two steps of the tiny GPT under ``deepspeed.initialize`` with the rank's
exact bytes. The ZeRO lessons use these as tools; the ZeRO exercise checkers build on them."""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from typing import Callable

import torch

from memlab.core.quiet import quiet_build
from memlab.distributed.deepspeed_zero import zero_accounting
from memlab.distributed.ranks import fake_process_group, set_cache_env
from memlab.models.gpt_unet import GPT, get_config
from memlab.step.training_step import StepConfig, make_batch


def import_deepspeed():
    """``import deepspeed``, quietly: at its first import it probes every op it could build
    by compiling and linking a test program (``/usr/bin/ld: cannot find -laio`` where libaio
    is missing), output that reaches a notebook through the file descriptors
    (:func:`memlab.core.quiet.quiet_build` keeps it). ``DS_ACCELERATOR=cpu`` without a GPU, which
    it reads at import (:func:`~memlab.distributed.ranks.set_cache_env`)."""
    set_cache_env()
    if "deepspeed" not in sys.modules:
        with quiet_build():
            import deepspeed  # noqa: F401
    return sys.modules["deepspeed"]


@contextlib.contextmanager
def fake_ranks(world_size: int = 2):
    """This process as rank 0 of ``world_size`` for DeepSpeed, without other processes.

    A fake process group (``torch.testing._internal.distributed.fake_pg``: every collective
    returns at once) stands in for the job, so ``deepspeed.initialize`` builds the partitions
    rank 0 of a real job holds. Nothing is exchanged: averaged gradients and gathered ZeRO-3
    weights are wrong, so use it for configs and bytes, not for losses. The group, DeepSpeed's
    handle on it and the environment it reads are undone on exit.
    """
    deepspeed = import_deepspeed()
    import deepspeed.comm.comm as ds_comm
    import deepspeed.utils.groups as ds_groups
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size),
           "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    before = {k: os.environ.get(k) for k in env}
    log = logging.getLogger("DeepSpeed")
    level = log.level
    try:
        os.environ.update(env)
        with fake_process_group(world_size), warnings.catch_warnings():  # validates world_size, refuses a second group
            # DeepSpeed's ZeRO calls torch's all_gather_into_tensor / reduce_scatter_tensor, which
            # torch 2.13 deprecates (for *_single): a warning per call memlab cannot avoid
            warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated",
                                    category=FutureWarning)
            log.setLevel(logging.ERROR)
            with quiet_build():  # DeepSpeed builds its shared-memory op here (and prints it)
                deepspeed.init_distributed(dist_backend="gloo")  # wraps the group made above
            yield
    finally:
        # DeepSpeed caches the group and its world group; the next fake_ranks makes new ones
        ds_comm.cdb = None
        ds_groups._WORLD_GROUP = None
        log.setLevel(level)
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def deepspeed_batch_sizes(config: dict, ranks: int) -> dict:
    """What DeepSpeed makes of a config's batch keys on ``ranks`` data-parallel ranks:
    ``train_batch_size``, ``train_micro_batch_size_per_gpu`` and
    ``gradient_accumulation_steps``, derived and checked by ``DeepSpeedConfig`` itself
    (``train_batch_size = micro-batch x accumulation x ranks``), or ``{"error": message}``."""
    import_deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig
    with fake_ranks(ranks):
        try:
            c = DeepSpeedConfig(config)
        except (AssertionError, ValueError) as e:
            return {"error": " ".join(str(e).splitlines()[:3])}
    return {"train_batch_size": c.train_batch_size,
            "train_micro_batch_size_per_gpu": c.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": c.gradient_accumulation_steps}


def engine_step(engine, seq: int = 32) -> dict:
    """Two optimizer steps (the first creates Adam's state); DeepSpeed's per-rank accounting
    is read after the last backward, where the gradients are held, with the fp32 gradient
    partition that ZeRO-Offload keeps next to the master weights."""
    micro = engine.train_micro_batch_size_per_gpu()
    k = engine.gradient_accumulation_steps()
    batch = make_batch(StepConfig(model="tiny", seq=seq, batch=micro), engine.device)
    stage = engine.zero_optimization_stage()
    acc = {}
    for _ in range(2):
        for i in range(k):
            engine.backward(engine(*batch))
            if i == k - 1:
                acc = zero_accounting(engine, stage)
            engine.step()
    return acc


def run_deepspeed(config: dict, ranks: int = 2, make_engine: Callable | None = None) -> dict:
    """Build the tiny GPT, ``deepspeed.initialize`` it with ``config`` as rank 0 of ``ranks``
    (:func:`fake_ranks`), run two steps and return what the engine decided: ZeRO stage, batch
    sizes, offload, whether activation checkpointing was configured, and the rank's exact
    bytes (``memlab.distributed.deepspeed_zero.zero_accounting``). ``make_engine(model)`` replaces the
    plain ``deepspeed.initialize`` call."""
    deepspeed = import_deepspeed()
    with fake_ranks(ranks):
        torch.manual_seed(0)
        model = GPT(get_config("tiny"))
        if make_engine is None:
            engine = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config)[0]
        else:
            engine = make_engine(model)
        engine = engine[0] if isinstance(engine, tuple) else engine
        if not isinstance(engine, deepspeed.DeepSpeedEngine):
            return {"engine": type(engine).__name__}
        opt = engine.optimizer
        out = {"engine": type(engine).__name__, "optimizer": type(opt).__name__,
               "zero_stage": engine.zero_optimization_stage(),
               "train_batch_size": engine.train_batch_size(),
               "train_micro_batch_size_per_gpu": engine.train_micro_batch_size_per_gpu(),
               "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
               "offload_optimizer": bool(getattr(opt, "cpu_offload", False)
                                         or getattr(opt, "offload_optimizer", False)),
               "activation_checkpointing_configured": deepspeed.checkpointing.is_configured(),
               "num_params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                                 for p in model.parameters())}
        has_step = hasattr(opt, "step") and hasattr(opt, "backward")
        out["accounting"] = engine_step(engine) if has_step else {}
    return out

