"""Figures that say what they show: legends outside the data, constant bands flat, axes that
hold what they compare, labels that name the plotted quantity and do not collide, titles.
Properties of the drawn artists, not pixels (issue 28, item 3)."""
import json
from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.text import Text

from memlab import CATEGORIES, StepConfig, measure_step
from memlab.classroom.plots import (
    CURRICULUM_CHECKPOINTING,
    STACK_ORDER,
    plot_curve,
    plot_lenses,
    plot_module_bytes,
    plot_padding,
    plot_tensor_split,
    plot_timeline,
    plot_tradeoff,
)
from memlab.techniques.batching import plan_batches

MiB = 2**20
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report():
    return measure_step(StepConfig(seq=64, batch=4))


def _boxes(ax):
    """(axes data area, legend) window extents, after a draw so that both are laid out."""
    ax.figure.canvas.draw()
    return ax.get_window_extent(), ax.get_legend().get_window_extent()


def test_timeline_legend_is_outside_the_data_area(report):
    ax = plot_timeline(report)
    area, legend = _boxes(ax)
    assert not legend.overlaps(area), (legend, area)
    assert legend.x0 >= area.x1  # to the right, top-aligned: the forward ramp stays visible
    plt.close("all")


def test_timeline_stacks_constant_bands_flat_at_the_bottom(report):
    """Parameters and optimizer state hold their bytes through the measured step (checked
    first: the property is only meaningful then); drawn at the bottom of the stack, the
    parameter band's lower edge is 0 everywhere and each of the two bands has exactly two
    heights, a flat bottom and a flat top. Stacked over gradients (the old order) the
    optimizer band's edges climbed with them."""
    data = np.array([e.by_category for e in report.timeline], dtype=float) / MiB
    params, opt = data[:, CATEGORIES.index("parameters")], data[:, CATEGORIES.index("optimizer")]
    assert np.ptp(params) == 0 and np.ptp(opt) == 0 and opt[0] > 0
    assert np.ptp(data[:, CATEGORIES.index("gradients")]) > 0  # and gradients do vary
    ax = plot_timeline(report)
    bands = {c.get_label(): c for c in ax.collections if c.get_label() in CATEGORIES}
    assert set(bands) == set(CATEGORIES)
    for name, bottom in (("parameters", 0.0), ("optimizer", params[0])):
        ys = bands[name].get_paths()[0].vertices[:, 1]
        top = bottom + (params[0] if name == "parameters" else opt[0])
        np.testing.assert_allclose(np.unique(ys), [bottom, top], rtol=1e-9)
    plt.close("all")


def test_stack_order_is_every_category_once_constant_ones_first():
    assert sorted(STACK_ORDER) == sorted(CATEGORIES)
    assert STACK_ORDER[:2] == ("parameters", "optimizer")
    assert STACK_ORDER.index("gradients") > STACK_ORDER.index("optimizer")


def test_timeline_legend_names_whole_categories_top_band_first(report):
    """Every legend entry is a whole category name (none cut), listed as the stack reads from
    the top, and only categories that hold bytes in the step."""
    ax = plot_timeline(report)
    names = [t.get_text() for t in ax.get_legend().get_texts()]
    held = [c for c in STACK_ORDER if report.by_category.get(c, 0) > 0 or
            max(e.by_category[CATEGORIES.index(c)] for e in report.timeline) > 0]
    assert names == held[::-1]
    plt.close("all")


def test_lens_bars_stack_in_the_timelines_order(report):
    """A peak in backward holds gradients: the optimizer band still sits right on the parameters."""
    by = dict(report.by_category, gradients=3 * MiB)
    ax = plot_lenses({"measure": replace(report, by_category=by, peak_bytes=sum(by.values()))})
    bottoms = {c.get_label(): c.patches[0].get_y() for c in ax.containers}
    assert bottoms["parameters"] == 0
    assert bottoms["optimizer"] == pytest.approx(by["parameters"] / MiB)
    assert bottoms["gradients"] == pytest.approx((by["parameters"] + by["optimizer"] + by["other"]
                                                  + by["workspace"]) / MiB)
    area, legend = _boxes(ax)
    assert not legend.overlaps(area)
    plt.close("all")


def test_tradeoff_axes_hold_every_point_and_the_curriculum_box():
    """Lesson 05's ratios (measured on the tiny GPT: full checkpointing keeps 0.74 of the peak
    for 1.22x the FLOPs): the curriculum's box, 0.3-0.5 x 1.3-1.5, lay outside the old axes."""
    pts = {"none": (1.0, 1.0), "selective": (0.91, 1.02), "full": (0.74, 1.22)}
    ax = plot_tradeoff(pts, ylabel="FLOPs per step / baseline (counted)")
    (x0, x1), (y0, y1) = CURRICULUM_CHECKPOINTING
    lo_x, hi_x = ax.get_xlim()
    lo_y, hi_y = ax.get_ylim()
    for mem, cost in [*pts.values(), (x0, y0), (x1, y1)]:
        assert lo_x < mem < hi_x and lo_y < cost < hi_y, (mem, cost, ax.get_xlim(), ax.get_ylim())
    assert ax.get_ylabel() == "FLOPs per step / baseline (counted)"
    area, legend = _boxes(ax)
    assert not legend.overlaps(area)
    plt.close("all")


def test_lesson_05_labels_its_flop_ratio_as_flops():
    """05 plots a FLOP ratio: its call names it (the default label is a measured step time)."""
    nb = json.loads((ROOT / "notebooks" / "05_checkpointing.ipynb").read_text())
    calls = ["".join(c["source"]) for c in nb["cells"] if "plot_tradeoff(" in "".join(c["source"])]
    assert calls and all("ylabel=" in c and "FLOP" in c.split("ylabel=")[1] for c in calls), calls


def _label_boxes(ax):
    """Each label's text box (an annotation's own extent also spans its leader line)."""
    ax.figure.canvas.draw()
    r = ax.figure.canvas.get_renderer()
    return [Text.get_window_extent(t, r) for t in ax.texts]


# lesson 15's table on the tiny GPT (seq 256, batch 4, 2 gloo ranks): names as the table has
# them, ratios of the size it measures, several in one corner
TABLE_POINTS = {
    "gradient checkpointing": (0.80, 1.27), "mixed precision (bf16 autocast)": (0.97, 1.10),
    "activation compression (bf16)": (0.90, 1.05), "selective recomputation": (0.95, 1.03),
    "ZeRO-1": (0.82, 1.08), "ZeRO-2": (0.76, 1.12), "ZeRO-3": (0.70, 1.40),
    "ZeRO-2 + optimizer offload": (0.55, 2.10), "tensor parallelism": (0.66, 1.30),
    "pipeline parallelism": (0.60, 1.45),
}


@pytest.mark.parametrize("relayout", [False, True])
def test_table_plot_labels_do_not_collide_and_legend_is_outside(relayout):
    """Every point keeps a whole label inside the axes, no two labels overlap, and the
    legend is right of the axes (in lesson 15 it sat on the labels). ``relayout``: as
    ``Table.save`` draws it, tight_layout after plotting."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    plot_tradeoff(TABLE_POINTS, ax)
    if relayout:
        fig.tight_layout()
    boxes = _label_boxes(ax)
    assert sorted(t.get_text() for t in ax.texts) == sorted(TABLE_POINTS)
    area, legend = _boxes(ax)
    for i, a in enumerate(boxes):
        assert area.x0 <= a.x0 and a.x1 <= area.x1 and area.y0 <= a.y0 and a.y1 <= area.y1, ax.texts[i]
        assert not a.overlaps(legend)
        for j in range(i):
            assert not a.overlaps(boxes[j]), (ax.texts[i].get_text(), ax.texts[j].get_text())
    assert not legend.overlaps(area)
    plt.close("all")


def test_every_figure_has_a_title_and_named_axes():
    """Figures drawn without an explicit title still get one (the site's alt text)."""
    plans = [plan_batches(s, [5, 9, 12, 30, 31, 64], 128, 64) for s in ("fixed", "packed")]
    axes = [plot_curve([1, 2], {"peak": [1, 2]}, xlabel="batch", ylabel="peak (MiB)"),
            plot_module_bytes({"block 0": 2 * MiB, "block 1": MiB}), plot_padding(plans),
            plot_tensor_split(8, 32, 2)]
    for ax in axes:
        assert ax.get_title(), ax
    for ax in axes[:3]:
        assert ax.get_xlabel()
    assert axes[0].get_title() == "peak (MiB) against batch"
    plt.close("all")
