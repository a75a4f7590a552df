"""Control panels (ipywidgets 8) that re-run a step and redraw its figure.

>>> panel = StepPanel(StepConfig(seq=128, batch=4), seqs=(64, 128, 256),
...                   techniques={"none": {}, "full": {"checkpointing": "full"}})
>>> panel                       # sliders, drop-downs and the figure, in a notebook
>>> panel.seq.value = 256       # moving a control re-measures and redraws ...
>>> panel.data.peak_bytes      # ... and ``data`` holds what was just drawn (a StepView)

Setting a widget's value from code fires the same callback as a click, synchronously, so a
following cell can assert on :attr:`StepPanel.data` headless (under nbval).

A size this machine cannot hold is refused before anything is built
(:class:`~memlab.lenses.guard.HostMemoryError`): the panel shows the one-line refusal in its
output, ``data.refused`` holds it, and the next size that fits measures as usual.

Over 500 lines because this is the one module allowed to import ipywidgets
(tests/test_architecture.py), so every panel lives here; each is a thin shell over a lens or
a domain function, with its figure in :mod:`memlab.classroom.plots`.
"""
from __future__ import annotations

import traceback
from dataclasses import asdict, dataclass, replace
from typing import Mapping, Sequence

import ipywidgets as W
import matplotlib.pyplot as plt
from IPython.display import clear_output, display

from memlab.classroom.plots import (
    plot_advice,
    plot_bubble,
    plot_calculator,
    plot_lenses,
    plot_module_bytes,
    plot_pipeline,
    plot_stage_memory,
    plot_timeline,
)
from memlab.classroom.technique_table import CLAIMS, SINGLE, measure_saving
from memlab.core.errors import InputError
from memlab.core.hardware import GPU_PRESETS
from memlab.core.units import GiB, MiB
from memlab.distributed.parallel_common import ParallelResult
from memlab.distributed.pipeline_parallel import pipeline_bubble, pipeline_run
from memlab.hf.shape import decoder_shape
from memlab.lenses.calculator import CHECKPOINTING, MODELS, Calculation, calculator
from memlab.lenses.estimate import estimate_step
from memlab.lenses.guard import HostMemoryError
from memlab.lenses.parallel_formulas import bubble_fraction, tp_activation_bytes
from memlab.models.chunked_loss import loss_spike_bytes
from memlab.models.diffusion import unet_module_key
from memlab.models.gpt_unet import PRESETS, UNetConfig, get_config
from memlab.planning.advisor import Advice, advise
from memlab.step.fine_tune_config import LoraConfig
from memlab.step.states import model_states
from memlab.step.training_step import PRECISIONS, MemoryReport, StepConfig
from memlab.techniques.compression import VARIANTS, compare
from memlab.techniques.sweeps import activations_by_module, category_max, lens_fn


# --------------------------------------------------------------------------------------
# What each panel drew last (its ``data``): one frozen record per panel
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepView:
    """What :class:`StepPanel` (and :class:`UNetPanel`) drew last."""

    seq: int
    """The sequence length (a UNet: the image side)."""
    batch: int
    """The batch."""
    precision: str
    """The step's precision."""
    technique: str | None
    """The technique drop-down's label (``None`` when the panel offers none)."""
    peak_bytes: int | None = None
    """The step's peak (``None`` when refused)."""
    by_category: dict[str, int] | None = None
    """Peak bytes by category."""
    max_activations: int | None = None
    """Most activation bytes alive at any point of the step (:func:`max_activations`)."""
    fits: bool | None = None
    """Whether the peak fits the budget (``None``: no budget, or refused)."""
    report: MemoryReport | None = None
    """The lens's report."""
    refused: str | None = None
    """The one-line refusal when this machine cannot hold the step (:meth:`Panel.refuse`)."""
    by_module: dict[str, int] | None = None
    """A UNet's bars: what each part keeps for backward, by resolution (:class:`UNetPanel`)."""


@dataclass(frozen=True)
class AdvisorView:
    """What :class:`AdvisorPanel` drew last."""

    model: str
    """The preset."""
    gpu: str
    """The card."""
    seq: int
    """The sequence length (clipped to the model's block size)."""
    world_size: int
    """Ranks."""
    batch: int
    """The batch."""
    plan: list[str]
    """The advisor's techniques, in order (empty when the step fits as it is)."""
    fits: bool
    """Whether the plan fits the card."""
    peak_bytes: int
    """The plan's estimated peak."""
    advice: Advice
    """The advisor's whole answer (:func:`memlab.planning.advisor.advise`)."""


@dataclass(frozen=True)
class CalculatorSettings:
    """The keyword arguments of :func:`memlab.lenses.calculator.calculator` the controls describe."""

    model: str
    """The model preset."""
    seq: int
    """Tokens per sequence."""
    batch: int
    """Sequences per rank."""
    precision: str
    """The step's precision."""
    checkpointing: str
    """Checkpointing."""
    zero: int
    """ZeRO stage."""
    ranks: int
    """Data-parallel ranks."""
    tensor_parallel: int
    """Tensor-parallel degree."""
    pipeline: int
    """Pipeline stages."""
    gpu: str
    """The card."""


@dataclass(frozen=True)
class CalculatorView(CalculatorSettings):
    """What :class:`CalculatorPanel` drew last: its settings and the calculation (or the error)."""

    error: str | None = None
    """The formulas' refusal of the setting (``None`` when valid)."""
    calculation: Calculation | None = None
    """The calculator's result (``None`` when refused)."""
    peak_bytes: int | None = None
    """The peak per rank."""
    by_category: dict[str, int] | None = None
    """The peak by category."""
    fits: bool | None = None
    """Whether the peak fits the card."""
    moment: str | None = None
    """Where the peak falls in the step."""


@dataclass(frozen=True)
class LossSpikeView:
    """What :class:`LossSpikePanel` drew last."""

    vocab: int
    """The vocabulary size."""
    seq: int
    """Tokens per sequence."""
    target: str
    """``cpu`` or ``cuda`` (the estimate's device)."""
    plain_peak: int
    """The step's peak with the plain loss."""
    chunked_peak: int
    """... with the chunked loss."""
    saving: int
    """``plain_peak - chunked_peak``."""
    spike_bytes: int
    """The logits and log-softmax the plain loss holds (:func:`memlab.models.chunked_loss.loss_spike_bytes`)."""
    plain_moment: str
    """Where the plain loss's peak falls."""
    chunked_moment: str
    """Where the chunked loss's peak falls."""


@dataclass(frozen=True)
class CompressionView:
    """What :class:`CompressionPanel` drew last."""

    variant: str
    """The compression variant."""
    seq: int
    """Tokens per sequence."""
    peak_bytes: int | None = None
    """The step's peak with the variant (``None`` when refused)."""
    activation_bytes: int | None = None
    """Activations kept with the variant."""
    baseline_activation_bytes: int | None = None
    """... without compression."""
    grad_error: float | None = None
    """The gradient's relative error against the uncompressed step."""
    refused: str | None = None
    """The one-line refusal when this machine cannot hold the step."""


@dataclass(frozen=True)
class TableView:
    """What :class:`TablePanel` drew last."""

    technique: str
    """The row of the table."""
    batch: int
    """The batch."""
    seq: int
    """Tokens per sequence."""
    saving: float | None = None
    """``1 - peak with / peak without`` (``None`` when refused)."""
    verdict: str | None = None
    """The curriculum claim's verdict at this size."""
    refused: str | None = None
    """The one-line refusal when this machine cannot hold the step."""


@dataclass(frozen=True)
class PipelineView:
    """What :class:`PipelinePanel` drew last."""

    schedule: str
    """``gpipe`` or ``1f1b`` (1F1B below ``m >= p`` is drawn as GPipe)."""
    m: int
    """Micro-batches."""
    bubble: float
    """The measured bubble."""
    formula: float
    """The bubble by formula, ``(p - 1) / (m + p - 1)``."""
    in_flight: int
    """Most micro-batches in flight on a stage."""
    peak_bytes: int | None
    """The stage's measured peak (``None`` when not measured)."""


@dataclass(frozen=True)
class TensorParallelView:
    """What :class:`TensorParallelPanel` drew last (bytes of one layer's activations per rank)."""

    model: str
    """The preset."""
    seq: int
    """Tokens per sequence."""
    batch: int
    """The batch."""
    t: int
    """The tensor-parallel degree."""
    replicated: float
    """What stays whole on every rank (norms, block inputs)."""
    sharded: float
    """What ``t`` divides."""
    total: float
    """``replicated + sharded``."""


@dataclass(frozen=True)
class FinetuneView:
    """What :class:`FinetunePanel` drew last."""

    peak_bytes: int
    """The estimated peak."""
    fits: bool | None
    """Whether it fits the card."""
    by_category: dict[str, int]
    """The peak by category."""
    report: MemoryReport
    """The estimate's report."""


class Panel:
    """What every control panel shares: its widgets in :attr:`box`, the figure it draws in
    :attr:`output`, and the data it drew last in :attr:`data` (for assert cells)."""

    box: W.Box
    output: W.Output
    data: object | None = None

    def show(self, fig) -> None:
        """Replace the figure in the Output widget; close it so it shows only there."""
        with self.output:
            clear_output(wait=True)
            display(fig)
        plt.close(fig)

    def refuse(self, error: HostMemoryError, data):
        """Show a refusal instead of a figure: one line in the output (and the status, if
        any); ``data`` (the panel's record of the controls, with a ``refused`` field) becomes
        that record with ``refused`` set. Nothing was built, and the traceback's frames are
        cleared so that nothing it saw stays alive."""
        traceback.clear_frames(error.__traceback__)
        line = f"refused: {error}"
        self.output.outputs = ()
        self.output.append_stdout(line + "\n")
        status = getattr(self, "status", None)
        if status is not None:
            status.value = "<b>refused</b>: does not fit this machine (see below)"
        self.data = replace(data, refused=line)
        return self.data

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
        self.data: StepView | None = None
        self.history: list[StepView] = []
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

    def refresh(self) -> StepView:
        """Re-run the step for the current controls, redraw, and return the new data."""
        step = self.current_step()
        controls = StepView(seq=step.seq, batch=step.batch, precision=step.precision,
                            technique=self.technique.value if self.technique is not None else None)
        try:
            report = self.run(step)
        except HostMemoryError as e:
            self.figure = None
            self.history.append(self.refuse(e, controls))
            return self.data
        self.data = replace(controls, peak_bytes=report.peak_bytes, by_category=dict(report.by_category),
                            max_activations=max_activations(report), fits=report.fits, report=report)
        verdict = {True: "fits", False: "<b>OOM</b>", None: ""}[report.fits]
        self.status.value = f"peak {report.peak_bytes / MiB:.1f} MiB {verdict}"
        self.draw(report)
        self.history.append(self.data)  # after draw: a UNet's draw adds its bars
        return self.data

    def draw(self, report: MemoryReport) -> None:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.4), width_ratios=(3, 1))
        plot_timeline(report, ax1)
        plot_lenses({report.lens: report}, ax2, title="at the peak")
        ax2.get_legend().remove()
        fig.tight_layout()
        self.show(fig)
        self.figure = fig


class UNetPanel(StepPanel):
    """A diffusion UNet's step: sliders for the image side and the batch, drop-downs for
    precision and checkpointing; the Output shows what each part of the UNet keeps for
    backward, by resolution (:func:`memlab.techniques.sweeps.activations_by_module`), and the
    step's peak by category. ``data.by_module`` holds the bars drawn last."""

    def __init__(self, step: StepConfig, *, images: Sequence[int] = (16, 32, 48),
                 batches: Sequence[int] = (1, 2, 4, 8),
                 precisions: Sequence[str] = ("fp32", "bf16"),
                 checkpointing: Sequence[str] = ("none", "full"),
                 budget: int | str | None = None, device: str | None = "cpu", draw: bool = True):
        if not isinstance(step.model_config, UNetConfig):
            raise InputError(f"UNetPanel needs a UNet step, got model {step.model_config.name!r}; "
                             f"use StepPanel for a GPT")
        super().__init__(step, seqs=images, batches=batches, precisions=precisions,
                         techniques={c: {"checkpointing": c} for c in checkpointing},
                         budget=budget, device=device, draw=False)
        self.seq.description = "image"
        self.technique.description = "checkpoint"
        if draw:
            self.refresh()

    def draw(self, report: MemoryReport) -> None:
        step = report.step
        by = activations_by_module(report, unet_module_key(step.model_config, step.seq))
        self.data = replace(self.data, by_module=by)
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8), width_ratios=(2, 1))
        plot_module_bytes(by, ax1, title=f"image {step.seq}px, batch {step.batch}, "
                          f"{step.precision}, checkpointing {step.model_config.checkpointing}")
        plot_lenses({report.lens: report}, ax2, title="at the peak")
        ax2.get_legend().remove()
        fig.tight_layout()
        self.show(fig)
        self.figure = fig


class AdvisorPanel(Panel):
    """Model, GPU, world size, sequence and batch controls; the Output draws the flowchart path
    (:func:`plot_advice`). Estimate only, so every change redraws at once; ``data`` holds what
    was drawn last."""

    def __init__(self, model: str = "gpt2-xl", gpu: str = "A100-40GB", world_size: int = 1,
                 seq: int = 1024, batch: int = 8, *, draw: bool = True):
        self.model = W.Dropdown(options=[m for m in PRESETS if m != "tiny"], value=model,
                                description="model")
        self.gpu = W.Dropdown(options=list(GPU_PRESETS), value=gpu, description="GPU")
        self.world_size = W.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64], value=world_size,
                                            description="ranks", continuous_update=False)
        self.seq = W.SelectionSlider(options=[256, 512, 1024, 2048, 4096, 8192], value=seq,
                                     description="seq", continuous_update=False)
        self.batch = W.SelectionSlider(options=[1, 2, 4, 8, 16, 32], value=batch,
                                       description="batch", continuous_update=False)
        self.status = W.HTML()
        self.output = W.Output()
        self.data: AdvisorView | None = None
        controls = [self.model, self.gpu, self.world_size, self.seq, self.batch]
        for w in controls:
            w.observe(lambda change: self.refresh(), names="value")
        self.box = W.VBox([W.HBox(controls[:2]), W.HBox(controls[2:]), self.status, self.output])
        if draw:
            self.refresh()

    def refresh(self) -> AdvisorView:
        """Advise for the current controls, redraw, and return the new data."""
        seq = min(self.seq.value, get_config(self.model.value).block_size)
        a = advise(self.model.value, self.gpu.value, self.world_size.value, seq,
                   self.batch.value, simulate=False)
        self.data = AdvisorView(model=self.model.value, gpu=self.gpu.value, seq=seq,
                                world_size=self.world_size.value, batch=self.batch.value,
                                plan=list(a.plan), fits=a.fits, peak_bytes=a.peak_bytes, advice=a)
        self.status.value = a.message
        fig, ax = plt.subplots(figsize=(8, 3.4))
        plot_advice(a, ax)
        fig.tight_layout()
        self.show(fig)
        return self.data


class CalculatorPanel(Panel):
    """The real-scale calculator (:func:`memlab.lenses.calculator.calculator`, the estimate lens):
    model, sequence, batch, precision, checkpointing, ZeRO stage and ranks, tensor and
    pipeline degrees, and the card. Every change redraws the peak by category against the
    card's memory; ``data`` holds what was drawn last (its ``calculation`` is the result).
    A setting the formulas refuse (a degree that does not divide the heads, ...) shows its
    message instead of a figure."""

    def __init__(self, model: str = "gpt2-xl", *, seq: int = 1024, batch: int = 1,
                 precision: str = "bf16", checkpointing: str = "none", zero: int = 0,
                 ranks: int = 1, tensor_parallel: int = 1, pipeline: int = 1,
                 gpu: str = "A100-80GB", draw: bool = True):
        def slider(options, value, name):
            return W.SelectionSlider(options=list(options), value=_pick(options, value), description=name,
                                     continuous_update=False)
        self.model = W.Dropdown(options=list(MODELS), value=model, description="model")
        self.seq = slider((128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072), seq, "seq")
        self.batch = slider((1, 2, 4, 8, 16, 32, 64), batch, "batch")
        self.precision = W.Dropdown(options=list(PRECISIONS), value=precision, description="precision")
        self.checkpointing = W.Dropdown(options=list(CHECKPOINTING), value=checkpointing,
                                        description="checkpoint")
        self.zero = W.Dropdown(options=[0, 1, 2, 3], value=zero, description="ZeRO")
        self.ranks = slider((1, 2, 4, 8, 16, 32, 64, 128, 256), ranks, "ranks")
        self.tensor_parallel = slider((1, 2, 4, 8), tensor_parallel, "tensor")
        self.pipeline = slider((1, 2, 4, 8), pipeline, "pipeline")
        self.gpu = W.Dropdown(options=list(GPU_PRESETS), value=gpu, description="GPU")
        self.status = W.HTML()
        self.output = W.Output()
        self.data: CalculatorView | None = None
        for w in self.controls:
            w.observe(lambda change: self.refresh(), names="value")
        c = self.controls
        self.box = W.VBox([W.HBox(c[:4]), W.HBox(c[4:7]), W.HBox(c[7:]), self.status, self.output])
        if draw:
            self.refresh()

    @property
    def controls(self) -> list[W.Widget]:
        return [self.model, self.gpu, self.seq, self.batch, self.precision, self.checkpointing,
                self.zero, self.ranks, self.tensor_parallel, self.pipeline]

    def settings(self) -> CalculatorSettings:
        """The calculator's arguments the controls describe."""
        return CalculatorSettings(**{name: getattr(self, name).value  # each setting's control has its name
                                     for name in CalculatorSettings.__dataclass_fields__})

    def refresh(self) -> CalculatorView:
        """Calculate for the current controls, redraw, and return the new data."""
        settings = self.settings()
        kw = asdict(settings)
        try:
            c = calculator(**kw)
        except InputError as e:
            self.output.outputs = ()
            self.output.append_stdout(f"not a valid setting: {e}\n")
            self.status.value = "<b>not a valid setting</b> (see below)"
            self.data = CalculatorView(**kw, error=str(e))
            return self.data
        self.data = CalculatorView(**kw, calculation=c, peak_bytes=c.peak_bytes,
                                   by_category=c.by_category, fits=c.fits, moment=c.moment)
        verdict = "fits" if c.fits else "<b>does not fit</b>"
        host = f"; host {c.host_bytes / 2**30:.1f} GiB" if c.host_bytes else ""
        self.status.value = (f"peak {c.peak_bytes / 2**30:.2f} GiB per rank at {c.moment}: "
                             f"{verdict} a {kw['gpu']}{host}")
        fig, ax = plt.subplots(figsize=(8, 1.9))
        plot_calculator(c.by_category, c.card_bytes, ax,
                        title=f"{kw['model']}, seq {kw['seq']}, batch {kw['batch']}, "
                              f"{kw['precision']}: {c.peak_bytes / 2**30:.1f} GiB of "
                              f"{c.card_bytes / 2**30:.0f} GiB")
        fig.tight_layout()
        self.show(fig)
        self.figure = fig
        return self.data


class LossSpikePanel(Panel):
    """Vocabulary and sequence sliders and a target drop-down over a GPT step: the panel
    estimates the step with the plain loss and with the chunked one
    (:func:`memlab.lenses.estimate.estimate_step`, instant at any size) and draws both peaks by
    category. ``data`` holds the two peaks, their peak moments, the saving and the logits
    spike the plain loss holds (:func:`memlab.models.chunked_loss.loss_spike_bytes`)."""

    def __init__(self, step: StepConfig,
                 vocabs: Sequence[int] = (32000, 64000, 128256, 152064, 256000),
                 seqs: Sequence[int] = (1024, 2048, 4096, 8192, 16384, 32768),
                 *, target: str = "cpu", draw: bool = True):
        self.step, self.data = step, None
        cfg = step.model_config
        self.vocab = W.SelectionSlider(options=list(vocabs), value=_pick(vocabs, cfg.vocab_size),
                                       description="vocab", continuous_update=False)
        self.seq = W.SelectionSlider(options=list(seqs), value=_pick(seqs, step.seq),
                                     description="seq", continuous_update=False)
        self.target = W.Dropdown(options=["cpu", "cuda"], value=target, description="target")
        self.status = W.HTML()
        self.output = W.Output()
        for w in (self.vocab, self.seq, self.target):
            w.observe(lambda change: self.refresh(), names="value")
        self.box = W.VBox([W.HBox([self.vocab, self.seq, self.target]), self.status, self.output])
        if draw:
            self.refresh()

    def refresh(self) -> LossSpikeView:
        """Estimate both losses for the current controls, redraw, and return the new data."""
        vocab, seq, target = self.vocab.value, self.seq.value, self.target.value
        cfg = self.step.model_config
        reports = {}
        for loss in ("plain", "chunked"):
            model = replace(cfg, vocab_size=vocab, block_size=max(cfg.block_size, seq), loss=loss)
            reports[loss] = estimate_step(replace(self.step, model=model, seq=seq), target=target)
        plain, chunked = reports["plain"], reports["chunked"]
        s = self.step  # the loss runs in the forward's precision (16 bits under DeepSpeed)
        run = model_states(cfg, precision=s.precision, optimizer=s.optimizer, zero=s.zero,
                           world_size=s.world_size, offload=s.offload).compute_precision
        spike = loss_spike_bytes(seq * s.batch, vocab, run)
        self.data = LossSpikeView(vocab=vocab, seq=seq, target=target, plain_peak=plain.peak_bytes,
                                  chunked_peak=chunked.peak_bytes,
                                  saving=plain.peak_bytes - chunked.peak_bytes, spike_bytes=spike,
                                  plain_moment=plain.notes[0].removeprefix("peak moment: "),
                                  chunked_moment=chunked.notes[0].removeprefix("peak moment: "))
        self.status.value = (f"plain {plain.peak_bytes / GiB:.2f} GiB at {self.data.plain_moment}; "
                             f"chunked {chunked.peak_bytes / GiB:.2f} GiB at "
                             f"{self.data.chunked_moment}; logits + log-softmax "
                             f"{spike / GiB:.2f} GiB")
        fig, ax = plt.subplots(figsize=(6.5, 3.2))
        plot_lenses(reports, ax, title=f"{cfg.name}: vocab {vocab}, {seq} tokens x {self.step.batch} "
                                       f"({target})")
        fig.tight_layout()
        self.show(fig)
        return self.data


class CompressionPanel(Panel):
    """A variant drop-down and a sequence slider; the Output shows the step's peak by category
    and the gradient error. ``data`` holds what was drawn last (for asserts under nbval)."""

    def __init__(self, step: StepConfig, seqs=(64, 128, 256), variants=tuple(VARIANTS),
                 *, draw: bool = True):
        self.step, self.data, self._rows = step, None, {}
        self.variant = W.Dropdown(options=list(variants), description="activations")
        self.seq = W.SelectionSlider(options=list(seqs), value=step.seq if step.seq in seqs else seqs[0],
                                     description="seq", continuous_update=False)
        self.output = W.Output()
        for w in (self.variant, self.seq):
            w.observe(lambda change: self.refresh(), names="value")
        self.box = W.VBox([W.HBox([self.variant, self.seq]), self.output])
        if draw:
            self.refresh()

    def refresh(self) -> CompressionView:
        """Measure the variant at the current sequence (once each), redraw, and return the new data."""
        step = replace(self.step, seq=self.seq.value)
        v = self.variant.value
        key = (step.seq, v)
        if key not in self._rows:  # one measurement per (seq, variant): the baseline is shared
            try:
                rows = compare(step, [v], repeats=0)
            except HostMemoryError as e:
                return self.refuse(e, CompressionView(variant=v, seq=step.seq))
            self._rows.update({(step.seq, k): r for k, r in rows.items()})
        row, base = self._rows[key], self._rows[(step.seq, "none")]
        self.data = CompressionView(variant=v, seq=step.seq, peak_bytes=row.peak_bytes,
                                    activation_bytes=row.activation_bytes,
                                    baseline_activation_bytes=base.activation_bytes, grad_error=row.grad_error)
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 2.8))
        a1.bar(["none", v], [base.activation_bytes / MiB, row.activation_bytes / MiB], color="#c44e52")
        a1.set_ylabel("activations kept (MiB)")
        a2.bar(["none", v], [base.peak_bytes / MiB, row.peak_bytes / MiB], color="#4c72b0")
        a2.set_ylabel("step peak (MiB)")
        fig.suptitle(f"seq {step.seq}, {v}: gradient error {row.grad_error:.1e}", fontsize=9)
        fig.tight_layout()
        self.show(fig)
        return self.data


class TablePanel(Panel):
    """A technique drop-down, a batch slider and a sequence slider: the panel measures the step
    with and without the technique, draws both peaks by category and says whether the
    curriculum's claim holds at this size. ``data`` holds what was drawn last."""

    def __init__(self, step: StepConfig, batches=(1, 2, 4, 8), *, seqs: Sequence[int] | None = None,
                 draw: bool = True):
        self.step, self.data, self._cache = step, None, {}
        seqs = list(seqs) if seqs else [step.seq]
        self.technique = W.Dropdown(options=list(SINGLE), description="technique")
        self.batch = W.SelectionSlider(options=list(batches), value=_pick(batches, step.batch),
                                       description="batch", continuous_update=False)
        self.seq = W.SelectionSlider(options=seqs, value=_pick(seqs, step.seq),
                                     description="seq", continuous_update=False)
        self.status = W.HTML()
        self.output = W.Output()
        for w in (self.technique, self.batch, self.seq):
            w.observe(lambda change: self.refresh(), names="value")
        self.box = W.VBox([W.HBox([self.technique, self.batch, self.seq]), self.status, self.output])
        if draw:
            self.refresh()

    def refresh(self) -> TableView:
        """Measure the step with and without the technique (once per size), redraw, and return the new data."""
        key = (self.technique.value, self.batch.value, self.seq.value)
        if key not in self._cache:
            try:
                self._cache[key] = measure_saving(replace(self.step, batch=key[1], seq=key[2]), key[0])
            except HostMemoryError as e:
                return self.refuse(e, TableView(technique=key[0], batch=key[1], seq=key[2]))
        res = self._cache[key]
        self.data = TableView(technique=key[0], batch=key[1], seq=key[2], saving=res.saving, verdict=res.verdict)
        self.status.value = f"saved {res.saving:.0%} (curriculum: {CLAIMS[key[0]][0]}): {res.verdict}"
        reports = {name: MemoryReport("measure", self.step, "cpu", r.peak_bytes, r.by_category)
                   for name, r in (("baseline", res.baseline), (key[0], res.with_technique))}
        fig, ax = plt.subplots(figsize=(6.5, 3.2))
        plot_lenses(reports, ax, title=f"batch {key[1]}, seq {key[2]}: peak by category")
        fig.tight_layout()
        self.show(fig)
        return self.data


class PipelinePanel(Panel):
    """A micro-batch slider and a schedule drop-down over a measured
    :func:`measure_pipeline` result; redraws the step's Gantt chart, the bubble curve and
    the stage's memory. :attr:`data` holds what was drawn last."""

    def __init__(self, result: ParallelResult, *, draw: bool = True):
        self.result = result
        ms = sorted({r["m"] for r in result.per_rank[0]["runs"]})
        self.m = W.SelectionSlider(options=ms, value=ms[len(ms) // 2], description="m",
                                   continuous_update=False)
        scheds = sorted({r["schedule"] for r in result.per_rank[0]["runs"]})
        self.schedule = W.Dropdown(options=scheds, value=scheds[-1], description="schedule")
        self.output = W.Output()
        self.data: PipelineView | None = None
        for w in (self.m, self.schedule):
            w.observe(lambda change: self.refresh(), names="value")
        self.box = W.VBox([W.HBox([self.m, self.schedule]), self.output])
        if draw:
            self.refresh()

    def refresh(self) -> PipelineView:
        """Redraw the chosen schedule and micro-batches and return the new data."""
        sched, m = self.schedule.value, self.m.value
        if pipeline_run(self.result, sched, m) is None:
            sched = "gpipe"  # 1F1B needs m >= p; below that it is GPipe
        run = pipeline_run(self.result, sched, m)
        self.data = PipelineView(schedule=sched, m=m, bubble=pipeline_bubble(self.result, sched, m),
                                 formula=bubble_fraction(len(self.result.per_rank), m),
                                 in_flight=run["in_flight"], peak_bytes=run.get("peak_bytes"))
        fig = plt.figure(figsize=(10, 5))
        plot_pipeline(self.result, sched, m, fig.add_subplot(2, 1, 1))
        plot_bubble(self.result, fig.add_subplot(2, 2, 3), highlight=(sched, m))
        ax = plot_stage_memory(self.result, fig.add_subplot(2, 2, 4))
        if run.get("peak_bytes"):
            ax.plot(m, run["peak_bytes"] / MiB, "r*", ms=14)
        fig.tight_layout()
        self.show(fig)
        return self.data


class TensorParallelPanel(Panel):
    """A model drop-down, a sequence slider and the tensor-parallel degree ``t``: draws one
    layer's activations per rank from :func:`~memlab.lenses.parallel_formulas.tp_activation_bytes` (Korthikanti
    et al. 2022, sec. 4.2.1), what stays whole beside what ``t`` divides, for every degree the
    model allows. ``data`` holds the drawn degree's numbers (bytes)."""

    def __init__(self, model: str = "gpt2-medium", seq: int = 1024, batch: int = 1, *,
                 seqs: Sequence[int] = (512, 1024, 2048, 4096), draw: bool = True):
        self.batch, self.data = batch, None
        self.model = W.Dropdown(options=list(PRESETS), value=_pick(PRESETS, model), description="model")
        self.seq = W.SelectionSlider(options=list(seqs), value=_pick(seqs, seq), description="seq",
                                     continuous_update=False)
        self.t = W.SelectionSlider(options=self.degrees(), description="t", continuous_update=False)
        self.output = W.Output()
        self.model.observe(self._model_changed, names="value")
        for w in (self.seq, self.t):
            w.observe(lambda change: self.refresh(), names="value")
        self.box = W.VBox([W.HBox([self.model, self.seq, self.t]), self.output])
        if draw:
            self.refresh()

    def degrees(self) -> list[int]:
        """The powers of two up to 64 that split the chosen model's heads and MLP."""
        cfg, ok = get_config(self.model.value), []
        for t in (1, 2, 4, 8, 16, 32, 64):
            try:
                tp_activation_bytes(cfg, 1, 1, t)
                ok.append(t)
            except InputError:
                pass
        return ok

    def _model_changed(self, change) -> None:
        t, options = self.t.value, self.degrees()
        with self.t.hold_trait_notifications():
            self.t.options = options
            self.t.value = _pick(options, t)
        self.refresh()

    def refresh(self) -> TensorParallelView:
        """Redraw every degree's activations for the current controls and return the chosen one's."""
        cfg, seq, t = get_config(self.model.value), self.seq.value, self.t.value
        parts = {d: tp_activation_bytes(cfg, seq, self.batch, d) for d in self.t.options}
        f = parts[t]
        self.data = TensorParallelView(model=self.model.value, seq=seq, batch=self.batch, t=t,
                                       replicated=f["replicated"], sharded=f["total"] - f["replicated"],
                                       total=f["total"])
        labels = [str(d) for d in parts]
        rep = [parts[d]["replicated"] / 2**20 for d in parts]
        rest = [(parts[d]["total"] - parts[d]["replicated"]) / 2**20 for d in parts]
        fig, ax = plt.subplots(figsize=(6.5, 3))
        ax.bar(labels, rep, color="gray", label="stays whole (norms, block inputs)")
        bars = ax.bar(labels, rest, bottom=rep, color="tab:blue", label="divided by t")
        bars[list(parts).index(t)].set_edgecolor("red")
        bars[list(parts).index(t)].set_linewidth(2)
        ax.set(xlabel="tensor-parallel degree t", ylabel="MiB per layer per rank",
               title=f"{cfg.name}, seq {seq}, batch {self.batch}: t={t} keeps "
                     f"{f['total'] / 2**20:.0f} MiB per layer")
        ax.legend(fontsize=8)
        fig.tight_layout()
        self.show(fig)
        return self.data


class FinetunePanel(Panel):
    """"Will my fine-tune fit?": a Hugging Face config (:mod:`memlab.hf.config`) on a GPU, with
    sequence and batch sliders and knobs for precision, checkpointing, LoRA and 8-bit AdamW.
    Estimate only: the decoder's run (:class:`memlab.step.training_step.StepConfig` with its
    :class:`memlab.models.decoder_shape.DecoderShape`) through :func:`memlab.lenses.estimate.estimate_step`,
    so every change redraws at once; ``data`` holds the report drawn last."""

    LORA = {"off": None, "r=16 q,v": (16, ("q_proj", "v_proj")),
            "r=16 all linear": (16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                     "up_proj", "down_proj"))}

    def __init__(self, hf_config: str = "llama-3-8b", gpu: str = "RTX4090-24GB", *,
                 seqs: Sequence[int] = (512, 1024, 2048, 4096), batches: Sequence[int] = (1, 2, 4, 8),
                 draw: bool = True):
        self.hf_config, self.shape = hf_config, decoder_shape(hf_config)
        def slider(opts, name):
            return W.SelectionSlider(options=list(opts), value=opts[0], description=name,
                                     continuous_update=False)
        self.seq, self.batch = slider(seqs, "seq"), slider(batches, "batch")
        self.gpu = W.Dropdown(options=list(GPU_PRESETS), value=gpu, description="GPU")
        self.precision = W.Dropdown(options=["fp32", "bf16", "pure-bf16"], value="bf16",
                                    description="precision")
        self.checkpointing = W.Dropdown(options=["none", "full"], value="none", description="ckpt")
        self.lora = W.Dropdown(options=list(self.LORA), value="off", description="LoRA")
        self.eight_bit = W.Checkbox(value=False, description="8-bit AdamW")
        self.status, self.output, self.data = W.HTML(), W.Output(), None
        controls = [self.seq, self.batch, self.gpu, self.precision, self.checkpointing, self.lora,
                    self.eight_bit]
        for w in controls:
            w.observe(lambda change: self.refresh(), names="value")
        self.box = W.VBox([W.HBox(controls[:3]), W.HBox(controls[3:]), self.status, self.output])
        if draw:
            self.refresh()

    def estimate(self) -> MemoryReport:
        """The estimate for the controls as they are now."""
        return estimate_step(self.run(), budget=self.gpu.value, target="cuda")

    def run(self) -> StepConfig:
        """The run the controls describe, as they are now."""
        lora = self.LORA[self.lora.value]
        return StepConfig(self.shape, seq=self.seq.value, batch=self.batch.value, precision=self.precision.value,
                          checkpointing=self.checkpointing.value,
                          optimizer="adamw-8bit" if self.eight_bit.value else "adamw",
                          lora=None if lora is None else LoraConfig(rank=lora[0], targets=lora[1]))

    def refresh(self) -> FinetuneView:
        """Estimate the controls' fine-tune, redraw, and return the new data."""
        r = self.estimate()
        self.data = FinetuneView(peak_bytes=r.peak_bytes, fits=r.fits, by_category=dict(r.by_category), report=r)
        self.status.value = (f"{r.peak_bytes / 2**30:.1f} GiB on {self.gpu.value} "
                             f"({r.budget_bytes / 2**30:.0f} GiB): "
                             f"<b>{'fits' if r.fits else 'does NOT fit'}</b>")
        fig, ax = plt.subplots(figsize=(6, 3.2))
        plot_lenses({"estimate": r}, ax, title=f"{self.hf_config}: seq {self.seq.value} x batch "
                                               f"{self.batch.value}, LoRA {self.lora.value}")
        fig.tight_layout()
        self.show(fig)
        return self.data


def max_activations(report: MemoryReport) -> int:
    """Most activation bytes alive at any point of the step (end of forward, usually): the
    peak by category can sit in the optimizer step, where activations are already gone."""
    return category_max(report, "activations")


def _pick(options: Sequence, value):
    """``value`` if it is offered, else the first option."""
    options = list(options)
    return value if value in options else options[0]


__all__ = ["StepView", "AdvisorView", "CalculatorSettings", "CalculatorView", "LossSpikeView",
           "CompressionView", "TableView", "PipelineView", "TensorParallelView", "FinetuneView", "Panel",
           "StepPanel", "CalculatorPanel", "UNetPanel", "AdvisorPanel", "CompressionPanel", "PipelinePanel",
           "TablePanel", "TensorParallelPanel", "FinetunePanel", "max_activations"]
