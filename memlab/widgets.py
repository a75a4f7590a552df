"""Control panels (ipywidgets 8) that re-run a step and redraw its figure.

>>> panel = StepPanel(StepConfig(seq=128, batch=4), seqs=(64, 128, 256),
...                   techniques={"none": {}, "full": {"checkpointing": "full"}})
>>> panel                       # sliders, drop-downs and the figure, in a notebook
>>> panel.seq.value = 256       # moving a control re-measures and redraws ...
>>> panel.data["peak_bytes"]    # ... and ``data`` holds what was just drawn

Setting a widget's value from code fires the same callback as a click, synchronously, so a
following cell can assert on :attr:`StepPanel.data` headless (under nbval).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

import ipywidgets as W
import matplotlib.pyplot as plt
from IPython.display import clear_output, display

from .step import MemoryReport, StepConfig
from .plots import plot_lenses, plot_timeline
from .techniques import category_max, lens_fn


class Panel:
    """What every control panel shares: its widgets in :attr:`box`, the figure it draws in
    :attr:`output`, and the data it drew last in :attr:`data` (for assert cells)."""

    box: W.Box
    output: W.Output
    data: dict | None = None

    def show(self, fig) -> None:
        """Replace the figure in the Output widget; close it so it shows only there."""
        with self.output:
            clear_output(wait=True)
            display(fig)
        plt.close(fig)

    def _repr_mimebundle_(self, **kwargs):
        return self.box._repr_mimebundle_(**kwargs)

    def _ipython_display_(self) -> None:
        display(self.box)


class StepPanel(Panel):
    """Sliders for sequence length and batch, drop-downs for technique and precision, and an
    Output widget with the step's timeline and its peak by category.

    ``techniques`` maps a label to :class:`StepConfig` overrides (e.g. ``{"checkpointing":
    "full"}``); ``precisions`` lists the precisions offered. Widgets that are not asked for
    are ``None``. ``lens`` is ``"measure"`` (default), ``"simulate"`` or ``"estimate"``.
    """

    def __init__(self, step: StepConfig, *, seqs: Sequence[int] = (64, 128, 256),
                 batches: Sequence[int] = (1, 2, 4, 8),
                 techniques: Mapping[str, dict] | None = None,
                 precisions: Sequence[str] | None = None, budget: int | str | None = None,
                 lens: str = "measure", device: str | None = "cpu", draw: bool = True):
        self.step, self.budget, self.lens, self.device = step, budget, lens, device
        self.techniques = dict(techniques or {})
        self.seq = W.SelectionSlider(options=list(seqs), value=_pick(seqs, step.seq),
                                     description="seq", continuous_update=False)
        self.batch = W.SelectionSlider(options=list(batches), value=_pick(batches, step.batch),
                                       description="batch", continuous_update=False)
        self.technique = (W.Dropdown(options=list(self.techniques), description="technique")
                          if self.techniques else None)
        self.precision = (W.Dropdown(options=list(precisions), value=_pick(precisions, step.precision),
                                     description="precision") if precisions else None)
        self.status = W.HTML()
        self.output = W.Output()
        self.data: dict | None = None
        self.history: list[dict] = []
        self.figure = None
        for w in self.controls:
            w.observe(self._changed, names="value")
        self.box = W.VBox([W.HBox(self.controls[:2]), W.HBox(self.controls[2:] + [self.status]),
                           self.output])
        if draw:
            self.refresh()

    @property
    def controls(self) -> list[W.Widget]:
        return [w for w in (self.seq, self.batch, self.technique, self.precision) if w is not None]

    def current_step(self) -> StepConfig:
        """The :class:`StepConfig` the controls describe now."""
        over = {"seq": self.seq.value, "batch": self.batch.value}
        if self.technique is not None:
            over.update(self.techniques[self.technique.value])
        if self.precision is not None:
            over["precision"] = self.precision.value
        return replace(self.step, **over)

    def _changed(self, change) -> None:
        self.refresh()

    def run(self, step: StepConfig) -> MemoryReport:
        kwargs = {"device": self.device} if self.lens == "measure" else {}
        return lens_fn(self.lens)(step, budget=self.budget, **kwargs)

    def refresh(self) -> dict:
        """Re-run the step for the current controls, redraw, and return the new data."""
        step = self.current_step()
        report = self.run(step)
        self.data = {
            "seq": step.seq, "batch": step.batch, "precision": step.precision,
            "technique": self.technique.value if self.technique is not None else None,
            "peak_bytes": report.peak_bytes, "by_category": dict(report.by_category),
            "max_activations": max_activations(report), "fits": report.fits, "report": report,
        }
        self.history.append(self.data)
        verdict = {True: "fits", False: "<b>OOM</b>", None: ""}[report.fits]
        self.status.value = f"peak {report.peak_bytes / 2**20:.1f} MiB {verdict}"
        self.draw(report)
        return self.data

    def draw(self, report: MemoryReport) -> None:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.4), width_ratios=(3, 1))
        plot_timeline(report, ax1)
        plot_lenses({report.lens: report}, ax2, title="at the peak")
        ax2.get_legend().remove()
        fig.tight_layout()
        self.show(fig)
        self.figure = fig


def max_activations(report: MemoryReport) -> int:
    """Most activation bytes alive at any point of the step (end of forward, usually): the
    peak by category can sit in the optimizer step, where activations are already gone."""
    return category_max(report, "activations")


def _pick(options: Sequence, value):
    """``value`` if it is offered, else the first option."""
    options = list(options)
    return value if value in options else options[0]


__all__ = ["Panel", "StepPanel", "max_activations"]
