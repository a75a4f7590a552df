"""The OOM-now ladder of Llama-3.1-8B on a 24, a 48 and an 80 GB card.

Expected numbers: the parameters of the real class counted on the meta device, LoRA's
``r (in + out)`` per adapted Linear (Hu et al. 2021, sec. 4.1; peft's count) from the
config's own fields, a packing worked by hand, and the chunked loss's bytes measured by
memlab's tracker with the head frozen and trainable.
"""
import gc
import json
import math
from dataclasses import replace

import pytest
import torch
from hf_gpt_mapping import gpt_config, step_config

from memlab.core.cards import card_speeds
from memlab.core.errors import InputError
from memlab.hf import config as hf
from memlab.lenses.estimate import chunked_loss_moments
from memlab.models.chunked_loss import linear_cross_entropy
from memlab.models.gpt_unet import GPTConfig
from memlab.planning.oom_ladder import RUNGS, oom_ladder, packing_gain
from memlab.time.step_time import CPU_ADAM_PARAMS_PER_S
from memlab.tracking.tracker import MemoryTracker

CONFIG = "llama-3.1-8b"
CARDS = ("RTX4090-24GB", "L40S-48GB", "A100-80GB")
ADAPTERS = [r.key for r in RUNGS if r.track == "adapters"]


@pytest.fixture(scope="module")
def ladder():
    return oom_ladder(CONFIG, CARDS, seq=4096, batch=4, lora_rank=16)


def _fields() -> dict:
    from importlib import resources
    return json.loads(resources.files("memlab").joinpath("data", "hf_configs", f"{CONFIG}.json").read_text())


def test_pure_bf16_rung_holds_8_bytes_per_parameter_of_the_real_model(ladder):
    """Pure bf16 with AdamW: 2 (weights) + 2 (gradients, all there: accumulation) + 2 + 2
    (moments in the weights' dtype) bytes per parameter of LlamaForCausalLM on the meta device."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf.hf_config(CONFIG))
    n = sum(p.numel() for p in model.parameters())
    for card in ladder.cards:
        r = card.result("pure-bf16")
        assert r.trainable == n
        cats = r.report.by_category
        assert cats["parameters"] + cats["gradients"] + cats["optimizer"] == 8 * n


def test_the_ladder_reads_the_real_class_and_its_upcast_loss(ladder):
    """Up to checkpointing the peak is the loss's (transformers' ``logits.float()`` and its
    log-softmax's backward, 128256 words a token); the chunked loss never makes them, and saves at
    least the fp32 log-softmax's gradient pair of the peak: 8 bytes a token and word."""
    t, v = 4096, _fields()["vocab_size"]  # one sequence a micro-batch from rung 1 on
    card = ladder.cards[0]
    ckpt, chunked = card.result("checkpointing"), card.result("chunked-loss")
    assert ckpt.report.notes[0].startswith(("peak moment: loss forward", "peak moment: log-softmax backward"))
    assert "log-softmax" not in chunked.report.notes[0] and "loss forward" not in chunked.report.notes[0]
    assert ckpt.peak_bytes - chunked.peak_bytes >= 8 * t * v


def test_lora_rung_trains_r_times_in_plus_out_of_every_projection(ladder):
    f = _fields()
    d, L, r = f["hidden_size"], f["num_hidden_layers"], 16
    hd = d // f["num_attention_heads"]
    q, kv, ffn = d, f["num_key_value_heads"] * hd, f["intermediate_size"]
    per_layer = (d + q) + 2 * (d + kv) + (q + d) + 2 * (d + ffn) + (ffn + d)
    assert r * per_layer * L == 41_943_040  # peft's "trainable params" for r=16 on all projections
    for card in ladder.cards:
        for key in ("lora", "qlora", "packing"):
            assert card.result(key).trainable == r * per_layer * L


def test_each_rung_lowers_the_peak_and_the_bigger_card_fits_sooner(ladder):
    for card in ladder.cards:
        peaks = [card.result(k).peak_bytes for k in ADAPTERS]
        assert all(b <= a for a, b in zip(peaks, peaks[1:], strict=False)), peaks
        assert peaks[-1] < peaks[0] / 20
        assert card.result("offload").peak_bytes <= card.result("zero-3").peak_bytes
        for r in card.results:
            assert r.fits == (r.peak_bytes <= card.card.memory)
    first = {c.card.name: RUNGS.index(c.first_fit().rung) for c in ladder.cards}
    assert first["A100-80GB"] < first["RTX4090-24GB"]
    assert first["A100-80GB"] <= first["L40S-48GB"] <= first["RTX4090-24GB"]
    # sharding the full fine-tune needs more ranks on the smaller card
    ranks = [c.result("zero-3").world_size for c in ladder.cards]
    assert ranks == sorted(ranks, reverse=True) and ranks[0] > ranks[-1]
    assert "first rung that fits" in ladder.table()


def test_packing_gain_worked_by_hand():
    # rows of 4096: padded, one sample a row (7 rows); packed first-fit decreasing:
    # [4096], [2048, 2048], [1024 x 4] (3 rows)
    g = packing_gain([4096, 2048, 2048, 1024, 1024, 1024, 1024], 4096)
    assert (g.rows_padded, g.rows_packed, g.tokens) == (7, 3, 12288)
    assert g.gain == pytest.approx(7 / 3)
    assert g.padding_fraction == pytest.approx(1 - 12288 / (7 * 4096))


def test_packing_keeps_the_peak_and_carries_more_tokens(ladder):
    g = ladder.packing
    for card in ladder.cards:
        qlora, packed = card.result("qlora"), card.result("packing")
        assert packed.peak_bytes == qlora.peak_bytes
        assert packed.tokens / qlora.tokens == pytest.approx(g.gain)
        assert packed.tokens <= ladder.batch * ladder.seq  # never more real tokens than slots


def test_time_costs_checkpointing_and_offload(ladder):
    for card in ladder.cards:
        acc, ckpt = card.result("accumulation"), card.result("checkpointing")
        base = card.result("baseline").seconds
        # the same FLOPs in smaller pieces; each micro-batch casts the weights to bf16 again and,
        # from the second on, adds its gradients into .grad: 6 + 6 + 12 bytes a parameter more
        extra = (4 - 1) * (6 + 6 + 12) * acc.trainable / card_speeds(card.card.name).hbm  # batch 4, over HBM
        assert 0 < acc.seconds - base <= extra
        assert ckpt.seconds > acc.seconds                      # the forward re-run
        off = card.result("offload")
        # the host's Adam steps this rank's share of the parameters
        assert off.seconds >= off.trainable / off.world_size / CPU_ADAM_PARAMS_PER_S
        assert off.host_bytes > 0


def _loss_backward_peak(head_grad: bool) -> int:
    """The tracker's peak over the chunked loss's backward, less what was live before it."""
    torch.manual_seed(0)
    t, d, v = 256, 64, 4000
    h = torch.randn(t, d, requires_grad=True)
    w = torch.randn(v, d, requires_grad=head_grad)
    y = torch.randint(0, v, (t,))
    with MemoryTracker() as mt:
        loss = linear_cross_entropy(h, w, y, chunk_size=64)
        gc.collect()
        before = mt.live_bytes
        mt.reset_peak()
        loss.backward()
        peak = mt.peak_bytes
    return peak - before


@pytest.mark.parametrize("head_grad", [True, False])
def test_chunked_loss_backward_estimate_equals_the_measured_bytes(head_grad):
    """Measured by the tracker over the loss's backward: with a frozen head (LoRA) no V x d
    gradient and no V x d product exist; the estimate's moment holds what was measured (up to
    the loss's 8-byte scalars)."""
    t, d, v = 256, 64, 4000
    cfg = GPTConfig(n_layer=1, n_head=4, d_model=d, vocab_size=v, block_size=t, loss="chunked", loss_chunk=64)
    est = chunked_loss_moments(cfg, t, "fp32", "cpu", head_grad=head_grad)["chunked loss backward"]
    assert abs(sum(est.values()) - _loss_backward_peak(head_grad)) <= 16
    assert (est["gradients"] == 0) == (not head_grad)


@pytest.mark.parametrize("kw, needle", [(dict(cards=("RTX5090-32GB",)), "unknown GPU preset"),
                                        (dict(shard_ranks=(1,)), "shard_ranks"),
                                        (dict(batch=0), "batch=0"),
                                        (dict(config="no-such-model"), "no-such-model")])
def test_bad_input_names_the_value(kw, needle):
    with pytest.raises(InputError, match=needle):
        oom_ladder(**kw)


def test_the_table_has_a_row_per_rung_and_a_column_per_card(ladder):
    lines = ladder.table().splitlines()
    assert len(lines) == 2 + len(RUNGS) + 1
    assert all(c in lines[0] for c in CARDS)
    assert math.isclose(float(lines[2].split("|")[2].split()[0]), ladder.cards[0].results[0].peak_gib, abs_tol=0.05)


def test_lora_with_the_chunked_loss_holds_only_the_adapters_gradients():
    """The head is frozen under LoRA: at the chunked loss's backward the gradients are the
    adapters' alone (2 bytes each in pure bf16, all there: accumulation), no V x d head gradient."""
    from memlab.step.fine_tune_config import LLAMA_TARGETS
    from memlab.techniques.finetune import estimate_finetune
    step = replace(step_config(CONFIG, seq=4096, batch=4, precision="pure-bf16", checkpointing="full"),
                   micro_batches=4)
    step = replace(step, model=replace(step.model_config, loss="chunked"))
    rep = estimate_finetune(step, lora=(16, LLAMA_TARGETS), budget="RTX4090-24GB", target="cuda")
    assert rep.by_category["gradients"] == 2 * 41_943_040


#: torchtune's README at a9ea6d5 ("Memory and training speed"): Llama 3.1 8B full fine-tune on
#: one RTX 4090, batch 2, packed to 2048 tokens, "Peak Memory per GPU" 18.9 GiB; its recipe is
#: recipes/configs/llama3_1/8B_full_single_device.yaml (59dc1f4): PagedAdamW8bit,
#: optimizer_in_bwd, activation checkpointing, bf16, no accumulation
TORCHTUNE_8B_FULL_4090 = 18.9 * 2**30


def test_a_full_fine_tune_fits_a_24gb_card_as_torchtunes_recipe_does(ladder):
    small = oom_ladder(CONFIG, ("RTX4090-24GB",), seq=2048, batch=2).cards[0]
    rung = small.result("in-backward")
    assert small.first_fit("full") is rung and rung.trainable == gpt_config(CONFIG).num_params()
    assert abs(rung.peak_bytes - TORCHTUNE_8B_FULL_4090) <= 0.10 * TORCHTUNE_8B_FULL_4090
    # paged 8-bit state: two uint8 moments per element of each tensor of 1e5 elements or more in unified
    # memory (host bytes); the norms' state (4096 elements each) and the block maxima stay on the device
    numels = gpt_config(CONFIG).param_numels()
    unified = sum(2 * n for n in numels if n >= 100_000)
    assert 0 < rung.trainable - sum(n for n in numels if n >= 100_000) < 1e6  # the norms alone stay
    assert rung.host_bytes >= unified
    # at the ladder's own 4096 x 4 it still fits the 24 GB card, the first full rung that does
    assert ladder.cards[0].first_fit("full").rung.key == "in-backward"
