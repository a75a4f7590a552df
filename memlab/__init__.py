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

Plumbing stays in its module (``memlab.hardware.Placement``, ``memlab.hardware.pick_device``,
...). Importing memlab loads neither DeepSpeed nor ipywidgets nor matplotlib: the modules that
need them (``distributed``'s rank workers, ``widgets``, ``plots``) load them when used.
The layers, lowest first, and what each module owns: the module map in ``docs/modules.md``
(``tools/modmap.py``, checked by ``tests/test_architecture.py``).
"""
from .advisor import Advice, advise
from .distributed.deepspeed_zero import measure_distributed, measure_zero
from .distributed.fsdp import simulate_sharded
from .distributed.pipeline_parallel import measure_pipeline
from .distributed.tensor_parallel import measure_tensor_parallel
from .errors import InputError
from .estimate import estimate_step
from .guard import HostMemoryError
from .hardware import GPU_PRESETS, place_ranks, resolve_budget
from .measure import measure_step, time_step
from .models import GPT, PRESETS, UNET_PRESETS, GPTConfig, UNet, UNetConfig, build_model, get_config
from .quiet import quiet_offline_kernels
from .simulate import simulate_step
from .step import MemoryReport, StepConfig, build_trainer, make_batch
from .technique_table import measure_table
from .tracking import CATEGORIES, MemoryTracker
from .units import GiB, MiB, fmt_bytes, parse_size
from .your_model import simulate_model, track_step

quiet_offline_kernels()  # before peft or transformers import bitsandbytes (memlab.quiet)

__version__ = "0.1.0"

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
    "StepConfig", "GPTConfig", "UNetConfig", "GPT", "UNet", "PRESETS", "UNET_PRESETS",
    "get_config", "build_model", "build_trainer", "make_batch", "time_step", "MemoryTracker",
    # cards, ranks and sizes
    "GPU_PRESETS", "resolve_budget", "place_ranks", "MiB", "GiB", "fmt_bytes", "parse_size",
    # errors
    "InputError", "HostMemoryError",
]
