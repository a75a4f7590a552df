"""Print each lesson's minutes in class, the table `course/two-day-plan.md` is built from.

    python tools/class_minutes.py                               # run seconds from the plan's own table
    python tools/class_minutes.py --seconds build/site/site.json  # or a fresh run's record
    python tools/class_minutes.py --seconds log.txt NOTEBOOK ...  # a log of "NN_name SECONDS" lines

Counts every notebook's prose words, code cells and "Your turn" exercises as committed
(`memlab.classroom.lesson_time`) and adds its measured run time; prints one Markdown row per
lesson in the plan's "measured" table format, to paste over that table after a lesson changes.
"""
import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memlab.classroom import LessonTime, lesson_time, read_run_seconds  # noqa: E402
from memlab.errors import InputError  # noqa: E402

PLAN = ROOT / "course" / "two-day-plan.md"
HEADER = ("| lesson | words | code cells | your turn | run s | reading | code | your turn min | run | demo "
          "| total |")


def plan_seconds(plan: pathlib.Path = PLAN) -> dict[str, float]:
    """The run seconds the plan's measured table records, by lesson stem."""
    lines = plan.read_text(encoding="utf-8").splitlines()
    start = lines.index(HEADER)
    seconds = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        seconds[cells[0].strip("`")] = float(cells[4])
    return seconds


def row(t: LessonTime) -> str:
    """One row of the measured table."""
    return (f"| `{t.lesson}` | {t.words} | {t.code_cells} | {t.exercises} | {t.run_seconds:g} | {t.reading} "
            f"| {t.code} | {t.exercise} | {t.run} | {t.demo} | {t.total} |")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("notebooks", nargs="*", help="default: notebooks/*.ipynb")
    p.add_argument("--seconds", help="site.json or a log of 'NN_name SECONDS' lines (default: the plan's table)")
    args = p.parse_args(argv)
    paths = [pathlib.Path(n) for n in args.notebooks] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    try:
        seconds = read_run_seconds(args.seconds) if args.seconds else plan_seconds()
        missing = [q.stem for q in paths if q.stem not in seconds]
        if missing:
            raise InputError(f"no run time recorded for {', '.join(missing)}; "
                             f"known: {', '.join(sorted(seconds)) or 'none'}")
        print(HEADER)
        print("|" + " --- |" * HEADER.count(" |"))
        for q in paths:
            print(row(lesson_time(json.loads(q.read_text(encoding="utf-8")), q.stem, seconds[q.stem])))
    except InputError as e:
        print(f"class_minutes: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
