"""The largest batch that fits a budget, found two ways: a search that measures steps until
one does not fit, and a prediction from two measured steps (every op's live bytes are a
line in the batch size).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from memlab.core.errors import InputError
from memlab.core.hardware import resolve_budget
from memlab.core.quiet import progress_wanted
from memlab.lenses.measure import measure_step
from memlab.step.training_step import StepConfig


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
                          max_batch: int = 1024, progress: bool | None = None, **kwargs) -> BatchSearch:
    """Grow the batch by doubling until a step runs out of memory, then bisect between the
    last size that fit and the first that did not (Lightning's ``BatchSizeFinder``,
    ``mode="binsearch"``). Every trial is a real step under the budget; OOMs are caught.
    Returns batch 0 if even ``start`` does not fit. A bar counts the trials where someone
    watches it (``progress=None``: :func:`memlab.core.quiet.progress_wanted`).
    """
    budget_bytes = resolve_budget(budget)
    if budget_bytes is None:
        raise InputError("find_max_batch_search needs a budget, e.g. '120MiB' or 'T4-16GB'")
    if start < 1 or max_batch < start:
        raise InputError(f"need 1 <= start <= max_batch, got start={start}, max_batch={max_batch}")
    from tqdm.auto import tqdm
    bar = tqdm(desc="batch search", disable=not progress_wanted(progress), leave=False)
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
                 for e1, e2 in zip(r1.timeline, r2.timeline, strict=True)]
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


__all__ = ["BatchPrediction", "BatchSearch", "find_max_batch_search", "predict_max_batch"]
