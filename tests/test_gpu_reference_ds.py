"""DeepSpeed's accounting against real DeepSpeed on one H200 (``zero_offload_one_gpu.json``).

The reference measured gpt2-large (774M parameters), bf16, seq 1024, batch 4, on one GPU
with memlab's DeepSpeed config: the CUDA allocator's peak over a steady-state step
(``device_peak``) and the host RSS after warm-up. These tests run on CPU from that file.
"""
import json
from importlib import resources

import pytest

from memlab.estimate import estimate_step
from memlab.simulate import simulate_step
from memlab.states import model_states
from memlab.step import StepConfig

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


@pytest.mark.parametrize("zero, offload", [(1, "none"), (2, "none"), (2, "optimizer"), (3, "none")])
def test_estimate_of_the_device_peak_within_5_percent(zero, offload):
    """DeepSpeed's layout (16-bit weights and gradients, fp32 master and moments, offloaded
    ones on the host) and its 16-bit forward: the estimate's peak against the allocator's."""
    row = _row(zero, offload)
    est = estimate_step(_step(row))
    assert est.peak_bytes == pytest.approx(row["device_peak"], rel=0.05)


def test_device_base_is_the_model_states_deepspeed_keeps():
    """After warm-up the allocator holds the model states and DeepSpeed's buffers; the
    cuBLAS workspace (64 MiB on this GPU, README) comes on top."""
    for zero, offload in ((1, "none"), (2, "none"), (2, "optimizer"), (3, "none")):
        row = _row(zero, offload)
        s = _step(row)
        ms = model_states(s.model_config, precision="bf16", zero=zero, offload=offload)
        # ZeRO-2's gradient partition exists only from backward to the step
        held = ms.parameters + ms.optimizer + ms.buffers + (ms.gradients if zero == 3 else 0)
        assert held + 64 * 2**20 == pytest.approx(row["device_base"], rel=0.01), (zero, offload)


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


def test_simulation_of_the_offload_step_within_5_percent():
    row = _row(2, "optimizer")
    sim = simulate_step(_step(row))
    assert sim.peak_bytes == pytest.approx(row["device_peak"], rel=0.05)
    assert sim.host_bytes == estimate_step(_step(row)).host_bytes


def test_the_cli_measure_bug_was_host_state_counted_as_device():
    """``memlab measure ... --offload optimizer --device cuda`` (before the fix) reported
    19.78 GiB; its own categories show why: the host-resident fp32 master, moments and fp32
    gradients (16 bytes per parameter) were in them. Without those, the tracked tensors are
    within 3% of the allocator's peak (the rest: cuBLAS workspace, DeepSpeed's staging)."""
    cli = json.loads(REF.joinpath("cli_measure_zero2_offload.json").read_text())
    psi = cli["config"]["num_params"]
    cats = cli["by_category"]
    assert cli["peak_bytes"] / GiB == pytest.approx(19.78, abs=0.01)
    host = cats["optimizer"] + cats["gradients"]
    assert host == pytest.approx(16 * psi, rel=0.001)
    device = cli["peak_bytes"] - host
    assert device == pytest.approx(_row(2, "optimizer")["device_peak"], rel=0.03)


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
