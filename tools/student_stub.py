"""The student copy's answer cell: stubs for the names a solution cell defines (stdlib only).

An emptied solution cell left as ``# your code here`` makes the check cell after it fail with
``NameError: name 'CheckpointedBlock' is not defined``, which says nothing about the exercise.
Instead the student cell defines every top-level name the solution defines (``def``,
``class``, assignment) as ``None``; each checker treats ``None`` as "not written yet" and says
what to write and where (``memlab.classroom.exercises.common.require``)::

    # your code here
    CheckpointedBlock = None  # your code here: a class (replace this line)
"""
from __future__ import annotations

import ast

PLACEHOLDER = "# your code here"


def defined_names(source: str) -> list[tuple[str, str]]:
    """``(name, kind)`` for every top-level function, class and assigned name of ``source``,
    in order, once each; imports are not answers and are left out."""
    out: dict[str, str] = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.setdefault(node.name, "a function")
        elif isinstance(node, ast.ClassDef):
            out.setdefault(node.name, "a class")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        out.setdefault(n.id, "a value")
    return list(out.items())


def student_source(solution: str | list[str]) -> list[str]:
    """The source lines of the student cell that replaces ``solution`` (a cell's source)."""
    text = "".join(solution) if isinstance(solution, list) else solution
    try:
        names = defined_names(text)
    except SyntaxError:  # not Python (a %magic cell): the bare placeholder
        names = []
    lines = [PLACEHOLDER] + [f"{name} = None  # your code here: {kind} (replace this line)"
                             for name, kind in names]
    return [line + "\n" for line in lines[:-1]] + [lines[-1]]
