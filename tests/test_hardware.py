"""Devices: GPU presets, budgets, picking a device, and bad input (sizes: test_units.py)."""
import pytest
import torch

from memlab.core.errors import InputError
from memlab.core.hardware import GPU_PRESETS, pick_device, resolve_budget


def test_resolve_budget_takes_presets_sizes_and_none():
    assert resolve_budget(None) is None
    assert resolve_budget("A100-40GB") == GPU_PRESETS["A100-40GB"] == 40960 * 2**20
    assert resolve_budget("120MiB") == 120 * 2**20
    with pytest.raises(InputError, match="unknown GPU preset 'Z100-1GB'; allowed: T4-16GB"):
        resolve_budget("Z100-1GB")


def test_pick_device_refuses_what_it_cannot_use():
    assert pick_device("cpu") == torch.device("cpu")
    with pytest.raises(InputError, match="unknown device 'tpu'; allowed: cpu, cuda"):
        pick_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="torch sees no CUDA GPU"):
            pick_device("cuda")
