"""tools/output_noise.py and notebooks/conftest.py: noise in a cell's outputs fails the cell.

Each kind of noise is fed as the outputs nbval collects (nbformat output dicts), copied from
what the executed lessons showed before memlab was quieted; a quiet cell's outputs, as the
lessons print them, pass.
"""
import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load(name: str, path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module      # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


noise = _load("output_noise", ROOT / "tools" / "output_noise.py")
plugin = _load("notebooks_conftest", ROOT / "notebooks" / "conftest.py")


def stream(text: str, name: str = "stdout") -> dict:
    return {"output_type": "stream", "name": name, "text": text}


def result(text: str, widget: bool = False) -> dict:
    data = {"text/plain": text}
    if widget:
        data["application/vnd.jupyter.widget-view+json"] = {"model_id": "x", "version_major": 2}
    return {"output_type": "execute_result", "data": data, "metadata": {}, "execution_count": 1}


QUIET = [
    stream("measure | tiny | seq 128 batch 4 | fp32 | ckpt none | cpu\n  parameters      14.03 MiB\n"
           "  peak            81.02 MiB\n  step time        218.8 ms\n  FLOPs           1.139e+10\n"),
    stream("{'naive': 'x2.39', 'sdpa': 'x2.00'} (x2 would be linear, x4 quadratic)\n"),
    stream("saved on the peak: ['0%', '21%', '52%']\n"),
    stream("DeepSpeed op cpu_adam: built in 41 s (cached under .cache/torch_extensions)\n"),
    result("PASSED model states\n  adamw: 16 B/param, 119.66 GiB for llama-3-8b (8.03 B parameters)"),
    result("AccumulationCheck: k=4, gradients differ by at most 1.8e-07 (largest 0.42): the same"),
    result("VBox(children=(HBox(children=(SelectionSlider(continuous_update=False, description='seq', "
           "index=1, options=(64, 128, 256, 512), value=128),)),))", widget=True),
    {"output_type": "display_data", "data": {"image/png": "iVBOR", "text/plain": "<Figure size 700x350>"},
     "metadata": {}},
]

NOISY = {
    "error": [
        {"output_type": "error", "ename": "RuntimeError", "evalue": "boom", "traceback": ["..."]},
        stream("Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: no\n", "stderr"),
    ],
    "warning": [
        stream("/work/main/.venv/lib/python3.11/site-packages/transformers/modeling_utils.py:3303: "
               "FutureWarning: `is_gradient_checkpointing` is deprecated\n  warnings.warn(\n", "stderr"),
        stream("[transformers] `use_cache=True` is incompatible with gradient checkpointing. "
               "Setting `use_cache=False`.\n", "stderr"),
        stream("UserWarning: torch.cuda.amp.GradScaler is enabled, but CUDA is not available.\n"),
        stream("[2026-12-01 19:50:01,123] [WARNING] [config_utils.py:70:_process] Config parameter x\n"),
    ],
    "progress": [
        result("measure seq:   0%|          | 0/4 [00:00<?, ?it/s]", widget=True),
        result("batch search: 0it [00:00, ?it/s]", widget=True),
        stream("\rbatch search: 0it [00:00, ?it/s]\r 50%|#####     | 1/2 [00:01<00:01,  1.0s/it]", "stderr"),
    ],
    "build": [
        stream("/usr/bin/ld: cannot find -laio: No such file or directory\n"
               "collect2: error: ld returned 1 exit status\n"),
        stream("Emitting ninja build file /root/.cache/torch_extensions/cpu_adam/build.ninja...\n"
               "Building extension module cpu_adam...\n[1/3] c++ -MMD -MF cpu_adam.o.d -c cpu_adam.cpp\n"
               "Loading extension module cpu_adam...\nTime to load cpu_adam op: 41.2 seconds\n"),
        stream("cpu_adam built successfully\n"),
    ],
    "repr": [
        result("AccumulationCheck(k=4, max_abs_diff=1.7881393432617188e-07, max_grad=0.4217, same=True)"),
        result("GPTConfig(vocab_size=50257, n_layer=12, n_head=12, d_model=768, seq_len=1024, "
               "mlp_hidden=3072, norm='layernorm', position='learned', bias=True, tie_embeddings=True)"),
        stream("{'bubble': 0.2488566398040607, 'm': 4}\n"),
    ],
}


def test_quiet_outputs_pass():
    assert noise.noise_in(QUIET) == []


@pytest.mark.parametrize("kind,out", [(k, o) for k, outs in NOISY.items() for o in outs],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_each_kind_of_noise_is_named(kind, out):
    found = noise.noise_in(QUIET[:2] + [out] + QUIET[2:])
    assert found and {n.kind for n in found} == {kind}, found


def test_a_warning_block_is_one_piece_and_a_tag_allows_its_kind():
    block = NOISY["warning"][0]
    assert len(noise.noise_in([block])) == 1          # its "  warnings.warn(" line is the same block
    assert noise.noise_in([block], tags=["allow-warning"]) == []
    assert noise.noise_in([block], tags=["allow-repr"]) != []


class FakeCell:
    """What the hook reads of nbval's ``IPyNbCell`` after ``runtest``."""

    def __init__(self, outputs, tags=()):
        self.test_outputs = outputs
        self.cell = {"metadata": {"tags": list(tags)}}

    def raise_cell_error(self, message, detail):
        raise AssertionError(f"{message}\n{detail}")


def _run_hook(item):
    wrapper = plugin.pytest_runtest_call(item)
    next(wrapper)               # nbval's runtest ran here
    with pytest.raises(StopIteration):
        wrapper.send(None)


def test_the_nbval_hook_fails_a_noisy_cell_and_passes_a_quiet_one():
    _run_hook(FakeCell(QUIET))
    _run_hook(FakeCell([NOISY["warning"][2]], tags=["allow-warning"]))
    for kind, outs in NOISY.items():
        with pytest.raises(AssertionError, match=f"noise .*{kind}"):
            _run_hook(FakeCell(QUIET + outs[:1]))


def test_executed_notebooks_are_counted(tmp_path, capsys):
    import nbformat
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x", outputs=[nbformat.from_dict(o) for o in QUIET]),
                nbformat.v4.new_code_cell("y", outputs=[nbformat.from_dict(NOISY["progress"][0]),
                                                        nbformat.from_dict(NOISY["build"][0])])]
    path = tmp_path / "lesson.ipynb"
    nbformat.write(nb, path)
    assert noise.count_notebook(str(path)) == {"progress": 1, "build": 2}
    assert noise.main([str(path)]) == 1
    assert "lesson.ipynb" in capsys.readouterr().out


@pytest.mark.slow
def test_nbval_collects_the_plugin():
    """notebooks/conftest.py is found for a notebook path (pytest's rootdir is the repo; the
    fast sibling drives the hook itself: test_the_nbval_hook_fails_a_noisy_cell...)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "--nbval", "--nbval-current-env",
                           "-p", "no:cacheprovider", "notebooks/00_start_here.ipynb", "--trace-config"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:]
    assert "notebooks/conftest.py" in done.stdout
