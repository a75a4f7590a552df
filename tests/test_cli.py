"""The CLI contract: JSON keys, exit codes (0 result, 2 user error, 1 internal error),
one-line errors, and no flag silently ignored."""
import json

import pytest

from memlab.app.cli import main

KEYS = {"lens", "config", "seq", "batch", "device", "peak_bytes", "by_category",
        "budget_bytes", "fits", "step_seconds"}


@pytest.mark.parametrize("lens", ["estimate", "simulate", "measure"])
def test_json_keys(lens, capsys):
    assert main([lens, "--model", "tiny", "--seq", "64", "--batch", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert KEYS <= out.keys()
    assert out["lens"] == lens
    assert set(out["by_category"]) == {"parameters", "gradients", "optimizer", "activations",
                                       "temporaries", "other", "workspace"}
    assert out["host_bytes"] == 0 and set(out["host_by_category"]) == set(out["by_category"])


def test_not_fitting_is_a_result(capsys):
    assert main(["measure", "--seq", "128", "--batch", "4", "--budget", "60MiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and out["budget_bytes"] == 60 * 2**20
    assert "Tried to allocate" in out["oom"]["message"]


@pytest.mark.parametrize("argv, needle", [
    (["estimate", "--seq", "0"], "seq must be a positive integer, got 0"),
    (["estimate", "--seq", "abc"], "seq must be a positive integer, got 'abc'"),
    (["estimate", "--batch", "-3"], "batch must be a positive integer, got -3"),
    (["estimate", "--model", "gpt5"], "unknown model preset 'gpt5'; allowed: tiny"),
    (["estimate", "--gpu", "Z100"], "unknown GPU preset 'Z100'; allowed: T4-16GB"),
    (["estimate", "--d-model", "100", "--heads", "3"], "d_model=100 is not divisible by n_head=3"),
    (["estimate", "--zero", "4"], "ZeRO stage '4' is outside 0-3"),
    (["estimate", "--world-size", "0"], "world size must be a positive integer, got 0"),
    (["estimate", "--budget", "-5"], "malformed size '-5'"),
    (["estimate", "--budget", "12XB"], "malformed size '12XB'"),
    (["measure", "--device", "tpu"], "unknown device 'tpu'; allowed: cpu, cuda"),
    (["estimate", "--precision", "fp8"], "invalid choice: 'fp8'"),
    (["estimate", "--seq", "5000"], "seq 5000 exceeds the model's block size; allowed: 1-1024"),
])
def test_bad_input_exits_2_with_one_line(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("argv, needle", [
    (["measure", "--zero", "2", "--world-size", "2", "--snapshot", "s.pickle"],
     "--snapshot records one process's CUDA allocator; it is not available for multi-rank runs"),
    (["measure", "--snapshot", "s.pickle"], "with --device cpu there is none"),
    (["simulate", "--offload", "optimizer", "--zero", "3", "--world-size", "2"],
     "the sharded simulation keeps every tensor on the device"),
    (["simulate", "--zero", "2", "--world-size", "2"], "simulate shards with FSDP2 (ZeRO-3) only"),
    (["simulate", "--zero", "3", "--world-size", "2", "--optimizer", "sgd"],
     "the sharded simulation runs AdamW only"),
    (["measure", "--zero", "2", "--world-size", "2", "--precision", "fp16"],
     "precision='fp16' for DeepSpeed here; allowed: fp32, bf16"),
])
def test_flags_a_command_cannot_honour_exit_2(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_one_rank_simulation_honours_zero_and_offload(capsys):
    """On one rank the simulation puts the model states in DeepSpeed's layout: optimizer
    offload moves the fp32 master and moments (and fp32 gradients) to the host."""
    assert main(["simulate", "--zero", "2", "--offload", "optimizer", "--seq", "64",
                 "--batch", "2", "--target", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["offload"] == "optimizer" and out["host_bytes"] > 0


def test_internal_error_shows_its_traceback_and_exits_1(monkeypatch, capsys):
    """Only user errors exit 2: a ValueError from inside memlab is a bug, not bad input."""
    import memlab.lenses.estimate

    def broken(*args, **kwargs):
        raise ValueError("an internal inconsistency")

    # the CLI imports the lens when the command runs (startup), from its module
    monkeypatch.setattr(memlab.lenses.estimate, "estimate_step", broken)
    assert main(["estimate", "--seq", "64"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "ValueError: an internal inconsistency" in err
    assert "internal error" in err


def test_a_step_the_host_cannot_hold_exits_2_naming_the_way_out(monkeypatch, capsys):
    import memlab.lenses.guard
    monkeypatch.setattr(memlab.lenses.guard, "host_available_bytes", lambda: 2**20)
    assert main(["measure", "--seq", "64", "--batch", "2", "--device", "cpu", "--json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "measuring this step needs about" in err and "but only 1.00 MiB is available" in err
    # the same flags with simulate, less the measurement-only --device
    assert "`memlab simulate --seq 64 --batch 2 --json`" in err


def test_presets_lists_models_and_gpus(capsys):
    assert main(["presets", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["models"]["gpt2-small"]["params"] == 124_439_808
    assert "A100-40GB" in out["gpus"]


@pytest.mark.distributed
@pytest.mark.slow  # fast siblings: test_guard's same command with --budget, test_distributed's halves
def test_multi_rank_measure_prints_only_json_with_per_rank_halves():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "memlab.app.cli", "measure", "--seq", "64",
                          "--batch", "2", "--zero", "2", "--world-size", "2", "--json"],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    report = json.loads(out)  # DeepSpeed's logs must not reach stdout
    ranks = report["per_rank"]
    assert len(ranks) == 2
    for r in ranks:  # ZeRO-2 on 2 ranks: gradient and optimizer partitions are halves
        acc = r["allocator"]
        assert acc["gradients"] * 2 == pytest.approx(acc["parameters"], rel=0.01)
        assert acc["optimizer_state"] == pytest.approx(acc["parameters"], rel=0.01)


@pytest.mark.parametrize("flag, scope", [(["--compile"], True), (["--compile", "graph"], True), ([], False),
                                         (["--compile", "layers"], "layers"), (["--compile=layers"], "layers")])
def test_compile_takes_its_scope_and_bare_compile_keeps_its_meaning(flag, scope, capsys):
    """``--compile layers`` is torchtune's compile (``StepConfig(compile="layers")``); bare ``--compile`` and
    ``--compile graph`` stay the whole graph (``compile=True``). The CLI's estimate is the library's of that step."""
    from memlab.lenses.estimate import estimate_step
    from memlab.step.training_step import StepConfig
    assert main(["estimate", "--seq", "32", "--batch", "2", "--target", "cpu", "--json", *flag]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["compile"] == scope
    assert out["peak_bytes"] == estimate_step(StepConfig(seq=32, batch=2, compile=scope), target="cpu").peak_bytes


@pytest.mark.parametrize("value", ["foo", "Layers", "true"])
def test_a_compile_scope_not_allowed_exits_2_naming_it(value, capsys):
    assert main(["estimate", "--compile", value]) == 2
    err = capsys.readouterr().err
    assert f"argument --compile: {value!r}; allowed: graph" in err and "layers (torchtune's" in err
    assert err.count("\n") == 1 and "Traceback" not in err
