"""Single-device techniques: accumulation, fp16 loss scaling, finding the largest batch."""
from dataclasses import replace

import pytest

from memlab import GPTConfig, StepConfig, measure_step
from memlab.classroom.technique_table import CLAIMS, PIPELINE_MICRO_BATCHES, Row, Table, predicted_times
from memlab.core.cards import SPEEDS
from memlab.core.errors import InputError
from memlab.techniques.accumulation import accumulation_check
from memlab.techniques.max_batch import find_max_batch_search, predict_max_batch
from memlab.techniques.mixed_precision import FP16_TINY, fp16_underflow
from memlab.techniques.sweeps import step_flops, sweep
from memlab.time.elementwise import gpt_elementwise
from memlab.time.step_time import CALIBRATION_ENV

# smaller than ``tiny`` so that a batch search of ~8 real steps takes seconds
MICRO = GPTConfig(n_layer=2, n_head=2, d_model=64, vocab_size=256, block_size=256, name="micro")
SMALL = StepConfig(model=MICRO, seq=32, batch=4)


def test_accumulation_gives_the_big_batch_gradients():
    chk = accumulation_check(SMALL, 4)
    assert chk.same
    assert chk.max_abs_diff < 1e-5 * max(chk.max_grad, 1.0)


def test_accumulation_holds_one_micro_batch_of_activations():
    """4 micro-batches of a batch of 8: each forward keeps the activations of 2 samples.
    Every saved tensor is batch x (seq x ...), so that is a quarter of batch 8's (measured:
    0.2501; a graph kept alive across micro-batches would hold a half or more)."""
    one = measure_step(SMALL, seq=128, batch=8)
    four = measure_step(SMALL, seq=128, batch=8, micro_batches=4)
    assert four.by_category["activations"] == pytest.approx(one.by_category["activations"] / 4, rel=0.002)
    assert four.peak_bytes < one.peak_bytes


def test_accumulation_rejects_a_non_divisor():
    with pytest.raises(ValueError, match="divisor"):
        accumulation_check(SMALL, 3)


def test_fp16_underflow_and_loss_scaling():
    plain = fp16_underflow(None)
    scaled = fp16_underflow(2.0**16)
    assert plain.below_fp16 > 0.05          # the fp32 reference has gradients fp16 cannot hold
    assert plain.zero_fraction > 0.05       # ... and fp16 flushed them to zero
    assert plain.rel_error > 0.1
    assert scaled.zero_fraction == 0.0
    assert scaled.rel_error < 0.01
    assert FP16_TINY == 2.0**-24


def test_fp16_underflow_rejects_bad_scale():
    with pytest.raises(ValueError, match="loss_scale"):
        fp16_underflow(-1.0)


def test_search_and_prediction_agree():
    budget = 8 * 2**20
    found = find_max_batch_search(SMALL, budget, max_batch=64)
    pred = predict_max_batch(SMALL, budget)
    assert found.batch >= 1
    tried = {b: fits for b, fits, _ in found.trials}
    assert tried[found.batch] and tried.get(found.batch + 1) is False
    assert abs(pred.batch - found.batch) <= 1
    assert len(pred.calibration) == 2 and found.n_trials > 2
    # the per-op lines predict the measured peak at the found batch
    peak = measure_step(SMALL, batch=found.batch).peak_bytes
    assert pred.peak_at(found.batch) == pytest.approx(peak, rel=0.01)


def test_batch_finders_need_a_budget():
    with pytest.raises(ValueError, match="budget"):
        find_max_batch_search(SMALL, None)
    with pytest.raises(ValueError, match="calibrate"):
        predict_max_batch(SMALL, "1GiB", calibrate=(4, 2))


def test_sweep_grows_activations_with_seq():
    reports = sweep(replace(SMALL, batch=8), "seq", [64, 128], progress=False)
    acts = [r.by_category["activations"] for r in reports]
    assert acts[1] > 1.8 * acts[0]
    with pytest.raises(ValueError, match="not a StepConfig field"):
        sweep(SMALL, "sequence", [1])
    with pytest.raises(ValueError, match="lens"):
        sweep(SMALL, "seq", [32], lens="guess")


def _flops_by_shapes(step: StepConfig) -> tuple[int, int]:
    """MICRO's step from its shapes: (forward + backward, full checkpointing's recompute).

    A Linear costs 2 x tokens x in x out forward and twice that backward; the fused attention
    core costs what torch's own ``sdpa_flop_count`` and ``sdpa_backward_flop_count`` give it,
    4 b s^2 d forward and 10 b s^2 d backward (the backward recomputes q k^T). Full
    checkpointing runs each block's forward again in backward, but non-reentrant ``checkpoint``
    stops recomputing once it has every tensor backward saved (its early stop): a block's last
    Linear (``mlp.out``, whose output nothing saves) is not run again, and the LM head is
    outside the blocks."""
    b, s, t = step.batch, step.seq, step.seq * step.batch
    d, v, layers = MICRO.d_model, MICRO.vocab_size, MICRO.n_layer

    def linear(fan_in: int, fan_out: int) -> int:
        return 2 * t * fan_in * fan_out

    block = linear(d, 3 * d) + linear(d, d) + linear(d, 4 * d) + linear(4 * d, d)  # qkv, proj, fc, out
    attention = 4 * b * s * s * d  # forward: q k^T and p v, the full s x s square (torch counts no mask)
    forward = layers * (block + attention) + linear(d, v)
    model = 3 * (forward - layers * attention) + layers * (attention + 10 * b * s * s * d)
    return model, layers * (block - linear(4 * d, d) + attention)


def test_full_checkpointing_recomputes_each_block_up_to_its_last_linear():
    """Counted with FlopCounterMode, the step grows by the recompute of :func:`_flops_by_shapes`:
    less than one whole forward more (the 1.33 of 3 -> 4 forwards)."""
    model, recompute = _flops_by_shapes(SMALL)
    base = step_flops(SMALL)
    full = step_flops(replace(SMALL, checkpointing="full"))
    assert base == model
    assert full == base + recompute
    assert 1.1 < full / base < 4 / 3


#: A100 datasheet, fp32 on the CUDA cores (no TF32: torch leaves it off for matmuls)
A100_FP32 = 19.5e12


@pytest.fixture
def no_calibration(monkeypatch, tmp_path):
    """The datasheet's rate, whatever ``memlab doctor --calibrate`` stored on this machine."""
    monkeypatch.setenv(CALIBRATION_ENV, str(tmp_path / "absent.json"))


def test_predicted_checkpointing_adds_the_recompute_at_the_cards_rate(no_calibration):
    """The table's predicted checkpointing step is the baseline's plus the recompute FLOPs
    counted from the shapes, at the A100's fp32 peak times its achievable fraction; its
    pipeline row adds the bubble, (p - 1) / m of each stage's share of the step's FLOPs."""
    rate = A100_FP32 * SPEEDS["A100-80GB"].achievable
    hbm = 2.039e12  # the A100's datasheet bandwidth: elementwise bytes stream at it
    model, recompute = _flops_by_shapes(SMALL)
    pred = predicted_times(SMALL, "A100-80GB", world_size=2)
    ck = pred["gradient checkpointing"]
    rerun = gpt_elementwise(replace(MICRO, checkpointing="full"), SMALL.seq, SMALL.batch, target="cuda").recompute
    assert ck.seconds - ck.baseline_seconds == pytest.approx(recompute / rate + rerun / hbm, rel=1e-9)
    assert ck.ratio == pytest.approx(ck.seconds / ck.baseline_seconds)
    pp = pred["pipeline parallelism"]
    m = PIPELINE_MICRO_BATCHES
    ew = gpt_elementwise(MICRO, SMALL.seq, SMALL.batch, micro_batches=m, target="cuda")
    bubble = (2 - 1) / m * ((model / 2) / rate + (ew.forward + ew.backward) / 2 / hbm)
    assert pp.seconds - pp.baseline_seconds == pytest.approx(bubble, rel=1e-9)


@pytest.mark.parametrize("card", sorted(SPEEDS))
def test_predicted_column_orders_the_rows_as_lesson_15_says(card, no_calibration):
    """On every card: checkpointing costs more than the baseline and less than a whole forward
    more (4/3), selective less than full; bf16 is never slower ("lower or equal") where the card
    runs bf16 matmuls faster than fp32, and only its casts slower where not; offload is
    the slowest DeepSpeed run (the host's Adam and PCIe on top of ZeRO-2); the bubble slows."""
    pred = predicted_times(replace(SMALL, seq=64), card)
    r = {k: v.ratio for k, v in pred.items()}
    assert 1 < r["recomputation (selective)"] < r["gradient checkpointing"] < 4 / 3
    sp = SPEEDS[card]
    if sp.peak("bf16") > sp.peak("fp32"):
        assert r["mixed precision"] <= 1 + 1e-12
    else:  # no faster bf16 matmuls (T4, V100): autocast's casts of the weights cost a little
        assert 1 < r["mixed precision"] < 1.05
    deepspeed = [pred[f"ZeRO-{z}"].seconds for z in (1, 2, 3)] + [pred["ZeRO-1"].baseline_seconds]
    assert pred["offloading"].seconds > max(deepspeed) and r["offloading"] > 1
    assert r["pipeline parallelism"] > 1
    assert "activation compression" not in pred   # elementwise work: the time lens has no model of it


@pytest.mark.parametrize("card", ["T4-16GB", "V100-16GB"])
def test_only_bf16_autocast_is_predicted_slower_on_a_t4_or_v100(card, no_calibration):
    """Lesson 15: a T4 or V100 has fp16 tensor cores and no bf16 ones (datasheets: 65 and 125
    TFLOPS fp16 against 8.1 and 15.7 fp32), so bf16 autocast runs its matmuls at the fp32 rate
    and pays its casts, while fp16 autocast runs at the tensor cores' rate."""
    from memlab.time.step_time import step_time
    sp = SPEEDS[card]
    assert sp.peak("bf16") == sp.peak("fp32") and sp.peak("fp16") > 7 * sp.peak("fp32")
    step = StepConfig(model="gpt2-medium", seq=128, batch=4)   # matmul-bound: launches are not the step
    t = {p: step_time(replace(step, precision=p), card).seconds for p in ("fp32", "bf16", "fp16")}
    assert t["fp16"] < 0.5 * t["fp32"] < t["fp32"] < t["bf16"] < 1.05 * t["fp32"], t


def test_table_on_card_adds_the_predicted_column(no_calibration):
    rows = [Row(t, *CLAIMS[t][:2], 0.8, 1.3, "holds", "-")
            for t in ("gradient checkpointing", "activation compression")]
    table = Table(rows, SMALL, 1, 0.0).on_card("T4-16GB")
    ck = predicted_times(SMALL, "T4-16GB")["gradient checkpointing"]
    assert table.card == "T4-16GB" and table.row("gradient checkpointing").predicted_ratio == ck.ratio
    md = table.to_markdown()
    assert "| measured time ratio | predicted on T4-16GB |" in md
    assert f"| 1.30x | {ck.ratio:.2f}x (" in md and "| 1.30x | n/a |" in md
    assert "predicted on" not in Table(rows, SMALL, 1, 0.0).to_markdown()


def test_predicted_times_reject_bad_input(no_calibration):
    with pytest.raises(InputError, match="H800"):
        predicted_times(SMALL, "H800")
    with pytest.raises(InputError, match="world_size"):
        predicted_times(SMALL, "T4-16GB", world_size=1)
