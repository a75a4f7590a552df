"""The claims register (course/claims.md): every row names a cell or a test that exists (or
says why nothing here measures it), every paper a notebook cites has a row for that lesson,
and the numbers the answer keys and notes state are what memlab's code computes now."""
import ast
import importlib.util
import json
import pathlib
import re

import pytest

import memlab as ml
from memlab import GiB
from memlab.planning.advisor import advise

ROOT = pathlib.Path(__file__).resolve().parents[1]
REGISTER = ROOT / "course" / "claims.md"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# Author et al. Year, or Author & Author Year / Author and Author Year
CITATION = re.compile(r"([A-Z][a-zA-Z]+) et al\.?,? (\d{4})|([A-Z][a-zA-Z]+) (?:and|&) [A-Z][a-zA-Z]+,? (\d{4})")


#: what a row was checked against: the source's own text, only a secondary one, no outside
#: source, or nothing (course/claims.md, the "read" column)
READ = re.compile(r"(own text|secondary|derived|not read)\b")


def rows() -> list[dict[str, str]]:
    """The register's table rows as dicts of its columns."""
    lines = [line for line in REGISTER.read_text().splitlines() if line.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    out = []
    for line in lines[2:]:  # after the header and its --- row
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == len(head), f"a row with {len(cells)} columns, not {len(head)}: {line[:80]}"
        out.append(dict(zip(head, cells, strict=True)))
    return out


def cell_ids(path: pathlib.Path) -> set[str]:
    return {c.get("id") for c in json.loads(path.read_text())["cells"]}


def test_the_register_parses_and_ids_are_unique():
    r = rows()
    ids = [row["id"] for row in r]
    assert len(ids) == len(set(ids)), [i for i in ids if ids.count(i) > 1]
    assert all(re.match(r"(checked|corrected|unread|open)\b", row["status"]) for row in r), \
        [row["id"] for row in r if not re.match(r"(checked|corrected|unread|open)\b", row["status"])]
    # every row says what it was checked against (the register's "read" column)
    assert list(r[0])[-1] == "read"
    unsaid = [row["id"] for row in r if not READ.match(row["read"])]
    assert unsaid == [], f"rows whose 'read' is not one of {READ.pattern}: {unsaid}"
    # the closing note's count is the table's
    note = REGISTER.read_text().split("## Closing note", 1)[1]
    assert f"holds {len(r)} rows" in note, len(r)
    corrected = sum(row["status"].startswith("corrected") for row in r)
    assert f"{corrected} were corrected" in note, corrected


@pytest.mark.parametrize("row", rows(), ids=lambda row: row["id"])
def test_every_row_names_a_cell_or_test_that_exists(row):
    where = row["measured by"]
    if where.startswith("not measurable here:"):
        assert len(where.split()) > 4, f"{row['id']}: say why it is not measurable"
        return
    nb = re.match(r"(notebooks/[\w]+\.ipynb)#([\w-]+)", where)
    if nb:
        path = ROOT / nb.group(1)
        assert path.exists(), where
        assert nb.group(2) in cell_ids(path), f"{row['id']}: no cell {nb.group(2)} in {nb.group(1)}"
        return
    test = re.match(r"(tests/[\w]+\.py)(?:::(\w+))?", where)
    assert test, f"{row['id']}: 'measured by' is neither a cell, a test nor 'not measurable here': {where}"
    path = ROOT / test.group(1)
    assert path.exists(), where
    if test.group(2):
        assert re.search(rf"^def {test.group(2)}\(", path.read_text(), re.M), f"{row['id']}: no {where}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_citation_of_a_notebook_is_in_the_register(path):
    lesson = path.stem[:2]
    text = " ".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"])
    cited = {(m.group(1) or m.group(3), m.group(2) or m.group(4)) for m in CITATION.finditer(text)}
    mine = " ".join(row["source"] + " " + row["claim"] for row in rows() if row["id"].startswith(lesson + "-"))
    missing = [f"{a} {y}" for a, y in sorted(cited) if not re.search(rf"{a}\b[^|]*?{y}", mine)]
    assert missing == [], f"{path.stem} cites {missing} with no row {lesson}-n giving the source"


def test_the_citation_check_can_fail():
    text = "as Nobody et al. 2031 showed, and Smith & Jones 1999"
    assert {(m.group(1) or m.group(3)) for m in CITATION.finditer(text)} == {"Nobody", "Smith"}


def test_cited_package_paths_exist():
    """Every memlab/....py a lesson, an answer or a course page names is a file."""
    texts = [p.read_text() for p in (ROOT / "course").rglob("*.md") if p != REGISTER]
    texts += [p.read_text() for p in NOTEBOOKS]
    named = {m for t in texts for m in re.findall(r"memlab/[\w/]+\.py", t)}
    assert named and [n for n in sorted(named) if not (ROOT / n).exists()] == []


# --------------------------------------------------------------------------------------
# Numbers the answer keys and the notes state, recomputed from memlab and its sources
# --------------------------------------------------------------------------------------
def _text(rel: str) -> str:
    return " ".join((ROOT / rel).read_text().split())  # line breaks as spaces


def test_llama3_8b_model_states():
    psi = ml.get_config("llama-3-8b").num_params()
    lesson = _text("notebooks/01_where_memory_goes.ipynb")
    assert f"{psi / 1e9:.2f} B parameters x 16 = {16 * psi / GiB:.1f} GiB" in lesson


def test_logits_of_llama3_8b():
    vocab, tokens = ml.get_config("llama-3-8b").vocab_size, 8192
    notes, lesson = _text("course/instructor-notes.md"), _text("notebooks/07_logits_spike.ipynb")
    assert f"the bf16 logits are {2 * tokens * vocab / 1e9:.1f} GB" in notes
    assert f"fp32 log-softmax {4 * tokens * vocab / 1e9:.1f} GB" in notes
    assert f"{4 * tokens * vocab / 1e9:.1f} GB ({4 * tokens * vocab / GiB:.1f} GiB) per fp32" in lesson
    assert 3 * 4 * tokens * vocab / 1e9 > 10 > (2 + 4) * tokens * vocab / 1e9   # "over 10 GB" needs the backward's


def test_offload_traffic_answer():
    """answers/11 and /15, exercise 3: DeepSpeed's 4 + 2 bytes per parameter over PCIe, on the
    H200 reference's ZeRO-2 rows."""
    ref = json.loads((ROOT / "memlab/data/reference/NVIDIA-H200/zero_offload_one_gpu.json").read_text())
    z2 = next(r for r in ref if (r["zero"], r["offload"]) == (2, "none"))
    off = next(r for r in ref if (r["zero"], r["offload"]) == (2, "optimizer"))
    psi, secs = off["num_params"], off["step_seconds"]
    a11, a15 = _text("course/answers/11_offload.md"), _text("course/answers/15_the_table.md")
    assert f"**{secs:.3f} s**" in a11 and f"{z2['step_seconds']:.3f} s" in a11
    assert f"6 x {psi / 1e6:.0f}M = **{6 * psi / 1e9:.1f} GB per step**" in a11
    assert f"**{6 * psi / 1e9 / secs:.1f} GB/s**" in a11
    assert f"about {6 * psi / 1e9 / secs / 64:.0%} of a PCIe" in a11
    assert f"**{secs / z2['step_seconds']:.1f}x**, for {6 * psi / 1e9:.1f} GB" in a15


def _offload_default(cls_name: str) -> bool:
    """``pin_memory``'s default in DeepSpeed's offload config class, read from its source
    (no import of deepspeed: seconds)."""
    spec = importlib.util.find_spec("deepspeed")
    src = pathlib.Path(spec.submodule_search_locations[0]) / "runtime" / "zero" / "offload_config.py"
    tree = ast.parse(src.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    field = next(n for n in cls.body if isinstance(n, ast.AnnAssign) and n.target.id == "pin_memory")
    return ast.literal_eval(field.value)


def test_deepspeed_pins_by_default():
    """states.py counts DeepSpeed's host buffers as pinned: the installed DeepSpeed's default,
    which memlab's config leaves in force."""
    pytest.importorskip("deepspeed")
    from memlab.step.write_deepspeed_config import deepspeed_config
    assert _offload_default("DeepSpeedZeroOffloadOptimizerConfig") is True
    assert _offload_default("DeepSpeedZeroOffloadParamConfig") is True
    zo = deepspeed_config(ml.StepConfig(zero=3, offload="all"))["zero_optimization"]
    assert "pin_memory" not in zo["offload_optimizer"] and "pin_memory" not in zo["offload_param"]


#: GPT-2 medium (Radford et al. 2019: 24 layers, d 1024, 1024 positions, 50257 tokens) counted
#: from its architecture, the embedding tied to the head
_D, _L = 1024, 24
GPT2_MEDIUM = 50257 * _D + 1024 * _D + _L * (4 * _D + 3 * _D * _D + 3 * _D + _D * _D + _D
                                            + 4 * _D * _D + 4 * _D + 4 * _D * _D + _D) + 2 * _D


def test_answer_14_t4_plan():
    """answers/14, exercise 3: GPT-2 medium on a T4 at seq 1024, batch 24. Its numbers from
    outside the estimate: the 16 bytes a parameter and the fp32 logits the key states, the
    parts of the peak they are, and the simulation (the real module on fake tensors) for the
    plan's peak and for the step without offload being over the card."""
    from dataclasses import replace

    from memlab.lenses.simulate import simulate_step
    text = _text("course/answers/14_plan_your_run.md").split("## Exercise 3", 1)[1].split("## Exercise 4")[0]
    n, logits = GPT2_MEDIUM, 24 * 1024 * 50257 * 4
    assert n == 354_823_168 and "355M" in text
    assert f"{16 * n / GiB:.1f} GiB" in text and f"{logits / GiB:.1f} GiB per fp32 copy" in text
    one = advise("gpt2-medium", "T4-16GB", seq=1024, batch=24, simulate=False)
    assert one.plan == ["fp16", "checkpointing", "offload-optimizer"], one.plan  # the T4 has no bf16
    bare = ml.estimate_step(replace(one.step, offload="none", zero=0), budget="T4-16GB")
    # without offload: fp32 weights and two moments held (gradients not yet, at the loss) and
    # one fp32 copy of the logits as the loss's temporary
    cats = bare.by_category
    assert (cats["parameters"], cats["optimizer"], cats["temporaries"]) == (4 * n, 8 * n, logits)
    t4 = 15360 * 2**20
    sim_bare = simulate_step(replace(one.step, offload="none", zero=0), budget="T4-16GB")
    assert not bare.fits and sim_bare.peak_bytes > t4 and sim_bare.peak_bytes < bare.peak_bytes
    assert f"**{bare.peak_bytes / GiB:.2f} GiB**" in text and f"({sim_bare.peak_bytes / GiB:.2f} GiB" in text
    # offloaded: the fp16 weights stay (2 bytes a parameter), master weights and moments move out
    planned = ml.estimate_step(one.step, budget="T4-16GB")
    assert planned.peak_bytes == one.peak_bytes
    assert (planned.by_category["parameters"], planned.by_category["optimizer"]) == (2 * n, 0)
    sim = simulate_step(one.step, budget="T4-16GB")
    assert one.peak_bytes == pytest.approx(sim.peak_bytes, rel=0.001) and sim.peak_bytes < 0.9 * t4
    assert f"{one.peak_bytes / GiB:.2f} GiB" in text


def test_answer_14_headroom():
    """answers/14, exercise 2: the five plans of lesson 14 at 10% and 30% headroom."""
    text = _text("course/answers/14_plan_your_run.md").split("## Exercise 2", 1)[1].split("## Exercise 3")[0]
    t4 = advise("gpt2-medium", "T4-16GB", seq=1024, batch=24, simulate=False, headroom=0.3)
    assert t4.fits and f"{t4.peak_bytes / GiB:.2f} of 10.5" in text
    big = advise("llama-7b", "A100-40GB", world_size=8, seq=4096, batch=1, simulate=False, headroom=0.3)
    assert big.fits and f"needs {big.peak_bytes / GiB:.2f} GiB" in text
    inf = advise("llama-13b", "T4-16GB", seq=4096, batch=1, simulate=False, headroom=0.3)
    assert inf.fits and f"{inf.peak_bytes / GiB:.2f} of 10.5" in text
    large = advise("gpt2-large", "RTX4090-24GB", seq=1024, batch=8, simulate=False, headroom=0.3)
    assert large.fits and f"{large.peak_bytes / GiB:.2f} of 16.8" in text
    for h in (0.1, 0.3):
        none = advise("llama-13b", "T4-16GB", seq=4096, batch=8, simulate=False, headroom=h)
        assert not none.fits and f"{none.short_bytes / GiB:.2f} GiB at {h:.0%}" in text


def test_answer_05_calculator():
    """answers/05, exercise 3: GPT-2 XL, fp32, batch 8 on an A100-40GB, each checkpointing mode,
    as the lesson's calculator (the estimate against the card) gives it."""
    text = _text("course/answers/05_checkpointing.md").split("## Exercise 3", 1)[1].split("## Exercise 4")[0]
    peaks = {}
    for mode in ("none", "selective", "full"):
        e = ml.estimate_step(ml.StepConfig(model="gpt2-xl", seq=1024, batch=8, precision="fp32",
                                           checkpointing=mode), budget="A100-40GB")
        peaks[mode] = e
    assert f"without checkpointing {peaks['none'].peak_bytes / GiB:.2f} GiB, does not fit" in text
    assert f"selective {peaks['selective'].peak_bytes / GiB:.2f} GiB" in text
    assert f"full {peaks['full'].peak_bytes / GiB:.2f} GiB, fits" in text
    assert not peaks["none"].fits and not peaks["selective"].fits and peaks["full"].fits


def _lesson(rel: str) -> str:
    """A notebook's cell sources as one text, line breaks as spaces."""
    cells = json.loads((ROOT / rel).read_text())["cells"]
    return " ".join(" ".join("".join(c["source"]) for c in cells).split())


def _installed(package: str, rel: str) -> pathlib.Path:
    """A file of an installed package, read as source (no import: seconds)."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        pytest.skip(f"{package} is not installed")
    return pathlib.Path(spec.submodule_search_locations[0]) / rel


def test_8bit_block_sizes_cited_for_what_each_says():
    """Lesson 03: the paper's blocks are 2048 (Dettmers et al. 2022, sec. 2.1), bitsandbytes'
    optimizer uses 256 at the line the lesson cites, and the 2.03 bytes are bitsandbytes' blocks
    (memlab's count of that layout against bitsandbytes' own state:
    tests/test_finetune.py::test_8bit_layout_equals_bitsandbytes)."""
    src = _installed("bitsandbytes", "optim/optimizer.py")
    cls = next(n for n in ast.parse(src.read_text()).body
               if isinstance(n, ast.ClassDef) and n.name == "Optimizer2State")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "init_state")
    block = next(n for n in ast.walk(init) if isinstance(n, ast.Assign)
                 and getattr(n.targets[0], "id", None) == "blocksize")
    size = ast.literal_eval(block.value)
    assert size == 256   # the lesson's block, read from the installed bitsandbytes
    lesson = _lesson("notebooks/03_your_oom.ipynb")
    assert "blocks of 2048 (Dettmers et al. 2022" in lesson          # the paper's
    assert f"uses blocks of {size} (`blocksize = {size}` in `Optimizer2State.init_state`, " \
           f"`bitsandbytes/optim/optimizer.py:{block.lineno}`)" in lesson
    assert f"2 x (1 + 4/{size}), about {2 * (1 + 4 / size):.2f} bytes" in lesson
    assert f"the paper's blocks would give {2 * (1 + 4 / 2048):.3f}" in lesson


def test_deepspeed_all_reduces_zero_1_2_gradients_at_the_cited_lines():
    """Lesson 09: DeepSpeed's ``use_multi_rank_bucket_allreduce`` defaults to true at the cited
    line of its config, and ``average_tensor`` picks the all-reduce bucket on it at the cited line."""
    lesson = _lesson("notebooks/09_data_parallel.ipynb")
    config = _installed("deepspeed", "runtime/zero/config.py").read_text().splitlines()
    stage = _installed("deepspeed", "runtime/zero/stage_1_and_2.py").read_text().splitlines()
    c = int(re.search(r"deepspeed/runtime/zero/config\.py:(\d+)", lesson).group(1))
    a = int(re.search(r"runtime/zero/stage_1_and_2\.py:(\d+)", lesson).group(1))
    assert config[c - 1].strip() == "use_multi_rank_bucket_allreduce: bool = True"
    assert "if self.use_multi_rank_bucket_allreduce" in stage[a - 1]
    assert stage[a].strip() == 'bucket_key = ("allreduce", process_group)'
    above = next(line for line in reversed(stage[:a]) if line.lstrip().startswith("def "))
    assert "def average_tensor(" in above


def test_launch_overhead_citation_says_its_benchmark_synchronises():
    """The 4-6 us of memlab.time.step_time.LAUNCH_SECONDS's source are a launch and a stream
    synchronisation (its loop calls cudaStreamSynchronize after each launch): the comment says so."""
    src = (ROOT / "memlab" / "time" / "step_time.py").read_text()
    comment = src.split("LAUNCH_SECONDS = ", 1)[0].rsplit("\n\n", 1)[1]
    assert "4-6 us" in comment and "pegainfer-3-cuda-graph" in comment
    assert "synchronises the stream after every launch" in " ".join(comment.replace("#:", " ").split())
