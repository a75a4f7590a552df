"""Move memlab's flat modules into packages that show the layers (issue 37, item 1), re-runnably.

``MOVES`` maps each module as it is named today (dotted, inside memlab) to its new home. The
script ``git mv``\\ s each file that is still at its old path (history follows), then rewrites
every reference to the old names in the tracked text files (``memlab/``, ``tests/``, ``tools/``,
``benchmarks/``, ``notebooks/*.ipynb`` cell sources, ``docs/``, ``course/``, ``README.md``,
``Makefile``, ``pyproject.toml``, ``.ci/``):

- relative imports inside memlab become absolute (``from .x import y`` -> ``from memlab.x import
  y``, resolved against the file's old place), so a moved file needs no recomputed dots;
- dotted names ``memlab.a.b`` (imports, ``mock.patch`` strings, ``python -m`` launchers, the
  ``memlab.cli:main`` entry point, ``:mod:`` roles, ``ml.models.Block`` through the front door's
  usual ``ml`` alias) and paths ``memlab/a/b.py``;
- ``from memlab import x`` / ``from memlab.distributed import zero`` where ``x`` is a moved
  module: ``from memlab.core import hardware`` (``... import tracker as tracking`` where the file
  name changed, so the code that uses the local name is untouched);
- ``Path(__file__)...parent / "data"`` in a file that moved one level down;
- ``tools/modmap.py``'s ``LAYERS`` (rebuilt: one layer per package, lowest first, each module's
  "owns" kept), then ``docs/modules.md`` regenerated (``python tools/modmap.py``).

New packages get an ``__init__.py`` holding only a docstring (what the package owns, from
``PACKAGES``), no re-exports. Afterwards ``ruff check --fix --select I`` sorts the rewritten
imports.

    python tools/relayout.py           # move what is not moved yet, rewrite references
    python tools/relayout.py --dry-run # list the moves and the files it would rewrite
    python tools/relayout.py --check   # exit 1 unless every module is in a package and the
                                       # packages' layer order holds (no upward import)

Re-runnable: on a tree already moved it changes nothing; a module under memlab/ that neither
``MOVES`` nor its new-name side knows is listed and the script exits 2 before touching anything
(add it to ``MOVES``, and its "owns" line to ``LAYERS``, then run again).
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "memlab"

#: package -> what it owns (its ``__init__`` docstring and its layer's title in LAYERS), in
#: layer order, lowest first: a module may import its own package and the ones above it here.
PACKAGES: dict[str, str] = {
    "core": "core: errors, sizes, precisions, cards and devices, quiet output, torch's private APIs",
    "tracking": "tracking: the memory tracker, allocator snapshots, OOM messages read into numbers",
    "policy": "policy: a target device's rules (autocast, kernels, workspaces, allocator) applied to a CPU step",
    "models": "models: memlab's own GPT and UNet, a decoder's shape (the one the lenses read), the chunked loss head, the UNet's activations",
    "step": "step: a training step and its run description (LoRA, quantisation, the optimizer step in backward, activation offload), its report, the model states per rank (ZeRO, low-bit, a decoder's), its DeepSpeed config",
    "time": "time: a step's FLOPs, elementwise bytes, communication and its time on a card",
    "lenses": "lenses: estimate, simulate, measure, the guard, the H200 reference, any model, parallel formulas",
    "techniques": "techniques: sweeps, mixed precision, accumulation, batch search, compression, batching, LoRA, leaks",
    "distributed": "distributed: ranks and their workers (DDP, DeepSpeed ZeRO, offload, FSDP2, TP, PP), launchers",
    "hf": "hf: Hugging Face configs checked, read, shaped, estimated, measured; run configs read; callbacks",
    "planning": "planning: the advisor, the fastest plan that fits, the OOM ladder",
    "classroom": "classroom: lessons, predictions, exercises, the technique table, plots, widgets, collection",
    "app": "app: the memlab command, doctor, the GPU check; and memlab's front door",
}

#: old module (dotted, inside memlab) -> new module. One line per module, grouped by new package.
MOVES: dict[str, str] = {
    # core
    "errors": "core.errors",
    "units": "core.units",
    "precision": "core.precision",
    "cards": "core.cards",
    "hardware": "core.hardware",
    "quiet": "core.quiet",
    "torch_private": "core.torch_private",
    # tracking
    "tracking": "tracking.tracker",
    "snapshot": "tracking.snapshot",
    "oom": "tracking.oom_messages",
    # policy (already a package)
    "policy": "policy",
    "policy.autocast": "policy.autocast",
    "policy.elements": "policy.elements",
    "policy.kernels": "policy.kernels",
    "policy.caching_allocator": "policy.caching_allocator",
    "policy.workspaces": "policy.workspaces",
    "policy.target": "policy.target",
    "policy.emulation": "policy.emulation",
    # models (GPT and UNet stay one file: their presets, build_model and get_config span both)
    "models": "models.gpt_unet",
    "chunked_loss": "models.chunked_loss",
    "diffusion": "models.diffusion",
    "shape": "models.decoder_shape",
    # step
    "step": "step.training_step",
    "states": "step.states",
    "low_bit": "step.low_bit",
    "run": "step.fine_tune_config",
    "hf_states": "step.decoder_states",
    "in_backward": "step.optimizer_in_backward",
    "activation_offload": "step.activation_offload",
    "distributed.zero": "step.zero",
    "distributed.deepspeed_config": "step.write_deepspeed_config",
    # time
    "flops": "time.flops",
    "elementwise": "time.elementwise",
    "communication": "time.communication",
    "step_time": "time.step_time",
    # lenses
    "estimate": "lenses.estimate",
    "simulate": "lenses.simulate",
    "measure": "lenses.measure",
    "guard": "lenses.guard",
    "reference": "lenses.reference",
    "your_model": "lenses.your_model",
    "calculator": "lenses.calculator",
    "distributed.parallel_formulas": "lenses.parallel_formulas",
    # techniques
    "sweeps": "techniques.sweeps",
    "mixed_precision": "techniques.mixed_precision",
    "accumulation": "techniques.accumulation",
    "max_batch": "techniques.max_batch",
    "compression": "techniques.compression",
    "batching": "techniques.batching",
    "finetune": "techniques.finetune",
    "leaks": "techniques.leaks",
    # distributed: ranks and workers only
    "distributed": "distributed",
    "distributed.__main__": "distributed.__main__",
    "distributed.ranks": "distributed.ranks",
    "distributed.data_parallel": "distributed.data_parallel",
    "distributed.deepspeed_zero": "distributed.deepspeed_zero",
    "distributed.deepspeed_rank0": "distributed.deepspeed_rank0",
    "distributed.offload": "distributed.offload",
    "distributed.fsdp": "distributed.fsdp",
    "distributed.parallel_common": "distributed.parallel_common",
    "distributed.tensor_parallel": "distributed.tensor_parallel",
    "distributed.pipeline_parallel": "distributed.pipeline_parallel",
    "distributed.comm_count": "distributed.comm_count",
    "distributed.zero_worker": "distributed.zero_worker",
    # hf
    "hf": "hf.config",
    "hf_config_check": "hf.config_check",
    "hf_shape": "hf.shape",
    "hf_estimate": "hf.estimate",
    "hf_measure": "hf.measure",
    "hf_simulate": "hf.simulate",
    "post_training": "hf.post_training",
    "evaluation": "hf.evaluation",
    "trl_measure": "hf.trl_measure",
    "run_config": "hf.read_run_configs",
    "callbacks": "hf.callbacks",
    "simulation_bound": "hf.simulation_bound",
    # planning
    "advisor": "planning.advisor",
    "plan_search": "planning.plan_search",
    "oom_ladder": "planning.oom_ladder",
    # classroom (the technique table draws with plots, so it sits beside them)
    "lesson": "classroom.lesson",
    "classroom": "classroom.collect",
    "predictions": "classroom.predictions",
    "watchdog": "classroom.watchdog",
    "technique_table": "classroom.technique_table",
    "plots": "classroom.plots",
    "widgets": "classroom.widgets",
    "exercises": "classroom.exercises",
    "exercises.accumulation": "classroom.exercises.accumulation",
    "exercises.amp": "classroom.exercises.amp",
    "exercises.checkpoint": "classroom.exercises.checkpoint",
    "exercises.common": "classroom.exercises.common",
    "exercises.compression": "classroom.exercises.compression",
    "exercises.data_parallel": "classroom.exercises.data_parallel",
    "exercises.diffusion": "classroom.exercises.diffusion",
    "exercises.evaluation": "classroom.exercises.evaluation",
    "exercises.experts": "classroom.exercises.experts",
    "exercises.gqa": "classroom.exercises.gqa",
    "exercises.leaks": "classroom.exercises.leaks",
    "exercises.logits": "classroom.exercises.logits",
    "exercises.oom": "classroom.exercises.oom",
    "exercises.pipeline": "classroom.exercises.pipeline",
    "exercises.planning": "classroom.exercises.planning",
    "exercises.start": "classroom.exercises.start",
    "exercises.table": "classroom.exercises.table",
    "exercises.tensor_parallel": "classroom.exercises.tensor_parallel",
    "exercises.zero": "classroom.exercises.zero",
    # app
    "cli": "app.cli",
    "doctor": "app.doctor",
    "gpu_check": "app.gpu_check",
}

#: file-specific rewrites the name rules cannot see (applied where the old text is present).
FIXUPS: list[tuple[str, str, str]] = [
    ("tests/test_units.py", 'path.name == "units.py" and path.parent == package',
     'path.name == "units.py" and path.parent == package / "core"'),
    ("memlab/classroom/exercises/checkpoint.py",
     '"class CheckpointedBlock(ml.models.gpt_unet.Block) whose forward runs under checkpoint(..., use_reentrant=False)"',
     '"class CheckpointedBlock(ml.models.gpt_unet.Block) whose forward runs under "\n'
     '            "checkpoint(..., use_reentrant=False)"'),
    # module-map names (no memlab. prefix), which the name rules leave alone
    ("tests/test_architecture.py", 'assert "plots" in graph["technique_table"]',
     'assert "classroom.plots" in graph["classroom.technique_table"]'),
    ("tests/test_architecture.py", '{"distributed", "distributed.parallel_formulas"} <= graph["technique_table"]',
     '{"distributed", "lenses.parallel_formulas"} <= graph["classroom.technique_table"]'),
    ("tests/test_architecture.py", 'assert graph["errors"] == set()', 'assert graph["core.errors"] == set()'),
    # relative imports are absolute now
    ("tests/test_architecture.py", '           ".plots",\n', '           "memlab.classroom.plots",\n'),
    ("tests/test_claims.py", '(ROOT / "memlab" / "step_time.py")', '(ROOT / "memlab" / "time" / "step_time.py")'),
]

#: the tracked files whose references are rewritten
TEXT_SUFFIXES = {".py", ".md", ".toml", ".ipynb", ".cfg", ".yml", ".yaml", ".txt", ".sh"}
TEXT_NAMES = {"Makefile", "run"}
#: files that spell the old names on purpose (the mapping, its tests)
SELF = {"tools/relayout.py", "tests/test_relayout.py"}

OLD = {o: n for o, n in MOVES.items() if o != n}  # the names that change
NEW = set(MOVES.values())
NEW_ALL = NEW | {".".join(n.split(".")[:i]) for n in NEW for i in range(1, n.count(".") + 1)}
#: old modules whose name is also a new package's ("tracking", "hf", ...): ``memlab.hf.X`` is new
#: when ``hf.X`` is a new module, old otherwise (:func:`resolve`); a bare ``memlab.hf`` is the old one
AMBIGUOUS = {o for o in OLD if o in NEW_ALL}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def old_path(name: str) -> pathlib.Path:
    """Where a module lives under its old name (a package: its folder)."""
    base = PACKAGE.joinpath(*name.split("."))
    return base if is_package(name) else base.with_suffix(".py")


def is_package(old: str) -> bool:
    return any(o.startswith(old + ".") for o in MOVES)


# -- name rules ---------------------------------------------------------------------------------
def resolve(parts: list[str]) -> list[str]:
    """A dotted name inside memlab (``["hf", "load_config"]``) under the new layout.

    The longest prefix that names a module decides: ``hf.config.X`` is new (``hf.config`` is a
    new module) before ``hf`` (an old one) is looked at, so a new name maps to itself."""
    for k in range(len(parts), 0, -1):
        name = ".".join(parts[:k])
        if name in OLD:
            return OLD[name].split(".") + parts[k:]
        if name in NEW_ALL:
            return parts
    return parts


DOTTED = re.compile(r"(?<![\w.])(?<!from )(memlab|ml)((?:\.[A-Za-z_]\w*)+)")
PATH = re.compile(r"(?<![\w/.])memlab/((?:\w+/)*\w+)(\.py|/)")


def rewrite_dotted(text: str) -> str:
    def sub(m: re.Match) -> str:
        parts = m.group(2)[1:].split(".")
        if m.group(1) == "ml" and parts[0] not in OLD and parts[0] not in NEW_ALL:
            return m.group(0)
        return m.group(1) + "." + ".".join(resolve(parts))
    return DOTTED.sub(sub, text)


def rewrite_paths(text: str) -> str:
    def sub(m: re.Match) -> str:
        parts, tail = m.group(1).split("/"), m.group(2)
        if tail == "/":  # a folder: memlab/exercises/ -> memlab/classroom/exercises/
            name = ".".join(parts)
            if name in OLD and is_package(name) and name not in AMBIGUOUS:
                return "memlab/" + OLD[name].replace(".", "/") + "/"
            return m.group(0)
        name = ".".join(parts)
        if parts[-1] == "__init__":
            pkg = ".".join(parts[:-1])
            if pkg in OLD and is_package(pkg):
                return "memlab/" + OLD[pkg].replace(".", "/") + "/__init__.py"
            return m.group(0)
        if name in OLD and not is_package(name):
            return "memlab/" + OLD[name].replace(".", "/") + ".py"
        return m.group(0)
    return PATH.sub(sub, text)


def _import_from(module: list[str], names: list[ast.alias]) -> list[tuple[str, str, str | None]]:
    """(new module, name, alias) per imported name of ``from memlab.<module> import <names>``."""
    out = []
    for a in names:
        full = module + [a.name]
        if ".".join(full) in OLD:  # a moved module: `from memlab import hf` is the old module
            new = OLD[".".join(full)].split(".")
            alias = a.asname or (a.name if new[-1] != a.name else None)
            out.append((".".join(["memlab", *new[:-1]]), new[-1], alias))
        else:  # a name in a module: the name decides whether `hf` is old (hf.load_config) or new
            mod = resolve(full)[:-1]
            out.append((".".join(["memlab", *mod]), a.name, a.asname))
    return out


FROM_LINE = re.compile(r"(?<![\w.])(^[ \t]*(?:>>> )?)?from[ \t]+(memlab(?:\.\w+)*)[ \t]+import[ \t]+"
                       r"(\w+(?:[ \t]+as[ \t]+\w+)?(?:[ \t]*,[ \t]*\w+(?:[ \t]+as[ \t]+\w+)?)*)(?![\w(])", re.M)


def rewrite_from_text(text: str) -> str:
    """``from memlab.x import a, b as c`` on one line (code, docs, docstrings, code in strings):
    at a line's start, split into lines where the names' homes differ; inside a line (``python -c``
    code), joined with ``; ``."""
    def sub(m: re.Match) -> str:
        prefix, module = m.group(1), m.group(2).split(".")[1:]
        names = []
        for item in m.group(3).split(","):
            bits = item.split()
            names.append(ast.alias(bits[0], bits[2] if len(bits) == 3 else None))
        groups: dict[str, list[tuple[str, str | None]]] = {}
        for mod, name, alias in _import_from(module, names):
            groups.setdefault(mod, []).append((name, alias))
        if list(groups) == [m.group(2)] and groups[m.group(2)] == [(a.name, a.asname) for a in names]:
            return m.group(0)
        if prefix is None:  # inside a line
            return "; ".join(_format(mod, ns, "") for mod, ns in groups.items())
        return "\n".join(_format(mod, ns, prefix) for mod, ns in groups.items())
    return FROM_LINE.sub(sub, text)


def _format(module: str, names: list[tuple[str, str | None]], indent: str) -> str:
    items = [n if a is None else f"{n} as {a}" for n, a in names]
    line = f"{indent}from {module} import {', '.join(items)}"
    if len(line) <= 110:
        return line
    body = "".join(f"{indent}    {i},\n" for i in items)
    return f"{indent}from {module} import (\n{body}{indent})"


def rewrite_python(src: str, package: list[str] | None) -> str:
    """Rewrite a Python source: relative imports (``package``: the file's package inside memlab,
    None outside memlab) made absolute, ``from memlab... import`` split where modules moved,
    then every dotted name and path."""
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return rewrite_text(src)
    lines = src.splitlines(keepends=True)
    edits: list[tuple[int, int, str]] = []  # (first line, last line, replacement), 0-based
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            if package is None:
                continue
            base = package[:len(package) - node.level + 1]
            module = base + (node.module.split(".") if node.module else [])
        elif (node.module or "").split(".")[0] == "memlab":
            module = node.module.split(".")[1:]
        else:
            continue
        first, last = node.lineno - 1, node.end_lineno - 1
        indent = re.match(r"\s*", lines[first]).group(0)
        if not lines[first][len(indent):].startswith("from") or node.col_offset != len(indent):
            continue  # `if x: from ...` on one line: leave it
        tail = lines[last][node.end_col_offset:]
        groups: dict[str, list[tuple[str, str | None]]] = {}
        for mod, name, alias in _import_from(module, node.names):
            groups.setdefault(mod, []).append((name, alias))
        old_text = "".join(lines[first:last + 1])
        same = [(x.name, x.asname) for x in node.names]
        if len(groups) == 1 and next(iter(groups.values())) == same:
            mod = next(iter(groups))
            new_text = re.sub(r"from\s+[\w.]+\s+import", f"from {mod} import", old_text, count=1)
        else:
            new_text = "\n".join(_format(m, ns, indent) for m, ns in groups.items()) + tail
            if not new_text.endswith("\n") and old_text.endswith("\n"):
                new_text += "\n"
        if new_text != old_text:
            edits.append((first, last, new_text))
    for first, last, text in sorted(edits, reverse=True):
        lines[first:last + 1] = [text]
    out = "".join(lines)
    # the rest: dotted names in strings, docstrings, `import memlab.x`, attribute chains
    return rewrite_text(out)


def rewrite_text(text: str) -> str:
    """Any text: one-line from-imports, then dotted names (not the from-imports' own), then paths.
    Each rule maps a new name to itself, so a second pass changes nothing."""
    return rewrite_paths(rewrite_dotted(rewrite_from_text(text)))


MAGIC = re.compile(r"^\s*[%!]")


def rewrite_cell(src: str) -> str:
    """A notebook cell: magics blanked for parsing, the rest rewritten as Python."""
    lines = src.split("\n")
    magic = {i: ln for i, ln in enumerate(lines) if MAGIC.match(ln)}
    masked = "\n".join("pass" if i in magic else ln for i, ln in enumerate(lines))
    out = rewrite_python(masked, None).split("\n")
    if len(out) != len(lines):  # an import was re-wrapped: magics are rare, keep them in place
        if magic:
            return rewrite_text(src)
        return "\n".join(out)
    return "\n".join(magic.get(i, ln) for i, ln in enumerate(out))


def rewrite_notebook(text: str) -> str:
    nb = json.loads(text)
    changed = False
    for cell in nb.get("cells", []):
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        new = rewrite_cell(src) if cell["cell_type"] == "code" else rewrite_text(src)
        if new != src:
            cell["source"] = new.splitlines(keepends=True)
            changed = True
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n" if changed else text


DATA_DIR = re.compile(r"(Path\(__file__\)(?:\.resolve\(\))?)\.parent(\s*/\s*[\"']data[\"'])")


def rewrite_file(path: pathlib.Path, package: list[str] | None, depth_change: int) -> bool:
    text = path.read_text()
    if path.suffix == ".ipynb":
        new = rewrite_notebook(text)
    elif path.suffix == ".py":
        new = rewrite_python(text, package)
        if depth_change > 0:
            new = DATA_DIR.sub(lambda m: f"{m.group(1)}.parents[{depth_change}]{m.group(2)}", new)
    else:
        new = rewrite_text(text)
    rel = path.relative_to(ROOT).as_posix()
    for file, old, repl in FIXUPS:
        if file == rel and old in new and repl not in new:
            new = new.replace(old, repl)
    if new != text:
        path.write_text(new)
        return True
    return False


# -- LAYERS ---------------------------------------------------------------------------------------
def load_modmap():
    spec = importlib.util.spec_from_file_location("modmap_for_relayout", ROOT / "tools" / "modmap.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


LAYERS_RE = re.compile(r"^LAYERS: list\[tuple\[str, dict\[str, str\]\]\] = \[\n.*?^\]\n", re.S | re.M)


def layers_text(old_layers) -> str:
    owns: dict[str, str] = {}
    already = [title for title, _ in old_layers] == list(PACKAGES)  # keys are new names already
    for _, owned in old_layers:
        for m, what in owned.items():
            owns[m if already else OLD.get(m, m)] = what
    lines = ["LAYERS: list[tuple[str, dict[str, str]]] = ["]
    for pkg, title in PACKAGES.items():
        lines.append(f"    ({title.split(':')[0]!r}, {{")
        members = [pkg] + [n for n in MOVES.values() if n.split(".")[0] == pkg and n != pkg]
        if pkg == "app":
            members.append("__init__")
        for m in dict.fromkeys(members):
            what = owns.get(m) or (title.split(": ", 1)[1] if m == pkg else "")
            if not what:
                raise SystemExit(f"relayout: no 'owns' line for {m} in LAYERS")
            lines.append(f"        {m!r}: {json.dumps(what, ensure_ascii=False)},")
        lines.append("    }),")
    lines.append("]\n")
    return "\n".join(lines)


# -- the run --------------------------------------------------------------------------------------
def tracked_files() -> list[pathlib.Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = []
    for rel in out.split("\0"):
        if not rel or rel.startswith("memlab/data/"):
            continue
        p = ROOT / rel
        if p.is_file() and (p.suffix in TEXT_SUFFIXES or p.name in TEXT_NAMES) and rel not in SELF:
            files.append(p)
    return files


def unknown_modules() -> list[str]:
    known = set(MOVES) | NEW | set(PACKAGES) | {"__init__"}
    return sorted(m for m in (module_name(p) for p in PACKAGE.rglob("*.py")) if m not in known)


def plan_moves() -> list[tuple[str, pathlib.Path, pathlib.Path]]:
    moves = []
    for old, new in OLD.items():
        if "." in old and old.split(".")[0] in OLD and is_package(old.split(".")[0]):
            continue  # a member of a package that moves whole (exercises.*)
        src = old_path(old)
        dst = PACKAGE.joinpath(*new.split("."))
        dst = dst if is_package(old) else dst.with_suffix(".py")
        if src.exists() and not dst.exists():
            moves.append((old, src, dst))
        elif src.exists() and dst.exists() and src != dst:
            raise SystemExit(f"relayout: both {src.relative_to(ROOT)} and {dst.relative_to(ROOT)} exist; "
                             "merge them by hand")
    return moves


def run(dry: bool) -> int:  # noqa: C901 the tool's steps in order, each with its dry-run branch
    unknown = unknown_modules()
    if unknown:
        print("relayout: modules MOVES does not know (add each to MOVES and its owns line to LAYERS):", file=sys.stderr)
        for m in unknown:
            print(f"  {m}", file=sys.stderr)
        return 2
    moves = plan_moves()
    # each memlab file's package before the move, for its relative imports
    packages: dict[pathlib.Path, tuple[list[str], int]] = {}
    for p in PACKAGE.rglob("*.py"):
        name = module_name(p)
        pkg = name.split(".") if p.name == "__init__.py" and name != "__init__" else name.split(".")[:-1]
        if name == "__init__":
            pkg = []
        packages[p] = (pkg, 0)
    relocated: dict[pathlib.Path, pathlib.Path] = {}
    for _old, src, dst in moves:
        if src.is_dir():
            for p in src.rglob("*.py"):
                relocated[p] = dst / p.relative_to(src)
        else:
            relocated[src] = dst
    if dry:
        for _old, src, dst in moves:
            print(f"git mv {src.relative_to(ROOT)} {dst.relative_to(ROOT)}")
        return 0
    for pkg, title in PACKAGES.items():
        init = PACKAGE / pkg / "__init__.py"
        if not init.exists():
            init.parent.mkdir(exist_ok=True)
            # no bare `memlab.<pkg>` in the text: the name rules would read it as the old module
            body = textwrap.fill(f"The {pkg} package, layer {list(PACKAGES).index(pkg)} of memlab: "
                                 f"{title.split(': ', 1)[1]}.", 96)
            init.write_text(f'"""{body}\n\nNo re-exports: import a name from the module that owns it '
                            f'(the module map: docs/modules.md)."""\n')
            subprocess.run(["git", "add", str(init)], cwd=ROOT, check=True)
    for _old, src, dst in moves:
        dst.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "mv", str(src), str(dst)], cwd=ROOT, check=True)
        print(f"moved {src.relative_to(ROOT)} -> {dst.relative_to(ROOT)}")
    changed = []
    for path in tracked_files():
        pkg, depth = None, 0
        before = next((s for s, d in relocated.items() if d == path), path)
        if before in packages:
            pkg = packages[before][0]
            depth = len(path.relative_to(PACKAGE).parts) - len(before.relative_to(PACKAGE).parts)
        elif path.is_relative_to(PACKAGE):
            name = module_name(path)
            pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        if rewrite_file(path, pkg, depth):
            changed.append(path.relative_to(ROOT).as_posix())
    modmap_py = ROOT / "tools" / "modmap.py"
    text = modmap_py.read_text()
    new_text = LAYERS_RE.sub(lambda m: layers_text(load_modmap().LAYERS), text, count=1)
    if new_text != text:
        modmap_py.write_text(new_text)
        changed.append("tools/modmap.py (LAYERS)")
    for c in changed:
        print(f"rewrote {c}")
    ruff = shutil.which("ruff") or str(pathlib.Path(sys.executable).with_name("ruff"))
    if changed and pathlib.Path(ruff).exists():
        subprocess.run([ruff, "check", "--fix", "--select", "I", "-q", "memlab", "tests", "tools", "benchmarks"],
                       cwd=ROOT)
    subprocess.run([sys.executable, str(ROOT / "tools" / "modmap.py")], cwd=ROOT, check=True)
    if not moves and not changed:
        print("relayout: already laid out; nothing to do")
    return 0


def check() -> list[str]:
    """What breaks the layout: flat modules, modules outside PACKAGES' layers, upward imports."""
    problems = []
    for p in sorted(PACKAGE.glob("*.py")):
        if p.name not in ("__init__.py", "__main__.py"):
            problems.append(f"memlab/{p.name}: a flat module (move it into a package: MOVES)")
    order = list(PACKAGES)
    modmap = load_modmap()
    layers = modmap.layer_of()
    for name, (title, _owned) in zip(order, modmap.LAYERS, strict=False):
        if title != name:
            problems.append(f"tools/modmap.py: LAYERS' layer {title!r} where package {name!r} is expected")
    rank = {m: order.index(m.split(".")[0]) for m in modmap.modules() if m.split(".")[0] in order}
    rank["__init__"] = len(order)
    for m in modmap.modules():
        if m not in rank:
            problems.append(f"memlab/{m}: not in a package of the layer order")
        elif m in layers and layers[m] != rank[m] and m != "__init__":
            problems.append(f"{m}: in LAYERS' layer {layers[m]}, its package is layer {rank[m]}")
    for m, deps in modmap.graph().items():
        for d in deps:
            if m in rank and d in rank and rank[d] > rank[m]:
                problems.append(f"{m} imports {d}: a package above its own ({order[rank[m]]} < "
                                f"{order[rank[d]] if rank[d] < len(order) else '__init__'})")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 unless the tree is laid out in packages, in order")
    ap.add_argument("--dry-run", action="store_true", help="list the moves, change nothing")
    args = ap.parse_args(argv)
    if args.check:
        problems = check()
        for p in problems:
            print(p, file=sys.stderr)
        return 1 if problems else 0
    return run(args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
