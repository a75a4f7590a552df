"""The layering the README's module map promises: domain modules run without a notebook
stack, and no module reaches into another's private names."""
import ast
import pathlib
import subprocess
import sys

import memlab

PACKAGE = pathlib.Path(memlab.__file__).parent
UI = {"widgets"}  # the only modules allowed to import ipywidgets / IPython


def _modules() -> list[pathlib.Path]:
    return sorted(p for p in PACKAGE.rglob("*.py"))


def _dotted(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def test_domain_modules_import_without_ipywidgets():
    domain = [_dotted(p) for p in _modules()
              if p.stem not in UI and p.stem != "__main__"]
    code = ("import sys; sys.modules['ipywidgets'] = None; sys.modules['IPython'] = None\n"
            "import importlib\n"
            f"for name in {domain!r}: importlib.import_module(name)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_no_private_names_across_modules():
    offences = []
    for path in _modules():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                offences += [f"{path.name}: from {'.' * node.level}{node.module} import {a.name}"
                             for a in node.names if a.name.startswith("_")]
            # memlab_module._name: an attribute of an imported memlab module
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and isinstance(node.value, ast.Name)):
                imported = {a.asname or a.name for n in ast.walk(tree)
                            if isinstance(n, ast.ImportFrom) and n.level > 0 for a in n.names}
                if node.value.id in imported:
                    offences.append(f"{path.name}: {node.value.id}.{node.attr}")
    assert offences == []


def test_only_ui_imports_ipywidgets():
    users = set()
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] in ("ipywidgets", "IPython") for n in names):
                users.add(path.stem)
    assert users <= UI, users
