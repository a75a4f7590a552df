"""Single-device techniques the lessons measure: sweeps, fp16 loss scaling, gradient
accumulation and two ways to find the largest batch that fits a budget.

Everything here runs real steps through :func:`memlab.measure.measure_step` (or the other
lenses), so what a lesson asserts is measured, not assumed.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch
import torch.nn as nn

from .errors import InputError
from .hardware import resolve_budget
from .estimate import estimate_step
from .measure import measure_step
from .step import MemoryReport, StepConfig, batch_to, build_trainer, make_batch
from .tracking import Event
from .simulate import simulate_step

LENSES = ("estimate", "simulate", "measure")
# The smallest positive fp16 value (a subnormal): anything below rounds to zero.
FP16_TINY = 2.0 ** -24


def lens_fn(lens: str) -> Callable[..., MemoryReport]:
    """The function behind a lens name: ``estimate_step``, ``simulate_step`` or ``measure_step``."""
    if lens == "measure":
        return measure_step
    if lens == "estimate":
        return estimate_step
    if lens == "simulate":
        return simulate_step
    raise InputError(f"lens={lens!r}; allowed: {', '.join(LENSES)}")


def sweep(step: StepConfig, param: str, values: Sequence, lens: str = "measure", *,
          budget: int | str | None = None, progress: bool = True, **kwargs) -> list[MemoryReport]:
    """One report per value of a :class:`StepConfig` field (``seq``, ``batch``, ...).

    ``kwargs`` go to the lens function (e.g. ``device="cuda"`` for measure); a tqdm bar shows
    progress in notebooks.
    """
    if param not in StepConfig.__dataclass_fields__:
        raise InputError(f"param={param!r} is not a StepConfig field; "
                         f"allowed: {', '.join(StepConfig.__dataclass_fields__)}")
    fn = lens_fn(lens)
    from tqdm.auto import tqdm
    out = []
    for v in tqdm(list(values), desc=f"{lens} {param}", disable=not progress, leave=False):
        out.append(fn(replace(step, **{param: v}), budget=budget, **kwargs))
    return out


def category_max(report: MemoryReport, category: str) -> int:
    """Most bytes of one category alive at any op of the step. The peak's breakdown can miss
    a category: at a small batch the peak sits in the optimizer step, after activations are
    freed and before gradients are; this finds activations at the end of forward, gradients
    at the end of backward."""
    from .tracking import CATEGORIES
    if category not in CATEGORIES:
        raise InputError(f"unknown category {category!r}; allowed: {', '.join(CATEGORIES)}")
    if not report.timeline:  # estimate lens: no timeline, only the peak's breakdown
        return int(report.by_category.get(category, 0))
    i = CATEGORIES.index(category)
    return max(e.by_category[i] for e in report.timeline)


def activations_by_module(report: MemoryReport,
                          key: Callable[[Event], str] | None = None) -> dict[str, int]:
    """Bytes each module keeps for backward: every rise of the ``activations`` category in
    forward goes to the module whose op made it (a tensor is an activation when it was made
    in forward and is still alive when forward ends, so with one forward the parts sum to
    the category's largest value; with ``k`` micro-batches, to ``k`` forwards' worth).
    Labels come from ``key(event)``, called with every forward op's timeline event in order
    (its ``module``, ``op``); by default the model's direct child of ``event.module``
    (``down.0`` of ``UNet.down.0.conv1``, ``UNet`` for its own ops, ``Global`` outside the
    model). Labels appear in the order they first kept bytes."""
    from .tracking import CATEGORIES
    if not report.timeline:
        raise InputError(f"the {report.lens!r} lens keeps no timeline; use measure or simulate")
    key = key or _direct_child
    i = CATEGORIES.index("activations")
    out: dict[str, int] = {}
    before = 0
    for e in report.timeline:
        now = e.by_category[i]
        if e.phase == "forward":
            label = key(e)  # on every op: a key may follow the order modules ran in
            if now > before:  # forward only adds activations (a drop is the step's end)
                out[label] = out.get(label, 0) + now - before
        before = now
    return out


def _direct_child(event: Event) -> str:
    parts = event.module.split(".")
    if len(parts) == 1:
        return parts[0]
    # a ModuleList index belongs to its list: "down.0", not "down"
    return ".".join(parts[1:3]) if len(parts) > 2 and parts[2].isdigit() else parts[1]


def step_flops(step: StepConfig, *, device: str = "cpu") -> int:
    """Floating-point operations of one steady-state training step (forward, backward and
    any recomputation), counted with ``torch.utils.flop_counter.FlopCounterMode``: a compute
    cost that, unlike wall-clock time, does not depend on what else the machine is doing."""
    from torch.utils.flop_counter import FlopCounterMode
    from .guard import preflight
    preflight(step, device)
    trainer = build_trainer(step, device)
    batch = batch_to(make_batch(step, device), step)
    trainer.step(batch)
    with FlopCounterMode(display=False) as counter:
        trainer.step(batch)
    return int(counter.get_total_flops())


def relative_error(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """``||got - ref|| / ||ref||`` over all tensors together (the norm of the flattened lists)."""
    num = sum(((g - r).float() ** 2).sum() for g, r in zip(got, ref))
    den = sum((r.float() ** 2).sum() for r in ref)
    return float((num / den).sqrt())


# --------------------------------------------------------------------------------------
# fp16 gradient underflow and loss scaling (Micikevicius et al. 2018, sec. 3.2)
# --------------------------------------------------------------------------------------
@dataclass
class UnderflowResult:
    """Gradients of one fp16-autocast backward compared with the fp32 reference."""

    loss_scale: float | None
    zero_fraction: float      # entries exactly 0 in fp16 whose fp32 reference is not 0
    rel_error: float          # ||g - g_ref|| / ||g_ref|| over all parameters
    reference: torch.Tensor = field(repr=False)  # fp32 gradients, flattened
    grads: torch.Tensor = field(repr=False)      # fp16-autocast gradients, unscaled

    @property
    def below_fp16(self) -> float:
        """Fraction of reference gradient entries smaller than fp16 can hold at all."""
        return (self.reference.abs() < FP16_TINY).float().mean().item()


def _underflow_model(seed: int, width: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                          nn.Linear(width, 1))
    x = torch.randn(256, width, generator=g)
    y = torch.randn(256, 1, generator=g)
    return model, x, y


def fp16_underflow(loss_scale: float | None = None, *, loss_weight: float = 1e-4,
                   seed: int = 0, width: int = 64) -> UnderflowResult:
    """Backward of a small MLP under fp16 autocast, with or without loss scaling.

    ``loss_weight`` makes the gradients small, as late in training or for a weighted loss
    term; fp16 then flushes many of them to zero. With ``loss_scale`` the loss is multiplied
    before backward and the gradients divided after it, in fp32, as ``GradScaler`` does
    (``torch.amp.GradScaler("cpu", init_scale=loss_scale)``, ``scale`` / ``unscale_``).
    """
    if loss_scale is not None and not loss_scale > 0:
        raise InputError(f"loss_scale={loss_scale!r}; give a positive number or None")
    model, x, y = _underflow_model(seed, width)

    def grads(fp16: bool, scale: float | None) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        scaler = torch.amp.GradScaler("cpu", init_scale=scale) if scale else None
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = loss_weight * ((model(x).float() - y) ** 2).mean()
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)  # divides the fp32 gradients by the scale
        return torch.cat([p.grad.detach().flatten().float() for p in model.parameters()])

    ref = grads(False, None)
    got = grads(True, loss_scale)
    zero = ((got == 0) & (ref != 0)).float().mean().item()
    err = relative_error([got], [ref])
    return UnderflowResult(loss_scale, zero, err, ref, got)


# --------------------------------------------------------------------------------------
# Where mixed precision keeps its 16 bytes per parameter
# --------------------------------------------------------------------------------------
def master_weight_states(step: StepConfig | None = None, *, device: str = "cpu") -> dict[str, float]:
    """Bytes per parameter of each model state when the model itself is bf16 and AdamW
    updates an fp32 master copy: the mixed-precision Adam of ZeRO (Rajbhandari et al. 2020,
    sec. 3.1: 2 + 2 + 12) and of Micikevicius et al. 2018 (sec. 3.1), built in plain torch.

    One real step: bf16 forward and backward; then, one parameter at a time, its bf16 gradient
    becomes an fp32 master gradient, the master takes an AdamW step (fp32 moments) and the
    bf16 weight is overwritten from it, so only one fp32 gradient exists at a time (DeepSpeed
    works partition by partition). The bytes are read from the tensors themselves: the bf16
    weights, their gradients right after backward, the masters and AdamW's state.
    """
    step = replace(step or StepConfig(), precision="pure-bf16", micro_batches=1)
    model = build_trainer(step, device).model
    params = list(model.parameters())
    master = [p.detach().float() for p in params]
    opts = [torch.optim.AdamW([m], lr=1e-4) for m in master]
    model(*batch_to(make_batch(step, device), step)).backward()
    grads = sum(p.grad.nbytes for p in params)
    with torch.no_grad():
        for p, m, opt in zip(params, master, opts):
            m.grad = p.grad.float()
            p.grad = None
            opt.step()
            m.grad = None
            p.copy_(m)
    n = sum(p.numel() for p in params)
    moments = sum(t.nbytes for opt in opts for st in opt.state.values() for t in st.values()
                  if t.dim() > 0)  # exp_avg and exp_avg_sq; the scalar step counters aside
    return {"bf16 parameters": sum(p.nbytes for p in params) / n, "bf16 gradients": grads / n,
            "fp32 master": sum(m.nbytes for m in master) / n, "Adam moments": moments / n}


# --------------------------------------------------------------------------------------
# Gradient accumulation
# --------------------------------------------------------------------------------------
@dataclass
class AccumulationCheck:
    """One batch of ``batch`` against ``k`` micro-batches of ``batch // k``."""

    k: int
    max_abs_diff: float
    max_grad: float
    same: bool  # torch.allclose at fp32 tolerance


def _grads(step: StepConfig, k: int, seed: int, device: str = "cpu") -> list[torch.Tensor]:
    trainer = build_trainer(replace(step, micro_batches=k), device, seed=seed)
    batch = make_batch(step, device, seed=seed)
    for micro in zip(*(t.chunk(k) for t in batch)):
        (trainer.model(*micro) / k).backward()  # mean over micro-batches = mean over batch
    return [p.grad.detach().clone() for p in trainer.model.parameters()]


def accumulation_check(step: StepConfig, k: int, *, seed: int = 0, rtol: float = 1e-4,
                       atol: float = 1e-6, device: str = "cpu") -> AccumulationCheck:
    """Do ``k`` accumulated micro-batches give the gradients of one big batch? (fp32, on
    ``device``: a lesson's GPU when it has one)"""
    if k < 1 or step.batch % k:
        raise InputError(f"k={k} must be a positive divisor of batch {step.batch}")
    one = _grads(replace(step, precision="fp32"), 1, seed, device)
    acc = _grads(replace(step, precision="fp32"), k, seed, device)
    diff = max((a - b).abs().max().item() for a, b in zip(one, acc))
    same = all(torch.allclose(a, b, rtol=rtol, atol=atol) for a, b in zip(one, acc))
    return AccumulationCheck(k, diff, max(a.abs().max().item() for a in one), same)


# --------------------------------------------------------------------------------------
# Dynamic batch size
# --------------------------------------------------------------------------------------
@dataclass
class BatchSearch:
    """The largest batch that fits, and every trial that found it: (batch, fits, peak)."""

    batch: int
    trials: list[tuple[int, bool, int]]
    method: str

    @property
    def n_trials(self) -> int:
        return len(self.trials)


def find_max_batch_search(step: StepConfig, budget: int | str, *, start: int = 1,
                          max_batch: int = 1024, progress: bool = False, **kwargs) -> BatchSearch:
    """Grow the batch by doubling until a step runs out of memory, then bisect between the
    last size that fit and the first that did not (Lightning's ``BatchSizeFinder``,
    ``mode="binsearch"``). Every trial is a real step under the budget; OOMs are caught.
    Returns batch 0 if even ``start`` does not fit.
    """
    budget_bytes = resolve_budget(budget)
    if budget_bytes is None:
        raise InputError("find_max_batch_search needs a budget, e.g. '120MiB' or 'T4-16GB'")
    if start < 1 or max_batch < start:
        raise InputError(f"need 1 <= start <= max_batch, got start={start}, max_batch={max_batch}")
    from tqdm.auto import tqdm
    bar = tqdm(desc="batch search", disable=not progress, leave=False)
    trials: list[tuple[int, bool, int]] = []

    def fits(b: int) -> bool:
        r = measure_step(replace(step, batch=b, micro_batches=1), budget=budget_bytes, **kwargs)
        trials.append((b, bool(r.fits), r.peak_bytes))
        bar.update()
        return bool(r.fits)

    good, bad = 0, None
    b = start
    while b <= max_batch:            # grow
        if not fits(b):
            bad = b
            break
        good, b = b, b * 2
    if bad is None:                  # everything up to max_batch fit
        bad = max_batch + 1
        if good < max_batch and fits(max_batch):
            good = max_batch
    while bad - good > 1:            # bisect (good fits, bad does not)
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    bar.close()
    return BatchSearch(good, trials, "search")


@dataclass
class BatchPrediction:
    """Live bytes after every op of a step are linear in the batch: ``static + slope * batch``
    (static: parameters, optimizer state, ...; slope: what one more sample adds). Two measured
    runs give every op's line; the step's peak at any batch is the highest line there."""

    batch: int
    static_bytes: float   # the line that binds at ``batch``
    slope_bytes: float
    binding_op: str       # "op (phase)" where that line comes from
    calibration: list[tuple[int, int]]  # (batch, measured peak)
    lines: list[tuple[float, float]] = field(repr=False, default_factory=list)
    method: str = "predict"

    def peak_at(self, batch: int) -> float:
        """Predicted peak of the whole step at ``batch``: the max over every op's line."""
        return max(a + c * batch for a, c in self.lines)


def predict_max_batch(step: StepConfig, budget: int | str, *, calibrate: tuple[int, int] = (1, 2),
                      **kwargs) -> BatchPrediction:
    """Measure the step at two batch sizes (no budget), fit ``static + slope * batch`` to the
    live bytes after each op, and pick the largest batch whose highest line stays within
    ``budget``: two runs, no trial and error.

    Fitting the peak alone is fragile: at a small batch the peak may sit in the optimizer
    step, which does not grow with the batch, so its slope says nothing about a large batch.
    Fitting per op keeps every place the peak could move to. Returns batch 0 if nothing fits.
    """
    budget_bytes = resolve_budget(budget)
    if budget_bytes is None:
        raise InputError("predict_max_batch needs a budget, e.g. '120MiB' or 'T4-16GB'")
    b1, b2 = calibrate
    if not 1 <= b1 < b2:
        raise InputError(f"calibrate={calibrate!r}; need two batch sizes 1 <= b1 < b2")
    r1, r2 = (measure_step(replace(step, batch=b, micro_batches=1), **kwargs) for b in (b1, b2))
    if len(r1.timeline) == len(r2.timeline) and r1.timeline:
        pairs = [(e1.total, e2.total, f"{e1.op} ({e1.phase})")
                 for e1, e2 in zip(r1.timeline, r2.timeline)]
    else:  # the step ran different ops (should not happen): fall back to the peaks
        pairs = [(r1.peak_bytes, r2.peak_bytes, "peak")]
    lines, best, where = [], None, "none"
    for p1, p2, name in pairs:
        slope = (p2 - p1) / (b2 - b1)
        static = p1 - slope * b1
        lines.append((static, slope))
        if static > budget_bytes:
            limit = 0
        elif slope <= 0:
            continue
        else:
            limit = int((budget_bytes - static) // slope)
        if best is None or limit < best:
            best, where, bind = limit, name, (static, slope)
    if best is None:
        raise InputError("no op grows with the batch; the step's memory does not depend on it")
    return BatchPrediction(max(best, 0), bind[0], bind[1], where,
                           [(b1, r1.peak_bytes), (b2, r2.peak_bytes)], lines)


__all__ = ["LENSES", "FP16_TINY", "lens_fn", "sweep", "category_max", "activations_by_module", "step_flops",
           "relative_error", "UnderflowResult", "fp16_underflow", "master_weight_states",
           "AccumulationCheck", "accumulation_check", "BatchSearch", "find_max_batch_search",
           "BatchPrediction", "predict_max_batch"]
