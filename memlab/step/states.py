"""Model states: the bytes of parameters, gradients and optimizer state per rank, and where
they live. The one source for the estimate, the simulation's correction, the advisor, the
report's ZeRO savings and lesson 10.

Two layouts, decided by :func:`under_deepspeed`:

**Plain PyTorch** (no ZeRO, no offload): the optimizer updates the model's own weights.
fp32 and autocast (``bf16``/``fp16``: the weights stay fp32) keep 4 + 4 + 8 bytes per
parameter with AdamW (weights, gradients, two fp32 moments); ``pure-bf16`` keeps 2 + 2 + 4;
SGD with momentum has one moment instead of two. bitsandbytes' 8-bit AdamW
(``"adamw-8bit"``) keeps its state in :func:`memlab.step.low_bit.adam_state_bytes`' layout, whatever
the weights' dtype; its paged twin (``"paged-adamw-8bit"``) the same bytes in CUDA unified
memory: host bytes, none on the device. torchao's low-bit AdamW (``"torchao-adamw-8bit"``, ``-4bit``,
``-fp8``) its layout there, whose unquantised tensors keep moments in the weights' dtype.

**DeepSpeed** (ZeRO stage 1-3 or offload): in ``bf16``/``fp16`` mode DeepSpeed casts the model
to 16 bits (no autocast: activations are those of a pure 16-bit step) and its optimizer
holds an fp32 master copy and fp32 moments: 2 + 2 + K bytes per parameter with K = 12 for
Adam (Rajbhandari et al. 2020, "ZeRO", sec. 3.1 and 5.1). Stage 1 divides the K bytes by the
N data-parallel ranks, stage 2 also the gradients, stage 3 also the parameters. In fp32 mode
the weights and gradients take 4 + 4 and DeepSpeed's ZeRO optimizer still keeps a separate
fp32 master partition (``single_partition_of_fp32_groups``, ``fp32_partitioned_groups_flat``,
read by :func:`memlab.distributed.deepspeed_zero.zero_accounting`): K = 4 + 8; at stage 0 the fp32 model
is the master and K = 8. What DeepSpeed 0.19 (``runtime/zero/stage_1_and_2.py``,
``stage3.py``) holds besides, per rank:

* stage 1: full 16-bit gradients through backward; at ``step()`` a flat copy of the rank's
  gradient partition and its fp32 conversion (``single_grad_partition``);
* stage 2: a contiguous 16-bit gradient partition (``grads_in_partition``), allocated when
  the first reduce bucket is flushed early in backward, and the fp32 conversion at ``step()``;
  it holds every parameter overlapping the rank's share whole, so ranks differ by up to a
  parameter (:func:`zero2_partition_elements`; :func:`model_states` keeps the even share,
  :func:`with_zero2_partition` puts DeepSpeed's in where the parameters' order is known);
* stage 3: a persistent 16-bit gradient partition (``grad_partitions_flat_buffer``),
  parameters below ``stage3_param_persistence_threshold`` elements kept whole on every rank,
  and during forward/backward the gathered parameters of the running module;
* stages 1-3: the gradient reduce bucket (``reduce_bucket_size`` elements).

**Offload** (ZeRO-Offload, Ren et al. 2021, sec. 3.5 and 4.1, which offload the fp32 states and
the fp16 gradients: 12 + 2 bytes per parameter): DeepSpeed's optimizer offload moves the fp32
master, the moments *and an fp32 gradient partition* to host memory, 16 bytes per parameter / N
(0.19.8 ``stage_1_and_2.py``: ``initialize_optimizer_states`` allocates the fp32 partition's
``.grad`` on ``self.device``, ``'cpu'`` with offload; the gradient is cast to fp32 on the GPU
before its copy down, ``async_inplace_copy_grad_to_fp32_buffer_from_gpu``); the device keeps the 16-bit
parameters and the 16-bit gradients in flight (the reduce bucket, and at stages 1-2 a
staging buffer the size of the largest parameter). Parameter offload (stage 3 only;
ZeRO-Infinity, Rajbhandari et al. 2021, sec. 5) also moves the 16-bit parameter partition to
the host: the device keeps the small persistent parameters and the parameters gathered for
the module that runs. Parameter offload alone (``offload_param`` without ``offload_optimizer``,
:data:`PARAM_OFFLOAD`) moves only that partition: 0.19.8 ``stage3.py`` puts the fp32 master
on ``self.device`` (line 333: the accelerator unless the optimizer is offloaded; line 1172:
``converted = self.fp16_partitioned_groups_flat[i].to(self.device, ...)``), so the 12 bytes of
master and moments and the 2-byte gradient partition stay on the device, divided by N, and
only the 16-bit parameters go to the host (lines 967-1003: ``_create_param_groups_fp16_flat_cpu_memory``).
DeepSpeed pins its host buffers (``pin_memory: bool = True`` in 0.19.8's
``runtime/zero/offload_config.py``, for both offload configs; memlab's config leaves it unset), and
the CUDA host allocator rounds each pinned block up to a power of two
(``ATen/core/CachingHostAllocator.h``): host bytes count each pinned buffer at that size.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field, replace

import torch

from memlab.core.errors import InputError
from memlab.core.precision import SIZES, check_precision
from memlab.models.gpt_unet import build_model
from memlab.step.low_bit import (
    BLOCKWISE,
    PAGED,
    TORCHAO,
    adam_state_bytes,
    moment_bytes,
    paged_note,
    paged_state_bytes,
    torchao_update_bytes,
)
from memlab.step.zero import zero_formula
from memlab.step.zero3_gathers import gathered_in_closed_form, persists

BUCKET_ELEMENTS = 2**20  # memlab's DeepSpeed buckets (ZeRO-3's defaults allocate ~1.9 GiB/rank)
PERSISTENCE_THRESHOLD = 10_000  # ZeRO-3 keeps parameters of at most this many elements whole on every rank
SUB_GROUP_SIZE = 10**9  # DeepSpeed's default zero_optimization.sub_group_size (stage 3)
PLAIN = {p: (w, w) for p, (w, _) in SIZES.items()}  # bytes of a weight and of its gradient
OFFLOADS = ("none", "optimizer", "all")
#: DeepSpeed's ``offload_param`` without ``offload_optimizer`` (a config reader's value; module doc)
PARAM_OFFLOAD = "params"


def under_deepspeed(zero: int, offload: str = "none") -> bool:
    """Whether a step with this ZeRO stage and offload runs under DeepSpeed (else plain
    PyTorch: autocast, ``torch.optim``)."""
    return zero > 0 or offload != "none"


def pinned_bytes(nbytes: float) -> int:
    """Host bytes of a pinned buffer: the CUDA host allocator rounds it to a power of two."""
    n = int(nbytes)
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def param_numels(cfg) -> list[int]:
    """Elements of every parameter of a model config (GPT: closed form; UNet: built on the
    ``meta`` device, which allocates nothing)."""
    if hasattr(cfg, "param_numels"):
        return cfg.param_numels()
    with torch.device("meta"):
        return [p.numel() for p in build_model(cfg).parameters()]


@dataclass(frozen=True)
class ModelStates:
    """Per-rank model-state bytes of one step, where they live and when.

    Device bytes: ``parameters`` and ``optimizer`` (master copy and moments) are held all
    step; ``gradients`` are what the step holds at the end of backward, and ``gradients_from``
    says since when: ``"backward"`` (grown parameter by parameter), ``"first bucket"``
    (allocated whole when the first reduce bucket is flushed: ZeRO-2), ``"end of backward"``
    (ZeRO-2 whose bucket holds the whole model: flushed once, by the last hook) or ``"always"`` (a
    persistent buffer: ZeRO-3). ``buffers``: DeepSpeed's gradient buffers held all step
    (ZeRO-3's reduce bucket, the offload staging buffer). ``bucket``: stages 1-2's reduce
    bucket, which lives in backward only: 0.19.8 ``stage_1_and_2.py`` allocates it at the first
    gradient's hook (``process_gradients`` -> ``setup_buckets``) and frees it when the last hook
    has run (``independent_gradient_partition_epilogue`` -> ``_release_ipg_buffers``);
    ``bucket_until`` says which backward that is: ``"backward"``, each one (ZeRO-2: DeepSpeed's
    engine runs the epilogue after every backward), or ``"step"``, the last before the optimizer
    step (ZeRO-1: 0.19.8 ``runtime/engine.py`` ``allreduce_gradients`` reduces stage 1's gradients,
    and so runs the epilogue, only at the accumulation boundary, so with micro-batches the bucket
    made at the first one's first gradient is held through the later forwards). ``flush``: ZeRO-2's
    gradient bytes made before its first bucket is full and flushed, which allocates the partition
    (``"first bucket"``). ``gathered``: ZeRO-3's parameters gathered at any moment of forward and
    backward but the forward's first part, ``gathered_forward``: when the root's prefetch gathered
    the whole model, the forward holds its flat buffer with the copies until the last parameter is
    fetched (:func:`memlab.step.zero3_gathers.gathered_in_closed_form`). ``step_scratch``: what
    ``optimizer.step()`` adds (the gradient partition flattened and converted to fp32). ``host``:
    bytes in host memory by category. ``compute_precision``: the precision the forward runs in
    (``"pure-bf16"`` under DeepSpeed's 16-bit mode: no autocast, 16-bit weights).
    """

    parameters: float
    gradients: float
    optimizer: float
    deepspeed: bool
    compute_precision: str
    gradients_from: str = "backward"
    buffers: float = 0.0
    gathered: float = 0.0
    step_scratch: float = 0.0
    host: dict[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    bucket: float = 0.0
    flush: float = 0.0
    gathered_forward: float = 0.0
    bucket_until: str = "backward"

    @property
    def host_bytes(self) -> float:
        return float(sum(self.host.values()))

    def as_dict(self) -> dict[str, float]:
        """``parameters``, ``gradients``, ``optimizer`` (device) and ``host`` (all host
        bytes): the shape :func:`model_state_bytes` returns."""
        return {"parameters": self.parameters, "gradients": self.gradients,
                "optimizer": self.optimizer, "host": self.host_bytes}

    def peak_inputs(self) -> dict[str, float]:
        """The quantities the estimate's peak moments use: ``parameters``, ``optimizer``,
        ``gradients`` (grown through backward), ``held`` (gradient bytes held all step),
        ``late`` (held from the first reduce bucket on), ``bucket`` (held from the first
        gradient to the end of backward), ``bucket_step`` (``bucket`` when it is held to the last
        backward's end: ZeRO-1), ``flush`` (gradient bytes made before ``late`` is
        allocated), ``step`` (optimizer-step scratch), ``gathered`` and ``gathered_forward``
        (ZeRO-3's gathered parameters in forward and backward, and in the forward until the root's
        flat buffer goes)."""
        always = self.gradients if self.gradients_from == "always" else 0.0
        return {"parameters": self.parameters, "optimizer": self.optimizer,
                "gradients": self.gradients - always, "held": self.buffers + always,
                "late": self.gradients if self.gradients_from == "first bucket" else 0.0,
                "bucket": self.bucket, "bucket_step": self.bucket if self.bucket_until == "step" else 0.0,
                "flush": self.flush, "step": self.step_scratch,
                "gathered": self.gathered, "gathered_forward": self.gathered_forward}


@dataclass(frozen=True)
class ZeroBuckets:
    """DeepSpeed's ``zero_optimization`` sizes that decide its buffers (elements), as a run's
    config sets them (:mod:`memlab.hf.read_run_configs`); the defaults are memlab's own config's
    (:func:`memlab.step.write_deepspeed_config.deepspeed_config`).

    ``reduce``: ``reduce_bucket_size``, the contiguous gradient bucket (stages 1-3; two of
    them at stages 1-2 with ``overlap_comm``, ``setup_buckets`` in ``stage_1_and_2.py``);
    ``prefetch``: ``stage3_prefetch_bucket_size``, parameters gathered ahead of the running
    module, capped by ``max_live`` (``stage3_max_live_parameters``); ``persistence``:
    ``stage3_param_persistence_threshold``; ``pinned``: ``pin_memory`` of the offload;
    ``sub_group``: ``sub_group_size``, the elements of a rank's partition that stage 3's
    ``step()`` converts to fp32 and steps at a time (``stage3.py``: ``_create_fp16_sub_groups``
    closes a group once it holds ``sub_group_size`` elements, ``_prepare_fp32_grad_for_sub_group``
    converts its gradients, ``_release_sub_group`` frees them).
    """

    reduce: int = BUCKET_ELEMENTS
    prefetch: int = BUCKET_ELEMENTS
    max_live: int = 4 * BUCKET_ELEMENTS
    persistence: int = PERSISTENCE_THRESHOLD
    overlap_comm: bool = False
    pinned: bool = True
    sub_group: int = SUB_GROUP_SIZE


def _count(model, persistence: int = PERSISTENCE_THRESHOLD) -> tuple[int, int, int, list[int] | None]:
    """(parameters, largest parameter, elements in ZeRO-3's persistent small parameters, every
    parameter's elements; None for a parameter count)."""
    if isinstance(model, bool) or not isinstance(model, int):
        sizes = param_numels(model)
        return sum(sizes), max(sizes), sum(s for s in sizes if persists(s, persistence)), sizes
    if model < 0:
        raise InputError(f"num_params must be >= 0, got {model}")
    return model, 0, 0, None


def _sub_groups(model, part: float, n: int, sub: int, largest: int) -> list[float]:
    """Elements of each of ZeRO-3's optimizer sub-groups of a rank's partition of ``part``
    elements. 0.19.8 ``stage3.py`` ``_create_fp16_sub_groups`` (lines 1210-1232) walks the
    parameters and closes a group once it holds ``sub_group_size`` partition elements: groups
    of about that size while it exceeds a parameter's partition; below that (a config's
    ``sub_group_size: 0`` or 1) every parameter's partition is its own group, walked here
    parameter by parameter (a parameter count alone: groups no smaller than the largest
    partition, as nothing finer is known)."""
    if sub >= part:
        return [part]
    if largest and sub < largest / n and not isinstance(model, int):
        groups, acc = [], 0.0
        for numel in param_numels(model):
            acc += numel / n
            if acc >= sub:
                groups.append(acc)
                acc = 0.0
        return groups + ([acc] if acc else [])
    sub = max(sub, largest / n if largest else part / 10_000)
    return [sub] * int(part // sub) + [part % sub]


def _gathered(sizes: list[int] | None, psi: int, e: int, n: int, buckets: ZeroBuckets) -> tuple[float, float]:
    """ZeRO-3's gathered bytes ``(forward, held)``: :func:`memlab.step.zero3_gathers.gathered_in_closed_form`
    of the parameters' sizes; a parameter count alone, a prefetch bucket (no sizes to decide more by)."""
    if sizes is None:
        return (e * min(buckets.prefetch, buckets.max_live, psi),) * 2
    return gathered_in_closed_form(sizes, world_size=n, element_bytes=e, prefetch=buckets.prefetch,
                                   max_live=buckets.max_live, persistence=buckets.persistence)


def _check_layout(precision: str, optimizer: str, zero: int, world_size: int, offload: str) -> None:
    """The arguments of :func:`model_states` that name no layout, refused before any is built."""
    if zero not in (0, 1, 2, 3) or isinstance(zero, bool):
        raise InputError(f"ZeRO stage {zero!r} is outside 0-3")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"world size {world_size!r} must be a positive integer")
    check_precision(precision)
    if optimizer not in BLOCKWISE:
        moment_bytes(optimizer)  # refuses an optimizer memlab keeps no moments of, before the layout
    if offload not in (*OFFLOADS, PARAM_OFFLOAD):
        raise InputError(f"offload={offload!r}; allowed: {', '.join((*OFFLOADS, PARAM_OFFLOAD))}")
    if offload in ("all", PARAM_OFFLOAD) and zero != 3:
        raise InputError(f"offload={offload!r} (parameters too) needs ZeRO stage 3, got stage {zero}")
    if offload == "optimizer" and zero == 0:
        raise InputError("offload='optimizer' needs ZeRO stage 1-3 (DeepSpeed's ZeRO optimizer), "
                         "got stage 0")


def model_states(model, *, precision: str = "fp32", optimizer: str = "adamw", zero: int = 0,
                 world_size: int = 1, offload: str = "none", deepspeed: bool | None = None,
                 pinned: bool = True, bucket_elements: int = BUCKET_ELEMENTS,
                 buckets: ZeroBuckets | None = None, per_tensor: bool = False) -> ModelStates:
    """Per-rank model states of a step (see the module docstring for the layouts).

    ``model`` is a model config (exact largest and small parameters for DeepSpeed's buffers)
    or a parameter count (buffers then left out). ``deepspeed=None`` decides by
    :func:`under_deepspeed`; ``True`` gives DeepSpeed's layout at stage 0 too (what a
    DeepSpeed config with stage 0 runs). ``pinned=False`` counts host buffers at their own
    size (DeepSpeed's CPU accelerator does not pin). ``buckets`` (a :class:`ZeroBuckets`)
    replaces ``bucket_elements`` and ``pinned`` with a run config's sizes. ``per_tensor``: one
    optimizer per parameter (the step in backward; 8-bit state keeps its maps per tensor).

    Over 80 lines because it is the layouts' table (plain PyTorch, DeepSpeed stages 0-3, offload),
    one line per state and layout.
    """
    if buckets is None:
        buckets = ZeroBuckets(reduce=bucket_elements, prefetch=bucket_elements,
                              max_live=4 * bucket_elements, pinned=pinned)
    _check_layout(precision, optimizer, zero, world_size, offload)
    psi, largest, small, sizes = _count(model, buckets.persistence)
    ds = under_deepspeed(zero, offload) if deepspeed is None else deepspeed
    if not ds:
        if zero or offload != "none":
            raise InputError("ZeRO and offload run under DeepSpeed: deepspeed=False needs zero=0 "
                             "and offload='none'")
        w, g = PLAIN[precision]
        if optimizer in BLOCKWISE:
            return _eight_bit_states(w * psi, g * psi, sizes or [psi], optimizer, precision, per_tensor, w)
        return ModelStates(w * psi, g * psi, moment_bytes(optimizer, w) * psi, False, precision)
    if optimizer in BLOCKWISE:
        raise InputError(f"optimizer={optimizer!r} is bitsandbytes' or torchao's own, for plain PyTorch; "
                         f"DeepSpeed's ZeRO "
                         f"optimizer keeps its fp32 state: allowed with it: zero=0, offload='none'")
    e = 4 if precision == "fp32" else 2  # DeepSpeed's bf16/fp16 mode casts the model to 16 bits
    compute = "fp32" if e == 4 else "pure-bf16"
    master = 0 if (e == 4 and zero == 0) else 4  # fp32 stage 0: the model is the master
    n = world_size
    shard = n if zero >= 1 else 1
    notes = [f"DeepSpeed layout: {e} + {e} + {master + moment_bytes(optimizer)} bytes per parameter "
             f"(weights, gradients, fp32 master and moments), ZeRO-{zero} over {n} rank(s)"]
    split = zero_formula(psi, zero, n, param_bytes=e, grad_bytes=e, k=master + moment_bytes(optimizer))
    params = split["parameters"] + (e * small if zero >= 3 else 0)
    grads, opt = split["gradients"], split["optimizer"]
    grads_from = {0: "backward", 1: "backward", 2: "first bucket", 3: "always"}[zero]
    if zero == 2 and psi and buckets.reduce >= psi:
        # the partition is allocated when the first bucket is flushed: a bucket as large as
        # the model fills only with the last gradient, at the end of backward; until then each
        # gradient is copied into the bucket at its hook and freed
        grads_from = "end of backward"
    # the reduce bucket, doubled at stages 1-2 under overlap_comm (stage 3 keeps one)
    copies = 2 if buckets.overlap_comm and zero in (1, 2) else 1
    bucket = copies * e * buckets.reduce if zero >= 1 else 0
    # stage 3 keeps its bucket all step; stages 1-2 allocate theirs in each backward
    buffers, in_backward = (bucket, 0.0) if zero >= 3 else (0.0, bucket)
    gathered_forward, gathered = _gathered(sizes, psi, e, n, buckets) if zero >= 3 else (0.0, 0.0)
    # step(): stage 1 (and stage 0's 16-bit optimizer) flattens the gradient partition, the
    # 16-bit modes convert it to fp32; fp32 stage 0 is torch's own optimizer, no copy
    flat = zero == 1 or (zero == 0 and e != 4)
    scratch = (e * psi / shard if flat else 0.0) + (4 * psi / shard if e != 4 else 0.0)
    if zero == 3 and e != 4:  # one sub-group's fp32 gradients at a time (ZeroBuckets.sub_group)
        scratch = 4 * min(psi / shard, buckets.sub_group + largest / n)
    host: dict[str, float] = {}
    pin = pinned_bytes if buckets.pinned else (lambda b: int(b))

    def add(category: str, nbytes: float) -> None:
        host[category] = host.get(category, 0.0) + nbytes

    if offload in ("optimizer", "all"):
        part = psi / shard  # elements of this rank's partition
        add("optimizer", moment_bytes(optimizer) * part)  # torch.optim's moments: ordinary host memory
        opt, scratch = 0.0, 0.0
        if zero <= 2:
            add("optimizer", pin(4 * part))            # fp32 master partition (pinned)
            add("gradients", pin(4 * part))            # fp32 gradient partition (pinned)
            add("gradients", pin(4 * largest))         # host staging of one parameter's gradient
            add("parameters", pin(e * part))           # 16-bit copy of the updated partition
            buffers = e * largest                      # device staging of one parameter's gradient
            grads, grads_from = 0.0, "backward"
        else:
            add("optimizer", 4 * part)                 # fp32 master (unpinned clone)
            chunks = _sub_groups(model, part, n, buckets.sub_group, largest)
            add("gradients", sum(pin(4 * c) for c in chunks))  # fp32 gradients per sub-group
            add("gradients", pin(e * part))            # the 16-bit gradient partition
            grads = 0.0
        notes.append("offload: fp32 master, moments and fp32 gradients in host memory")
    if offload in ("all", PARAM_OFFLOAD):
        add("parameters", pin(e * psi / n))            # the 16-bit parameter partition
        params = e * small
        notes.append("parameter offload: the device keeps the small persistent parameters and "
                     "those gathered for the running module")
    flush = e * buckets.reduce if grads_from == "first bucket" else 0.0
    return ModelStates(params, grads, opt, True, compute, grads_from, buffers, gathered, scratch,
                       host, tuple(notes), in_backward, flush, gathered_forward,
                       bucket_until="step" if zero == 1 else "backward")


def _eight_bit_states(params: float, grads: float, sizes: list[int], optimizer: str, precision: str,
                      per_tensor: bool, element_bytes: int = 4) -> ModelStates:
    """Plain PyTorch's states with bitsandbytes' 8-bit AdamW or torchao's low-bit AdamW over tensors of
    ``sizes`` elements of ``element_bytes`` (:func:`memlab.step.low_bit.adam_state_bytes`); a paged one's
    large tensors' moments in host memory (:func:`memlab.step.low_bit.paged_state_bytes`)."""
    state = adam_state_bytes(sizes, optimizer, per_tensor=per_tensor, element_bytes=element_bytes)
    per = f"{state / max(sum(sizes), 1):.3f} B per parameter"
    if optimizer in PAGED:
        paged = paged_state_bytes(sizes, optimizer)
        return ModelStates(params, grads, float(state - paged), False, precision, host={"optimizer": float(paged)},
                           notes=(paged_note(optimizer, state, paged) + f" ({per} in all)",))
    # torchao's compiled update of the largest quantised tensor: its buffers while it runs
    scratch = max((torchao_update_bytes(n, optimizer) for n in sizes), default=0) if optimizer in TORCHAO else 0
    return ModelStates(params, grads, float(state), False, precision, step_scratch=float(scratch),
                       notes=(f"{optimizer} state: {per}",))


def zero2_partition_elements(sizes: list[int], world_size: int) -> list[int]:
    """Elements of DeepSpeed's stage-2 gradient partition on each rank: ``grads_in_partition``
    holds every parameter that overlaps the rank's share of the flat group *whole*, not the share.

    DeepSpeed 0.19.8 ``runtime/zero/stage_1_and_2.py``: the trainable parameters are flattened in
    the order the optimizer is given them (the model's ``parameters()``), with no padding between
    them (line 444: ``param_alignment`` is 1 unless ``zero_optimization.parameter_alignment``)
    and the group padded to a multiple of ``nccl_start_alignment_factor`` (2, line 387) times the
    ranks (lines 441, 446); each rank's share is ``len(flat) // world_size`` (line 586);
    ``get_partition_info`` (lines 2579-2611) puts in ``params_in_partition`` every parameter
    that starts inside the share or straddles its start; ``copy_grads_in_partition`` (lines
    2184-2195) allocates ``grads_in_partition`` as the sum of their ``numel()``, once per backward,
    and with gradient accumulation the micro-batches' sum is held in it between backwards.

    Args:
        sizes: every trainable parameter's elements, in the model's order.
        world_size: the data-parallel ranks.

    Returns:
        One figure per rank, rank 0 first.
    """
    n = world_size
    alignment = 2 * n
    share = -(-sum(sizes) // alignment) * alignment // n
    ends = list(itertools.accumulate(sizes))
    starts = [e - s for e, s in zip(ends, sizes, strict=True)]
    out = []
    for rank in range(n):
        lo, hi = share * rank, share * (rank + 1)
        # a parameter counts when it starts in [lo, hi) or straddles lo (start < lo < end); an
        # empty one adds nothing either way
        first = bisect.bisect_right(ends, lo)  # the first parameter ending past lo
        last = bisect.bisect_left(starts, hi)  # parameters starting at or past hi do not count
        out.append(sum(sizes[first:last]))
    return out


def with_zero2_partition(ms: ModelStates, sizes: list[int], world_size: int, rank: int | None = None) -> ModelStates:
    """``ms`` (a ZeRO-2 step's states, no offload) with the gradient partition of ``rank`` as
    DeepSpeed allocates it (:func:`zero2_partition_elements`), the largest rank's when ``rank`` is
    None; any other step's states unchanged."""
    if ms.gradients_from not in ("first bucket", "end of backward") or not sizes:
        return ms
    per_rank = zero2_partition_elements(sizes, world_size)
    e = 4 if ms.compute_precision == "fp32" else 2
    grads = e * (max(per_rank) if rank is None else per_rank[rank])
    return replace(ms, gradients=float(grads))


def data_parallel_ranks(world_size: int, tensor_parallel: int) -> int:
    """The data-parallel degree left when groups of ``tensor_parallel`` ranks split each layer
    (Megatron-LM): ``world_size / t``, the ranks ZeRO shards over.

    Raises:
        InputError: ``t`` is not a positive integer dividing ``world_size``.
    """
    t = tensor_parallel
    if isinstance(t, bool) or not isinstance(t, int) or t < 1:
        raise InputError(f"tensor_parallel must be a positive integer, got {t!r}")
    if world_size % t:
        divisors = (str(k) for k in range(1, world_size + 1) if world_size % k == 0)
        raise InputError(f"tensor_parallel={t} must divide world_size={world_size}; "
                         f"allowed: {', '.join(divisors)}")
    return world_size // t


def tensor_parallel_share(states: dict[str, float], tensor_parallel: int) -> dict[str, float]:
    """One tensor-parallel rank's model states: those of the model over its
    :func:`data_parallel_ranks` (ZeRO's sharding), divided by ``t``, as Megatron-LM splits each
    weight matrix (Shoeybi et al. 2019, sec. 3) and with it its gradient and optimizer state.
    The norm weights, which every TP rank keeps whole, are counted as split: a fraction of a
    percent. Both estimates (memlab's GPT, a decoder's shape) take their per-rank states here."""
    return {k: v / tensor_parallel for k, v in states.items()}


def step_model_states(step, buckets: ZeroBuckets | None = None) -> ModelStates:
    """The model states of a :class:`memlab.step.training_step.StepConfig` (its model, precision,
    optimizer, ZeRO stage, world size and offload), with a run config's ``buckets``."""
    return model_states(step.model_config, precision=step.precision, optimizer=step.optimizer,
                        zero=step.zero, world_size=step.world_size, offload=step.offload,
                        buckets=buckets, per_tensor=step.optimizer_in_backward)


def model_state_bytes(num_params: int, *, precision: str = "fp32", optimizer: str = "adamw",
                      zero: int = 0, world_size: int = 1, offload: str = "none") -> dict[str, float]:
    """Parameters, gradients and optimizer state per rank on the device, and the bytes in
    host memory (``"host"``), for a model of ``num_params`` parameters: plain PyTorch without
    ZeRO or offload, DeepSpeed's layout with them (:func:`model_states`)."""
    return model_states(num_params, precision=precision, optimizer=optimizer, zero=zero,
                        world_size=world_size, offload=offload).as_dict()


def bytes_per_param(precision: str, stage: int, world_size: int, *, optimizer: str = "adamw",
                    deepspeed: bool = True) -> dict[str, float]:
    """Bytes per parameter on one rank: ``parameters``, ``gradients`` and ``optimizer`` (fp32
    master and moments) as :func:`model_states` counts them (DeepSpeed's layout by default)."""
    s = model_states(1, precision=precision, optimizer=optimizer, zero=stage,
                     world_size=world_size, deepspeed=deepspeed)
    return {"parameters": s.parameters, "gradients": s.gradients, "optimizer": s.optimizer}


__all__ = ["data_parallel_ranks", "tensor_parallel_share", "ModelStates", "model_states", "model_state_bytes",
           "under_deepspeed", "step_model_states", "bytes_per_param", "param_numels", "pinned_bytes",
           "BUCKET_ELEMENTS", "PERSISTENCE_THRESHOLD", "PARAM_OFFLOAD", "SUB_GROUP_SIZE", "ZeroBuckets",
           "with_zero2_partition", "zero2_partition_elements"]
