"""The measured comparison table: verdicts, GPU references, files written, the CLI."""
import json
from dataclasses import replace

import pytest

from memlab.app.cli import main
from memlab.classroom.technique_table import measure_table, ranks_for, reference_ratios, verdict, zero_saving
from memlab.lenses.estimate import estimate_step
from memlab.lenses.reference import load_references
from memlab.step.training_step import StepConfig

STEP = StepConfig(seq=128, batch=4)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    return measure_table(STEP, distributed=False, repeats=1,
                         reference_dir=tmp_path_factory.mktemp("none"))


def test_single_device_rows_are_measured(table):
    techs = [r.technique for r in table.rows]
    assert techs == ["gradient checkpointing", "mixed precision", "activation compression",
                     "recomputation (selective)", "optimizer step in backward", "op-level checkpointing",
                     "activation offload"]
    ck = table.row("gradient checkpointing")
    assert 0.2 < ck.saving < 0.9 and ck.time_ratio > 0
    assert table.row("activation compression").saving > 0.15
    assert any("no GPU reference" in n for n in table.notes)


@pytest.mark.parametrize("technique, change, claim_low, condition", [
    ("gradient checkpointing", dict(checkpointing="full"), 0.50, "activations are most of the peak"),
    ("mixed precision", dict(precision="bf16"), 0.45, "activations dominate"),
])
def test_verdict_follows_from_the_estimated_saving(table, technique, change, claim_low, condition):
    """A second lens decides the verdict: the closed-form estimate's saving for the same
    change, against the curriculum's published low end (50-70% for checkpointing, ~50% for mixed
    precision) less the table's 5-point allowance. The measured saving agrees with the
    estimate's within 0.5 points (achieved: 0.3 and < 0.01)."""
    base = estimate_step(STEP).peak_bytes
    expected_saving = 1 - estimate_step(replace(STEP, **change)).peak_bytes / base
    row = table.row(technique)
    assert row.saving == pytest.approx(expected_saving, abs=0.005)
    if expected_saving >= claim_low - 0.05:
        assert row.verdict == "holds"
    else:  # the tiny step: activations are under half the peak, so neither claim holds
        assert row.verdict.startswith(f"holds only when {condition}")


def test_selective_recomputation_with_sdpa_saves_nothing_measurable(table):
    """With SDPA only a log-sum-exp per head and token is saved in the core (4 a s b bytes per
    layer: 64 KiB of an 81 MiB peak here), so the saving is under 0.1% and the verdict names
    the condition under which it would hold."""
    cfg = STEP.model_config
    lse = 4 * cfg.n_head * STEP.seq * STEP.batch * cfg.n_layer
    row = table.row("recomputation (selective)")
    assert 0 <= row.saving * estimate_step(STEP).peak_bytes <= 2 * lse
    assert row.verdict.startswith("holds only when attention scores are stored")


def test_save_writes_markdown_json_png(table, tmp_path):
    paths = table.save(tmp_path)
    md = paths["markdown"].read_text()
    assert "| gradient checkpointing | ~50-70% |" in md and "single-device rows only" in md
    assert json.loads(paths["json"].read_text())["rows"][0]["technique"] == "gradient checkpointing"
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_verdicts():
    assert verdict(0.60, (0.5, 0.7), "x") == "holds"
    assert verdict(0.46, (0.5, 0.7), "x") == "holds"  # within 5 points
    assert verdict(0.30, (0.5, 0.7), "long sequences") == "holds only when long sequences"
    assert verdict(0.30, (0.5, 0.7), "") == "does not hold"
    assert verdict(0.0, None, "") == "does not hold"


def test_zero_formula_thresholds():
    # Rajbhandari et al. 2020, figure 1: 4x (75%) and 8x (87.5%) as N grows; ZeRO-3 1/N
    assert zero_saving(0, 64) == 0
    assert zero_saving(1, 10**6) == pytest.approx(0.75, abs=1e-3)
    assert zero_saving(2, 10**6) == pytest.approx(0.875, abs=1e-3)
    assert zero_saving(3, 8) == pytest.approx(7 / 8)
    assert ranks_for(1, 0.5) == 3 and ranks_for(3, 0.9) == 10
    assert ranks_for(1, 0.8) is None  # ZeRO-1 never reaches 80%


def test_gpu_references_are_used_when_present(tmp_path):
    assert load_references(tmp_path / "missing") == []
    rows = [{"model": "gpt2-small", "seq": 512, "batch": 8, "measure_peak_bytes": 1000,
             "step_seconds": 1.0},
            {"model": "gpt2-small", "seq": 512, "batch": 8, "checkpointing": "full",
             "measure_peak_bytes": 400, "step_seconds": 1.3},
            {"model": "gpt2-small", "seq": 512, "batch": 8, "precision": "bf16",
             "measure_peak_bytes": 600, "step_seconds": 0.5}]
    (tmp_path / "NVIDIA-H200.json").write_text(json.dumps({"gpu": "NVIDIA H200", "rows": rows}))
    (tmp_path / "broken.json").write_text("{not json")
    refs = load_references(tmp_path)
    assert len(refs) == 1
    got = reference_ratios(refs)
    assert got["gradient checkpointing"] == "NVIDIA H200 gpt2-small s512: 60% saved, 1.30x time"
    assert got["mixed precision"] == "NVIDIA H200 gpt2-small s512: 40% saved, 0.50x time"


def test_load_references_reads_the_shipped_h200_folder():
    """data/reference/NVIDIA-H200/: gpu_check.json (16 rows: 2 models x 2 lengths x 4
    variants), devset.json (19 rows) and the single-GPU DeepSpeed rows (ZeRO 0-3, offload)."""
    refs = load_references()
    h200 = next(r for r in refs if r.get("folder") == "NVIDIA-H200")
    assert h200["gpu"] == "NVIDIA H200" and len(h200["rows"]) == 16
    assert len(h200["devset"]) == 19 and len(h200["zero_offload"]) == 5
    got = reference_ratios([h200])
    # the README's figures: ZeRO-2 17.49 GiB -> 8.43 GiB with the optimizer offloaded
    assert "17.49 -> 8.43 GiB" in got["offloading"] and "NVIDIA H200" in got["offloading"]
    assert {"ZeRO-1", "ZeRO-2", "ZeRO-3", "mixed precision", "gradient checkpointing"} <= got.keys()
    # gpu_check, gpt2-small s512 b8: fp32 6407843608 bytes, bf16 5179946272 tracked
    assert "gpt2-small s512: 19% saved" in got["mixed precision"]


def test_cli_report_writes_files(tmp_path, capsys):
    assert main(["report", "--out", str(tmp_path), "--seq", "64", "--batch", "2",
                 "--no-distributed", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # the four curriculum techniques one device measures, and three of today's (in-backward, op, offload)
    assert len(out["rows"]) == 4 + 3 and (tmp_path / "table.md").exists() and (tmp_path / "table.png").exists()


@pytest.mark.parametrize("argv, needle", [
    (["report"], "the following arguments are required: --out"),
    (["report", "--out", "x", "--model", "gpt9"], "unknown model preset 'gpt9'"),
    (["report", "--out", "x", "--world-size", "1"], "world size 1 for the multi-rank rows"),
])
def test_cli_report_bad_input(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_todays_techniques_are_rows_with_memory_and_time(table):
    """Issue 39's rows, each against facts found outside memlab: save_on_cpu keeps the tensor
    itself on a CPU (so the peak is the plain step's to the byte); torchtitan's op-level policy
    saves more than full checkpointing and less than none (its peak lies between the two rows);
    fusing the step into backward frees each gradient once applied, which lowers only a peak that
    holds gradients: this step's peak is at the forward's end (states and activations, no gradient
    yet; tests/test_in_backward.py measures the saving where gradients are in the peak), so the row
    keeps the plain peak to the byte and says when it would hold."""
    off, op = table.row("activation offload"), table.row("op-level checkpointing")
    assert off.memory_ratio == 1.0 and off.verdict.startswith("holds only when the device is a GPU")
    full = table.row("gradient checkpointing").memory_ratio
    assert full < op.memory_ratio < 1.0
    ib = table.row("optimizer step in backward")
    assert ib.memory_ratio == 1.0 and ib.verdict == "holds only when the gradients are a large share of the peak"
    assert all(r.time_ratio > 0 for r in table.rows[-3:])
    assert any("expandable_segments" in n and "OOMs by default" in n and "fits with" in n for n in table.notes)
