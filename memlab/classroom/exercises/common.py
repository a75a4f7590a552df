"""What every checker shares: the result and failure types, and small measuring helpers."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from memlab.models.gpt_unet import GPT, get_config
from memlab.tracking.tracker import CATEGORIES, MemoryTracker


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


def fail(exercise: str, message: str) -> None:
    raise CheckFailed(f"{exercise}: {message}")


def require(exercise: str, name: str, value, what: str, *, call: bool = True) -> None:
    """Fail with "write `name` in the cell above: what" when the learner's answer is missing:
    ``None`` (the student copy's stub, ``name = None  # your code here``) or, where a function
    or class is asked for (``call``), anything not callable."""
    if value is None or (call and not callable(value)):
        got = "" if value is None else f" (got {type(value).__name__}, not a function or class)"
        fail(exercise, f"write `{name}` in the cell above{got}: {what}")


def rel_diff(got: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> float:
    """Largest absolute difference over all tensors, relative to the reference's largest value."""
    diff = max((g.float() - r.float()).abs().max().item() for g, r in zip(got, ref, strict=True))
    return diff / max(r.abs().max().item() for r in ref)


def grad_norm(ts: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(t.float().pow(2).sum().item() for t in ts))


def tiny_model(seed: int = 0, device: str | torch.device = "cpu", **overrides) -> GPT:
    torch.manual_seed(seed)
    with torch.device(device):
        return GPT(get_config("tiny", **overrides))


def max_activations(tracker: MemoryTracker) -> int:
    i = CATEGORIES.index("activations")
    return max((e.by_category[i] for e in tracker.timeline), default=0)


def call_learner(exercise: str, what: str, fn: Callable, *args):
    """Run the learner's function; an exception becomes a message naming it."""
    try:
        return fn(*args)
    except CheckFailed:
        raise
    except Exception as e:  # the learner's code: report, do not crash the checker
        fail(exercise, f"{what} raised {type(e).__name__}: {e}")

def forward_kept(model: GPT, batch: tuple) -> tuple[torch.Tensor, int]:
    """Run forward under the tracker; return the loss and the activations it kept."""
    tracker = MemoryTracker()
    with tracker:
        tracker.track_model(model)
        loss = model(*batch)
        tracker.mark_phase("backward")  # settles what forward kept for backward
        kept = tracker.by_category()["activations"]
    return loss, kept
