"""Figures for the lessons, all matplotlib (inline, offline: no CDN, no network).

- :func:`plot_timeline`: live bytes by category, stacked, op by op through one step.
- :func:`plot_lenses`: estimate / simulate / measure side by side as stacked bars.
- :func:`plot_calculator`: a step's peak by category against a card's memory.
- :func:`plot_curve`: a measured quantity against sequence length or batch, formula overlaid.
- :func:`plot_tradeoff`: memory against time, both as ratios to a baseline.
- :func:`plot_grad_histogram`: gradient magnitudes against the smallest fp16 number.
- :func:`plot_snapshot`: a CUDA allocator snapshot's live and reserved bytes over time.

Over 500 lines because there is one module for every figure, so that panels and notebooks draw
the same way (one job: turning reports into matplotlib axes).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

from memlab.core.errors import InputError
from memlab.core.units import GiB, MiB, binary_unit
from memlab.distributed.pipeline_parallel import in_flight, pipeline_bubble, pipeline_run
from memlab.lenses.parallel_formulas import bubble_fraction, pipeline_schedule
from memlab.step.training_step import MemoryReport
from memlab.step.zero import zero_formula
from memlab.tracking.tracker import CATEGORIES

if TYPE_CHECKING:
    from memlab.distributed.parallel_common import ParallelResult
    from memlab.planning.advisor import Advice
    from memlab.techniques.batching import BatchPlan
    from memlab.tracking.snapshot import SnapshotTimeline

COLORS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer": "#55a868",
          "activations": "#c44e52", "temporaries": "#8172b3", "other": "#937860",
          "workspace": "#8c8c8c"}
PHASE_SHADE = {"forward": "#f2f2f2", "backward": "#e6eef7", "optimizer": "#eef7e6"}
# Bottom to top of every stacked figure: the bands that keep their size through a step (model
# states, the batch and buffers, the allocator's resident workspace) first, so each one stays
# flat; the ones that rise and fall on top. Stacked on gradients, the constant optimizer band
# climbed with them and read as growing.
STACK_ORDER = ("parameters", "optimizer", "other", "workspace", "gradients", "activations",
               "temporaries")


def _ax(ax):
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    return ax


def legend_outside(ax, handles=None, labels=None, **kwargs):
    """The axes' legend to the right of its data area, top-aligned, one column: inside, it
    covered what the figure shows (a timeline's forward ramp, a trade-off's labelled points).

    Args:
        ax: the axes.
        handles, labels: as for :meth:`matplotlib.axes.Axes.legend` (default: the labelled artists).
        **kwargs: more legend options (they override these).

    Returns:
        The :class:`matplotlib.legend.Legend`.
    """
    opts = {"fontsize": 7, "loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0,
            "frameon": False, **kwargs}
    if handles is None:
        handles, labels = ax.get_legend_handles_labels()
    return ax.legend(handles, labels, **opts)


def timeline_array(report: MemoryReport) -> np.ndarray:
    """The timeline as an (ops x categories) array of MiB, categories in :data:`CATEGORIES`."""
    if not report.timeline:
        return np.zeros((0, len(CATEGORIES)))
    return np.array([e.by_category for e in report.timeline], dtype=float) / MiB


def plot_timeline(report: MemoryReport, ax=None, *, title: str | None = None, legend: bool = True):
    """Stacked live MiB by category through the step, phases shaded, budget and OOM marked.

    Args:
        report: a report with a timeline (measured or simulated).
        ax: the axes to draw on (default: a new 7 x 3.5 in figure).
        title: the title (default: the lens, model, step and peak).
        legend: draw the legend, right of the axes (off for all but one of side-by-side plots).

    Returns:
        The axes. Bands stack in :data:`STACK_ORDER`; the legend reads top to bottom as the
        stack does and names only the categories that hold bytes in this step.
    """
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
    order = [CATEGORIES.index(c) for c in STACK_ORDER]
    bands = ax.stackplot(x, data[:, order].T, labels=STACK_ORDER, colors=[COLORS[c] for c in STACK_ORDER],
                         zorder=1)
    held = data[:, order].max(axis=0) > 0
    handles = [b for b, h in zip(bands, held, strict=True) if h][::-1]  # top band first, as drawn
    if report.budget_bytes is not None:
        handles.append(ax.axhline(report.budget_bytes / MiB, color="k", ls="--", lw=1, label="budget"))
    if report.oom is not None:
        # the failing op is where live bytes went over the budget: the highest point
        at = int(data.sum(axis=1).argmax())
        handles += ax.plot([at], [report.oom.live_bytes / MiB], "kx", ms=10, mew=2, label="OOM", zorder=3)
    ax.set_xlim(0, max(len(data) - 1, 1))
    ax.set_xlabel("op of the step (in the order run)")
    ax.set_ylabel("live MiB")
    ax.set_title(title or _title(report), fontsize=9, pad=12)
    if legend:
        legend_outside(ax, handles, [h.get_label() for h in handles])
    return ax


def plot_snapshot(timeline: "SnapshotTimeline", ax=None, *, title: str | None = None):
    """Live bytes (filled) and reserved bytes (line) after each allocator action of a CUDA
    snapshot (:func:`memlab.tracking.snapshot.live_timeline`), peak and any OOM marked: the offline
    version of pytorch.org/memory_viz's active-memory timeline."""
    ax = _ax(ax)
    if not timeline.actions:
        ax.text(0.5, 0.5, "empty trace", ha="center", transform=ax.transAxes)
        return ax
    t = np.array(timeline.time_ms)
    live = np.array(timeline.live_bytes, dtype=float) / MiB
    ax.fill_between(t, live, step="post", color=COLORS["activations"], alpha=0.6,
                    label="allocated (live tensors)")
    ax.step(t, np.array(timeline.reserved_bytes, dtype=float) / MiB, where="post", color="k",
            lw=1, label="reserved (segments held)")
    ax.axhline(timeline.start_bytes / MiB, color=COLORS["parameters"], ls=":", lw=1,
               label="live before recording")
    if timeline.peak_index >= 0:
        i = timeline.peak_index
        ax.plot([t[i]], [live[i]], "v", color="k", label=f"peak {live[i]:.0f} MiB")
    for i in timeline.ooms:
        ax.plot([t[i]], [live[i]], "kx", ms=10, mew=2, label="OOM")
    ax.set_xlabel("ms since recording began")
    ax.set_ylabel("MiB")
    ax.set_ylim(0, None)
    ax.set_title(title or f"CUDA allocator, device {timeline.device}: peak "
                 f"{timeline.peak_bytes / MiB:.0f} MiB", fontsize=9)
    legend_outside(ax)
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
    for c in STACK_ORDER:  # the timeline's order, so that a bar beside it reads the same way
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
    handles, names = ax.get_legend_handles_labels()
    n = len(STACK_ORDER)  # the bars' entries come first: list them top of the bar first
    legend_outside(ax, handles[:n][::-1] + handles[n:], names[:n][::-1] + names[n:])
    return ax


def plot_calculator(by_category: Mapping[str, float], card_bytes: int, ax=None, *,
                    title: str | None = None):
    """One horizontal bar of a step's peak by category (GiB), against the card's memory
    (the black line): what :class:`memlab.classroom.widgets.CalculatorPanel` draws."""
    ax = _ax(ax)
    left = 0.0
    for c in STACK_ORDER:
        v = by_category.get(c, 0) / 2**30
        ax.barh([0], [v], left=left, color=COLORS[c], label=c)
        left += v
    ax.axvline(card_bytes / 2**30, color="k", lw=2, label="card")
    ax.set_xlim(0, 1.15 * max(left, card_bytes / 2**30))
    ax.set_yticks([])
    ax.set_xlabel("GiB per rank at the peak")
    ax.set_title(title or f"peak {left:.1f} GiB of {card_bytes / 2**30:.0f} GiB", fontsize=9)
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
    ax.set_title(title or f"{ylabel} against {xlabel}", fontsize=9)
    legend_outside(ax)
    return ax


# The curriculum's claim for gradient checkpointing (course/curriculum.md, comparison table):
# ~50-70% of the memory saved for +30-50% compute, as (memory ratio, compute ratio) ranges.
CURRICULUM_CHECKPOINTING = ((0.3, 0.5), (1.3, 1.5))


def plot_tradeoff(points: Mapping[str, tuple[float, float]], ax=None, *, title: str | None = None,
                  ylabel: str = "step time / baseline (measured)"):
    """Peak memory ratio (x) against a cost ratio (y), both relative to a baseline, with the
    curriculum's checkpointing claim drawn as a box.

    Args:
        points: technique -> (peak memory / baseline, cost / baseline).
        ax: the axes to draw on (default: a new 7 x 3.5 in figure).
        title: the title (default: "memory saved against its cost").
        ylabel: what the y ratio is: the default is a measured step time; a lesson that counts
            FLOPs says so (e.g. "FLOPs per step / baseline").

    Returns:
        The axes. Its limits hold every point, the baseline (1, 1) and the claim's box; the
        x axis starts at 0 so that a ratio reads as a share of the baseline. Point labels are
        placed where they overlap no other label or point; the legend sits right of the axes.
    """
    ax = _ax(ax)
    names = list(points)
    xy = np.array([points[n] for n in names], dtype=float).reshape(-1, 2)
    for i, (mem, cost) in enumerate(xy):
        ax.plot(mem, cost, "o", ms=8, color=f"C{i % 10}", zorder=3)
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.axhline(1.0, color="grey", lw=0.8)
    (x0, x1), (y0, y1) = CURRICULUM_CHECKPOINTING
    ax.add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, color="gold", alpha=0.3,
                           label="curriculum, checkpointing:\n50-70% less memory,\n+30-50% compute"))
    xs = np.concatenate([xy[:, 0], [0.0, 1.0, x1]])
    ys = np.concatenate([xy[:, 1], [1.0, y0, y1]])
    ax.set_xlim(0.0, xs.max() + 0.06 * (xs.max() - xs.min()))
    pad = 0.08 * (ys.max() - ys.min())
    ax.set_ylim(ys.min() - pad, ys.max() + pad)
    ax.set_xlabel("peak memory / baseline (1 = no saving)")
    ax.set_ylabel(ylabel)
    ax.set_title(title or "memory saved against its cost", fontsize=9)
    legend_outside(ax)
    place_labels(ax, xy, names, colors=[f"C{i % 10}" for i in range(len(names))])
    return ax


def place_labels(ax, xy: np.ndarray, names: Sequence[str], *, fontsize: float = 8,
                 colors: Sequence[str] | None = None) -> list:
    """Annotate each point ``xy[i]`` (data coordinates) with ``names[i]``, trying offsets around
    it, nearest first, and keeping the first whose text stays inside the axes and overlaps no
    label placed before nor any point (the least-overlapping one when none is free). A label
    that had to move away from its point gets a thin line back to it.

    Args:
        ax: the axes, its limits already set (the placement is measured on its figure's canvas).
        xy: (n, 2) array of points.
        names: one label per point.
        fontsize: the labels' size in points.
        colors: the labels' colours (default black), e.g. each its point's.

    Returns:
        The annotations, in the order of ``names``.
    """
    fig = ax.figure
    renderer = fig.canvas.get_renderer() if hasattr(fig.canvas, "get_renderer") else None
    # (dx, dy) in points and the text's anchor: right, left, above, below, then the diagonals,
    # on rings further out
    sides = ((1, 0.3, "left", "bottom"), (1, -0.3, "left", "top"), (-1, 0.3, "right", "bottom"),
             (-1, -0.3, "right", "top"), (0, 1, "center", "bottom"), (0, -1, "center", "top"),
             (0.8, 0.8, "left", "bottom"), (-0.8, 0.8, "right", "bottom"), (0.8, -0.8, "left", "top"),
             (-0.8, -0.8, "right", "top"))
    tries = [(dx * r, dy * r, ha, va) for r in (7, 14, 24, 36) for dx, dy, ha, va in sides]
    at = ax.transData.transform(xy) if len(xy) else np.zeros((0, 2))
    dots = [(px - 5, py - 5, px + 5, py + 5) for px, py in at]  # each marker's square, in pixels
    frame = ax.get_window_extent(renderer)
    placed, out = [], []
    for i, name in enumerate(names):
        best = None
        for dx, dy, ha, va in tries:
            t = ax.annotate(name, tuple(xy[i]), textcoords="offset points", xytext=(dx, dy), ha=ha, va=va,
                            fontsize=fontsize, zorder=4, color=colors[i] if colors else "k")
            if renderer is None:  # a canvas that cannot measure text: the first offset
                best = (0.0, t)
                break
            b = t.get_window_extent(renderer).padded(3)
            box = (b.x0, b.y0, b.x1, b.y1)
            clash = sum(_overlap(box, o) for o in placed) + sum(_overlap(box, d) for d in dots)
            clash += (b.width * b.height) - _overlap(box, (frame.x0, frame.y0, frame.x1, frame.y1))  # outside
            if best is None or clash < best[0]:
                if best is not None:
                    best[1].remove()
                best = (clash, t)
            else:
                t.remove()
            if clash == 0:
                break
        t = best[1]
        if renderer is not None:
            b = t.get_window_extent(renderer)
            placed.append((b.x0, b.y0, b.x1, b.y1))
            dx, dy = t.xyann
            if abs(dx) > 8 or abs(dy) > 8:  # moved away: a line back to the point says whose label it is
                t.remove()
                ha, va = t.get_ha(), t.get_va()
                corner = ({"left": 0, "right": 1}.get(ha, 0.5), {"bottom": 0, "top": 1}.get(va, 0.5))
                t = ax.annotate(name, tuple(xy[i]), textcoords="offset points", xytext=(dx, dy), ha=ha, va=va,
                                fontsize=fontsize, zorder=4, color=t.get_color(),
                                arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "grey", "shrinkA": 0,
                                            "shrinkB": 4, "relpos": corner})
        out.append(t)
    return out


def _overlap(a: tuple, b: tuple) -> float:
    """Area shared by two (x0, y0, x1, y1) boxes."""
    return max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))


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
    legend_outside(ax)
    return ax


__all__ = ["COLORS", "STACK_ORDER", "CURRICULUM_CHECKPOINTING", "legend_outside", "place_labels",
           "timeline_array", "plot_timeline", "plot_lenses", "plot_curve", "plot_tradeoff",
           "plot_grad_histogram", "plot_snapshot"]


def plot_advice(advice: Advice, ax=None):
    """The flowchart path: one bar per step tried (kept: solid, left out: hatched), with the
    card's memory and the usable part (less headroom) as lines. The axis is linear from 0 so
    that a bar's height reads as bytes (a log axis made a 52 GiB bar look empty beside
    100 GiB ones)."""
    ax = ax or plt.subplots(figsize=(8, 3.4))[1]
    names = [s.technique for s in advice.steps]
    peaks = [s.peak_bytes / GiB for s in advice.steps]
    colors = ["#55a868" if s.fits else ("#c44e52" if s.kept else "#dddddd") for s in advice.steps]
    bars = ax.bar(range(len(names)), peaks, color=colors, edgecolor="k", lw=0.5)
    for b, s in zip(bars, advice.steps, strict=True):
        if not s.kept:
            b.set_hatch("//")
        if s.simulated_bytes is not None:
            ax.plot(b.get_x() + b.get_width() / 2, s.simulated_bytes / GiB, "kD", ms=4)
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
            ax.plot(*zip(*pts, strict=True), mark, label=f"{sched} measured")
    if highlight and pipeline_run(result, *highlight):
        ax.plot(highlight[1], pipeline_bubble(result, *highlight), "r*", ms=14)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble (idle share of the step)")
    ax.set_ylim(0, 1)
    ax.set_title(f"pipeline bubble on {p} stages, measured and formula", fontsize=9)
    ax.legend(fontsize=8)
    return ax


def plot_stage_memory(result: ParallelResult, ax=None, *, rank: int = 0):
    """Peak bytes of one stage against m, GPipe vs 1F1B (the batch is fixed)."""
    ax = ax or plt.subplots(figsize=(4, 3))[1]
    for sched, mark in (("gpipe", "o-"), ("1f1b", "s-")):
        pts = [(r["m"], r["peak_bytes"] / MiB) for r in result.per_rank[rank]["runs"]
               if r["schedule"] == sched and "peak_bytes" in r]
        if pts:
            ax.plot(*zip(*pts, strict=True), mark, label=sched)
    ax.set_xlabel("micro-batches m (same batch)")
    ax.set_ylabel(f"stage {rank} peak (MiB)")
    ax.set_ylim(0, None)
    ax.set_title(f"stage {rank}'s peak against micro-batches: GPipe and 1F1B", fontsize=9)
    ax.legend(fontsize=8)
    return ax


# -- diagrams: pictures of what a formula or a measurement says -------------------------
ZERO_STAGE_NAMES = ("ZeRO-0: data parallel, all replicated", "ZeRO-1: optimizer states sharded",
                    "ZeRO-2: + gradients sharded", "ZeRO-3: + parameters sharded")


def plot_zero_partition(num_params: int, world_size: int = 4, ax=None, **formula):
    """What each rank holds under ZeRO stages 0-3: one bar per rank, its length the bytes of
    parameters, gradients and optimizer states on that rank (:func:`memlab.step.zero.zero_formula`,
    ``formula`` its keyword arguments). A sharded part is drawn solid and labelled with the
    rank's shard; a replicated one light. Linear axis from 0."""
    per = [zero_formula(num_params, s, world_size, **formula) for s in range(4)]
    scale, unit = binary_unit(sum(per[0].values()), smallest="KiB")
    rows = 4 * (world_size + 1)
    ax = ax or plt.subplots(figsize=(8, 0.28 * rows + 0.8))[1]
    cats, y = ("parameters", "gradients", "optimizer"), 0
    ticks, labels = [], []
    for s, parts in enumerate(per):
        ax.text(0, y, ZERO_STAGE_NAMES[s], va="center", fontsize=8, weight="bold")
        y += 1
        for r in range(world_size):
            left = 0.0
            for c in cats:
                w = parts[c] / scale
                sharded = parts[c] < per[0][c]  # smaller than the replica: a 1/N shard
                ax.barh(y, w, left=left, color=COLORS[c], alpha=1.0 if sharded else 0.35,
                        edgecolor="k", lw=0.3, label=c if s == 0 and r == 0 else None)
                if sharded and w > 0.06 * sum(per[0].values()) / scale:
                    ax.text(left + w / 2, y, f"{r + 1}/{world_size}", ha="center",
                            va="center", fontsize=6)
                left += w
            if r == 0:
                ax.text(left, y, f" {left:.3g} {unit}", va="center", fontsize=7)
            ticks.append(y)
            labels.append(f"rank {r}")
            y += 1
    ax.set_yticks(ticks, labels, fontsize=7)
    ax.set_ylim(y - 0.4, -0.6)
    ax.set_xlim(0, 1.18 * sum(per[0].values()) / scale)
    ax.set_xlabel(f"bytes per rank ({unit}); solid: this rank's 1/{world_size} shard, "
                  f"light: a full replica")
    ax.set_title(f"{num_params / 1e6:.4g}M parameters on {world_size} ranks", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    return ax


def plot_tensor_split(d_model: int, hidden: int, t: int = 2, ax=None, *,
                      names: tuple[str, str] = ("fc", "out")):
    """The two weight matrices of a Megatron MLP, split across ``t`` ranks (one colour per
    rank): the first (``d_model x hidden``, inputs x outputs) by columns, the second
    (``hidden x d_model``) by rows. Rectangles are drawn to scale."""
    for name, v in (("d_model", d_model), ("hidden", hidden), ("t", t)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"{name} must be a positive integer, got {v!r}")
    if hidden % t:
        raise InputError(f"hidden={hidden} is not divisible by t={t}")
    ax = ax or plt.subplots(figsize=(9, 4))[1]
    gap = 0.3 * max(d_model, hidden)
    x0 = hidden + gap  # the second matrix starts here
    for r in range(t):
        color = f"C{r}"
        ax.add_patch(Rectangle((r * hidden / t, 0), hidden / t, d_model, facecolor=color,
                               edgecolor="k", lw=0.8, alpha=0.75))
        ax.text((r + 0.5) * hidden / t, d_model / 2, f"rank {r}\n{d_model}x{hidden // t}",
                ha="center", va="center", fontsize=7)
        ax.add_patch(Rectangle((x0, r * hidden / t), d_model, hidden / t, facecolor=color,
                               edgecolor="k", lw=0.8, alpha=0.75))
        ax.text(x0 + d_model / 2, (r + 0.5) * hidden / t, f"rank {r}\n{hidden // t}x{d_model}",
                ha="center", va="center", fontsize=7)
    below = max(d_model, hidden) * 1.04
    ax.text(hidden / 2, d_model + 0.04 * hidden, f"{names[0]} ({d_model} x {hidden}): "
            "split by columns;\neach rank makes its own hidden features", ha="center", va="top",
            fontsize=8)
    ax.text(x0 + d_model / 2, hidden * 1.04, f"{names[1]} ({hidden} x {d_model}): split by rows;\n"
            "partial sums, one all-reduce", ha="center", va="top", fontsize=8)
    ax.set_xlim(-0.02 * hidden, x0 + d_model * 1.6)
    ax.set_ylim(below + 0.25 * max(d_model, hidden), -0.02 * hidden)  # row 0 at the top
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"a Megatron MLP's two weights split over {t} ranks (to scale)", fontsize=9)
    return ax


def plot_pipeline_schedule(p: int, m: int, schedule: str = "1f1b", ax=None, *,
                           forward: int = 1, backward: int = 2):
    """The ideal schedule (:func:`memlab.lenses.parallel_formulas.pipeline_schedule`): which micro-batch each
    stage runs in each time slot, forward light and backward dark, idle slots (the bubble)
    hatched. Every op takes its slots exactly; nothing here is timed."""
    events = pipeline_schedule(p, m, schedule, forward=forward, backward=backward)
    wall = max(e[3] for stage in events for e in stage)
    ax = ax or plt.subplots(figsize=(8, 0.45 * p + 0.9))[1]
    for s, stage in enumerate(events):
        t = 0
        for kind, j, a, b in sorted(stage, key=lambda e: e[2]):
            if a > t:  # a gap in this stage's work: the bubble
                ax.barh(s, a - t, left=t, color="white", edgecolor="#888888", hatch="////",
                        lw=0.4, gid="idle")
            fwd = kind == "F"
            ax.barh(s, b - a, left=a, color="#a6cbe3" if fwd else "#f28e2b", edgecolor="k",
                    lw=0.4, gid=kind)
            ax.text((a + b) / 2, s, str(j), ha="center", va="center", fontsize=7)
            t = b
        if t < wall:
            ax.barh(s, wall - t, left=t, color="white", edgecolor="#888888", hatch="////",
                    lw=0.4, gid="idle")
    busy = sum(e[3] - e[2] for e in events[0])
    held = max(in_flight(stage) for stage in events)
    ax.set_yticks(range(p), [f"stage {s}" for s in range(p)], fontsize=8)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlim(0, wall)
    ax.set_xlabel(f"time slot (forward {forward}, backward {backward}; number: micro-batch; "
                  "hatched: idle)", fontsize=8)
    ax.set_title(f"{schedule}, p={p}, m={m}: each stage idle {1 - busy / wall:.0%} "
                 f"= (p-1)/(m+p-1); holds up to {held} micro-batches", fontsize=9)
    return ax


def plot_activation_life(report: MemoryReport | Mapping[str, MemoryReport], ax=None, *,
                         title: str | None = None):
    """Bytes of activations alive after every op of a measured step: they rise in forward
    (each layer saves its tensors) and fall in backward (the last layer's go first).
    Several reports are drawn as lines over one another."""
    ax = _ax(ax)
    reports = {report.step.model_config.checkpointing: report} if isinstance(report, MemoryReport) \
        else dict(report)
    i = CATEGORIES.index("activations")
    for n, (name, r) in enumerate(reports.items()):
        if not r.timeline:
            raise InputError(f"the {r.lens!r} report has no timeline; plot a measured one")
        y = np.array([e.by_category[i] for e in r.timeline], dtype=float) / MiB
        x = np.arange(len(y))
        forward = np.array([e.phase == "forward" for e in r.timeline])
        color = COLORS["activations"] if len(reports) == 1 else f"C{n}"
        ax.plot(x, y, color=color, lw=1.2, label=f"{name}: {y.max():.1f} MiB at the end of forward")
        if len(reports) == 1:  # one step: shade forward (saving) and backward (freeing)
            ax.fill_between(x, 0, y, where=forward, color=color, alpha=0.35, lw=0)
            ax.fill_between(x, 0, y, where=~forward, color=color, alpha=0.12, lw=0)
        else:  # several: mark where each forward ends
            top = int(y.argmax())
            ax.plot([top], [y[top]], "o", color=color, ms=4)
    ax.set_xlim(0, None)
    ax.set_ylim(0, None)
    ax.set_xlabel("op of the step (forward: saving, then backward: freeing)" if len(reports) > 1
                  else "op of the step (dark: forward, saving; light: backward, freeing)")
    ax.set_ylabel("activations alive (MiB)")
    ax.set_title(title or "the life of activations through one step", fontsize=9)
    legend_outside(ax)
    return ax


def plot_module_bytes(by_module: Mapping[str, float], ax=None, *, title: str | None = None,
                      xlabel: str = "kept for backward (MiB)"):
    """Horizontal bars of bytes per module (e.g. :func:`memlab.techniques.sweeps.activations_by_module`),
    in the order given, in MiB on a linear axis from 0."""
    ax = ax or plt.subplots(figsize=(6, 0.3 * len(by_module) + 0.8))[1]
    names = list(by_module)
    vals = [by_module[k] / MiB for k in names]
    ax.barh(range(len(names)), vals, color=COLORS["activations"])
    for k, v in enumerate(vals):
        ax.text(v, k, f" {v:.2f}", va="center", fontsize=7)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_xlim(0, 1.15 * max(vals) if vals and max(vals) > 0 else 1)
    ax.set_xlabel(xlabel)
    ax.set_title(title or "bytes per module", fontsize=9)
    return ax


def plot_padding(plans: Mapping[str, BatchPlan] | Sequence[BatchPlan], ax=None):
    """One bar per batching plan (:mod:`memlab.techniques.batching`): its padded token slots, split
    into real tokens and padding, with the number of batches it takes. Linear axis from 0."""
    if not isinstance(plans, Mapping):
        plans = {p.strategy: p for p in plans}
    ax = ax or plt.subplots(figsize=(7, 0.5 * len(plans) + 1))[1]
    names = list(plans)
    real = np.array([plans[k].tokens for k in names], dtype=float)
    pad = np.array([plans[k].padding_tokens for k in names], dtype=float)
    scale = 1e3
    ax.barh(names, real / scale, color="#4c72b0", label="real tokens")
    ax.barh(names, pad / scale, left=real / scale, color="#dddddd", edgecolor="#999999",
            hatch="//", label="padding")
    for k, name in enumerate(names):
        p = plans[name]
        ax.text((real[k] + pad[k]) / scale, k, f" {p.padding_fraction:.0%} padding, "
                f"{len(p.batches)} batches", va="center", fontsize=7)
    ax.set_xlim(0, 1.45 * (real + pad).max() / scale)
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_xlabel("token slots, thousands (what the activations are sized by)")
    ax.set_title("real tokens and padding per batching plan", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    return ax
