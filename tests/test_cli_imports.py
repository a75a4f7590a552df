"""What each CLI command imports (issue 37: an instant estimate): a command loads only what it
needs, so the closed-form estimate costs little more than ``import torch``.

One interpreter imports torch (every command needs it), then forks a child per command; each
child runs ``memlab.app.cli.main`` and reports its ``sys.modules``. The modules a command must
not load are the heavy ones it does not use: DeepSpeed and transformers (seconds each), psutil
and the guard (only a real measurement asks for host memory), the time lens (FLOPs, only
``--card`` estimates of memlab's GPT read it). ``benchmarks/cli_startup.py`` times the same
commands against bare torch.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

# the run configs the benchmark uses: a Trainer YAML and a plain ZeRO-2 JSON
TRAINING_ARGS = "per_device_train_batch_size: 2\ngradient_accumulation_steps: 4\nbf16: true\n" \
                "gradient_checkpointing: true\n"
DEEPSPEED = '{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, ' \
            '"bf16": {"enabled": true}, "zero_optimization": {"stage": 2}}\n'
# never needed by a closed-form estimate, nor by --help
HEAVY = ("deepspeed", "transformers", "psutil", "memlab.lenses.guard", "memlab.lenses.simulate",
         "memlab.lenses.measure", "memlab.time", "memlab.techniques", "memlab.distributed.deepspeed_zero",
         "memlab.hf.simulate", "memlab.hf.measure")

CHILD = textwrap.dedent("""
    import contextlib, json, os, sys
    import torch  # every command's floor, imported once before the forks
    argvs = json.loads(sys.argv[1])
    out = {}
    for argv in argvs:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            from memlab.app.cli import main
            with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
                try:
                    rc = main(argv)
                except SystemExit as e:  # --help
                    rc = e.code
            with os.fdopen(w, "w") as f:
                json.dump({"rc": rc, "modules": sorted(sys.modules)}, f)
            os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            out[" ".join(argv)] = json.load(f)
        os.waitpid(pid, 0)
    print(json.dumps(out))
""")


def loaded(argvs: list[list[str]]) -> dict[str, dict]:
    """Each command's exit status and the modules it left loaded, one forked child each."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", CHILD, json.dumps(argvs)], capture_output=True, text=True,
                         env=env, timeout=300, check=True)
    return json.loads(res.stdout)


def heavy_in(modules: list[str]) -> list[str]:
    """The modules of :data:`HEAVY` (or below one) among ``modules``."""
    return sorted(m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Each command's run, by a short name."""
    tmp = tmp_path_factory.mktemp("cli_imports")
    (tmp / "args.yaml").write_text(TRAINING_ARGS)
    (tmp / "ds.json").write_text(DEEPSPEED)
    est = ["estimate", "--hf-config", "mistral-7b"]
    commands = {"help": ["--help"], "hf": est,
                "hf --training-args": [*est, "--training-args", str(tmp / "args.yaml")],
                "hf --deepspeed": [*est, "--deepspeed", str(tmp / "ds.json"), "--world-size", "2"],
                "gpt": ["estimate", "--model", "gpt2-small", "--seq", "128", "--batch", "1"]}
    by_argv = loaded(list(commands.values()))
    return {name: by_argv[" ".join(argv)] for name, argv in commands.items()}


def test_the_children_ran_the_cli(runs):
    """Each command exited 0 and loaded the CLI and torch: the checks below look at real runs."""
    for name, run in runs.items():
        assert run["rc"] == 0, name
        assert {"memlab.app.cli", "torch"} <= set(run["modules"]), name


def test_help_loads_no_lens_and_no_reader(runs):
    modules = runs["help"]["modules"]
    assert heavy_in(modules) == []
    assert "memlab.hf.read_run_configs" not in modules and "yaml" not in modules


@pytest.mark.parametrize("name", ["hf", "hf --training-args", "hf --deepspeed"])
def test_an_hf_estimate_loads_only_the_estimate(runs, name):
    """``estimate --hf-config`` alone, with a Trainer YAML and with a plain ZeRO-2 JSON: the
    closed form and the readers, no DeepSpeed (a plain config is read from its JSON), no
    transformers (the shipped config's class defaults are recorded), no guard, no time lens."""
    modules = runs[name]["modules"]
    assert heavy_in(modules) == []
    assert "memlab.hf.estimate" in modules
    # the run configs' readers only when a run config is given
    assert ("memlab.hf.read_run_configs" in modules) == (name != "hf")


def test_a_gpt_estimate_loads_no_hf_reader_and_no_guard(runs):
    """memlab's GPT estimate reads the time lens (the step's FLOPs), nothing else heavy."""
    modules = runs["gpt"]["modules"]
    assert "memlab.lenses.estimate" in modules
    assert heavy_in(m for m in modules if not m.startswith("memlab.time")) == []
    assert "memlab.hf.read_run_configs" not in modules
