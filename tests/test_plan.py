"""course/two-day-plan.md: the plan names existing notebooks and numbered exercises only, gives
every exercise a place (class or homework), adds up, and keeps each day within 7 hours; the
course documents agree with memlab.doctor on which lessons start two ranks."""
import importlib.util
import json
import math
import pathlib
import re

import pytest

from memlab.doctor import RANK_LESSONS

ROOT = pathlib.Path(__file__).resolve().parents[1]
PLAN = (ROOT / "course" / "two-day-plan.md").read_text()
_spec = importlib.util.spec_from_file_location("make_instructor", ROOT / "tools" / "make_instructor.py")
mi = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mi)

DAY_LIMIT = 7 * 60
WPM, LINES_PER_MIN, YOUR_TURN, IN_CLASS = 200, 15, 15, 10


def table(heading_row: str) -> list[list[str]]:
    """The rows of the Markdown table whose header starts with ``heading_row``."""
    lines = PLAN.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading_row))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


PLAN_ROWS = table("| day | session | lesson |")
LESSONS = [r for r in PLAN_ROWS if r[2].endswith(".ipynb")]
SELF = table("| lesson | read | run |")


def numbers(cell: str) -> list[int]:
    return [] if cell == "-" else [int(x) for x in cell.split(",")]


def notebook(name: str) -> dict:
    return json.loads((ROOT / "notebooks" / name).read_text())


def reading_minutes(nb: dict) -> int:
    words = sum(len("".join(c["source"]).split()) for c in nb["cells"] if c["cell_type"] == "markdown")
    lines = sum(len("".join(c["source"]).splitlines()) for c in nb["cells"]
                if c["cell_type"] == "code" and "solution" not in c["metadata"].get("tags", []))
    return math.ceil(words / WPM + lines / LINES_PER_MIN)


def test_each_day_fits_seven_hours_and_adds_up():
    days = {}
    for day, _, what, *cols, total in PLAN_ROWS:
        if what.endswith(".ipynb"):
            read, run, demo, turn, _, in_min, _ = cols
            assert int(total) == int(read) + int(run) + int(demo) + int(turn) + int(in_min), what
        days[day] = days.get(day, 0) + int(total)
    assert sorted(days) == ["1", "2"]
    assert all(m <= DAY_LIMIT for m in days.values()), days
    for day, m in days.items():  # the prose states the same sums
        assert f"Day {day}: **{m} minutes**" in PLAN


def test_lessons_in_order_and_every_notebook_planned():
    planned = [r[2] for r in LESSONS]
    assert planned == sorted(planned) and len(set(planned)) == len(planned)
    existing = {p.name for p in (ROOT / "notebooks").glob("*.ipynb")}
    everywhere = set(planned) | {r[0] for r in SELF}
    assert existing <= everywhere, existing - everywhere
    assert everywhere <= existing, f"in the plan but not in notebooks/: {everywhere - existing}"


@pytest.mark.parametrize("row", LESSONS + [[None, None, r[0], r[1], r[2], "0", r[3], "-", "0", r[4], "0"]
                                          for r in SELF], ids=lambda r: r[2])
def test_lesson_row_matches_its_notebook(row):
    _, _, name, read, run, demo, turn, in_class, in_min, homework, total = row
    nb = notebook(name)
    exercises = mi.numbered_exercises(nb)
    done = numbers(in_class) + numbers(homework)
    assert sorted(done) == exercises, f"{name}: plan has {sorted(done)}, notebook {exercises}"
    assert int(in_min) == IN_CLASS * len(numbers(in_class))
    turns = sum("solution" in c["metadata"].get("tags", []) for c in nb["cells"])
    assert int(turn) == YOUR_TURN * turns, name
    expected = reading_minutes(nb)  # prose may be rewritten: within half, or 3 minutes
    assert abs(int(read) - expected) <= max(3, expected // 2), (name, read, expected)


def test_rank_lessons_agree_everywhere():
    ranks = set(RANK_LESSONS)
    assert ranks == {"09", "10", "11", "12", "13", "15"}
    make = (ROOT / "Makefile").read_text()
    line = next(x for x in make.splitlines() if x.startswith("RANK_NOTEBOOKS :="))
    assert set(re.findall(r"notebooks/(\d\d)_", line)) == ranks
    for doc in ("two-day-plan.md", "syllabus.md", "running-a-class.md"):
        text = (ROOT / "course" / doc).read_text()
        m = re.search(r"[Ll]essons ([\d,\sand]+?)\s+start two ranks", text)
        assert m, f"{doc} does not say which lessons start two ranks"
        assert set(re.findall(r"\d\d", m.group(1))) == ranks, (doc, m.group(1))
