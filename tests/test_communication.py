"""Bytes moved per rank (memlab.time.communication) against the ZeRO paper's and Megatron's
counts, and against the bytes counted on real gloo ranks (memlab.distributed.comm_count)."""
from __future__ import annotations

import dataclasses
import functools

import pytest

from memlab.core.errors import InputError
from memlab.models.gpt_unet import get_config
from memlab.step.parallel_dims import ParallelDims
from memlab.step.training_step import StepConfig
from memlab.step.write_deepspeed_config import GATHER_EVERY_USE, REDUCE_TO_OWNER, deepspeed_config
from memlab.time.communication import Transfer, step_communication

TINY = StepConfig(model="tiny", seq=16, batch=2, world_size=2)


def zero_moved(engine: str) -> dict[int, float]:
    steps = {z: StepConfig(model="llama-7b", seq=128, batch=1, precision="bf16", zero=z, world_size=8)
             for z in (1, 2, 3)}
    return {z: step_communication(s, engine=engine).gpu_bytes for z, s in steps.items()}


def test_zero_stages_move_2_2_3_psi_in_the_paper():
    # llama-7b: the parameters DeepSpeed keeps whole (norms, < 10k elements) are 0.004%
    psi = get_config("llama-7b").num_params()
    moved = zero_moved("paper")
    # ZeRO paper sec. 7: 2 psi, 2 psi, 3 psi elements of 2 bytes, (n-1)/n of each on a ring
    assert moved[1] == pytest.approx(2 * 2 * psi * 7 / 8, rel=1e-6)
    assert moved[2] == moved[1]
    assert moved[3] / moved[1] == pytest.approx(1.5, rel=1e-3)


def test_deepspeed_all_reduces_zero_1_and_2_gradients():
    # DeepSpeed 0.19's bucketed all-reduce (2 psi) + all-gather (psi): as much as ZeRO-3
    psi = get_config("llama-7b").num_params()
    moved = zero_moved("deepspeed")
    assert moved[1] == pytest.approx(3 * 2 * psi * 7 / 8, rel=1e-6)
    assert moved[3] / moved[1] == pytest.approx(1.0, rel=1e-3)


def test_deepspeed_with_reduce_to_owner_moves_the_papers_2_2_3_psi():
    # llama-7b (untied): nothing persists under GATHER_EVERY_USE, so ZeRO-3 is 3 psi exactly
    psi = get_config("llama-7b").num_params()
    moved = zero_moved("deepspeed-reduce-scatter")
    assert moved[1] == pytest.approx(2 * 2 * psi * 7 / 8, rel=1e-6)
    assert moved[2] == moved[1]
    assert moved[3] == pytest.approx(3 * 2 * psi * 7 / 8, rel=1e-6)


def test_a_tied_embedding_is_gathered_by_both_of_its_modules():
    cfg = get_config("tiny")  # tied: wte is the embedding and the head
    step = StepConfig(model="tiny", seq=16, batch=2, world_size=2, zero=3, precision="bf16")
    comm = step_communication(step, engine="deepspeed-reduce-scatter")
    # forward and backward each gather every weight once, and the tied one once more
    assert comm.payload("all_gather") == 2 * 2 * (cfg.num_params() + cfg.vocab_size * cfg.d_model)
    assert comm.payload("reduce_scatter") == 2 * cfg.num_params()


def test_paper_collectives_add_their_keys_and_leave_the_default_as_it_was():
    for zero, keys in ((1, REDUCE_TO_OWNER), (2, REDUCE_TO_OWNER), (3, GATHER_EVERY_USE)):
        step = StepConfig(model="tiny", seq=16, batch=2, world_size=2, zero=zero, precision="bf16")
        default = deepspeed_config(step)["zero_optimization"]
        paper = deepspeed_config(step, paper_collectives=True)["zero_optimization"]
        assert paper == {**default, **keys}
        # the memory references were measured with DeepSpeed's own choices: none of these keys
        assert "use_multi_rank_bucket_allreduce" not in default
        if zero == 3:
            assert default["stage3_max_reuse_distance"] > 0 and default["stage3_param_persistence_threshold"] > 0


def test_ddp_all_reduces_fp32_gradients_once_per_backward():
    comm = step_communication(TINY)
    psi = get_config("tiny").num_params()
    assert comm.payload("all_reduce") == 4 * psi
    assert comm.by_kind["data-parallel all-reduce"] == pytest.approx(2 * (2 - 1) / 2 * 4 * psi)
    assert step_communication(StepConfig(model="tiny", seq=16, batch=2)).transfers == ()


def test_tensor_parallel_has_four_all_reduces_per_layer():
    cfg = get_config("tiny")
    comm = step_communication(dataclasses.replace(TINY, parallel=ParallelDims(tensor=2)))
    assert comm.payload("all_reduce") == 4 * cfg.n_layer * 16 * 2 * cfg.d_model * 4  # Megatron sec. 3


def test_offload_moves_fp32_gradients_down_and_16_bit_weights_up():
    step = StepConfig(model="tiny", seq=16, batch=2, world_size=2, zero=2, offload="optimizer",
                      precision="bf16")
    psi = get_config("tiny").num_params()
    pcie = {t.kind: t.payload_bytes for t in step_communication(step).transfers if t.link == "pcie"}
    assert sorted(pcie.values()) == [int(2 * psi / 2), int(4 * psi / 2)]


def test_ring_traffic_and_bad_degrees():
    assert Transfer("x", "all_gather", 800, 8).moved_bytes == 700
    # eight reduces of 100 bytes, one to each owner: each rank sends the seven it does not own
    assert Transfer("x", "reduce", 800, 8).moved_bytes == 700
    assert Transfer("x", "copy", 800, 1, "pcie").moved_bytes == 800
    with pytest.raises(InputError, match="allowed: a divisor of the world size"):  # the run refuses it
        dataclasses.replace(TINY, parallel=ParallelDims(tensor=4))


@pytest.mark.distributed
def test_counted_ddp_bytes_equal_the_formula():
    from memlab.distributed.comm_count import count_step_communication
    counted = count_step_communication(TINY, "ddp")
    formula = step_communication(TINY)
    for rank in counted:
        assert rank["bytes"]["all_reduce"] == pytest.approx(formula.payload("all_reduce"), rel=0.02)


@pytest.mark.distributed
@pytest.mark.slow
def test_counted_tensor_parallel_bytes_equal_the_formula():
    from memlab.distributed.comm_count import count_step_communication
    counted = count_step_communication(TINY, "tp")
    formula = step_communication(dataclasses.replace(TINY, parallel=ParallelDims(tensor=2)))
    assert counted[0]["bytes"] == {"all_reduce": pytest.approx(formula.payload("all_reduce"), rel=0.02)}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 2])
def test_counted_zero_bytes_equal_the_formula(zero):
    # DeepSpeed's own config. Its ZeRO-3 keeps a small model's parameters gathered between
    # forward and backward (stage3_max_reuse_distance): counted exactly only with
    # paper_collectives (below)
    from memlab.distributed.comm_count import count_step_communication
    step = StepConfig(model="tiny", seq=16, batch=2, world_size=2, zero=zero, precision="bf16")
    counted = count_step_communication(step, "zero")[0]["bytes"]
    formula = step_communication(step)
    for collective in ("all_reduce", "reduce_scatter", "reduce", "all_gather"):
        assert counted.get(collective, 0) == pytest.approx(formula.payload(collective), rel=0.02,
                                                           abs=16), collective


UNTIED = dataclasses.replace(get_config("tiny"), tie_embeddings=False)


@functools.cache
def paper_count(zero: int, tied: bool = False) -> dict[str, int]:
    """Rank 0's counted bytes by collective of one DeepSpeed step with ``paper_collectives``."""
    from memlab.distributed.comm_count import count_step_communication
    step = StepConfig(model="tiny" if tied else UNTIED, seq=16, batch=2, world_size=2, zero=zero,
                      precision="bf16")
    return count_step_communication(step, "zero", paper_collectives=True)[0]["bytes"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("zero", "tied"), [(1, False), (2, False), (3, False), (3, True)])
def test_counted_paper_collectives_equal_the_formula(zero, tied):
    step = StepConfig(model="tiny" if tied else UNTIED, seq=16, batch=2, world_size=2, zero=zero,
                      precision="bf16")
    counted = paper_count(zero, tied)
    formula = step_communication(step, engine="deepspeed-reduce-scatter")
    total = sum(counted.values())
    for collective in set(counted) | {t.collective for t in formula.transfers}:
        if formula.payload(collective):
            assert counted.get(collective, 0) == pytest.approx(formula.payload(collective), rel=0.02), collective
        else:  # what the formula leaves out: DeepSpeed's flags and norms, a few bytes
            assert counted[collective] < 1e-3 * total, collective


@pytest.mark.distributed
@pytest.mark.slow
def test_counted_zero_1_2_3_move_the_papers_2_2_3_psi():
    # ZeRO paper sec. 7: 2 psi, 2 psi, 3 psi elements (bf16: 2 bytes) from the parameter count,
    # (n-1)/n of them sent per rank on a ring; the counted payloads turned into bytes sent by
    # their collective (an all-reduce sends twice its payload's share)
    n, psi_bytes = 2, 2 * UNTIED.num_params()
    moved = {zero: sum(Transfer(c, c, v, n).moved_bytes for c, v in paper_count(zero).items())
             for zero in (1, 2, 3)}
    for zero, elements in ((1, 2), (2, 2), (3, 3)):
        assert moved[zero] == pytest.approx(elements * psi_bytes * (n - 1) / n, rel=0.02), zero
    assert moved[3] / moved[1] == pytest.approx(1.5, rel=0.02)
