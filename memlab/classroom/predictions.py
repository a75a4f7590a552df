"""Predictions the learner writes down, scored against what is then measured.

A predict-first question in a lesson is a code cell where the learner sets a number
(``guess = 3.0  # GiB``); the next cell measures and calls :func:`check_prediction`, which
says how far off the guess was and, where the lesson knows it, what the gap is made of::

    you said 3.00 GiB, measured 4.10 GiB: 27% low. The gap: the logits.

An unanswered question (``guess = None``) is not an error: the measurement is shown and the
learner is asked to guess before reading on next time. Every scored prediction is kept in
this process's history, so a lesson's last cell (or a teacher) can show them all.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from memlab.core.errors import InputError
from memlab.core.units import SIZE_UNITS

# the units a guess may be written in: bytes and binary sizes (memlab.core.units), or "" for a number
UNITS = {u: SIZE_UNITS[u.upper()] for u in ("B", "KiB", "MiB", "GiB")} | {"": 1}
CLOSE = 0.10  # within 10% counts as a good prediction: the lenses themselves agree within ~2%


@dataclass(frozen=True)
class Prediction:
    """One scored prediction: the guess and the measurement in the question's unit."""

    question: str
    guess: float | None
    measured: float
    unit: str
    explain: str = ""

    @property
    def error(self) -> float | None:
        """Signed relative error of the guess, ``(guess - measured) / measured``; None unanswered."""
        if self.guess is None:
            return None
        return (self.guess - self.measured) / self.measured if self.measured else math.inf

    @property
    def close(self) -> bool:
        """Whether the guess is within :data:`CLOSE` of the measurement."""
        return self.error is not None and abs(self.error) <= CLOSE

    def __str__(self) -> str:
        got = _fmt(self.measured, self.unit)
        gap = f" The gap: {self.explain}." if self.explain else ""
        if self.guess is None:
            return (f"no prediction written: measured {got}. Next time write your number "
                    f"first; it is what makes the measurement teach.{gap}")
        err = self.error
        said = _fmt(self.guess, self.unit)
        if self.close:
            return f"you said {said}, measured {got}: within {abs(err):.0%}, well predicted."
        side = "high" if err > 0 else "low"
        return f"you said {said}, measured {got}: {abs(err):.0%} {side}.{gap}"

    __repr__ = __str__


_HISTORY: list[Prediction] = []


def _fmt(value: float, unit: str) -> str:
    return f"{value:,.2f} {unit}".rstrip() if unit else f"{value:,.3g}"


def check_prediction(guess: float | None, measured: float, *, unit: str = "MiB",
                     question: str = "", explain: str = "", measured_in_bytes: bool = True
                     ) -> Prediction:
    """Score ``guess`` (a number in ``unit``, or None if the learner left it blank) against
    ``measured``: bytes when ``measured_in_bytes`` and ``unit`` is a byte unit (converted to
    ``unit``), else already in ``unit``. ``explain`` names what the gap is usually made of;
    it is shown when the guess is off by more than :data:`CLOSE`. The result prints its verdict
    and is added to :func:`history`."""
    if unit not in UNITS:
        raise InputError(f"unit={unit!r}; allowed: {', '.join(repr(u) for u in UNITS)}")
    if guess is not None and (isinstance(guess, bool) or not isinstance(guess, (int, float))
                              or not math.isfinite(guess)):
        raise InputError(f"guess={guess!r}: write a number (in {unit or 'the question unit'}), "
                         f"or leave it None")
    if isinstance(measured, bool) or not isinstance(measured, (int, float)) or measured < 0:
        raise InputError(f"measured={measured!r}: a non-negative number")
    value = measured / UNITS[unit] if (measured_in_bytes and unit) else float(measured)
    p = Prediction(question, None if guess is None else float(guess), value, unit, explain)
    _HISTORY.append(p)
    return p


def history() -> list[Prediction]:
    """Every prediction scored in this process, oldest first."""
    return list(_HISTORY)
