"""The instant lens stays instant: what `memlab estimate --hf-config` and `memlab --help` import
(not timed: benchmarks/cli_startup.py times them), the lazy front door, and the recorded
transformers answers that let a shipped config be read without importing transformers."""
import dataclasses
import json
import pathlib
import subprocess
import sys

import pytest

import memlab as ml
from memlab.hf import (
    config as hf,
)
from memlab.hf import (
    config_check as hf_config_check,
)
from memlab.hf import (
    read_run_configs as run_config,
)
from memlab.hf import (
    shape as hf_shape,
)
from memlab.hf.estimate import estimate_hf

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEAVY = ("transformers", "deepspeed", "peft", "bitsandbytes", "torchao", "matplotlib")
#: memlab's own modules a closed-form estimate of an HF config never needs: the guard (and its
#: psutil: only a real measurement asks for host memory), the other lenses, the time lens (FLOPs
#: and seconds: memlab's GPT and --card), the techniques (memlab's GPT), DeepSpeed's ranks
NOT_FOR_AN_ESTIMATE = ("psutil", "memlab.lenses.guard", "memlab.lenses.estimate", "memlab.lenses.simulate",
                       "memlab.lenses.measure", "memlab.time.step_time", "memlab.time.flops",
                       "memlab.techniques.finetune", "memlab.hf.simulate", "memlab.hf.measure",
                       "memlab.distributed.deepspeed_zero")


def _imported(runs: list[list[str]], watch: tuple[str, ...]) -> list[str]:
    """The modules of ``watch`` in sys.modules after ``memlab <argv>`` of each of ``runs`` ran,
    one after another, in one fresh Python (each must exit 0)."""
    code = ("import sys, contextlib, io\nfrom memlab.app.cli import main\ncodes = []\n"
            f"for argv in {runs!r}:\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        try:\n            codes.append(main(argv))\n"
            "        except SystemExit as e:\n            codes.append(e.code)\n"
            f"print(codes, [m for m in {watch!r} if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    codes, mods = eval(done.stdout.strip().splitlines()[-1].replace("] [", "], ["))  # noqa: S307
    assert codes == [0] * len(runs), done.stdout + done.stderr[-3000:]
    return mods


def test_estimate_of_a_shipped_config_imports_no_hf_library(tmp_path):
    """estimate --hf-config, alone, with --training-args (YAML), with LoRA on a 4-bit base, and
    of a config whose check needs its class's defaults (Mixtral), and with a --deepspeed JSON
    (the benchmark's and the curriculum's, read from the JSON by DeepSpeed's rules:
    read_run_configs.plain_reading), never imports transformers, DeepSpeed, peft or bitsandbytes
    (seconds each), nor memlab's modules of the other lenses (:data:`NOT_FOR_AN_ESTIMATE`)."""
    ta = tmp_path / "args.yaml"
    ta.write_text("per_device_train_batch_size: 2\ngradient_accumulation_steps: 4\nbf16: true\n")
    ds = tmp_path / "ds_config.json"
    ds.write_text('{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, '
                  '"bf16": {"enabled": true}, "zero_optimization": {"stage": 2}}')
    curriculum = str(ROOT / "memlab" / "data" / "deepspeed" / "curriculum.json")
    base = ["estimate", "--hf-config", "mistral-7b"]
    runs = [base, [*base, "--training-args", str(ta)], [*base, "--lora-rank", "16", "--load-in-4bit"],
            ["estimate", "--hf-config", "mixtral-8x7b"], [*base, "--deepspeed", str(ds), "--world-size", "2"],
            [*base, "--deepspeed", curriculum, "--world-size", "2"]]
    assert _imported(runs, HEAVY + NOT_FOR_AN_ESTIMATE) == []


def test_help_imports_no_lens_beyond_the_parser():
    """--help builds the parser only: no DeepSpeed launcher, no advisor, no run readers. (The HF
    estimate may load with the simulation bound the parser reads: its inputs are loaded already,
    it adds one module and ~10 ms, ``python -X importtime``.)"""
    watch = (*HEAVY, *NOT_FOR_AN_ESTIMATE, "memlab.planning.advisor", "memlab.hf.read_run_configs",
             "memlab.classroom.technique_table", "memlab.app.doctor")
    assert _imported([["--help"]], watch) == []


def test_import_memlab_loads_no_lens():
    """The front door is lazy: `import memlab` loads no lens (nor torch); a name loads its module."""
    code = ("import sys, memlab\nprint(sorted(m for m in sys.modules if m.startswith('memlab.')), "
            "'torch' in sys.modules)\nmemlab.estimate_step\nprint('memlab.lenses.estimate' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          check=True, timeout=300)
    first, second = done.stdout.strip().splitlines()
    assert first == "['memlab.core', 'memlab.core.quiet'] False"
    assert second == "True"


def test_every_front_door_name_is_its_home_modules_object():
    """Each name memlab exported when it imported everything eagerly is the same object as in
    its module (the notebooks' `ml.estimate_step(...)`), and dir() lists them."""
    import importlib
    homes = ml._homes()
    assert set(homes) == set(ml.__all__)
    for name, module in homes.items():
        assert getattr(ml, name) is getattr(importlib.import_module(module), name), name
    assert set(ml.__all__) <= set(dir(ml))
    assert ml.hf.config is hf  # a submodule by attribute, as the eager imports left it
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        ml.not_a_name  # noqa: B018


def _live_answers() -> dict:
    """The answers transformers gives today, recorded afresh (tools/record_hf.py's calls)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("record_hf", ROOT / "tools" / "record_hf.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return hf_config_check.record(tool.shipped_answers)


def test_recorded_answers_are_what_transformers_says_now():
    """memlab/data/hf_resolved.json equals a fresh recording under the installed transformers
    (stale after an upgrade: run tools/record_hf.py), and the record is used: a recorded
    answer, changed, changes what the lens reads."""
    path = ROOT / "memlab" / pathlib.Path(*hf_config_check.RECORDED)
    shipped = json.loads(path.read_text())
    live = _live_answers()
    assert shipped["transformers"] == live["transformers"]
    assert shipped["answers"] == live["answers"]
    # the shipped configs' shape questions are among them, so the estimate reads the record
    assert sum(k.startswith("shape:") for k in shipped["answers"]) == sum(
        hf.shipped_config(n)["model_type"] in hf_shape.FAMILIES for n in hf.SHIPPED)


@pytest.mark.parametrize("name", sorted(hf.SHIPPED))
def test_a_shipped_config_reads_the_same_recorded_or_live(name):
    """The checked config, the decoder shape and the whole estimate of each shipped config are
    the same from the record as from transformers itself."""
    raw = hf.load_config(name, checked=False)
    recorded = hf_config_check.check_config(raw)
    with hf_config_check.live_transformers():
        live = hf_config_check.check_config(raw)
    assert dataclasses.asdict(recorded) == json.loads(json.dumps(dataclasses.asdict(live)))
    if raw["model_type"] not in hf_shape.FAMILIES:
        return
    shape = hf_shape.decoder_shape(name)
    report = estimate_hf(name, seq=128, batch=1, precision="bf16")
    with hf_config_check.live_transformers():
        assert hf_shape.decoder_shape(name) == shape
        live_report = estimate_hf(name, seq=128, batch=1, precision="bf16")
    assert report.peak_bytes == live_report.peak_bytes
    assert report.by_category == live_report.by_category


def test_training_args_defaults_are_recorded_as_transformers_writes_them():
    """TrainingArguments' defaults, recorded, are the class's (enums as their values)."""
    with hf_config_check.live_transformers():
        live = run_config._class_defaults()
    assert run_config._defaults() == live
    # TrainingArguments' documented defaults (transformers 5: fused AdamW where torch has it)
    assert live["optim"] == "adamw_torch_fused" and live["per_device_train_batch_size"] == 8
