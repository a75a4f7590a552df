"""Rank placement: one function decides where ranks run, checked for 0, 1 and 2 GPUs.

The GPU count is patched (``torch.cuda.is_available`` / ``device_count``): the decision is
pure, and the one machine that crashed (one H200, two ranks: ``invalid device ordinal`` on
rank 1, see data/reference/NVIDIA-H200/nb_06.log) is the 1-GPU case below.
"""
import json
import os
import socket

import pytest
import torch

from memlab.core.hardware import place_ranks, rank_device
from memlab.distributed.ranks import resolve_placement, run_ranks


def gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_no_gpu_runs_gloo_ranks_on_the_cpu(monkeypatch):
    gpus(monkeypatch, 0)
    p = place_ranks(2)
    assert (p.backend, p.devices, p.device_type) == ("gloo", ("cpu", "cpu"), "cpu")
    assert "no CUDA GPU" in p.reason
    assert p.rank_env() == {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    assert place_ranks(2, shrink=True).backend == "gloo"  # nothing to shrink onto


def test_one_gpu_one_rank_is_nccl_on_it(monkeypatch):
    gpus(monkeypatch, 1)
    p = place_ranks(1)
    assert (p.backend, p.devices) == ("nccl", ("cuda:0",))
    assert p.rank_env() == {"DS_ACCELERATOR": "cuda"}


def test_one_gpu_two_ranks_puts_both_ranks_on_the_cpu(monkeypatch):
    gpus(monkeypatch, 1)
    p = place_ranks(2)
    assert (p.backend, p.devices, p.world_size) == ("gloo", ("cpu", "cpu"), 2)
    assert [p.device(r) for r in range(2)] == [torch.device("cpu")] * 2
    assert "one GPU per rank" in p.reason and "CPU" in p.reason
    assert p.rank_env()["DS_ACCELERATOR"] == "cpu"
    # the lesson that needs the GPU itself runs fewer ranks instead
    s = place_ranks(2, shrink=True)
    assert (s.backend, s.devices, s.world_size) == ("nccl", ("cuda:0",), 1)


def test_two_gpus_give_each_rank_its_own(monkeypatch):
    gpus(monkeypatch, 2)
    p = place_ranks(2)
    assert (p.backend, p.devices) == ("nccl", ("cuda:0", "cuda:1"))
    assert p.device(1) == torch.device("cuda", 1)
    assert place_ranks(3).backend == "gloo"
    asked = place_ranks(2, gpus=0)  # CPU ranks on purpose (the comparison table does this)
    assert asked.backend == "gloo" and "asked" in asked.reason


def test_bad_input_is_a_value_error():
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="world_size"):
            place_ranks(bad)
    with pytest.raises(ValueError, match="gpus"):
        place_ranks(2, gpus=-1)
    with pytest.raises(ValueError, match="rank 2"):
        place_ranks(2, gpus=0).device(2)


def test_asking_for_cuda_ranks_without_the_gpus_says_why(monkeypatch):
    gpus(monkeypatch, 1)
    with pytest.raises(ValueError, match="one CUDA GPU each"):
        resolve_placement(2, device="cuda")
    with pytest.raises(ValueError, match="one CUDA GPU each"):
        resolve_placement(2, backend="nccl")
    assert resolve_placement(2).backend == "gloo"
    assert resolve_placement(1, device="cuda").devices == ("cuda:0",)
    with pytest.raises(ValueError, match="placement is for 1"):
        resolve_placement(2, placement=place_ranks(1))


def report_env(rank: int, world_size: int) -> dict:
    """What a spawned rank sees (a worker for run_ranks)."""
    import torch.distributed as dist
    return {"backend": dist.get_backend(), "ds": os.environ.get("DS_ACCELERATOR"),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "device": str(rank_device())}


@pytest.mark.distributed
def test_run_ranks_follows_the_placement(monkeypatch):
    gpus(monkeypatch, 1)  # the parent believes in one GPU: two ranks must go to the CPU
    out = run_ranks(report_env, 2, timeout=120)
    assert out == [{"backend": "gloo", "ds": "cpu", "visible": "", "device": "cpu"}] * 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
def test_zero_rank_step_builds_on_the_cpu_when_its_group_is_gloo(monkeypatch):
    """1 GPU, 2 ranks -> gloo, and DeepSpeed's step then builds on the CPU even though CUDA
    is 'available' (the code before placement built on CUDA whenever CUDA existed)."""
    import torch.distributed as dist

    from memlab.distributed.deepspeed_zero import RankResult, zero_rank_step
    from memlab.step.training_step import StepConfig

    gpus(monkeypatch, 1)
    placement = place_ranks(2)
    assert placement.backend == "gloo"
    for key, value in {**placement.rank_env(), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(_free_port()), "RANK": "0", "LOCAL_RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    # one rank of such a job, in this process (a second rank would only repeat it)
    dist.init_process_group(placement.backend, rank=0, world_size=1)
    try:
        out = zero_rank_step(0, 1, StepConfig(seq=32, batch=2, zero=2), track=False)
    finally:
        dist.destroy_process_group()
    assert out.device == "cpu"
    assert out.accounting["parameters"] == 4 * StepConfig().model_config.num_params()
    assert out.device_peak_bytes is None  # no CUDA allocator was asked
    assert RankResult.from_dict(json.loads(json.dumps(out.to_dict()))) == out  # zero_worker's JSON line


def test_a_rank_result_crosses_a_json_line_unchanged():
    """zero_worker prints a RankResult as JSON; from_dict gives back the same result (tuple of
    host accounts, the OOM as an OOMInfo), ignoring the launcher's extra keys."""
    from memlab.core.errors import InputError
    from memlab.distributed.deepspeed_zero import RankResult
    from memlab.tracking.tracker import OOMInfo

    oom = OOMInfo("aten::mm", "blocks.0", "backward", 2**20, 3 * 2**20, 2**22, "over budget",
                  by_category={"activations": 2**20})
    res = RankResult(rank=1, device="cpu", optimizer="AdamW", host_accounts=("fp32_master",),
                     accounting={"fp32_master": 8, "optimizer_state": 16}, peak_bytes=64,
                     by_category={"parameters": 4}, oom=oom)
    line = json.dumps({"world_size": 2, **res.to_dict()})
    assert RankResult.from_dict(json.loads(line)) == res
    assert res.host_account_bytes() == 8
    with pytest.raises(InputError, match="needs \\['optimizer'\\]"):
        RankResult.from_dict({"rank": 0, "device": "cpu", "host_accounts": []})
