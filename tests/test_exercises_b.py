"""Checkers of arc B's lessons (09, 13, 14, 16, 17): each passes its reference answer and fails
a named wrong answer with a message that says what is wrong."""
import pytest

from memlab import exercises as ex


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
    with pytest.raises(ex.CheckFailed, match="define average_gradients"):
        ex.check_gradient_average(None)
