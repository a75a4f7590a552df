"""Formulas of tensor and pipeline parallelism: the pipeline bubble and the activations a
tensor-parallel layer keeps (Korthikanti et al. 2022, section 4.2.1)."""
from __future__ import annotations

from ..errors import InputError
from ..models import GPTConfig

SCHEDULES = ("gpipe", "1f1b")


def bubble_fraction(p: int, m: int) -> float:
    """Idle share of each stage's time in a GPipe/1F1B step: ``(p - 1) / (m + p - 1)``."""
    for name, v in (("p", p), ("m", m)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"{name} must be a positive integer, got {v!r}")
    return (p - 1) / (m + p - 1)


def tp_activation_bytes(cfg: GPTConfig, seq: int, batch: int, t: int = 1) -> dict[str, float]:
    """Activation bytes one transformer layer keeps for backward on each of ``t`` TP ranks.

    Korthikanti et al. 2022 (section 4.2.1) give ``sbh(10 + 24/t + 5as/(ht))`` for fp16 with
    dropout. memlab's block is fp32 (4 bytes, not 2) and has no dropout, so:

    - replicated, ``16 sbh``: the inputs of both LayerNorms and of ``qkv`` and ``fc``
      (their ``10`` less the two dropout masks, ``8``, doubled for fp32), plus the two
      LayerNorms' saved mean and 1/std, ``16 sb`` (the paper drops such small terms);
    - sharded, ``48 sbh / t``: q, k, v (12), the attention output that ``proj`` reads (4),
      the GELU input and output (16 + 16) - their ``24``, doubled;
    - the attention core, ``/ t``: with ``attention="naive"`` the softmax output
      ``4 a s^2 b`` (no dropout mask or dropout output: their ``5`` becomes ``4``), plus
      the boolean causal mask, ``s^2`` bytes, on every rank; with fused SDPA only its
      log-sum-exp, ``4 a s b``.
    """
    if cfg.mlp != "gelu" or cfg.hidden != 4 * cfg.d_model:
        raise InputError("the formula covers the GPT-2 block (gelu MLP, hidden 4*d_model); "
                         f"got mlp={cfg.mlp!r}, hidden={cfg.hidden}")
    s, b, h, a = seq, batch, cfg.d_model, cfg.n_head
    core = 4 * a * s * s * b if cfg.attention == "naive" else 4 * a * s * b
    mask = s * s if cfg.attention == "naive" else 0
    replicated = 16 * s * b * h + 16 * s * b + mask
    sharded, core = 48 * s * b * h / t, core / t
    return {"replicated": replicated, "sharded": sharded, "attention_core": core,
            "total": replicated + sharded + core}


def pipeline_schedule(p: int, m: int, schedule: str = "gpipe", *, forward: int = 1,
                      backward: int = 1) -> list[list[tuple[str, int, int, int]]]:
    """The ideal schedule of one pipeline step: per stage, its ``(kind, micro-batch, start,
    end)`` events in time slots, where a forward takes ``forward`` slots and a backward
    ``backward`` on every stage (no communication time).

    GPipe (Huang et al. 2019, section 2.2) runs every stage's ``m`` forwards, then its ``m``
    backwards. 1F1B (PipeDream-Flush, Narayanan et al. 2021, section 2.2) lets stage ``s``
    run ``p - s - 1`` warm-up forwards and then alternate one forward and one backward, so
    it holds at most ``p - s`` micro-batches. Each op starts when its stage is free and its
    input is there: a forward needs the previous stage's forward of the same micro-batch, a
    backward the next stage's backward (the last stage: its own forward). Both schedules
    end after ``(m + p - 1)(forward + backward)`` slots, an idle share of
    :func:`bubble_fraction` on every stage.
    """
    bubble_fraction(p, m)  # validates p and m
    if schedule not in SCHEDULES:
        raise InputError(f"schedule={schedule!r}; allowed: {', '.join(SCHEDULES)}")
    for name, v in (("forward", forward), ("backward", backward)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"{name} must be a positive integer number of slots, got {v!r}")
    orders = []
    for s in range(p):
        if schedule == "gpipe":
            order = [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
        else:
            warm = min(p - s - 1, m)
            order = [("F", j) for j in range(warm)]
            for k in range(m - warm):
                order += [("F", warm + k), ("B", k)]
            order += [("B", j) for j in range(m - warm, m)]
        orders.append(order)
    end: dict[tuple[str, int, int], int] = {}  # (kind, stage, micro-batch) -> end slot
    free, nxt = [0] * p, [0] * p
    events: list[list[tuple[str, int, int, int]]] = [[] for _ in range(p)]
    while any(nxt[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if nxt[s] == len(orders[s]):
                continue
            kind, j = orders[s][nxt[s]]
            dep = (("F", s - 1, j) if s > 0 else None) if kind == "F" else \
                  (("B", s + 1, j) if s < p - 1 else ("F", s, j))
            if dep is not None and dep not in end:
                continue  # its input is not computed yet: another stage goes first
            start = max(free[s], end.get(dep, 0))
            stop = start + (forward if kind == "F" else backward)
            end[(kind, s, j)] = free[s] = stop
            events[s].append((kind, j, start, stop))
            nxt[s] += 1
            progressed = True
        if not progressed:  # cannot happen for the two orders above; guards a future edit
            raise RuntimeError(f"{schedule} schedule deadlocked at p={p}, m={m}")
    return events
