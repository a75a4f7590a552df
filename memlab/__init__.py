"""memlab: where the memory of a training step goes, and how to get it back.

The front door: ``import memlab as ml`` gives what a learner calls (``__all__``).

- Three lenses on one training step, each returning a :class:`MemoryReport`:
  :func:`estimate_step` (closed-form formulas), :func:`simulate_step` (fake tensors, for GPUs
  you do not have) and :func:`measure_step` (a real step, tracked exactly on CPU, with the
  allocator's statistics on CUDA).
- Many ranks: :func:`measure_distributed` (real DeepSpeed ZeRO/offload ranks),
  :func:`measure_zero` (several ZeRO stages in one launch), :func:`simulate_sharded` (one
  FSDP2 rank of N on fake tensors), :func:`measure_tensor_parallel`, :func:`measure_pipeline`.
- :func:`advise`: the techniques, in order, until the step fits a card; :func:`measure_table`:
  the comparison table of the techniques, measured.
- What the lessons build with: :class:`StepConfig`, :class:`GPTConfig` and the presets,
  :func:`build_trainer`, :func:`make_batch`, :class:`MemoryTracker`; sizes: :data:`MiB`,
  :data:`GiB`, :func:`fmt_bytes`; bad input raises :class:`InputError`.

Plumbing stays in its module (``memlab.core.hardware.Placement``, ``memlab.core.hardware.pick_device``,
...). Importing memlab loads neither DeepSpeed nor ipywidgets nor matplotlib: the modules that
need them (``distributed``'s rank workers, ``widgets``, ``plots``) load them when used.
The layers, lowest first, and what each module owns: the module map in ``docs/modules.md``
(``tools/modmap.py``, checked by ``tests/test_architecture.py``).
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import pathlib
from typing import TYPE_CHECKING, Any

from memlab.core.quiet import quiet_offline_kernels

# The names below load when first used (module __getattr__): `memlab --help` and `memlab
# estimate` need a few modules, and importing every lens, DeepSpeed's launcher and the
# Hugging Face readers cost seconds more than torch itself. These imports are the one list
# of what the front door exports and where each name lives (read by _homes(); type checkers
# and tools/modmap.py read them as written).
if TYPE_CHECKING:
    from memlab.classroom.technique_table import measure_table
    from memlab.core.errors import InputError
    from memlab.core.hardware import GPU_PRESETS, place_ranks, resolve_budget
    from memlab.core.units import GiB, MiB, fmt_bytes, parse_size
    from memlab.distributed.deepspeed_zero import measure_distributed, measure_zero
    from memlab.distributed.fsdp import simulate_sharded
    from memlab.distributed.pipeline_parallel import measure_pipeline
    from memlab.distributed.tensor_parallel import measure_tensor_parallel
    from memlab.lenses.estimate import estimate_step
    from memlab.lenses.guard import HostMemoryError
    from memlab.lenses.measure import measure_step, time_step
    from memlab.lenses.simulate import simulate_step
    from memlab.lenses.your_model import simulate_model, track_step
    from memlab.models.gpt_unet import GPT, PRESETS, UNET_PRESETS, GPTConfig, UNet, UNetConfig, build_model, get_config
    from memlab.planning.advisor import Advice, advise
    from memlab.step.parallel_dims import ParallelDims
    from memlab.step.training_step import MemoryReport, StepConfig, build_trainer, make_batch
    from memlab.tracking.tracker import CATEGORIES, MemoryTracker

quiet_offline_kernels()  # before peft or transformers import bitsandbytes (memlab.core.quiet)

__version__ = "0.1.0"


def _homes() -> dict[str, str]:
    """Each exported name -> its module, from the ``TYPE_CHECKING`` imports above."""
    if not _HOMES:
        tree = ast.parse(pathlib.Path(__file__).read_text())
        block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
        for node in block.body:
            _HOMES.update({a.name: node.module for a in node.names})
    return _HOMES


_HOMES: dict[str, str] = {}


def __getattr__(name: str) -> Any:
    """An exported name (``ml.estimate_step``), loaded from its module when first asked; any
    submodule (``ml.hf.config``) by its name."""
    module = _homes().get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # asked once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    # the three lenses and what they return
    "estimate_step", "simulate_step", "measure_step", "MemoryReport", "CATEGORIES",
    # your own model: measure its step, simulate it on fake tensors
    "track_step", "simulate_model",
    # many ranks
    "measure_distributed", "measure_zero", "simulate_sharded", "measure_tensor_parallel",
    "measure_pipeline",
    # planning and the comparison table
    "advise", "Advice", "measure_table",
    # the step and the models
    "StepConfig", "ParallelDims", "GPTConfig", "UNetConfig", "GPT", "UNet", "PRESETS", "UNET_PRESETS",
    "get_config", "build_model", "build_trainer", "make_batch", "time_step", "MemoryTracker",
    # cards, ranks and sizes
    "GPU_PRESETS", "resolve_budget", "place_ranks", "MiB", "GiB", "fmt_bytes", "parse_size",
    # errors
    "InputError", "HostMemoryError",
]
