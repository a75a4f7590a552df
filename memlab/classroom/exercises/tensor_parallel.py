"""Lesson 12: a column- and row-parallel Linear pair."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from memlab.classroom.exercises.common import CheckResult, call_learner, fail, require, tiny_model
from memlab.core.errors import InputError
from memlab.core.units import fmt_bytes
from memlab.models.gpt_unet import get_config

TP_TOLERANCE = 1e-5  # the partial sums add in another order


def check_tensor_parallel(make_shards: Callable, tp_forward: Callable, *, t: int = 2) -> CheckResult:
    """``make_shards(fc, out, t)`` returns one ``(column, row)`` pair of Linears per rank;
    ``tp_forward(shards, x)`` computes ``out(gelu(fc(x)))`` from them, adding the ranks' partial
    outputs as the all-reduce would. Checked on the tiny GPT's MLP: output equal within
    :data:`TP_TOLERANCE`; each rank's weights own exactly 1/t of the bytes (not a view of the
    whole matrix)."""
    name = "tensor-parallel MLP"
    require(name, "make_shards", make_shards, "def make_shards(fc, out, t): one (column, row) pair of Linears per rank")
    require(name, "tp_forward", tp_forward, "def tp_forward(shards, x): the MLP from the shards, partial outputs added")
    cfg = get_config("tiny")
    if cfg.hidden % t:
        raise InputError(f"t={t} must divide the MLP width {cfg.hidden}")
    mlp = tiny_model().blocks[0].mlp
    fc, out = mlp.fc, mlp.out
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in mlp.parameters():  # random biases too (GPT-2 initialises them to zero)
            p.copy_(0.05 * torch.randn(p.shape, generator=g))
        x = torch.randn(2, 16, cfg.d_model, generator=g)
        ref = mlp(x)
        shards = call_learner(name, "make_shards", make_shards, fc, out, t)
        if len(shards) != t:
            fail(name, f"make_shards returned {len(shards)} ranks, expected t={t}")
        h, full = cfg.hidden // t, fc.weight.nbytes + out.weight.nbytes
        for r, (col, row) in enumerate(shards):
            if tuple(col.weight.shape) != (h, cfg.d_model) or tuple(row.weight.shape) != (cfg.d_model, h):
                fail(name, f"rank {r}: column weight {tuple(col.weight.shape)}, row weight "
                            f"{tuple(row.weight.shape)}; expected {(h, cfg.d_model)} and "
                            f"{(cfg.d_model, h)}: column-parallel splits fc's output features "
                            f"(rows of its weight), row-parallel out's input features (its columns)")
            for kind, w in (("column", col.weight), ("row", row.weight)):
                if w.untyped_storage().nbytes() != w.nbytes:
                    fail(name, f"rank {r}'s {kind} weight is a view: its storage holds "
                                f"{fmt_bytes(w.untyped_storage().nbytes())}, the whole matrix; "
                                f"copy the slice (.clone()) so a rank owns only its part")
        y = call_learner(name, "tp_forward", tp_forward, shards, x)
        if tuple(y.shape) != tuple(ref.shape):
            fail(name, f"output shape {tuple(y.shape)}, expected {tuple(ref.shape)}: the row-parallel "
                        f"outputs are partial sums to add, not pieces to concatenate")
        diff = (y - ref).abs().max().item() / ref.abs().max().item()
        if diff > TP_TOLERANCE:
            msg = f"output differs from the full MLP by {diff:.1e} (allowed {TP_TOLERANCE:g})"
            if out.bias is not None and (y - (t - 1) * out.bias - ref).abs().max() < 1e-4:
                fail(name, f"{msg}: out's bias was added {t} times; add it once, after the sum")
            hidden = F.gelu(F.linear(x, fc.weight[:h], fc.bias[:h]), approximate="tanh")
            part = F.linear(hidden, out.weight[:, :h])
            if (y - part).abs().max() < 1e-4 or (y - part - out.bias).abs().max() < 1e-4:
                fail(name, f"{msg}: that is rank 0's partial sum; add the {t} ranks' outputs "
                            f"(the all-reduce)")
            fail(name, f"{msg}: each rank computes gelu(x W_col^T + b_col) W_row^T; the sum over "
                        f"ranks plus out's bias is the output (the MLP uses approximate='tanh')")
    sizes = [sum(p.nbytes for p in (col.weight, row.weight)) for col, row in shards]
    return CheckResult(name, {"max_diff": diff, "rank_weight_bytes": max(sizes),
                              "full_weight_bytes": full},
                       [f"output equals the full MLP within {diff:.1e} (allowed {TP_TOLERANCE:g})",
                        f"weights per rank {fmt_bytes(max(sizes))} = 1/{t} of {fmt_bytes(full)}"])


