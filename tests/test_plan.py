"""course/two-day-plan.md: every minute is recomputed from the notebooks as committed
(`memlab.classroom.collect.lesson_time`: prose words, code cells, "Your turn" exercises) and the run
seconds the plan records; the page fails when it drifts from them by more than its stated
tolerance, when a day does not add up or runs over its limit, when rank-starting lessons are
stacked without the page saying so, or when the capstone waits on `class collect`."""
import importlib.util
import json
import math
import pathlib
import re

import pytest

from memlab.app.doctor import RANK_LESSONS
from memlab.classroom import collect as classroom
from memlab.core.errors import InputError

ROOT = pathlib.Path(__file__).resolve().parents[1]
PLAN_PATH = ROOT / "course" / "two-day-plan.md"
PLAN = PLAN_PATH.read_text()
_spec = importlib.util.spec_from_file_location("class_minutes", ROOT / "tools" / "class_minutes.py")
class_minutes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(class_minutes)

# The stated tolerance: a lesson's minutes may drift 3 from its notebook (about 360 words of
# prose, or six code cells) and a day's 10 before the plan must be recomputed.
LESSON_TOLERANCE, DAY_TOLERANCE = 3, 10
DAY_HEADING = re.compile(r"^### (2\.5|2) days, day (\d)(?: \((.+)\))?$")
LIMITS = {"": 390, "a morning": 195}


def table_after(lines: list[str], start: int) -> list[list[str]]:
    """The rows of the first Markdown table at or after line ``start``."""
    i = next(j for j in range(start, len(lines)) if lines[j].startswith("|"))
    rows = []
    for line in lines[i + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


MEASURED = {r[0].strip("`"): r for r in table_after(PLAN.splitlines(), PLAN.splitlines().index(class_minutes.HEADER))}


def days(text: str = PLAN) -> dict[tuple[str, int], tuple[list[list[str]], int, int]]:
    """(variant, day) -> (rows, the stated teaching minutes, the limit)."""
    lines, out = text.splitlines(), {}
    for i, line in enumerate(lines):
        m = DAY_HEADING.match(line)
        if m:
            rows = table_after(lines, i + 1)
            stated = re.search(r"Teaching minutes: \*\*(\d+)\*\* of (\d+)\.", "\n".join(lines[i:i + len(rows) + 8]))
            assert stated, f"{line}: no 'Teaching minutes: **N** of LIMIT.' line after its table"
            assert int(stated.group(2)) == LIMITS[m.group(3) or ""], line
            out[(m.group(1), int(m.group(2)))] = (rows, int(stated.group(1)), int(stated.group(2)))
    return out


def notebook_time(stem: str) -> classroom.LessonTime:
    nb = json.loads((ROOT / "notebooks" / f"{stem}.ipynb").read_text())
    return classroom.lesson_time(nb, stem, float(MEASURED[stem][4]))


def lesson_minutes(row: list[str]) -> int:
    """A day row's minutes: its numeric columns (a cut one counts 0)."""
    return sum(int(c) for c in row[1:6] if c.isdigit())


def test_every_notebook_is_measured_and_each_row_follows_the_stated_formula():
    assert sorted(MEASURED) == sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    for stem, (_, words, cells, turns, secs, reading, code, turn_min, run, demo, total) in MEASURED.items():
        assert int(reading) == math.ceil(int(words) / 120), stem
        assert int(code) == math.ceil(int(cells) * 0.5), stem
        assert int(turn_min) == 20 * int(turns), stem
        assert int(run) == math.ceil(float(secs) / 60) and int(demo) == 10, stem
        assert int(total) == int(reading) + int(code) + int(turn_min) + int(run) + int(demo), stem
    # the page states the figures the code uses
    assert (classroom.WORDS_PER_MINUTE, classroom.CODE_CELL_MINUTES, classroom.EXERCISE_MINUTES,
            classroom.DEMO_MINUTES) == (120, 0.5, 20, 10)
    for said in ("**120 words a minute**", "**half a minute per code cell**",
                 "**20 minutes per \"Your turn\" exercise**", "**10 minutes**"):
        assert said in PLAN, said


@pytest.mark.parametrize("stem", sorted(MEASURED))
def test_measured_row_within_tolerance_of_its_notebook(stem):
    row, now = MEASURED[stem], notebook_time(stem)
    assert int(row[3]) == now.exercises, f"{stem}: {now.exercises} 'Your turn' exercises now, the plan {row[3]}"
    assert abs(int(row[10]) - now.total) <= LESSON_TOLERANCE, (
        f"{stem}: the plan says {row[10]} min, the notebook now gives {now.total} ({now}); "
        f"run `python tools/class_minutes.py --write`")


def test_each_day_adds_up_fits_its_limit_and_stays_near_the_notebooks():
    found = days()
    assert sorted(found) == [("2", 1), ("2", 2), ("2.5", 1), ("2.5", 2), ("2.5", 3)]
    for key, (rows, stated, limit) in found.items():
        total = computed = 0
        for row in rows:
            name = row[0].strip("`")
            if name in MEASURED:  # each column is the measured table's, or cut
                measured = MEASURED[name]
                for col, m in zip(row[1:6], measured[5:10], strict=True):
                    assert col == m or col.startswith("cut"), (key, name, col, m)
                assert int(row[6]) == lesson_minutes(row), (key, name)
                now = notebook_time(name)
                now_minutes = (now.reading, now.code, now.exercise, now.run, now.demo)
                computed += sum(m for col, m in zip(row[1:6], now_minutes, strict=True) if not col.startswith("cut"))
            else:
                computed += int(row[6])
            total += int(row[6])
        assert total == stated <= limit, (key, total, stated, limit)
        assert abs(computed - stated) <= DAY_TOLERANCE, (key, computed, stated)


def test_every_course_lesson_once_per_variant_in_order_and_cuts_named():
    for variant in ("2", "2.5"):
        planned = [r[0].strip("`") for (v, _), (rows, _, _) in sorted(days().items()) if v == variant
                   for r in rows if r[0].strip("`") in MEASURED]
        course = [s for s in planned if "01" <= s[:2] <= "15"]   # an elective may join, after 15
        assert course == sorted(s for s in MEASURED if "01" <= s[:2] <= "15"), (variant, planned)
        assert planned[:len(course)] == course and len(set(planned)) == len(planned), (variant, planned)
    cut = [r[0] for (v, _), (rows, _, _) in days().items() for r in rows if any(c.startswith("cut") for c in r)]
    assert cut, "the two-day variant names its cuts"
    cuts = PLAN.split("## Two days: with three named cuts", 1)[1].split("###", 1)[0]
    for name in cut:
        assert f"Lesson {name.strip('`')[:2]}" in cuts, f"{name} is cut but not named under the cuts"


def rank_runs(rows: list[list[str]]) -> list[list[str]]:
    """The runs of rank-starting lessons, in a day's order, with nothing else between them."""
    runs, current = [], []
    for row in rows:
        name = row[0].strip("`")
        if name[:2] in RANK_LESSONS and name in MEASURED:
            current.append(name[:2])
        elif name in MEASURED:
            runs, current = runs + [current] * bool(current), []
    return runs + [current] * bool(current)


def stacked_unsaid(text: str) -> list[tuple]:
    """Runs of three or more rank lessons that no 'back to back' sentence of the page names."""
    said = [p for p in re.split(r"\n\s*\n", text) if "back to back" in p]
    return [(key, run) for key, (rows, _, _) in days(text).items() for run in rank_runs(rows)
            if len(run) >= 3 and not any(all(n in p for n in run) for p in said)]


def test_stacked_rank_lessons_are_said():
    assert stacked_unsaid(PLAN) == []
    # and the check sees a stack: the same page without its sentences fails
    silent = "\n\n".join(p for p in re.split(r"\n\s*\n", PLAN) if "back to back" not in p)
    assert stacked_unsaid(silent)


def test_the_capstone_is_learner_work_and_collect_comes_after():
    for (variant, day), (rows, _, _) in days().items():
        assert not any("collect" in r[0] for r in rows), (variant, day)
    last = {v: max(d for (w, d) in days() if w == v) for v in ("2", "2.5")}
    for variant, day in last.items():
        rows = days()[(variant, day)][0]
        assert any(r[0].startswith("capstone: learner work only") for r in rows), variant
    capstone = PLAN.split("## The capstone: learner work only", 1)[1].split("\n## ", 1)[0]
    assert "After the session" in capstone and "memlab class collect" in capstone
    assert capstone.index("After the session") < capstone.index("memlab class collect submitted/")


def test_lesson_time_counts_prose_cells_and_exercises_as_stated():
    nb = {"cells": [
        {"cell_type": "markdown", "metadata": {}, "source": "## Your turn: x\n\nWrite `f` | --- |\n\n```\n"
         "\nfenced code is not prose\n```\n<details><summary>Answer</summary>\n\nfour words hidden here\n</details>"},
        {"cell_type": "code", "metadata": {}, "source": "print(1)"},
        {"cell_type": "code", "metadata": {"tags": ["solution"]}, "source": "def f(): pass"},
        {"cell_type": "code", "metadata": {}, "source": "exercises.check_f(f)"},
    ]}
    t = classroom.lesson_time(nb, "99_x", 61)
    # "##" and "|" and "---" are not words; "Your", "turn:", "x", "Write", "`f`" are
    assert (t.words, t.code_cells, t.exercises, t.run) == (5, 1, 1, 2)
    assert t.total == 1 + 1 + 20 + 2 + 10
    with pytest.raises(InputError, match="run_seconds"):
        classroom.lesson_time(nb, "99_x", -1)


def test_read_run_seconds_reads_a_log_and_a_site_record(tmp_path):
    log = tmp_path / "log.txt"
    log.write_text("[IPKernelApp] WARNING | noise\n05_checkpointing 136\n10_zero 142.5\n")
    assert classroom.read_run_seconds(log) == {"05_checkpointing": 136.0, "10_zero": 142.5}
    site = tmp_path / "site.json"
    site.write_text(json.dumps([{"stem": "00_start_here", "seconds": 11.9, "figures": 2}]))
    assert classroom.read_run_seconds(site) == {"00_start_here": 11.9}
    with pytest.raises(InputError, match="does not exist"):
        classroom.read_run_seconds(tmp_path / "none.json")


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


def test_readme_and_syllabus_reading_minutes_are_the_plans():
    """README's "read" column and the syllabus' "(reading N min)" are the plan's reading + code."""
    plan = {stem: int(row[5]) + int(row[6]) for stem, row in MEASURED.items()}
    readme = dict(re.findall(r"^\| `(\d\d_\w+)`(?: \(elective\))? \| (\d+) \|", (ROOT / "README.md").read_text(), re.M))
    syllabus = dict(re.findall(r"^### `(\d\d_\w+)\.ipynb` .*\(reading (\d+) min\)",
                               (ROOT / "course" / "syllabus.md").read_text(), re.M))
    assert {s: int(m) for s, m in readme.items()} == plan
    assert {s: int(m) for s, m in syllabus.items()} == plan


def test_class_minutes_write_puts_a_lessons_new_minutes_everywhere_and_flags_a_day_over():
    """`tools/class_minutes.py --write`: a lesson that grew by 50 minutes of reading moves every
    row of it and every day holding it, and a day that no longer fits is reported."""
    from dataclasses import replace
    times = {stem: notebook_time(stem) for stem in MEASURED}
    same, over = class_minutes.rewrite_plan(PLAN, times)
    assert days(same).keys() == days().keys()
    grown = dict(times, **{"01_where_memory_goes": replace(times["01_where_memory_goes"],
                                                           reading=times["01_where_memory_goes"].reading + 50)})
    text, over = class_minutes.rewrite_plan(same, grown)
    before, after = days(same), days(text)
    for key in before:
        holds = any(r[0] == "`01_where_memory_goes`" for r in before[key][0])
        assert after[key][1] - before[key][1] == (50 if holds else 0), key
    assert [line.split(":")[0] for line in over] == ["### 2.5 days, day 1", "### 2 days, day 1"]
    measured = next(line for line in text.splitlines() if line.startswith("| `01_where_memory_goes` | "))
    assert f"| {times['01_where_memory_goes'].reading + 50} |" in measured
