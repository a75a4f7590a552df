"""`memlab doctor`: the decisions are plain functions of the device facts, tested with patched
properties (0, 1, 2 GPUs; 16-141 GB; capability 7.5-9.0)."""
from types import SimpleNamespace

import pytest

from memlab.app import doctor
from memlab.app.cli import main as cli_main


def props(name="X", gb=80, major=8, minor=0):
    return SimpleNamespace(name=name, total_memory=gb * 10**9, major=major, minor=minor)


@pytest.mark.parametrize("major, minor, native", [(7, 5, False), (8, 0, True), (8, 6, True), (8, 9, True),
                                                  (9, 0, True), (7, 0, False)])
def test_bf16_is_native_from_ampere(major, minor, native):
    facts = doctor.gpu_facts(props(major=major, minor=minor))
    assert facts.bf16_native is native
    assert facts.capability == f"{major}.{minor}"


@pytest.mark.parametrize("gb", [16, 24, 40, 80, 141])
def test_memory_is_read_from_the_props(gb):
    assert doctor.gpu_facts(props(gb=gb)).memory == gb * 10**9


def test_no_gpu_everything_on_the_cpu(monkeypatch):
    monkeypatch.setattr("memlab.core.hardware.visible_gpus", lambda: 0)
    places = doctor.lesson_places(0)
    assert set(places.values()) == {"cpu", "cpu ranks"}
    assert sorted(n for n, p in places.items() if p == "cpu ranks") == list(doctor.RANK_LESSONS)
    line = doctor.verdict(places, [])
    assert "GPU" not in line and "two gloo ranks for 09 10 11 12 13 15" in line


def test_one_gpu_single_lessons_and_offload_on_it(monkeypatch):
    monkeypatch.setattr("memlab.core.hardware.visible_gpus", lambda: 1)
    places = doctor.lesson_places(1)
    on_gpu = [n for n, p in places.items() if p.startswith("gpu")]
    # one-process lessons on the card; of the rank lessons only offload (one rank per GPU)
    assert on_gpu == sorted(doctor.SINGLE_LESSONS + ("11",))
    assert [n for n, p in places.items() if p == "cpu ranks"] == ["09", "10", "12", "13", "15"]


def test_two_gpus_every_lesson_on_gpu(monkeypatch):
    monkeypatch.setattr("memlab.core.hardware.visible_gpus", lambda: 2)
    places = doctor.lesson_places(2)
    assert all(p.startswith("gpu") for p in places.values())
    assert len(places) == 18
    assert doctor.verdict(places, []).startswith("verdict: lessons on the GPU: 00 01")


def test_a_blocker_is_the_verdict():
    line = doctor.verdict(doctor.lesson_places(0), ["torch: not installed"])
    assert "cannot run" in line and "torch: not installed" in line


def test_exit_status_only_for_blockers(monkeypatch, capsys):
    places = doctor.lesson_places(0)
    monkeypatch.setattr(doctor, "collect", lambda build: ([doctor.Check("ram", "warn", "2 GiB")], places))
    assert cli_main(["doctor", "--no-build"]) == 0
    monkeypatch.setattr(doctor, "collect", lambda build: ([doctor.Check("torch", "FAIL", "missing")], places))
    assert cli_main(["doctor"]) == 1
    assert "cannot run here: torch: missing" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.distributed
def test_doctor_runs_here(capsys):
    assert cli_main(["doctor", "--no-build"]) == 0
    out = capsys.readouterr().out
    assert "ok    two ranks" in out and out.strip().splitlines()[-1].startswith("verdict: lessons")
