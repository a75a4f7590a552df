"""Will a real step fit this machine? Checked before anything is built.

A measurement builds the model, its optimizer state and one step for real, so a step too
large for the machine does not fail politely: the host swaps or the allocator raises
``DefaultCPUAllocator: can't allocate memory`` half-way through building. :func:`preflight`
estimates the step first (:func:`memlab.lenses.estimate.estimate_step`, per rank) and

* under a simulated budget, returns a ``fits: false`` report with an OOM at phase ``build``
  when the parameters and optimizer state alone exceed the budget (the budget covers the
  whole step, building included);
* raises :class:`HostMemoryError` when the memory the step needs is more
  than the machine has available: host RAM on CPU, free device memory on CUDA.

The rule, ``need = MARGIN[device] x held + PROCESS_BYTES`` (``held``: the estimate's peak per
rank, capped at the budget when there is one; multi-rank runs on one host add up
``DEEPSPEED_HOST_FACTOR x margin x held + RANK_PROCESS_BYTES`` per rank), and where each of
its numbers comes from (the estimate's measured errors on CPU and on the H200 reference) are
written down once, in ``docs/guard.md``; ``tests/test_docs.py`` holds that page to the
constants below.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import psutil
import torch

from memlab.core.cards import detect_card
from memlab.core.errors import InputError
from memlab.core.units import MiB, fmt_bytes
from memlab.lenses.estimate import estimate_step
from memlab.models.gpt_unet import GPTConfig
from memlab.policy import get_target
from memlab.step.states import step_model_states
from memlab.step.training_step import MemoryReport, StepConfig
from memlab.tracking.tracker import CATEGORIES, OOMInfo


class HostMemoryError(InputError):
    """A real step that this machine cannot hold, refused before anything was allocated.

    ``need_bytes`` is what the step needs by :mod:`memlab.lenses.guard`'s rule, ``available_bytes``
    what ``resource`` (``"host RAM"``, ``"free memory on cuda:0"``) has now; ``way_out`` says
    what to run instead. ``str()`` is one line.

    Args:
        need_bytes, available_bytes, resource, way_out: as above.
        rule: the guard's rule the step broke.
    """

    def __init__(self, need_bytes: int, available_bytes: int, resource: str, rule: str,
                 way_out: str = "simulate it instead (`memlab simulate` with the same flags, or "
                                "memlab.lenses.simulate.simulate_step) or choose a smaller model, "
                                "sequence or batch"):
        self.need_bytes, self.available_bytes = int(need_bytes), int(available_bytes)
        self.resource, self.rule, self.way_out = resource, rule, way_out
        super().__init__(self._line())

    def _line(self) -> str:
        return (f"measuring this step needs about {fmt_bytes(self.need_bytes)} of {self.resource} "
                f"({self.rule}) but only {fmt_bytes(self.available_bytes)} is available; "
                f"{self.way_out}")

    def with_way_out(self, way_out: str) -> "HostMemoryError":
        """The same refusal with another way out (the CLI names the exact command)."""
        return HostMemoryError(self.need_bytes, self.available_bytes, self.resource, self.rule,
                               way_out)


MARGIN = {"cpu": 1.15, "cuda": 1.3}
PROCESS_BYTES = 256 * MiB
RANK_PROCESS_BYTES = 512 * MiB
DEEPSPEED_HOST_FACTOR = 2.0


# --------------------------------------------------------------------------------------
# What is available
# --------------------------------------------------------------------------------------
def host_available_bytes() -> int:
    """Host RAM a new allocation can get now without swapping: ``psutil``'s available memory,
    lowered to the container's limit (cgroup v2 or v1) when there is one."""
    avail = psutil.virtual_memory().available
    headroom = _cgroup_headroom()
    return int(avail if headroom is None else min(avail, headroom))


def host_total_bytes() -> int:
    """This machine's RAM (``psutil``), lowered to the container's memory limit when there is
    one: what a plan's offloaded states may take at most."""
    total = psutil.virtual_memory().total
    limit = _cgroup_limit()
    return int(total if limit is None else min(total, limit))


def process_headroom_bytes() -> int | None:
    """Address space this process may still map under ``RLIMIT_AS`` (``ulimit -v``), or
    ``None`` when unlimited (or not on a Unix)."""
    try:
        import resource  # POSIX only: no RLIMIT_AS on Windows
    except ImportError:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    return max(0, soft - psutil.Process().memory_info().vms)


def device_available_bytes(device: torch.device | str) -> int:
    """Memory a new allocation can get on a CUDA device now: the driver's free memory
    (``torch.cuda.mem_get_info``) plus the blocks this process's caching allocator holds
    with no tensor in them (:func:`cached_free_bytes`), which the allocator frees and
    retries with before it raises an OOM (``release_cached_blocks`` in
    ``c10/cuda/CUDACachingAllocator.cpp``). On CPU, the host's (:func:`host_available_bytes`)."""
    device = torch.device(device)
    if device.type == "cuda":
        free = int(torch.cuda.mem_get_info(device)[0])
        capped = fraction_headroom_bytes(device)
        return (free if capped is None else min(free, capped)) + cached_free_bytes(device)
    return host_available_bytes()


def fraction_headroom_bytes(device: torch.device | str) -> int | None:
    """What ``set_per_process_memory_fraction`` still lets this process reserve on a CUDA
    device (``fraction x total - memory_reserved``), or ``None`` without a cap. A rehearsal
    of a smaller card (:func:`memlab.classroom.lesson.rehearse`) or an instructor's split of one GPU
    sets it; ``mem_get_info`` does not see it."""
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is None:  # older torch: the cap cannot be read (pytorch/pytorch#140620)
        return None
    index = torch.device(device).index or 0
    fraction = getter(index)
    if fraction >= 1.0:
        return None
    total = torch.cuda.get_device_properties(index).total_memory
    return max(0, int(fraction * total) - int(torch.cuda.memory_reserved(device)))


def cached_free_bytes(device: torch.device | str) -> int:
    """Bytes this process has reserved on a CUDA device but not allocated to tensors
    (``memory_reserved - memory_allocated``): an earlier cell's cache, invisible to
    ``mem_get_info`` (which counts it as used) but usable by the next step."""
    return max(0, int(torch.cuda.memory_reserved(device)) - int(torch.cuda.memory_allocated(device)))


#: (limit, usage, stat, reclaimable key) of the memory cgroup, v2 then v1
CGROUP_FILES = (("memory.max", "memory.current", "memory.stat", "inactive_file"),
                ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
                 "total_inactive_file"))


def _cgroup_limit() -> int | None:
    """The memory cgroup's limit in bytes; ``None`` without one."""
    for limit_f, *_ in CGROUP_FILES:
        try:
            with open(os.path.join("/sys/fs/cgroup", limit_f)) as f:
                text = f.read().strip()
            return None if text == "max" or int(text) >= 2**60 else int(text)  # v1: a huge number
        except (OSError, ValueError):
            continue
    return None


def _cgroup_headroom() -> int | None:
    """``limit - usage`` of this process's memory cgroup, page cache that can be reclaimed
    counted as free; ``None`` without a limit."""
    limit = _cgroup_limit()
    if limit is None:
        return None
    for _, usage_f, stat_f, key in CGROUP_FILES:
        try:
            with open(os.path.join("/sys/fs/cgroup", usage_f)) as f:
                usage = int(f.read())
            inactive = 0
            with open(os.path.join("/sys/fs/cgroup", stat_f)) as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    if name == key:
                        inactive = int(value)
            return max(0, limit - usage + inactive)
        except (OSError, ValueError):
            continue
    return None


# --------------------------------------------------------------------------------------
# What the step needs
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryNeed:
    """One comparison of the rule: ``need_bytes`` of ``resource`` against what is available."""

    resource: str
    need_bytes: int
    available_bytes: int
    rule: str

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.available_bytes


@dataclass(frozen=True)
class StepEstimate:
    """Per rank: the estimated peak, model states (parameters, gradients, optimizer state on
    the device), what offload keeps in host memory, and the largest single tensor."""

    peak_bytes: int
    parameters: int
    optimizer: int
    model_states: int
    host_bytes: int
    largest_tensor_bytes: int | None
    by_category: dict = field(default_factory=dict)


def estimate_for(step: StepConfig, target: str = "cpu", estimate: MemoryReport | None = None) -> StepEstimate:
    """The figures :func:`preflight` works from, per rank, from the closed-form estimate for
    the device the step will run on (``target``: ``"cpu"`` or ``"cuda"``); ``estimate``: one
    made elsewhere (a Hugging Face decoder's, :func:`memlab.lenses.decoder_estimate.estimate_run`), whose
    categories give the model states."""
    if estimate is not None:
        cats = estimate.by_category
        held = int(cats["parameters"] + cats["gradients"] + cats["optimizer"])
        return StepEstimate(estimate.peak_bytes, int(cats["parameters"]), int(cats["optimizer"]), held,
                            int(estimate.host_bytes or 0), None, dict(cats))
    est = estimate_step(step, target=target)
    ms = step_model_states(step)  # the estimate's own model states: one ZeRO division
    held = int(ms.parameters + ms.gradients + ms.optimizer)
    return StepEstimate(est.peak_bytes, int(est.by_category["parameters"]),
                        int(est.by_category["optimizer"]), held, int(ms.host_bytes),
                        largest_tensor_bytes(step), dict(est.by_category))


def largest_tensor_bytes(step: StepConfig) -> int | None:
    """An upper bound on the largest single tensor of a GPT step (``None`` for other models):
    the fp32 logits or their log-softmax (``t V``), the embedding or its gradient (``V h``),
    the MLP's hidden activation (``t f``), naive attention's scores (``b a s^2``), 4 bytes
    each, with ``t`` the tokens of one micro-batch."""
    cfg = step.model_config
    if not isinstance(cfg, GPTConfig):
        return None
    b = step.batch // step.micro_batches
    t = step.seq * b
    sizes = [t * cfg.vocab_size, cfg.vocab_size * cfg.d_model, t * cfg.hidden]
    if cfg.attention == "naive" and cfg.checkpointing != "selective":
        sizes.append(b * cfg.n_head * step.seq ** 2)
    return 4 * max(sizes)


def target_for(device: torch.device | str):
    """What the guard estimates with on ``device``: ``"cpu"``, or the CUDA target of the card
    this process runs on (:func:`memlab.core.cards.detect_card`: its kernels and workspace)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    return get_target("cuda", card=detect_card())


def _held(est: StepEstimate, device_type: str, budget_bytes: int | None,
          with_host: bool) -> tuple[int, str]:
    """Bytes one process holds at its peak, and how that was found (for the message)."""
    peak = est.peak_bytes + (est.host_bytes if with_host else 0)
    what = f"estimate {fmt_bytes(peak)}"
    if budget_bytes is None:
        return peak, what
    if device_type == "cuda":
        over = 0  # the capped allocator refuses the op that would cross the budget
    elif est.largest_tensor_bytes is None:
        return peak, what  # no bound on one op's overshoot: count the whole step
    else:
        over = est.largest_tensor_bytes
    capped = max(min(peak, budget_bytes + over), est.model_states)
    if capped >= peak:
        return peak, what
    how = f"budget {fmt_bytes(budget_bytes)}" + (f" + largest tensor {fmt_bytes(over)}" if over else "")
    return capped, f"the step stopped at the {how}"


def cuda_need(step: StepConfig, target, budget_bytes: int | None = None) -> int:
    """Bytes the guard asks of a GPU for ``step`` in this process, for the card of ``target``
    (a :class:`~memlab.policy.Target`): ``margin x held + overhead``, without reading any
    device (lesson sizing plans with it for cards that are not here)."""
    held, _ = _held(estimate_for(step, target), "cuda", budget_bytes, with_host=False)
    return math.ceil(MARGIN["cuda"] * held) + PROCESS_BYTES


def memory_needs(step: StepConfig, device: torch.device | str = "cpu",
                 budget_bytes: int | None = None, *, spawned: bool = False,
                 est: StepEstimate | None = None) -> list[MemoryNeed]:
    """Each comparison :func:`preflight` makes for ``step`` on ``device``: one for a step in
    this process; for ``spawned`` ranks (``step.world_size`` DeepSpeed processes on this
    host), host RAM for all of them, the address space of each under ``ulimit -v``, and on
    CUDA the free memory of the GPUs they share."""
    device = torch.device(device)
    est = est or estimate_for(step, target_for(device))
    kind = device.type
    headroom = process_headroom_bytes()
    if not spawned:
        held, what = _held(est, kind, budget_bytes, with_host=False)
        need = math.ceil(MARGIN[kind] * held) + PROCESS_BYTES
        rule = f"{what} x {MARGIN[kind]} + {fmt_bytes(PROCESS_BYTES)} for the process"
        if kind == "cuda":
            cached = cached_free_bytes(device)
            return [MemoryNeed(f"free memory on {device} (free + {fmt_bytes(cached)} cached by this "
                               f"process)", need, device_available_bytes(device), rule)]
        host = host_available_bytes()
        if headroom is not None and headroom < host:
            return [MemoryNeed("address space left under ulimit -v", need, headroom, rule)]
        return [MemoryNeed("host RAM", need, host, rule)]
    world = step.world_size
    needs = []
    if kind == "cpu":
        held, what = _held(est, kind, budget_bytes, with_host=True)
        per_rank = math.ceil(DEEPSPEED_HOST_FACTOR * MARGIN["cpu"] * held) + RANK_PROCESS_BYTES
        rank_rule = (f"{DEEPSPEED_HOST_FACTOR:g} x {MARGIN['cpu']} x {what} per rank + "
                     f"{fmt_bytes(RANK_PROCESS_BYTES)} for its process")
    else:
        held, what = _held(est, kind, budget_bytes, with_host=False)
        gpus = max(1, torch.cuda.device_count())
        sharing = math.ceil(world / gpus)  # ranks go round-robin over the GPUs
        on_gpu = sharing * (math.ceil(MARGIN["cuda"] * held) + PROCESS_BYTES)
        # the ranks are other processes: this one's cached blocks are of no use to them
        # unless returned to the driver first
        torch.cuda.empty_cache()
        free = min(torch.cuda.mem_get_info(i)[0] for i in range(min(gpus, world)))
        needs.append(MemoryNeed("free GPU memory (this process's cache emptied first)", on_gpu, free,
                                f"{sharing} rank(s) per GPU x ({what} x {MARGIN['cuda']} + "
                                f"{fmt_bytes(PROCESS_BYTES)} per process)"))
        per_rank = math.ceil(MARGIN["cpu"] * est.host_bytes) + RANK_PROCESS_BYTES
        rank_rule = (f"{fmt_bytes(est.host_bytes)} offloaded x {MARGIN['cpu']} + "
                     f"{fmt_bytes(RANK_PROCESS_BYTES)} for its process")
    if headroom is not None:  # ulimit -v applies to each rank process on its own
        needs.append(MemoryNeed("address space per rank under ulimit -v", per_rank, headroom, rank_rule))
    needs.append(MemoryNeed("host RAM", world * per_rank, host_available_bytes(),
                            f"{world} ranks x ({rank_rule})"))
    return needs


def build_oom_report(step: StepConfig, device: str, budget_bytes: int,
                     est: StepEstimate | None = None) -> MemoryReport | None:
    """A ``fits: false`` report with an OOM at phase ``build`` when the parameters and the
    optimizer state of one rank alone exceed ``budget_bytes``; ``None`` when they fit."""
    est = est or estimate_for(step, device)
    built = est.parameters + est.optimizer
    if built <= budget_bytes:
        return None
    cats = dict.fromkeys(CATEGORIES, 0)
    cats.update(parameters=est.parameters, optimizer=est.optimizer)
    culprit = max(cats, key=cats.get)
    msg = (f"Simulated device out of memory while building the model. Tried to allocate "
           f"{fmt_bytes(built)} for the parameters ({fmt_bytes(est.parameters)}) and the "
           f"optimizer state ({fmt_bytes(est.optimizer)}) (build_trainer, build); budget "
           f"{fmt_bytes(budget_bytes)}, so {fmt_bytes(built - budget_bytes)} short. Largest "
           f"category: {culprit} ({fmt_bytes(cats[culprit])}). Found by the estimate before "
           f"building: nothing was allocated.")
    oom = OOMInfo("build_trainer", step.model_config.name, "build", built, built, budget_bytes,
                  msg, cats)
    report = MemoryReport("measure", step, device, built, cats, budget_bytes, None, oom)
    report.notes.append("refused at build: peak_bytes and by_category are the estimate's "
                        "model states, not a measurement")
    if step.world_size > 1:
        report.per_rank = [MemoryReport("measure", step, device, built, dict(cats), budget_bytes,
                                        None, oom) for _ in range(step.world_size)]
    return report


def preflight(step: StepConfig, device: torch.device | str = "cpu",
              budget_bytes: int | None = None, *, spawned: bool = False,
              estimate: MemoryReport | None = None) -> MemoryReport | None:
    """Check ``step`` before building it: a build-phase OOM report when a budget cannot hold
    its model states, :class:`HostMemoryError` when this machine cannot hold the step, else
    ``None`` (go ahead). ``estimate``: as :func:`estimate_for`."""
    device = torch.device(device)
    est = estimate_for(step, target_for(device), estimate)
    if budget_bytes is not None:
        refused = build_oom_report(step, device.type, budget_bytes, est)
        if refused is not None:
            return refused
    for need in memory_needs(step, device, budget_bytes, spawned=spawned, est=est):
        if not need.fits:
            raise HostMemoryError(need.need_bytes, need.available_bytes, need.resource, need.rule)
    return None


def check_host(step: StepConfig) -> None:
    """Refuse (:class:`HostMemoryError`) to build a CPU trainer of ``step`` that host RAM
    cannot hold now; for helpers that build trainers themselves (compression, the table).
    Each call reads what is available anew, so trainers built earlier are accounted for."""
    for need in memory_needs(step, "cpu"):
        if not need.fits:
            raise HostMemoryError(need.need_bytes, need.available_bytes, need.resource, need.rule)


__all__ = ["MARGIN", "PROCESS_BYTES", "RANK_PROCESS_BYTES", "DEEPSPEED_HOST_FACTOR",
           "MemoryNeed", "StepEstimate", "HostMemoryError", "host_available_bytes",
           "process_headroom_bytes", "device_available_bytes", "cached_free_bytes",
           "fraction_headroom_bytes", "target_for", "cuda_need", "estimate_for",
           "largest_tensor_bytes", "memory_needs", "build_oom_report", "preflight", "check_host"]
