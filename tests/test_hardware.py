"""Sizes and devices: parsing and formatting bytes, budgets, and bad input."""
import pytest
import torch

from memlab.errors import InputError
from memlab.hardware import GPU_PRESETS, fmt_bytes, parse_size, pick_device, resolve_budget


@pytest.mark.parametrize("text, expected", [
    ("512MiB", 512 * 2**20), ("1.5GiB", 3 * 2**29), ("40GB", 40 * 10**9), ("1kb", 1000),
    ("  7 KiB ", 7 * 1024), ("1073741824", 2**30), ("0", 0), ("2TiB", 2 * 2**40), ("3B", 3),
])
def test_parse_size_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("n", [0, 1, 1023, 1024, 1536, 2**20, 5 * 2**30 + 123, 3 * 2**40])
def test_fmt_bytes_parses_back_within_its_rounding(n):
    """fmt_bytes keeps two decimals: parsing its text gives n back to within half a unit of
    the last place (0.005 of the unit it chose)."""
    text = fmt_bytes(n)
    value, unit = text.split()
    back = parse_size(value + unit)
    size = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    assert abs(back - n) <= 0.005 * size + 1


def test_fmt_bytes_picks_the_largest_unit_below_the_value():
    assert fmt_bytes(1023) == "1023 B"
    assert fmt_bytes(1024) == "1.00 KiB"
    assert fmt_bytes(14.26 * 2**20) == "14.26 MiB"
    assert fmt_bytes(-3 * 2**30) == "-3.00 GiB"
    assert fmt_bytes(5 * 2**40) == "5120.00 GiB"  # GiB is the largest unit


@pytest.mark.parametrize("bad, needle", [
    ("12XB", "malformed size '12XB'"), ("-5", "malformed size '-5'"), ("", "malformed size ''"),
    ("1.2.3GB", "malformed size '1.2.3GB'"), (-1, "budget -1 is negative"),
    (True, "budget True is not a size"),
])
def test_parse_size_refuses_bad_input(bad, needle):
    with pytest.raises(InputError, match=needle.replace(".", r"\.")):
        parse_size(bad)


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
