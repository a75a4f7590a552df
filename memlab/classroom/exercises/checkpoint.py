"""Lesson 05: checkpoint a block's forward."""
from __future__ import annotations

import torch.nn as nn

from memlab.classroom.exercises.common import (
    CheckResult,
    call_learner,
    fail,
    forward_kept,
    rel_diff,
    require,
    tiny_model,
)
from memlab.core.units import fmt_bytes
from memlab.lenses.estimate import layer_activation_bytes
from memlab.models.gpt_unet import get_config
from memlab.step.training_step import StepConfig, make_batch

CKPT_TOLERANCE = 1e-6  # recomputation repeats the same operations: gradients match to rounding



def check_checkpointed_block(block_cls: type, *, seq: int = 64, batch: int = 2) -> CheckResult:
    """``block_cls(cfg)``: a :class:`memlab.models.gpt_unet.Block` whose forward runs under
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.

    Checked in the tiny GPT (naive attention): gradients equal the plain model's within
    :data:`CKPT_TOLERANCE`; the activations kept fall by at least 90% of what the blocks save
    minus their inputs (``n_layer * (layer_activation_bytes - 4 b s d)``); non-reentrant.
    """
    name = "checkpointed block"
    require(name, "CheckpointedBlock", block_cls,
            "class CheckpointedBlock(ml.models.gpt_unet.Block) whose forward runs under "
            "checkpoint(..., use_reentrant=False)")
    cfg = get_config("tiny", attention="naive")
    data = make_batch(StepConfig(model=cfg, seq=seq, batch=batch))
    ref = tiny_model(attention="naive")
    yours = tiny_model(attention="naive")
    blocks = call_learner(name, f"{getattr(block_cls, '__name__', block_cls)}(cfg)",
                   lambda: nn.ModuleList(block_cls(cfg) for _ in range(cfg.n_layer)))
    yours.blocks = blocks
    try:
        yours.load_state_dict(ref.state_dict())
    except RuntimeError as e:
        fail(name, f"your block's parameters differ from Block's ({str(e).splitlines()[0]}): "
                    f"subclass memlab.models.gpt_unet.Block and override forward only")
    grad_fns = []
    hook = yours.blocks[0].register_forward_hook(
        lambda m, a, out: grad_fns.append(out.grad_fn.name() if out.grad_fn else None))
    ref_loss, ref_kept = forward_kept(ref, data)
    loss, kept = call_learner(name, "the forward with your block", forward_kept, yours, data)
    hook.remove()
    if grad_fns and grad_fns[0] == "CheckpointFunctionBackward":
        fail(name, "this is the reentrant checkpoint (use_reentrant=True or unset): pass "
                    "use_reentrant=False, the variant PyTorch recommends (it works with inputs "
                    "that do not require grad and with keyword arguments)")
    ref_loss.backward()
    call_learner(name, "backward through your block", loss.backward)
    got = [p.grad for p in yours.parameters()]
    if any(g is None for g in got):
        fail(name, "some weights got no gradient: is the block's output computed from the "
                    "checkpointed function's result?")
    diff = rel_diff(got, [p.grad for p in ref.parameters()])
    if diff > CKPT_TOLERANCE:
        fail(name, f"gradients differ from the plain block's by {diff:.1e} (allowed "
                    f"{CKPT_TOLERANCE:g}): the checkpointed function must compute the whole "
                    f"block, x + attn(ln1(x)) then + mlp(ln2(x))")
    inputs = 4 * seq * batch * cfg.d_model
    expected = cfg.n_layer * (layer_activation_bytes(cfg, seq, batch, "fp32") - inputs)
    saved = ref_kept - kept
    if saved < 0.9 * expected:
        fail(name, f"activations kept: {fmt_bytes(kept)} vs {fmt_bytes(ref_kept)} without "
                    f"checkpointing, saved {fmt_bytes(saved)}; each block should keep only its "
                    f"input (b*s*d*4 bytes), saving at least {fmt_bytes(0.9 * expected)}: wrap the "
                    f"whole block forward in checkpoint(...)")
    return CheckResult(name, {"kept_bytes": kept, "plain_kept_bytes": ref_kept,
                              "saved_bytes": saved, "expected_saved_bytes": expected,
                              "max_grad_diff": diff},
                       [f"activations kept {fmt_bytes(ref_kept)} -> {fmt_bytes(kept)}; saved "
                        f"{fmt_bytes(saved)}, formula {fmt_bytes(expected)} "
                        f"(n_layer x (layer - its input))",
                        f"gradients equal the plain block's within {diff:.1e} (allowed {CKPT_TOLERANCE:g})"])


