"""Figures for the lessons, all matplotlib (inline, offline: no CDN, no network).

- :func:`plot_timeline`: live bytes by category, stacked, op by op through one step.
- :func:`plot_lenses`: estimate / simulate / measure side by side as stacked bars.
- :func:`plot_curve`: a measured quantity against sequence length or batch, formula overlaid.
- :func:`plot_tradeoff`: memory against time, both as ratios to a baseline.
- :func:`plot_grad_histogram`: gradient magnitudes against the smallest fp16 number.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np

from .parallel import bubble_fraction, pipeline_bubble, pipeline_run
from .step import MemoryReport
from .tracking import CATEGORIES

if TYPE_CHECKING:
    from .advisor import Advice
    from .parallel import ParallelResult

MiB = 2**20
COLORS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer": "#55a868",
          "activations": "#c44e52", "temporaries": "#8172b3", "other": "#937860",
          "workspace": "#8c8c8c"}
PHASE_SHADE = {"forward": "#f2f2f2", "backward": "#e6eef7", "optimizer": "#eef7e6"}


def _ax(ax):
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    return ax


def timeline_array(report: MemoryReport) -> np.ndarray:
    """The timeline as an (ops x categories) array of MiB, categories in :data:`CATEGORIES`."""
    if not report.timeline:
        return np.zeros((0, len(CATEGORIES)))
    return np.array([e.by_category for e in report.timeline], dtype=float) / MiB


def plot_timeline(report: MemoryReport, ax=None, *, title: str | None = None):
    """Stacked live MiB by category through the step, phases shaded, budget and OOM marked."""
    ax = _ax(ax)
    data = timeline_array(report)
    if not len(data):
        ax.text(0.5, 0.5, f"no timeline ({report.lens} lens)", ha="center", transform=ax.transAxes)
        return ax
    x = np.arange(len(data))
    phases = [e.phase for e in report.timeline]
    start = 0
    for i in range(1, len(phases) + 1):  # shade each run of one phase
        if i == len(phases) or phases[i] != phases[start]:
            ax.axvspan(start, i, color=PHASE_SHADE.get(phases[start], "white"), lw=0, zorder=0)
            if i - start > len(phases) // 12:  # label only spans wide enough to read
                ax.text((start + i) / 2, 1.0, phases[start], ha="center", va="bottom", fontsize=7,
                        transform=ax.get_xaxis_transform())
            start = i
    ax.stackplot(x, data.T, labels=CATEGORIES, colors=[COLORS[c] for c in CATEGORIES], zorder=1)
    if report.budget_bytes is not None:
        ax.axhline(report.budget_bytes / MiB, color="k", ls="--", lw=1, label="budget")
    if report.oom is not None:
        # the failing op is where live bytes went over the budget: the highest point
        at = int(data.sum(axis=1).argmax())
        ax.plot([at], [report.oom.live_bytes / MiB], "kx", ms=10, mew=2, label="OOM", zorder=3)
    ax.set_xlim(0, max(len(data) - 1, 1))
    ax.set_xlabel("op")
    ax.set_ylabel("live MiB")
    ax.set_title(title or _title(report), fontsize=9, pad=12)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    return ax


def _title(r: MemoryReport) -> str:
    cfg = r.step.model_config
    return (f"{r.lens}: {cfg.name} seq {r.step.seq} batch {r.step.batch} {r.step.precision} "
            f"ckpt {cfg.checkpointing} - peak {r.peak_bytes / MiB:.1f} MiB")


def plot_lenses(reports: Mapping[str, MemoryReport] | Sequence[MemoryReport], ax=None, *,
                title: str | None = None):
    """Stacked bars of the peak by category, one bar per report (e.g. per lens)."""
    ax = _ax(ax)
    if not isinstance(reports, Mapping):
        reports = {r.lens: r for r in reports}
    labels = list(reports)
    bottom = np.zeros(len(labels))
    for c in CATEGORIES:
        vals = np.array([reports[k].by_category.get(c, 0) / MiB for k in labels])
        ax.bar(labels, vals, bottom=bottom, color=COLORS[c], label=c)
        bottom += vals
    for i, k in enumerate(labels):
        ax.text(i, bottom[i], f"{reports[k].peak_bytes / MiB:.1f}", ha="center", va="bottom",
                fontsize=8)
    budgets = {r.budget_bytes for r in reports.values() if r.budget_bytes is not None}
    if len(budgets) == 1:
        ax.axhline(budgets.pop() / MiB, color="k", ls="--", lw=1, label="budget")
    ax.set_ylabel("MiB at the peak")
    ax.set_title(title or "peak by category", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax


def plot_curve(x: Sequence[float], measured: Mapping[str, Sequence[float]], ax=None, *,
               formula: Mapping[str, Callable[[float], float]] | None = None,
               xlabel: str = "sequence length", ylabel: str = "MiB", title: str | None = None,
               logx: bool = False):
    """Measured points (one series per key) with formula lines overlaid (same colours).

    ``measured`` values and ``formula`` results are in the same unit (MiB by convention).
    """
    ax = _ax(ax)
    xs = np.asarray(x, dtype=float)
    dense = np.linspace(xs.min(), xs.max(), 200)
    for i, (name, ys) in enumerate(measured.items()):
        color = f"C{i}"
        ax.plot(xs, ys, "o", color=color, label=f"{name} (measured)")
        if formula and name in formula:
            ax.plot(dense, [formula[name](v) for v in dense], "-", color=color, alpha=0.7,
                    label=f"{name} (formula)")
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    return ax


def plot_tradeoff(points: Mapping[str, tuple[float, float]], ax=None, *,
                  title: str | None = None):
    """Peak memory ratio (x) against step time ratio (y), both relative to a baseline."""
    ax = _ax(ax)
    for i, (name, (mem, time)) in enumerate(points.items()):
        ax.plot(mem, time, "o", ms=9, color=f"C{i}")
        ax.annotate(name, (mem, time), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.axhline(1.0, color="grey", lw=0.8)
    # the seed's claim: 50-70% of the memory saved for 30-50% more compute
    ax.add_patch(plt.Rectangle((0.3, 1.3), 0.2, 0.2, color="gold", alpha=0.3,
                               label="seed: -50..70% memory, +30..50% time"))
    ax.set_xlabel("peak memory / baseline")
    ax.set_ylabel("step time / baseline")
    ax.set_title(title or "memory against recompute time", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    return ax


def plot_grad_histogram(grads: Mapping[str, np.ndarray], ax=None, *, tiny: float = 2.0 ** -24,
                        title: str | None = None):
    """Histogram of log2 |gradient| per series, with fp16's smallest number marked."""
    ax = _ax(ax)
    for name, g in grads.items():
        g = np.abs(np.asarray(g, dtype=float))
        g = g[g > 0]
        ax.hist(np.log2(g), bins=60, alpha=0.5, label=name)
    ax.axvline(np.log2(tiny), color="k", ls="--", lw=1, label="fp16 smallest (2^-24)")
    ax.set_xlabel("log2 |gradient|")
    ax.set_ylabel("count")
    ax.set_title(title or "gradient magnitudes", fontsize=9)
    ax.legend(fontsize=7)
    return ax


__all__ = ["COLORS", "timeline_array", "plot_timeline", "plot_lenses", "plot_curve",
           "plot_tradeoff", "plot_grad_histogram"]


def plot_advice(advice: Advice, ax=None):
    """The flowchart path: one bar per step tried (kept: solid, left out: hatched), with the
    card's memory and the usable part (less headroom) as lines. The axis is linear from 0 so
    that a bar's height reads as bytes (a log axis made a 52 GiB bar look empty beside
    100 GiB ones)."""
    ax = ax or plt.subplots(figsize=(8, 3.4))[1]
    GiB = 2**30
    names = [s["technique"] for s in advice.steps]
    peaks = [s["peak_bytes"] / GiB for s in advice.steps]
    colors = ["#55a868" if s["fits"] else ("#c44e52" if s["kept"] else "#dddddd") for s in advice.steps]
    bars = ax.bar(range(len(names)), peaks, color=colors, edgecolor="k", lw=0.5)
    for b, s in zip(bars, advice.steps):
        if not s["kept"]:
            b.set_hatch("//")
        if s["simulated_bytes"] is not None:
            ax.plot(b.get_x() + b.get_width() / 2, s["simulated_bytes"] / GiB, "kD", ms=4)
    ax.axhline(advice.budget_bytes / GiB, color="k", lw=1, label="card memory")
    ax.axhline(advice.usable_bytes / GiB, color="k", ls="--", lw=1,
               label=f"usable ({advice.headroom:.0%} headroom)")
    ax.set_xticks(range(len(names)), [f"+ {n}" if i else n for i, n in enumerate(names)],
                  rotation=30, ha="right", fontsize=8)
    ax.set_ylim(0, 1.08 * max(peaks + [advice.budget_bytes / GiB]))
    ax.set_ylabel("peak per rank (GiB)")
    cfg = advice.step.model_config
    ax.set_title(f"{cfg.name}, seq {advice.step.seq}, batch {advice.step.batch}, "
                 f"{advice.step.world_size} rank(s): {'fits' if advice.fits else 'does NOT fit'}",
                 fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    return ax


def plot_pipeline(result: ParallelResult, schedule: str, m: int, ax=None):
    """Gantt chart of one step: forward (light) and backward (dark) of each micro-batch."""
    ax = ax or plt.subplots(figsize=(8, 2))[1]
    p = len(result.per_rank)
    for rank in range(p):
        run = pipeline_run(result, schedule, m, rank)
        for kind, mb, s, e in run["events"]:
            color = "tab:blue" if kind == "F" else "tab:orange"
            ax.barh(rank, e - s, left=s, color=color, alpha=0.5 if kind == "F" else 0.9,
                    edgecolor="k", linewidth=0.3)
            ax.text((s + e) / 2, rank, str(mb), ha="center", va="center", fontsize=7)
    wall = pipeline_run(result, schedule, m)["wall"]
    ax.axvline(wall, color="k", ls=":", lw=1)
    ax.set_yticks(range(p), [f"stage {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds (blue: forward, orange: backward; number: micro-batch)")
    ax.set_title(f"{schedule}, m={m}: bubble measured {pipeline_bubble(result, schedule, m):.2f}, "
                 f"formula {bubble_fraction(p, m):.2f}")
    return ax


def plot_bubble(result: ParallelResult, ax=None, *, highlight: tuple[str, int] | None = None):
    """Measured bubble (mean of the stages) against (p - 1)/(m + p - 1), over m."""
    ax = ax or plt.subplots(figsize=(4, 3))[1]
    p = len(result.per_rank)
    ms = sorted({r["m"] for r in result.per_rank[0]["runs"]})
    grid = range(1, max(ms) + 1)
    ax.plot(list(grid), [bubble_fraction(p, m) for m in grid], "k-", label="(p-1)/(m+p-1)")
    for sched, mark in (("gpipe", "o"), ("1f1b", "s")):
        pts = [(m, pipeline_bubble(result, sched, m)) for m in ms if pipeline_run(result, sched, m)]
        if pts:
            ax.plot(*zip(*pts), mark, label=f"{sched} measured")
    if highlight and pipeline_run(result, *highlight):
        ax.plot(highlight[1], pipeline_bubble(result, *highlight), "r*", ms=14)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble (idle share)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    return ax


def plot_stage_memory(result: ParallelResult, ax=None, *, rank: int = 0):
    """Peak bytes of one stage against m, GPipe vs 1F1B (the batch is fixed)."""
    ax = ax or plt.subplots(figsize=(4, 3))[1]
    for sched, mark in (("gpipe", "o-"), ("1f1b", "s-")):
        pts = [(r["m"], r["peak_bytes"] / 2**20) for r in result.per_rank[rank]["runs"]
               if r["schedule"] == sched and "peak_bytes" in r]
        if pts:
            ax.plot(*zip(*pts), mark, label=sched)
    ax.set_xlabel("micro-batches m (same batch)")
    ax.set_ylabel(f"stage {rank} peak (MiB)")
    ax.set_ylim(0, None)
    ax.legend(fontsize=8)
    return ax
