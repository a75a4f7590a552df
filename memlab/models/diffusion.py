"""A diffusion UNet's memory: where its activations sit by resolution, and what a GPU's
convolutions add that no tensor tracker sees.

memlab's UNet (:class:`~memlab.models.gpt_unet.UNet`, after Ho et al. 2020, "Denoising Diffusion
Probabilistic Models", appendix B) keeps, per resolution level, the output of its encoder
block as a *skip* tensor until the decoder block of the same level concatenates it; self-
attention runs only at the lowest resolution, where an image of side ``H`` has
``(H / 2^(L-1))^2`` tokens instead of ``H^2``.

On a GPU the caching allocator also serves cuDNN's convolution workspaces, which are not
tensors and never pass through the dispatcher. :func:`allocator_gaps` reads the gap
between the tracker and ``torch.cuda.max_memory_allocated`` from the reference rows
recorded on an H200 (``data/reference/NVIDIA-H200/devset.json``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Callable

from memlab.core.errors import InputError
from memlab.models.gpt_unet import UNetConfig
from memlab.tracking.tracker import Event

REFERENCE = ("data", "reference", "NVIDIA-H200", "devset.json")


@dataclass(frozen=True)
class UNetLevel:
    """One resolution level of a UNet (:func:`unet_levels`)."""

    level: int
    """0 at full resolution, one more per halving."""
    side: int
    """The feature map's side in pixels."""
    channels: int
    """The level's channels (``base x mult``)."""
    tokens: int
    """``side ** 2``: the positions self-attention at this level would attend over."""


def unet_levels(cfg: UNetConfig, image: int) -> list[UNetLevel]:
    """Per resolution level: its side in pixels, its channels and its token count (what
    self-attention at that level would attend over)."""
    if isinstance(image, bool) or not isinstance(image, int) or image < 1:
        raise InputError(f"image must be a positive integer side in pixels, got {image!r}")
    if image % 2 ** (len(cfg.mults) - 1):
        raise InputError(f"image {image} is not divisible by {2 ** (len(cfg.mults) - 1)}: "
                         f"the UNet halves it {len(cfg.mults) - 1} times")
    out = []
    for i, m in enumerate(cfg.mults):
        side = image // 2**i
        out.append(UNetLevel(level=i, side=side, channels=cfg.base * m, tokens=side * side))
    return out


def skip_bytes(cfg: UNetConfig, image: int, batch: int, element_bytes: int = 4) -> int:
    """Bytes of the skip tensors (each encoder block's output) that the forward holds until
    the decoder reads them: ``sum_i batch * channels_i * side_i^2 * element_bytes``."""
    return sum(batch * lv.channels * lv.tokens * element_bytes
               for lv in unet_levels(cfg, image))


def attention_score_bytes(tokens: int, batch: int, heads: int = 1, element_bytes: int = 4) -> int:
    """Bytes of the ``tokens x tokens`` attention probabilities a naive (unfused) attention
    keeps for backward: ``batch * heads * tokens^2 * element_bytes``."""
    return batch * heads * tokens * tokens * element_bytes


def unet_module_key(cfg: UNetConfig, image: int) -> Callable[[Event], str]:
    """A labeller for :func:`memlab.techniques.sweeps.activations_by_module`: an op of a UNet module
    (``UNet.down.1.conv2``) is labelled with its part and resolution (``encoder 16px``).

    The UNet's own ops (outside its child modules) are named by what they are and where
    they run, so the key follows the ops in order: before the middle block they build the
    time embedding; after it, each concatenation is the skip concat of the next decoder
    level (deepest first); ``mse_loss`` is the loss and ends the forward.
    """
    sides = [lv.side for lv in unet_levels(cfg, image)]
    last = len(sides) - 1
    state = {"past_middle": False, "concats": 0}

    def child(parts: list[str]) -> str:
        part = parts[1]
        index = int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else None
        if part in ("down", "pool"):
            return f"encoder {sides[index]}px"
        if part in ("up", "upsample"):
            return f"decoder {sides[last - index]}px"
        if part in ("mid", "mid_attn"):
            state["past_middle"] = True
            return f"{'middle' if part == 'mid' else 'attention'} {sides[last]}px"
        return {"time": "time embedding", "inp": f"input conv {image}px",
                "out": f"output head {image}px"}.get(part, "other")

    def key(event: Event) -> str:
        parts = event.module.split(".")
        if parts[0] != "UNet":
            return "other"  # outside the model, e.g. the trainer's loss scaling
        if len(parts) > 1:
            return child(parts)
        if event.op.startswith("mse_loss"):
            state.update(past_middle=False, concats=0)  # the next forward starts afresh
            return "loss"
        if not state["past_middle"]:
            return "time embedding"  # the sinusoid of the timestep
        if event.op.startswith("cat"):
            state["concats"] += 1
        if not 1 <= state["concats"] <= len(sides):
            return "other"
        return f"skip concat {sides[last - state['concats'] + 1]}px"

    return key


@dataclass(frozen=True)
class AllocatorGap:
    """One reference step on a GPU: the tracker's peak against the allocator's.

    ``tracked_at_start`` is what the tracker holds when the step begins (parameters,
    optimizer state and the batch); ``allocated_at_start`` what the allocator held then.
    """

    model: str
    image: int
    batch: int
    precision: str
    tracked_peak: int
    allocator_peak: int
    tracked_at_start: int
    allocated_at_start: int

    @property
    def gap(self) -> int:
        """Bytes the allocator had at its peak that the tracker did not count."""
        return self.allocator_peak - self.tracked_peak

    @property
    def gap_fraction(self) -> float:
        return self.gap / self.allocator_peak

    @property
    def before_step(self) -> int:
        """Untracked bytes already allocated when the step began (library workspaces kept
        from the warm-up step, e.g. cuBLAS's)."""
        return self.allocated_at_start - self.tracked_at_start

    @property
    def during_step(self) -> int:
        """Untracked bytes that appeared during the step: on a conv net, cuDNN's
        convolution workspaces (plus the allocator's 512-byte rounding)."""
        return self.gap - self.before_step


def allocator_gaps(model: str | None = "unet-small") -> list[AllocatorGap]:
    """The reference rows of ``devset.json`` (one H200, torch 2.11) as :class:`AllocatorGap`,
    for one model preset or (``None``) all of them."""
    path = resources.files("memlab").joinpath(*REFERENCE)
    rows = json.loads(path.read_text())["rows"]
    names = {r["config"]["model"] for r in rows}
    if model is not None and model not in names:
        raise InputError(f"no reference rows for model {model!r}; allowed: {', '.join(sorted(names))}")
    out = []
    for r in rows:
        c, m, a = r["config"], r["measure_by_category"], r["allocator"]
        if model is not None and c["model"] != model:
            continue
        out.append(AllocatorGap(c["model"], c["seq"], c["batch"], c["precision"],
                                r["measure_peak_bytes"], a["max_memory_allocated"],
                                m["parameters"] + m["optimizer"] + m["other"],
                                a["memory_allocated_at_start"]))
    return out


__all__ = ["UNetLevel", "unet_levels", "skip_bytes", "attention_score_bytes", "unet_module_key",
           "AllocatorGap", "allocator_gaps"]
