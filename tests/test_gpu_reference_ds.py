"""DeepSpeed's accounting against real DeepSpeed on one H200 (``zero_offload_one_gpu.json``).

The reference measured gpt2-large (774M parameters), bf16, seq 1024, batch 4, on one GPU
with memlab's DeepSpeed config: the CUDA allocator's peak over a steady-state step
(``device_peak``) and the host RSS after warm-up. These tests run on CPU from that file.
"""
import json
from importlib import resources

import pytest

from memlab.lenses.estimate import estimate_step
from memlab.lenses.simulate import FORMULA_CATEGORIES, FORMULA_NOTE, simulate_step
from memlab.step.states import model_states
from memlab.step.training_step import StepConfig

REF = resources.files("memlab").joinpath("data", "reference", "NVIDIA-H200")
ROWS = json.loads(REF.joinpath("zero_offload_one_gpu.json").read_text())
GiB = 2**30


def _row(zero: int, offload: str) -> dict:
    return next(r for r in ROWS if r["zero"] == zero and r["offload"] == offload)


def _step(row: dict) -> StepConfig:
    return StepConfig(model=row["model"], seq=row["seq"], batch=row["batch"], precision="bf16",
                      zero=row["zero"], offload=row["offload"])


def test_the_reference_is_the_step_we_estimate():
    for row in ROWS:
        assert _step(row).model_config.num_params() == row["num_params"] == 774_030_080


# every DeepSpeed row the estimate can express (StepConfig zero=0 is plain PyTorch: see below)
DEEPSPEED_ROWS = [(1, "none"), (2, "none"), (2, "optimizer"), (3, "none")]


@pytest.mark.parametrize("zero, offload", DEEPSPEED_ROWS)
def test_estimate_of_the_device_peak_within_1_percent(zero, offload):
    """DeepSpeed's layout (16-bit weights and gradients, fp32 master and moments, offloaded
    ones on the host) and its 16-bit forward, for the GPU (target ``cuda``): the estimate's
    peak against the allocator's. Achieved: +0.02%, -0.20%, +0.03%, +0.68%."""
    row = _row(zero, offload)
    est = estimate_step(_step(row), target="cuda")
    assert est.peak_bytes == pytest.approx(row["device_peak"], rel=0.01)


def test_every_reference_row_is_checked():
    """No row is left out silently: the ZeRO-0 row is checked on its own (below)."""
    assert sorted((r["zero"], r["offload"]) for r in ROWS) == sorted(DEEPSPEED_ROWS + [(0, "none")])


@pytest.mark.parametrize("zero, offload, rel", [(1, "none", 0.001), (2, "none", 0.001),
                                                (2, "optimizer", 0.001), (3, "none", 0.001),
                                                (0, "none", 0.025)])
def test_device_base_is_the_model_states_deepspeed_keeps(zero, offload, rel):
    """After warm-up the allocator holds the model states and DeepSpeed's buffers; the
    cuBLAS workspace (``memlab.core.cards.cublas_workspace_bytes``) comes on top. Achieved: +0.009% (ZeRO
    1-3), +0.056% (offload). The ZeRO-0 row ran DeepSpeed at stage 0, a step
    :class:`StepConfig` cannot express (``zero=0`` is plain PyTorch with autocast), so it is
    checked here against DeepSpeed's stage-0 layout only: 2.4% under, a known gap (DeepSpeed's
    stage-0 bf16 optimizer holds buffers memlab does not model)."""
    row = _row(zero, offload)
    s = _step(row)
    ms = model_states(s.model_config, precision="bf16", zero=zero, offload=offload, deepspeed=True)
    # ZeRO-2's gradient partition exists only from backward to the step
    held = ms.parameters + ms.optimizer + ms.buffers + (ms.gradients if zero == 3 else 0)
    assert held + 64 * 2**20 == pytest.approx(row["device_base"], rel=rel)


def test_offload_host_bytes_within_10_percent_of_the_host_rss_growth():
    """The host-resident state: RSS after warm-up with optimizer offload less the same step's
    RSS without it (ZeRO-2). ZeRO-Offload keeps there the fp32 master, moments and gradients,
    a 16-bit copy of the parameters, DeepSpeed's pinned buffers at power-of-two sizes."""
    grown = _row(2, "optimizer")["rss_before"] - _row(2, "none")["rss_before"]
    est = estimate_step(_step(_row(2, "optimizer")))
    assert est.host_bytes == pytest.approx(grown, rel=0.10)
    assert est.host_by_category["optimizer"] >= 12 * 774_030_080  # master + two moments
    # without offload nothing is in host memory
    assert estimate_step(_step(_row(2, "none"))).host_bytes == 0


def test_offload_halves_the_device_peak_as_measured():
    """The reference: ZeRO-2 17.49 GiB -> ZeRO-2 + optimizer offload 8.43 GiB on the device."""
    z2, off = (estimate_step(_step(_row(2, o))).peak_bytes for o in ("none", "optimizer"))
    real = _row(2, "optimizer")["device_peak"] / _row(2, "none")["device_peak"]
    assert off / z2 == pytest.approx(real, abs=0.03)


def test_simulation_of_the_offload_step_says_what_it_took_from_the_formula():
    """Under DeepSpeed the simulation runs the unsharded step and puts the model states in
    DeepSpeed's layout by formula: its notes say which categories, and only the simulated
    ones are compared with the H200's tracker (``cli_measure_zero2_offload.json``, the same
    step measured there): activations and temporaries to within 4 KiB (achieved: 440 bytes
    and exact). The peak, whose model states are the formula's, is within 0.1% of the
    allocator's (achieved +0.03%)."""
    row = _row(2, "optimizer")
    sim = simulate_step(_step(row), target="cuda")
    assert FORMULA_NOTE in sim.notes
    real = json.loads(REF.joinpath("cli_measure_zero2_offload.json").read_text())["by_category"]
    for category in ("activations", "temporaries"):
        assert category not in FORMULA_CATEGORIES
        assert sim.by_category[category] == pytest.approx(real[category], abs=4096), category
    assert sim.peak_bytes == pytest.approx(row["device_peak"], rel=0.001)


def test_the_cli_measure_bug_was_host_state_counted_as_device():
    """``memlab measure ... --offload optimizer --device cuda`` (before the fix) reported
    19.78 GiB; its own categories show why: the host-resident fp32 master, moments and fp32
    gradients (16 bytes per parameter, ZeRO-Offload sec. 4.1) were in them. The estimate
    keeps none of that on the device, and agrees with the same run's device categories:
    parameters exactly, activations and temporaries within 4 KiB (achieved: 584 bytes, 0)."""
    cli = json.loads(REF.joinpath("cli_measure_zero2_offload.json").read_text())
    psi = cli["config"]["num_params"]
    cats = cli["by_category"]
    assert cli["peak_bytes"] / GiB == pytest.approx(19.78, abs=0.01)
    assert cats["optimizer"] + cats["gradients"] == pytest.approx(16 * psi, rel=0.001)
    est = estimate_step(_step(_row(2, "optimizer")), target="cuda")
    assert est.by_category["optimizer"] == 0
    assert est.by_category["gradients"] < 0.1 * 2 * psi  # the bucket and one staging buffer
    assert est.by_category["parameters"] == cats["parameters"] == 2 * psi
    for category in ("activations", "temporaries"):
        assert est.by_category[category] == pytest.approx(cats[category], abs=4096), category


def test_deepspeed_runs_the_forward_in_16_bits_without_autocast():
    """DeepSpeed's bf16 mode casts the model, so its activations are a pure-bf16 step's: the
    tracker saw them on the H200 under DeepSpeed (``cli_measure_zero2_offload.json``)."""
    cli = json.loads(REF.joinpath("cli_measure_zero2_offload.json").read_text())
    step = _step(_row(2, "optimizer"))
    est = estimate_step(step)
    assert est.by_category["activations"] == pytest.approx(cli["by_category"]["activations"], rel=0.02)
    pure = estimate_step(StepConfig(model=step.model, seq=step.seq, batch=step.batch,
                                    precision="pure-bf16"))
    assert est.by_category["activations"] == pure.by_category["activations"]
