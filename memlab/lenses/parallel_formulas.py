"""Formulas of tensor and pipeline parallelism: the pipeline bubble, the pipeline schedule,
and the activations a tensor-parallel layer keeps, read from the estimate's one per-layer
count (:func:`memlab.lenses.estimate.layer_activation_parts`) (Korthikanti et
al. 2022, section 4.2.1)."""
from __future__ import annotations

from memlab.core.errors import InputError
from memlab.lenses.estimate import layer_activation_parts
from memlab.models.gpt_unet import GPTConfig

SCHEDULES = ("gpipe", "1f1b")


def bubble_fraction(p: int, m: int) -> float:
    """The bubble as a share of the step's total time, ``(p - 1) / (m + p - 1)``: each stage
    idles ``p - 1`` of the ``m + p - 1`` micro-batch slots of a GPipe or 1F1B step (GPipe's
    form, Huang et al. 2019, sec. 2.3). Narayanan et al. 2021 (sec. 2.2.1) divide the same idle
    time by the ideal compute time instead, ``(p - 1) / m``; the two agree when ``m >> p``."""
    for name, v in (("p", p), ("m", m)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"{name} must be a positive integer, got {v!r}")
    return (p - 1) / (m + p - 1)


def tp_activation_bytes(cfg: GPTConfig, seq: int, batch: int, tensor_parallel: int = 1, *,
                        target: str = "cpu") -> dict[str, float]:
    """Activation bytes one transformer layer keeps for backward on each of ``t`` TP ranks
    (fp32, the precision the tensor-parallel runs use).

    Korthikanti et al. 2022 (section 4.2.1) give ``sbh(10 + 24/t + 5as/(ht))`` for the GPT
    block in fp16 with dropout. memlab's blocks are fp32 (4 bytes, not 2) with no dropout,
    and the count is tensor by tensor, so it also covers LLaMA-style blocks:

    - replicated, per norm: its input (the residual stream) and output, ``8 sbh``, plus
      LayerNorm's mean and 1/std (``8 sb``) or RMSNorm's ``x / rms`` and ``1/rms``
      (``4 sbh + 4 sb``). For the GPT-2 block that is ``16 sbh + 16 sb`` in all: the
      paper's ``10`` less the two dropout masks, doubled for fp32.
    - sharded: what attention saves of q, k and v (below), the attention output that
      ``proj`` reads (``4 sbh / t``), and the MLP's hidden tensors: GELU its input and
      output (``2 x 4 sbf / t``), SwiGLU the gate, SiLU, up and product (``4 x 4 sbf / t``).
      For the GPT-2 block (``f = 4h``, MHA, no rotary) that is ``48 sbh / t``, the paper's
      ``24``, doubled.
    - q, k, v (counted by :func:`memlab.lenses.estimate.attention_saved_elements`) under SDPA:
      with learned positions q, k and v are views of the ``qkv`` output, so the whole
      output stays alive (``4 s b (a_r + 2 g_r) d_head`` for ``a_r``
      query and ``g_r`` key/value heads per rank). Rotary positions make new q and k;
      grouped heads with ``gqa="repeat"`` make new k and v of ``a_r`` heads each (then
      nothing keeps the ``qkv`` output). With replicated key/value heads
      (``t > n_kv_head``) the kept ``qkv`` output is the all-gathered one,
      ``4 s b (a + 2 g) d_head``. Naive attention's matmuls fold batch and heads into one
      dimension; unless one of them is 1 a view cannot be folded, and they save contiguous
      copies of q, k and v instead (``4 s b d_head`` times ``a_r + 2 g_r``, or ``3 a_r``
      when k and v are repeated).
    - the attention core: with ``attention="naive"`` the softmax output ``4 a_r s^2 b``
      (no dropout: the paper's ``5`` becomes ``4``) and the boolean causal mask, ``s^2``
      bytes on every rank; with fused SDPA only its log-sum-exp, ``4 a_r s b``.
    """
    cfg.check_tensor_parallel(tensor_parallel)
    parts = layer_activation_parts(cfg, seq, batch, "fp32", target, tensor_parallel)
    return {**parts, "total": sum(parts.values())}


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
