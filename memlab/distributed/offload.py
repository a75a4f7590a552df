"""Offload: what ZeRO-Offload moves off the device, and what it costs, measured on ranks.

:func:`measure_offload` runs ZeRO with and without optimizer (and parameter) offload in one
launch and reports, per case, the device's peak and base, the host bytes DeepSpeed's
accounting gives and how much the process's resident memory grew (Ren et al. 2021,
"ZeRO-Offload", sec. 4.1; :mod:`memlab.step.states` for the formula).
"""
from __future__ import annotations

import os
import shutil
from dataclasses import replace

from memlab.core.hardware import Placement, place_ranks
from memlab.distributed.deepspeed_zero import zero_worker
from memlab.distributed.ranks import run_ranks
from memlab.step.write_deepspeed_config import deepspeed_config

OFFLOAD_CASES = ((2, "none"), (2, "optimizer"), (3, "all"))


def cpu_adam_buildable() -> tuple[bool, str]:
    """Whether DeepSpeed can JIT-compile its ``DeepSpeedCPUAdam`` op here (a C++ compiler
    and ninja), and why not."""
    from torch.utils.cpp_extension import is_ninja_available  # heavy: only when asked
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return False, f"no C++ compiler ({cxx!r} is not on PATH)"
    if not is_ninja_available():
        return False, "ninja is not installed"
    return True, f"{cxx} and ninja found"


def measure_offload(step, *, cases=OFFLOAD_CASES, placement: Placement | None = None,
                    cpu_adam: bool = False, timeout: float = 900.0) -> list[dict]:
    """ZeRO with and without offload, one row per ``(stage, offload)`` case, in one launch.

    On CUDA ranks the device figures are the caching allocator's: ``device_peak_bytes`` is
    ``max_memory_allocated`` over the timed step (run without the tracker),
    ``device_base_bytes`` what the engine held before it. On CPU ranks host and device are
    one memory: the device peak is the tracked peak less what ZeRO-Offload keeps on the host,
    the base the model states DeepSpeed keeps on the device (``source`` says which). Both
    give ``host_bytes`` (DeepSpeed's accounting of the offloaded fp32 master, Adam's state, the fp32
    gradient partition and, with ``"all"``, the parameters), how much the process's resident memory
    grew while the engine was built and run (``rss_growth_bytes``, psutil) and the step time.
    ``cpu_adam`` runs the offloaded optimizer as DeepSpeed's compiled ``DeepSpeedCPUAdam`` instead
    of torch's AdamW (offload cases only). Rows are rank 0's.
    """
    placement = placement or place_ranks(step.world_size)
    steps = []
    for zero, offload in cases:
        s = replace(step, zero=zero, offload=offload, world_size=placement.world_size)
        deepspeed_config(s, torch_adam=not cpu_adam)  # validate before spawning anything
        steps.append(s)
    on_cuda = placement.device_type == "cuda"
    threads = max(1, (os.cpu_count() or 1) // placement.world_size) if on_cuda else None
    ranks = run_ranks(zero_worker, placement.world_size, placement=placement, timeout=timeout,
                      kwargs={"steps": steps, "torch_adam": not cpu_adam, "track": not on_cuda,
                              "threads": threads})
    rows = []
    for s, res in zip(steps, ranks[0], strict=True):
        acc = res.accounting
        if on_cuda:
            peak, base, source = res.device_peak_bytes, res.device_base_bytes, "allocator"
        else:
            # parameters offloaded at stage 3 are gathered to the device for each layer: the
            # tracker saw them there, so only the optimizer side leaves the device's count
            peak = res.peak_bytes - sum(acc[k] for k in res.host_accounts if k != "parameters")
            base = res.device_account_bytes()
            source = "accounting"
        rss = (res.rss_bytes - res.rss_start_bytes) if res.rss_bytes is not None else None
        rows.append({"zero": s.zero, "offload": s.offload, "optimizer": res.optimizer,
                     "device": placement.device_type, "source": source,
                     "device_peak_bytes": peak, "device_base_bytes": base,
                     "host_bytes": res.host_account_bytes(),
                     "rss_growth_bytes": rss, "step_seconds": res.step_seconds,
                     "accounting": dict(acc)})
    return rows


# --------------------------------------------------------------------------------------
# Per-rank memory without the ranks: FSDP2 on a fake process group and fake tensors
# --------------------------------------------------------------------------------------


__all__ = ["OFFLOAD_CASES", "cpu_adam_buildable", "measure_offload"]
