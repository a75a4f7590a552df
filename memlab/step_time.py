"""How long one training step takes on a card: the time lens beside the memory lenses.

The rule, part by part (each a few lines below, and in :attr:`StepTime.rule`):

* **compute** = (forward + backward FLOPs) / (peak x achievable), **recompute** = the
  recomputed FLOPs / the same rate. FLOPs come from :mod:`memlab.flops` (per rank: divided by
  the tensor- and pipeline-parallel degrees); the peak is the card's datasheet figure for the
  dtype the matmuls run in (:class:`memlab.cards.Speeds`: bf16/fp16 under autocast or
  DeepSpeed's 16-bit mode, fp32 otherwise: torch leaves TF32 off for matmuls by default);
  ``achievable`` is the fraction published training runs reach on that card (cited in
  :data:`memlab.cards.SPEEDS`), applied to the rate of one large matmul ``memlab doctor
  --calibrate`` measured on this card in place of the datasheet's peak (:func:`calibrated_rate`).
* **communication** = bytes moved on the GPU links (:mod:`memlab.communication`) / the
  link's one-way bandwidth (NVLink within a node of up to 8 GPUs, where the card has it, else
  PCIe), less what the engine overlaps: DDP all-reduces its buckets while backward runs
  (Li et al. 2020, sec. 3.2.3), so only what outlasts backward shows; memlab's DeepSpeed
  config sets ``overlap_comm: false`` (:func:`memlab.distributed.deepspeed_config.deepspeed_config`),
  so ZeRO's collectives are all exposed; tensor parallelism's all-reduces sit between a
  layer's matmuls (Megatron-LM sec. 3): exposed; pipeline sends: exposed.
* **offload**: the step is the slowest of the GPU's work (compute, recompute, communication),
  the PCIe transfers and the host's Adam over its parameter shard (``cpu_adam_params_per_s``,
  measured by ``memlab doctor --calibrate``, else :data:`CPU_ADAM_PARAMS_PER_S`); the
  ``offload`` part is what the slowest exceeds the GPU's work by.
* **bubble** (pipeline, ``p`` stages, ``m`` micro-batches): ``(p - 1) / m`` of the compute
  (Narayanan et al. 2021, sec. 2.2.1).

Left out: elementwise ops, norms and the optimizer on the GPU (memory-bound, a few percent of
a large model's step), kernel launch latency (it dominates tiny models on a GPU), the data
loader, and the network between nodes (a group over 8 GPUs uses PCIe's figure).
"""
from __future__ import annotations

import json
import os
import pathlib
from dataclasses import dataclass, field

from .cards import SPEEDS, Card, Speeds, card_speeds, get_card
from .communication import StepComm, step_communication
from .flops import StepFlops, step_flops_formula
from .states import under_deepspeed

#: torch.optim.AdamW on the host, parameters per second, used when ``memlab doctor
#: --calibrate`` has not measured this host: the H200 reference's host ran ZeRO-Offload's
#: step of gpt2-large (774M parameters) in 1.65 s, 1.43 s more than on the GPU
#: (memlab/data/reference/NVIDIA-H200/README.md): about 5.4e8 parameters/s
CPU_ADAM_PARAMS_PER_S = 774_030_080 / (1.65 - 0.22)
#: where ``memlab doctor --calibrate`` keeps what it measured (``MEMLAB_CALIBRATION`` overrides)
CALIBRATION_ENV = "MEMLAB_CALIBRATION"
PARTS = ("compute", "recompute", "communication", "offload", "bubble")
NODE_GPUS = 8  # GPUs one NVLink domain joins in the DGX/HGX boards the datasheets describe


@dataclass(frozen=True)
class TimeParts:
    """Seconds of one step by part (module doc); ``communication_bytes`` is what those
    seconds move on the GPU links, ``pcie_bytes`` over PCIe."""

    compute: float
    recompute: float
    communication: float
    offload: float
    bubble: float
    communication_bytes: float = 0.0
    pcie_bytes: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.communication + self.offload + self.bubble


@dataclass(frozen=True)
class StepTime:
    """The time lens of one step: its FLOPs (always), and on a card its seconds, by part,
    tokens per second and MFU (model FLOPs, without recompute, over seconds x peak: PaLM,
    Chowdhery et al. 2022, appendix B). ``bound`` names what limits an offloaded step."""

    flops: StepFlops
    seconds: float | None = None
    by_part: TimeParts | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    card: str | None = None
    bound: str = "gpu"
    communication: StepComm = field(default_factory=StepComm)
    rule: str = ""

    def to_dict(self) -> dict:
        d = {"flops": self.flops.to_dict(), "seconds": self.seconds, "tokens_per_second": self.tokens_per_second,
             "mfu": self.mfu, "card": self.card, "bound": self.bound, "rule": self.rule}
        if self.by_part is not None:
            d["by_part"] = {p: getattr(self.by_part, p) for p in PARTS}
            d["by_part"]["communication_bytes"] = self.by_part.communication_bytes
            d["by_part"]["pcie_bytes"] = self.by_part.pcie_bytes
        d["communication"] = self.communication.to_dict()
        return d


@dataclass(frozen=True)
class Calibration:
    """What ``memlab doctor --calibrate`` measured: one large matmul's FLOP/s per dtype on a
    device, the host's AdamW parameters per second."""

    device: str
    matmul_flops: dict[str, float]
    cpu_adam_params_per_s: float


def calibration_path() -> pathlib.Path:
    """Where the calibration lives: ``$MEMLAB_CALIBRATION`` or ``~/.cache/memlab/calibration.json``."""
    env = os.environ.get(CALIBRATION_ENV)
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "memlab" / "calibration.json"


def load_calibration(path: pathlib.Path | None = None) -> Calibration | None:
    """The stored calibration, or ``None`` when there is none (or it cannot be read)."""
    p = path or calibration_path()
    try:
        d = json.loads(p.read_text())
        return Calibration(d["device"], {k: float(v) for k, v in d["matmul_flops"].items()},
                           float(d["cpu_adam_params_per_s"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def compute_dtype(step) -> str:
    """The dtype a step's matmuls run in: bf16/fp16 under autocast and in DeepSpeed's 16-bit
    mode (bf16 unless fp32), else fp32."""
    if step.precision in ("bf16", "pure-bf16"):
        return "bf16"
    if step.precision == "fp16":
        return "fp16"
    return "fp32"


def calibrated_rate(card_name: str, dtype: str, calibration: Calibration | None) -> float | None:
    """FLOP/s a step reaches per the calibration, when it was measured on this card: the
    measured matmul rate takes the datasheet peak's place (``measured x achievable``), so a
    card whose matmuls run slower than its datasheet (clocks, power cap) is timed slower.
    ``None`` without a calibration of this card and dtype."""
    if calibration is None or calibration.device != card_name or dtype not in calibration.matmul_flops:
        return None
    return calibration.matmul_flops[dtype] * card_speeds(card_name).achievable


def step_time(step, card: Card | str | None = None, *, flops: StepFlops | None = None,
              tensor_parallel: int = 1, pipeline_parallel: int = 1,
              speeds: Speeds | None = None, calibration: Calibration | None = None,
              cpu_adam_params_per_s: float | None = None) -> StepTime:
    """The time of one step of ``step`` (a :class:`memlab.step.StepConfig`, ``batch`` per
    rank) on ``card``, by the module doc's rule.

    Args:
        step: the step.
        card: a profile or its name; ``None``: the FLOPs only (no card, no seconds).
        flops: the step's FLOPs if already counted (default :func:`memlab.flops.step_flops_formula`).
        tensor_parallel, pipeline_parallel: degrees over ``step.world_size`` ranks.
        speeds: datasheet figures to use instead of the card's (a card memlab has none for).
        calibration: ``memlab doctor --calibrate``'s figures (default: the stored ones).
        cpu_adam_params_per_s: the host's AdamW throughput (default: calibrated, else
            :data:`CPU_ADAM_PARAMS_PER_S`).

    Returns:
        :class:`StepTime`.
    """
    flops = flops or step_flops_formula(step)
    comm = step_communication(step, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel)
    if card is None and speeds is None:
        return StepTime(flops, communication=comm, rule="no card: FLOPs only")
    if isinstance(card, str):
        card = get_card(card)
    name = card.name if card is not None else "custom"
    sp = speeds or card_speeds(card)
    calibration = calibration if calibration is not None else load_calibration()
    dtype = compute_dtype(step)
    rate = calibrated_rate(name, dtype, calibration) or sp.peak(dtype) * sp.achievable
    t, p = tensor_parallel, pipeline_parallel
    share = t * p
    compute = flops.model / share / rate
    recompute = flops.recompute / share / rate
    gpu_link = sp.nvlink if sp.nvlink and step.world_size <= NODE_GPUS else sp.pcie
    comm_s = comm.gpu_bytes / gpu_link if comm.gpu_bytes else 0.0
    overlap = "none"
    if step.zero == 0 and not under_deepspeed(step.zero, step.offload):
        dp_bytes = comm.by_kind.get("data-parallel all-reduce", 0.0)
        dp_s = dp_bytes / gpu_link
        backward = flops.backward / share / rate
        comm_s = comm_s - dp_s + max(0.0, dp_s - backward)
        overlap = "DDP overlaps its all-reduce with backward"
    m = step.micro_batches
    bubble = (p - 1) / m * (compute + recompute) if p > 1 else 0.0
    gpu = compute + recompute + comm_s + bubble
    offload, bound = 0.0, "gpu"
    if step.offload != "none":
        cal_adam = calibration.cpu_adam_params_per_s if calibration is not None else None
        adam_rate = cpu_adam_params_per_s or cal_adam or CPU_ADAM_PARAMS_PER_S
        n = step.world_size // share
        shard = step.model_config.num_params() / share / n
        pcie_s = comm.pcie_bytes / sp.pcie
        adam_s = shard / adam_rate
        slowest = max(gpu, pcie_s, adam_s)
        bound = "gpu" if slowest == gpu else ("pcie" if slowest == pcie_s else "cpu adam")
        offload = slowest - gpu
    seconds = gpu + offload
    tokens = step.seq * step.batch * (step.world_size // share)  # the data-parallel replicas' tokens
    peak_all = sp.peak(dtype) * step.world_size
    mfu = flops.model * (step.world_size // share) / (seconds * peak_all) if seconds > 0 else None
    parts = TimeParts(compute, recompute, comm_s, offload, bubble, comm.gpu_bytes, comm.pcie_bytes)
    rule = (f"compute = FLOPs / ({dtype} peak {sp.peak(dtype) / 1e12:g} TFLOP/s x "
            f"{rate / sp.peak(dtype):.2f} achievable); communication = {comm.gpu_bytes / 1e9:.3g} GB / "
            f"{gpu_link / 1e9:g} GB/s ({overlap}); offload: slowest of GPU, PCIe, CPU Adam; "
            f"bubble (p-1)/m")
    return StepTime(flops, seconds, parts, tokens / seconds if seconds > 0 else None, mfu, name, bound,
                    comm, rule)


def report_time(step, card: Card | None, *, flops: StepFlops | None = None,
                tensor_parallel: int = 1) -> StepTime:
    """The ``time`` of a lens's report: on ``card`` when memlab has its figures, else the
    FLOPs alone (the CPU, a card without a datasheet entry)."""
    if card is not None and card.name not in SPEEDS:
        card = None
    return step_time(step, card, flops=flops, tensor_parallel=tensor_parallel)


__all__ = ["report_time", "CALIBRATION_ENV", "CPU_ADAM_PARAMS_PER_S", "Calibration", "NODE_GPUS",
           "PARTS", "StepTime", "TimeParts", "calibrated_rate", "calibration_path", "compute_dtype",
           "load_calibration", "step_time"]
