"""The curriculum's comparison table, measured: memory saved and compute cost of each technique.

The curriculum (course/curriculum.md, section 4) gives folklore figures: checkpointing saves 50-70% for
30-50% more compute, mixed precision ~50%, ZeRO-1/2/3 ~50/75/90%, activation compression
30-60%, and so on. :func:`measure_table` measures each row on this machine for one training
step of the tiny GPT, as ratios to a baseline (fp32, no technique), and marks each claim
*holds*, *holds only when (condition)* or *does not hold*, with the number. GPU figures
recorded by ``make gpu-check`` (``data/reference/<gpu>/``: the shipped ``NVIDIA-H200`` folder
and any other) are added where they exist.

Single-device rows compare against the one-process step; the multi-rank rows (ZeRO, offload,
tensor and pipeline parallelism) run 2 ranks on gloo and compare against stage 0 on the same
ranks. Time ratios on a shared 2-core CPU are noisy: every single-device variant is timed
round-robin so that background load slows all of them alike.

:meth:`Table.on_card` adds the time lens's prediction on a card (:func:`predicted_times`,
:func:`memlab.time.step_time.step_time`) beside each measured time ratio, against the same baseline.
Over 500 lines because that prediction must pair each row with the baseline its measurement
uses (ZeRO against stage 0, offload against ZeRO-2, the pipeline against its bubble-free
stages), which :func:`measure_table` and :func:`multi_rank` define here.
"""
from __future__ import annotations

import functools
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from memlab.core.errors import InputError
from memlab.core.hardware import Placement, place_ranks
from memlab.core.units import GiB, MiB
from memlab.distributed.deepspeed_zero import measure_zero
from memlab.distributed.pipeline_parallel import measure_pipeline
from memlab.distributed.tensor_parallel import measure_tensor_parallel
from memlab.lenses.estimate import estimate_step
from memlab.lenses.measure import measure_trainer, time_steps
from memlab.lenses.parallel_formulas import bubble_fraction
from memlab.lenses.reference import REFERENCE_DIR, load_references
from memlab.policy.caching_allocator import replay_fragmentation
from memlab.step.parallel_dims import ParallelDims
from memlab.step.training_step import StepConfig
from memlab.step.zero import zero_saving  # one source for the ZeRO formula (re-exported)
from memlab.techniques.compression import compressed_trainer
from memlab.techniques.sweeps import category_max
from memlab.time.step_time import Calibration, step_time

# technique -> (the curriculum's memory claim, its compute claim, claimed saving range or None)
CLAIMS = {
    "gradient checkpointing": ("~50-70%", "+30-50%", (0.50, 0.70)),
    "mixed precision": ("~50%", "lower or equal", (0.45, 0.55)),
    "ZeRO-1": ("~50%", "slight communication", (0.45, 0.55)),
    "ZeRO-2": ("~75%", "more synchronisation", (0.70, 0.80)),
    "ZeRO-3": ("~90%", "significant communication latency", (0.85, 0.95)),
    "tensor parallelism": ("by split degree", "high communication", None),
    "pipeline parallelism": ("lower per-device load", "bubble waits", None),
    "offloading": ("very large", "IO bottleneck", None),
    "activation compression": ("30-60%", "decompression", (0.30, 0.60)),
    "recomputation (selective)": ("customisable", "repeated compute", None),
}
#: techniques beyond the curriculum (issue 39), measured on the same step: technique -> (what its
#: source claims for memory, for compute, its source). The curriculum columns carry these claims.
TODAY = {
    "optimizer step in backward": ("the gradients never all exist", "none (same update)",
                                   "PyTorch tutorial 'How to save memory by fusing the optimizer step "
                                   "into the backward pass'; torchtune optimizer_in_bwd"),
    "op-level checkpointing": ("between selective and full", "recompute of the unsaved ops",
                               "torchtitan _apply_op_sac (matmul outputs saved by a policy)"),
    "activation offload": ("saved activations leave the GPU", "PCIe copies, overlapped on a stream",
                           "torchtune OffloadActivations; torch.autograd.graph.save_on_cpu"),
}
#: micro-batches of the pipeline row's 1F1B run (:func:`multi_rank`) and of its prediction
PIPELINE_MICRO_BATCHES = 4


@dataclass
class Row:
    """One technique: the curriculum's claim, what we measured, and the verdict."""

    technique: str
    curriculum_memory: str
    curriculum_compute: str
    memory_ratio: float | None  # peak with the technique / peak without (lower is better)
    time_ratio: float | None    # step time with / without
    verdict: str                # holds | holds only when ... | does not hold
    evidence: str               # the numbers behind the verdict
    reference: str = ""         # GPU figures from data/reference, when recorded
    predicted_ratio: float | None = None    # the time lens's ratio on ``Table.card`` (:func:`predicted_times`)
    predicted_seconds: float | None = None  # ... and its seconds of the step with the technique

    @property
    def saving(self) -> float | None:
        return None if self.memory_ratio is None else 1 - self.memory_ratio


@dataclass
class Table:
    """The measured table; :meth:`to_markdown` and :meth:`save` write it out."""

    rows: list[Row]
    step: StepConfig
    world_size: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    card: str | None = None  # the card of the rows' predicted times (:meth:`on_card`)

    def row(self, technique: str) -> Row:
        return next(r for r in self.rows if r.technique == technique)

    def on_card(self, card: str, calibration: Calibration | None = None) -> "Table":
        """This table with each row's predicted time on ``card`` beside the measured one.

        Args:
            card: a card memlab has datasheet speeds for (:data:`memlab.core.cards.SPEEDS`).
            calibration: ``memlab doctor --calibrate``'s figures (default: the stored ones).

        Returns:
            A copy of the table whose rows carry ``predicted_ratio`` and ``predicted_seconds``
            (``None`` where the time lens has no model of the technique) and whose ``card`` is set.
        """
        pred = predicted_times(self.step, card, max(self.world_size, 2), calibration=calibration)
        rows = [replace(r, predicted_ratio=pred[r.technique].ratio if r.technique in pred else None,
                        predicted_seconds=pred[r.technique].seconds if r.technique in pred else None)
                for r in self.rows]
        return replace(self, rows=rows, notes=list(self.notes), card=card)

    def to_dict(self) -> dict:
        return {"step": self.step.describe(), "world_size": self.world_size,
                "seconds": self.seconds, "notes": list(self.notes),
                "rows": [{**asdict(r), "saving": r.saving} for r in self.rows]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_markdown(self) -> str:
        s = self.step
        multi = (f"multi-rank rows on {self.world_size} ranks (gloo)" if self.world_size > 1
                 else "single-device rows only")
        head = (f"Measured on this machine: {s.model_config.name}, seq {s.seq}, batch {s.batch}, "
                f"AdamW, fp32 baseline; {multi}.\n\n")
        predicted = f" predicted on {self.card} |" if self.card else ""
        lines = ["| technique | curriculum: memory | measured memory saved | curriculum: compute | "
                 f"measured time ratio |{predicted} verdict | evidence | GPU reference |",
                 "|---|---|---|---|---|" + ("---|" if self.card else "") + "---|---|---|"]
        for r in self.rows:
            saved = "n/a" if r.saving is None else f"{r.saving:.0%}"
            tr = "n/a" if r.time_ratio is None else f"{r.time_ratio:.2f}x"
            pr = ""
            if self.card:
                pr = (" n/a |" if r.predicted_ratio is None
                      else f" {r.predicted_ratio:.2f}x ({r.predicted_seconds * 1e3:.3g} ms) |")
            lines.append(f"| {r.technique} | {r.curriculum_memory} | {saved} | {r.curriculum_compute} | {tr} "
                         f"|{pr} {r.verdict} | {r.evidence} | {r.reference or '-'} |")
        notes = "".join(f"\n- {n}" for n in self.notes)
        return head + "\n".join(lines) + ("\n" + notes if notes else "") + "\n"

    def table(self) -> str:
        return self.to_markdown()

    def __str__(self) -> str:
        return self.to_markdown()

    def plot(self, ax=None):
        """Memory ratio against time ratio per technique (1, 1 is the baseline)."""
        from memlab.classroom.plots import plot_tradeoff  # matplotlib: loaded only when a figure is drawn
        pts = {r.technique: (r.memory_ratio, r.time_ratio) for r in self.rows
               if r.memory_ratio is not None and r.time_ratio is not None}
        return plot_tradeoff(pts, ax, title="the curriculum's table, measured: peak memory against step time")

    def save(self, out: str | Path) -> dict[str, Path]:
        """Write ``table.md``, ``table.json`` and ``table.png`` into ``out``."""
        import matplotlib  # the UI edge: loaded when a figure is written, not on import
        import matplotlib.pyplot as plt
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"markdown": out / "table.md", "json": out / "table.json", "png": out / "table.png"}
        paths["markdown"].write_text("# The curriculum's comparison table, measured\n\n" + self.to_markdown())
        paths["json"].write_text(self.to_json())
        with matplotlib.rc_context({"backend": "Agg"}):
            fig, ax = plt.subplots(figsize=(7, 4.5))
            self.plot(ax)
            fig.tight_layout()
            fig.savefig(paths["png"], dpi=120)
            plt.close(fig)
        return paths


# --------------------------------------------------------------------------------------
# Verdicts
# --------------------------------------------------------------------------------------
def verdict(saving: float, claim: tuple[float, float] | None, condition: str) -> str:
    """``holds`` when the saving reaches the claimed range's low end (within 5 points; a claim
    without a range: any saving over 2%), else ``holds only when <condition>`` (a condition
    the formulas give), else ``does not hold``."""
    if claim is None:
        claim = (0.07, 1.0)
    if saving >= claim[0] - 0.05:
        return "holds"
    return f"holds only when {condition}" if condition else "does not hold"


def _selective_estimate(step: StepConfig) -> float:
    """Saving of selective recomputation with materialised (naive) attention, by formula."""
    naive = replace(step, attention="naive")
    return 1 - (estimate_step(replace(naive, checkpointing="selective")).peak_bytes
                / estimate_step(naive).peak_bytes)


def ranks_for(stage: int, target: float, limit: int = 4096) -> int | None:
    """Fewest ranks at which the formula's model-state saving reaches ``target``."""
    return next((n for n in range(1, limit + 1) if zero_saving(stage, n) >= target), None)


# --------------------------------------------------------------------------------------
# Measured results
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VariantRun:
    """One single-device variant of the table's step, measured (:func:`single_device`)."""

    peak_bytes: int
    """Peak of one tracked step."""
    activation_bytes: int
    """The step's largest activations held at once (:func:`memlab.techniques.sweeps.category_max`)."""
    seconds: float | None = None
    """Median untracked step time (``None`` when not timed)."""


@dataclass(frozen=True)
class ZeroRun:
    """One DeepSpeed engine's step of the table's multi-rank rows (:func:`multi_rank`)."""

    peak_bytes: int
    """The rank's whole-step peak."""
    seconds: float
    """The rank's step time."""
    allocator: dict[str, int]
    """DeepSpeed's exact accounting (:attr:`memlab.distributed.deepspeed_zero.RankResult.allocator`)."""


@dataclass(frozen=True)
class TensorParallelRun:
    """The tensor-parallel row's run: the largest rank's figures (:func:`multi_rank`)."""

    peak_bytes: int
    """The largest rank peak."""
    param_bytes: int
    """The largest rank's parameter bytes (its shards and the layers kept whole)."""
    full_param_bytes: int
    """The parameter bytes of the whole model on one device."""


@dataclass(frozen=True)
class PipelineRun:
    """The pipeline row's 1F1B run (:data:`PIPELINE_MICRO_BATCHES` micro-batches)."""

    peak_bytes: int
    """The largest stage peak."""
    bubble: float
    """The stages' mean idle share of the step."""


@dataclass(frozen=True)
class MultiRank:
    """The multi-rank rows' runs, each on the same ranks (:func:`multi_rank`)."""

    zero: dict[int, ZeroRun]
    """ZeRO stage (0-3) -> its engine's step."""
    offload: ZeroRun
    """ZeRO-2 with the optimizer offloaded to the host."""
    tp: TensorParallelRun
    """The tensor-parallel run."""
    pp: PipelineRun
    """The pipeline run."""


@dataclass(frozen=True)
class StepBytes:
    """One step's measured bytes (:func:`measure_saving`)."""

    peak_bytes: int
    """Peak of the step."""
    by_category: dict[str, int]
    """Peak bytes by tracker category."""
    activation_bytes: int
    """The step's largest activations held at once."""


@dataclass(frozen=True)
class Saving:
    """A single-device technique's saving on the step's peak (:func:`measure_saving`)."""

    technique: str
    """The row of the table (a key of :data:`SINGLE`)."""
    baseline: StepBytes
    """The step without the technique."""
    with_technique: StepBytes
    """The step with it."""
    saving: float
    """``1 - peak with / peak without``."""
    verdict: str
    """The curriculum claim's verdict (:func:`verdict`)."""


# --------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------
def single_device(step: StepConfig, repeats: int = 2) -> dict[str, VariantRun]:
    """Peak (one tracked step) and median untracked step time of the baseline and of each
    single-device technique; one trainer per variant serves both."""
    variants = {"baseline": (step, "none"),
                "checkpointing": (replace(step, checkpointing="full"), "none"),
                "bf16": (replace(step, precision="bf16"), "none"),
                "selective": (replace(step, checkpointing="selective"), "none"),
                "int8": (step, "int8 per-row"),
                "in_backward": (replace(step, optimizer_in_backward=True), "none"),
                "op": (replace(step, checkpointing="op"), "none"),
                "offload": (replace(step, activation_offload=True), "none")}
    trainers = {name: compressed_trainer(s, v) for name, (s, v) in variants.items()}
    out = {}
    for name, (trainer, _, batch) in trainers.items():
        rep = measure_trainer(trainer, batch)
        out[name] = VariantRun(rep.peak_bytes, category_max(rep, "activations"))
    if repeats:
        runs = {name: (trainer, batch) for name, (trainer, _, batch) in trainers.items()}
        for name, secs in time_steps(runs, repeats).items():
            out[name] = replace(out[name], seconds=secs)
    for _, comp, _ in trainers.values():
        if comp is not None:
            comp.remove()
    return out


def table_placement(world_size: int) -> Placement:
    """Where the table's multi-rank rows run: CPU ranks on any machine, so that they are
    measured like the single-device rows (the exact CPU tracker on the tiny model)."""
    return place_ranks(world_size, gpus=0)


def multi_rank(step: StepConfig, world_size: int = 2, placement: Placement | None = None) -> MultiRank:
    """ZeRO 0-3 and ZeRO-2 + optimizer offload in one DeepSpeed launch; one tensor-parallel
    and one pipeline (1F1B, 4 micro-batches) run. Each on ``world_size`` ranks, placed by
    ``placement`` (default :func:`table_placement`)."""
    placement = placement or table_placement(world_size)
    s = replace(step, world_size=world_size, precision="fp32")
    zs = [replace(s, zero=z) for z in (0, 0, 1, 2, 3)] + [replace(s, zero=2, offload="optimizer")]
    # the launch's first engine is slow to start: time the second
    reps = measure_zero(zs, placement=placement)[1:]
    zero = {z: ZeroRun(r.peak_bytes, r.step_seconds, dict(r.allocator))
            for z, r in zip((0, 1, 2, 3), reps[:4], strict=True)}
    off = reps[-1]
    tp = measure_tensor_parallel(replace(step, world_size=1), world_size, check=False,
                                 placement=placement)
    tp_run = TensorParallelRun(peak_bytes=max(r["peak_bytes"] for r in tp.per_rank),
                               param_bytes=max(r["param_bytes"] for r in tp.per_rank),
                               full_param_bytes=tp.per_rank[0]["full_param_bytes"])
    pp = measure_pipeline(replace(step, world_size=1), world_size,
                          micro_batches=(PIPELINE_MICRO_BATCHES,),
                          schedules=("1f1b",), repeats=1, placement=placement)
    runs = [r["runs"][0] for r in pp.per_rank]
    return MultiRank(zero=zero, offload=ZeroRun(off.peak_bytes, off.step_seconds, dict(off.allocator)),
                     tp=tp_run, pp=PipelineRun(peak_bytes=max(r["peak_bytes"] for r in runs),
                                               bubble=sum(r["bubble"] for r in runs) / len(runs)))


@dataclass(frozen=True)
class PredictedTime:
    """One row's step time on a card by the time lens (:func:`memlab.time.step_time.step_time`):
    ``seconds`` of the step with the technique, ``baseline_seconds`` of the step its measured
    ratio is against, ``ratio`` = the one over the other, ``bound`` what limits the step."""

    technique: str
    seconds: float
    baseline_seconds: float
    ratio: float
    against: str
    bound: str = "gpu"


def predicted_times(step: StepConfig, card: str, world_size: int = 2, *,
                    calibration: Calibration | None = None) -> dict[str, PredictedTime]:
    """The time lens's step time on ``card`` for the table's rows, each against the baseline
    its measured time ratio has (:func:`measure_table`).

    Single-device rows against ``step``; ZeRO 1-3 against DeepSpeed's stage 0 on the same
    ``world_size`` ranks (fp32, as :func:`multi_rank` runs them); offloading (ZeRO-2 +
    optimizer offload) against ZeRO-2; tensor parallelism (``world_size`` ways) against one
    device; pipeline parallelism (``world_size`` stages, :data:`PIPELINE_MICRO_BATCHES`
    micro-batches) against the same step without its bubble, as the measured row's
    ``1 / (1 - bubble)``. Activation compression has no row: its pack/unpack is elementwise
    work, which the time lens leaves out.

    Args:
        step: the table's base step (fp32, no checkpointing).
        card: a card with datasheet speeds (:data:`memlab.core.cards.SPEEDS`).
        world_size: ranks of the multi-rank rows.
        calibration: ``memlab doctor --calibrate``'s figures (default: the stored ones).

    Returns:
        ``technique -> PredictedTime`` for every row the time lens models.

    Raises:
        InputError: a card memlab has no speeds for, or fewer than 2 ranks.
    """
    if world_size < 2:
        raise InputError(f"world_size={world_size}; the multi-rank rows need 2 or more ranks")

    def secs(s: StepConfig, **kw):
        return step_time(s, card, calibration=calibration, **kw)

    base = secs(step)
    out: dict[str, PredictedTime] = {}

    def add(tech: str, t, against_seconds: float, against: str) -> None:
        out[tech] = PredictedTime(tech, t.seconds, against_seconds, t.seconds / against_seconds, against, t.bound)

    for tech, over in (("gradient checkpointing", {"checkpointing": "full"}),
                       ("mixed precision", {"precision": "bf16"}),
                       ("recomputation (selective)", {"checkpointing": "selective"})):
        add(tech, secs(replace(step, **over)), base.seconds, "baseline")
    ranks = replace(step, world_size=world_size, precision="fp32")
    z0 = secs(replace(ranks, zero=0), engine="deepspeed")
    for z in (1, 2, 3):
        add(f"ZeRO-{z}", secs(replace(ranks, zero=z)), z0.seconds, "DeepSpeed stage 0")
    z2 = secs(replace(ranks, zero=2))
    add("offloading", secs(replace(ranks, zero=2, offload="optimizer")), z2.seconds, "ZeRO-2")
    add("tensor parallelism", secs(replace(step, world_size=world_size, parallel=ParallelDims(tensor=world_size))),
        base.seconds, "one device")
    pp = secs(replace(step, world_size=world_size, micro_batches=PIPELINE_MICRO_BATCHES,
                      parallel=ParallelDims(pipeline=world_size)))
    add("pipeline parallelism", pp, pp.seconds - pp.by_part.bubble, "the same stages without the bubble")
    return out


def _model_states(acc: dict) -> int:
    """Device bytes of parameters, gradients, fp32 master and optimizer state on one rank."""
    return acc["device_bytes"] - acc.get("comm_buffers", 0)


def reference_ratios(refs: list[dict]) -> dict[str, str]:
    """``technique -> "GPU: memory -x%, time y.yyx"`` from the gpu-check rows: the baseline
    row of a case against its bf16 and its checkpointing row."""
    out: dict[str, list[str]] = {}
    for ref in refs:
        gpu = ref.get("gpu", "GPU")
        rows = ref["rows"]
        base = {(r["model"], r["seq"], r["batch"]): r for r in rows
                if not r.get("precision") and not r.get("checkpointing")}
        for r in rows:
            key = (r.get("model"), r.get("seq"), r.get("batch"))
            b = base.get(key)
            if b is None or r is b:
                continue
            tech = ("mixed precision" if r.get("precision") == "bf16" and not r.get("checkpointing")
                    else "gradient checkpointing" if r.get("checkpointing") == "full"
                    and not r.get("precision") else None)
            if tech is None or not b.get("measure_peak_bytes") or not b.get("step_seconds"):
                continue
            mem = 1 - r["measure_peak_bytes"] / b["measure_peak_bytes"]
            tr = r["step_seconds"] / b["step_seconds"]
            out.setdefault(tech, []).append(f"{gpu} {key[0]} s{key[1]}: {mem:.0%} saved, {tr:.2f}x time")
        for tech, text in _deepspeed_ratios(gpu, ref.get("zero_offload") or []).items():
            out.setdefault(tech, []).append(text)
    return {k: "; ".join(v) for k, v in out.items()}


def _deepspeed_ratios(gpu: str, rows: list[dict]) -> dict[str, str]:
    """ZeRO and offload on one GPU (``zero_offload_one_gpu.json``): the allocator's device
    peak and the step time of each stage against stage 0, offload against ZeRO-2."""
    by = {(r.get("zero"), r.get("offload")): r for r in rows
          if r.get("device_peak") and r.get("step_seconds")}
    base, z2 = by.get((0, "none")), by.get((2, "none"))
    out = {}
    for z in (1, 2, 3):
        r = by.get((z, "none"))
        if base and r:
            out[f"ZeRO-{z}"] = (f"{gpu} {r['model']}, 1 GPU: device peak "
                                f"{base['device_peak'] / GiB:.2f} -> {r['device_peak'] / GiB:.2f} GiB, "
                                f"{r['step_seconds'] / base['step_seconds']:.2f}x time "
                                f"(one rank shards nothing)")
    off = by.get((2, "optimizer"))
    if z2 and off:
        host = off["rss_before"] - z2["rss_before"]
        out["offloading"] = (f"{gpu} {off['model']}, ZeRO-2 + optimizer offload: device peak "
                             f"{z2['device_peak'] / GiB:.2f} -> {off['device_peak'] / GiB:.2f} GiB "
                             f"({1 - off['device_peak'] / z2['device_peak']:.0%} saved), host RSS "
                             f"+{host / GiB:.2f} GiB, {off['step_seconds'] / z2['step_seconds']:.2f}x time")
    return out


def measure_table(step: StepConfig | None = None, *, world_size: int = 2, distributed: bool = True,
                  repeats: int = 2, reference_dir: str | Path = REFERENCE_DIR) -> Table:
    """Measure every row of the curriculum's table for ``step`` (default tiny, seq 256, batch 8).

    ``distributed=False`` skips the multi-rank rows (they spawn ranks: the slow part).

    Args:
        step: the base step (``None``: tiny, seq 256, batch 8).
        world_size, distributed, repeats: the multi-rank rows' ranks, whether to run them, timed runs.
        reference_dir: the folders of GPU reference measurements shown beside the CPU's.

    Returns:
        A :class:`~memlab.classroom.technique_table.Table` of the rows, measured.

    Over 80 lines because each row's evidence sentence is written beside the measurement it cites
    (the measuring itself is :func:`single_device` and :func:`multi_rank`).
    """
    start = time.perf_counter()
    step = step or StepConfig()
    if step.precision != "fp32" or step.model_config.checkpointing != "none":
        raise InputError(f"the baseline must be fp32 without checkpointing, got precision="
                         f"{step.precision!r}, checkpointing={step.model_config.checkpointing!r}")
    one = single_device(step, repeats)
    base = one["baseline"]
    act_share = base.activation_bytes / base.peak_bytes
    rows = []

    def ratio(name, key="peak_bytes"):
        return getattr(one[name], key) / getattr(base, key)

    def tratio(name):
        return one[name].seconds / base.seconds if repeats else None

    def add(tech, name, cond, evidence):
        """The row of ``tech``, measured as the single-device case ``name``."""
        cur_mem, cur_comp, claim = CLAIMS[tech]
        mem = ratio(name)
        rows.append(Row(tech, cur_mem, cur_comp, mem, tratio(name), verdict(1 - mem, claim, cond), evidence))

    add("gradient checkpointing", "checkpointing",
        f"activations are most of the peak (here {act_share:.0%}; activations alone fell "
        f"{1 - ratio('checkpointing', 'activation_bytes'):.0%})",
        f"peak {base.peak_bytes / MiB:.1f} -> {one['checkpointing'].peak_bytes / MiB:.1f} MiB")
    add("mixed precision", "bf16",
        f"activations dominate and weights are stored in 16 bits (autocast keeps fp32 weights; "
        f"activations fell {1 - ratio('bf16', 'activation_bytes'):.0%})",
        f"peak {one['bf16'].peak_bytes / MiB:.1f} MiB; CPU bf16 matmuls are not faster")
    add("activation compression", "int8",
        f"activations are most of the peak (int8 cut activations "
        f"{1 - ratio('int8', 'activation_bytes'):.0%})",
        f"int8 per-row saved-tensor hooks: peak {one['int8'].peak_bytes / MiB:.1f} MiB")
    naive = _selective_estimate(step)
    add("recomputation (selective)", "selective",
        f"attention scores are stored (naive attention, estimate: {naive:.0%} saved)",
        f"attention core recomputed: peak {one['selective'].peak_bytes / MiB:.1f} MiB "
        f"({step.model_config.attention} attention; with sdpa only the log-sum-exp is saved)")
    for tech, name, cond in (
            ("optimizer step in backward", "in_backward", "the gradients are a large share of the peak"),
            ("op-level checkpointing", "op", "activations are most of the peak"),
            ("activation offload", "offload", "the device is a GPU: on a CPU save_on_cpu keeps the "
                                              "tensor itself, nothing moves")):
        mem_claim, comp_claim, source = TODAY[tech]
        mem = ratio(name)
        rows.append(Row(tech, mem_claim, comp_claim, mem, tratio(name), verdict(1 - mem, None, cond),
                        f"peak {one[name].peak_bytes / MiB:.1f} MiB (source: {source})"))
    notes = [f"baseline peak {base.peak_bytes / MiB:.1f} MiB, activations "
             f"{base.activation_bytes / MiB:.1f} MiB ({act_share:.0%} of the peak)"]
    frag = {e: replay_fragmentation(e) for e in (False, True)}
    notes.append(f"expandable_segments:True (counted by the allocator's rules, not measured here): the "
                 f"fragmentation case {'fits' if frag[False].fits else 'OOMs'} by default with "
                 f"{(frag[False].reserved_before - frag[False].allocated_before) / MiB:.0f} MiB reserved but "
                 f"unallocated, and {'fits' if frag[True].fits else 'OOMs'} with expandable segments "
                 f"(reserved {frag[True].reserved_before / MiB:.0f} -> {frag[True].reserved_after / MiB:.0f} MiB); "
                 f"no time cost in the step (page mapping on growth)")
    notes.append("torch.compile is not a row: inductor takes minutes per compile on a CPU; "
                 "measure_step(compile=True) measures it and memlab.step.compiled counts its saved set")
    if distributed:
        placement = table_placement(world_size)
        multi = multi_rank(step, world_size, placement)
        z0 = multi.zero[0]
        s0 = _model_states(z0.allocator)
        for z, tech in ((1, "ZeRO-1"), (2, "ZeRO-2"), (3, "ZeRO-3")):
            zr = multi.zero[z]
            states = 1 - _model_states(zr.allocator) / s0
            n_needed = ranks_for(z, CLAIMS[tech][2][0] - 0.05)
            cur_mem, cur_comp, claim = CLAIMS[tech]
            v = verdict(states, claim, f"N >= {n_needed} ranks (formula, mixed-precision Adam: "
                                       f"{zero_saving(z, world_size):.0%} at N={world_size}, "
                                       f"{zero_saving(z, 64):.0%} at N=64)")
            rows.append(Row(tech, cur_mem, cur_comp, 1 - states, zr.seconds / z0.seconds, v,
                            f"model states per rank -{states:.0%} (fp32 training, DeepSpeed adds an "
                            f"fp32 master partition); whole step peak "
                            f"{z0.peak_bytes / MiB:.1f} -> {zr.peak_bytes / MiB:.1f} MiB "
                            f"(activations and buckets unchanged); time vs DeepSpeed stage 0"))
        tp = multi.tp
        m = tp.peak_bytes / base.peak_bytes
        rows.append(Row("tensor parallelism", *CLAIMS["tensor parallelism"][:2], m, None,
                        "holds only when the split layers dominate (parameters "
                        f"{tp.param_bytes / tp.full_param_bytes:.0%} per rank at "
                        f"t={world_size}; embeddings, norms and the loss stay whole)"
                        if m > 1 - 0.8 / world_size else "holds",
                        f"rank peak {tp.peak_bytes / MiB:.1f} MiB vs one device "
                        f"{base.peak_bytes / MiB:.1f} MiB; not timed"))
        pp = multi.pp
        m = pp.peak_bytes / base.peak_bytes
        rows.append(Row("pipeline parallelism", *CLAIMS["pipeline parallelism"][:2], m,
                        1 / (1 - pp.bubble), "holds" if m < 1 else "does not hold",
                        f"1F1B, {PIPELINE_MICRO_BATCHES} micro-batches, {world_size} stages: stage peak "
                        f"{pp.peak_bytes / MiB:.1f} MiB, bubble {pp.bubble:.0%} "
                        f"(formula {bubble_fraction(world_size, PIPELINE_MICRO_BATCHES):.0%})"))
        off, z2 = multi.offload, multi.zero[2]
        dev = off.allocator["device_peak_bytes"]
        m = dev / z2.peak_bytes
        rows.append(Row("offloading", *CLAIMS["offloading"][:2], m, off.seconds / z2.seconds,
                        "holds" if m < 0.75 else "holds only when optimizer state dominates "
                        "(large models, small activations)",
                        f"ZeRO-2 + optimizer offload: device peak {dev / MiB:.1f} MiB, host "
                        f"{off.allocator['host_bytes'] / MiB:.1f} MiB; memory and time vs ZeRO-2"))
        notes.append(f"multi-rank rows: {placement.reason}; ZeRO rows give the model "
                     f"states per rank (what ZeRO shards) against stage 0")
    refs = reference_ratios(load_references(reference_dir))
    for r in rows:
        r.reference = refs.get(r.technique, "")
    if not refs:
        notes.append("no GPU reference figures in data/reference/<gpu>/ yet (make gpu-check)")
    order = list(CLAIMS) + [t for t in TODAY if t not in CLAIMS]
    rows.sort(key=lambda r: order.index(r.technique))
    return Table(rows, step, world_size if distributed else 1, time.perf_counter() - start, notes)


SINGLE = {"gradient checkpointing": ({"checkpointing": "full"}, "none"),
          "mixed precision": ({"precision": "bf16"}, "none"),
          "activation compression": ({}, "int8 per-row"),
          "recomputation (selective)": ({"checkpointing": "selective"}, "none")}


@functools.lru_cache(maxsize=256)
def _measured_bytes(step: StepConfig, variant: str) -> tuple[int, tuple, int]:
    """Peak, bytes by category and activations of one step with one compression variant,
    measured once per process: the exact CPU tracker counts the same bytes every time for
    the same step (the table's panel, its exercise and the table ask for the same baselines
    again and again). Keyed by the whole (frozen) StepConfig and the variant."""
    trainer, comp, batch = compressed_trainer(step, variant)
    try:
        rep = measure_trainer(trainer, batch)
    finally:
        if comp is not None:
            comp.remove()
    return rep.peak_bytes, tuple(rep.by_category.items()), category_max(rep, "activations")


def measure_saving(step: StepConfig, technique: str) -> Saving:
    """Peak and activations of ``step`` without and with one single-device technique (each
    step measured once per process: :func:`_measured_bytes`)."""
    if technique not in SINGLE:
        raise InputError(f"technique={technique!r}; allowed: {', '.join(SINGLE)}")
    over, variant = SINGLE[technique]
    base, tech = (StepBytes(peak, dict(by_category), acts)
                  for peak, by_category, acts in (_measured_bytes(step, "none"),
                                                  _measured_bytes(replace(step, **over), variant)))
    saving = 1 - tech.peak_bytes / base.peak_bytes
    return Saving(technique, base, tech, saving,
                  verdict(saving, CLAIMS[technique][2], "activations dominate the peak"))


def write_report(out: str | Path, step: StepConfig | None = None, **kwargs) -> tuple[Table, dict[str, Path]]:
    """Measure the table and write it to ``out`` as Markdown, JSON and PNG."""
    table = measure_table(step, **kwargs)
    return table, table.save(out)


__all__ = ["PIPELINE_MICRO_BATCHES", "PredictedTime", "VariantRun", "ZeroRun", "TensorParallelRun",
           "PipelineRun", "MultiRank", "StepBytes", "Saving", "predicted_times", "Row", "Table", "CLAIMS", "SINGLE",
           "measure_saving", "measure_table", "write_report",
           "reference_ratios", "verdict", "zero_saving", "ranks_for", "single_device",
           "multi_rank", "table_placement"]
