"""Lesson 04: the autocast + GradScaler step."""
from __future__ import annotations

import math
import warnings
from typing import Callable

import torch
import torch.nn as nn

from memlab.classroom.exercises.common import CheckResult, call_learner, fail, grad_norm, require, tiny_model
from memlab.step.training_step import StepConfig, make_batch
from memlab.techniques.sweeps import relative_error

AMP_TOLERANCE = 1e-3  # relative difference of a weight update against the reference step


def reference_amp_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                       scaler: torch.amp.GradScaler, batch: tuple) -> torch.Tensor:
    """fp16 autocast with loss scaling, as ``torch.amp`` documents it (the checker's reference)."""
    optimizer.zero_grad(set_to_none=True)
    with torch.amp.autocast(batch[0].device.type, dtype=torch.float16):
        loss = model(*batch)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss.detach()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _amp_run(step_fn: Callable, batches: list[tuple], device: torch.device):
    """Two steps, then one whose scaled loss overflows fp16; the weights after each."""
    model = tiny_model(device=device, n_layer=2)  # fp16 matmuls are slow on a CPU: two blocks
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # SGD: a wrong scale shows in the update
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**16)
    snaps = [_params(model)]
    for b in batches:
        step_fn(model, opt, scaler, b)
        snaps.append(_params(model))
    scaler.update(new_scale=2.0**40)  # 2^40 x the loss overflows fp16 in backward: a step to skip
    step_fn(model, opt, scaler, batches[0])
    snaps.append(_params(model))
    return snaps, scaler.get_scale()


def check_amp_step(amp_step: Callable, *, device: str = "cpu") -> CheckResult:
    """``amp_step(model, optimizer, scaler, batch)``: one fp16 mixed-precision training step.

    Checked: no deprecated ``torch.cuda.amp``; the Linear layers compute in fp16; two weight
    updates equal the reference's within :data:`AMP_TOLERANCE` (SGD, so a missing scale or
    unscale shows as a factor 2^16); after an fp16 overflow the step is skipped and the scale
    halved (what ``scaler.step`` and ``scaler.update`` do).
    """
    name = "autocast + GradScaler"
    require(name, "amp_step", amp_step,
            "def amp_step(model, optimizer, scaler, batch): one fp16 autocast step with loss scaling")
    dev = torch.device(device)
    step = StepConfig(model="tiny", seq=16, batch=2)
    batches = [make_batch(step, dev, seed=s) for s in (0, 1)]
    ref, ref_scale = _amp_run(reference_amp_step, batches, dev)
    dtypes: set[torch.dtype] = set()

    def linear_dtype(module, args, out):
        if isinstance(module, nn.Linear):
            dtypes.add(out.dtype)

    hook = torch.nn.modules.module.register_module_forward_hook(linear_dtype)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, scale = _amp_run(lambda *a: call_learner(name, "your step", amp_step, *a), batches, dev)
    finally:
        hook.remove()
    old = [str(w.message) for w in caught if "torch.cuda.amp" in str(w.message)]
    if old:
        fail(name, f"torch.cuda.amp is deprecated ({old[0]}) and, without CUDA, disabled: use "
                    f"torch.amp.autocast(device_type, dtype=torch.float16) and "
                    f"torch.amp.GradScaler(device_type)")
    if torch.float16 not in dtypes:
        seen = ", ".join(sorted(str(d) for d in dtypes)) or "nothing"
        hint = (" bf16 has fp32's exponent range and needs no scaler; this exercise is fp16"
                if torch.bfloat16 in dtypes else "")
        fail(name, f"the Linear layers computed in {seen}: run the forward (it returns the loss) "
                    f"inside torch.amp.autocast(device_type, dtype=torch.float16).{hint}")
    diffs = []
    for k in (1, 2):
        upd = [a - b for a, b in zip(got[k], got[k - 1], strict=True)]
        ref_upd = [a - b for a, b in zip(ref[k], ref[k - 1], strict=True)]
        ratio = grad_norm(upd) / grad_norm(ref_upd)
        diff = relative_error(upd, ref_upd)
        diffs.append(diff)
        if diff <= AMP_TOLERANCE:
            continue
        msg = f"weight update {k} differs from the reference by {diff:.1e} (allowed {AMP_TOLERANCE:g})"
        if ratio == 0:
            fail(name, f"{msg}: the weights did not move; call scaler.step(optimizer)")
        if abs(math.log2(ratio) - 16) < 0.5:
            fail(name, f"{msg}: it is 2^16 times too large, the gradients were still scaled; "
                        f"scaler.step(optimizer) unscales them before stepping")
        if abs(math.log2(ratio) + 16) < 0.5:
            fail(name, f"{msg}: it is 2^16 times too small; backpropagate scaler.scale(loss), "
                        f"since scaler.step divides by the scale")
        if k == 2:
            fail(name, f"{msg}, the first one matched: zero the gradients once per step "
                        f"(optimizer.zero_grad(set_to_none=True))")
        fail(name, f"{msg} (update x{ratio:.3g})")
    moved = max((a - b).abs().max().item() for a, b in zip(got[3], got[2], strict=True))
    if not math.isfinite(moved) or moved > 0:
        fail(name, f"after an fp16 overflow (inf gradients) your step still changed the weights "
                    f"(by {moved}): scaler.step(optimizer) skips such a step, optimizer.step() does not")
    if scale != ref_scale:
        fail(name, f"after an overflow the loss scale is {scale:g}, expected {ref_scale:g}: "
                    f"call scaler.update() after scaler.step(optimizer) (it halves the scale on overflow)")
    return CheckResult(name, {"update_diff_1": diffs[0], "update_diff_2": diffs[1],
                              "scale_after_overflow": scale},
                       [f"Linear layers in fp16; weight updates match the reference within "
                        f"{max(diffs):.1e} (allowed {AMP_TOLERANCE:g})",
                        f"overflow: step skipped, scale 2^40 -> 2^{math.log2(scale):g}"])


