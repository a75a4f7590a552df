"""``memlab oom``: out-of-memory messages of every format torch, DeepSpeed and NCCL printed,
read into numbers and explained.

Real messages are quoted from the GitHub threads named beside them; the templates are torch's
own (c10/cuda/CUDACachingAllocator.cpp: the "(GPU 0; ... total capacity; ...)" message of torch
< 2.1 and the "GPU 0 has a total capacity of ..." one after it).
"""
import io
import json
import sys
from decimal import Decimal

import pytest

from memlab import cli
from memlab.errors import InputError
from memlab.oom import explain_last, explain_oom, parse_oom, read_oom

KiB, MiB, GiB = 2**10, 2**20, 2**30


def size(text: str) -> int:
    """c10's format_size printed a number and a binary unit: the bytes it stands for."""
    number, unit = text.split()
    return int(Decimal(number) * {"bytes": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB}[unit])


def format_size(n: int) -> str:
    """c10's format_size (c10/util/... used by CUDACachingAllocator.cpp): bytes up to 1 KiB,
    then KiB, MiB, GiB with two decimals, each unit up to and including its boundary."""
    if n <= KiB:
        return f"{n} bytes"
    if n <= MiB:
        return f"{n / KiB:.2f} KiB"
    if n <= GiB:
        return f"{n / MiB:.2f} MiB"
    return f"{n / GiB:.2f} GiB"


# https://github.com/rshaojimmy/MADDoG/issues/11 (torch < 2.1)
PRE_21 = ("RuntimeError: CUDA out of memory. Tried to allocate 2.87 GiB (GPU 0; 14.76 GiB total "
          "capacity; 8.77 GiB already allocated; 19.75 MiB free; 13.71 GiB reserved in total by PyTorch)")
# https://github.com/pytorch/pytorch/issues/16417 (title; torch < 1.5 printed "cached")
PRE_15 = ("RuntimeError: CUDA out of memory. Tried to allocate 12.50 MiB (GPU 0; 10.92 GiB total "
          "capacity; 8.57 MiB already allocated; 9.28 GiB free; 4.68 MiB cached)")
# https://github.com/pytorch/pytorch/issues/16417 (comment of 2024-03-13, torch >= 2.1)
POST_21 = ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 22.00 MiB. GPU 0 has a "
           "total capacity of 23.65 GiB of which 11.06 MiB is free. Including non-PyTorch memory, this "
           "process has 23.60 GiB memory in use. Of the allocated memory 22.90 GiB is allocated by "
           "PyTorch, and 194.87 MiB is reserved by PyTorch but unallocated. If reserved but unallocated "
           "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
           "fragmentation.  See documentation for Memory Management  "
           "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
# https://github.com/rwth-i6/returnn/issues/1482 (torch 2.1: "capacty"; 15 other processes;
# quoted up to where the thread's excerpt ends)
OTHERS = ("OutOfMemoryError: CUDA out of memory. Tried to allocate 52.00 MiB. GPU 0 has a total capacty "
          "of 31.74 GiB of which 39.62 MiB is free. "
          + "".join(f"Process {pid} has 1.19 GiB memory in use. " for pid in
                    (101553, 101552, 101563, 101549, 101555, 101558, 101557, 101562, 101556, 101560,
                     101554, 101550, 101561, 101559, 101551))
          + "Including non-PyTorch memory, this process has 13.82 GiB memory in use. Of the allocated "
            "memory 11.54 GiB is allocated by PyTorch, and 677.26 MiB is reserved by PyTorch but "
            "unallocated.")
# https://github.com/mxfold/mxfold2/issues/20 (title)
HOST = ("RuntimeError: [enforce fail at alloc_cpu.cpp:75] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 132426121216 bytes. Error code 12 (Cannot allocate memory)")
# https://github.com/IvanoLauriola/MKLpy/issues/27 (the Windows wording)
HOST_WINDOWS = "DefaultCPUAllocator: not enough memory: you tried to allocate 5077901088 bytes."
# https://github.com/deepspeedai/DeepSpeed/issues/3160 (the launcher's log; command shortened)
DEEPSPEED_KILLED = (
    '\n'
    '[2023-04-07 13:08:55,468] [INFO] [utils.py:829:see_memory_usage] Before initializing optim'
    'izer states\n'
    '[2023-04-07 13:08:55,469] [INFO] [utils.py:830:see_memory_usage] MA 11.76 GB         Max_M'
    'A 11.76 GB         CA 11.77 GB         Max_CA 12 GB\n'
    '[2023-04-07 13:08:55,469] [INFO] [utils.py:838:see_memory_usage] CPU Virtual Memory:  used'
    ' = 28.43 GB, percent = 22.6%\n'
    '[2023-04-07 13:09:33,201] [INFO] [launch.py:318:sigkill_handler] Killing subprocess 80\n'
    "[2023-04-07 13:09:33,220] [ERROR] [launch.py:324:sigkill_handler] ['/usr/bin/python3', '-u"
    "', 'run_clm.py', '--local_rank=0', '--deepspeed', 'ds_config_stage2_hf.json'] exits with r"
    'eturn code = -9\n')
# https://github.com/Lightning-AI/pytorch-lightning/issues/18134 (ZeRO-3 gathering parameters)
DEEPSPEED_GATHER = (
    '\n'
    'torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB (GPU 0; 31.7'
    '5 GiB total capacity; 30.25 GiB already allocated; 62.19 MiB free; 30.67 GiB reserved in t'
    'otal by PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb t'
    'o avoid fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CON'
    'F\n'
    '    param_coordinator.fetch_sub_module(sub_module, forward=True)\n'
    '    param_buffer = torch.empty(\n')
# https://github.com/PKU-YuanGroup/Open-Sora-Plan/issues/386 (NCCL_DEBUG=INFO output)
NCCL = "ins-7df6eojsifuykig9:3018451:3018451 [0] enqueue.cc:1085 NCCL WARN Cuda failure 'out of memory'"
# https://github.com/NVIDIA/nccl/issues/1410: an NCCL failure that is not an OOM
NCCL_NOT_OOM = (
    '\n'
    '[rank7]: torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d'
    '/NCCLUtils.hpp:275, unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL vers'
    'ion 2.20.5\n'
    '[rank7]: ncclUnhandledCudaError: Call to CUDA function failed.\n'
    '[rank7]: Last error:\n'
    "[rank7]: Cuda failure 1 'invalid argument'\n")
# https://github.com/huggingface/transformers/issues/24658 (title)
RUNTIME = "RuntimeError: CUDA error: out of memory with zero3 offload"


def test_torch_before_21_reads_into_numbers():
    m = parse_oom(PRE_21)
    assert (m.kind, m.era, m.device) == ("cuda", "pre-2.1", 0)
    assert (m.requested, m.total, m.allocated, m.free, m.reserved) == (
        size("2.87 GiB"), size("14.76 GiB"), size("8.77 GiB"), size("19.75 MiB"), size("13.71 GiB"))
    assert m.reserved_unallocated == size("13.71 GiB") - size("8.77 GiB")


def test_torch_before_15_printed_the_cache_as_cached():
    m = parse_oom(PRE_15)
    assert (m.era, m.allocated, m.reserved_unallocated) == ("pre-1.5", size("8.57 MiB"), size("4.68 MiB"))
    assert m.reserved == size("8.57 MiB") + size("4.68 MiB")
    # 9.28 GiB free and a 12.5 MiB request: not this process's doing
    assert explain_oom(PRE_15).cause == "outside the allocator"


def test_torch_21_and_later_reads_into_numbers():
    m = parse_oom(POST_21)
    assert (m.era, m.requested, m.total, m.free) == ("2.1+", size("22.00 MiB"), size("23.65 GiB"), size("11.06 MiB"))
    assert (m.allocated, m.reserved_unallocated) == (size("22.90 GiB"), size("194.87 MiB"))
    assert m.process == size("23.60 GiB") and m.hint == "expandable_segments"
    assert m.non_pytorch == size("23.60 GiB") - size("22.90 GiB") - size("194.87 MiB")
    e = explain_oom(POST_21)
    # the cache (0.8% of it) is not why a card 97% full of live tensors failed
    assert e.cause == "live tensors"
    assert any("expandable_segments" in a and "97%" in a for a in e.advice)


@pytest.mark.parametrize("device", [0, 3])
@pytest.mark.parametrize("fraction", [False, True])
def test_both_eras_give_the_same_numbers_for_the_same_allocator_state(device, fraction):
    """One allocator state, printed by both templates of CUDACachingAllocator.cpp."""
    total, free, allocated, reserved, request = 80 * GiB, 900 * MiB, 61 * GiB + 3 * MiB, 70 * GiB, 2 * GiB
    allowed = f"{format_size(72 * GiB)} allowed; " if fraction else ""
    old = (f"CUDA out of memory. Tried to allocate {format_size(request)} (GPU {device}; "
           f"{format_size(total)} total capacity; {format_size(allocated)} already allocated; "
           f"{format_size(free)} free; {allowed}{format_size(reserved)} reserved in total by PyTorch)")
    new = (f"CUDA out of memory. Tried to allocate {format_size(request)}. GPU {device} has a total "
           f"capacity of {format_size(total)} of which {format_size(free)} is free. Including non-PyTorch "
           f"memory, this process has {format_size(reserved + 600 * MiB)} memory in use. {allowed}Of the "
           f"allocated memory {format_size(allocated)} is allocated by PyTorch, and "
           f"{format_size(reserved - allocated)} is reserved by PyTorch but unallocated.")
    a, b = parse_oom(old), parse_oom(new)
    assert (a.era, b.era) == ("pre-2.1", "2.1+")
    for name in ("device", "requested", "total", "free", "allowed", "allocated"):
        assert getattr(a, name) == getattr(b, name), name
    # reserved and its unallocated part: printed in one era, a difference in the other
    for name in ("reserved", "reserved_unallocated"):
        assert abs(getattr(a, name) - getattr(b, name)) <= 0.01 * GiB, name
    assert abs(b.reserved_unallocated - (reserved - allocated)) <= 0.005 * GiB
    assert explain_oom(old).cause == explain_oom(new).cause == "fragmentation"  # 9 GiB cached, 2 asked


def test_a_memory_fraction_that_refused_what_the_card_had():
    """set_per_process_memory_fraction: the message adds "X allowed; " (both eras)."""
    msg = ("CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 79.19 GiB of "
           "which 60.00 GiB is free. Including non-PyTorch memory, this process has 19.50 GiB memory in "
           "use. 19.00 GiB allowed; Of the allocated memory 18.60 GiB is allocated by PyTorch, and "
           "300.00 MiB is reserved by PyTorch but unallocated.")
    m = parse_oom(msg)
    assert m.allowed == size("19.00 GiB")
    e = explain_oom(msg)
    assert e.cause == "memory fraction" and "60.00 GiB" in e.advice[0]


def test_other_processes_on_the_card():
    m = parse_oom(OTHERS)
    assert len(m.other_processes) == 15 and m.other_bytes == 15 * size("1.19 GiB")
    assert m.process == size("13.82 GiB")
    e = explain_oom(OTHERS)
    assert e.cause == "other processes"
    assert any("set_device" in a for a in e.advice)  # 15 equal small contexts: one per rank


def test_in_a_container_this_process_is_listed_under_another_pid():
    msg = ("CUDA out of memory. Tried to allocate 448.00 MiB. GPU 1 has a total capacty of 79.10 GiB of "
           "which 364.31 MiB is free. Process 175080 has 1.46 GiB memory in use. Process 175356 has "
           "77.26 GiB memory in use. Of the allocated memory 72.12 GiB is allocated by PyTorch, and "
           "3.78 GiB is reserved by PyTorch but unallocated.")
    e = explain_oom(msg)
    assert any("175356" in line and "this one" in line for line in e.lines)
    # not the 1.46 GiB neighbour: live tensors (72 GiB of 79); the 3.78 GiB cache (5% of it)
    # would serve this request with expandable segments, not the next
    assert e.cause == "live tensors"
    assert any("expandable_segments" in a for a in e.advice)


def test_host_allocator_messages():
    m = parse_oom(HOST)
    assert (m.kind, m.requested, m.errno, m.error_text) == ("host", 132426121216, 12, "Cannot allocate memory")
    assert parse_oom(HOST_WINDOWS).requested == 5077901088
    assert explain_oom(HOST).cause == "host memory"
    assert read_oom(HOST) == {"requested": 132426121216}


def test_deepspeed_launcher_killed_by_the_host():
    m = parse_oom(DEEPSPEED_KILLED)
    assert (m.kind, m.return_code) == ("deepspeed", -9)
    # DeepSpeed's "GB" is bytes / 1024**3 (runtime/utils.py see_memory_usage)
    assert (m.ds_allocated, m.ds_reserved, m.ds_max_reserved) == (int(11.76 * GiB), int(11.77 * GiB), 12 * GiB)
    assert (m.host_used, m.host_percent) == (int(28.43 * GiB), 22.6)
    e = explain_oom(DEEPSPEED_KILLED)
    assert e.cause == "host killed" and "host RAM" in e.advice[0]


def test_deepspeed_zero3_gathering_parameters():
    m = parse_oom(DEEPSPEED_GATHER)
    assert m.zero3_gather and m.hint == "max_split_size_mb"
    assert m.reserved_unallocated == size("30.67 GiB") - size("30.25 GiB")
    e = explain_oom(DEEPSPEED_GATHER)
    assert e.cause == "live tensors"
    assert any("stage3_max_live_parameters" in a for a in e.advice)


def test_nccl_and_the_cuda_runtime():
    assert explain_oom(NCCL).cause == "nccl buffers"
    assert explain_oom(RUNTIME).cause == "outside the allocator"
    with pytest.raises(InputError, match="not an out-of-memory message"):
        parse_oom(NCCL_NOT_OOM)


def test_a_log_with_one_message_per_rank_reads_the_last():
    log = "\n".join(f"[rank{r}]: " + PRE_21.replace("2.87 GiB", f"{r + 1}.00 GiB") for r in range(4))
    assert parse_oom(log).requested == 4 * GiB


def test_the_last_traceback_of_a_notebook(monkeypatch):
    try:
        raise RuntimeError(POST_21)
    except RuntimeError as e:
        err = e
    monkeypatch.setattr(sys, "last_exc", err, raising=False)
    monkeypatch.setattr(sys, "last_value", err, raising=False)
    assert explain_last().message.requested == size("22.00 MiB")
    monkeypatch.setattr(sys, "last_exc", None, raising=False)
    monkeypatch.setattr(sys, "last_value", None, raising=False)
    with pytest.raises(InputError, match="no exception"):
        explain_last()


def test_cli_reads_a_file_and_stdin(tmp_path, capsys, monkeypatch):
    path = tmp_path / "trace.txt"
    path.write_text(DEEPSPEED_GATHER)
    assert cli.main(["oom", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cause"] == "live tensors" and out["message"]["requested"] == 512 * MiB
    monkeypatch.setattr(sys, "stdin", io.StringIO(PRE_21))
    assert cli.main(["oom"]) == 0
    assert "fragmentation" in capsys.readouterr().out
    monkeypatch.setattr(sys, "stdin", io.StringIO("ValueError: shapes do not match"))
    assert cli.main(["oom", "-"]) == 2
    assert cli.main(["oom", str(tmp_path / "missing.txt")]) == 2
