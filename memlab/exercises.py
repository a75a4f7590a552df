"""Checkers for the learners' own code: one ``check_<name>`` per "Your turn" exercise.

Each checker runs the learner's code on the tiny model, next to a reference, and says what is
right or wrong in measured terms: gradients against the reference within a stated tolerance,
bytes saved against a formula, a DeepSpeed config against DeepSpeed itself. A correct answer
returns a :class:`CheckResult` (printed in the notebook); a wrong one raises
``AssertionError`` with a specific message, so a notebook whose solution has rotted fails
under nbval.

>>> result = check_accumulation(accumulate)      # accumulate(model, optimizer, batch, k)
>>> result.measured["max_grad_diff"]

The DeepSpeed checkers run ``deepspeed.initialize`` in this process as rank 0 of N, on a fake
process group (:func:`fake_ranks`): DeepSpeed builds exactly the partitions that rank holds,
while collectives exchange nothing. Bytes and configs are real; losses are not.
"""
from __future__ import annotations

import contextlib
import io
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .distributed import set_cache_env, zero_accounting
from .estimate import layer_activation_bytes, zero_formula
from .hardware import resolve_budget
from .measure import measure_step
from .models import GPT, get_config
from .step import StepConfig, make_batch
from .techniques import relative_error
from .tracking import CATEGORIES, MemoryTracker
from .units import fmt_bytes
from .errors import InputError

BUCKET_LIMIT = 2**24  # elements; DeepSpeed's defaults (5e8) make GiB-sized buckets


@dataclass
class CheckResult:
    """A passed check: what was measured, and what it means."""

    exercise: str
    measured: dict[str, float]
    lines: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join([f"PASSED {self.exercise}"] + [f"  {line}" for line in self.lines])

    __repr__ = __str__


class CheckFailed(AssertionError):
    """The learner's code is wrong; the message says how. (An ``AssertionError``, so nbval and
    pytest report it as a failed check.)"""


def _fail(exercise: str, message: str) -> None:
    raise CheckFailed(f"{exercise}: {message}")


def _rel_diff(got: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> float:
    """Largest absolute difference over all tensors, relative to the reference's largest value."""
    diff = max((g.float() - r.float()).abs().max().item() for g, r in zip(got, ref))
    return diff / max(r.abs().max().item() for r in ref)


def _norm(ts: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(t.float().pow(2).sum().item() for t in ts))


def _tiny(seed: int = 0, device: str | torch.device = "cpu", **overrides) -> GPT:
    torch.manual_seed(seed)
    with torch.device(device):
        return GPT(get_config("tiny", **overrides))


def _max_activations(tracker: MemoryTracker) -> int:
    i = CATEGORIES.index("activations")
    return max((e.by_category[i] for e in tracker.timeline), default=0)


def _call(exercise: str, what: str, fn: Callable, *args):
    """Run the learner's function; an exception becomes a message naming it."""
    try:
        return fn(*args)
    except CheckFailed:
        raise
    except Exception as e:  # the learner's code: report, do not crash the checker
        _fail(exercise, f"{what} raised {type(e).__name__}: {e}")


# --------------------------------------------------------------------------------------
# 02: fix the out-of-memory step
# --------------------------------------------------------------------------------------
def check_oom_fix(fixed: StepConfig, original: StepConfig, budget: int | str, *,
                  device: str = "cpu") -> CheckResult:
    """The learner's ``fixed`` step (``replace(original, ...)``) trains the same model on the
    same sequence length and now fits ``budget``, measured."""
    name = "fix the OOM"
    if resolve_budget(budget) is None:
        raise InputError("check_oom_fix needs the lesson's budget, e.g. '120MiB' or 'T4-16GB'")
    if not isinstance(fixed, StepConfig):
        _fail(name, f"expected a StepConfig such as replace(STEP, checkpointing='full'), got "
                    f"{type(fixed).__name__}")
    if fixed.model_config.name != original.model_config.name or fixed.seq != original.seq:
        _fail(name, f"the fix trains {fixed.model_config.name} at seq {fixed.seq}, the lesson "
                    f"{original.model_config.name} at seq {original.seq}: keep the model and the "
                    f"sequence, change how the step runs (or its batch)")
    rep = measure_step(fixed, budget=budget, device=device)
    if not rep.fits:
        _fail(name, f"still out of memory: {rep.oom.message} The culprit is "
                    f"{rep.oom.culprit}: checkpointing, a smaller micro-batch or 16-bit "
                    f"activations shrink activations; precision='pure-bf16' also halves model states")
    lines = [f"peak {fmt_bytes(rep.peak_bytes)} within the budget {fmt_bytes(rep.budget_bytes)} "
             f"(headroom {fmt_bytes(rep.headroom_bytes)})"]
    samples = fixed.batch
    if samples < original.batch:
        lines.append(f"note: each optimizer step now sees {samples} samples instead of "
                     f"{original.batch}; micro_batches keeps the batch (lesson 05)")
    return CheckResult(name, {"peak_bytes": rep.peak_bytes, "budget_bytes": rep.budget_bytes,
                              "batch": samples}, lines)


# --------------------------------------------------------------------------------------
# 03: the autocast + GradScaler step
# --------------------------------------------------------------------------------------
AMP_TOLERANCE = 1e-3  # relative difference of a weight update against the reference step


def reference_amp_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                       scaler: torch.amp.GradScaler, batch: tuple) -> torch.Tensor:
    """fp16 autocast with loss scaling, as ``torch.amp`` documents it (the checker's reference)."""
    optimizer.zero_grad(set_to_none=True)
    with torch.amp.autocast(batch[0].device.type, dtype=torch.float16):
        loss = model(*batch)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss.detach()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _amp_run(step_fn: Callable, batches: list[tuple], device: torch.device):
    """Two steps, then one whose scaled loss overflows fp16; the weights after each."""
    model = _tiny(device=device, n_layer=2)  # fp16 matmuls are slow on a CPU: two blocks
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # SGD: a wrong scale shows in the update
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**16)
    snaps = [_params(model)]
    for b in batches:
        step_fn(model, opt, scaler, b)
        snaps.append(_params(model))
    scaler.update(new_scale=2.0**40)  # 2^40 x the loss overflows fp16 in backward: a step to skip
    step_fn(model, opt, scaler, batches[0])
    snaps.append(_params(model))
    return snaps, scaler.get_scale()


def check_amp_step(amp_step: Callable, *, device: str = "cpu") -> CheckResult:
    """``amp_step(model, optimizer, scaler, batch)``: one fp16 mixed-precision training step.

    Checked: no deprecated ``torch.cuda.amp``; the Linear layers compute in fp16; two weight
    updates equal the reference's within :data:`AMP_TOLERANCE` (SGD, so a missing scale or
    unscale shows as a factor 2^16); after an fp16 overflow the step is skipped and the scale
    halved (what ``scaler.step`` and ``scaler.update`` do).
    """
    name = "autocast + GradScaler"
    dev = torch.device(device)
    step = StepConfig(model="tiny", seq=16, batch=2)
    batches = [make_batch(step, dev, seed=s) for s in (0, 1)]
    ref, ref_scale = _amp_run(reference_amp_step, batches, dev)
    dtypes: set[torch.dtype] = set()

    def linear_dtype(module, args, out):
        if isinstance(module, nn.Linear):
            dtypes.add(out.dtype)

    hook = torch.nn.modules.module.register_module_forward_hook(linear_dtype)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, scale = _amp_run(lambda *a: _call(name, "your step", amp_step, *a), batches, dev)
    finally:
        hook.remove()
    old = [str(w.message) for w in caught if "torch.cuda.amp" in str(w.message)]
    if old:
        _fail(name, f"torch.cuda.amp is deprecated ({old[0]}) and, without CUDA, disabled: use "
                    f"torch.amp.autocast(device_type, dtype=torch.float16) and "
                    f"torch.amp.GradScaler(device_type)")
    if torch.float16 not in dtypes:
        seen = ", ".join(sorted(str(d) for d in dtypes)) or "nothing"
        hint = (" bf16 has fp32's exponent range and needs no scaler; this exercise is fp16"
                if torch.bfloat16 in dtypes else "")
        _fail(name, f"the Linear layers computed in {seen}: run the forward (it returns the loss) "
                    f"inside torch.amp.autocast(device_type, dtype=torch.float16).{hint}")
    diffs = []
    for k in (1, 2):
        upd = [a - b for a, b in zip(got[k], got[k - 1])]
        ref_upd = [a - b for a, b in zip(ref[k], ref[k - 1])]
        ratio = _norm(upd) / _norm(ref_upd)
        diff = relative_error(upd, ref_upd)
        diffs.append(diff)
        if diff <= AMP_TOLERANCE:
            continue
        msg = f"weight update {k} differs from the reference by {diff:.1e} (allowed {AMP_TOLERANCE:g})"
        if ratio == 0:
            _fail(name, f"{msg}: the weights did not move; call scaler.step(optimizer)")
        if abs(math.log2(ratio) - 16) < 0.5:
            _fail(name, f"{msg}: it is 2^16 times too large, the gradients were still scaled; "
                        f"scaler.step(optimizer) unscales them before stepping")
        if abs(math.log2(ratio) + 16) < 0.5:
            _fail(name, f"{msg}: it is 2^16 times too small; backpropagate scaler.scale(loss), "
                        f"since scaler.step divides by the scale")
        if k == 2:
            _fail(name, f"{msg}, the first one matched: zero the gradients once per step "
                        f"(optimizer.zero_grad(set_to_none=True))")
        _fail(name, f"{msg} (update x{ratio:.3g})")
    moved = max((a - b).abs().max().item() for a, b in zip(got[3], got[2]))
    if not math.isfinite(moved) or moved > 0:
        _fail(name, f"after an fp16 overflow (inf gradients) your step still changed the weights "
                    f"(by {moved}): scaler.step(optimizer) skips such a step, optimizer.step() does not")
    if scale != ref_scale:
        _fail(name, f"after an overflow the loss scale is {scale:g}, expected {ref_scale:g}: "
                    f"call scaler.update() after scaler.step(optimizer) (it halves the scale on overflow)")
    return CheckResult(name, {"update_diff_1": diffs[0], "update_diff_2": diffs[1],
                              "scale_after_overflow": scale},
                       [f"Linear layers in fp16; weight updates match the reference within "
                        f"{max(diffs):.1e} (allowed {AMP_TOLERANCE:g})",
                        f"overflow: step skipped, scale 2^40 -> 2^{math.log2(scale):g}"])


# --------------------------------------------------------------------------------------
# 04: checkpoint a block's forward
# --------------------------------------------------------------------------------------
CKPT_TOLERANCE = 1e-6  # recomputation repeats the same operations: gradients match to rounding


def _forward_kept(model: GPT, batch: tuple) -> tuple[torch.Tensor, int]:
    """Run forward under the tracker; return the loss and the activations it kept."""
    tracker = MemoryTracker()
    with tracker:
        tracker.track_model(model)
        loss = model(*batch)
        tracker.mark_phase("backward")  # settles what forward kept for backward
        kept = tracker.by_category()["activations"]
    return loss, kept


def check_checkpointed_block(block_cls: type, *, seq: int = 64, batch: int = 2) -> CheckResult:
    """``block_cls(cfg)``: a :class:`memlab.models.Block` whose forward runs under
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.

    Checked in the tiny GPT (naive attention): gradients equal the plain model's within
    :data:`CKPT_TOLERANCE`; the activations kept fall by at least 90% of what the blocks save
    minus their inputs (``n_layer * (layer_activation_bytes - 4 b s d)``); non-reentrant.
    """
    name = "checkpointed block"
    cfg = get_config("tiny", attention="naive")
    data = make_batch(StepConfig(model=cfg, seq=seq, batch=batch))
    ref = _tiny(attention="naive")
    yours = _tiny(attention="naive")
    blocks = _call(name, f"{getattr(block_cls, '__name__', block_cls)}(cfg)",
                   lambda: nn.ModuleList(block_cls(cfg) for _ in range(cfg.n_layer)))
    yours.blocks = blocks
    try:
        yours.load_state_dict(ref.state_dict())
    except RuntimeError as e:
        _fail(name, f"your block's parameters differ from Block's ({str(e).splitlines()[0]}): "
                    f"subclass memlab.models.Block and override forward only")
    grad_fns = []
    hook = yours.blocks[0].register_forward_hook(
        lambda m, a, out: grad_fns.append(out.grad_fn.name() if out.grad_fn else None))
    ref_loss, ref_kept = _forward_kept(ref, data)
    loss, kept = _call(name, "the forward with your block", _forward_kept, yours, data)
    hook.remove()
    if grad_fns and grad_fns[0] == "CheckpointFunctionBackward":
        _fail(name, "this is the reentrant checkpoint (use_reentrant=True or unset): pass "
                    "use_reentrant=False, the variant PyTorch recommends (it works with inputs "
                    "that do not require grad and with keyword arguments)")
    ref_loss.backward()
    _call(name, "backward through your block", loss.backward)
    got = [p.grad for p in yours.parameters()]
    if any(g is None for g in got):
        _fail(name, "some weights got no gradient: is the block's output computed from the "
                    "checkpointed function's result?")
    diff = _rel_diff(got, [p.grad for p in ref.parameters()])
    if diff > CKPT_TOLERANCE:
        _fail(name, f"gradients differ from the plain block's by {diff:.1e} (allowed "
                    f"{CKPT_TOLERANCE:g}): the checkpointed function must compute the whole "
                    f"block, x + attn(ln1(x)) then + mlp(ln2(x))")
    inputs = 4 * seq * batch * cfg.d_model
    expected = cfg.n_layer * (layer_activation_bytes(cfg, seq, batch, "fp32") - inputs)
    saved = ref_kept - kept
    if saved < 0.9 * expected:
        _fail(name, f"activations kept: {fmt_bytes(kept)} vs {fmt_bytes(ref_kept)} without "
                    f"checkpointing, saved {fmt_bytes(saved)}; each block should keep only its "
                    f"input (b*s*d*4 bytes), saving at least {fmt_bytes(0.9 * expected)}: wrap the "
                    f"whole block forward in checkpoint(...)")
    return CheckResult(name, {"kept_bytes": kept, "plain_kept_bytes": ref_kept,
                              "saved_bytes": saved, "expected_saved_bytes": expected,
                              "max_grad_diff": diff},
                       [f"activations kept {fmt_bytes(ref_kept)} -> {fmt_bytes(kept)}; saved "
                        f"{fmt_bytes(saved)}, formula {fmt_bytes(expected)} "
                        f"(n_layer x (layer - its input))",
                        f"gradients equal the plain block's within {diff:.1e} (allowed {CKPT_TOLERANCE:g})"])


# --------------------------------------------------------------------------------------
# 05: gradient accumulation
# --------------------------------------------------------------------------------------
ACC_TOLERANCE = 1e-5  # fp32 sums in another order


class RecordingOptimizer(torch.optim.Optimizer):
    """An optimizer that changes nothing: ``step`` records the gradients it was handed."""

    def __init__(self, params):
        super().__init__(params, {})
        self.steps = 0
        self.grads: list[torch.Tensor | None] = []

    @torch.no_grad()
    def step(self, closure=None):
        self.steps += 1
        self.grads = [None if p.grad is None else p.grad.clone()
                      for g in self.param_groups for p in g["params"]]


def _big_batch(model: GPT, batch: tuple) -> tuple[list[torch.Tensor], int]:
    tracker = MemoryTracker()
    with tracker:
        tracker.track_model(model)
        model(*batch).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads, _max_activations(tracker)


def check_accumulation(accumulate: Callable, *, k: int = 4, seq: int = 32,
                       batch: int = 8) -> CheckResult:
    """``accumulate(model, optimizer, batch, k)``: one optimizer step over ``k`` micro-batches.

    Checked on two consecutive steps: ``optimizer.step()`` runs once per call; the gradients it
    sees equal one big batch's within :data:`ACC_TOLERANCE` (relative to the largest gradient);
    the activations alive at once are at most 1.5/k of the big batch's.
    """
    name = "gradient accumulation"
    if batch % k:
        raise InputError(f"batch {batch} is not divisible by k={k}; choose a divisor")
    step = StepConfig(model="tiny", seq=seq, batch=batch)
    data = [make_batch(step, seed=s) for s in (0, 1)]
    ref_model = _tiny()
    refs = [_big_batch(ref_model, b) for b in data]
    model = _tiny()
    opt = RecordingOptimizer(model.parameters())
    diffs, acts = [], []
    for i, b in enumerate(data):
        tracker = MemoryTracker()
        with tracker:
            tracker.track_model(model)
            _call(name, "your accumulate", accumulate, model, opt, b, k)
        acts.append(_max_activations(tracker))
        if opt.steps != i + 1:
            _fail(name, f"optimizer.step() ran {opt.steps - i} times in one call: step once, "
                        f"after all {k} micro-batches")
        if any(g is None for g in opt.grads):
            _fail(name, "some weights had no gradient at optimizer.step(): call backward on "
                        "every micro-batch's loss before stepping")
        ref = refs[i][0]
        diff = _rel_diff(opt.grads, ref)
        diffs.append(diff)
        if diff <= ACC_TOLERANCE:
            continue
        msg = f"gradients differ from one batch of {batch} by {diff:.1e} (allowed {ACC_TOLERANCE:g})"
        if _rel_diff(opt.grads, [g * k for g in ref]) <= ACC_TOLERANCE:
            _fail(name, f"{msg}: they are {k} times too large; did you divide the loss by k?")
        if i == 1 and _rel_diff(opt.grads, [a + b for a, b in zip(ref, refs[0][0])]) <= ACC_TOLERANCE:
            _fail(name, f"{msg}: the previous step's gradients were still there; zero them "
                        f"(optimizer.zero_grad(set_to_none=True)) once per optimizer step")
        _fail(name, f"{msg}: the loss of each micro-batch is a mean over batch/k samples; divide "
                    f"it by k and let backward add into .grad, zeroing only once per step")
    big = max(r[1] for r in refs)
    if max(acts) > 1.5 * big / k:
        _fail(name, f"{fmt_bytes(max(acts))} of activations were alive at once, one batch of "
                    f"{batch} keeps {fmt_bytes(big)}: {k} micro-batches should keep about 1/{k} of it; "
                    f"call backward on each micro-batch's loss before the next forward")
    return CheckResult(name, {"max_grad_diff": max(diffs), "activation_bytes": max(acts),
                              "big_batch_activation_bytes": big},
                       [f"one optimizer step per call; gradients equal one batch of {batch} "
                        f"within {max(diffs):.1e} (allowed {ACC_TOLERANCE:g})",
                        f"activations alive at once {fmt_bytes(max(acts))}, one big batch "
                        f"{fmt_bytes(big)} (x{max(acts) / big:.2f}, 1/k = {1 / k:.2f})"])


# --------------------------------------------------------------------------------------
# 06-07: a DeepSpeed config and deepspeed.initialize
# --------------------------------------------------------------------------------------
@contextlib.contextmanager
def fake_ranks(world_size: int = 2):
    """This process as rank 0 of ``world_size`` for DeepSpeed, without other processes.

    A fake process group (``torch.testing._internal.distributed.fake_pg``: every collective
    returns at once) stands in for the job, so ``deepspeed.initialize`` builds the partitions
    rank 0 of a real job holds. Nothing is exchanged: averaged gradients and gathered ZeRO-3
    weights are wrong, so use it for configs and bytes, not for losses. The group, DeepSpeed's
    handle on it and the environment it reads are undone on exit.
    """
    import logging
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"world_size must be a positive integer, got {world_size!r}")
    if dist.is_initialized():
        raise RuntimeError("a process group already exists in this process; fake_ranks needs its own")
    set_cache_env()  # DS_ACCELERATOR=cpu without a GPU (read when deepspeed is imported)
    import deepspeed
    import deepspeed.comm.comm as ds_comm
    import deepspeed.utils.groups as ds_groups
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size),
           "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    log = logging.getLogger("DeepSpeed")
    level = log.level
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        log.setLevel(logging.ERROR)
        with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints its op builds
            deepspeed.init_distributed(dist_backend="gloo")  # wraps the group made above
        yield
    finally:
        dist.destroy_process_group()
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
    from deepspeed.runtime.config import DeepSpeedConfig
    with fake_ranks(ranks):
        try:
            c = DeepSpeedConfig(config)
        except (AssertionError, ValueError) as e:
            return {"error": " ".join(str(e).splitlines()[:3])}
    return {"train_batch_size": c.train_batch_size,
            "train_micro_batch_size_per_gpu": c.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": c.gradient_accumulation_steps}


def _engine_step(engine, seq: int = 32) -> dict:
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
                fp32 = getattr(engine.optimizer, "single_partition_of_fp32_groups", None) or []
                acc["host_gradients"] = sum(g.grad.numel() * g.grad.element_size()
                                            for g in fp32 if g.grad is not None)
            engine.step()
    return acc


def run_deepspeed(config: dict, ranks: int = 2, make_engine: Callable | None = None) -> dict:
    """Build the tiny GPT, ``deepspeed.initialize`` it with ``config`` as rank 0 of ``ranks``
    (:func:`fake_ranks`), run two steps and return what the engine decided: ZeRO stage, batch
    sizes, offload, whether activation checkpointing was configured, and the rank's exact
    bytes (``memlab.distributed.zero_accounting``). ``make_engine(model)`` replaces the
    plain ``deepspeed.initialize`` call."""
    import deepspeed
    with fake_ranks(ranks):
        model = _tiny()
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
        out["accounting"] = _engine_step(engine) if has_step else {}
    return out


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
    from deepspeed.runtime.config import DeepSpeedConfig
    if stage not in (1, 2, 3):
        raise InputError(f"stage={stage!r}; allowed: 1, 2, 3 (the ZeRO stages that shard)")
    for arg, value in (("ranks", ranks), ("micro_batch", micro_batch), ("accumulation", accumulation)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{arg} must be a positive integer, got {value!r}")
    if not isinstance(config, dict):
        _fail(name, f"the config is a dict (DeepSpeed also reads a JSON file), got {type(config).__name__}")
    problem = _config_errors(config, stage=stage, ranks=ranks, micro_batch=micro_batch,
                             accumulation=accumulation)
    if problem:
        _fail(name, problem)
    off = config["zero_optimization"].get("offload_optimizer")
    if offload and (not isinstance(off, dict) or off.get("device") != "cpu"):
        _fail(name, f"zero_optimization.offload_optimizer is {off}: offload the optimizer with "
                    f"{{'device': 'cpu'}}")
    if not offload and off not in (None, {}) and off.get("device", "none") != "none":
        _fail(name, "this exercise keeps the optimizer on the device: remove offload_optimizer")
    with fake_ranks(ranks):
        try:
            DeepSpeedConfig(config)
        except Exception as e:  # pydantic's ValidationError or DeepSpeed's own assertions
            _fail(name, "DeepSpeed rejected the config: " + " ".join(str(e).split("\n")[:3]))
    got = _call(name, "make_engine", run_deepspeed, config, ranks, make_engine)
    if got["engine"] != "DeepSpeedEngine":
        _fail(name, f"make_engine returned a {got['engine']}: return the engine, the first of "
                    f"the four values deepspeed.initialize returns")
    if got["zero_stage"] != stage or not got["accounting"]:
        _fail(name, f"the engine runs ZeRO stage {got['zero_stage']} with optimizer "
                    f"{got['optimizer']}: pass config=your dict to deepspeed.initialize, with an "
                    f"optimizer section")
    n, acc = got["num_params"], got["accounting"]
    want = zero_formula(n, stage, ranks, param_bytes=4, grad_bytes=4)
    state = acc["fp32_master"] + acc["optimizer_state"]
    if abs(state / want["optimizer"] - 1) > 0.01:
        _fail(name, f"rank 0 holds {fmt_bytes(state)} of fp32 master and Adam state, the ZeRO "
                    f"formula {fmt_bytes(want['optimizer'])} (12 bytes x {n:,} / {ranks})")
    if offload and not got["offload_optimizer"]:
        _fail(name, "DeepSpeed did not offload the optimizer: check zero_optimization.offload_optimizer")
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


# --------------------------------------------------------------------------------------
# 08: a column- and row-parallel Linear pair
# --------------------------------------------------------------------------------------
TP_TOLERANCE = 1e-5  # the partial sums add in another order


def check_tensor_parallel(make_shards: Callable, tp_forward: Callable, *, t: int = 2) -> CheckResult:
    """``make_shards(fc, out, t)`` returns one ``(column, row)`` pair of Linears per rank;
    ``tp_forward(shards, x)`` computes ``out(gelu(fc(x)))`` from them, adding the ranks' partial
    outputs as the all-reduce would. Checked on the tiny GPT's MLP: output equal within
    :data:`TP_TOLERANCE`; each rank's weights own exactly 1/t of the bytes (not a view of the
    whole matrix)."""
    name = "tensor-parallel MLP"
    cfg = get_config("tiny")
    if cfg.hidden % t:
        raise InputError(f"t={t} must divide the MLP width {cfg.hidden}")
    mlp = _tiny().blocks[0].mlp
    fc, out = mlp.fc, mlp.out
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in mlp.parameters():  # random biases too (GPT-2 initialises them to zero)
            p.copy_(0.05 * torch.randn(p.shape, generator=g))
        x = torch.randn(2, 16, cfg.d_model, generator=g)
        ref = mlp(x)
        shards = _call(name, "make_shards", make_shards, fc, out, t)
        if len(shards) != t:
            _fail(name, f"make_shards returned {len(shards)} ranks, expected t={t}")
        h, full = cfg.hidden // t, fc.weight.nbytes + out.weight.nbytes
        for r, (col, row) in enumerate(shards):
            if tuple(col.weight.shape) != (h, cfg.d_model) or tuple(row.weight.shape) != (cfg.d_model, h):
                _fail(name, f"rank {r}: column weight {tuple(col.weight.shape)}, row weight "
                            f"{tuple(row.weight.shape)}; expected {(h, cfg.d_model)} and "
                            f"{(cfg.d_model, h)}: column-parallel splits fc's output features "
                            f"(rows of its weight), row-parallel out's input features (its columns)")
            for kind, w in (("column", col.weight), ("row", row.weight)):
                if w.untyped_storage().nbytes() != w.nbytes:
                    _fail(name, f"rank {r}'s {kind} weight is a view: its storage holds "
                                f"{fmt_bytes(w.untyped_storage().nbytes())}, the whole matrix; "
                                f"copy the slice (.clone()) so a rank owns only its part")
        y = _call(name, "tp_forward", tp_forward, shards, x)
        if tuple(y.shape) != tuple(ref.shape):
            _fail(name, f"output shape {tuple(y.shape)}, expected {tuple(ref.shape)}: the row-parallel "
                        f"outputs are partial sums to add, not pieces to concatenate")
        diff = (y - ref).abs().max().item() / ref.abs().max().item()
        if diff > TP_TOLERANCE:
            msg = f"output differs from the full MLP by {diff:.1e} (allowed {TP_TOLERANCE:g})"
            if out.bias is not None and (y - (t - 1) * out.bias - ref).abs().max() < 1e-4:
                _fail(name, f"{msg}: out's bias was added {t} times; add it once, after the sum")
            hidden = F.gelu(F.linear(x, fc.weight[:h], fc.bias[:h]), approximate="tanh")
            part = F.linear(hidden, out.weight[:, :h])
            if (y - part).abs().max() < 1e-4 or (y - part - out.bias).abs().max() < 1e-4:
                _fail(name, f"{msg}: that is rank 0's partial sum; add the {t} ranks' outputs "
                            f"(the all-reduce)")
            _fail(name, f"{msg}: each rank computes gelu(x W_col^T + b_col) W_row^T; the sum over "
                        f"ranks plus out's bias is the output (the MLP uses approximate='tanh')")
    sizes = [sum(p.nbytes for p in (col.weight, row.weight)) for col, row in shards]
    return CheckResult(name, {"max_diff": diff, "rank_weight_bytes": max(sizes),
                              "full_weight_bytes": full},
                       [f"output equals the full MLP within {diff:.1e} (allowed {TP_TOLERANCE:g})",
                        f"weights per rank {fmt_bytes(max(sizes))} = 1/{t} of {fmt_bytes(full)}"])


# --------------------------------------------------------------------------------------
# 09: a saved_tensors_hooks pack/unpack pair
# --------------------------------------------------------------------------------------
PACK_TOLERANCE = 1e-2  # relative gradient error allowed for 16-bit saved activations


def _hooked_forward(model: GPT, batch: tuple, hooks: tuple | None) -> tuple[torch.Tensor, int]:
    """Forward with ``hooks`` active inside the blocks only; the activations it kept."""
    handles = []
    if hooks is not None:
        ctx = torch.autograd.graph.saved_tensors_hooks(*hooks)
        for block in model.blocks:
            handles.append(block.register_forward_pre_hook(lambda m, a: ctx.__enter__()))
            handles.append(block.register_forward_hook(lambda m, a, o: ctx.__exit__(None, None, None)))
    try:
        return _forward_kept(model, batch)
    finally:
        for h in handles:
            h.remove()


def check_pack_hooks(make_hooks: Callable, *, seq: int = 64, batch: int = 2) -> CheckResult:
    """``make_hooks(model)`` returns ``(pack, unpack)`` for
    ``torch.autograd.graph.saved_tensors_hooks`` that keep fp32 activations in 16 bits.

    Checked on the tiny GPT with the hooks active inside the blocks: unpack gives back the
    saved dtype and shape; the blocks' activations shrink by at least 40% of the formula
    (``n_layer * layer_activation_bytes``; 16 bits would save 50%); the gradient error against
    the unhooked model is at most :data:`PACK_TOLERANCE`.
    """
    name = "pack/unpack hooks"
    cfg = get_config("tiny")
    data = make_batch(StepConfig(model=cfg, seq=seq, batch=batch))
    ref, model = _tiny(), _tiny()
    pack, unpack = _call(name, "make_hooks", make_hooks, model)
    probe = torch.randn(4, 64)
    back = _call(name, "unpack(pack(t))", lambda: unpack(pack(probe)))
    if not isinstance(back, torch.Tensor) or back.dtype != probe.dtype or back.shape != probe.shape:
        what = f"{back.dtype} {tuple(back.shape)}" if isinstance(back, torch.Tensor) else type(back).__name__
        _fail(name, f"unpack(pack(t)) gave {what} for a float32 {tuple(probe.shape)} tensor: "
                    f"backward needs the dtype and shape that forward saved; cast back with .to(dtype)")
    ref_loss, ref_kept = _hooked_forward(ref, data, None)
    loss, kept = _call(name, "the forward with your hooks", _hooked_forward, model, data, (pack, unpack))
    ref_loss.backward()
    _call(name, "backward with your hooks", loss.backward)
    got, want = [p.grad for p in model.parameters()], [p.grad for p in ref.parameters()]
    if any(g is None for g in got):
        _fail(name, "some weights got no gradient with your hooks")
    err = relative_error(got, want)
    blocks = cfg.n_layer * layer_activation_bytes(cfg, seq, batch, "fp32")
    saved = ref_kept - kept
    if saved < 0.4 * blocks:
        hint = (" (the weights a Linear saves were copied too: return parameters unchanged)"
                if saved < 0 else "")
        _fail(name, f"activations kept {fmt_bytes(ref_kept)} -> {fmt_bytes(kept)}, saved "
                    f"{fmt_bytes(saved)}; 16-bit copies of the blocks' {fmt_bytes(blocks)} should "
                    f"save at least {fmt_bytes(0.4 * blocks)}{hint}")
    if not err <= PACK_TOLERANCE:
        _fail(name, f"relative gradient error {err:.1e} (allowed {PACK_TOLERANCE:g}): unpack must "
                    f"rebuild the saved values, in their dtype")
    return CheckResult(name, {"kept_bytes": kept, "plain_kept_bytes": ref_kept, "saved_bytes": saved,
                              "block_activation_bytes": blocks, "grad_error": err},
                       [f"activations kept {fmt_bytes(ref_kept)} -> {fmt_bytes(kept)} (saved "
                        f"{saved / blocks:.0%} of the blocks' {fmt_bytes(blocks)})",
                        f"relative gradient error {err:.1e} (allowed {PACK_TOLERANCE:g})"])


__all__ = ["CheckResult", "CheckFailed", "check_oom_fix", "check_amp_step", "reference_amp_step",
           "check_checkpointed_block", "check_accumulation", "RecordingOptimizer",
           "fake_ranks", "deepspeed_batch_sizes", "run_deepspeed", "check_zero_config",
           "check_offload_config", "check_tensor_parallel", "check_pack_hooks",
           "AMP_TOLERANCE", "CKPT_TOLERANCE", "ACC_TOLERANCE", "TP_TOLERANCE", "PACK_TOLERANCE"]
