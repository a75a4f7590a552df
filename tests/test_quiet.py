"""memlab.core.quiet and memlab's own calls: no bar nobody watches, no library warning memlab's call
triggers, a build's output in one line, results that print as one readable line."""
import logging
import re
import subprocess
import sys
import warnings

import pytest
import torch

from memlab.core import quiet
from memlab.step.training_step import StepConfig
from memlab.techniques.accumulation import AccumulationCheck

SMALL_LLAMA = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("env,asked,want", [("0", None, False), ("1", None, True), ("off", None, False),
                                            ("0", True, True), ("1", False, False), (None, None, False)])
def test_progress_wanted(monkeypatch, env, asked, want):
    if env is None:
        monkeypatch.delenv(quiet.PROGRESS_ENV, raising=False)   # pytest: no kernel, no terminal
    else:
        monkeypatch.setenv(quiet.PROGRESS_ENV, env)
    assert quiet.progress_wanted(asked) is want


def test_a_sweep_draws_no_bar_when_nobody_watches(monkeypatch, capfd):
    from memlab.techniques.sweeps import sweep
    step = StepConfig(model="tiny", seq=16, batch=1)
    monkeypatch.setenv(quiet.PROGRESS_ENV, "1")
    sweep(step, "batch", [1], lens="estimate")
    assert "estimate batch" in capfd.readouterr().err          # the bar, when asked for
    monkeypatch.setenv(quiet.PROGRESS_ENV, "0")
    sweep(step, "batch", [1, 2], lens="estimate")
    assert capfd.readouterr().err == ""


def test_quiet_build_sums_a_build_up_in_one_line(monkeypatch, tmp_path, capfd):
    import io
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    line = io.StringIO()
    with quiet.quiet_build("DeepSpeed op", stream=line):
        print("DeepSpeed deepspeed.ops.demo built successfully", flush=True)       # sys.stdout
        subprocess.run([sys.executable, "-c", "import sys; print('[1/2] c++ -c demo.cpp'); "  # fd 1 and 2
                        "print('/usr/bin/ld: cannot find -laio', file=sys.stderr)"], check=True)
        (tmp_path / "demo").mkdir()
        (tmp_path / "demo" / "demo.so").write_bytes(b"")                           # what a build leaves
    seen = capfd.readouterr()
    assert seen.out == "" and seen.err == ""
    assert re.fullmatch(rf"DeepSpeed op demo: built in \d+ s \(cached under {re.escape(str(tmp_path))}\)\n",
                        line.getvalue()), line.getvalue()
    with quiet.quiet_build("DeepSpeed op", stream=line):                           # loaded from the cache
        print("DeepSpeed deepspeed.ops.demo built successfully", flush=True)
    assert line.getvalue().count("\n") == 1 and capfd.readouterr().out == ""


def test_quiet_build_shows_the_log_when_the_build_fails(capfd):
    with pytest.raises(RuntimeError), quiet.quiet_build("DeepSpeed op"):
        subprocess.run([sys.executable, "-c", "print('error: demo.cpp:1: no such file')"], check=True)
        raise RuntimeError("build failed")
    err = capfd.readouterr().err
    assert "DeepSpeed op: failed" in err and "no such file" in err


def test_hf_checkpointing_turns_the_cache_off_itself(capfd):
    from transformers import LlamaConfig, LlamaForCausalLM

    from memlab.hf import config as hf
    logging.Logger.warning_once.cache_clear()        # transformers logs each message once a process
    model = LlamaForCausalLM(LlamaConfig(**SMALL_LLAMA)).train()
    hf.enable_hf_checkpointing(model)
    ids = torch.randint(0, 128, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert model.config.use_cache is False
    assert "use_cache" not in capfd.readouterr().err


def test_peft_model_triggers_no_deprecation_warning():
    from peft import LoraConfig
    from transformers import LlamaConfig, LlamaForCausalLM

    from memlab.hf import config as hf
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = hf.peft_model(LlamaForCausalLM(LlamaConfig(**SMALL_LLAMA)),
                              LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    assert model.get_nb_trainable_parameters()[0] > 0
    assert [str(w.message) for w in caught] == []


def test_a_result_prints_one_readable_line_and_keeps_its_fields():
    from IPython.lib.pretty import pretty
    check = AccumulationCheck(k=4, max_abs_diff=1.7881393432617188e-07, max_grad=0.5202020406723022, same=True)
    for shown in (str(check), pretty(check)):
        assert "\n" not in shown and len(shown) <= 120 and "1.8e-07" in shown and "7881393" not in shown
    assert check == AccumulationCheck(4, 1.7881393432617188e-07, 0.5202020406723022, True)
    assert "max_abs_diff=1.7881393432617188e-07" in repr(check)      # repr stays the dataclass's


def noisy_worker(rank: int, world_size: int, fail: bool = False) -> int:
    """What DeepSpeed does on a rank: prints, warns, and runs the linker (a subprocess)."""
    print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully", flush=True)
    warnings.warn("`torch.distributed.reduce_scatter_tensor` is deprecated", FutureWarning, stacklevel=1)
    subprocess.run([sys.executable, "-c", "import sys; print('/usr/bin/ld: cannot find -laio', file=sys.stderr)"],
                   check=True)
    if fail and rank == 1:
        raise ValueError("boom from the second rank")
    return rank


@pytest.mark.slow
@pytest.mark.distributed
def test_ranks_keep_their_output_unless_one_fails(capfd):
    """Two launches (about 10 s each unloaded); quiet_build's tests are its fast siblings."""
    from memlab.distributed.ranks import RankError, run_ranks
    assert run_ranks(noisy_worker, 2, timeout=120) == [0, 1]
    seen = capfd.readouterr()
    assert "cannot find -laio" not in seen.out + seen.err and "deprecated" not in seen.err, seen
    with pytest.raises(RankError, match="boom"):
        run_ranks(noisy_worker, 2, kwargs={"fail": True}, timeout=120)
    err = capfd.readouterr().err
    assert "the ranks' output" in err and "cannot find -laio" in err   # a failure shows the log


#: bitsandbytes, then torchao, imported in one process (two imports of torch cost seconds each),
#: a line between them so that each library's own lines are told apart
LIBRARY_IMPORTS = ("import logging, sys; logging.basicConfig(stream=sys.stderr); {}import bitsandbytes; "
                   "print('--- torchao', file=sys.stderr, flush=True); import torchao")


@pytest.fixture(scope="module")
def import_lines() -> dict[str, tuple[str, str]]:
    """Each library's import lines on stderr: (without memlab, after ``import memlab``)."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("torchao")
    runs = []
    for first in ("", "import memlab; "):
        done = subprocess.run([sys.executable, "-c", LIBRARY_IMPORTS.format(first)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        runs.append(done.stderr.split("--- torchao\n"))
    (bnb_bare, ao_bare), (bnb_quiet, ao_quiet) = runs
    return {"bitsandbytes": (bnb_bare, bnb_quiet), "torchao": (ao_bare, ao_quiet)}


def test_bitsandbytes_hub_kernel_warning_is_kept_out_once_memlab_is_imported(import_lines):
    """On a CPU with AVX512-BF16, importing bitsandbytes logs that its hub GEMM cannot be
    fetched (lesson 03's peft cell printed it); after ``import memlab`` it does not."""
    bare, quiet = import_lines["bitsandbytes"]
    if "kernels-community" not in bare:
        pytest.skip("this CPU's bitsandbytes backend does not try the hub kernel")
    assert "kernels-community" not in quiet, quiet


def test_torchao_extension_warnings_are_kept_out_once_memlab_is_imported(import_lines):
    """transformers imports torchao when it is installed; on a CPU-only torch torchao warns for
    each CUDA extension it cannot load and torch's pytree for each enum it registers (lesson
    03's first transformers cell printed four such lines); after ``import memlab`` none."""
    bare, quiet = import_lines["torchao"]
    if "WARNING" not in bare and "Enum subclass" not in bare:
        pytest.skip("torchao loads quietly with this torch")
    assert "Failed to load" not in quiet and "Enum subclass" not in quiet, quiet
