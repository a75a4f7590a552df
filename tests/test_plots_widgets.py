"""Figures and control panels: they draw what was measured and react to their controls."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from memlab import CATEGORIES, StepConfig, measure_step  # noqa: E402
from memlab.plots import (plot_curve, plot_grad_histogram, plot_lenses, plot_timeline,  # noqa: E402
                          plot_tradeoff, timeline_array)
from memlab.widgets import StepPanel  # noqa: E402

MiB = 2**20


@pytest.fixture(scope="module")
def report():
    return measure_step(StepConfig(seq=64, batch=4))


def test_timeline_array_matches_the_peak(report):
    arr = timeline_array(report)
    assert arr.shape == (len(report.timeline), len(CATEGORIES))
    assert arr.sum(axis=1).max() == pytest.approx(report.peak_bytes / MiB)


def test_plot_timeline_stacks_every_category(report):
    ax = plot_timeline(report)
    assert len(ax.collections) >= len(CATEGORIES)
    assert ax.get_ylabel() == "live MiB"
    plt.close("all")


def test_plot_timeline_marks_budget_and_oom():
    r = measure_step(StepConfig(seq=64, batch=4), budget="50MiB")
    assert r.fits is False
    ax = plot_timeline(r)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "budget" in labels and "OOM" in labels
    plt.close("all")


def test_plot_lenses_bars_sum_to_the_peaks(report):
    other = measure_step(StepConfig(seq=64, batch=4, checkpointing="full"))
    ax = plot_lenses({"none": report, "full": other})
    tops = {}
    for patch in ax.patches:
        x = round(patch.get_x() + patch.get_width() / 2)
        tops[x] = max(tops.get(x, 0), patch.get_y() + patch.get_height())
    assert tops[0] == pytest.approx(report.peak_bytes / MiB)
    assert tops[1] == pytest.approx(other.peak_bytes / MiB)
    plt.close("all")


def test_plot_curve_tradeoff_histogram():
    ax = plot_curve([1, 2, 4], {"acts": [1, 2, 4]}, formula={"acts": lambda x: x})
    assert len(ax.lines) == 2
    np.testing.assert_allclose(ax.lines[0].get_ydata(), [1, 2, 4])
    ax = plot_tradeoff({"full": (0.5, 1.3)})
    assert ax.lines[0].get_xdata()[0] == 0.5
    ax = plot_grad_histogram({"g": np.array([1e-9, 1e-3, 0.0])})
    assert len(ax.patches) > 0
    plt.close("all")


def test_panel_remeasures_when_controls_change():
    panel = StepPanel(StepConfig(seq=64, batch=4), seqs=(32, 64), batches=(2, 4),
                      techniques={"none": {}, "full": {"checkpointing": "full"}},
                      precisions=["fp32", "bf16"])
    first = panel.data
    assert first["seq"] == 64 and first["technique"] == "none"
    panel.seq.value = 32
    assert panel.data["seq"] == 32
    assert panel.data["max_activations"] < first["max_activations"] / 1.8
    panel.technique.value = "full"
    assert panel.data["report"].step.model_config.checkpointing == "full"
    assert panel.data["max_activations"] < panel.history[1]["max_activations"] / 2
    assert len(panel.history) == 3
    assert "ckpt full" in panel.figure.axes[0].get_title()  # the figure drawn is the new step
    plt.close("all")


def test_panel_without_optional_controls():
    panel = StepPanel(StepConfig(seq=32, batch=2), seqs=(32,), batches=(2,), budget="1GiB")
    assert panel.technique is None and panel.precision is None
    assert panel.data["fits"] is True
    assert "fits" in panel.status.value


def test_loss_spike_panel_follows_vocabulary_and_sequence():
    """Plain minus chunked loss, estimated: zero while a block's recomputation is the peak,
    then at least the logits and log-softmax the plain loss holds (t x V x 4 bytes in the
    16-bit forward of a DeepSpeed step), growing with the vocabulary."""
    from memlab.widgets import LossSpikePanel
    step = StepConfig(model="llama-3-8b", seq=8192, batch=1, precision="bf16",
                      checkpointing="full", zero=2, offload="optimizer")
    panel = LossSpikePanel(step)
    big = panel.data
    assert big["vocab"] == 128256 and big["spike_bytes"] == 8192 * 128256 * 4
    assert big["plain_moment"] == "log-softmax backward" and big["saving"] > 0
    panel.vocab.value = 256000
    assert panel.data["saving"] >= panel.data["spike_bytes"] * 0.9 > big["saving"]
    panel.vocab.value = 32000
    assert panel.data["saving"] == 0 and panel.data["plain_moment"] == panel.data["chunked_moment"]
    plt.close("all")
