"""The GPUs learners own, as profiles: memory, compute capability and what follows from it.

A :class:`Card` is what the lenses and the lessons need to know about a GPU, and nothing
else: how much memory one device has, how many devices there are, its compute capability,
and the facts that capability decides in torch (2.11-2.13):

* **bf16 natively** from sm80 (Ampere) on; below, bf16 runs emulated and slowly, so a
  lesson uses fp16 with a ``GradScaler`` there (``torch.cuda.is_bf16_supported``).
* **Scaled dot-product attention kernels** (``aten/src/ATen/native/transformers/cuda/
  sdp_utils.cpp``): FlashAttention-2 needs sm80+ and fp16/bf16 inputs
  (``check_flash_attention_hardware_support``, ``check_dtypes_low_precision``); the
  memory-efficient kernel runs from sm50 on, for fp16/fp32 below sm80 and fp16/bf16/fp32
  from sm80 (``less_than_sm80_mem_efficient_dtypes``,
  ``greater_than_or_equal_sm80_mem_efficient_dtypes``); everything else falls back to the
  ``math`` composite. So on a T4 (sm75) bf16 attention materialises its scores.
* **cuBLAS workspace** per (handle, stream), larger on sm90 (Hopper), plus a cuBLASLt
  workspace: the sizes and their environment variables are written once, at
  :func:`cublas_workspace_bytes` and :func:`cublaslt_workspace_bytes` (from
  ``aten/src/ATen/cuda/CublasHandlePool.cpp``).

:func:`detect_card` maps the device torch sees to a profile (or builds one from its
properties). ``MEMLAB_CARD=T4-16GB`` asks for a *rehearsal*: on a larger GPU the profile of
the named card is returned, marked ``rehearsal``, and :func:`memlab.classroom.lesson.setup` caps the
memory and switches off the kernels that card lacks.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

import torch

from memlab.core.errors import InputError

_MiB = 2**20
CARD_ENV = "MEMLAB_CARD"   # the profile to rehearse (lesson.setup, detect_card, make gpu-check CARD=)

SDPA_KERNELS = ("flash", "efficient", "math")  # torch's priority order on CUDA


@dataclass(frozen=True)
class Card:
    """One GPU model as the lenses and lessons see it.

    ``memory`` is one device's total (``nvidia-smi``'s MiB for the presets; the device's
    ``total_memory`` when detected), ``gpus`` how many of them the machine has (Kaggle's
    2 x T4: 2), ``capability`` the compute capability. ``rehearsal`` names the real GPU when
    this profile is rehearsed on a larger one (``MEMLAB_CARD``); ``flash`` is ``False``
    when FlashAttention is switched off although the capability has it.
    """

    name: str
    memory: int
    capability: tuple[int, int]
    gpus: int = 1
    device_name: str = ""
    rehearsal: str | None = None
    flash: bool = True

    @property
    def bf16_native(self) -> bool:
        """bf16 arithmetic in hardware: Ampere (sm80) and later."""
        return tuple(self.capability) >= (8, 0)

    @property
    def precision(self) -> str:
        """The 16-bit mixed precision a lesson uses here: ``bf16`` where native, else ``fp16``
        (with a ``GradScaler``)."""
        return "bf16" if self.bf16_native else "fp16"

    def precisions(self) -> tuple[str, ...]:
        """The precisions a lesson may run on this card (bf16 ones only where native)."""
        return ("fp32", "bf16", "fp16", "pure-bf16") if self.bf16_native else ("fp32", "fp16")

    def sdpa_kernels(self, elem_bytes: int, dtype: str | None = None) -> tuple[str, ...]:
        """Fused attention kernels this card runs for inputs of ``elem_bytes`` per element
        (``dtype``: ``"bf16"`` or ``"fp16"`` to tell the two 16-bit types apart; default
        fp16 for 2 bytes), in torch's priority order, ``"math"`` last (always possible)."""
        cap = tuple(self.capability)
        dtype = dtype or {2: "fp16", 4: "fp32"}.get(elem_bytes, "other")
        kernels = []
        if self.flash and cap >= (8, 0) and dtype in ("fp16", "bf16"):
            kernels.append("flash")
        efficient = ("fp16", "fp32", "bf16") if cap >= (8, 0) else ("fp16", "fp32")
        if cap >= (5, 0) and dtype in efficient:
            kernels.append("efficient")
        return (*kernels, "math")

    def cublas_workspace(self, env: dict[str, str] | None = None) -> int:
        """Bytes of one (handle, stream)'s cuBLAS + cuBLASLt workspace on this card."""
        return cublas_workspace_bytes(self.capability, env) + cublaslt_workspace_bytes(env)

    @property
    def total_memory(self) -> int:
        """Memory of all the card's devices together."""
        return self.memory * self.gpus

    def describe(self) -> str:
        """One line: name, memory, capability, and the rehearsal if any."""
        gib = self.memory / 2**30
        gpus = f"{self.gpus} x " if self.gpus > 1 else ""
        line = (f"{self.name} ({gpus}{gib:.1f} GiB, sm{self.capability[0]}{self.capability[1]}, "
                f"bf16 {'native' if self.bf16_native else 'emulated'}, "
                f"flash {'on' if self.flash and self.capability >= (8, 0) else 'off'})")
        return line + (f", rehearsed on {self.rehearsal}" if self.rehearsal else "")


def cublas_workspace_bytes(capability: tuple[int, int] = (9, 0),
                           env: dict[str, str] | None = None) -> int:
    """cuBLAS workspace of one (handle, stream), as torch chooses it: ``CUBLAS_WORKSPACE_CONFIG``
    (``:SIZE_KiB:COUNT`` pairs, summed) if set, else 32 MiB on sm90 and 8 MiB + 128 KiB
    otherwise (``parseChosenWorkspaceSize`` in ``CublasHandlePool.cpp``)."""
    env = os.environ if env is None else env
    default = 4096 * 8 * 1024 if tuple(capability) == (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    if not config:
        return default
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    return sum(int(size) * 1024 * int(count) for size, count in pairs) if pairs else default


def cublaslt_workspace_bytes(env: dict[str, str] | None = None) -> int:
    """cuBLASLt workspace of one (handle, stream): ``CUBLASLT_WORKSPACE_SIZE`` KiB, default
    1024 (``parseCUDABlasLtWorkspaceSize``)."""
    env = os.environ if env is None else env
    try:
        return int(env.get("CUBLASLT_WORKSPACE_SIZE", "1024")) * 1024
    except ValueError:
        return 1024 * 1024


def _card(name: str, mib: int, cap: tuple[int, int], gpus: int = 1, device: str = "") -> Card:
    return Card(name, mib * _MiB, cap, gpus, device)


# Total memory as ``nvidia-smi`` reports it (MiB); capability from NVIDIA's CUDA GPUs list.
# A process gets a little less: the CUDA context takes a few hundred MiB first.
CARDS: dict[str, Card] = {c.name: c for c in (
    _card("T4-16GB", 15360, (7, 5), device="Tesla T4"),
    _card("2xT4-16GB", 15360, (7, 5), gpus=2, device="Tesla T4"),
    _card("V100-16GB", 16160, (7, 0), device="Tesla V100-SXM2-16GB"),
    _card("V100-32GB", 32510, (7, 0), device="Tesla V100-SXM2-32GB"),
    _card("RTX3090-24GB", 24576, (8, 6), device="NVIDIA GeForce RTX 3090"),
    _card("RTX4090-24GB", 24564, (8, 9), device="NVIDIA GeForce RTX 4090"),
    _card("L4-24GB", 23034, (8, 9), device="NVIDIA L4"),
    _card("A10G-24GB", 23028, (8, 6), device="NVIDIA A10G"),
    _card("L40S-48GB", 46068, (8, 9), device="NVIDIA L40S"),
    _card("A100-40GB", 40960, (8, 0), device="NVIDIA A100-SXM4-40GB"),
    _card("A100-80GB", 81920, (8, 0), device="NVIDIA A100-SXM4-80GB"),
    _card("H100-80GB", 81559, (9, 0), device="NVIDIA H100 80GB HBM3"),
    _card("H200-141GB", 143771, (9, 0), device="NVIDIA H200"),
)}
REFERENCE_CARD = "H200-141GB"  # the GPU of memlab/data/reference/NVIDIA-H200


# --------------------------------------------------------------------------------------
# What time needs: throughput and bandwidths (memlab.time.step_time)
# --------------------------------------------------------------------------------------
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")


@dataclass(frozen=True)
class Speeds:
    """A card's datasheet figures for the step-time model, dense (no structured sparsity).

    ``tflops``: peak TFLOP/s per dtype (fp32 on the CUDA cores; tf32, bf16, fp16 and fp8 on
    the tensor cores, with fp32 accumulation where the datasheet says so), only the dtypes the
    card has. ``hbm``: memory bandwidth, bytes/s. ``nvlink``, ``pcie``: bytes/s in *one*
    direction (the datasheets give both directions together: half of that; 0: no NVLink).
    ``achievable``: the fraction of the peak a large GEMM reaches where a kernel benchmark
    is published (the A100), else the end-to-end fraction of a published run (its source in
    ``achievable_source``; :data:`RATE_LEDGER`), applied under each GEMM's roofline.
    """

    tflops: tuple[tuple[str, float], ...]
    hbm: float
    nvlink: float
    pcie: float
    achievable: float
    achievable_source: str
    datasheet: str

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` (bf16 on a card without it: fp32's, as it is emulated)."""
        table = dict(self.tflops)
        if dtype not in DTYPES:
            raise InputError(f"dtype={dtype!r}; allowed: {', '.join(DTYPES)}")
        if dtype not in table:
            return table["fp32"] * 1e12
        return table[dtype] * 1e12


_GB = 1e9
#: ``achievable``: the fraction of the dtype's peak a large, compute-bound GEMM reaches; the
#: time lens applies it per GEMM, under a roofline of the GEMM's bytes at HBM's bandwidth
#: (:func:`memlab.time.step_time.gemm_seconds`), so small and skinny GEMMs run slower. Each figure,
#: its source and the published rows it was derived from or only checks, in :data:`RATE_LEDGER`.
_A100_GEMM = (0.80, "Dao 2023 (FlashAttention-2, arXiv 2307.08691), sec. 1: optimized GEMM reaches "
                    "up to 80-90% of the A100's peak; the lower end (that sentence not read in the paper "
                    "here; its abstract, read, puts FlashAttention-2 at 50-73% of peak, 'close to' GEMM)")
_H100_KERNEL = (0.75, "Shah et al. 2024 (FlashAttention-3, arXiv 2407.08608), abstract: its BF16/FP16 "
                      "kernel reaches 740 TFLOP/s on the H100, 75% of the dense peak (a kernel benchmark; "
                      "no H100 GEMM figure was read, so the large-GEMM fraction is taken to be what its best "
                      "published kernel reaches)")
_ADA_GEMM = (_A100_GEMM[0], "Dao 2023 (FlashAttention-2), sec. 1, the A100's figure taken to hold on Ada's tensor "
                            "cores (no RTX 4090 GEMM benchmark was read); the other Ada and Ampere cards keep the "
                            "end-to-end 0.30 until a published row checks them")
_V100_RUN = (0.30, "Shoeybi et al. 2019 (Megatron-LM), sec. 1: 30% of peak on V100 (end to end), "
                   "used for the cards no published kernel benchmark covers")


#: the measured rows the time lens is set against or derived from, by key: published runs (each
#: held by tests/test_published_runs.py) and the H200 reference record's rows (tests/test_step_time.py)
MEASURED_ROWS: dict[str, str] = {
    "narayanan2021-table1": "Narayanan et al. 2021 (arXiv 2104.04473), sec. 5.1, Table 1: ten GPT models, 1.7B-1T, "
                            "TFLOP/s per A100",
    "korthikanti2022-abstract": "Korthikanti et al. 2022 (arXiv 2205.05198), abstract: the 530B on 2240 A100s, 54.2% "
                                "MFU with selective recomputation and SP, 42.1% with full",
    "korthikanti2022-table4": "Korthikanti et al. 2022, Table 4: one 22B layer's time without, with full and with "
                              "selective recomputation, with and without SP",
    "korthikanti2022-figure8": "Korthikanti et al. 2022, Figure 8: the 530B and 1T layers' overheads",
    "korthikanti2022-table5": "Korthikanti et al. 2022, Table 5: iteration seconds of the 22B-1T models, full "
                              "recomputation and selective + SP",
    "dubey2024-table4": "Dubey et al. 2024 (Llama 3, arXiv 2407.21783), sec. 3.3.2, Table 4: the 405B on 8,192 and "
                        "16,384 H100s, TFLOP/s per GPU",
    "torchtune-4090": "torchtune README (pytorch/torchtune@30b8519e): Llama 3.1 8B on one RTX 4090, LoRA 3,083 and "
                      "QLoRA 2,413 tokens/s",
    "shoeybi2019-sec1": "Shoeybi et al. 2019 (Megatron-LM, arXiv 1909.08053), sec. 1: 30% of the V100's peak "
                        "end to end",
    **{f"h200-zero{z}{o}": f"memlab/data/reference/NVIDIA-H200/zero_offload_one_gpu.json: gpt2-large, ZeRO {z}"
                           f"{' with the optimizer offloaded' if o else ''}, one timed step"
       for z, o in ((0, ""), (1, ""), (2, ""), (2, "-offload"), (3, ""))},
}


@dataclass(frozen=True)
class RateSource:
    """One rate of the time lens: its ``value`` and ``source`` (a datasheet, a kernel benchmark, a
    code path), the :data:`MEASURED_ROWS` it was ``derived_from`` and those whose predictions use it
    and so ``checks`` it. No row may be both, for any rate (tests/test_published_runs.py)."""

    rate: str
    value: float
    source: str
    derived_from: tuple[str, ...]
    checks: tuple[str, ...]


_KORTHIKANTI = ("korthikanti2022-abstract", "korthikanti2022-table4", "korthikanti2022-figure8",
                "korthikanti2022-table5")
_H200_ROWS = ("h200-zero1", "h200-zero2", "h200-zero3")
#: every rate the time lens takes from outside, with the rows that made it and those that test it
RATE_LEDGER: tuple[RateSource, ...] = (
    RateSource("A100 large-GEMM fraction of peak (A100-40GB, A100-80GB)", _A100_GEMM[0], _A100_GEMM[1],
               (), ("narayanan2021-table1", *_KORTHIKANTI)),
    RateSource("H100 and H200 large-GEMM fraction of peak", _H100_KERNEL[0], _H100_KERNEL[1],
               (), ("dubey2024-table4", *_H200_ROWS)),
    RateSource("RTX 4090 large-GEMM fraction of peak", _ADA_GEMM[0], _ADA_GEMM[1], (), ("torchtune-4090",)),
    RateSource("QLoRA dequantisation under bitsandbytes: bytes per 4-bit weight per matmul, 3 launches", 2.766,
               "bitsandbytes-foundation/bitsandbytes@37d2a938 (tag 0.50.1; the installed 0.50.2's files are "
               "byte-identical): backends/cuda/ops.py:926,954 (past 1536 rows gemm_4bit takes the default "
               "path), backends/default/ops.py:323-345 (forward), functional.py:1052-1063 and "
               "autograd/_functions.py:384 (backward) (memlab.time.step_time.dequant_4bit_bytes); "
               "no published row runs it", (), ()),
    RateSource("QLoRA dequantisation under torchao's NF4Tensor, fused by torch.compile: bytes per weight "
               "element per matmul (eager: 33.2 in 13 kernels)", 2.516,
               "torchao/dtypes/nf4tensor.py at pytorch/ao@5e558f50, LinearNF4 (lines 1063-1074) and "
               "get_original_weight (855-889), recounted on torchao 0.18's own ops "
               "(memlab.time.step_time.dequant_nf4_torchao)", (), ("torchtune-4090",)),
    RateSource("fraction of peak on T4, V100, RTX 3090, L4, A10G, L40S", _V100_RUN[0], _V100_RUN[1],
               ("shoeybi2019-sec1",), ()),
    RateSource("HBM bandwidth (GEMM roofline, elementwise ops, LoRA's GEMMs, QLoRA's dequantisation)", 1.0,
               "each card's datasheet (SPEEDS)", (),
               ("narayanan2021-table1", *_KORTHIKANTI, "dubey2024-table4", "torchtune-4090", *_H200_ROWS)),
    RateSource("host launch per kernel, seconds (memlab.time.step_time.LAUNCH_SECONDS)", 10e-6,
               "susun-blog.com 'From Launch Overhead to CUDA Graph' (5 us a launch) plus a stated 5 us of "
               "PyTorch dispatch; the ZeRO-0 row, launch-bound, derived the host's Adam, so no row checks it",
               (), ("torchtune-4090", *_H200_ROWS)),
    RateSource("GPU link bandwidth: NVLink within 8 GPUs, PCIe's figure beyond", 1.0,
               "each card's datasheet (SPEEDS)", (), ("korthikanti2022-table5", "dubey2024-table4")),
    RateSource("Selene's network between nodes, bytes/s one way per GPU", 25e9,
               "Narayanan et al. 2021, sec. 5: eight 200 Gb/s HDR InfiniBand HCAs a node of eight A100s (the "
               "cluster's description, not a measured row)", (),
               ("narayanan2021-table1", "korthikanti2022-abstract")),
    RateSource("host AdamW, parameters/s (memlab.time.step_time.CPU_ADAM_PARAMS_PER_S)", 774_030_080 / (1.65 - 0.22),
               "the H200 reference's ZeRO-Offload step of gpt2-large, 1.65 s, less its ZeRO-0 step, 0.22 s",
               ("h200-zero2-offload", "h200-zero0"), ()),
)


def _speeds(tflops: dict[str, float], hbm_gb: float, nvlink_gb: float, pcie_gb: float,
            run: tuple[float, str], datasheet: str) -> Speeds:
    return Speeds(tuple(tflops.items()), hbm_gb * _GB, nvlink_gb / 2 * _GB, pcie_gb / 2 * _GB,
                  run[0], run[1], datasheet)


#: datasheet figures per profile (bandwidths as printed: both directions; halved above)
SPEEDS: dict[str, Speeds] = {
    # NVIDIA T4 Tensor Core GPU datasheet: FP32 8.1, mixed FP16/FP32 65 TFLOPS; 320 GB/s; PCIe Gen3 x16 32 GB/s
    "T4-16GB": _speeds({"fp32": 8.1, "fp16": 65}, 320, 0, 32, _V100_RUN, "NVIDIA T4 datasheet"),
    # NVIDIA V100 Tensor Core GPU datasheet (SXM2): FP32 15.7, tensor 125 TFLOPS; 900 GB/s; NVLink 300 GB/s;
    # PCIe Gen3 32 GB/s
    "V100-16GB": _speeds({"fp32": 15.7, "fp16": 125}, 900, 300, 32, _V100_RUN, "NVIDIA V100 datasheet"),
    "V100-32GB": _speeds({"fp32": 15.7, "fp16": 125}, 900, 300, 32, _V100_RUN, "NVIDIA V100 datasheet"),
    # NVIDIA Ampere GA102 GPU Architecture whitepaper, Table 9 (RTX 3090): FP32 35.6, TF32 35.6,
    # FP16/BF16 tensor with FP32 accumulate 71 TFLOPS; 936 GB/s; NVLink bridge 112.5 GB/s; PCIe Gen4 64 GB/s
    "RTX3090-24GB": _speeds({"fp32": 35.6, "tf32": 35.6, "bf16": 71, "fp16": 71}, 936, 112.5, 64,
                            _V100_RUN, "NVIDIA Ampere GA102 whitepaper"),
    # NVIDIA Ada GPU Architecture whitepaper, Table 2 (RTX 4090): FP32 82.6, TF32 82.6, FP16/BF16 with
    # FP32 accumulate 165.2, FP8 330.3 TFLOPS; 1008 GB/s; no NVLink; PCIe Gen4 64 GB/s
    "RTX4090-24GB": _speeds({"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2, "fp8": 330.3},
                            1008, 0, 64, _ADA_GEMM, "NVIDIA Ada Lovelace whitepaper"),
    # NVIDIA L4 Tensor Core GPU datasheet: FP32 30.3, TF32 60, FP16/BF16 121, FP8 242.5 TFLOPS (dense:
    # half the printed sparse figures); 300 GB/s; PCIe Gen4 x16 64 GB/s
    "L4-24GB": _speeds({"fp32": 30.3, "tf32": 60, "bf16": 121, "fp16": 121, "fp8": 242.5}, 300, 0, 64,
                       _V100_RUN, "NVIDIA L4 datasheet"),
    # the A10's figures, not the A10G's: NVIDIA publishes no A10G datasheet (AWS's A10G is an A10
    # variant whose tensor throughput differs), so this profile times the A10G with the NVIDIA A10
    # Tensor Core GPU datasheet: FP32 31.2, TF32 62.5, FP16/BF16 125 TFLOPS; 600 GB/s; PCIe Gen4 64 GB/s
    "A10G-24GB": _speeds({"fp32": 31.2, "tf32": 62.5, "bf16": 125, "fp16": 125}, 600, 0, 64,
                         _V100_RUN, "NVIDIA A10 datasheet: the A10's figures (none is published for the A10G)"),
    # NVIDIA L40S datasheet: FP32 91.6, TF32 183, FP16/BF16 362.05, FP8 733 TFLOPS (dense: half the
    # printed sparse figures); 864 GB/s; no NVLink; PCIe Gen4 x16 64 GB/s
    "L40S-48GB": _speeds({"fp32": 91.6, "tf32": 183, "bf16": 362.05, "fp16": 362.05, "fp8": 733}, 864, 0, 64,
                         _V100_RUN, "NVIDIA L40S datasheet"),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM): FP32 19.5, TF32 156, FP16/BF16 312 TFLOPS;
    # 40GB HBM2 1555 GB/s, 80GB HBM2e 2039 GB/s; NVLink 600 GB/s; PCIe Gen4 64 GB/s
    "A100-40GB": _speeds({"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312}, 1555, 600, 64,
                         _A100_GEMM, "NVIDIA A100 datasheet"),
    "A100-80GB": _speeds({"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312}, 2039, 600, 64,
                         _A100_GEMM, "NVIDIA A100 datasheet"),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM): FP32 67, TF32 494.5, BF16/FP16 989.5, FP8 1979 TFLOPS
    # (dense); HBM3 3.35 TB/s; NVLink 900 GB/s; PCIe Gen5 128 GB/s
    "H100-80GB": _speeds({"fp32": 67, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979}, 3350, 900,
                         128, _H100_KERNEL, "NVIDIA H100 datasheet"),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): the H100's compute; HBM3e 4.8 TB/s; NVLink 900 GB/s;
    # PCIe Gen5 128 GB/s
    "H200-141GB": _speeds({"fp32": 67, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979}, 4800, 900,
                          128, _H100_KERNEL, "NVIDIA H200 datasheet"),
}
SPEEDS["2xT4-16GB"] = SPEEDS["T4-16GB"]


def card_speeds(card: "Card | str") -> Speeds:
    """The datasheet figures of a profile (or its name); a card memlab has no figures for is
    bad input, naming the profiles it has."""
    name = card if isinstance(card, str) else card.name
    if name not in SPEEDS:
        raise InputError(f"no throughput figures for card {name!r}; allowed: {', '.join(SPEEDS)}")
    return SPEEDS[name]


def get_card(name: str) -> Card:
    """The profile named ``name`` (``"T4-16GB"``); an unknown name is bad input."""
    if name not in CARDS:
        raise InputError(f"unknown GPU preset {name!r}; allowed: {', '.join(CARDS)}")
    return CARDS[name]


# (pattern in the device name, profile, or (profile <= 48 GiB, profile above)); first match wins
_NAMES = (
    (r"\bT4\b", "T4-16GB"),
    (r"V100", ("V100-16GB", "V100-32GB")),
    (r"RTX 3090", "RTX3090-24GB"),
    (r"RTX 4090", "RTX4090-24GB"),
    (r"\bL4\b", "L4-24GB"),
    (r"A10G", "A10G-24GB"),
    (r"L40S", "L40S-48GB"),
    (r"A100", ("A100-40GB", "A100-80GB")),
    (r"H100", "H100-80GB"),
    (r"H200", "H200-141GB"),
)


def _profile_for(device_name: str, total: int) -> str | None:
    for pattern, names in _NAMES:
        if re.search(pattern, device_name):
            if isinstance(names, str):
                return names
            small, large = (get_card(n) for n in names)
            return small.name if total <= (small.memory + large.memory) // 2 else large.name
    return None


def card_from_properties(props, gpus: int = 1) -> Card:
    """The profile of a device from its properties (``name``, ``total_memory``, ``major``,
    ``minor``, as ``torch.cuda.get_device_properties`` gives them): a known model's profile
    with this device's memory and capability, else one built from the properties."""
    cap = (int(props.major), int(props.minor))
    total = int(props.total_memory)
    known = _profile_for(props.name, total)
    if known is not None:
        base = get_card(known)
        if gpus == 2 and known == "T4-16GB":
            base = get_card("2xT4-16GB")
        return replace(base, memory=total, capability=cap, gpus=gpus, device_name=props.name)
    short = re.sub(r"^(NVIDIA|Tesla)\s+", "", props.name)
    short = re.sub(r"[^A-Za-z0-9]+", "", short) or "GPU"
    prefix = f"{gpus}x" if gpus > 1 else ""
    return Card(f"{prefix}{short}-{round(total / 1e9)}GB", total, cap, gpus, props.name)


def detect_card(props=None, gpus: int | None = None, env: dict[str, str] | None = None) -> Card | None:
    """The card this process runs on, or ``None`` without a CUDA GPU.

    ``props``: device properties to read instead of GPU 0's (tests pass a stand-in); ``gpus``:
    how many devices (default: torch's count, 1 when ``props`` is given). With ``MEMLAB_CARD``
    set to a profile name in ``env`` (default ``os.environ``), that profile is returned marked
    as a rehearsal on the real device; it must not be larger than the device it runs on.
    """
    env = os.environ if env is None else env
    if props is None:
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            return None
        props = torch.cuda.get_device_properties(0)
        gpus = torch.cuda.device_count() if gpus is None else gpus
    real = card_from_properties(props, 1 if gpus is None else gpus)
    asked = env.get(CARD_ENV)
    if not asked:
        return real
    card = get_card(asked)
    if card.memory > real.memory:
        raise InputError(f"{CARD_ENV}={asked!r} has {card.memory / 2**30:.1f} GiB, more than this "
                         f"{props.name} ({real.memory / 2**30:.1f} GiB): a rehearsal can only "
                         f"shrink the card; allowed: a profile of at most that memory")
    if card.gpus > real.gpus:
        raise InputError(f"{CARD_ENV}={asked!r} needs {card.gpus} GPUs and this machine has "
                         f"{real.gpus}; allowed: a single-GPU profile")
    flash = real.capability >= (8, 0) and card.capability >= (8, 0)
    return replace(card, rehearsal=props.name, flash=flash)


__all__ = ["CARD_ENV", "CARDS", "Card", "DTYPES", "RATE_LEDGER", "REFERENCE_CARD", "RateSource",
           "MEASURED_ROWS", "SDPA_KERNELS", "SPEEDS", "Speeds",
           "card_from_properties", "card_speeds",
           "cublas_workspace_bytes", "cublaslt_workspace_bytes", "detect_card", "get_card"]
