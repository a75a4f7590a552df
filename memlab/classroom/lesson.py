"""One call at the top of each notebook: the device, the precision and the sizes of a lesson.

``L = memlab.classroom.lesson.setup("04")`` looks at the machine (:func:`memlab.core.cards.detect_card`) and
returns a :class:`Lesson`: the device (``"cuda"`` or ``"cpu"``), the card, the 16-bit
precision the card runs natively (``bf16`` from sm80, else ``fp16`` with a ``GradScaler``),
and the sizes of the lesson's steps. It prints one line: card, memory, precision, sizes.

On CPU the sizes are the lesson's CPU sizes (the tiny GPT, seconds a step). On a GPU each
lesson lists its GPU steps as a function of its sizes (:data:`LESSONS`), and :func:`setup`
takes the largest sizes on the lesson's ladder for which *every* GPU step passes the
measure guard on this card (:func:`memlab.lenses.guard.cuda_need`, the rule in ``docs/guard.md``,
with the card's own estimate: its kernels and cuBLAS workspace) within the card's memory
less :data:`CONTEXT_BYTES` for the CUDA context. So a 16 GB T4 gets GPT-2 small at shorter
sequences or smaller batches than an H200, and no cell is refused.

``MEMLAB_CARD=T4-16GB`` rehearses a smaller card on a larger GPU: the sizes are the smaller
card's, the process's memory is capped to it (``set_per_process_memory_fraction``) and
FlashAttention is switched off where the rehearsed card lacks it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from memlab.core.cards import Card, detect_card
from memlab.core.hardware import resolve_budget
from memlab.core.units import MiB, fmt_bytes
from memlab.lenses.guard import MARGIN, PROCESS_BYTES, cuda_need
from memlab.models.gpt_unet import tiny_llama
from memlab.policy import get_target
from memlab.step.training_step import StepConfig

# The CUDA context, cuBLAS/cuDNN handles and the kernels' code take this much of a card's
# memory before the first tensor (a T4's 15360 MiB shows about 14.5 GiB free after torch
# starts: the measurement; 300-500 MiB on larger cards).
CONTEXT_BYTES = 768 * MiB

CPU_BASE = StepConfig(model="tiny", seq=128, batch=4)
# GPT-2 small steps from the largest a lesson's GPU branch was written for (H200) down
GPU_BASES = tuple(StepConfig(model="gpt2-small", seq=s, batch=b)
                  for s, b in ((1024, 4), (1024, 2), (512, 4), (512, 2), (256, 2)))


@dataclass(frozen=True)
class GpuStep:
    """One step a lesson runs on the GPU: what it is, and the budget it runs under."""

    label: str
    step: StepConfig
    budget: int | None = None


@dataclass(frozen=True)
class LessonPlan:
    """A lesson's sizes: ``cpu(base)`` gives the CPU sizes; ``ladder(card, precision)`` the
    candidate GPU sizes, largest first; ``steps(sizes, precision)`` the GPU steps they run."""

    cpu: Callable[[StepConfig], dict]
    ladder: Callable[[Card, str], list[dict]]
    steps: Callable[[dict, str], list[GpuStep]]


def _bases(extra: Callable[[StepConfig], list[dict]] | None = None
           ) -> Callable[[Card, str], list[dict]]:
    """A ladder over :data:`GPU_BASES`, each base with the variants ``extra`` gives (or none)."""
    def ladder(card: Card, precision: str) -> list[dict]:
        out = []
        for base in GPU_BASES:
            out += [{"base": base, **v} for v in (extra(base) if extra else [{}])]
        return out
    return ladder


def _base_only(sizes: dict, precision: str) -> list[GpuStep]:
    return [GpuStep("base step", sizes["base"])]


# ---- the lessons' GPU steps, read from each notebook's GPU branches --------------------
def _steps_01(z: dict, p: str) -> list[GpuStep]:
    b = z["base"]
    return [GpuStep("base step (and its snapshot)", b),
            GpuStep("naive attention, longest seq, batch 1", replace(b, batch=1, attention="naive",
                                                                     seq=max(z["seqs"]))),
            GpuStep("largest batch", replace(b, batch=max(z["batches"])))]


def _steps_02(z: dict, p: str) -> list[GpuStep]:
    return [GpuStep("the OOM step under its budget", z["step"], resolve_budget(z["budget"]))]


def _steps_04(z: dict, p: str) -> list[GpuStep]:
    b = z["base"]
    return [GpuStep(f"{prec} at batch {max(z['batches'])}", replace(b, precision=prec, batch=max(z["batches"])))
            for prec in z["precisions"]]


def _steps_05(z: dict, p: str) -> list[GpuStep]:
    out = [GpuStep(f"naive attention, checkpointing {c}", replace(z["step"], checkpointing=c))
           for c in ("none", "selective", "full")]
    big = replace(z["base"], batch=max(z["batches"]), attention="sdpa")
    return out + [GpuStep(f"sdpa batch {big.batch}, checkpointing {c}", replace(big, checkpointing=c))
                  for c in ("none", "full")]


def _steps_06(z: dict, p: str) -> list[GpuStep]:
    s = z["step"]
    return [GpuStep("one big batch", s), GpuStep(f"{z['k']} micro-batches", replace(s, micro_batches=z["k"])),
            GpuStep("batch search under its budget", replace(z["search_step"], batch=4 * s.batch),
                    resolve_budget(z["budget"]))]


def _steps_11(z: dict, p: str) -> list[GpuStep]:
    # DeepSpeed's ZeRO-2 without offload on one GPU keeps 16-bit weights and gradients, the fp32
    # master and Adam's moments on the device: the plain step's 16 B/param plus its activations
    return [GpuStep("ZeRO-2 without offload (the device's largest case)", z["step"]),
            GpuStep("save_on_cpu step", z["small"])]


# Lesson 11's DeepSpeed step, largest first: (model, seq, batch, index of its save_on_cpu step
# in GPU_BASES). gpt2-large is zero_offload_one_gpu.json's step on the H200.
_OFFLOAD_11 = (("gpt2-large", 1024, 4, 0), ("gpt2-medium", 1024, 4, 0), ("gpt2-medium", 1024, 2, 1),
               ("gpt2-medium", 512, 2, 2), ("gpt2-small", 512, 2, 4))


def _ladder_11(card: Card, precision: str) -> list[dict]:
    """bf16 where the card has it; elsewhere fp32, since DeepSpeed's fp16 needs loss scaling
    that this lesson (about where the bytes live) does not teach."""
    ds = "bf16" if card.bf16_native else "fp32"
    return [{"base": GPU_BASES[i], "small": GPU_BASES[i],
             "step": StepConfig(model=m, seq=s, batch=n, precision=ds)} for m, s, n, i in _OFFLOAD_11]


def _steps_14(z: dict, p: str) -> list[GpuStep]:
    r = z["real"]
    return [GpuStep("the plan's step under the card budget",
                    StepConfig(model=r["model"], seq=r["seq"], batch=r["batch"]), resolve_budget(r["gpu"]))]


def _steps_16(z: dict, p: str) -> list[GpuStep]:
    return [GpuStep("plain loss, vocabulary 128256", StepConfig(model=tiny_llama(128256), seq=z["seq"],
                                                                batch=z["batch"]))]


def _steps_17(z: dict, p: str) -> list[GpuStep]:
    return [GpuStep("UNet step", z["step"])]


def _precisions(card: Card) -> list[str]:
    """Lesson 04's precisions on a card: fp32, its native 16-bit autocast, and pure bf16 where
    bf16 is native (an emulated bf16 step teaches nothing about memory it would not on fp16)."""
    return ["fp32", "bf16", "pure-bf16"] if card.bf16_native else ["fp32", "fp16"]


def _real_14(card: Card, precision: str) -> list[dict]:
    """Lesson 14 measures the plan under a card budget: the T4's when this card can hold the
    guard's margin over it, else the largest budget it can (so the plan still has work)."""
    usable = card.memory - CONTEXT_BYTES
    t4 = 15360 * MiB
    room = int((usable - PROCESS_BYTES) / MARGIN["cuda"]) // (256 * MiB) * 256 * MiB
    gpu = "T4-16GB" if room >= t4 else f"{room // MiB}MiB"
    return [{"real": dict(model="gpt2-small", gpu=gpu, seq=1024, batch=16)}]


LESSONS: dict[str, LessonPlan] = {
    "00": LessonPlan(lambda b: {"base": b}, _bases(), _base_only),
    "01": LessonPlan(lambda b: {"base": b, "seqs": [64, 128, 256, 512], "batches": [1, 2, 4]},
                     _bases(lambda b: [{"seqs": [b.seq // 8, b.seq // 4, b.seq // 2, b.seq],
                                        "batches": [1, 2, b.batch]}]),
                     _steps_01),
    "02": LessonPlan(lambda b: {"base": b, "step": replace(b, seq=2 * b.seq, batch=2 * b.batch),
                                "budget": "120MiB"},
                     _bases(lambda b: [{"step": replace(b, batch=8), "budget": "6GiB"}]), _steps_02),
    "04": LessonPlan(lambda b: {"base": b, "batches": [1, 8],
                                "precisions": ["fp32", "bf16", "pure-bf16"]},
                     lambda card, p: [{**z, "precisions": _precisions(card)} for z in
                                      _bases(lambda b: [{"batches": [1, n]} for n in (8, 4, 2)])(card, p)],
                     _steps_04),
    "05": LessonPlan(lambda b: {"base": b, "batches": [1, 4, 16],
                                "step": replace(b, seq=2 * b.seq, batch=b.batch // 2, attention="naive")},
                     _bases(lambda b: [{"step": replace(b, batch=max(1, b.batch // 2), attention="naive"),
                                        "batches": bs} for bs in ([1, 4, 16], [1, 4, 8], [1, 2, 4])]),
                     _steps_05),
    "06": LessonPlan(lambda b: {"base": b, "step": replace(b, seq=b.seq // 2, batch=8), "k": 4,
                                "budget": "80MiB", "search_step": replace(b, seq=b.seq // 2), "tokens": 1024},
                     _bases(lambda b: [{"step": replace(b, seq=b.seq // 2, batch=n), "k": 4,
                                        "budget": "8GiB", "search_step": replace(b, seq=b.seq // 2),
                                        "tokens": 4096} for n in (8, 4)]),
                     _steps_06),
    "11": LessonPlan(lambda b: {"base": b, "small": b, "step": b}, _ladder_11, _steps_11),
    "14": LessonPlan(lambda b: {"base": b, "real": dict(model="tiny", gpu="150MiB", seq=256, batch=8)},
                     lambda card, p: [{"base": GPU_BASES[0], **r} for r in _real_14(card, p)], _steps_14),
    "16": LessonPlan(lambda b: {"base": b, "seq": 256, "batch": 2},
                     lambda card, p: [{"base": GPU_BASES[0], "seq": 1024, "batch": n} for n in (4, 2, 1)],
                     _steps_16),
    "17": LessonPlan(lambda b: {"base": b, "step": StepConfig(model="unet-small", seq=32, batch=4)},
                     lambda card, p: [{"base": GPU_BASES[0],
                                       "step": StepConfig(model="unet-small", seq=64, batch=n)} for n in (8, 4)],
                     _steps_17),
}


def _steps_07(z: dict, p: str) -> list[GpuStep]:
    """The largest of lesson 07's fp32 steps: the 128k vocabulary (its base), plain and chunked
    loss (the 32k, GQA and timed batch-1 steps are smaller)."""
    b = z["base"]
    return [GpuStep("plain loss, vocabulary 128256", b),
            GpuStep("chunked loss, vocabulary 128256", replace(b, model=tiny_llama(128256, loss="chunked")))]


def _step_07(seq: int, batch: int) -> StepConfig:
    """Lesson 07's base: its ``tiny`` (:func:`memlab.models.gpt_unet.tiny_llama`) at vocabulary 128256."""
    return StepConfig(model=tiny_llama(128256), seq=seq, batch=batch)


def _rank_steps(z: dict, p: str) -> list[GpuStep]:
    """One rank's step (the tiny GPT at the lesson's per-rank sizes, its base) where the ranks
    run on GPUs; none where they run on the CPU (:func:`memlab.core.hardware.place_ranks`)."""
    return [] if z["ranks"] == "cpu" else [GpuStep("one rank's step", z["base"])]


def _no_gpu_steps(z: dict, p: str) -> list[GpuStep]:
    return []


#: A lesson with no GPU step to size: the CPU base everywhere.
NO_GPU_STEPS = LessonPlan(lambda b: {"base": b}, lambda card, p: [{"base": CPU_BASE}], _no_gpu_steps)


def _ranks(cpu: tuple[int, int], gpu: tuple[int, int], world_size: int = 2) -> LessonPlan:
    """A rank lesson: the tiny GPT per rank at ``cpu`` (seq, batch) where its ranks run on the
    CPU (no GPU, or fewer GPUs than ranks: gloo), at ``gpu`` where each rank has its own GPU
    (NCCL, ``card.gpus >= world_size``); ``ranks`` says which."""
    def sizes(seq_batch: tuple[int, int], where: str) -> dict:
        return {"base": StepConfig(model="tiny", seq=seq_batch[0], batch=seq_batch[1]), "ranks": where}
    return LessonPlan(lambda b: sizes(cpu, "cpu"),
                      lambda card, p: [sizes(gpu, "cuda") if card.gpus >= world_size else sizes(cpu, "cpu")],
                      _rank_steps)


# Lessons measured with the exact CPU tracker on any machine (08, 15), 03's small models, and
# the rank lessons whose ranks run the tiny GPT at their own sizes (09, 10, 12, 13).
LESSONS.update({
    "07": LessonPlan(lambda b: {"base": _step_07(256, 2)},
                     lambda card, p: [{"base": _step_07(s, n)} for s, n in ((1024, 4), (1024, 2), (1024, 1), (512, 1))],
                     _steps_07),
    "08": NO_GPU_STEPS,
    "03": NO_GPU_STEPS,   # its GPU cells run a 4-layer Llama of its own (about 100 MiB) on any card
    "15": LessonPlan(lambda b: {"base": replace(b, seq=256)},
                     lambda card, p: [{"base": replace(CPU_BASE, seq=256)}], _no_gpu_steps),
    "09": _ranks((64, 2), (64, 2)),       # a primer: the same sizes on GPUs
    "10": _ranks((128, 4), (512, 8)),
    "12": _ranks((128, 8), (1024, 8)),
    "13": _ranks((128, 8), (512, 8)),     # the pipeline's (seq, batch); micro-batches 1-8 of it
})
DEFAULT = LessonPlan(lambda b: {"base": b}, _bases(), _base_only)


@dataclass
class Lesson:
    """What :func:`setup` chose for a lesson on this machine."""

    lesson: str
    device: str
    card: Card | None
    precision: str            # the 16-bit mixed precision to use: "bf16" or "fp16"
    sizes: dict
    steps: list[GpuStep] = field(default_factory=list)   # the GPU steps checked (none on CPU)
    needs: list[int] = field(default_factory=list)       # the guard's need of each, bytes

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def base(self) -> StepConfig:
        return self.sizes["base"]

    @property
    def scaler(self) -> bool:
        """Whether a ``GradScaler`` is needed (fp16: gradients underflow without one)."""
        return self.precision == "fp16"

    @property
    def bf16_native(self) -> bool:
        """bf16 in hardware (always true for the CPU's autocast, which lessons run in bf16)."""
        return self.card is None or self.card.bf16_native

    def __getitem__(self, name: str):
        return self.sizes[name]

    def line(self) -> str:
        """One line: card, memory, precision, sizes."""
        b = self.base
        where = self.card.describe() if self.card else "CPU (no CUDA GPU)"
        extra = ", ".join(f"{k} {_short(v)}" for k, v in self.sizes.items() if k != "base")
        fit = (f"; largest GPU step needs {fmt_bytes(max(self.needs))} with the guard's margin"
               if self.needs else "")
        return (f"lesson {self.lesson} on {where}; precision {self.precision}"
                f"{' + GradScaler' if self.scaler else ''}; base {b.model_config.name} seq {b.seq} "
                f"batch {b.batch}" + (f"; {extra}" if extra else "") + fit)


def _short(v) -> str:
    if isinstance(v, StepConfig):
        return f"{v.model_config.name}/s{v.seq}/b{v.batch}" + ("" if v.precision == "fp32" else f"/{v.precision}")
    if isinstance(v, int) and v >= MiB:
        return fmt_bytes(v)
    return str(v)


def plan(lesson: str, card: Card | None) -> Lesson:
    """The sizes of ``lesson`` for ``card`` (``None``: the CPU), without touching a device:
    the first sizes on the lesson's ladder whose every GPU step fits the card under the
    guard, else the smallest (each step then says what it needs in :attr:`Lesson.needs`)."""
    lp = LESSONS.get(lesson, DEFAULT)
    if card is None:
        return Lesson(lesson, "cpu", None, "bf16", lp.cpu(CPU_BASE))
    precision = card.precision
    target = get_target("cuda", card=card)
    usable = card.memory - CONTEXT_BYTES
    ladder = lp.ladder(card, precision)
    for sizes in ladder:
        steps = lp.steps(sizes, precision)
        needs = [cuda_need(s.step, target, s.budget) for s in steps]
        if max(needs, default=0) <= usable:
            break
    return Lesson(lesson, "cuda", card, precision, sizes, steps, needs)


def rehearse(card: Card) -> None:
    """Make this GPU behave like ``card`` (a rehearsal, :data:`memlab.core.cards.CARD_ENV`): its
    memory as this process's cap, FlashAttention off where the card has none."""
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, card.memory / total), 0)
    if not card.flash or tuple(card.capability) < (8, 0):
        torch.backends.cuda.enable_flash_sdp(False)


def setup(lesson: str, *, card: Card | None = None, quiet: bool = False) -> Lesson:
    """Choose device, precision and sizes for ``lesson`` (``"04"``) on this machine; print one
    line. ``card`` overrides detection (tests, or planning for another card)."""
    detected = card is None
    card = detect_card() if detected else card
    chosen = plan(lesson, card)
    if detected and card is not None and card.rehearsal:
        rehearse(card)
    if not quiet:
        print(chosen.line())
    return chosen


__all__ = ["CONTEXT_BYTES", "CPU_BASE", "GPU_BASES", "GpuStep", "LESSONS", "Lesson", "LessonPlan",
           "plan", "rehearse", "setup"]
