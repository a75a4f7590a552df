"""Lesson 08: a saved_tensors_hooks pack/unpack pair."""
from __future__ import annotations

from typing import Callable

import torch

from memlab.classroom.exercises.common import CheckResult, call_learner, fail, forward_kept, require, tiny_model
from memlab.core.units import fmt_bytes
from memlab.lenses.estimate import layer_activation_bytes
from memlab.models.gpt_unet import GPT, get_config
from memlab.step.training_step import StepConfig, make_batch
from memlab.techniques.sweeps import relative_error

PACK_TOLERANCE = 1e-2  # relative gradient error allowed for 16-bit saved activations


def _hooked_forward(model: GPT, batch: tuple, hooks: tuple | None) -> tuple[torch.Tensor, int]:
    """Forward with ``hooks`` active inside the blocks only; the activations it kept."""
    handles = []
    if hooks is not None:
        ctx = torch.autograd.graph.saved_tensors_hooks(*hooks)
        for block in model.blocks:
            handles.append(block.register_forward_pre_hook(lambda m, a: ctx.__enter__()))
            handles.append(block.register_forward_hook(lambda m, a, o: ctx.__exit__(None, None, None)))
    try:
        return forward_kept(model, batch)
    finally:
        for h in handles:
            h.remove()


def check_pack_hooks(make_hooks: Callable, *, seq: int = 64, batch: int = 2) -> CheckResult:
    """``make_hooks(model)`` returns ``(pack, unpack)`` for
    ``torch.autograd.graph.saved_tensors_hooks`` that keep fp32 activations in 16 bits.

    Checked on the tiny GPT with the hooks active inside the blocks: unpack gives back the
    saved dtype and shape; the blocks' activations shrink by at least 40% of the formula
    (``n_layer * layer_activation_bytes``; 16 bits would save 50%); the gradient error against
    the unhooked model is at most :data:`PACK_TOLERANCE`.
    """
    name = "pack/unpack hooks"
    require(name, "make_hooks", make_hooks,
            "def make_hooks(model) returning (pack, unpack) that keep activations in bf16")
    cfg = get_config("tiny")
    data = make_batch(StepConfig(model=cfg, seq=seq, batch=batch))
    ref, model = tiny_model(), tiny_model()
    pack, unpack = call_learner(name, "make_hooks", make_hooks, model)
    probe = torch.randn(4, 64)
    back = call_learner(name, "unpack(pack(t))", lambda: unpack(pack(probe)))
    if not isinstance(back, torch.Tensor) or back.dtype != probe.dtype or back.shape != probe.shape:
        what = f"{back.dtype} {tuple(back.shape)}" if isinstance(back, torch.Tensor) else type(back).__name__
        fail(name, f"unpack(pack(t)) gave {what} for a float32 {tuple(probe.shape)} tensor: "
                    f"backward needs the dtype and shape that forward saved; cast back with .to(dtype)")
    ref_loss, ref_kept = _hooked_forward(ref, data, None)
    loss, kept = call_learner(name, "the forward with your hooks", _hooked_forward, model, data, (pack, unpack))
    ref_loss.backward()
    call_learner(name, "backward with your hooks", loss.backward)
    got, want = [p.grad for p in model.parameters()], [p.grad for p in ref.parameters()]
    if any(g is None for g in got):
        fail(name, "some weights got no gradient with your hooks")
    err = relative_error(got, want)
    blocks = cfg.n_layer * layer_activation_bytes(cfg, seq, batch, "fp32")
    saved = ref_kept - kept
    if saved < 0.4 * blocks:
        hint = (" (the weights a Linear saves were copied too: return parameters unchanged)"
                if saved < 0 else "")
        fail(name, f"activations kept {fmt_bytes(ref_kept)} -> {fmt_bytes(kept)}, saved "
                    f"{fmt_bytes(saved)}; 16-bit copies of the blocks' {fmt_bytes(blocks)} should "
                    f"save at least {fmt_bytes(0.4 * blocks)}{hint}")
    if not err <= PACK_TOLERANCE:
        fail(name, f"relative gradient error {err:.1e} (allowed {PACK_TOLERANCE:g}): unpack must "
                    f"rebuild the saved values, in their dtype")
    return CheckResult(name, {"kept_bytes": kept, "plain_kept_bytes": ref_kept, "saved_bytes": saved,
                              "block_activation_bytes": blocks, "grad_error": err},
                       [f"activations kept {fmt_bytes(ref_kept)} -> {fmt_bytes(kept)} (saved "
                        f"{saved / blocks:.0%} of the blocks' {fmt_bytes(blocks)})",
                        f"relative gradient error {err:.1e} (allowed {PACK_TOLERANCE:g})"])
