"""The checkers of a first step, the model states of any model and the peak estimator
(lessons 00, 01, 07): each passes its reference and fails a named wrong answer with the
message that names the mistake."""
import pytest

import memlab as ml
from memlab.classroom import exercises as ex
from memlab.lenses.estimate import layer_activation_bytes


def test_first_step_checker_passes_a_right_prediction_and_names_a_wrong_one():
    step = ml.StepConfig(model="tiny", seq=256, batch=8)  # 2048 tokens: activations on top
    assert "as you predicted" in str(ex.check_first_step(step, "activations"))
    with pytest.raises(ex.CheckFailed, match="'activations' holds the most"):
        ex.check_first_step(step, "optimizer")
    short = ml.StepConfig(model="tiny", seq=16, batch=1)  # 16 tokens: Adam's moments on top
    assert "optimizer" in str(ex.check_first_step(short, "optimizer"))
    with pytest.raises(ex.CheckFailed, match="at most 4096"):
        ex.check_first_step(ml.StepConfig(model="tiny", seq=1024, batch=8), "activations")


def state_bytes(n, optimizer):
    return (4 + 4 + (8 if optimizer == "adamw" else 4)) * n


def test_state_bytes_checker():
    res = ex.check_state_bytes(state_bytes)
    assert "16 B/param" in str(res) and "12 B/param" in str(res)
    # the mistake: Adam's count for SGD with momentum, which keeps one buffer, not two
    with pytest.raises(ex.CheckFailed, match="sgd: you said 16.00 B/param, the model keeps 12.00"):
        ex.check_state_bytes(lambda n, optimizer: 16 * n)
    with pytest.raises(ex.CheckFailed, match="not a number"):
        ex.check_state_bytes(lambda n, optimizer: "16n")


def estimate_peak(cfg, seq, batch):
    """The lesson 07 reference: the larger of the loss moment (no gradients yet) and the end
    of backward (all gradients, no activations)."""
    n, t = cfg.num_params(), seq * batch
    acts = cfg.n_layer * layer_activation_bytes(cfg, seq, batch, "fp32")
    at_loss = dict(parameters=4 * n, gradients=0, optimizer=8 * n, activations=acts,
                   logits=3 * 4 * t * cfg.vocab_size)
    at_end = dict(parameters=4 * n, gradients=4 * n, optimizer=8 * n, activations=0, logits=0)
    return max(at_loss, at_end, key=lambda d: sum(d.values()))


@pytest.mark.slow
def test_estimator_checker_passes_the_reference_within_3_percent():
    res = ex.check_estimator(estimate_peak)
    assert res.measured["worst_error"] < 0.03


@pytest.mark.slow
def test_estimator_checker_names_the_gradients_that_do_not_exist_at_the_loss():
    def all_at_once(cfg, seq, batch):  # 16 B/param + every activation + one logits tensor
        d = estimate_peak(cfg, seq, batch)
        n = cfg.num_params()
        return dict(d, gradients=4 * n, activations=cfg.n_layer * layer_activation_bytes(
            cfg, seq, batch, "fp32"), logits=4 * seq * batch * cfg.vocab_size)
    with pytest.raises(ex.CheckFailed, match=r"llama-7b .*\+10%.*gradients: you count 7.01 GiB.*holds 0 B"):
        ex.check_estimator(all_at_once)


def test_estimator_checker_wants_the_named_terms():
    with pytest.raises(ex.CheckFailed, match="dict with the keys parameters, gradients"):
        ex.check_estimator(lambda cfg, seq, batch: 16 * cfg.num_params())
