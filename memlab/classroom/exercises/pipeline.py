"""Lesson 13: how many micro-batches a pipeline stage holds, GPipe against 1F1B."""
from __future__ import annotations

from typing import Callable

from memlab.classroom.exercises.common import CheckResult, call_learner, fail, require
from memlab.distributed.parallel_common import ParallelResult


def schedule_order(stage: int, p: int, m: int, schedule: str) -> list[str]:
    """The order of one stage's forwards ("F") and backwards ("B") over one step. GPipe: all
    ``m`` forwards, then all backwards (Huang et al. 2019). 1F1B (PipeDream-Flush, Narayanan et
    al. 2021, sec. 2.2.1): ``p - stage - 1`` warm-up forwards, then one forward and one backward
    in turn, then the remaining backwards."""
    if schedule == "gpipe":
        return ["F"] * m + ["B"] * m
    warm = min(p - stage - 1, m)
    steady = m - warm
    return ["F"] * warm + ["F", "B"] * steady + ["B"] * warm


def held(order: list[str]) -> int:
    """Most micro-batches whose forward ran and whose backward has not: their activations."""
    live = top = 0
    for op in order:
        live += 1 if op == "F" else -1
        top = max(top, live)
    return top


def check_in_flight(in_flight: Callable, *, measured: ParallelResult | None = None) -> CheckResult:
    """``in_flight(stage, p, m, schedule)`` returns the most micro-batches whose activations
    ``stage`` (0 = first) of a ``p``-stage pipeline holds at once with ``m`` micro-batches,
    ``schedule`` "gpipe" or "1f1b". Checked against each schedule's order of forwards and
    backwards for p up to 8 and m up to 16 and, given ``measured`` (a
    :func:`~memlab.distributed.pipeline_parallel.measure_pipeline` result), against what each measured stage held."""
    name = "micro-batches in flight"
    require(name, "in_flight", in_flight, "a function (stage, p, m, schedule) returning an int")
    cases = 0
    for schedule in ("gpipe", "1f1b"):
        for p in range(2, 9):
            for m in range(p if schedule == "1f1b" else 1, 17):
                for stage in range(p):
                    want = held(schedule_order(stage, p, m, schedule))
                    have = call_learner(name, "in_flight", in_flight, stage, p, m, schedule)
                    cases += 1
                    if have == want:
                        continue
                    where = f"{schedule}, p={p}, m={m}, stage {stage}: you said {have}, expected {want}"
                    if schedule == "1f1b" and have == min(p, m):
                        fail(name, f"{where}: stage i starts its backwards after p - i - 1 warm-up "
                                   f"forwards, so later stages hold fewer")
                    if schedule == "gpipe":
                        fail(name, f"{where}: GPipe runs every forward before any backward")
                    fail(name, f"{where}")
    checked = 0
    if measured is not None:
        p = len(measured.per_rank)
        for stage, rank in enumerate(measured.per_rank):
            for run in rank["runs"]:
                have = call_learner(name, "in_flight", in_flight, stage, p, run["m"], run["schedule"])
                if have != run["in_flight"]:
                    fail(name, f"{run['schedule']}, m={run['m']}, stage {stage}: you said {have}, "
                               f"the measured stage held {run['in_flight']}")
                checked += 1
    return CheckResult(name, {"cases": cases, "measured_runs": checked},
                       [f"{cases} (schedule, p, m, stage) cases agree with the schedules' order",
                        f"{checked} measured stage runs agree" if measured is not None
                        else "no measured pipeline given"])
