"""The real-scale calculator: one training step of any size, by category, against a card.

The lessons measure a tiny model on a CPU; this is where a learner sees *their* sizes. It is
the estimate lens (:func:`memlab.lenses.estimate.estimate_step`, closed form, instant at any size)
with the settings a run is planned with: a model, sequence, batch per rank, precision,
checkpointing, a ZeRO stage over a number of ranks, tensor- and pipeline-parallel degrees,
and the card. With ``pipeline=1`` its categories *are* ``estimate_step``'s for the same step
(``tests/test_calculator.py`` checks equality); a pipeline degree ``p`` is the first stage
under 1F1B: ``1/p`` of the layers' model states, and the activations of ``p`` micro-batches
of ``L/p`` layers, i.e. those of one micro-batch of the whole model (Korthikanti et al. 2022,
sec. 4.2.3; Narayanan et al. 2021, sec. 2.2), the loss counted as on one stage.

>>> c = calculator("llama-3-8b", seq=4096, batch=1, precision="bf16", checkpointing="full",
...                zero=3, ranks=8, gpu="H100-80GB")
>>> c.fits, round(c.peak_bytes / 2**30, 1)   # doctest: +SKIP

A rotary-position model may be planned past its trained context (its ``block_size`` is
raised to ``seq``); a model with learned positions may not. Models come from
:data:`MODELS` (memlab's presets); :func:`register_model` adds one (for
instance a config read from a Hugging Face ``config.json``) and every panel offers it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from memlab.core.errors import InputError
from memlab.core.hardware import GPU_PRESETS
from memlab.lenses.estimate import estimate_step
from memlab.models.gpt_unet import PRESETS, GPTConfig
from memlab.step.parallel_dims import ParallelDims
from memlab.step.training_step import MemoryReport, StepConfig
from memlab.tracking.tracker import CATEGORIES

#: The models the calculator offers, by name (memlab's GPT presets; extend with
#: :func:`register_model`).
MODELS: dict[str, GPTConfig] = {name: cfg for name, cfg in PRESETS.items()}
STATES = ("parameters", "gradients", "optimizer")
CHECKPOINTING = ("none", "selective", "full")


def register_model(name: str, cfg: GPTConfig) -> None:
    """Offer ``cfg`` under ``name`` in :func:`calculator` and the panels built after this."""
    if not isinstance(cfg, GPTConfig):
        raise InputError(f"register_model({name!r}, ...) needs a GPTConfig, got {type(cfg).__name__}")
    MODELS[name] = cfg


@dataclass
class Calculation:
    """What :func:`calculator` found for one setting: the device bytes per rank by category
    at the step's peak, the card's memory, and the estimate it came from."""

    settings: dict
    by_category: dict[str, int]
    peak_bytes: int
    card_bytes: int
    host_bytes: int
    report: MemoryReport = field(repr=False)

    @property
    def fits(self) -> bool:
        """Whether the peak is within the card's memory (no headroom: see lesson 14)."""
        return self.peak_bytes <= self.card_bytes

    @property
    def moment(self) -> str:
        """Where in the step the peak is (the estimate's note)."""
        return self.report.notes[0].removeprefix("peak moment: ")


def calculator(model: str | GPTConfig = "gpt2-xl", *, seq: int = 1024, batch: int = 1,
               precision: str = "bf16", checkpointing: str = "none", zero: int = 0,
               ranks: int = 1, tensor_parallel: int = 1, pipeline: int = 1,
               gpu: str = "A100-80GB", target: str = "cuda") -> Calculation:
    """Peak device bytes per rank of one training step, by category, and the card's memory.

    ``batch`` is per rank (a micro-batch under pipelining). ``ranks`` GPUs are split into
    ``tensor_parallel x pipeline`` model-parallel groups and ``ranks / (t p)`` data-parallel
    replicas, across which ZeRO shards. ``target`` is the device whose kernels the formulas
    follow (``"cuda"`` for a card; ``"cpu"`` for what the lessons measure).
    """
    cfg = MODELS.get(model) if isinstance(model, str) else model
    if cfg is None:
        raise InputError(f"unknown model {model!r}; allowed: {', '.join(MODELS)}")
    if gpu not in GPU_PRESETS:
        raise InputError(f"unknown GPU {gpu!r}; allowed: {', '.join(GPU_PRESETS)}")
    if checkpointing not in CHECKPOINTING:
        raise InputError(f"checkpointing={checkpointing!r}; allowed: {', '.join(CHECKPOINTING)}")
    for name, v in (("ranks", ranks), ("pipeline", pipeline), ("tensor_parallel", tensor_parallel)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"{name} must be a positive integer, got {v!r}")
    if ranks % (tensor_parallel * pipeline):
        raise InputError(f"ranks={ranks} must be a multiple of tensor_parallel x pipeline = "
                         f"{tensor_parallel * pipeline}")
    if cfg.n_layer % pipeline:
        raise InputError(f"pipeline={pipeline} must divide the {cfg.n_layer} layers of {cfg.name}")
    if cfg.position == "rope" and isinstance(seq, int) and seq > cfg.block_size:
        # rotary positions have no table to outgrow: plan past the trained context, as
        # long-context fine-tuning does (learned positions stop at theirs: StepConfig refuses)
        cfg = replace(cfg, block_size=seq)
    step = StepConfig(model=cfg, seq=seq, batch=batch, precision=precision,
                      checkpointing=checkpointing, zero=zero, world_size=ranks // pipeline,
                      parallel=ParallelDims(tensor=tensor_parallel))
    report = estimate_step(step, budget=gpu, target=target)
    cats = dict(report.by_category)
    host = report.host_bytes
    if pipeline > 1:  # the first stage: 1/p of the model states, the activations as they are
        cats.update({c: cats[c] // pipeline for c in STATES})
        host //= pipeline
    settings = dict(model=cfg.name, seq=seq, batch=batch, precision=precision,
                    checkpointing=checkpointing, zero=zero, ranks=ranks,
                    tensor_parallel=tensor_parallel, pipeline=pipeline, gpu=gpu, target=target)
    return Calculation(settings, {c: cats[c] for c in CATEGORIES}, sum(cats.values()),
                       GPU_PRESETS[gpu], host, report)


__all__ = ["MODELS", "CHECKPOINTING", "Calculation", "calculator", "register_model"]
