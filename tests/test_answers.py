"""The answer keys: every numbered exercise of every notebook has a worked answer in
course/answers/<stem>.md, no answer names an exercise that does not exist, and `make
instructor` appends them to the notebooks."""
import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("make_instructor", ROOT / "tools" / "make_instructor.py")
mi = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mi)

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_exercise_parsing_on_a_made_up_notebook():
    nb = {"cells": [{"cell_type": "markdown", "source": ["## Your turn\n\n1. not this one\n"]},
                    {"cell_type": "markdown", "source": ["## Exercises\n\n1. First?\n   more\n2. Second\n"
                                                         "10. Tenth\n\n## Summary\n\n3. not an exercise\n"]}]}
    assert mi.numbered_exercises(nb) == [1, 2, 10]
    text = "# Answers\n\n## Exercise 1\n\nyes\n\n## Exercise 10\n\nten\n"
    assert mi.answer_sections(text) == {1: "yes", 10: "ten"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_numbered_exercise_has_an_answer(path):
    numbers = mi.numbered_exercises(json.loads(path.read_text()))
    answers = mi.answers_for(path.stem)
    assert sorted(answers) == numbers, f"{path.stem}: exercises {numbers}, answers {sorted(answers)}"
    for n, text in answers.items():
        assert len(text.split()) >= 40, f"{path.stem} exercise {n}: a worked answer, not a hint"
        assert any(ch.isdigit() for ch in text), f"{path.stem} exercise {n}: no number in the answer"
        assert "GPU" in text, f"{path.stem} exercise {n}: say what changes on a GPU"


def test_no_answers_for_notebooks_that_do_not_exist():
    stems = {p.stem for p in NOTEBOOKS}
    orphans = [p.name for p in (ROOT / "course" / "answers").glob("*.md") if p.stem not in stems]
    assert orphans == []


def test_instructor_edition_appends_the_answers(tmp_path):
    src = ROOT / "notebooks" / "05_checkpointing.ipynb"
    assert mi.main(["--out", str(tmp_path), str(src)]) == 0
    nb = json.loads((tmp_path / src.name).read_text())
    keys = [c for c in nb["cells"] if "answer-key" in c["metadata"].get("tags", [])]
    numbers = mi.numbered_exercises(json.loads(src.read_text()))
    assert len(keys) == 1 + len(numbers)                  # a heading, then one cell per exercise
    assert "".join(keys[1]["source"]).startswith("### Exercise 1")
    assert any("solution" in c["metadata"].get("tags", []) for c in nb["cells"])  # solutions stay
    assert len({c["id"] for c in nb["cells"]}) == len(nb["cells"])              # ids unique
