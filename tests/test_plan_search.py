"""The advisor's fastest fit (memlab.planning.plan_search): candidates listed with seconds, the fastest
that fits recommended, no offload where a plan without it fits."""
from __future__ import annotations

import json

from memlab.app.cli import main
from memlab.models.gpt_unet import get_config
from memlab.planning.advisor import advise


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


#: GPT-2 XL (Radford et al. 2019: 48 layers, d 1600, 1024 positions, 50257 tokens) counted
#: from its architecture: tied embeddings, per block two LayerNorms, c_attn, c_proj and the
#: 4d MLP with biases, and the final LayerNorm
D, L = 1600, 48
GPT2_XL = 50257 * D + 1024 * D + L * (2 * 2 * D + (3 * D * D + 3 * D) + (D * D + D)
                                      + (4 * D * D + 4 * D) + (4 * D * D + D)) + 2 * D


def test_one_small_card_must_offload_and_says_so():
    """GPT-2 XL on one T4: fp32 AdamW keeps 16 bytes a parameter (weights, gradients, two
    moments) = 24.9 GB on a 15360 MiB card, and one GPU's ZeRO shards nothing: no exact plan
    fits without offload, so the recommendation offloads, and says why."""
    assert GPT2_XL == 1_557_611_200
    t4 = 15360 * 2**20
    a = advise("gpt2-xl", "T4-16GB", seq=1024, batch=1, simulate=False)
    exact = [c for c in a.search.candidates if not c.changes_training]
    on_gpu = [c for c in exact if c.plan["offload"] == "none"]
    assert on_gpu and not any(c.fits for c in on_gpu)
    # each holds at least the 16 bytes a parameter (fp16 as well: its fp32 master and moments
    # plus 16-bit weights and gradients), and the peak is the states plus little
    assert 16 * GPT2_XL > t4
    for c in on_gpu:
        if c.plan.get("optimizer_in_backward"):  # no moment holds every gradient: weights and moments
            assert 12 * GPT2_XL <= c.peak_bytes < 16 * GPT2_XL, c.describe()
            continue
        assert 16 * GPT2_XL <= c.peak_bytes <= 1.05 * 16 * GPT2_XL, c.describe()
    best = a.search.best
    assert best.fits and best.plan["offload"] != "none" and not best.changes_training
    # what stays on the GPU: at least the fp32 weights; the moments (8 bytes a parameter) are on the host
    assert 4 * GPT2_XL <= best.peak_bytes < t4 and best.host_bytes >= 8 * GPT2_XL
    assert "no plan without offload fits" in a.search.why


def test_a_bare_size_has_no_search():
    assert advise("tiny", "200MiB", seq=64, batch=2, simulate=False, target="cpu").search is None


def test_plans_that_change_the_training_are_listed_and_flagged():
    from memlab.core.units import GiB
    from memlab.planning.plan_search import search_plans
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


def test_todays_techniques_are_candidates_with_memory_and_time(capsys):
    """Issue 39: the op-level checkpoint policy and the optimizer step in backward are plans,
    each with its peak and seconds. The step in backward makes the same update with the same
    FLOPs (its seconds are its twin's) and never holds more; where the gradients are at the peak
    (LLaMA-7B, fp32, full checkpointing, one sequence of 512) it saves the fp32 gradients
    (4 bytes a parameter) less at most two of the largest (the embedding's, 32000 x 4096)."""
    assert main(["advise", "--model", "llama-7b", "--gpu", "A100-80GB", "--seq", "512",
                 "--batch", "1", "--no-simulate", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    op = [c for c in d["candidates"] if c["plan"]["checkpointing"] == "op"]
    fused = [c for c in d["candidates"] if c["plan"].get("optimizer_in_backward")]
    assert op and fused and all(c["seconds"] > 0 and c["peak_bytes"] > 0 for c in op + fused)
    twins = {}
    for c in fused:
        twin = next(t for t in d["candidates"] if t["plan"] == {**c["plan"], "optimizer_in_backward": False})
        assert c["seconds"] == twin["seconds"] and c["peak_bytes"] <= twin["peak_bytes"], c["describe"]
        assert "optimizer step in backward" in c["describe"]
        twins[(c["plan"]["precision"], c["plan"]["checkpointing"])] = twin["peak_bytes"] - c["peak_bytes"]
    params, largest = get_config("llama-7b").num_params(), 32000 * 4096 * 4
    assert 4 * params - 2 * largest <= twins[("fp32", "full")] <= 4 * params


#: Llama 3.1 8B's parameters as its model card counts them (8.03B); fp32 AdamW holds 16 bytes
#: of each (weights, gradients, two moments: Rajbhandari et al. 2020, sec. 3.1)
LLAMA_8B = 8_030_261_248


def test_a_decoder_is_searched_in_its_own_terms(capsys):
    """A Hugging Face config is searched as its class runs (issue 36): whole-layer checkpointing
    only, its tensor parallelism without offload (what estimate_run counts), and each plan's
    peak is the estimate ``memlab estimate --hf-config`` gives of the same flags."""
    from memlab.core.units import GiB
    from memlab.hf.estimate import estimate_hf
    from memlab.hf.shape import decoder_shape
    from memlab.planning.plan_search import search_plans

    s = decoder_shape("llama-3.1-8b")
    assert s.num_params() == LLAMA_8B
    out = search_plans(s, "H100-80GB", 8, 4096, 1, usable_bytes=76 * GiB)
    plans = [c.plan for c in out.candidates]
    assert {p["checkpointing"] for p in plans} == {"none", "full"}
    assert not [p for p in plans if p["tensor_parallel"] > 1 and p["offload"] != "none"]
    assert {p["tensor_parallel"] for p in plans} >= {1, 2, 8} and {p["loss"] for p in plans} == {"transformers",
                                                                                                  "chunked"}
    for c in out.candidates[:40]:
        p = c.plan
        if p["tensor_parallel"] * p["pipeline_parallel"] > 1 or p["lora"] or p["optimizer_in_backward"]:
            continue
        flags = dict(seq=4096, batch=p["batch"], precision=p["precision"], checkpointing=p["checkpointing"],
                     micro_batches=p["micro_batches"], zero=p["zero"], offload=p["offload"], world_size=8,
                     loss=p["loss"], optimizer=p["optimizer_state"], card="H100-80GB")
        assert c.peak_bytes == estimate_hf("llama-3.1-8b", **flags).peak_bytes, c.describe()
    assert out.best is not None and out.best.fits and not out.best.changes_training


def test_advise_on_a_desktop_keeps_to_its_host_and_falls_back_to_lora(capsys):
    """Issue 36's desktop: Llama 3.1 8B on one RTX 4090 with 64 GiB of host memory. A full
    fine-tune's states are 16 bytes a parameter, 128.5 GB: more than the card and the host
    together (24 + 64 GiB = 94.5 GB), so no exact plan fits and the fastest fit trains LoRA;
    with 256 GiB of host an offloading plan keeps every weight trainable."""
    assert 16 * LLAMA_8B > (24 + 64) * 2**30
    assert main(["advise", "--hf-config", "llama-3.1-8b", "--gpu", "RTX4090-24GB", "--seq", "2048", "--batch", "2",
                 "--host-memory", "64GiB", "--no-simulate", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    best = d["recommendation"]
    assert best["changes_training"] and best["plan"]["lora"] and best["host_bytes"] <= 64 * 2**30
    assert "of host memory (this host: 64.00 GiB) it would be bf16" in d["why"] and "offload" in d["why"]
    assert not [c for c in d["candidates"] if c["fits"] and c["host_bytes"] > 64 * 2**30]
    assert main(["advise", "--hf-config", "llama-3.1-8b", "--gpu", "RTX4090-24GB", "--seq", "2048", "--batch", "2",
                 "--host-memory", "256GiB", "--no-simulate", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["recommendation"]
    assert not best["changes_training"] and best["plan"]["offload"] != "none"
    assert 16 * LLAMA_8B - 24 * 2**30 < best["host_bytes"] <= 256 * 2**30
