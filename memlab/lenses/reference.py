"""Measured GPU reference steps (package data under ``memlab/data/reference/<gpu>/``).

Each row of ``devset.json`` and ``gpu_check.json`` is one training step measured on a real
GPU: its configuration, the three lenses as they stood then, the tracker's bytes by category
(``measure_by_category``) and the CUDA caching allocator's figures (``allocator``, whose
``max_memory_allocated`` is the ground truth). :func:`reference_steps` turns every row back
into a :class:`~memlab.lenses.measure.StepConfig`, so that tests and benchmarks can replay them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path

from memlab.core.errors import InputError
from memlab.step.training_step import StepConfig

REFERENCE_DIR = Path(str(resources.files("memlab").joinpath("data", "reference")))
REFERENCE_FILES = ("devset.json", "gpu_check.json")  # the files whose rows replay as steps
OFFLOAD_FILE = "zero_offload_one_gpu.json"  # real DeepSpeed on one GPU: ZeRO 0-3 and optimizer offload


@dataclass(frozen=True)
class ReferenceStep:
    """One measured step: where it comes from, its config and the recorded figures.

    ``file`` is the reference file of the row (``"devset.json"``): one process measured the
    rows of a file, in the file's order, keeping its allocator's cache from row to row; ``index``
    is the row's place in it."""

    gpu: str               # the folder under memlab/data/reference/, e.g. "NVIDIA-H200"
    file: str
    index: int
    step: StepConfig
    row: dict

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


def step_of_row(row: dict) -> StepConfig:
    """The step a reference row ran: its ``config`` (:meth:`StepConfig.describe` as the recording
    memlab wrote it) or, for a ``gpu_check`` row without one, the row's own ``model``, ``seq``,
    ``batch``, ``precision`` and ``checkpointing``; keys a later StepConfig does not have (a row's
    figures, a renamed field) are left out (:meth:`StepConfig.from_dict` reads the rest)."""
    desc = row.get("config", row)
    known = {f.name for f in fields(StepConfig)} | {"model_config", "num_params"}
    return StepConfig.from_dict({k: v for k, v in desc.items() if k in known})


def load_references(directory: str | Path = REFERENCE_DIR) -> list[dict]:
    """GPU reference figures (``make gpu-check``), one dict per GPU, or ``[]`` when none were
    recorded.

    A GPU's folder (``data/reference/NVIDIA-H200/``) gives its ``gpu_check.json`` (``gpu``,
    ``rows``, ``plan_check``) with ``devset`` (the rows of ``devset.json``) and ``zero_offload``
    (``zero_offload_one_gpu.json``) added when present, and ``folder``, its name. A flat
    ``<gpu>.json`` with ``rows`` (older recordings) is read as it is. A file that is missing
    or not JSON is skipped.

    Args:
        directory: the folder of GPU folders (default: the package data).

    Returns:
        One dict per GPU, by folder name.

    A dict because it is the JSON files ``make gpu-check`` records, as written.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []

    def read(path: Path):
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return None

    refs = []
    for path in sorted(directory.iterdir()):
        if path.is_dir():
            check, dev, zero = (read(path / n) for n in
                                ("gpu_check.json", "devset.json", "zero_offload_one_gpu.json"))
            data = dict(check) if isinstance(check, dict) else {}
            data.setdefault("rows", [])
            if isinstance(dev, dict) and isinstance(dev.get("rows"), list):
                data["devset"] = dev["rows"]
                data.setdefault("gpu", dev.get("gpu"))
            if isinstance(zero, list):
                data["zero_offload"] = zero
            if not isinstance(data["rows"], list) or not (
                    data["rows"] or data.get("devset") or data.get("zero_offload")):
                continue
            data["folder"] = path.name
            data["gpu"] = data.get("gpu") or path.name
            refs.append(data)
        elif path.suffix == ".json":
            data = read(path)
            if isinstance(data, dict) and isinstance(data.get("rows"), list):
                refs.append(data)
    return refs


# the key of load_references' dict that holds each replayable file's rows
_ROWS_KEY = {"devset.json": "devset", "gpu_check.json": "rows"}


def reference_steps(gpu: str = "NVIDIA-H200", names: tuple[str, ...] = REFERENCE_FILES,
                    directory: str | Path = REFERENCE_DIR) -> list[ReferenceStep]:
    """Every measured row of a GPU's reference files, as steps to replay.

    Args:
        gpu: the GPU's folder under ``directory``.
        names: which of :data:`REFERENCE_FILES` to read.
        directory: the folder of GPU folders (default: the package data).

    Returns:
        The rows of each file in ``names``, in the file's order.

    Raises:
        InputError: an unknown file name, or no recorded folder for ``gpu``.
    """
    for name in names:
        if name not in REFERENCE_FILES:
            raise InputError(f"reference file {name!r}; allowed: {', '.join(REFERENCE_FILES)}")
    ref = next((r for r in load_references(directory) if r.get("folder") == gpu), None)
    if ref is None:
        raise InputError(f"no reference measurements for GPU {gpu!r} in {directory}")
    out = []
    for name in names:
        for i, row in enumerate(ref.get(_ROWS_KEY[name], [])):
            out.append(ReferenceStep(gpu, name, i, step_of_row(row), row))
    return out


@dataclass(frozen=True)
class OffloadReference:
    """One row of a GPU's ``zero_offload_one_gpu.json``: a steady-state DeepSpeed step on ONE
    GPU (world size 1), with memlab's DeepSpeed config, measured by the CUDA allocator and psutil.

    ``device_base_bytes``: what the allocator held after warm-up, before the timed step (the
    model states DeepSpeed keeps on the device, its buffers, the cuBLAS workspace);
    ``device_peak_bytes``: ``max_memory_allocated`` over the step; ``device_reserved_bytes``:
    ``max_memory_reserved``; ``rss_before_bytes``/``rss_after_bytes``: the process's resident
    host memory after warm-up and after the step; ``step_seconds``: the timed step (the median
    of ``step_seconds_samples`` where the record keeps them; the H200's record has one
    step per row, so no spread to judge a prediction against).
    """

    gpu: str
    zero: int
    offload: str
    model: str
    seq: int
    batch: int
    num_params: int
    device_base_bytes: int
    device_peak_bytes: int
    device_reserved_bytes: int
    rss_before_bytes: int
    rss_after_bytes: int
    step_seconds: float
    step_seconds_samples: tuple[float, ...] = ()

    @property
    def label(self) -> str:
        """``"ZeRO-2 + offload optimizer"``, ``"ZeRO-3"``."""
        return f"ZeRO-{self.zero}" + ("" if self.offload == "none" else f" + offload {self.offload}")

    def step(self) -> StepConfig:
        """The step as memlab describes it. The file records no precision: every row ran bf16
        (the folder's README). ``zero=0`` is plain PyTorch in :class:`StepConfig` (autocast),
        while this row ran DeepSpeed's stage 0, which no step config expresses."""
        return StepConfig(model=self.model, seq=self.seq, batch=self.batch, precision="bf16",
                          zero=self.zero, offload=self.offload)


def offload_reference(gpu: str = "NVIDIA-H200") -> list[OffloadReference]:
    """The rows of a GPU's ``zero_offload_one_gpu.json`` (package data), in the file's order.

    Args:
        gpu: the GPU's folder under ``memlab/data/reference/``.

    Returns:
        One :class:`OffloadReference` per measured ``(zero, offload)`` case.

    Raises:
        InputError: no such file for ``gpu`` (the message lists the GPUs that have one).
    """
    root = resources.files("memlab").joinpath("data", "reference")
    path = root.joinpath(gpu, OFFLOAD_FILE)
    if not path.is_file():
        have = sorted(d.name for d in root.iterdir() if d.joinpath(OFFLOAD_FILE).is_file())
        raise InputError(f"no {OFFLOAD_FILE} for GPU {gpu!r}; recorded for: {', '.join(have) or 'none'}")
    return [OffloadReference(gpu=gpu, zero=int(r["zero"]), offload=str(r["offload"]), model=str(r["model"]),
                             seq=int(r["seq"]), batch=int(r["batch"]), num_params=int(r["num_params"]),
                             device_base_bytes=int(r["device_base"]), device_peak_bytes=int(r["device_peak"]),
                             device_reserved_bytes=int(r["device_reserved"]),
                             rss_before_bytes=int(r["rss_before"]), rss_after_bytes=int(r["rss_after"]),
                             step_seconds=float(r["step_seconds"]),
                             step_seconds_samples=tuple(float(x) for x in r.get("step_seconds_samples", ())))
            for r in json.loads(path.read_text())]


__all__ = ["OFFLOAD_FILE", "REFERENCE_DIR", "REFERENCE_FILES", "OffloadReference", "ReferenceStep",
           "load_references", "offload_reference", "reference_steps", "step_of_row"]
