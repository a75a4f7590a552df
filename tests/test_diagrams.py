"""The lessons' diagrams: each drawn bar means what its formula or measurement says."""
import itertools

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pytest

import memlab as ml
from memlab.classroom import plots
from memlab.distributed.pipeline_parallel import in_flight
from memlab.lenses.parallel_formulas import bubble_fraction, pipeline_schedule
from memlab.techniques import batching as bt
from memlab.techniques import sweeps
from memlab.tracking.tracker import CATEGORIES

MiB, GiB = 2**20, 2**30


@pytest.fixture(autouse=True)
def _close():
    yield
    plt.close("all")


def test_zero_partition_bars_are_the_papers_bytes_per_rank():
    psi, n = 1_000_000_000, 4
    ax = plots.plot_zero_partition(psi, n)
    bars = [p for p in ax.patches]
    assert len(bars) == 4 * n * 3
    # Rajbhandari et al. 2020, sec. 5.1: 2 + 2 + 12 bytes per parameter (mixed-precision
    # Adam); stage 1 divides the 12 by N, stage 2 also the 2 of gradients, stage 3 all.
    expect = {0: (2, 2, 12), 1: (2, 2, 12 / n), 2: (2, 2 / n, 12 / n), 3: (2 / n, 2 / n, 12 / n)}
    for stage in range(4):
        for rank in range(n):
            start = (stage * n + rank) * 3
            widths = [bars[start + k].get_width() for k in range(3)]
            np.testing.assert_allclose(widths, [b * psi / GiB for b in expect[stage]])
            solid = [bars[start + k].get_alpha() == 1.0 for k in range(3)]
            assert solid == [stage >= 3, stage >= 2, stage >= 1]  # solid = sharded
    assert ax.get_xlim()[0] == 0  # a bar's length is bytes
    assert "GiB" in ax.get_xlabel()


def test_zero_partition_takes_the_formulas_keywords():
    ax = plots.plot_zero_partition(10_000_000, 2, param_bytes=4, grad_bytes=4)
    assert ax.patches[0].get_width() == pytest.approx(4 * 10_000_000 / MiB)


def test_tensor_split_draws_each_ranks_share_to_scale():
    d, f, t = 8, 32, 4
    ax = plots.plot_tensor_split(d, f, t)
    rects = ax.patches
    assert len(rects) == 2 * t
    first, second = rects[0::2], rects[1::2]
    for r in range(t):
        assert (first[r].get_width(), first[r].get_height()) == (f / t, d)   # columns of fc
        assert (second[r].get_width(), second[r].get_height()) == (d, f / t)  # rows of out
        assert first[r].get_facecolor() == second[r].get_facecolor()         # a colour per rank
    assert len({r.get_facecolor() for r in first}) == t
    with pytest.raises(ValueError, match="not divisible by t=3"):
        plots.plot_tensor_split(8, 32, 3)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m,f,b", [(2, 4, 1, 1), (4, 8, 1, 2), (3, 2, 2, 3)])
def test_schedule_bubble_and_dependencies(schedule, p, m, f, b):
    events = pipeline_schedule(p, m, schedule, forward=f, backward=b)
    end = {(k, s, j): e for s, stage in enumerate(events) for k, j, _, e in stage}
    start = {(k, s, j): a for s, stage in enumerate(events) for k, j, a, _ in stage}
    wall = max(end.values())
    assert wall == (m + p - 1) * (f + b)
    for s, stage in enumerate(events):
        assert len(stage) == 2 * m
        busy = sum(e - a for _, _, a, e in stage)
        assert 1 - busy / wall == pytest.approx((p - 1) / (m + p - 1))
        intervals = sorted((a, e) for _, _, a, e in stage)  # one op at a time per stage
        assert all(e0 <= a1 for (_, e0), (a1, _) in itertools.pairwise(intervals))
        for j in range(m):
            if s:
                assert start[("F", s, j)] >= end[("F", s - 1, j)]
            nxt = ("B", s + 1, j) if s < p - 1 else ("F", s, j)
            assert start[("B", s, j)] >= end[nxt]
        held = in_flight(stage)
        assert held == (m if schedule == "gpipe" else min(p - s, m))


def test_pipeline_schedule_plot_hatches_exactly_the_bubble():
    p, m = 4, 6
    ax = plots.plot_pipeline_schedule(p, m, "1f1b")
    by_row: dict[int, dict[str, float]] = {}
    for patch in ax.patches:
        row = round(patch.get_y() + patch.get_height() / 2)
        kind = patch.get_gid()
        by_row.setdefault(row, {}).setdefault(kind, 0.0)
        by_row[row][kind] += patch.get_width()
    assert sorted(by_row) == list(range(p))
    for row in by_row.values():
        total = sum(row.values())
        assert row["idle"] / total == pytest.approx(bubble_fraction(p, m))
        assert row["F"] == m and row["B"] == 2 * m
    with pytest.raises(ValueError, match="schedule='zb'"):
        pipeline_schedule(2, 2, "zb")


@pytest.fixture(scope="module")
def gpt_report():
    return ml.measure_step(ml.StepConfig(seq=64, batch=2))


def test_activation_life_is_the_measured_category(gpt_report):
    ax = plots.plot_activation_life(gpt_report)
    y = ax.lines[0].get_ydata()
    i = CATEGORIES.index("activations")
    np.testing.assert_allclose(y, [e.by_category[i] / MiB for e in gpt_report.timeline])
    assert y.max() == pytest.approx(sweeps.category_max(gpt_report, "activations") / MiB)
    last_forward = max(k for k, e in enumerate(gpt_report.timeline) if e.phase == "forward"
                       and k < len(y) // 2 + len(y) // 4)
    assert y[last_forward] == pytest.approx(y.max())  # the top is the end of forward
    assert y[-1] < 0.01 * y.max()                     # backward has freed them
    assert ax.get_ylim()[0] == 0


def test_activations_by_module_sum_to_the_category(gpt_report):
    parts = sweeps.activations_by_module(gpt_report)
    assert sum(parts.values()) == sweeps.category_max(gpt_report, "activations")
    assert [k for k in parts if k.startswith("blocks.")] == [f"blocks.{i}" for i in range(4)]
    # four identical blocks keep identical bytes
    assert len({parts[f"blocks.{i}"] for i in range(4)}) == 1
    ax = plots.plot_module_bytes(parts)
    np.testing.assert_allclose([p.get_width() for p in ax.patches],
                               [v / MiB for v in parts.values()])
    with pytest.raises(ValueError, match="no timeline"):
        sweeps.activations_by_module(ml.estimate_step(ml.StepConfig()))


def test_padding_plot_bars_are_slots():
    lengths = bt.sample_lengths(200, seed=0)
    plans = [bt.plan_batches(s, lengths, 1024, 256) for s in bt.STRATEGIES]
    ax = plots.plot_padding(plans)
    real, pad = ax.patches[:3], ax.patches[3:]
    for k, p in enumerate(plans):
        assert real[k].get_width() == pytest.approx(sum(lengths) / 1e3)
        assert real[k].get_width() + pad[k].get_width() == pytest.approx(p.slots / 1e3)
