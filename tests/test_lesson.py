"""memlab.classroom.lesson: every lesson's GPU steps fit every card under the guard, with the card's own
estimate; the precision is one the card runs; on CPU the lessons keep their CPU sizes."""
from types import SimpleNamespace

import pytest
import torch

from memlab.classroom.lesson import CONTEXT_BYTES, LESSONS, plan, setup
from memlab.core.cards import CARDS, get_card
from memlab.lenses import guard

MiB, GiB = 2**20, 2**30
ALL = sorted(LESSONS) + ["99"]  # "99": a lesson without its own table gets the base
RANK = ("09", "10", "12", "13")  # lessons whose ranks run the tiny GPT: one GPU each, else the CPU


def patch_gpu(monkeypatch, card, *, gpus=1):
    """A machine with ``card`` (torch's view of it): a fresh process, nothing cached."""
    props = SimpleNamespace(name=card.device_name, total_memory=card.memory,
                            major=card.capability[0], minor=card.capability[1])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (card.memory - CONTEXT_BYTES, card.memory))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 0)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i=0: 1.0)
    # the UNet estimate's shape walk runs a tracker, which reads the allocator when CUDA is on
    for fn in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, fn, lambda *a, **k: None)
    for fn in ("max_memory_allocated", "max_memory_reserved"):
        monkeypatch.setattr(torch.cuda, fn, lambda *a, **k: 0)
    monkeypatch.delenv("MEMLAB_CARD", raising=False)


@pytest.mark.parametrize("name", [n for n in CARDS if n != "2xT4-16GB"])
def test_every_lesson_fits_every_card_under_the_guard(name, monkeypatch):
    """The guard itself (memory_needs, on a patched GPU of this card, with what a fresh
    process has free) lets every GPU step of every lesson through."""
    card = get_card(name)
    patch_gpu(monkeypatch, card)
    for number in ALL:
        chosen = plan(number, card)
        assert chosen.gpu, number
        # lessons measured on the GPU have GPU steps (08 and 15 use the CPU tracker anywhere, 03
        # a 4-layer Llama of its own; one GPU is fewer than the rank lessons' two ranks, which
        # then run on the CPU)
        assert bool(chosen.steps) == (number not in ("03", "08", "15", *RANK)), number
        if number in RANK:
            assert chosen.sizes == plan(number, None).sizes and chosen["ranks"] == "cpu", number
        assert chosen.precision in card.precisions()
        assert chosen.precision == ("bf16" if card.capability >= (8, 0) else "fp16")
        assert chosen.scaler == (card.capability < (8, 0))
        for p in chosen.sizes.get("precisions", []):
            assert p in card.precisions(), (number, p)
        for s in chosen.steps:
            (need,) = guard.memory_needs(s.step, "cuda", s.budget)
            assert need.fits, (name, number, s.label, need)
            assert guard.target_for("cuda").card.capability == card.capability
            assert s.step.precision in card.precisions(), (name, number, s.label)


def test_rank_lessons_size_their_ranks_for_one_gpu_each_on_two_gpus(monkeypatch):
    """2 x T4: the rank lessons' ranks run on NCCL, one T4 each (place_ranks), at their GPU
    sizes, and every rank's step fits one T4 under the guard."""
    from memlab.core.hardware import place_ranks
    card = get_card("2xT4-16GB")
    patch_gpu(monkeypatch, card, gpus=2)
    assert place_ranks(2, gpus=card.gpus).device_type == "cuda"
    for number in RANK:
        chosen = plan(number, card)
        assert chosen["ranks"] == "cuda" and chosen.steps, number
        assert chosen.base.model_config.name == "tiny"
        assert chosen.base.seq >= plan(number, None).base.seq, number
        for s in chosen.steps:
            (need,) = guard.memory_needs(s.step, "cuda", s.budget)
            assert need.fits, (number, s.label, need)
    assert plan("12", card).base.seq == 1024 and plan("10", card).base.batch == 8


def test_small_cards_get_smaller_steps_than_large_ones():
    t4, h200 = plan("05", get_card("T4-16GB")), plan("05", get_card("H200-141GB"))
    assert max(t4["batches"]) < max(h200["batches"]) == 16
    assert plan("14", get_card("T4-16GB"))["real"]["gpu"].endswith("MiB")   # below a T4's own size
    assert plan("14", get_card("A100-40GB"))["real"]["gpu"] == "T4-16GB"
    assert plan("04", get_card("T4-16GB"))["precisions"] == ["fp32", "fp16"]
    # 11: the H200 reference's DeepSpeed step where it fits; a T4 (no bf16) trains in fp32
    h200_11, t4_11 = plan("11", get_card("H200-141GB"))["step"], plan("11", get_card("T4-16GB"))["step"]
    assert (h200_11.model_config.name, h200_11.seq, h200_11.batch, h200_11.precision) == ("gpt2-large", 1024, 4, "bf16")
    assert t4_11.precision == "fp32" and t4_11.model_config.num_params() < h200_11.model_config.num_params()


def test_on_cpu_the_lessons_keep_their_cpu_sizes(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    chosen = setup("04")
    line = capsys.readouterr().out
    assert "CPU" in line and "tiny seq 128 batch 4" in line and line.count("\n") == 1
    assert not chosen.gpu and chosen.device == "cpu" and chosen.steps == []
    assert chosen.base.model_config.name == "tiny" and chosen["batches"] == [1, 8]
    assert setup("06", quiet=True)["budget"] == "80MiB"
    assert setup("14", quiet=True)["real"] == dict(model="tiny", gpu="150MiB", seq=256, batch=8)
    # the sizes the newly wired notebooks had on CPU: (seq, batch) of their measured steps
    was = {"07": (256, 2), "08": (128, 4), "09": (64, 2), "10": (128, 4), "12": (128, 8), "13": (128, 8),
           "15": (256, 4)}
    for number, (seq, batch) in was.items():
        b = setup(number, quiet=True).base
        assert (b.seq, b.batch, b.precision) == (seq, batch, "fp32"), number
    assert setup("07", quiet=True).base.model_config.vocab_size == 128256


def test_setup_rehearses_a_smaller_card(monkeypatch, capsys):
    h200 = get_card("H200-141GB")
    patch_gpu(monkeypatch, h200)
    monkeypatch.setenv("MEMLAB_CARD", "T4-16GB")
    calls = {}
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda f, d=0: calls.setdefault("fraction", f))
    monkeypatch.setattr(torch.backends.cuda, "enable_flash_sdp", lambda on: calls.setdefault("flash", on))
    chosen = setup("04")
    assert chosen.card.name == "T4-16GB" and chosen.card.rehearsal == "NVIDIA H200"
    assert chosen.precision == "fp16" and chosen.scaler
    assert calls == {"fraction": 15360 * MiB / h200.memory, "flash": False}
    assert "rehearsed on NVIDIA H200" in capsys.readouterr().out


WIRED = tuple(f"{n:02d}" for n in range(18))   # every lesson


@pytest.mark.parametrize("number", WIRED)
def test_each_sized_notebook_sets_up_its_own_lesson_right_after_the_imports(number):
    """The set-up cell is the second code cell and names the notebook's own number, so the
    sizes a notebook runs are the ones the fit test above checked."""
    import json
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
    (path,) = root.glob(f"{number}_*.ipynb")
    code = ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    assert "import memlab as ml" in code[0]
    assert code[1].startswith("from memlab.classroom import lesson\n")
    assert f'L = lesson.setup("{number}")' in code[1]
    assert number in LESSONS
