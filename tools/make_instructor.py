"""Write the instructor edition: each notebook with its answer key appended (stdlib only).

    python tools/make_instructor.py [--out build/instructor] [NOTEBOOK ...]

The numbered exercises of a notebook are the items of the numbered list under its
``## Exercises`` heading. Their worked answers live in ``course/answers/<notebook-stem>.md``,
one ``## Exercise N`` section each (numbers measured on a CPU, and what changes on a GPU); this
tool appends them to a copy of the notebook as markdown cells after an "Answer key" heading.
Solutions stay in (``make student`` is the edition without them); outputs are dropped.
"""
import argparse
import glob
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ANSWERS = os.path.join(ROOT, "course", "answers")
SECTION = re.compile(r"^## Exercise (\d+)\s*$", re.M)


def numbered_exercises(nb: dict) -> list[int]:
    """The numbers of the items listed under the notebook's ``## Exercises`` heading."""
    numbers = []
    for cell in nb.get("cells", []):
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell.get("cell_type") != "markdown" or "## Exercises" not in src:
            continue
        body = re.split(r"\n#{1,2} ", src.split("## Exercises", 1)[1])[0]  # up to the next heading
        numbers += [int(n) for n in re.findall(r"^(\d+)\.\s", body, re.M)]
    return numbers


def answer_sections(text: str) -> dict[int, str]:
    """``## Exercise N`` -> its text, from an answers file."""
    parts = SECTION.split(text)
    return {int(parts[i]): parts[i + 1].strip() for i in range(1, len(parts) - 1, 2)}


def answers_for(stem: str) -> dict[int, str]:
    path = os.path.join(ANSWERS, f"{stem}.md")
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return answer_sections(f.read())


def with_answers(nb: dict, answers: dict[int, str]) -> dict:
    """A copy of ``nb`` without outputs, its answers appended as markdown cells."""
    cells = [dict(c, outputs=[], execution_count=None) if c.get("cell_type") == "code" else c
             for c in nb.get("cells", [])]
    if answers:
        cells.append({"cell_type": "markdown", "metadata": {"tags": ["answer-key"]}, "id": "answer-key",
                      "source": ["## Answer key (instructor edition)\n\n"
                                 "Numbers measured on a CPU with the tiny models unless said; "
                                 "each answer ends with what changes on a GPU."]})
        for n in sorted(answers):
            cells.append({"cell_type": "markdown", "metadata": {"tags": ["answer-key"]},
                          "id": f"answer-{n}", "source": [f"### Exercise {n}\n\n{answers[n]}\n"]})
    return dict(nb, cells=cells)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("notebooks", nargs="*", help="default: notebooks/*.ipynb")
    parser.add_argument("--out", default="build/instructor")
    args = parser.parse_args(argv)
    out = args.out
    paths = args.notebooks or sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
    os.makedirs(out, exist_ok=True)
    missing = []
    for path in paths:
        stem = os.path.splitext(os.path.basename(path))[0]
        with open(path, encoding="utf-8") as f:
            nb = json.load(f)
        answers = answers_for(stem)
        missing += [f"{stem} exercise {n}" for n in numbered_exercises(nb) if n not in answers]
        with open(os.path.join(out, os.path.basename(path)), "w", encoding="utf-8") as f:
            f.write(json.dumps(with_answers(nb, answers), indent=1, ensure_ascii=False) + "\n")
    print(f"{len(paths)} notebooks with their answer keys -> {out}/")
    if missing:
        print("no answer yet for: " + ", ".join(missing), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
