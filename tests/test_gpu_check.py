"""`make gpu-check`: its plan on a CPU machine (DRY=1), its sizing per card, its order and
keep-going over notebooks, and that it never writes into the shipped references."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memlab.app import gpu_check
from memlab.core.cards import CARDS, get_card

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "notebooks").glob("*.ipynb"))


def _listing(folder: Path) -> dict:
    return {p.name: p.stat().st_mtime_ns for p in folder.rglob("*")}


def test_dry_run_prints_the_plan_per_notebook_per_card():
    shipped = ROOT / "memlab" / "data" / "reference"
    before = _listing(shipped)
    done = subprocess.run(["make", "-s", "gpu-check", "DRY=1", f"PY={sys.executable}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    for card in CARDS.values():
        assert f"== {card.describe()}" in out
    lines = [line for line in out.splitlines() if ".ipynb" in line]
    assert len(lines) == len(CARDS) * len(NOTEBOOKS)
    for line in lines:
        rank = Path(line.split()[0]).name.split("_")[0] in gpu_check.RANK_LESSONS
        assert ("[one at a time]" in line) == rank, line
    assert "NCCL, one GPU per rank" in out          # 2 x T4: the rank lessons on both GPUs
    assert _listing(shipped) == before              # nothing written into the references


def test_refuses_to_write_into_the_shipped_references(capsys):
    assert gpu_check.main(["--out", str(ROOT / "memlab" / "data" / "reference")]) == 2
    assert "inside the shipped references" in capsys.readouterr().err


def test_reference_steps_are_sized_for_the_card():
    h200, t4 = get_card("H200-141GB"), get_card("T4-16GB")
    assert len(gpu_check.sized_cases(h200)) == 16 and len(gpu_check.sized_devset(h200)) == 19
    small = gpu_check.sized_cases(t4)
    assert 0 < len(small) < 16
    assert all(s.precision == "fp32" for s in small)          # bf16 is not native on sm75
    assert not any(s.model_config.name == "gpt2-medium" and s.seq == 1024
                   and s.model_config.checkpointing == "none" for s in small)
    assert gpu_check.deepspeed_step(h200).model_config.name == "gpt2-large"
    assert gpu_check.deepspeed_step(t4).precision == "fp16"


def test_rank_notebooks_first_one_at_a_time_and_a_failure_does_not_stop_the_rest(monkeypatch, tmp_path):
    ran = []

    def fake(notebook, folder, python=sys.executable, cell_timeout=300):
        ran.append(notebook)
        return gpu_check.NotebookRun(notebook, "02_" not in notebook, 1.0, "log")

    monkeypatch.setattr(gpu_check, "run_notebook", fake)
    runs = gpu_check.run_notebooks(NOTEBOOKS, tmp_path)
    rank, others = gpu_check.notebook_groups(NOTEBOOKS)
    assert ran[:len(rank)] == rank and sorted(ran[len(rank):]) == sorted(others)
    assert len(runs) == len(NOTEBOOKS) and sum(not r.passed for r in runs) == 1
    text = gpu_check.table(runs, get_card("T4-16GB"))
    assert "| 02_baseline_oom.ipynb | FAIL | 1 |" in text and "card profile: T4-16GB" in text
    assert text.count("| pass |") == len(NOTEBOOKS) - 1


@pytest.mark.distributed
@pytest.mark.slow
def test_the_deepspeed_row_times_several_steps_and_keeps_each():
    # on one CPU rank (gloo): the row's seconds are the median of the timed steps, each kept
    import statistics

    from memlab.distributed.ranks import run_ranks
    from memlab.step.training_step import StepConfig
    step = StepConfig(model="tiny", seq=16, batch=2, precision="bf16", zero=2)
    row = run_ranks(gpu_check.deepspeed_one_gpu_worker, 1, kwargs={"step": step, "timed_steps": 3},
                    timeout=600)[0]
    samples = row["step_seconds_samples"]
    assert len(samples) == 3 and all(s > 0 for s in samples)
    assert row["step_seconds"] == statistics.median(samples)
