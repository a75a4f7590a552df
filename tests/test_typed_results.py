"""Results are typed (issue 37, item 3): no public function of ``memlab/`` is annotated to
return a bare ``dict`` (``dict``, ``dict[str, Any]``, ``list[dict]``, ...) outside the short
lists below, and every function longer than 80 lines says why in its docstring.

A mapping keyed by data (``dict[str, int]``: bytes by category, seconds by variant) is typed
and allowed; a record with fixed keys is a frozen dataclass with a docstring per field.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "memlab"

#: functions whose job is a dict in a format memlab does not own (torch's, Hugging Face's,
#: DeepSpeed's, peft's) or a JSON file it writes; each docstring says so in a line that
#: starts "A dict because". ``to_dict`` methods are exempt by name: they are the JSON.
EXTERNAL = {
    "core.torch_private.memory_snapshot", "tracking.snapshot.load_snapshot",
    "hf.config.shipped_config", "hf.config.load_config", "hf.config.rope_parameters",
    "hf.config_check.given_fields", "hf.config_check.record",
    "hf.read_run_configs.load_file", "hf.read_run_configs.resolve_auto",
    "hf.read_run_configs.accelerate_precision", "hf.post_training.trl_defaults",
    "step.write_deepspeed_config.deepspeed_config", "step.fine_tune_config.LoraConfig.peft_kwargs",
    "step.optimizer_in_backward.OptimizerInBackward.param_groups",
    "step.optimizer_in_backward.OptimizerInBackward.state",
    "step.training_step.StepConfig.describe", "lenses.your_model.ModelStep.describe",
    "lenses.reference.load_references",
    "app.gpu_check.lens_row", "app.gpu_check.collect", "app.gpu_check.deepspeed_one_gpu_worker",
    "app.gpu_check.collect_deepspeed",
}
CONVERTERS = {"to_dict"}
#: not yet typed (issue 37 item 3, left for a later change): each rank's numbers, made in a
#: spawned or torchrun'd worker, pickled back to the parent and printed as JSON by
#: ``python -m memlab.distributed``; ParallelResult.per_rank holds them as they come.
RANK_PAYLOADS = {
    "distributed.__main__.main",
    "distributed.comm_count.ddp_count_worker", "distributed.comm_count.zero_count_worker",
    "distributed.comm_count.tp_count_worker", "distributed.comm_count.count_step_communication",
    "distributed.comm_count.count_deepspeed_passes",
    "distributed.data_parallel.collectives_worker", "distributed.data_parallel.measure_collectives",
    "distributed.data_parallel.ddp_worker", "distributed.data_parallel.measure_ddp",
    "distributed.deepspeed_rank0.deepspeed_batch_sizes", "distributed.deepspeed_rank0.engine_step",
    "distributed.deepspeed_rank0.run_deepspeed", "distributed.fsdp.fsdp_worker",
    "distributed.offload.measure_offload", "distributed.pipeline_parallel.pp_worker",
    "distributed.pipeline_parallel.pipeline_run", "distributed.ranks.allreduce_worker",
    "distributed.tensor_parallel.tp_tracked_step", "distributed.tensor_parallel.tp_worker",
}
MAX_LINES = 80
REASON = f"Over {MAX_LINES} lines because"


def bare_dict(annotation: ast.expr | None) -> bool:
    """Whether a return annotation names ``dict`` without its key and value types, or with
    ``Any`` for them (``dict``, ``dict[str, Any]``, ``list[dict]``, ``tuple[X, dict]``)."""
    if annotation is None:
        return False
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body  # a string annotation
    typed = set()
    for node in ast.walk(annotation):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "dict":
            typed.add(id(node.value))
            if any(isinstance(n, ast.Name) and n.id == "Any" for n in ast.walk(node.slice)):
                return True
    return any(isinstance(n, ast.Name) and n.id == "dict" and id(n) not in typed for n in ast.walk(annotation))


def functions(root: pathlib.Path = ROOT):
    """``(qualified name, node)`` of every function in ``root``'s modules (``module.Class.name``,
    the module relative to ``root``), nested ones included; public: no part starts with ``_``."""
    for path in sorted(root.rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        stack = [(module, n) for n in ast.parse(path.read_text()).body]
        while stack:
            prefix, node = stack.pop()
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}.{node.name}"
                if not isinstance(node, ast.ClassDef):
                    yield name, node
                stack.extend((name, n) for n in node.body)


def public(name: str) -> bool:
    return not any(part.startswith("_") and part != "__main__" for part in name.split("."))


def bare_dict_functions(root: pathlib.Path = ROOT) -> dict[str, ast.FunctionDef]:
    return {name: node for name, node in functions(root)
            if public(name) and bare_dict(node.returns) and node.name not in CONVERTERS}


def test_no_public_function_returns_a_bare_dict():
    found = set(bare_dict_functions()) - EXTERNAL - RANK_PAYLOADS
    assert not found, (f"public functions annotated to return a bare dict: {sorted(found)}; return a frozen "
                       f"dataclass (a docstring per field), or say in the docstring 'A dict because' "
                       f"it is an outside format and add it to EXTERNAL")


def test_each_exemption_says_why_and_still_returns_a_dict():
    found = bare_dict_functions()
    stale = (EXTERNAL | RANK_PAYLOADS) - set(found)
    assert not stale, f"exempt but no longer returning a bare dict (or gone): drop them from the lists: {stale}"
    silent = [n for n in EXTERNAL if "A dict because" not in (ast.get_docstring(found[n]) or "")]
    assert not silent, f"exempt without a docstring line 'A dict because ...': {silent}"


def test_the_walk_finds_a_planted_dict(tmp_path):
    """The check itself: a planted module with each spelling of a bare dict, beside typed ones."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "from typing import Any\n"
        "def plain() -> dict: ...\n"
        "def anyvalue() -> dict[str, Any]: ...\n"
        "def listed() -> list[dict]: ...\n"
        "def quoted() -> 'tuple[int, dict]': ...\n"
        "def typed() -> dict[str, int]: ...\n"
        "def _private() -> dict: ...\n"
        "class C:\n"
        "    def method(self) -> dict | None: ...\n"
        "    def to_dict(self) -> dict: ...\n")
    assert set(bare_dict_functions(tmp_path)) == {"pkg.m.plain", "pkg.m.anyvalue", "pkg.m.listed",
                                                  "pkg.m.quoted", "pkg.m.C.method"}


def long_functions(root: pathlib.Path = ROOT) -> dict[str, int]:
    """Every function over :data:`MAX_LINES` lines (its ``def`` to its last line) without
    :data:`REASON` in its docstring, with its length."""
    return {name: node.end_lineno - node.lineno + 1 for name, node in functions(root)
            if node.end_lineno - node.lineno + 1 > MAX_LINES and REASON not in (ast.get_docstring(node) or "")}


def test_no_function_over_80_lines_without_a_reason():
    long = long_functions()
    assert not long, f"functions over {MAX_LINES} lines without '{REASON} ...' in the docstring: {long}"


@pytest.mark.parametrize("lines, reason, flagged", [(MAX_LINES - 1, False, False), (MAX_LINES + 1, False, True),
                                                    (MAX_LINES + 1, True, False)])
def test_the_length_count_is_the_def_to_the_last_line(tmp_path, lines, reason, flagged):
    """A planted function of ``lines`` lines in all (the def, the docstring, the body)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    doc = f'    """{REASON} it is planted."""\n' if reason else '    """Planted."""\n'
    (pkg / "m.py").write_text("def f():\n" + doc + "    x = 0\n" * (lines - 2))
    assert ("pkg.m.f" in long_functions(tmp_path)) is flagged
