"""The layering the module map (docs/modules.md) promises (``tools/modmap.py``: LAYERS, lowest first):
every module is on the map, no module imports from a layer above its own, there is no import
cycle, and the map is what the code says. Also: domain modules run without a notebook
stack, and no module reaches into another's private names."""
import ast
import pathlib
import subprocess
import sys

import pytest

import memlab

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
import modmap

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


def _from_memlab(node: ast.ImportFrom) -> bool:
    """``from .x import`` or ``from memlab.x import`` (tools/relayout.py makes them all absolute)."""
    return node.level > 0 or (node.module or "").split(".")[0] == "memlab"


def test_no_private_names_across_modules():
    offences = []
    for path in _modules():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and _from_memlab(node):
                offences += [f"{path.name}: from {'.' * node.level}{node.module} import {a.name}"
                             for a in node.names if a.name.startswith("_")]
            # memlab_module._name: an attribute of an imported memlab module
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and isinstance(node.value, ast.Name)):
                imported = {a.asname or a.name for n in ast.walk(tree)
                            if isinstance(n, ast.ImportFrom) and _from_memlab(n) for a in n.names}
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


# -- the module map and the layers ------------------------------------------------------------
FIX = "add it to LAYERS in tools/modmap.py (its layer, what it owns), then run python tools/modmap.py"


def _allowed() -> set[tuple[str, str]]:
    """The tolerated edges, with the packages the imported module sits in."""
    out = set()
    for a, b in modmap.ALLOWED:
        parts = b.split(".")
        out |= {(a, ".".join(parts[:i])) for i in range(1, len(parts) + 1)}
    return out


def _graph() -> dict[str, set[str]]:
    allowed = _allowed()
    return {m: {d for d in deps if (m, d) not in allowed} for m, deps in modmap.graph().items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_is_on_the_map_and_every_line_is_a_module():
    on_map = modmap.layer_of()
    modules = set(modmap.modules())
    missing = [f"memlab/{modmap.module_path(m).relative_to(modmap.PACKAGE)} is not on the module map: {FIX}"
               for m in sorted(modules - set(on_map))]
    assert missing == []
    assert sorted(set(on_map) - modules) == [], "LAYERS names a module that does not exist"
    mapped = [m for _, owned in modmap.LAYERS for m in owned]
    assert len(mapped) == len(set(mapped)), "a module is in two layers"


def test_no_module_imports_from_a_layer_above_its_own():
    layer = modmap.layer_of()
    names = [name for name, _ in modmap.LAYERS]
    upward = [f"{m} ({names[layer[m]]}) imports {d} ({names[layer[d]]})"
              for m, deps in _graph().items() for d in sorted(deps)
              if m in layer and d in layer and layer[d] > layer[m]]
    assert upward == []


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_a_cycle_through_three_modules():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("edge", sorted(modmap.ALLOWED))
def test_each_tolerated_import_still_exists(edge):
    """Once the code drops a tolerated import, its line in ALLOWED must go too."""
    a, b = edge
    assert b in modmap.graph()[a], f"{a} no longer imports {b}: delete it from ALLOWED in tools/modmap.py"


def test_the_module_map_in_docs_is_what_the_code_says():
    block = modmap.map_block(modmap.MAP_PAGE.read_text())
    assert block is not None, f"docs/modules.md lost its {modmap.START} ... {modmap.END} markers"
    assert block == modmap.render(), "docs/modules.md's module map is out of date: run python tools/modmap.py"


def test_the_map_reads_imports_anywhere_in_a_file():
    """The imports column counts function-level imports and a package's __init__."""
    graph = modmap.graph()
    assert "classroom.plots" in graph["classroom.technique_table"]            # inside Table.plot
    # distributed/__init__ runs first
    assert {"distributed", "lenses.parallel_formulas"} <= graph["classroom.technique_table"]
    assert graph["core.errors"] == set()
    assert "distributed" not in graph["distributed.tensor_parallel"]  # its own package is loaded before it


@pytest.mark.parametrize("page", ["README.md"] + sorted(p.relative_to(modmap.ROOT).as_posix()
                                                     for p in (modmap.ROOT / "docs").glob("*.md")))
def test_every_table_starts_with_its_header(page):
    """A table row after a non-table line starts a new table: it must be a header (the next
    line the ``| --- |`` rule), or else a paragraph has cut a table in two."""
    lines = (modmap.ROOT / page).read_text().splitlines()
    cut = [f"{page}:{i + 1}: {line[:60]}" for i, line in enumerate(lines)
           if line.startswith("|") and not lines[i - 1].startswith("|")
           and not (i + 1 < len(lines) and lines[i + 1].startswith("| ---"))]
    assert cut == []


# -- function-level imports: only for optional or heavy dependencies ------------------------
#: What a function may import: optional dependencies, the UI edge, torch submodules that
#: ``import memlab`` does not load and that cost seconds (timed on this repo's CPU machine:
#: pipelining +6.3 s, fsdp +2.9 s, tensor +2.2 s, cpp_extension +1.0 s), POSIX-only
#: ``resource``, nbformat/nbclient (the lab extra, for ``memlab class`` only), PyYAML (comes with
#: the hf extra's transformers; --training-args YAML only), bitsandbytes (the hf extra; a run's
#: 8-bit optimizers and 4-bit base only), trl with its datasets and tokenizers (the hf extra; the
#: post-training measure lens only), accelerate (the hf extra; the post-training simulation's
#: autocast wrap only); memlab's ``plots`` is matplotlib.
#: Everything else is imported at the top, where a reader sees it.
LATE_OK = ("deepspeed", "ipywidgets", "IPython", "transformers", "peft", "bitsandbytes", "torchao", "matplotlib",
           "tqdm.auto", "nbformat", "nbclient", "yaml", "trl", "datasets", "tokenizers", "accelerate",
           "memlab.classroom.plots",
           "torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.pipelining",
           "torch.distributed._tools", "torch.utils.cpp_extension", "resource",
           "torch._inductor", "torch._functorch", "torch.profiler",  # compile and its profiler: heavy, on use
           # private names that move between torch releases: imported where used, so that
           # core.torch_private itself imports on any release (the GPU machine's 2.11)
           "torch._meta_registrations", "torch._subclasses")
#: Modules whose functions may import memlab's own modules late: the CLI, where each command
#: imports its lens when it runs (`memlab --help` and `estimate` stay near torch's own import:
#: benchmarks/cli_startup.py, tests/test_startup.py).
LATE_MEMLAB_OK = ("app.cli",)


def _late_imports() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name in modmap.modules():
        path = modmap.module_path(name)
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = ["." * node.level + (node.module or "")]
                else:
                    continue
                late = [n for n in names if not any(n == ok or n.startswith(ok + ".") for ok in LATE_OK)
                        and not (name in LATE_MEMLAB_OK and n.startswith((".", "memlab.")))]
                out.setdefault(name, []).extend(f"memlab/{path.relative_to(modmap.PACKAGE).as_posix()}:"
                                                 f"{node.lineno}: {n}" for n in late)
    return {k: v for k, v in out.items() if v}


def test_function_level_imports_are_only_optional_or_heavy_dependencies():
    late = _late_imports()
    offences = [line for lines in late.values() for line in lines]
    assert offences == [], "import these at the top of the module"


# -- one job per module ------------------------------------------------------------------------
LONG = 500


def test_a_module_over_500_lines_says_why_in_its_docstring():
    long = {}
    for name in modmap.modules():
        path = modmap.module_path(name)
        text = path.read_text()
        doc = ast.get_docstring(ast.parse(text)) or ""
        if len(text.splitlines()) > LONG and f"Over {LONG} lines because" not in doc:
            long[name] = len(text.splitlines())
    assert long == {}, f"split it, or say why not in its docstring ('Over {LONG} lines because ...')"


def test_no_module_maps_a_hugging_face_config_onto_memlabs_gpt():
    """Issue 36: every lens, the advisor and the CLI read a Hugging Face config as its decoder's
    shape (:func:`memlab.hf.shape.decoder_shape`); no module defines or calls a mapping onto
    memlab's GPT (``gpt_config``, ``step_config``, ``maps_to_gpt``: tests/hf_gpt_mapping.py keeps
    one as a second lens on memlab's own GPT)."""
    names = {"gpt_config", "step_config", "maps_to_gpt"}
    found = set()
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name in names:
                found.add(f"{rel}: def {node.name}")
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name in names:
                    found.add(f"{rel}: {name}()")
    assert found == set()


#: methods that count a model's parameters
COUNTS = {"param_numels", "num_params", "matmul_numels", "layer_params", "attention_params", "dense_mlp_params"}


def test_one_shape_type_counts_the_parameters():
    """Issue 36: one model description. Parameters are counted from widths in one place,
    :class:`memlab.models.decoder_shape.DecoderShape` (a Hugging Face config's shape and memlab's
    GPT's, ``GPTConfig.shape``); any other class's count reads its ``shape`` or its built module's
    ``parameters()`` (the UNet), never widths of its own."""
    own = set()
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
            if cls.name == "DecoderShape":
                continue
            for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in COUNTS):
                reads = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)}
                if not reads & {"shape", "parameters", "params"}:
                    own.add(f"{rel}: {cls.name}.{fn.name}")
    assert own == set()


def test_one_run_type_holds_the_parallel_degrees():
    """Issue 36: one run description. The tensor, pipeline and expert degrees are the run's own
    (``StepConfig.parallel``, one :class:`memlab.step.parallel_dims.ParallelDims`), not keywords
    beside it: no lens, time or config entry that reads a run takes one."""
    import dataclasses
    import inspect

    from memlab.lenses.decoder_estimate import estimate_run
    from memlab.lenses.estimate import estimate_step
    from memlab.lenses.measure import measure_step
    from memlab.lenses.simulate import simulate_step
    from memlab.step.parallel_dims import ParallelDims
    from memlab.step.training_step import StepConfig
    from memlab.step.write_deepspeed_config import deepspeed_config
    from memlab.time.communication import step_communication
    from memlab.time.step_time import report_time, step_time

    degrees = {"tensor_parallel", "pipeline_parallel", "expert_parallel", "expert_imbalance", "tp", "pp", "ep"}
    beside = {fn.__name__: sorted(set(inspect.signature(fn).parameters) & degrees)
              for fn in (estimate_step, estimate_run, simulate_step, measure_step, step_time, report_time,
                         step_communication, deepspeed_config)}
    assert {k: v for k, v in beside.items() if v} == {}
    fields = {f.name: f.type for f in dataclasses.fields(StepConfig)}
    assert fields["parallel"] in (ParallelDims, "ParallelDims") and not set(fields) & degrees
