"""Lessons 10-11: a DeepSpeed ZeRO / ZeRO-Offload config and ``deepspeed.initialize``, checked as rank 0 of N
(:func:`memlab.distributed.deepspeed_rank0.fake_ranks`)."""
from __future__ import annotations

from typing import Callable

from memlab.classroom.exercises.common import CheckResult, call_learner, fail, require
from memlab.core.errors import InputError
from memlab.core.units import fmt_bytes
from memlab.distributed.deepspeed_rank0 import fake_ranks, import_deepspeed, run_deepspeed
from memlab.models.gpt_unet import get_config
from memlab.step.zero import zero_formula

BUCKET_LIMIT = 2**24  # elements; DeepSpeed's defaults (5e8) make GiB-sized buckets



def _config_errors(config: dict, *, stage: int, ranks: int, micro_batch: int,
                   accumulation: int) -> str | None:
    """The first thing wrong with the batch keys, the stage or the buckets, in words."""
    keys = {"train_batch_size": micro_batch * accumulation * ranks,
            "train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": accumulation}
    for key, want in keys.items():
        if key not in config:
            return f"set {key} explicitly (here {want})"
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if config[key] != keys[key]:
            return f"{key} is {config[key]}, the exercise asks for {keys[key]}"
    tbs = config["train_batch_size"]
    if tbs != keys["train_batch_size"]:
        return (f"train_batch_size is {tbs}, but micro-batch {micro_batch} x accumulation "
                f"{accumulation} x ranks {ranks} = {keys['train_batch_size']}: DeepSpeed counts "
                f"every sample of every micro-batch on every rank in one optimizer step")
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict) or zero.get("stage") != stage:
        got = zero.get("stage") if isinstance(zero, dict) else None
        return f"zero_optimization.stage is {got}, the exercise asks for stage {stage}"
    buckets = ["reduce_bucket_size", "allgather_bucket_size"]
    buckets += ["stage3_prefetch_bucket_size"] if stage == 3 else []
    for key in buckets:
        value = zero.get(key, 5e8)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= BUCKET_LIMIT:
            millions = get_config("tiny").num_params() / 1e6
            return (f"zero_optimization.{key} is {zero.get(key, 'unset (DeepSpeed: 500,000,000)')}: "
                    f"a bucket of that many fp32 elements is GiB-sized per rank, for a model of "
                    f"{millions:.1f}M parameters; set it to about 2**20 (at most {BUCKET_LIMIT:,})")
    return None


def _check_deepspeed(name: str, config: dict, make_engine: Callable, *, stage: int, ranks: int,
                     micro_batch: int, accumulation: int, offload: bool) -> CheckResult:
    import_deepspeed()  # its first import compiles probes: their linker output stays out of the lesson
    from deepspeed.runtime.config import DeepSpeedConfig
    require(name, "config", config, "the DeepSpeed config dict (batch keys, zero_optimization)", call=False)
    require(name, "make_engine", make_engine, "def make_engine(model): deepspeed.initialize(...)")
    if stage not in (1, 2, 3):
        raise InputError(f"stage={stage!r}; allowed: 1, 2, 3 (the ZeRO stages that shard)")
    for arg, value in (("ranks", ranks), ("micro_batch", micro_batch), ("accumulation", accumulation)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{arg} must be a positive integer, got {value!r}")
    if not isinstance(config, dict):
        fail(name, f"the config is a dict (DeepSpeed also reads a JSON file), got {type(config).__name__}")
    problem = _config_errors(config, stage=stage, ranks=ranks, micro_batch=micro_batch,
                             accumulation=accumulation)
    if problem:
        fail(name, problem)
    off = config["zero_optimization"].get("offload_optimizer")
    if offload and (not isinstance(off, dict) or off.get("device") != "cpu"):
        fail(name, f"zero_optimization.offload_optimizer is {off}: offload the optimizer with "
                    f"{{'device': 'cpu'}}")
    if not offload and off not in (None, {}) and off.get("device", "none") != "none":
        fail(name, "this exercise keeps the optimizer on the device: remove offload_optimizer")
    with fake_ranks(ranks):
        try:
            DeepSpeedConfig(config)
        except Exception as e:  # pydantic's ValidationError or DeepSpeed's own assertions
            fail(name, "DeepSpeed rejected the config: " + " ".join(str(e).split("\n")[:3]))
    got = call_learner(name, "make_engine", run_deepspeed, config, ranks, make_engine)
    if got["engine"] != "DeepSpeedEngine":
        fail(name, f"make_engine returned a {got['engine']}: return the engine, the first of "
                    f"the four values deepspeed.initialize returns")
    if got["zero_stage"] != stage or not got["accounting"]:
        fail(name, f"the engine runs ZeRO stage {got['zero_stage']} with optimizer "
                    f"{got['optimizer']}: pass config=your dict to deepspeed.initialize, with an "
                    f"optimizer section")
    n, acc = got["num_params"], got["accounting"]
    want = zero_formula(n, stage, ranks, param_bytes=4, grad_bytes=4)
    state = acc["fp32_master"] + acc["optimizer_state"]
    if abs(state / want["optimizer"] - 1) > 0.01:
        fail(name, f"rank 0 holds {fmt_bytes(state)} of fp32 master and Adam state, the ZeRO "
                    f"formula {fmt_bytes(want['optimizer'])} (12 bytes x {n:,} / {ranks})")
    if offload and not got["offload_optimizer"]:
        fail(name, "DeepSpeed did not offload the optimizer: check zero_optimization.offload_optimizer")
    lines = [f"DeepSpeed accepted it: stage {stage}, train_batch_size {got['train_batch_size']} = "
             f"{micro_batch} x {accumulation} x {ranks} ranks",
             f"rank 0 of {ranks}: fp32 master + Adam {fmt_bytes(state)} = 12 B x {n:,} / {ranks}"]
    if stage >= 2 and not offload:
        lines.append(f"gradient partition {fmt_bytes(acc['gradients'])} = 4 B x {n:,} / {ranks}")
    if offload:
        host = state + acc["host_gradients"]
        lines.append(f"in host memory: master, moments and the fp32 gradient partition "
                     f"({fmt_bytes(acc['host_gradients'])}), {fmt_bytes(host)} = 16 B x {n:,} / {ranks}")
    return CheckResult(name, {**{k: float(v) for k, v in acc.items()},
                              "train_batch_size": got["train_batch_size"]}, lines)


def check_zero_config(config: dict, make_engine: Callable, *, stage: int = 2, ranks: int = 2,
                      micro_batch: int = 4, accumulation: int = 2) -> CheckResult:
    """A DeepSpeed ZeRO config and the learner's ``make_engine(model)`` (which calls
    ``deepspeed.initialize``), run as rank 0 of ``ranks``: batch keys consistent
    (``train_batch_size = micro_batch x accumulation x ranks``), the stage asked for, explicit
    buckets, accepted by ``DeepSpeedConfig``, and the rank's optimizer state 12 B/param / N."""
    return _check_deepspeed("ZeRO config", config, make_engine, stage=stage, ranks=ranks,
                            micro_batch=micro_batch, accumulation=accumulation, offload=False)


def check_offload_config(config: dict, make_engine: Callable, *, stage: int = 2, ranks: int = 2,
                         micro_batch: int = 4, accumulation: int = 2) -> CheckResult:
    """:func:`check_zero_config` for ZeRO-Offload: the optimizer offloaded to the CPU, and what
    lives in host memory measured (fp32 master, Adam's moments and the fp32 gradient partition)."""
    return _check_deepspeed("offload config", config, make_engine, stage=stage, ranks=ranks,
                            micro_batch=micro_batch, accumulation=accumulation, offload=True)


