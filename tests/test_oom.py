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
from pathlib import Path

import pytest

from memlab.app import cli
from memlab.core.errors import InputError
from memlab.core.units import fmt_bytes
from memlab.policy.caching_allocator import allocation_size, round_size
from memlab.tracking.oom_messages import (
    MPS_HIGH_WATERMARK_DEFAULT,
    ROUNDING_BYTES,
    explain_last,
    explain_oom,
    parse_oom,
    read_oom,
    segment_bytes,
)

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


# --------------------------------------------------------------------------------------
# Real messages from public threads (tests/data/oom_messages/*.txt): each file's header says
# where it comes from and what the thread says of its run; memlab's answer must agree.
# --------------------------------------------------------------------------------------
REAL = Path(__file__).parent / "data" / "oom_messages"


def _real(name: str) -> tuple[dict[str, str], str]:
    header, body = {}, []
    for line in (REAL / f"{name}.txt").read_text().splitlines():
        if not body and line.startswith("# "):
            key, _, value = line[2:].partition(":")
            header[key.strip()] = value.strip()
        else:
            body.append(line)
    return header, "\n".join(body)


REAL_NAMES = sorted(p.stem for p in REAL.glob("*.txt"))


def test_at_least_twenty_real_messages_with_provenance():
    assert len(REAL_NAMES) >= 20
    for name in REAL_NAMES:
        header, body = _real(name)
        assert header["source"].startswith("https://github.com/"), name
        assert header["says"] and body.strip(), name


@pytest.mark.parametrize("name", REAL_NAMES)
def test_a_real_message_is_explained_as_its_thread_says(name):
    """The cause the thread's own statement implies (``expect``), or a one-line refusal naming
    why (``refuse``); the card's size is the one the thread names (``card_gib``: the total the
    driver reports is at most that many GiB and at least 90% of it); NCCL's size is kept."""
    header, body = _real(name)
    if "refuse" in header:
        with pytest.raises(InputError, match=header["refuse"]) as info:
            explain_oom(body)
        assert "\n" not in str(info.value)
        return
    e = explain_oom(body)
    assert e.cause == header["expect"], f"{name}: {e.cause}\n{e}"
    m = e.message
    if "card_gib" in header:
        card = float(header["card_gib"]) * GiB
        assert 0.9 * card <= m.total <= card, (name, m.total / GiB)
    if "requested" in header:
        assert m.requested == int(header["requested"]) and fmt_bytes(m.requested) in str(e)
    if "torch" in header:
        assert m.torch_versions == header["torch"]
    if "mac_ram_gib" in header:
        # max allowed is 1.7 x recommendedMaxWorkingSetSize, a share of the Mac's RAM
        working = m.allowed / MPS_HIGH_WATERMARK_DEFAULT
        assert working < float(header["mac_ram_gib"]) * GiB <= 2 * working
        assert fmt_bytes(int(working)) in str(e)


def test_a_small_request_needs_a_20_mib_segment_so_6_mib_free_is_a_full_card():
    """github.com/MVIG-SJTU/AlphAction/issues/58: 2 MiB asked, 6 MiB free. A 1-10 MiB request
    with no cached block gets a kLargeBuffer (20 MiB) segment from cudaMalloc: the free 6 MiB
    could not serve it, so it is not memory 'taken outside the allocator'."""
    header, body = _real("alphaction-2mib-6mib-free")
    m = parse_oom(body)
    assert (m.requested, m.free, m.segment) == (2 * MiB, 6 * MiB, 20 * MiB)
    e = explain_oom(body)
    assert e.cause != "outside the allocator" and "20.00 MiB segment" in str(e)
    # the card's 3.79 GiB less the 6 MiB free and PyTorch's 666 MiB: held outside PyTorch
    assert abs(m.held_outside - (size("3.79 GiB") - 6 * MiB - 666 * MiB)) <= ROUNDING_BYTES


@pytest.mark.parametrize("request_bytes, segment", [
    (1, 2 * MiB), (512 * KiB, 2 * MiB), (MiB, 2 * MiB), (MiB + 1, 20 * MiB), (2 * MiB, 20 * MiB),
    (10 * MiB - 512, 20 * MiB), (10 * MiB - 1, 10 * MiB), (10 * MiB, 10 * MiB),
    (12 * MiB + 512 * KiB, 14 * MiB), (GiB + 1, GiB + 2 * MiB)])
def test_segment_sizes_are_the_caching_allocators(request_bytes, segment):
    """c10/cuda/CUDACachingAllocator.cpp get_allocation_size, in memlab's replay of it too."""
    assert segment_bytes(request_bytes) == segment
    assert allocation_size(round_size(request_bytes)) == segment


def test_allocated_above_the_card_is_windows_shared_memory():
    """github.com/richard-peng-xia/MMed-RAG/issues/38: 22.44 GiB allocated on a 4060 Ti 8GB."""
    header, body = _real("mmedrag-4060ti-8gb-wddm")
    e = explain_oom(body)
    assert e.message.beyond_card and e.cause == "shared GPU memory"
    assert "shared GPU memory" in str(e) and "8.00 GiB" in str(e)
    # no ceiling that exceeds the card is claimed of it
    assert "at most" not in str(e)


def test_the_card_gives_no_more_than_itself_on_an_8_gib_card():
    """github.com/YingqianWang/iPASSR/issues/9: 19.15 GiB reserved on an 8 GiB card, and a
    10.73 GiB request: larger than the card, and the reserved figure is shared memory."""
    header, body = _real("ipassr-8gb-wddm")
    e = explain_oom(body)
    assert e.cause == "request above the card"
    assert "19.15 GiB" not in " ".join(e.advice) and "shared GPU memory" in str(e)


def test_a_request_larger_than_the_card_is_not_live_tensors():
    header, body = _real("coser-a100-80gib-request")
    e = explain_oom(body)
    assert e.cause == "request above the card" and "larger than the whole card" in e.advice[0]


def test_other_processes_not_listed_are_the_card_minus_this_process_minus_free():
    """A 2.1+ message whose driver lists no process (WDDM), with this process's figure: what
    the card holds beyond this process and free belongs to others. The numbers are the
    MyGirlGPT message's (github.com/Synthintel0/MyGirlGPT/issues/11) with 10 GiB more card."""
    header, body = _real("mygirlgpt-4gb-full")
    bigger = body.replace("total capacty of 4.00 GiB", "total capacty of 14.00 GiB")
    m = parse_oom(bigger)
    assert abs(m.held_outside - (14 * GiB - size("41.56 MiB") - size("3.44 GiB"))) <= ROUNDING_BYTES
    e = explain_oom(bigger)
    assert e.cause == "other processes" and "in use by other processes" in e.advice[0]
    # the real 4 GiB card: 0.52 GiB outside, under a quarter of it: not blamed on others (the
    # thread says none ran), but still shown
    e = explain_oom(body)
    assert e.cause == "live tensors" and any("held outside this process" in line for line in e.lines)


def test_a_container_pid_is_the_smallest_entry_that_holds_the_cache():
    """github.com/vllm-project/vllm/issues/751: 50.52 and 28.19 GiB listed, 27.48 GiB PyTorch's:
    this process is the 28.19 GiB entry, the other holds 50.52 GiB."""
    header, body = _real("vllm-751-h100-other-process")
    e = explain_oom(body)
    assert any("477367" in line and "this one" in line for line in e.lines)
    assert "50.52 GiB" in e.advice[0]


def test_nccl_keeps_the_size_it_asked_for():
    header, body = _real("nccl-962-calloc")
    e = explain_oom(body)
    assert e.message.requested == 6291456 == 6 * MiB and "6.00 MiB" in e.lines[0]


def test_expandable_segments_by_torch_version():
    """Expandable segments arrived with pytorch/pytorch#96995 (April 2023): torch 2.1 has them,
    though its message ("capacty") still suggests max_split_size_mb; formats before 2.1 do not."""
    header, body = _real("mgfn-6gb-torch21-fragmentation")
    e = explain_oom(body)
    assert e.message.torch_versions == "2.1" and e.cause == "fragmentation"
    assert "expandable_segments:True" in e.advice[0] and "predates" not in e.advice[0]
    e = explain_oom(PRE_21)  # the same allocator state class, torch 1.5 to 2.0's format
    assert e.message.torch_versions == "1.5 to 2.0" and "predates expandable segments" in e.advice[0]
    assert parse_oom(POST_21).torch_versions == "2.2+"


def test_an_mps_message_is_read_and_explained():
    """aten/src/ATen/mps/MPSAllocator.mm's message; github.com/Comfy-Org/ComfyUI/issues/7440."""
    header, body = _real("mps-comfy-7440-other-allocations")
    m = parse_oom(body)
    assert (m.kind, m.allocated, m.other_allocations, m.allowed, m.requested, m.pool) == (
        "mps", size("9.57 GiB"), size("17.35 GiB"), size("27.20 GiB"), size("292.50 MiB"), "private")
    e = explain_oom(body)
    assert e.cause == "mps watermark" and "other allocations exceed" in str(e)
    # the older "GB"/"MB" labels are the same binary units
    assert parse_oom(_real("mps-surya-batch")[1]).requested == 896 * MiB


def test_cli_explains_an_mps_message(capsys):
    assert cli.main(["oom", str(REAL / "mps-pinokio-m1-16gb.txt")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("out of memory (mps): mps watermark") and "10.66 GiB" in out


def test_the_table_of_real_messages_agrees_with_every_thread():
    """tools/readers_table.py --oom: one row a message, every cause the one its thread implies."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import readers_table
    rows = readers_table.oom_rows()
    assert len(rows) == len(REAL_NAMES) >= 20
    assert [r.file for r in rows if not r.consistent] == []
