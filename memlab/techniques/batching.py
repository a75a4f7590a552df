"""Dynamic batching for variable-length text: token budgets, length buckets and packing.

Lesson 06's max-batch search answers "how many samples of length ``L`` fit"; real data has
lengths that vary tenfold. Activation memory follows the *padded slots* of a batch (rows x
padded length), so a batch is bounded by a **token budget** on its slots, and the question
becomes how many of those slots carry real tokens. Three ways to fill them:

``fixed``     ``budget // max_len`` samples per batch in data order, each padded to
              ``max_len``: one shape, the most padding.
``bucketed``  samples sorted into length buckets; a batch takes as many samples of one
              bucket as fit the budget at its longest sample, padded to that (the
              ``bucket_by_sequence_length`` of tf.data, fairseq's ``max_tokens`` batches).
``packed``    samples placed first-fit-decreasing into rows of ``max_len`` tokens, rows
              grouped ``budget // max_len`` to a batch: almost no padding. Positions
              restart at every sample and a block-diagonal causal mask keeps samples from
              attending to each other (Krell et al. 2021, "Efficient Sequence Packing
              without Cross-contamination", arXiv:2107.02027, whose abstract finds up to
              50% padding in common NLP datasets); :attr:`Collated.cu_seqlens` gives the
              same boundaries in the varlen format of FlashAttention's
              ``flash_attn_varlen_func``.

Lengths are drawn from a lognormal distribution fitted to the paragraphs of the package's
corpus (geometric mean 90 bytes, log standard deviation 0.91), and the samples' tokens are
windows of that corpus, so a run is seeded and needs no download.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from importlib import resources
from typing import Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from memlab.core.errors import InputError
from memlab.core.hardware import pick_device
from memlab.lenses.measure import measure_trainer
from memlab.models.gpt_unet import GPT, GPTConfig
from memlab.step.training_step import MemoryReport, StepConfig, Trainer, build_trainer

STRATEGIES = ("fixed", "bucketed", "packed")
IGNORE = -100  # F.cross_entropy's default ignore_index: padding and sample ends


# --------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------
def _corpus() -> np.ndarray:
    data = resources.files("memlab").joinpath("data", "corpus.txt").read_bytes()
    return np.frombuffer(data, dtype=np.uint8)


def corpus_paragraph_lengths() -> list[int]:
    """Bytes of every paragraph (blank-line separated) of the package's corpus."""
    text = _corpus().tobytes().decode("utf-8", errors="replace")
    return [len(p.encode()) for p in text.split("\n\n") if p.strip()]


def sample_lengths(n: int, *, median: float = 90.0, sigma: float = 0.91, min_len: int = 8,
                   max_len: int = 256, seed: int = 0) -> list[int]:
    """``n`` lengths from a lognormal distribution (``median`` = its geometric mean,
    ``sigma`` the standard deviation of the log), rounded and clipped to
    ``[min_len, max_len]``. The defaults are the corpus paragraphs' own."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InputError(f"n must be a positive integer, got {n!r}")
    if not 1 <= min_len <= max_len:
        raise InputError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    if median <= 0 or sigma < 0:
        raise InputError(f"need median > 0 and sigma >= 0, got median={median}, sigma={sigma}")
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(math.log(median), sigma, size=n)
    return [int(v) for v in np.clip(np.rint(raw), min_len, max_len)]


def corpus_samples(lengths: Sequence[int], vocab_size: int, *, seed: int = 0) -> list[torch.Tensor]:
    """One token tensor per length: a window of the corpus at a seeded random offset, bytes
    taken modulo ``vocab_size`` (as :func:`memlab.step.training_step.make_batch` does)."""
    corpus = _corpus()
    rng = np.random.default_rng(seed + 1)
    out = []
    for n in lengths:
        if n < 2 or n >= len(corpus):
            raise InputError(f"sample length {n} is outside 2-{len(corpus) - 1}")
        start = int(rng.integers(0, len(corpus) - n))
        out.append(torch.from_numpy(corpus[start:start + n].astype(np.int64) % vocab_size))
    return out


# --------------------------------------------------------------------------------------
# Plans
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Batch:
    """Rows of sample indices (one sample a row unless packed), each padded to ``row_len``."""

    rows: tuple[tuple[int, ...], ...]
    row_len: int

    @property
    def samples(self) -> tuple[int, ...]:
        return tuple(i for row in self.rows for i in row)

    @property
    def slots(self) -> int:
        """Padded token positions: what the activations are sized by."""
        return len(self.rows) * self.row_len


@dataclass(frozen=True)
class BatchPlan:
    """How one strategy cuts a dataset into batches under a token budget."""

    strategy: str
    lengths: tuple[int, ...]
    batches: tuple[Batch, ...]
    token_budget: int

    @property
    def tokens(self) -> int:
        """Real tokens in all batches."""
        return sum(self.lengths[i] for b in self.batches for i in b.samples)

    @property
    def slots(self) -> int:
        return sum(b.slots for b in self.batches)

    @property
    def padding_tokens(self) -> int:
        return self.slots - self.tokens

    @property
    def padding_fraction(self) -> float:
        """Share of all padded slots that hold padding, not data."""
        return self.padding_tokens / self.slots

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """The distinct (rows, row length) shapes the model sees."""
        return sorted({(len(b.rows), b.row_len) for b in self.batches})

    def largest(self) -> Batch:
        """The batch with the most slots (the most rows among equals): the peak's batch."""
        return max(self.batches, key=lambda b: (b.slots, len(b.rows)))


def _check(lengths: Sequence[int], token_budget: int, max_len: int) -> tuple[int, ...]:
    lengths = tuple(int(n) for n in lengths)
    if not lengths:
        raise InputError("lengths is empty: nothing to batch")
    if min(lengths) < 1:
        raise InputError(f"a sample has length {min(lengths)}; lengths must be >= 1")
    if max(lengths) > max_len:
        raise InputError(f"a sample of {max(lengths)} tokens exceeds max_len={max_len}; "
                         f"truncate the data or raise max_len")
    if token_budget < max_len:
        raise InputError(f"token_budget={token_budget} is below max_len={max_len}: the "
                         f"longest sample would not fit one batch")
    return lengths


def fixed_batches(lengths: Sequence[int], token_budget: int, max_len: int) -> BatchPlan:
    """``token_budget // max_len`` samples per batch, in data order, all padded to ``max_len``."""
    lengths = _check(lengths, token_budget, max_len)
    per = token_budget // max_len
    batches = tuple(Batch(tuple((i,) for i in range(s, min(s + per, len(lengths)))), max_len)
                    for s in range(0, len(lengths), per))
    return BatchPlan("fixed", lengths, batches, token_budget)


def bucketed_batches(lengths: Sequence[int], token_budget: int, max_len: int, *,
                     bucket_width: int = 32) -> BatchPlan:
    """Length buckets ``(0, w], (w, 2w], ...``; inside a bucket, samples in length order
    fill a batch while ``samples x longest <= token_budget``; each batch is padded to its
    longest sample."""
    lengths = _check(lengths, token_budget, max_len)
    if isinstance(bucket_width, bool) or not isinstance(bucket_width, int) or bucket_width < 1:
        raise InputError(f"bucket_width must be a positive integer, got {bucket_width!r}")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[Batch] = []
    current: list[int] = []
    for i in order:
        bucket = (lengths[i] - 1) // bucket_width
        same = current and (lengths[current[0]] - 1) // bucket_width == bucket
        if current and (not same or (len(current) + 1) * lengths[i] > token_budget):
            batches.append(Batch(tuple((j,) for j in current), lengths[current[-1]]))
            current = []
        current.append(i)
    batches.append(Batch(tuple((j,) for j in current), lengths[current[-1]]))
    return BatchPlan("bucketed", lengths, tuple(batches), token_budget)


def packed_batches(lengths: Sequence[int], token_budget: int, max_len: int) -> BatchPlan:
    """First-fit decreasing: each sample, longest first, goes into the first row of
    ``max_len`` tokens with room for it, else a new row; rows are grouped
    ``token_budget // max_len`` to a batch."""
    lengths = _check(lengths, token_budget, max_len)
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, free in enumerate(room):
            if free >= lengths[i]:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(max_len - lengths[i])
    per = token_budget // max_len
    batches = tuple(Batch(tuple(tuple(r) for r in rows[s:s + per]), max_len)
                    for s in range(0, len(rows), per))
    return BatchPlan("packed", lengths, batches, token_budget)


def plan_batches(strategy: str, lengths: Sequence[int], token_budget: int, max_len: int,
                 **kwargs) -> BatchPlan:
    """The plan of one strategy by name: ``fixed``, ``bucketed`` or ``packed``."""
    fns = {"fixed": fixed_batches, "bucketed": bucketed_batches, "packed": packed_batches}
    if strategy not in fns:
        raise InputError(f"strategy={strategy!r}; allowed: {', '.join(STRATEGIES)}")
    return fns[strategy](lengths, token_budget, max_len, **kwargs)


# --------------------------------------------------------------------------------------
# Tensors and the model
# --------------------------------------------------------------------------------------
@dataclass
class Collated:
    """A batch as tensors, ``(rows, row_len)`` each.

    ``targets`` holds the next token, or -100 (ignored by the loss) on padding and on each
    sample's last token, so no sample predicts its neighbour's first token. ``positions``
    restart at 0 with every sample; ``doc_ids`` number the samples of a row (-1: padding).
    ``cu_seqlens`` (int32) are the samples' boundaries in the concatenation of their tokens
    without padding, the format of FlashAttention's ``flash_attn_varlen_func``: sample ``k``
    is tokens ``cu_seqlens[k]:cu_seqlens[k + 1]``.
    """

    idx: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor
    doc_ids: torch.Tensor
    cu_seqlens: torch.Tensor

    def tensors(self, packed: bool) -> tuple[torch.Tensor, ...]:
        """What the model's forward takes: ``(idx, targets)`` for padded rows, and also
        positions and document ids for packed ones (:class:`PackedGPT`)."""
        if packed:
            return self.idx, self.targets, self.positions, self.doc_ids
        return self.idx, self.targets


def collate(batch: Batch, samples: Sequence[torch.Tensor]) -> Collated:
    """Lay the batch's samples into rows, padding each row at its end."""
    n = len(batch.rows)
    idx = torch.zeros(n, batch.row_len, dtype=torch.long)
    targets = torch.full((n, batch.row_len), IGNORE, dtype=torch.long)
    positions = torch.zeros(n, batch.row_len, dtype=torch.long)
    doc_ids = torch.full((n, batch.row_len), -1, dtype=torch.long)
    bounds = [0]
    for r, row in enumerate(batch.rows):
        at = 0
        for d, i in enumerate(row):
            s = samples[i]
            n_tok = len(s)
            if at + n_tok > batch.row_len:
                raise InputError(f"row {r} holds {at + n_tok} tokens, more than {batch.row_len}")
            idx[r, at:at + n_tok] = s
            targets[r, at:at + n_tok - 1] = s[1:]
            positions[r, at:at + n_tok] = torch.arange(n_tok)
            doc_ids[r, at:at + n_tok] = d
            at += n_tok
            bounds.append(bounds[-1] + n_tok)
    return Collated(idx, targets, positions, doc_ids, torch.tensor(bounds, dtype=torch.int32))


def packed_attention_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """``(rows, 1, L, L)`` booleans, True where query ``i`` may attend key ``j``: the same
    sample and ``j <= i``. Padding (-1) attends to padding, so no row of the mask is empty."""
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    L = doc_ids.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=doc_ids.device).tril()
    return (same & causal)[:, None]


class PackedGPT(nn.Module):
    """A memlab :class:`~memlab.models.gpt_unet.GPT` reading packed rows: learned positions restart
    at every sample and each block's attention gets the block-diagonal causal mask of
    :func:`packed_attention_mask`. It runs the GPT's own modules (norms, ``qkv``, ``proj``,
    MLP, head) and shares their parameters; only the attention core takes the mask.
    GPT-2-style blocks only (learned positions, one key/value head per query head)."""

    def __init__(self, gpt: GPT):
        super().__init__()
        cfg: GPTConfig = gpt.cfg
        if cfg.position != "learned":
            raise InputError(f"packing here needs learned positions, got position={cfg.position!r}")
        if cfg.kv_heads != cfg.n_head:
            raise InputError(f"packing here needs one key/value head per query head, got "
                             f"n_head={cfg.n_head}, {cfg.kv_heads} key/value heads")
        if cfg.loss != "plain":
            raise InputError(f"packing here computes the plain loss, got loss={cfg.loss!r}")
        self.gpt = gpt

    def _block(self, block: nn.Module, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = block.attn.cfg.n_head
        q, k, v = block.attn.qkv(block.ln1(x)).split(d, dim=2)
        q, k, v = (t.view(b, s, h, d // h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + block.attn.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + block.mlp(block.ln2(x))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None, positions: torch.Tensor,
                doc_ids: torch.Tensor) -> torch.Tensor:
        gpt = self.gpt
        mask = packed_attention_mask(doc_ids)
        x = gpt.wte(idx) + gpt.wpe(positions)
        for block in gpt.blocks:
            if gpt.cfg.checkpointing == "full" and torch.is_grad_enabled():
                x = checkpoint(self._block, block, x, mask, use_reentrant=False)
            else:
                x = self._block(block, x, mask)
        logits = gpt.lm_head(gpt.ln_f(x))
        if gpt.cfg.logits_fp32:  # as GPT.forward: only the fp32 copy lives through the loss
            logits = logits.float()
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


def measure_plan(plan: BatchPlan, samples: Sequence[torch.Tensor], step: StepConfig | None = None,
                 *, device: str | None = "cpu", batch: Batch | None = None) -> MemoryReport:
    """One tracked training step (after a warm-up step) on a batch of ``plan``, by default
    its largest: the GPT of ``step`` (its model, precision, optimizer, checkpointing), the
    rows and length of that batch. Packed plans run through :class:`PackedGPT`."""
    step = step or StepConfig()
    batch = batch or plan.largest()
    step = replace(step, seq=batch.row_len, batch=len(batch.rows), micro_batches=1)
    trainer = build_trainer(step, pick_device(device))
    if not isinstance(trainer.model, GPT):
        raise InputError(f"batching measures a GPT; got model {step.model_config.name!r}")
    packed = plan.strategy == "packed"
    if packed:
        trainer = Trainer(step, trainer.device, PackedGPT(trainer.model), trainer.optimizer,
                          trainer.scaler)
    tensors = tuple(t.to(trainer.device) for t in collate(batch, samples).tensors(packed))
    report = measure_trainer(trainer, tensors)
    report.notes.append(f"{plan.strategy}: {len(batch.rows)} rows x {batch.row_len}, "
                        f"{sum(plan.lengths[i] for i in batch.samples)} real tokens")
    return report


__all__ = ["STRATEGIES", "IGNORE", "corpus_paragraph_lengths", "sample_lengths", "corpus_samples",
           "Batch", "BatchPlan", "fixed_batches", "bucketed_batches", "packed_batches",
           "plan_batches", "Collated", "collate", "packed_attention_mask", "PackedGPT",
           "measure_plan"]
