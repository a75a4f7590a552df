"""Sizes and their units (memlab.core.units): the one parser, the one formatter, and the two
out-of-memory readers that must read a size the same way."""
import ast
import pathlib

import pytest

import memlab
from memlab.core.errors import InputError
from memlab.core.units import EiB, GiB, KiB, MiB, PiB, TiB, YiB, ZiB, binary_unit, fmt_bytes, parse_size
from memlab.tracking.oom_messages import read_oom, requested_bytes


@pytest.mark.parametrize("text, expected", [
    ("512MiB", 512 * 2**20), ("1.5GiB", 3 * 2**29), ("40GB", 40 * 10**9), ("1kb", 1000),
    ("  7 KiB ", 7 * 1024), ("1073741824", 2**30), ("0", 0), ("2TiB", 2 * 2**40), ("3B", 3),
])
def test_parse_size_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("n", [0, 1, 1023, 1024, 1536, 2**20, 5 * 2**30 + 123, 3 * 2**40, 7 * 2**50 + 9,
                               23844841218 * 2**30, 3 * 2**70, 5 * 2**80, 2**90])
def test_fmt_bytes_parses_back_within_its_rounding(n):
    """fmt_bytes keeps two decimals: parsing its text gives n back to within half a unit of
    the last place (0.005 of the unit it chose)."""
    text = fmt_bytes(n)
    value, unit = text.split()
    back = parse_size(value + unit)
    size = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50,
            "EiB": 2**60, "ZiB": 2**70, "YiB": 2**80}[unit]
    assert abs(back - n) <= 0.005 * size + 1


def test_fmt_bytes_picks_the_largest_unit_below_the_value():
    assert fmt_bytes(1023) == "1023 B"
    assert fmt_bytes(1024) == "1.00 KiB"
    assert fmt_bytes(14.26 * 2**20) == "14.26 MiB"
    assert fmt_bytes(-3 * 2**30) == "-3.00 GiB"
    assert fmt_bytes(5 * 2**40) == "5.00 TiB"
    assert fmt_bytes(2**50) == "1.00 PiB"
    # the absurd config: 23844841218.55 GiB is 22.21 EiB (2^60 B = 2^30 GiB)
    assert fmt_bytes(23844841218.55 * 2**30) == f"{23844841218.55 / 2**30:.2f} EiB" == "22.21 EiB"
    assert fmt_bytes(-3 * 2**70) == "-3.00 ZiB"
    assert fmt_bytes(2**90) == "1024.00 YiB"  # YiB is the largest unit


@pytest.mark.parametrize("bad, needle", [
    ("12XB", "malformed size '12XB'"), ("-5", "malformed size '-5'"), ("", "malformed size ''"),
    ("1.2.3GB", "malformed size '1.2.3GB'"), (-1, "budget -1 is negative"),
    (True, "budget True is not a size"),
])
def test_parse_size_refuses_bad_input(bad, needle):
    with pytest.raises(InputError, match=needle.replace(".", r"\.")):
        parse_size(bad)


def test_parse_size_is_exact_in_decimal():
    """'1.001KB' is 1001 bytes; float arithmetic gives 1000.999... and truncates to 1000."""
    assert int(float("1.001") * 1000) == 1000  # the trap this guards against
    assert parse_size("1.001KB") == 1001
    assert parse_size("1.07GiB") == 1148903751  # 1.07 x 2^30 = 1148903751.68, whole bytes


def test_c10_sizes_parse_with_a_space_and_bytes():
    """c10's format_size writes '512 bytes' below 1 KiB and '2.50 GiB' above."""
    assert parse_size("512 bytes") == 512
    assert parse_size("2.50 GiB") == 5 * GiB // 2


@pytest.mark.parametrize("text", ["20.00 MiB", "2.50 GiB", "512 bytes", "1.75 KiB"])
def test_both_oom_readers_read_a_size_as_parse_size_does(text):
    message = f"CUDA out of memory. Tried to allocate {text}. GPU 0 has a total capacity of 80.00 GiB"
    assert requested_bytes(message) == read_oom(message)["requested"] == parse_size(text)


@pytest.mark.parametrize("n, expected", [(0, (1, "B")), (1023, (1, "B")), (KiB, (KiB, "KiB")),
                                         (MiB - 1, (KiB, "KiB")), (3 * GiB, (GiB, "GiB")),
                                         (-2 * MiB, (MiB, "MiB")), (TiB, (TiB, "TiB")),
                                         (PiB + 1, (PiB, "PiB")), (EiB, (EiB, "EiB")),
                                         (ZiB, (ZiB, "ZiB")), (YiB * 10, (YiB, "YiB"))])
def test_binary_unit_is_the_largest_unit_not_above_the_value(n, expected):
    assert binary_unit(n) == expected


def test_binary_unit_floor_for_figures():
    assert binary_unit(10, smallest="KiB") == (KiB, "KiB")
    assert binary_unit(5 * MiB, smallest="KiB") == (MiB, "MiB")
    with pytest.raises(InputError, match="smallest='TiB'; allowed: B, KiB, MiB, GiB"):
        binary_unit(1, smallest="TiB")


UNIT_NAMES = {"KIB", "MIB", "GIB", "TIB", "KB", "MB", "GB", "TB"}


def test_units_are_defined_once():
    """No module but units.py binds KiB..TiB or keeps its own table of unit names."""
    offences = []
    package = pathlib.Path(memlab.__file__).parent
    for path in sorted(package.rglob("*.py")):
        if path.name == "units.py" and path.parent == package / "core":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                offences += [f"{path.name}:{node.lineno}: {t.id} =" for t in targets
                             if isinstance(t, ast.Name) and t.id in ("KiB", "MiB", "GiB", "TiB")]
            if isinstance(node, ast.Dict):
                keys = {k.value.upper() for k in node.keys
                        if isinstance(k, ast.Constant) and isinstance(k.value, str)}
                if len(keys & UNIT_NAMES) >= 2:
                    offences.append(f"{path.name}:{node.lineno}: a table of units")
    assert offences == [], "import them from memlab.units"
