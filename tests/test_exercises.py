"""The learners' exercises: the student edition, and every checker against a right and a
wrong solution (each wrong one the mistake the checker's message names)."""
import json
import pathlib
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import memlab as ml
from memlab.classroom import exercises as ex
from memlab.distributed import deepspeed_rank0
from memlab.models.gpt_unet import Block

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# The lessons with a checked "Your turn" exercise (lesson numbers; the arc adds more).
EXERCISED = {"00", "01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11", "12", "13", "14", "15", "16", "17",
             "18"}
LESSONS = [p for p in NOTEBOOKS if p.name[:2] in EXERCISED]


def _cells(path):
    return json.loads(path.read_text())["cells"]


def _is_solution(cell):
    return cell["cell_type"] == "code" and "solution" in cell["metadata"].get("tags", [])


def _src(cell):
    return "".join(cell["source"])


# --------------------------------------------------------------------------------------
# The notebooks and the student edition
# --------------------------------------------------------------------------------------
def test_every_technique_lesson_has_a_checked_exercise():
    assert sorted(p.name[:2] for p in LESSONS) == sorted(EXERCISED)
    for path in LESSONS:
        cells = _cells(path)
        sols = [i for i, c in enumerate(cells) if _is_solution(c)]
        assert sols, f"{path.name} has no solution cell"
        for i in sols:  # markdown exercise, solution, check cell: the same shape everywhere
            assert cells[i - 1]["cell_type"] == "markdown" and "Your turn" in _src(cells[i - 1]), path.name
            check = cells[i + 1]
            assert check["cell_type"] == "code" and "exercises.check_" in _src(check), path.name
            assert not _is_solution(check)


@pytest.mark.parametrize("arg", ["--bogus", "missing.ipynb", "README.md"])
def test_make_student_names_what_is_not_a_notebook(tmp_path, arg):
    done = subprocess.run([sys.executable, "tools/make_student.py", "--out", str(tmp_path), arg],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and repr(arg) in done.stderr and "allowed:" in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []   # nothing written


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_checker_has_a_solution_cell_to_empty(path):
    """Each ``exercises.check_...`` cell checks one exercise whose code cell is tagged ``solution``:
    an untagged one stays written in the student edition and its checker passes an empty
    workbook (lesson 16's expert-parallelism exercise did, seen in ``class collect``)."""
    cells = _cells(path)
    checkers = [i for i, c in enumerate(cells) if c["cell_type"] == "code"
                and re.search(r"\bexercises\.check_\w+\(", _src(c))]
    solutions = [i for i, c in enumerate(cells) if _is_solution(c)]
    assert len(checkers) == len(solutions), (checkers, solutions)
    assert all(s < c for s, c in zip(solutions, checkers, strict=True))   # each solution before its checker


def test_make_student_empties_every_solution(tmp_path):
    done = subprocess.run([sys.executable, "tools/make_student.py", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for path in NOTEBOOKS:
        original = _cells(path)
        student = _cells(tmp_path / path.name)
        assert len(student) == len(original)
        assert not any(_is_solution(c) for c in student)
        placeholders = [c for c in student if c["cell_type"] == "code"
                        and _src(c).startswith("# your code here")]  # and its stubs (student_stub)
        assert len(placeholders) == sum(map(_is_solution, original)), path.name
        for o, s in zip(original, student, strict=True):  # everything else as it was
            if not _is_solution(o):
                assert _src(o) == _src(s) and o["cell_type"] == s["cell_type"]


def test_predict_answers_are_collapsed_below_their_question():
    for path in NOTEBOOKS:
        for cell in _cells(path):
            text = _src(cell)
            if cell["cell_type"] == "markdown" and "<details>" in text:
                before = text[:text.index("<details>")]
                assert "?" in before, f"{path.name}: an answer before its question"
                assert text.count("<details>") == text.count("</details>")


# --------------------------------------------------------------------------------------
# Reference solutions (what the notebooks' solution cells write) and wrong ones
# --------------------------------------------------------------------------------------
def solution(notebook: str, name: str):
    """``name`` as the notebook's solution cells define it (what a learner who solved it wrote)."""
    (path,) = (ROOT / "notebooks").glob(f"{notebook}_*.ipynb")
    ns = {"torch": torch, "nn": nn, "F": F, "checkpoint": checkpoint}
    for cell in _cells(path):
        if _is_solution(cell):
            exec(_src(cell), ns)
    return ns[name]


amp_step = solution("04", "amp_step")


def _scaled_backward(model, optimizer, scaler, batch, dtype=torch.float16):
    """What the wrong answers below get right: the forward under autocast, the scaled backward."""
    optimizer.zero_grad(set_to_none=True)
    with torch.amp.autocast(batch[0].device.type, dtype=dtype):
        loss = model(*batch)
    scaler.scale(loss).backward()


def amp_step_without_scaler_step(model, optimizer, scaler, batch):
    _scaled_backward(model, optimizer, scaler, batch)
    optimizer.step()  # the gradients are still multiplied by the scale


def amp_step_manual_unscale(model, optimizer, scaler, batch):
    _scaled_backward(model, optimizer, scaler, batch)
    scaler.unscale_(optimizer)
    optimizer.step()  # also when the gradients hold inf
    scaler.update()


def amp_step_bf16(model, optimizer, scaler, batch):
    _scaled_backward(model, optimizer, scaler, batch, dtype=torch.bfloat16)
    scaler.step(optimizer)
    scaler.update()


def amp_step_seed(model, optimizer, scaler, batch):
    from torch.cuda.amp import autocast  # the curriculum's import
    optimizer.zero_grad(set_to_none=True)
    with autocast():
        loss = model(*batch)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def test_amp_checker_passes_the_reference():
    r = ex.check_amp_step(amp_step)
    assert r.measured["update_diff_1"] <= ex.AMP_TOLERANCE
    assert r.measured["scale_after_overflow"] == 2.0**39  # 2^40 halved (backoff 0.5)


@pytest.mark.parametrize("wrong, says", [
    (amp_step_without_scaler_step, "2^16 times too large"),
    (amp_step_manual_unscale, "skips such a step"),
    (amp_step_bf16, "bf16 has fp32's exponent range"),
    (amp_step_seed, "torch.cuda.amp is deprecated"),
])
def test_amp_checker_names_the_mistake(wrong, says):
    with pytest.raises(AssertionError, match=re.escape(says)):
        ex.check_amp_step(wrong)


class CheckpointedBlock(Block):
    def forward(self, x):
        def block(x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        return checkpoint(block, x, use_reentrant=False)


class SavesNothing(Block):
    def forward(self, x):  # checkpoints the first norm only
        x = x + self.attn(checkpoint(self.ln1, x, use_reentrant=False))
        return x + self.mlp(self.ln2(x))


class Reentrant(Block):
    def forward(self, x):
        return checkpoint(self._forward, x, use_reentrant=True)


class NoResidual(Block):
    def forward(self, x):
        return checkpoint(lambda x: self.mlp(self.ln2(x + self.attn(self.ln1(x)))), x,
                          use_reentrant=False)


def test_checkpoint_checker_passes_the_reference():
    r = ex.check_checkpointed_block(CheckpointedBlock)
    # saved = n_layer * (what a block saves - its input), Korthikanti-style count for our block
    cfg = ml.get_config("tiny", attention="naive")
    s, b, d, a, L = 64, 2, cfg.d_model, cfg.n_head, cfg.n_layer
    t = s * b
    layer = 4 * (2 * t * d + 2 * (t * d + 2 * t) + 4 * t * d + 2 * t * cfg.hidden) + 4 * a * s * s * b + s * s
    assert r.measured["expected_saved_bytes"] == L * (layer - 4 * t * d)
    assert abs(r.measured["saved_bytes"] / (L * (layer - 4 * t * d)) - 1) < 0.02  # measured = formula
    assert r.measured["max_grad_diff"] <= ex.CKPT_TOLERANCE


@pytest.mark.parametrize("wrong, says", [
    (SavesNothing, "wrap the whole block forward"),
    (Reentrant, "use_reentrant=False"),
    (NoResidual, "gradients differ"),
])
def test_checkpoint_checker_names_the_mistake(wrong, says):
    with pytest.raises(AssertionError, match=re.escape(says)):
        ex.check_checkpointed_block(wrong)


def accumulate(model, optimizer, batch, k):
    for idx, tgt in zip(batch[0].chunk(k), batch[1].chunk(k), strict=True):
        (model(idx, tgt) / k).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def accumulate_no_division(model, optimizer, batch, k):
    for idx, tgt in zip(batch[0].chunk(k), batch[1].chunk(k), strict=True):
        model(idx, tgt).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def accumulate_one_graph(model, optimizer, batch, k):
    losses = [model(idx, tgt) / k for idx, tgt in zip(batch[0].chunk(k), batch[1].chunk(k), strict=True)]
    sum(losses).backward()  # all k graphs alive at once
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def accumulate_step_each(model, optimizer, batch, k):
    for idx, tgt in zip(batch[0].chunk(k), batch[1].chunk(k), strict=True):
        (model(idx, tgt) / k).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def accumulate_never_zeroed(model, optimizer, batch, k):
    for idx, tgt in zip(batch[0].chunk(k), batch[1].chunk(k), strict=True):
        (model(idx, tgt) / k).backward()
    optimizer.step()


def test_accumulation_checker_passes_the_reference():
    r = ex.check_accumulation(accumulate, k=4)
    assert r.measured["max_grad_diff"] <= ex.ACC_TOLERANCE
    assert r.measured["activation_bytes"] < 0.3 * r.measured["big_batch_activation_bytes"]


@pytest.mark.parametrize("wrong, says", [
    (accumulate_no_division, "did you divide the loss by k?"),
    (accumulate_one_graph, "before the next forward"),
    (accumulate_step_each, "step once"),
    (accumulate_never_zeroed, "previous step's gradients were still there"),
])
def test_accumulation_checker_names_the_mistake(wrong, says):
    with pytest.raises(AssertionError, match=re.escape(says)):
        ex.check_accumulation(wrong, k=4)


def test_oom_fix_checker():
    step = ml.StepConfig(model="tiny", seq=256, batch=8)
    r = ex.check_oom_fix(replace(step, checkpointing="full"), step, "120MiB")
    assert r.measured["peak_bytes"] <= ml.resolve_budget("120MiB")
    with pytest.raises(AssertionError, match="still out of memory"):
        ex.check_oom_fix(replace(step, micro_batches=2), step, "120MiB")
    with pytest.raises(AssertionError, match="keep the model and the sequence"):
        ex.check_oom_fix(replace(step, seq=64), step, "120MiB")


# --------------------------------------------------------------------------------------
# DeepSpeed
# --------------------------------------------------------------------------------------
ZERO2 = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
         "zero_optimization": {"stage": 2, "reduce_bucket_size": 2**20, "allgather_bucket_size": 2**20}}
OFFLOAD = {**ZERO2, "zero_optimization": {**ZERO2["zero_optimization"], "offload_optimizer": {"device": "cpu"}}}


@pytest.fixture
def ds():
    return pytest.importorskip("deepspeed")


def initialize(config):
    import deepspeed

    def make_engine(model):
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
    return make_engine


def test_fake_ranks_leave_nothing_behind(ds):
    import os

    import torch.distributed as dist
    before = os.environ.get("WORLD_SIZE")
    with deepspeed_rank0.fake_ranks(4):
        assert dist.get_world_size() == 4 and ds.comm.get_world_size() == 4
    assert not dist.is_initialized() and os.environ.get("WORLD_SIZE") == before


def test_deepspeed_batch_sizes_are_deepspeeds_own(ds):
    seed = {"train_batch_size": 8, "gradient_accumulation_steps": 4}   # the curriculum's config
    # micro-batch = 8 / (4 x ranks)
    assert deepspeed_rank0.deepspeed_batch_sizes(seed, 1)["train_micro_batch_size_per_gpu"] == 2
    assert deepspeed_rank0.deepspeed_batch_sizes(seed, 2)["train_micro_batch_size_per_gpu"] == 1
    assert "greater than 0" in deepspeed_rank0.deepspeed_batch_sizes(seed, 4)["error"]


def test_zero_checker_passes_the_reference(ds):
    r = ex.check_zero_config(ZERO2, initialize(ZERO2), stage=2, ranks=2, micro_batch=4, accumulation=2)
    n = ml.get_config("tiny").num_params()
    assert abs(r.measured["optimizer_state"] - 8 * n / 2) < 0.01 * 8 * n / 2   # Adam's moments / N
    assert abs(r.measured["gradients"] - 4 * n / 2) < 0.01 * 4 * n / 2         # stage 2: grads / N
    assert r.measured["train_batch_size"] == 4 * 2 * 2


@pytest.mark.parametrize("change, says", [
    ({"train_batch_size": 8}, "4 x accumulation 2 x ranks 2 = 16"),
    ({"zero_optimization": {"stage": 1, "reduce_bucket_size": 2**20, "allgather_bucket_size": 2**20}},
     "asks for stage 2"),
    ({"zero_optimization": {"stage": 2}}, "set it to about 2**20"),
    ({"zero_optimization": {**ZERO2["zero_optimization"], "overlap_com": True}}, "DeepSpeed rejected the config"),
])
def test_zero_checker_names_the_mistake(ds, change, says):
    config = {**ZERO2, **change}
    with pytest.raises(AssertionError, match=re.escape(says)):
        ex.check_zero_config(config, initialize(config))


def test_offload_checker(ds):
    r = ex.check_offload_config(OFFLOAD, initialize(OFFLOAD))
    n = ml.get_config("tiny").num_params()
    assert abs(r.measured["host_gradients"] - 4 * n / 2) < 0.01 * 4 * n / 2   # fp32 grads on the host
    with pytest.raises(AssertionError, match="offload the optimizer"):
        ex.check_offload_config(ZERO2, initialize(ZERO2))


# --------------------------------------------------------------------------------------
# 08 and 09
# --------------------------------------------------------------------------------------
def make_shards(fc, out, t, *, clone=True, bias_everywhere=False):
    h = fc.out_features // t
    shards = []
    for r in range(t):
        cols = slice(r * h, (r + 1) * h)
        col = nn.Linear(fc.in_features, h)
        col.weight, col.bias = (nn.Parameter(w.clone() if clone else w) for w in (fc.weight[cols], fc.bias[cols]))
        row = nn.Linear(h, out.out_features, bias=r == 0 or bias_everywhere)
        row.weight = nn.Parameter(out.weight[:, cols].clone() if clone else out.weight[:, cols])
        if row.bias is not None:
            row.bias = nn.Parameter(out.bias.clone())
        shards.append((col, row))
    return shards


def tp_forward(shards, x):
    return sum(row(F.gelu(col(x), approximate="tanh")) for col, row in shards)


def test_tensor_parallel_checker_passes_the_reference():
    r = ex.check_tensor_parallel(make_shards, tp_forward, t=2)
    cfg = ml.get_config("tiny")
    assert r.measured["rank_weight_bytes"] == 2 * cfg.d_model * cfg.hidden * 4 / 2  # 1/t of fc + out
    assert r.measured["max_diff"] <= ex.TP_TOLERANCE


@pytest.mark.parametrize("shards, forward, says", [
    (make_shards, lambda s, x: s[0][1](F.gelu(s[0][0](x), approximate="tanh")), "rank 0's partial sum"),
    (make_shards, lambda s, x: torch.cat([r(F.gelu(c(x), approximate="tanh")) for c, r in s], -1),
     "not pieces to concatenate"),
    (lambda fc, out, t: make_shards(fc, out, t, clone=False), tp_forward, "is a view"),
    (lambda fc, out, t: make_shards(fc, out, t, bias_everywhere=True), tp_forward, "added 2 times"),
])
def test_tensor_parallel_checker_names_the_mistake(shards, forward, says):
    with pytest.raises(AssertionError, match=re.escape(says)):
        ex.check_tensor_parallel(shards, forward, t=2)


def make_hooks(model):
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() in params or not t.is_floating_point():
            return t
        return t.to(torch.bfloat16), t.dtype

    def unpack(packed):
        return packed if isinstance(packed, torch.Tensor) else packed[0].to(packed[1])
    return pack, unpack


def test_pack_hooks_checker_passes_the_reference():
    r = ex.check_pack_hooks(make_hooks)
    block = r.measured["block_activation_bytes"]
    assert 0.4 * block <= r.measured["saved_bytes"] <= 0.5 * block
    assert 0 < r.measured["grad_error"] <= ex.PACK_TOLERANCE


@pytest.mark.parametrize("hooks, says", [
    (lambda m: (lambda t: t.to(torch.bfloat16), lambda t: t), "cast back with .to(dtype)"),
    (lambda m: (lambda t: (t.to(torch.bfloat16), t.dtype) if t.is_floating_point() else t,
                lambda p: p[0].to(p[1]) if isinstance(p, tuple) else p), "return parameters unchanged"),
    (lambda m: (lambda t: t, lambda t: t), "should save at least"),
])
def test_pack_hooks_checker_names_the_mistake(hooks, says):
    with pytest.raises(AssertionError, match=re.escape(says)):
        ex.check_pack_hooks(hooks)
