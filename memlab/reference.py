"""Measured GPU reference steps (package data under ``memlab/data/reference/<gpu>/``).

Each row of ``devset.json`` and ``gpu_check.json`` is one training step measured on a real
GPU: its configuration, the three lenses as they stood then, the tracker's bytes by category
(``measure_by_category``) and the CUDA caching allocator's figures (``allocator``, whose
``max_memory_allocated`` is the ground truth). :func:`reference_steps` turns every row back
into a :class:`~memlab.measure.StepConfig`, so that tests and benchmarks can replay them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from importlib import resources

from .errors import InputError
from .models import GPTConfig, UNetConfig, get_config
from .step import StepConfig

REFERENCE_FILES = ("devset.json", "gpu_check.json")


@dataclass(frozen=True)
class ReferenceStep:
    """One measured step: where it comes from, its config and the recorded figures."""

    source: str            # "<gpu>/<file>#<row index>"
    step: StepConfig
    row: dict

    @property
    def file(self) -> str:
        """The reference file of the row (``"devset.json"``): one process measured the rows of
        a file, in the file's order, keeping its allocator's cache from row to row."""
        return self.source.split("/", 1)[1].split("#")[0]

    @property
    def allocator_peak(self) -> int:
        """``torch.cuda.max_memory_allocated()`` over the step: the ground truth."""
        return int(self.row["allocator"]["max_memory_allocated"])

    @property
    def label(self) -> str:
        s = self.step
        cfg = s.model_config
        extra = []
        if s.optimizer != "adamw":
            extra.append(s.optimizer)
        if s.micro_batches > 1:
            extra.append(f"{s.micro_batches} micro")
        attn = getattr(cfg, "attention", "-")
        return (f"{cfg.name} s{s.seq} b{s.batch} {s.precision} {attn} ckpt-{cfg.checkpointing}"
                + (" " + " ".join(extra) if extra else ""))


def _model_from(d: dict) -> GPTConfig | UNetConfig:
    """The model of a described step: the recorded ``model_config`` when present (custom
    models such as ``llama-dev`` have no preset), else the preset named ``model``."""
    mc = d.get("model_config")
    if mc is None:
        return get_config(d["model"])
    is_unet = "mults" in mc or "channels" in mc
    cls = UNetConfig if is_unet else GPTConfig
    allowed = {f.name for f in fields(cls)}
    unknown = set(mc) - allowed
    if unknown:
        raise InputError(f"model_config has unknown field(s) {sorted(unknown)}; "
                         f"allowed for {cls.__name__}: {sorted(allowed)}")
    kw = dict(mc)
    if "mults" in kw:
        kw["mults"] = tuple(kw["mults"])
    return cls(**kw)


def step_from_description(d: dict) -> StepConfig:
    """Rebuild a :class:`StepConfig` from :meth:`StepConfig.describe` output (as stored in a
    reference row's ``config``), or from a ``gpu_check`` row (``model``, ``seq``, ``batch``
    and the variant's ``precision`` / ``checkpointing``).

    The result describes itself as ``d`` does: ``step_from_description(s.describe())``
    equals ``s`` up to the preset name being replaced by its config.
    """
    if "model" not in d or "seq" not in d or "batch" not in d:
        raise InputError(f"a step description needs 'model', 'seq' and 'batch'; got keys {sorted(d)}")
    model = _model_from(d)
    kw = {k: d[k] for k in ("precision", "optimizer", "micro_batches", "zero", "world_size",
                            "offload") if d.get(k) is not None}
    step = StepConfig(model=model, seq=int(d["seq"]), batch=int(d["batch"]),
                      checkpointing=d.get("checkpointing"),
                      attention=d.get("attention") if isinstance(model, GPTConfig) else None, **kw)
    if "num_params" in d and step.model_config.num_params() != d["num_params"]:
        raise InputError(f"rebuilt {step.model_config.name} has {step.model_config.num_params()} "
                         f"parameters, the description says {d['num_params']}")
    return step


def load_reference(gpu: str = "NVIDIA-H200", name: str = "devset.json") -> dict:
    """One reference file of the package data, parsed."""
    if name not in REFERENCE_FILES:
        raise InputError(f"reference file {name!r}; allowed: {', '.join(REFERENCE_FILES)}")
    folder = resources.files("memlab").joinpath("data", "reference", gpu)
    if not folder.is_dir():
        raise InputError(f"no reference measurements for GPU {gpu!r} in memlab/data/reference/")
    return json.loads(folder.joinpath(name).read_text())


def reference_steps(gpu: str = "NVIDIA-H200", names: tuple[str, ...] = REFERENCE_FILES) -> list[ReferenceStep]:
    """Every measured row of the reference files, as steps to replay."""
    out = []
    for name in names:
        data = load_reference(gpu, name)
        for i, row in enumerate(data["rows"]):
            desc = row.get("config", row)
            out.append(ReferenceStep(f"{gpu}/{name}#{i}", step_from_description(desc), row))
    return out


__all__ = ["ReferenceStep", "REFERENCE_FILES", "load_reference", "reference_steps",
           "step_from_description"]
