"""The checkers of the multi-rank lessons (09 data parallel, 13 pipeline, 14 planning), of
today's models (16 GQA, 17 a UNet) and of the table (15): each passes its reference answer
and fails a named wrong answer with a message that says what is wrong."""
import pytest

from memlab.classroom import exercises as ex


# --------------------------------------------------------------------------------------
# 09: averaging gradients with an all-reduce
# --------------------------------------------------------------------------------------
def average(model, all_reduce, world_size):
    for p in model.parameters():
        all_reduce(p.grad)
        p.grad /= world_size


def test_gradient_average_passes_the_reference():
    r = ex.check_gradient_average(average)
    assert r.measured["max_grad_diff"] < ex.DP_TOLERANCE
    assert r.measured["all_reduce_calls"] == len(list(ex.common.tiny_model().parameters()))


def test_gradient_average_names_a_sum_without_the_division():
    def summed(model, all_reduce, world_size):
        for p in model.parameters():
            all_reduce(p.grad)
    with pytest.raises(ex.CheckFailed, match="2x the one-process gradients"):
        ex.check_gradient_average(summed)


def test_gradient_average_names_a_missing_all_reduce():
    def local(model, all_reduce, world_size):
        pass
    with pytest.raises(ex.CheckFailed, match="never called"):
        ex.check_gradient_average(local)


def test_gradient_average_names_an_empty_answer():
    with pytest.raises(ex.CheckFailed, match="write `average_gradients` in the cell above"):
        ex.check_gradient_average(None)


# --------------------------------------------------------------------------------------
# 14: ranks a ZeRO stage needs
# --------------------------------------------------------------------------------------
def min_ranks(num_params, stage, card_bytes):
    """Written out from the ZeRO paper's sec. 5.1 (2 + 2 + 12 bytes, K = 12), not from memlab."""
    for n in range(1, 1025):
        per_param = {1: 2 + 2 + 12 / n, 2: 2 + (2 + 12) / n, 3: (2 + 2 + 12) / n}[stage]
        if per_param * num_params <= 0.9 * card_bytes:
            return n
    return None


def test_min_ranks_passes_the_papers_formula():
    r = ex.check_min_ranks(min_ranks)
    assert r.measured["6.7B ZeRO-3 A100-40GB"] == 3                  # 6.74e9 x 16 / 3 < 36 GiB
    assert r.measured["70.6B ZeRO-1 H100-80GB"] == -1                # 4 bytes/param stay whole


def test_min_ranks_names_the_missing_headroom():
    def whole_card(num_params, stage, card_bytes):
        return min_ranks(num_params, stage, card_bytes / 0.9)
    with pytest.raises(ex.CheckFailed, match="headroom"):
        ex.check_min_ranks(whole_card)


def test_min_ranks_names_a_stage_that_shards_too_much():
    def stage2_as_stage3(num_params, stage, card_bytes):
        return min_ranks(num_params, 3 if stage == 2 else stage, card_bytes)
    with pytest.raises(ex.CheckFailed, match="expected 4"):
        ex.check_min_ranks(stage2_as_stage3)


# --------------------------------------------------------------------------------------
# 16: the KV cache of grouped-query attention
# --------------------------------------------------------------------------------------
def kv_cache_bytes(cfg, tokens):
    return 2 * cfg.n_layer * cfg.kv_heads * cfg.head_dim * 2 * tokens


def test_kv_cache_passes_the_reference():
    r = ex.check_kv_cache(kv_cache_bytes)
    # Llama 3 8B: 32 layers, 8 key/value heads of 128 -> 128 KiB per token (Meta's model card shape)
    assert r.measured["llama-3-8b"] == 128 * 2**10 * 8192


def test_kv_cache_names_query_heads_instead_of_kv_heads():
    def mha(cfg, tokens):
        return 2 * cfg.n_layer * cfg.n_head * cfg.head_dim * 2 * tokens
    with pytest.raises(ex.CheckFailed, match="4x too large"):
        ex.check_kv_cache(mha)


# --------------------------------------------------------------------------------------
# 17: a UNet's skip tensors, against a measured step
# --------------------------------------------------------------------------------------
def skip_bytes(levels, batch):
    return sum(batch * lv.channels * lv.side ** 2 * 4 for lv in levels)


def test_skip_bytes_passes_the_measurement():
    r = ex.check_skip_bytes(skip_bytes)
    assert r.measured["skip_bytes"] == r.measured["measured"] > 0


def test_skip_bytes_names_bf16_bytes():
    with pytest.raises(ex.CheckFailed, match="fp32, 4 bytes"):
        ex.check_skip_bytes(lambda levels, batch: skip_bytes(levels, batch) // 2)


# --------------------------------------------------------------------------------------
# 13: micro-batches a pipeline stage holds
# --------------------------------------------------------------------------------------
def in_flight(stage, p, m, schedule):
    return m if schedule == "gpipe" else min(m, p - stage)


def test_in_flight_passes_the_reference():
    r = ex.check_in_flight(in_flight)
    assert r.measured["cases"] > 500


def test_in_flight_names_stage_blind_1f1b():
    with pytest.raises(ex.CheckFailed, match="later stages hold fewer"):
        ex.check_in_flight(lambda stage, p, m, schedule: m if schedule == "gpipe" else min(m, p))


@pytest.mark.distributed
def test_in_flight_agrees_with_a_measured_pipeline():
    from memlab.distributed.pipeline_parallel import measure_pipeline
    from memlab.step.training_step import StepConfig
    pp = measure_pipeline(StepConfig(seq=32, batch=4), 2, micro_batches=(2, 4), repeats=1)
    r = ex.check_in_flight(in_flight, measured=pp)
    assert r.measured["measured_runs"] >= 4


# --------------------------------------------------------------------------------------
# 15: a row of the table, the saving on the peak
# --------------------------------------------------------------------------------------
def peak_saving(step, **technique):
    from memlab import measure_step
    return 1 - measure_step(step, **technique).peak_bytes / measure_step(step).peak_bytes


def test_peak_saving_passes_the_reference():
    r = ex.check_peak_saving(peak_saving)
    assert all(-0.5 < v < 1 for v in r.measured.values())


def test_peak_saving_names_the_activation_saving():
    def on_activations(step, **technique):
        from memlab import measure_step
        from memlab.techniques.sweeps import category_max
        a = [category_max(measure_step(step, **kw), "activations") for kw in (technique, {})]
        return 1 - a[0] / a[1]
    with pytest.raises(ex.CheckFailed, match="saving on the activations"):
        ex.check_peak_saving(on_activations)


def store_bytes(batch, seq, vocab, batches):
    return 2 * batches * batch * seq * vocab * 4  # old store, new batch and new store at the last torch.cat


def test_eval_store_passes_the_measurement():
    r = ex.check_eval_store(store_bytes)
    assert abs(r.measured["store_bytes"] / r.measured["measured"] - 1) < ex.STORE_TOLERANCE


def test_eval_store_names_the_concatenation_when_half():
    with pytest.raises(ex.CheckFailed, match="half; torch.cat"):
        ex.check_eval_store(lambda b, s, v, n: n * b * s * v * 4)
