"""Real numbers shipped for machines that cannot produce them: the H200's DeepSpeed offload rows
(``memlab.lenses.reference.offload_reference``, lesson 11) and a real CUDA OOM message from a public
thread (``memlab.tracking.oom_messages.recorded_oom``, lesson 02)."""
import json
from importlib import resources

import pytest

from memlab.core.errors import InputError
from memlab.lenses.reference import offload_reference
from memlab.tracking.oom_messages import ROUNDING_BYTES, oom_balance, parse_oom, recorded_oom, recorded_oom_names

GiB, MiB = 2**30, 2**20
RAW = json.loads(resources.files("memlab").joinpath(
    "data", "reference", "NVIDIA-H200", "zero_offload_one_gpu.json").read_text())


def test_offload_reference_is_the_file_row_by_row():
    rows = offload_reference()
    assert [(r.zero, r.offload) for r in rows] == [(d["zero"], d["offload"]) for d in RAW]
    for r, d in zip(rows, RAW, strict=True):
        assert (r.device_peak_bytes, r.device_base_bytes, r.device_reserved_bytes) == (
            d["device_peak"], d["device_base"], d["device_reserved"])
        assert (r.rss_before_bytes, r.rss_after_bytes, r.step_seconds) == (
            d["rss_before"], d["rss_after"], d["step_seconds"])
        assert r.step().model_config.num_params() == d["num_params"]
    assert [r.label for r in rows][3] == "ZeRO-2 + offload optimizer"


def test_offload_reference_of_an_unrecorded_gpu_names_the_recorded_ones():
    with pytest.raises(InputError, match="NVIDIA-H200"):
        offload_reference("T4-16GB")


def test_the_h200_offload_trade():
    """The trade lesson 11 states: the device peak falls, the host grows by at least the
    16 B/param DeepSpeed offloads (fp32 master, two moments, fp32 gradients: 4 + 8 + 4), the
    step slows (the H200: 17.49 -> 8.43 GiB, 5.5x)."""
    by = {(r.zero, r.offload): r for r in offload_reference()}
    z2, off = by[2, "none"], by[2, "optimizer"]
    assert off.device_peak_bytes < 0.5 * z2.device_peak_bytes
    assert off.rss_before_bytes - z2.rss_before_bytes >= 16 * off.num_params
    assert z2.device_base_bytes - off.device_base_bytes >= 0.9 * 12 * off.num_params  # master + moments left
    assert off.step_seconds / z2.step_seconds == pytest.approx(5.5, abs=0.05)


def test_the_shipped_oom_message_is_a_real_one_with_its_source():
    assert "a100-40gb-inference" in recorded_oom_names()
    rec = recorded_oom("a100-40gb-inference")
    assert rec.source.startswith("https://github.com/") and "A100" in rec.card
    assert rec.text.startswith("torch.OutOfMemoryError: CUDA out of memory.")  # no header line left in it
    m = rec.message
    # the figures as printed in the message, converted by hand (to the byte: parse_size truncates)
    got = (m.requested, m.total, m.free, m.process, m.allocated, m.reserved_unallocated)
    assert got == pytest.approx((80 * GiB, 39.50 * GiB, 25.24 * GiB, 14.25 * GiB, 12.87 * GiB, 912.01 * MiB), abs=1)
    assert m.hint == "expandable_segments"


def test_an_unknown_recorded_message_names_the_shipped_ones():
    with pytest.raises(InputError, match="a100-40gb-inference"):
        recorded_oom("h100")


def test_the_balance_of_the_a100_message():
    """total - free (14.26 GiB) is this process's 14.25 GiB to within the rounding of three
    printed figures; of it 12.87 GiB live tensors, 0.89 GiB cache, 0.49 GiB outside PyTorch."""
    b = oom_balance(recorded_oom().text)
    assert b.requested > b.free and not b.fits_with_cache
    assert abs(b.used - b.accounted) <= b.rounding == 3 * ROUNDING_BYTES
    assert b.non_pytorch == pytest.approx(14.25 * GiB - 12.87 * GiB - 912.01 * MiB, abs=3)
    assert b.short == pytest.approx(80 * GiB - 25.24 * GiB, abs=1)


def test_the_balance_counts_the_other_processes():
    """A message that lists another process: ``accounted`` includes it, or it would not add up."""
    msg = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 86.00 MiB. GPU 0 has a total "
           "capacity of 23.64 GiB of which 100.00 MiB is free. Process 7 has 14.00 GiB memory in use. "
           "Including non-PyTorch memory, this process has 9.54 GiB memory in use. Of the allocated memory "
           "8.50 GiB is allocated by PyTorch, and 40.00 MiB is reserved by PyTorch but unallocated.")
    b = oom_balance(msg)
    assert b.other_processes == 14 * GiB and b.rounding == 4 * ROUNDING_BYTES
    assert abs(b.used - b.accounted) <= b.rounding


def test_no_balance_from_a_format_without_this_process():
    old = ("CUDA out of memory. Tried to allocate 2.26 GiB (GPU 0; 6.00 GiB total capacity; 781.59 MiB "
           "already allocated; 3.03 GiB free; 1.24 GiB reserved in total by PyTorch)")
    with pytest.raises(InputError, match="process"):
        oom_balance(parse_oom(old))


def _lesson(name: str) -> str:
    from pathlib import Path
    nb = json.loads((Path(__file__).resolve().parents[1] / "notebooks" / name).read_text())
    return "".join("".join(c["source"]) for c in nb["cells"])


def test_lesson_11_states_the_h200_figures_of_the_reference():
    """Lesson 11's prose and summary, against the file: the peaks, the host growth, the 16
    B/param, the time ratio; the estimate's errors (within 1% on the device, 3% on the host)."""
    from memlab.lenses.estimate import estimate_step
    by = {(r.zero, r.offload): r for r in offload_reference()}
    z2, off = by[2, "none"], by[2, "optimizer"]
    text = " ".join(_lesson("11_offload.ipynb").split())
    grown = off.rss_before_bytes - z2.rss_before_bytes
    assert (f"from {z2.device_peak_bytes / GiB:.2f} to {off.device_peak_bytes / GiB:.2f} GiB" in text)
    assert f"grows by {grown / GiB:.1f} GiB" in text and f"({16 * off.num_params / GiB:.1f} GiB:" in text
    assert f"takes {off.step_seconds / z2.step_seconds:.1f}x as long" in text
    assert f"{off.num_params / 1e6:.0f}M fp32" in text
    est = estimate_step(off.step(), target="cuda")
    assert abs(est.host_bytes / grown - 1) < 0.03 and "host bytes within 3% of the growth" in text
    assert "within 1% of the allocator's on every DeepSpeed row" in text  # the check cell asserts it per row


def test_lesson_02_states_the_a100_messages_arithmetic():
    """Lesson 02's reading of the shipped message: the request twice the card, 912 MiB of cache,
    53.87 GiB short even with it; answers/02 exercise 4 says the same."""
    from pathlib import Path
    b, m = oom_balance(recorded_oom().text), recorded_oom().message
    text = " ".join(_lesson("02_baseline_oom.ipynb").split())
    assert round(m.requested / m.total, 1) == 2.0 and "the request alone is twice the card" in text
    assert f"The {m.reserved_unallocated / MiB:.0f} MiB of cache" in text
    still = b.requested - b.free - b.reserved_unallocated
    assert f"the request is {still / GiB:.2f} GiB short" in text
    answer = " ".join((Path(__file__).resolve().parents[1] / "course/answers/02_baseline_oom.md").read_text().split())
    assert f"**{still / GiB:.2f} GiB short**" in answer and f"{b.short / GiB:.2f} GiB" in answer
