"""Figures and control panels: they draw what was measured and react to their controls."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pytest

from memlab import CATEGORIES, StepConfig, measure_step
from memlab.classroom.plots import (
    plot_curve,
    plot_grad_histogram,
    plot_lenses,
    plot_timeline,
    plot_tradeoff,
    timeline_array,
)
from memlab.classroom.widgets import StepPanel

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
    assert (ax.lines[0].get_xdata()[0], ax.lines[0].get_ydata()[0]) == (0.5, 1.3)
    plt.close("all")


def test_grad_histogram_counts_every_nonzero_gradient_at_its_log2():
    """One bar per bin of log2 |g| (60 bins per series): the heights add up to the nonzero
    gradients of each series (a zero has no log2 and is left out), every value sits in a bar
    whose edges bracket its log2, and fp16's smallest number is the line at -24."""
    small = -(2.0 ** np.arange(-40, -20))          # 20 values, below fp16's 2^-24 and not
    large = np.concatenate([2.0 ** np.arange(-12, -2), np.zeros(5)])  # 10 nonzero, 5 zeros
    ax = plot_grad_histogram({"small": small, "large": large})
    bars = ax.patches
    assert len(bars) == 2 * 60
    assert [sum(b.get_height() for b in bars[:60]), sum(b.get_height() for b in bars[60:])] == [20, 10]
    for series, values in ((bars[:60], small), (bars[60:], large[large != 0])):
        for x in np.log2(np.abs(values)):
            assert any(b.get_x() <= x <= b.get_x() + b.get_width() and b.get_height() >= 1 for b in series), x
    fp16 = [line for line in ax.lines if "fp16" in line.get_label()]
    assert len(fp16) == 1 and list(fp16[0].get_xdata()) == [-24, -24]
    plt.close("all")


def test_panel_remeasures_when_controls_change():
    panel = StepPanel(StepConfig(seq=64, batch=4), seqs=(32, 64), batches=(2, 4),
                      techniques={"none": {}, "full": {"checkpointing": "full"}},
                      precisions=["fp32", "bf16"])
    first = panel.data
    assert first.seq == 64 and first.technique == "none"
    panel.seq.value = 32
    assert panel.data.seq == 32
    assert panel.data.max_activations < first.max_activations / 1.8
    panel.technique.value = "full"
    assert panel.data.report.step.model_config.checkpointing == "full"
    assert panel.data.max_activations < panel.history[1].max_activations / 2
    assert len(panel.history) == 3
    assert "ckpt full" in panel.figure.axes[0].get_title()  # the figure drawn is the new step
    plt.close("all")


def test_panel_without_optional_controls():
    panel = StepPanel(StepConfig(seq=32, batch=2), seqs=(32,), batches=(2,), budget="1GiB")
    assert panel.technique is None and panel.precision is None
    assert panel.data.fits is True
    assert "fits" in panel.status.value


def test_advisor_panel_replans_when_controls_change():
    from memlab.classroom.widgets import AdvisorPanel
    panel = AdvisorPanel("gpt2-xl", "T4-16GB", 1, 1024, 8)
    small = panel.data
    assert small.gpu == "T4-16GB" and small.plan  # 1.5B parameters need techniques on 16 GB
    panel.gpu.value = "H200-141GB"
    big = panel.data
    assert big.gpu == "H200-141GB" and big.advice.budget_bytes == 143771 * MiB
    # the flowchart is walked in one order: a larger card stops earlier on the same path
    assert big.plan == small.plan[:len(big.plan)] and len(big.plan) < len(small.plan)
    panel.model.value = "gpt2-small"
    assert panel.data.model == "gpt2-small" and panel.data.plan == []  # fits as it is
    panel.seq.value = 4096
    assert panel.data.seq == 1024  # clipped to GPT-2's block size
    assert panel.status.value == panel.data.advice.message
    plt.close("all")


def test_compression_panel_remeasures_when_controls_change():
    from memlab.classroom.widgets import CompressionPanel
    panel = CompressionPanel(StepConfig(seq=32, batch=2), seqs=(32, 64))
    assert panel.data.variant == "none" and panel.data.grad_error == 0
    panel.variant.value = "bf16"
    at32 = panel.data
    assert at32.variant == "bf16" and at32.seq == 32
    assert at32.activation_bytes < at32.baseline_activation_bytes and at32.grad_error > 0
    panel.seq.value = 64
    assert panel.data.seq == 64
    # twice the tokens: more activations kept, with and without compression
    assert panel.data.baseline_activation_bytes > at32.baseline_activation_bytes
    assert panel.data.activation_bytes > at32.activation_bytes
    plt.close("all")


def test_table_panel_remeasures_when_controls_change():
    """The technique, batch and sequence controls each re-measure (one panel: each build measures)."""
    from memlab.classroom.widgets import TablePanel
    step = StepConfig(seq=32, batch=1)
    panel = TablePanel(step, batches=(1, 2), seqs=(32, 64))
    assert panel.data.technique == "gradient checkpointing" and panel.data.batch == 1
    panel.technique.value = "mixed precision"
    base, bf16 = measure_step(step).peak_bytes, measure_step(step, precision="bf16").peak_bytes
    assert panel.data.technique == "mixed precision" and panel.data.seq == 32
    assert panel.data.saving == pytest.approx(1 - bf16 / base, rel=1e-12)
    panel.batch.value = 2
    assert panel.data.batch == 2 and "saved" in panel.status.value
    panel.batch.value = 1
    panel.seq.value = 64
    base = measure_step(StepConfig(seq=64, batch=1)).peak_bytes
    bf16 = measure_step(StepConfig(seq=64, batch=1), precision="bf16").peak_bytes
    assert panel.data.seq == 64 and panel.data.saving == pytest.approx(1 - bf16 / base, rel=1e-12)
    plt.close("all")


@pytest.mark.distributed
def test_pipeline_panel_redraws_when_controls_change():
    from memlab.classroom.widgets import PipelinePanel
    from memlab.distributed.pipeline_parallel import measure_pipeline
    result = measure_pipeline(StepConfig(seq=32, batch=4), 2, micro_batches=(1, 2, 4), repeats=1)
    panel = PipelinePanel(result)
    assert panel.data.m == 2 and panel.data.schedule == "gpipe"
    panel.schedule.value = "1f1b"
    # GPipe's bubble (p - 1) / (m + p - 1) with p = 2 stages; 1F1B holds at most p micro-batches
    assert panel.data.schedule == "1f1b" and panel.data.formula == pytest.approx(1 / 3)
    assert panel.data.in_flight <= 2
    panel.m.value = 4
    assert panel.data.m == 4 and panel.data.formula == pytest.approx(1 / 5)
    panel.m.value = 1
    assert panel.data.schedule == "gpipe"  # 1F1B needs m >= p: below that it is GPipe
    assert 0 <= panel.data.bubble < 1


def test_loss_spike_panel_follows_vocabulary_and_sequence():
    """Plain minus chunked loss, estimated: zero while a block's recomputation is the peak,
    then at least the logits and log-softmax the plain loss holds (t x V x 4 bytes in the
    16-bit forward of a DeepSpeed step), growing with the vocabulary."""
    from memlab.classroom.widgets import LossSpikePanel
    step = StepConfig(model="llama-3-8b", seq=8192, batch=1, precision="bf16",
                      checkpointing="full", zero=2, offload="optimizer")
    panel = LossSpikePanel(step)
    big = panel.data
    assert big.vocab == 128256 and big.spike_bytes == 8192 * 128256 * 4
    assert big.plain_moment == "log-softmax backward" and big.saving > 0
    panel.vocab.value = 256000
    assert panel.data.saving >= panel.data.spike_bytes * 0.9 > big.saving
    panel.vocab.value = 32000
    assert panel.data.saving == 0 and panel.data.plain_moment == panel.data.chunked_moment
    plt.close("all")


def test_tensor_parallel_panel_redraws_with_the_formula():
    from memlab.classroom.widgets import TensorParallelPanel
    from memlab.lenses.parallel_formulas import tp_activation_bytes
    from memlab.models.gpt_unet import get_config
    panel = TensorParallelPanel("gpt2-medium", seq=1024, batch=1)
    assert panel.t.options == (1, 2, 4, 8, 16)           # 16 heads, MLP 4096
    panel.t.value = 4
    f = tp_activation_bytes(get_config("gpt2-medium"), 1024, 1, 4)
    assert panel.data.t == 4 and panel.data.total == f["total"]
    # Korthikanti et al. 2022 sec. 4.2.1, fp32 without dropout: 16 sbh stay whole on every rank
    h = get_config("gpt2-medium").d_model
    assert panel.data.replicated >= 16 * 1024 * h
    panel.model.value = "gpt2-xl"                         # 25 heads: 2 and 4 are not allowed
    assert panel.t.options == (1,) and panel.data.t == 1 and panel.data.model == "gpt2-xl"
    panel.seq.value = 2048
    assert panel.data.seq == 2048 and panel.data.total == \
        tp_activation_bytes(get_config("gpt2-xl"), 2048, 1, 1)["total"]
    plt.close("all")
