"""The advisor's fastest fit (memlab.plan_search): candidates listed with seconds, the fastest
that fits recommended, no offload where a plan without it fits."""
from __future__ import annotations

import json

from memlab.advisor import advise
from memlab.cli import main


def test_llama_7b_on_8_a100_does_not_offload(capsys):
    assert main(["advise", "--model", "llama-7b", "--gpu", "A100-80GB", "--world-size", "8", "--seq", "4096",
                 "--batch", "2", "--no-simulate", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    fits = [c for c in d["candidates"] if c["fits"]]
    assert any(c["plan"]["offload"] == "none" for c in fits)
    best = d["recommendation"]
    assert best["plan"]["offload"] == "none" and best["fits"]
    assert best["seconds"] == min(c["seconds"] for c in fits if not c["changes_training"])  # the fastest exact fit
    assert {"plan", "peak_bytes", "fits", "seconds"} <= set(d["candidates"][0])
    assert "fits at" in d["why"]
    degrees = {(c["plan"]["tensor_parallel"], c["plan"]["pipeline_parallel"]) for c in d["candidates"]}
    assert all(8 % (t * p) == 0 for t, p in degrees) and (8, 1) in degrees and (1, 2) in degrees
    # every plan trains the run's global batch, 2 sequences x 8 GPUs: its seconds are for the same tokens
    for c in d["candidates"]:
        p = c["plan"]
        assert p["batch"] * 8 // (p["tensor_parallel"] * p["pipeline_parallel"]) == 16, c["describe"]


def test_one_small_card_must_offload_and_says_so():
    a = advise("gpt2-xl", "T4-16GB", seq=1024, batch=1, simulate=False)
    best = a.search.best
    assert best is not None and best.fits
    no_offload = [c for c in a.search.candidates if c.fits and c.plan["offload"] == "none"]
    assert (best.plan["offload"] != "none") == (not no_offload)


def test_a_bare_size_has_no_search():
    assert advise("tiny", "200MiB", seq=64, batch=2, simulate=False, target="cpu").search is None


def test_plans_that_change_the_training_are_listed_and_flagged():
    from memlab.plan_search import search_plans
    from memlab.units import GiB
    s = search_plans("llama-3-8b", "H100-80GB", 1, 4096, 1, usable_bytes=76 * GiB)
    kinds = {(c.plan["precision"], c.plan["optimizer_state"], c.plan["lora"]): c for c in s.candidates}
    changed = [kinds[("pure-bf16", "adamw", None)], kinds[("bf16", "adamw-8bit", None)], kinds[("bf16", "adamw", 16)]]
    assert all(c.changes_training and c.gives_up for c in changed)
    assert any(c.plan["loss"] == "chunked" and not c.changes_training for c in s.candidates)
    # one H100 holds no exact full fine-tuning of 8B without the host (16 bytes a parameter
    # = 128 GB of states): the recommendation offloads, and says what LoRA would cost instead
    assert not s.best.changes_training and s.best.plan["offload"] != "none"
    lora = min((c for c in s.candidates if c.plan["lora"] and c.fits), key=lambda c: c.seconds)
    assert lora.seconds < s.best.seconds and "changing the training" in s.why
