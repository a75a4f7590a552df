"""memlab: where the memory of a training step goes, and how to get it back.

Three lenses on one training step: :func:`estimate_step` (closed-form formulas),
:func:`simulate_step` (fake tensors, for GPUs you do not have) and :func:`measure_step`
(a real step, tracked exactly on CPU, with allocator statistics on CUDA).
"""
from .errors import InputError
from .guard import HostMemoryError
from .estimate import estimate_step
from .hardware import GPU_PRESETS, Placement, pick_device, place_ranks, resolve_budget
from .units import GiB, MiB, fmt_bytes, parse_size
from .measure import measure_step, time_step
from .step import MemoryReport, StepConfig, build_trainer, make_batch
from .simulate import simulate_step
from .models import GPT, PRESETS, UNET_PRESETS, GPTConfig, UNet, UNetConfig, build_model, get_config
from .tracking import CATEGORIES, MemoryTracker

__version__ = "0.1.0"
