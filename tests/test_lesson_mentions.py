"""Every "lesson NN" in memlab's prose names the notebook that uses what the sentence is in.

Lessons get renumbered; a number left behind sends a reader to the wrong notebook. A mention
inside a function or class must be in a lesson whose code cells name that function or class;
one in a module's docstring, in a lesson naming one of the module's public functions or
classes; one in a module-level comment, in a lesson naming what the next statement defines. A name also
counts as named by lesson NN when the module's own ``"NN": ...`` entry (``memlab.classroom.lesson``'s
plans) uses it, directly or through the module's functions.
"""
import ast
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "memlab"
#: "lesson 06", "Lesson 04's", "lessons 10-11", "Lessons 00 and 01"
MENTION = re.compile(r"\b[Ll]essons? (\d\d)((?:(?:, | and |-)\d\d)*)")


def lesson_numbers(match: re.Match) -> list[str]:
    """The lessons one mention names: a range ``10-13`` is every lesson in it."""
    first, rest = match.group(1), match.group(2)
    numbers = [first]
    for sep, n in re.findall(r"(, | and |-)(\d\d)", rest):
        if sep == "-":
            numbers += [f"{k:02d}" for k in range(int(numbers[-1]) + 1, int(n) + 1)]
        else:
            numbers.append(n)
    return numbers


def _defined(node: ast.AST) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {t.id for t in targets if isinstance(t, ast.Name)}
    return set()


def what_the_line_is_in(tree: ast.Module, line: int) -> set[str]:
    """The names a mention on ``line`` is about (see the module docstring)."""
    inner = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                and node.lineno <= line <= node.end_lineno:
            if inner is None or node.lineno >= inner.lineno:
                inner = node
    if inner is not None:
        return {inner.name}
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and body[0].lineno <= line <= body[0].end_lineno:
        return {n for stmt in body for n in _defined(stmt)
                if isinstance(stmt, (ast.FunctionDef, ast.ClassDef)) and not n.startswith("_")}
    following = [stmt for stmt in body if stmt.lineno >= line]
    return _defined(following[0]) if following else set()


def used_by_lesson_keys(tree: ast.Module) -> dict[str, set[str]]:
    """``{"NN": names}`` for each dict entry keyed by a two-digit string in the module: the
    names its value uses, and the names used by the module's functions among them."""
    bodies = {node.name: {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
              for node in tree.body if isinstance(node, ast.FunctionDef)}
    bodies.update({t.id: {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
                   for node in tree.body if isinstance(node, ast.Assign)
                   for t in node.targets if isinstance(t, ast.Name)})
    out: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Dict):
            continue
        for key, value in zip(node.keys, node.values, strict=True):
            if isinstance(key, ast.Constant) and isinstance(key.value, str) and re.fullmatch(r"\d\d", key.value):
                names = {n.id for n in ast.walk(value) if isinstance(n, ast.Name)}
                while True:
                    more = set().union(*(bodies.get(n, set()) for n in names)) - names
                    if not more:
                        break
                    names |= more
                out.setdefault(key.value, set()).update(names)
    return out


def notebook_code(number: str) -> str:
    found = sorted((ROOT / "notebooks").glob(f"{number}_*.ipynb"))
    assert len(found) == 1, f"lesson {number}: notebooks {[p.name for p in found]}"
    cells = json.loads(found[0].read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


def mentions() -> list[tuple[str, str, str, set[str], bool]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        keyed = used_by_lesson_keys(tree)
        for i, line in enumerate(text.splitlines(), 1):
            for m in MENTION.finditer(line):
                names = what_the_line_is_in(tree, i)
                for number in lesson_numbers(m):
                    out.append((f"{path.relative_to(ROOT)}:{i}", number, m.group(0), names,
                                bool(names & keyed.get(number, set()))))
    return out


MENTIONS = mentions()


def test_the_mention_pattern_reads_ranges_and_lists():
    assert lesson_numbers(MENTION.search("Lessons 10-13 share")) == ["10", "11", "12", "13"]
    assert lesson_numbers(MENTION.search("Lessons 00 and 01: read")) == ["00", "01"]
    assert lesson_numbers(MENTION.search("lesson 06's search")) == ["06"]
    assert MENTIONS, "no mentions found: the pattern no longer matches the prose"


@pytest.mark.parametrize("where, number, said, names, keyed", MENTIONS,
                         ids=[f"{m[0]}:{m[1]}" for m in MENTIONS])
def test_a_lesson_mention_names_the_notebook_that_uses_it(where, number, said, names, keyed):
    code = notebook_code(number)
    assert names, f"{where}: {said!r} is in nothing a notebook could name"
    assert keyed or any(re.search(rf"\b{re.escape(n)}\b", code) for n in names), \
        f"{where}: {said!r}, but notebook {number} names none of {sorted(names)}"
