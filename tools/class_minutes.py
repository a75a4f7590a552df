"""Print each lesson's minutes in class, the table `course/two-day-plan.md` is built from.

    python tools/class_minutes.py                               # run seconds from the plan's own table
    python tools/class_minutes.py --seconds build/site/site.json  # or a fresh run's record
    python tools/class_minutes.py --seconds log.txt NOTEBOOK ...  # a log of "NN_name SECONDS" lines
    python tools/class_minutes.py --write                       # update the plan, README, syllabus

Counts every notebook's prose words, code cells and "Your turn" exercises as committed
(`memlab.classroom.collect.lesson_time`) and adds its measured run time; prints one Markdown row per
lesson in the plan's "measured" table format. After a lesson changes, ``--write`` puts the new
minutes into the plan's measured table, every day table (a column marked ``cut`` stays cut) and
its "Teaching minutes" lines, README's "read" column and the syllabus' "(reading N min)"; it says
which day now runs over its limit, which only a teacher can re-plan.
"""
import argparse
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memlab.classroom.collect import LessonTime, lesson_time, read_run_seconds  # noqa: E402
from memlab.core.errors import InputError  # noqa: E402

PLAN = ROOT / "course" / "two-day-plan.md"
README = ROOT / "README.md"
SYLLABUS = ROOT / "course" / "syllabus.md"
DAY = re.compile(r"^### .*days, day \d")
MINUTES = re.compile(r"^Teaching minutes: \*\*(\d+)\*\* of (\d+)\.$")
SPARE = re.compile(r"The spare minutes \(\d+, \d+ and \d+ on the three days\)")
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


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def rewrite_plan(text: str, times: dict[str, LessonTime]) -> tuple[str, list[str]]:
    """The plan with every lesson's minutes from ``times``; returns it and the days over their limit."""
    lines, over, day_totals = text.splitlines(), [], []
    in_measured = in_day = False
    total, heading = 0, ""
    for i, line in enumerate(lines):
        if line == HEADER:
            in_measured = True
            continue
        if DAY.match(line):
            in_day, total, heading = True, 0, line
            continue
        if line.startswith("|") and not line.startswith(("| lesson", "| ---")):
            cells = _cells(line)
            stem = cells[0].strip("`")
            if in_measured and stem in times:
                lines[i] = row(times[stem])
            elif in_day and stem in times:
                t = times[stem]
                new = [c if c.startswith("cut") else str(v)
                       for c, v in zip(cells[1:6], (t.reading, t.code, t.exercise, t.run, t.demo), strict=True)]
                minutes = sum(int(c) for c in new if c.isdigit())
                lines[i] = "| " + " | ".join([cells[0], *new, str(minutes)]) + " |"
                total += minutes
            elif in_day:
                total += int(cells[6])
        elif not line.startswith("|"):
            in_measured = False
            m = MINUTES.match(line)
            if in_day and m:
                lines[i] = f"Teaching minutes: **{total}** of {m.group(2)}."
                day_totals.append((total, int(m.group(2))))
                if total > int(m.group(2)):
                    over.append(f"{heading}: {total} > {m.group(2)}")
                in_day = False
    out = "\n".join(lines) + "\n"
    if len(day_totals) >= 3:  # the long variant's three days come first
        spare = ", ".join(str(limit - t) for t, limit in day_totals[:2]) + f" and {day_totals[2][1] - day_totals[2][0]}"
        out = SPARE.sub(f"The spare minutes ({spare} on the three days)", out)
    return out, over


def reading_columns(times: dict[str, LessonTime]) -> None:
    """README's "read" column and the syllabus' "(reading N min)": reading + code minutes."""
    readme, syllabus = README.read_text(encoding="utf-8"), SYLLABUS.read_text(encoding="utf-8")
    for stem, t in times.items():
        readme = re.sub(rf"^(\| `{stem}`(?: \(elective\))? \| )\d+( \|)", rf"\g<1>{t.reading + t.code}\g<2>",
                        readme, flags=re.M)
        syllabus = re.sub(rf"^(### `{stem}\.ipynb` .*\(reading )\d+( min\))", rf"\g<1>{t.reading + t.code}\g<2>",
                          syllabus, flags=re.M)
    README.write_text(readme, encoding="utf-8")
    SYLLABUS.write_text(syllabus, encoding="utf-8")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("notebooks", nargs="*", help="default: notebooks/*.ipynb")
    p.add_argument("--seconds", help="site.json or a log of 'NN_name SECONDS' lines (default: the plan's table)")
    p.add_argument("--write", action="store_true", help="update the plan, README and the syllabus in place")
    args = p.parse_args(argv)
    paths = [pathlib.Path(n) for n in args.notebooks] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    try:
        seconds = read_run_seconds(args.seconds) if args.seconds else plan_seconds()
        missing = [q.stem for q in paths if q.stem not in seconds]
        if missing:
            raise InputError(f"no run time recorded for {', '.join(missing)}; "
                             f"known: {', '.join(sorted(seconds)) or 'none'}")
        times = {q.stem: lesson_time(json.loads(q.read_text(encoding="utf-8")), q.stem, seconds[q.stem])
                 for q in paths}
    except InputError as e:
        print(f"class_minutes: error: {e}", file=sys.stderr)
        return 2
    if not args.write:
        print(HEADER)
        print("|" + " --- |" * HEADER.count(" |"))
        for t in times.values():
            print(row(t))
        return 0
    text, over = rewrite_plan(PLAN.read_text(encoding="utf-8"), times)
    PLAN.write_text(text, encoding="utf-8")
    reading_columns(times)
    print(f"updated {PLAN.relative_to(ROOT)}, README.md, course/syllabus.md")
    for line in over:
        print(f"over its limit, re-plan it: {line}", file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
