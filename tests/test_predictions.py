"""Predictions: the score is the relative error, its sign says high or low, blanks are not errors."""
import pytest

from memlab.classroom import predictions as pr
from memlab.core.errors import InputError


def test_a_low_guess_is_scored_with_its_relative_error_and_the_gap():
    p = pr.check_prediction(3.0, 4.1 * 2**30, unit="GiB", explain="the logits")
    assert p.error == pytest.approx((3.0 - 4.1) / 4.1)
    assert str(p) == "you said 3.00 GiB, measured 4.10 GiB: 27% low. The gap: the logits."
    assert not p.close


def test_a_close_guess_is_praised_and_the_gap_not_shown():
    p = pr.check_prediction(105, 100 * 2**20, unit="MiB", explain="unused")
    assert p.close and "within 5%" in str(p) and "unused" not in str(p)
    high = pr.check_prediction(2.0, 1.0, unit="", measured_in_bytes=False)
    assert high.error == pytest.approx(1.0) and "100% high" in str(high)


def test_a_blank_guess_shows_the_measurement_and_asks_for_a_number():
    p = pr.check_prediction(None, 2**30, unit="GiB")
    assert p.error is None and not p.close
    assert "no prediction written: measured 1.00 GiB" in str(p)


def test_history_keeps_every_prediction_in_order():
    before = len(pr.history())
    a = pr.check_prediction(1, 2**20)
    b = pr.check_prediction(None, 2**20)
    assert pr.history()[before:] == [a, b]


@pytest.mark.parametrize("guess", ["3 GiB", True, float("nan")])
def test_a_guess_that_is_not_a_number_is_refused_by_name(guess):
    with pytest.raises(InputError, match="guess="):
        pr.check_prediction(guess, 1.0)


def test_an_unknown_unit_is_refused_with_the_allowed_ones():
    with pytest.raises(InputError, match="unit='GB'; allowed: 'B', 'KiB', 'MiB', 'GiB'"):
        pr.check_prediction(1.0, 1.0, unit="GB")
