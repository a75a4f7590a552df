"""Bytes one rank moves in one training step, by kind: the communication half of step time.

Each :class:`Transfer` is one kind of traffic with its collective, the bytes of the tensors
it operates on over the whole step (``payload_bytes``) and the group it runs in; what a rank
sends on the wire (``moved_bytes``) follows from the collective, for the ring algorithms
NCCL and gloo use (Patarasuk and Yuan 2009; the ZeRO paper's accounting, Rajbhandari et al.
2020, sec. 7): an all-reduce sends ``2 (n-1)/n`` of its payload per rank (a reduce-scatter
and an all-gather), a reduce-scatter or an all-gather ``(n-1)/n``, a point-to-point send
and a host copy all of it. A ``reduce`` here is DeepSpeed's set of reduces, one per gradient
slice to the rank owning it, over a step's slices: the same ``(n-1)/n`` as the reduce-scatter
it adds up to (:attr:`Transfer.moved_bytes`).

With ``Ψ`` the parameters of a rank's model replica (``1/t`` of the model under ``t``-way
tensor parallelism, ``1/p`` of it per pipeline stage) on ``n`` data-parallel ranks:

* **data parallelism** (DDP, plain PyTorch): one all-reduce of the gradients per backward,
  in their dtype (fp32 master weights under autocast: 4 bytes); ``2Ψ`` elements moved per
  rank (ZeRO sec. 7.1);
* **ZeRO-1 and -2** (16-bit gradients and weights): in the paper a reduce-scatter of the
  gradients and an all-gather of the updated 16-bit weights, ``Ψ + Ψ = 2Ψ``, as DP (sec.
  7.2.1; ``engine="paper"``). DeepSpeed 0.19 reduces its gradient buckets with all-reduces
  instead (``use_multi_rank_bucket_allreduce``, on by default, in ``average_tensor`` of
  ``stage_1_and_2.py``; counted on gloo ranks: ``tests/test_communication.py``), so it moves
  ``2Ψ + Ψ = 3Ψ`` (``engine="deepspeed"``, the default: what runs); stage 1 reduces once per
  step, stage 2 in every backward (its gradient partition accumulates). With
  ``use_multi_rank_bucket_allreduce: false`` and ``reduce_scatter: true`` (DeepSpeed's config
  keys, :data:`memlab.step.write_deepspeed_config.REDUCE_TO_OWNER`, written by
  ``deepspeed_config(step, paper_collectives=True)``) each slice is reduced to its owner
  (``dist.reduce``) instead: ``Ψ + Ψ = 2Ψ``, the paper's bytes (``engine="deepspeed-reduce-scatter"``);
* **ZeRO-3**: the weights all-gathered in forward and again in backward, the gradients
  reduce-scattered: ``3Ψ``, 1.5 times DP (sec. 7.2.2), per micro-batch; parameters under
  DeepSpeed's persistence threshold stay whole on every rank and are never gathered
  (:data:`memlab.step.states.PERSISTENCE_THRESHOLD`). DeepSpeed keeps a gathered parameter that
  is used again within ``stage3_max_reuse_distance`` (memlab: 4M elements): a model of a few
  million parameters skips most of the backward gather (counted: 0.07 of it for ``tiny``);
  at billions of parameters that is a few millionths of Ψ, left out.
  ``engine="deepspeed-reduce-scatter"`` assumes DeepSpeed run with
  :data:`memlab.step.write_deepspeed_config.GATHER_EVERY_USE` (persistence threshold,
  reuse distance and prefetch bucket 0): every module gathers its weights in forward and in
  backward, ``Ψ + Ψ + Ψ``, and a weight two modules share (tied embeddings) is gathered by
  each, ``2 V d`` more per micro-batch;
* **tensor parallelism** (Megatron-LM, Shoeybi et al. 2019, sec. 3): two all-reduces of the
  block's output (``b s h`` elements, the activations' dtype) in forward (after attention's
  and the MLP's row-parallel matmul), two in backward (before the column-parallel ones); full
  checkpointing re-runs attention's (the MLP's last matmul is not re-run, :mod:`memlab.time.flops`);
* **pipeline parallelism**: each stage boundary sends the activations forward and their
  gradients back (``b s h`` in the residual dtype each); a middle stage sends both;
* **offload** (ZeRO-Offload as DeepSpeed runs it, Ren et al. 2021, sec. 4.1): each rank's
  gradient partition goes to the host into DeepSpeed's fp32 buffer (4 bytes per parameter)
  and the updated 16-bit weights come back (2 bytes), over PCIe; with ``offload="all"`` the
  ZeRO-3 gathers read the weights from the host as well.
"""
from __future__ import annotations

from dataclasses import dataclass

from memlab.core.errors import InputError
from memlab.core.precision import precision_bytes
from memlab.models.decoder_shape import DecoderShape
from memlab.models.gpt_unet import GPTConfig
from memlab.step.states import PERSISTENCE_THRESHOLD, param_numels, under_deepspeed
from memlab.step.zero3_gathers import persists

COLLECTIVES = ("all_reduce", "reduce_scatter", "reduce", "all_gather", "send", "copy")
#: links a transfer runs over: between GPUs (NVLink, or the network) or host <-> device (PCIe)
LINKS = ("gpu", "pcie")


@dataclass(frozen=True)
class Transfer:
    """One kind of traffic of a step (module doc): ``payload_bytes`` summed over the step's
    calls, on a group of ``ranks``, over ``link``."""

    kind: str
    collective: str
    payload_bytes: int
    ranks: int
    link: str = "gpu"

    @property
    def moved_bytes(self) -> float:
        """Bytes this rank sends (ring algorithms; a copy or a send moves its payload)."""
        n = self.ranks
        if self.collective == "all_reduce":
            return 2 * (n - 1) / n * self.payload_bytes
        if self.collective in ("reduce_scatter", "all_gather"):
            return (n - 1) / n * self.payload_bytes
        if self.collective == "reduce":
            # every rank reduces each slice to its owner (its payload: all n owners' slices);
            # a ring reduce of m bytes has each rank but the root send m once, and each rank
            # is the root of 1/n of the payload: (n-1)/n of it, a reduce-scatter's share
            return (n - 1) / n * self.payload_bytes
        return float(self.payload_bytes)


@dataclass(frozen=True)
class StepComm:
    """The transfers of one rank's step. ``by_kind``: bytes moved by kind; ``gpu_bytes`` and
    ``pcie_bytes`` split them by link."""

    transfers: tuple[Transfer, ...] = ()

    @property
    def by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for t in self.transfers:
            out[t.kind] = out.get(t.kind, 0.0) + t.moved_bytes
        return out

    @property
    def gpu_bytes(self) -> float:
        return sum(t.moved_bytes for t in self.transfers if t.link == "gpu")

    @property
    def pcie_bytes(self) -> float:
        return sum(t.moved_bytes for t in self.transfers if t.link == "pcie")

    def payload(self, collective: str) -> int:
        """Payload bytes of one collective over all kinds (what a counter on the ranks sees)."""
        return sum(t.payload_bytes for t in self.transfers if t.collective == collective)

    def to_dict(self) -> dict:
        return {"by_kind": self.by_kind, "gpu_bytes": self.gpu_bytes, "pcie_bytes": self.pcie_bytes,
                "transfers": [{"kind": t.kind, "collective": t.collective, "payload_bytes": t.payload_bytes,
                               "ranks": t.ranks, "link": t.link, "moved_bytes": t.moved_bytes}
                              for t in self.transfers]}


#: ``deepspeed``: DeepSpeed 0.19 with memlab's default config; ``paper``: the ZeRO paper's
#: collectives; ``deepspeed-reduce-scatter``: DeepSpeed with ``deepspeed_config(step,
#: paper_collectives=True)``'s keys (module doc), the paper's bytes as DeepSpeed moves them
ENGINES = ("deepspeed", "paper", "deepspeed-reduce-scatter")


#: of a layer's tensor-parallel all-reduces, those backward runs (before attention's and the MLP's
#: column-parallel matmuls: the input gradient's, Megatron-LM's ``f`` operator)
TP_BACKWARD_ALL_REDUCES = 2


def tp_all_reduces_per_layer(step, whole_forward_recompute: bool = False) -> int:
    """A layer's tensor-parallel all-reduces in one micro-batch: two forward, two backward
    (:data:`TP_BACKWARD_ALL_REDUCES`), and what full checkpointing re-runs: torch's non-reentrant
    checkpoint stops before the MLP's last matmul, so attention's one; Megatron-LM's reentrant
    ``tensor_parallel.checkpoint`` of whole layers (``ParallelTransformer._checkpointed_forward``,
    megatron/model/transformer.py at NVIDIA/Megatron-LM@b35d061e) re-runs the whole forward, both
    (``whole_forward_recompute``)."""
    rerun = (2 if whole_forward_recompute else 1) if step.checkpointing_used == "full" else 0
    return 2 + TP_BACKWARD_ALL_REDUCES + rerun


def step_communication(step, *, engine: str = "deepspeed", sync_every_micro_batch: bool = True,
                       virtual_stages: int = 1, whole_forward_recompute: bool = False) -> StepComm:
    """The transfers of one rank's step (module doc's rules).

    Args:
        step: a :class:`memlab.step.training_step.StepConfig`; ``world_size`` ranks, ``batch`` per rank,
            its ``parallel`` degrees ``t`` (tensor) and ``p`` (pipeline); data parallelism runs
            over the ``world_size / (t p)`` remaining ranks.
        engine: ``"deepspeed"`` (what DeepSpeed 0.19 runs with memlab's default config),
            ``"paper"`` (the ZeRO paper's collectives, sec. 7) or ``"deepspeed-reduce-scatter"``
            (DeepSpeed with ``use_multi_rank_bucket_allreduce: false`` for ZeRO-1/2 and
            ``stage3_param_persistence_threshold``, ``stage3_max_reuse_distance`` and
            ``stage3_prefetch_bucket_size`` 0 for ZeRO-3: ``paper_collectives=True``).
        sync_every_micro_batch: plain data parallelism all-reduces after every micro-batch
            (memlab's trainer); ``False``: once per step, as Megatron-LM and DDP's ``no_sync``
            accumulate the micro-batches' gradients first.
        virtual_stages: model chunks per pipeline rank (the interleaved schedule, Narayanan et
            al. 2021, sec. 2.2.2): each chunk boundary sends, ``v`` times the point-to-point bytes.
        whole_forward_recompute: full checkpointing re-runs both TP all-reduces of a layer
            (Megatron-LM's, :func:`tp_all_reduces_per_layer`).

    Returns:
        :class:`StepComm`; empty on one rank without offload.
    """
    t, p, w = step.parallel.tensor, step.parallel.pipeline, step.world_size
    if engine not in ENGINES:
        raise InputError(f"engine={engine!r}; allowed: {', '.join(ENGINES)}")
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise InputError(f"virtual_stages must be a positive integer, got {virtual_stages!r}")
    n = w // (t * p)
    cfg = step.model_config
    k = step.micro_batches
    numels = param_numels(cfg)
    psi = sum(numels) / (t * p)
    ds = under_deepspeed(step.zero, step.offload)
    e = (4 if step.precision == "fp32" else 2) if ds else precision_bytes(step.precision)[0]
    out: list[Transfer] = []
    if n > 1 and step.zero == 0:
        syncs = k if sync_every_micro_batch else 1
        out.append(Transfer("data-parallel all-reduce", "all_reduce", int(syncs * e * psi), n))
    elif n > 1 and step.zero in (1, 2):
        reduces = 1 if step.zero == 1 else k
        reduce = {"deepspeed": "all_reduce", "paper": "reduce_scatter", "deepspeed-reduce-scatter": "reduce"}[engine]
        what = "reduce to each slice's owner" if reduce == "reduce" else reduce.replace("_", "-")
        out.append(Transfer(f"ZeRO-{step.zero} gradient {what}", reduce, int(reduces * e * psi), n))
        out.append(Transfer(f"ZeRO-{step.zero} weight all-gather", "all_gather", int(e * psi), n))
    elif n > 1 and step.zero == 3:
        if engine == "deepspeed-reduce-scatter":  # nothing persists; a tied weight: once per module
            tied = (cfg.vocab_size * cfg.d_model if isinstance(cfg, GPTConfig) and cfg.tie_embeddings else
                    cfg.vocab * cfg.d if isinstance(cfg, DecoderShape) and cfg.tied else 0)
            gathered = (sum(numels) + tied) / (t * p)
        else:
            gathered = (sum(numels) - sum(x for x in numels if persists(x, PERSISTENCE_THRESHOLD))) / (t * p)
        link = "pcie" if step.offload == "all" else "gpu"
        out.append(Transfer("ZeRO-3 weight all-gather (forward)", "all_gather", int(k * e * gathered), n, link))
        out.append(Transfer("ZeRO-3 weight all-gather (backward)", "all_gather", int(k * e * gathered), n, link))
        out.append(Transfer("ZeRO-3 gradient reduce-scatter", "reduce_scatter", int(k * e * psi), n))
    if step.offload != "none":
        shard = psi / n
        out.append(Transfer("offload: fp32 gradients to the host", "copy", int(4 * shard), 1, "pcie"))
        out.append(Transfer("offload: 16-bit weights to the device", "copy", int(e * shard), 1, "pcie"))
    if isinstance(cfg, (GPTConfig, DecoderShape)) and (t > 1 or p > 1):
        tokens = step.seq * step.batch  # over all micro-batches
        act = (4 if step.precision == "fp32" else 2) if ds or step.precision != "fp32" else 4
        width = cfg.d if isinstance(cfg, DecoderShape) else cfg.d_model
        if t > 1:
            per_layer = tp_all_reduces_per_layer(step, whole_forward_recompute)
            out.append(Transfer("tensor-parallel all-reduces", "all_reduce",
                                int(per_layer * cfg.n_layer / p * tokens * width * act), t))
        if p > 1:
            residual = precision_bytes(step.precision)[0] if not ds else e
            sends = 2 if p > 2 else 1
            out.append(Transfer("pipeline activations and their gradients", "send",
                                int(virtual_stages * sends * tokens * width * residual / t), 2))
    return StepComm(tuple(out))


__all__ = ["COLLECTIVES", "ENGINES", "LINKS", "TP_BACKWARD_ALL_REDUCES", "StepComm", "Transfer", "step_communication",
           "tp_all_reduces_per_layer"]
