"""OOM now: the ladder a practitioner climbs for a fine-tune that does not fit, rung by rung.

Each rung adds one fix to the rung before it and is measured by the one estimate of a Hugging
Face run (:func:`memlab.hf.estimate.estimate_hf`: the real class, its loss as ``transformers``
computes it, LoRA and QLoRA as peft and bitsandbytes build them, DeepSpeed's layout) on a
shipped config and a card profile (:mod:`memlab.core.cards`). The rungs, in the order :data:`RUNGS`
gives with the lesson that explains each, by the lesson's own rule: what costs only time comes
before what changes the training:

0. the baseline: ``batch`` sequences in one micro-batch, bf16 autocast on fp32 weights, AdamW;
1. micro-batch 1 and ``batch`` accumulation steps (06): the same tokens per optimizer step;
2. full activation checkpointing (05): one block's activations at a time, its forward re-run;
3. the chunked loss (07): no ``tokens x vocab`` logits, the head matmul run twice;
4. pure bf16 weights (04): 2 + 2 + 4 bytes per parameter instead of 4 + 4 + 8;
5. 8-bit AdamW (bitsandbytes ``AdamW8bit``, 03): one byte per moment;
6. LoRA on every ``Linear`` of the layers (03, peft's ``all-linear``): gradients and optimizer
   state for the adapters only;
7. QLoRA (03): the frozen base in NF4 (about half a byte per weight);
8. packing (06): the same peak; more real tokens per step (:class:`PackingGain`);
9. the full fine-tune on one card as torchtune's ``llama3_1/8B_full_single_device`` recipe runs it
   (pytorch/torchtune ``recipes/configs/llama3_1/8B_full_single_device.yaml`` at 59dc1f4:
   ``PagedAdamW8bit``, ``optimizer_in_bwd: True``, activation checkpointing, ``dtype: bf16``,
   ``gradient_accumulation_steps: 1``): rungs 2-4 with paged 8-bit AdamW stepped in backward
   (:mod:`memlab.step.optimizer_in_backward`), micro-batch = batch; torchtune's README (a9ea6d5, "Memory and
   training speed") publishes 18.9 GiB "Peak Memory per GPU" on one RTX 4090 at batch 2, packed
   2048 tokens, compile on; the paged state lives in CUDA unified memory, outside the caching
   allocator whose peaks torchtune logs, as memlab counts it (host bytes);
10. ZeRO-3 over N ranks (10: the fewest of :data:`SHARD_RANKS` that fit), and 11. offload to
   the host (11: the fewest ranks, one first, that fit), on the *full fine-tune*: rungs 1-3 and
   8 under DeepSpeed's bf16 (2 + 2 + 12 bytes a parameter divided over N), every weight
   trainable.

Time is the step-time lens (:func:`memlab.time.step_time.step_time`) on the card: seconds of one
rank's optimizer step of the rung's run, the decoder's shape and every field of the rung
(:class:`memlab.step.training_step.StepConfig` with a :class:`memlab.models.decoder_shape.DecoderShape`):
its FLOPs from the shape's own GEMMs (:func:`memlab.time.flops.decoder_step_flops`, LoRA's adapters
and the chunked loss's recomputed logits included), the adapters' small GEMMs by their roofline and
QLoRA's dequantisation of each weight (:func:`memlab.time.step_time.adapter_time`), for every family.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

from memlab.core.cards import Card, get_card
from memlab.core.errors import InputError
from memlab.hf.config import load_config
from memlab.hf.estimate import estimate_hf
from memlab.hf.shape import decoder_shape
from memlab.step.decoder_states import adapter_shapes, adapters_for
from memlab.step.fine_tune_config import ALL_LINEAR, LoraConfig, QuantConfig
from memlab.step.training_step import MemoryReport, StepConfig
from memlab.techniques.batching import fixed_batches, packed_batches, sample_lengths
from memlab.time.step_time import report_time

#: the cards of issue 28's "OOM now": a 24 GB, a 48 GB and an 80 GB card
DEFAULT_CARDS = ("RTX4090-24GB", "L40S-48GB", "A100-80GB")
#: the ranks the sharding rung tries, smallest first (one node)
SHARD_RANKS = (2, 4, 8)


@dataclass(frozen=True)
class Rung:
    """One fix: ``key``, what it adds (``title``), the lesson that explains it, what it costs,
    and the ``track`` it belongs to (``"adapters"``: rungs 0-8, each on the one before;
    ``"full"``: the full fine-tune on one card, sharded, offloaded)."""

    key: str
    title: str
    lesson: str
    cost: str
    track: str = "adapters"


RUNGS: tuple[Rung, ...] = (
    Rung("baseline", "micro-batch = batch, bf16 autocast, AdamW", "03", "-"),
    Rung("accumulation", "micro-batch 1 + accumulation", "06", "the same tokens per update in smaller matmuls"),
    Rung("checkpointing", "+ full activation checkpointing", "05", "time: each block's forward re-run"),
    Rung("chunked-loss", "+ chunked loss", "07", "time: the head matmul run twice"),
    Rung("pure-bf16", "+ pure bf16 weights", "04", "quality: bf16 updates round small steps away"),
    Rung("adamw-8bit", "+ 8-bit AdamW", "03", "moments kept in 8 bits, blockwise (bitsandbytes, CUDA)"),
    Rung("lora", "+ LoRA on every projection", "03", "quality: a low-rank update of a frozen model"),
    Rung("qlora", "+ QLoRA (NF4 base)", "03", "quality: base rounded to 4 bits; time: dequantised per matmul"),
    Rung("packing", "+ packing", "06", "samples must not attend to each other: block-diagonal mask or varlen"),
    Rung("in-backward", "full fine-tune: paged 8-bit AdamW + optimizer step in backward, micro-batch = batch",
         "03", "no accumulation, no global-norm clipping; large tensors' 8-bit moments in unified memory", "full"),
    Rung("zero-3", "full fine-tune: ZeRO-3 / FSDP over N", "10", "N cards; time: all-gathers each step", "full"),
    Rung("offload", "full fine-tune: ZeRO-3 + offload to host", "11", "host memory; time: PCIe and the host's Adam",
         "full"),
)


@dataclass(frozen=True)
class PackingGain:
    """Real tokens per micro-step without and with packing, from a padded and a packed plan
    of the same lengths (:mod:`memlab.techniques.batching`): ``rows_padded`` rows (one sample each, each
    padded to ``seq``) against ``rows_packed`` rows filled first-fit. The peak is the same
    (both hold ``seq`` slots a row); ``gain`` is how many more real tokens a step carries."""

    samples: int
    tokens: int
    seq: int
    rows_padded: int
    rows_packed: int

    @property
    def tokens_per_row_padded(self) -> float:
        return self.tokens / self.rows_padded

    @property
    def tokens_per_row_packed(self) -> float:
        return self.tokens / self.rows_packed

    @property
    def padding_fraction(self) -> float:
        """Share of the padded plan's slots that hold padding."""
        return 1 - self.tokens / (self.rows_padded * self.seq)

    @property
    def gain(self) -> float:
        return self.rows_padded / self.rows_packed


def packing_gain(lengths: Sequence[int], seq: int) -> PackingGain:
    """:class:`PackingGain` of samples of ``lengths`` tokens at ``seq`` tokens a row.

    Args:
        lengths: tokens per sample, each at most ``seq``.
        seq: the row length (``max_length``).

    Returns:
        :class:`PackingGain`.
    """
    padded, packed = fixed_batches(lengths, seq, seq), packed_batches(lengths, seq, seq)
    return PackingGain(len(padded.lengths), padded.tokens, seq,
                       sum(len(b.rows) for b in padded.batches), sum(len(b.rows) for b in packed.batches))


@dataclass(frozen=True)
class RungResult:
    """One rung on one card: ``peak_bytes`` per rank (the device's), ``fits`` the card,
    ``host_bytes`` kept in host memory, ``seconds`` of one rank's optimizer step by the time
    lens (``None`` where the card has no speeds), ``world_size`` the ranks, ``tokens`` the real
    tokens one rank's step carries, ``trainable`` the parameters trained, and ``note`` what
    the estimate says about this rung."""

    rung: Rung
    card: str
    peak_bytes: int
    fits: bool
    host_bytes: int
    seconds: float | None
    world_size: int
    tokens: float
    trainable: int
    note: str = ""
    report: MemoryReport | None = field(default=None, compare=False, repr=False)

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / 2**30

    @property
    def tokens_per_second(self) -> float | None:
        """Real tokens per second of one rank (``None`` without a time)."""
        return self.tokens / self.seconds if self.seconds else None


@dataclass(frozen=True)
class CardLadder:
    """Every rung on one card."""

    card: Card
    results: tuple[RungResult, ...]

    def first_fit(self, track: str = "adapters") -> RungResult | None:
        """The first rung of ``track`` whose peak fits the card (``None``: none does)."""
        return next((r for r in self.results if r.rung.track == track and r.fits), None)

    def result(self, key: str) -> RungResult:
        return next(r for r in self.results if r.rung.key == key)


@dataclass(frozen=True)
class Ladder:
    """The ladder of ``config`` at ``seq`` x ``batch`` (sequences per optimizer step per
    rank) on each card, with the packing gain the packing rung is read from."""

    config: str
    seq: int
    batch: int
    lora_rank: int
    cards: tuple[CardLadder, ...]
    packing: PackingGain

    def table(self) -> str:
        """The ladder as Markdown: a row per rung, peak GiB per card (``*`` where it fits,
        ``N=`` the ranks of the sharding rungs), the lesson and the cost."""
        head = "| rung | " + " | ".join(c.card.name for c in self.cards) + " | lesson | what it costs |"
        lines = [head, "|" + " --- |" * (len(self.cards) + 3)]
        for i, rung in enumerate(RUNGS):
            cells = []
            for c in self.cards:
                r = c.results[i]
                ranks = f" (N={r.world_size})" if r.world_size > 1 else ""
                cells.append(f"{r.peak_gib:.1f}{' *' if r.fits else ''}{ranks}")
            lines.append(f"| {i}. {rung.title} | " + " | ".join(cells) + f" | {rung.lesson} | {rung.cost} |")
        firsts = []
        for c in self.cards:
            r = c.first_fit()
            firsts.append(f"{RUNGS.index(r.rung)}. {r.rung.key}" if r else "none")
        lines.append("| first rung that fits | " + " | ".join(firsts) + " | | |")
        return "\n".join(lines)

    def time_table(self) -> str:
        """Seconds of one rank's optimizer step and real tokens per second, per rung and card
        (the step-time lens; ``-`` where the card has no speeds)."""
        lines = ["| rung | " + " | ".join(f"{c.card.name} s | tok/s" for c in self.cards) + " |",
                 "|" + " --- |" * (2 * len(self.cards) + 1)]
        for i, rung in enumerate(RUNGS):
            cells = []
            for c in self.cards:
                r = c.results[i]
                cells.append(f"{r.seconds:.2f} | {r.tokens_per_second:,.0f}" if r.seconds else "- | -")
            lines.append(f"| {i}. {rung.key} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


def _time_step(shape, seq: int, batch: int, run: dict) -> StepConfig:
    """The run the time lens times for one rung: the decoder's shape with the rung's fields
    (the same keywords :func:`memlab.hf.estimate.estimate_hf` takes)."""
    return StepConfig(shape, seq=seq, batch=batch, **{"precision": "bf16", **run})


def _card_ladder(cfg: str, card: Card, seq: int, batch: int, rank: int, gain: PackingGain,
                 shard_ranks: Sequence[int]) -> CardLadder:
    """Every rung of :data:`RUNGS` on ``card`` (module doc)."""
    name = card.name
    shape = decoder_shape(cfg)
    lora_cfg = LoraConfig(rank=rank, targets=ALL_LINEAR)
    unpacked, packed = batch * gain.tokens_per_row_padded, batch * gain.tokens_per_row_packed
    full = shape.num_params()
    adapters = sum(r * c for r, c in adapter_shapes(shape, adapters_for(shape, lora_cfg, "pure-bf16")))

    def seconds(run: dict) -> float | None:
        step = _time_step(shape, seq, batch, run)
        try:
            return report_time(step, card).seconds
        except InputError:  # a run the time lens does not count (LoRA on DeepSeek's latent attention)
            return None

    def result(rung: Rung, run: dict, note: str = "", real_tokens: float = unpacked) -> RungResult:
        rep = estimate_hf(cfg, seq=seq, batch=batch, budget=name, target="cuda", **run)
        lora = run.get("lora") is not None
        return RungResult(rung, name, rep.peak_bytes, rep.peak_bytes <= card.memory, rep.host_bytes,
                          seconds(run), run.get("world_size", 1), real_tokens, adapters if lora else full,
                          note, rep)

    rungs = {r.key: r for r in RUNGS}
    runs: dict[str, dict] = {"baseline": dict(precision="bf16")}
    runs["accumulation"] = dict(runs["baseline"], micro_batches=batch)
    runs["checkpointing"] = dict(runs["accumulation"], checkpointing="full")
    runs["chunked-loss"] = dict(runs["checkpointing"], loss="chunked")
    runs["pure-bf16"] = dict(runs["chunked-loss"], precision="pure-bf16")
    runs["adamw-8bit"] = dict(runs["pure-bf16"], optimizer="adamw-8bit")
    runs["lora"] = dict(runs["adamw-8bit"], lora=lora_cfg)
    runs["qlora"] = dict(runs["lora"], quantization=QuantConfig(bits=4))
    out = [result(rungs[k], runs[k]) for k in ("baseline", "accumulation", "checkpointing", "chunked-loss",
                                               "pure-bf16")]
    paged = estimate_hf(cfg, seq=seq, batch=batch, budget=name, target="cuda",
                        **dict(runs["pure-bf16"], optimizer="paged-adamw-8bit"))
    out.append(result(rungs["adamw-8bit"], runs["adamw-8bit"],
                      note=f"paged 8-bit: {paged.peak_bytes / 2**30:.1f} GiB on the device, the state "
                           f"in unified memory the driver pages out when the card is full"))
    out.append(result(rungs["lora"], runs["lora"]))
    out.append(result(rungs["qlora"], runs["qlora"]))
    out.append(result(rungs["packing"], runs["qlora"], real_tokens=packed,
                      note=f"real tokens per row {gain.tokens_per_row_padded:.0f} -> "
                           f"{gain.tokens_per_row_packed:.0f} (x{gain.gain:.2f}) at the same peak"))
    # the full fine-tune on one card, torchtune's llama3_1/8B_full_single_device recipe: rungs 2-4
    # with paged 8-bit AdamW stepped in backward; no accumulation (the step in backward applies
    # each gradient as it is made)
    in_bwd = dict(runs["pure-bf16"], micro_batches=1, optimizer="paged-adamw-8bit", optimizer_in_backward=True)
    plain_loss = estimate_hf(cfg, seq=seq, batch=batch, budget=name, target="cuda",
                             **dict(in_bwd, loss="transformers"))
    ib = result(rungs["in-backward"], in_bwd, real_tokens=packed)
    out.append(replace(ib, note=f"{ib.host_bytes / 2**30:.1f} GiB of 8-bit state in unified memory; with "
                                f"transformers' own loss (fp32 logits) {plain_loss.peak_bytes / 2**30:.1f} GiB"))
    # the full fine-tune under DeepSpeed (bf16: 2 + 2 + 12 bytes a parameter over N), rungs 1-3
    # and packing, sharded, then offloaded
    sharded = dict(runs["chunked-loss"], zero=3)
    ranks = ", ".join(map(str, shard_ranks))
    tried = [(n, result(rungs["zero-3"], dict(sharded, world_size=n), real_tokens=packed)) for n in shard_ranks]
    n, z3 = next(((n, r) for n, r in tried if r.fits), tried[-1])
    out.append(replace(z3, note=f"the fewest of {ranks} ranks that fit" if z3.fits else f"none of {ranks} ranks fit"))
    # offload: for whoever has fewer cards than that, the fewest ranks (one first) that fit
    tried = [(n, result(rungs["offload"], dict(sharded, world_size=n, offload="all"), real_tokens=packed))
             for n in (1, *shard_ranks)]
    n, off = next(((n, r) for n, r in tried if r.fits), tried[-1])
    out.append(replace(off, note=f"parameters and optimizer state on the host (offload_param and "
                                 f"offload_optimizer to cpu): {off.host_bytes / 2**30:.0f} GiB of host memory "
                                 f"per rank"))
    return CardLadder(card, tuple(out))


def oom_ladder(config: str = "llama-3.1-8b", cards: Sequence[str] = DEFAULT_CARDS, *, seq: int = 4096,
               batch: int = 4, lora_rank: int = 16, lengths: Sequence[int] | None = None,
               shard_ranks: Sequence[int] = SHARD_RANKS) -> Ladder:
    """The OOM ladder of a Hugging Face ``config`` on ``cards`` (module doc).

    Args:
        config: a shipped config name (:data:`memlab.hf.config.SHIPPED`) or a config.json path.
        cards: card profile names (:data:`memlab.core.cards.CARDS`).
        seq: tokens per sequence; batch: sequences per optimizer step per rank.
        lora_rank: the LoRA and QLoRA rungs' rank (every projection targeted).
        lengths: the dataset's sample lengths in tokens for the packing rung (default: 2000
            lognormal lengths, median ``seq / 8``, the log's standard deviation 0.91, the
            package corpus's own spread, :func:`memlab.techniques.batching.sample_lengths`).
        shard_ranks: the ranks the sharding rung tries, smallest first.

    Returns:
        :class:`Ladder`.
    """
    load_config(config)  # a bad name is refused before any estimate
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise InputError(f"batch={batch!r}; allowed: a positive integer")
    if not shard_ranks or any(isinstance(n, bool) or not isinstance(n, int) or n < 2 for n in shard_ranks):
        raise InputError(f"shard_ranks={tuple(shard_ranks)!r}; allowed: integers >= 2")
    if lengths is None:
        lengths = sample_lengths(2000, median=seq / 8, sigma=0.91, min_len=8, max_len=seq, seed=0)
    gain = packing_gain(lengths, seq)
    profiles = tuple(get_card(c) for c in cards)
    ladders = tuple(_card_ladder(config, c, seq, batch, lora_rank, gain, tuple(shard_ranks)) for c in profiles)
    return Ladder(str(config), seq, batch, lora_rank, ladders, gain)


__all__ = ["DEFAULT_CARDS", "SHARD_RANKS", "Rung", "RUNGS", "PackingGain", "packing_gain", "RungResult",
           "CardLadder", "Ladder", "oom_ladder"]
