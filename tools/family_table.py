"""Issue 36's table: every family's small config x every run option x both lenses, against the
real step measured on this CPU, as tests/test_family_table.py holds it.

    python tools/family_table.py                      # every cell: about 25 minutes on 2 cores
    python tools/family_table.py --families llama gpt_oss --options zero3

Prints a Markdown table of ``simulate / estimate`` error against the measured peak, in % (ZeRO:
the largest rank's device peak against the simulation's worst rank).
"""
import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

from test_family_table import OPTIONS, errors  # noqa: E402
from test_hf_lora import CONFIGS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--options", nargs="*", default=list(OPTIONS), choices=list(OPTIONS))
    a = ap.parse_args()
    print("| family | " + " | ".join(a.options) + " |")
    print("|---" * (len(a.options) + 1) + "|")
    for name in a.families:
        start = time.perf_counter()
        cells = [" / ".join(f"{100 * e:+.2f}" for e in errors(name, o)) for o in a.options]
        print(f"| {name} | " + " | ".join(cells) + f" |  <!-- {time.perf_counter() - start:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
