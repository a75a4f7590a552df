"""DeepSpeed 0.19.8's stage-3 coordinator replayed (memlab.step.zero3_gathers), on a toy trace
worked by hand from ``partitioned_param_coordinator.py`` and ``partition_parameters.py``.

The toy: a root without parameters, then A (``a``: 100 elements), B (``b``: 300, ``c``: 5, below
the persistence threshold of 10) and C (``d``: 200), 2 ranks, 4-byte elements, a 350-element
prefetch bucket. The parameter trace is ``a@1, b@2, c@2, d@3`` forward, ``d@4, b@5, c@5, a@6``
backward. The real figures (peak within 0.5% of DeepSpeed per rank) are in tests/test_hf_zero.py.
"""
import pytest

from memlab.core.errors import InputError
from memlab.step.zero3_gathers import TraceModule, gathered_in_closed_form, replay_gathers

TOY = [TraceModule("root", ()), TraceModule("A", (("a", 100),)),
       TraceModule("B", (("b", 300), ("c", 5))), TraceModule("C", (("d", 200),))]
KNOBS = dict(world_size=2, element_bytes=4, prefetch=350, max_live=10_000, persistence=10)


def test_the_root_prefetches_one_flat_buffer_that_lives_until_its_last_parameter_is_fetched():
    s = replay_gathers(TOY, reuse_distance=10_000, **KNOBS)
    # root: a and b prefetched (100 < 350, then 400 >= 350 stops) into one flat buffer of 400
    # elements; A: the wait copies a and b out (400 + 1200 B), d (200) comes alone as a view of
    # its buffer (800 B); B: b leaves the registry and the flat buffer goes
    assert s.forward == (1600, 1600 + 400 + 1200 + 800, 2400, 2400)
    # backward C, B, A: each one's parameters have no later use and go at its release
    assert s.backward_order == (3, 2, 1)
    assert s.backward == (2400, 1600, 400)
    assert s.released == (1600, 400, 0)


def test_parameters_are_padded_to_the_ranks_and_a_tiny_bucket_gathers_module_by_module():
    odd = [TraceModule("A", (("a", 101),)), TraceModule("B", (("b", 301),))]
    s = replay_gathers(odd, reuse_distance=0, world_size=2, element_bytes=2, prefetch=0, max_live=10_000,
                       persistence=10)
    # no prefetch: each module gathers its one parameter alone (ceil(101 / 2) * 2 = 102 elements),
    # and a zero reuse distance frees it after its forward
    assert s.forward == (2 * 102, 2 * 302)
    assert s.backward == (2 * 302, 2 * 102)
    assert s.released == (0, 0)


def test_the_closed_form_holds_the_replays_flat_buffer_and_copies_where_the_root_takes_the_whole_model():
    """The estimate's closed form (no trace) against the replay. With a bucket over the whole model
    the root gathers a, b and d (600 elements; c persists) into one flat buffer: the forward holds
    it with the copies (2 x 2400 B) until d, the last, is fetched; then the copies, to backward."""
    knobs = {**KNOBS, "prefetch": 10_000}
    s = replay_gathers(TOY, reuse_distance=10_000, **knobs)
    assert s.forward == (2400, 4800, 4800, 2400)
    numels = [n for m in TOY for _, n in m.params]
    assert gathered_in_closed_form(numels, **knobs) == (max(s.forward), s.backward[0]) == (4800, 2400)


def test_the_closed_form_bounds_the_replay_where_the_bucket_is_smaller_than_the_model():
    """A 350-element bucket takes a and b first (the first test): the whole model is under
    max_live, so the closed form holds it whole with a bucket's flat buffer in flight, a bound of
    what the replay holds from the end of forward on (at the loss, in backward). The forward's
    first modules hold more in flight (4000 B at A), beside activations that are still few."""
    s = replay_gathers(TOY, reuse_distance=10_000, **KNOBS)
    forward, held = gathered_in_closed_form([n for m in TOY for _, n in m.params], **KNOBS)
    assert forward == held == 4 * (600 + 350) >= max(s.forward[-1], *s.backward)


def test_a_bad_world_size_is_refused():
    with pytest.raises(InputError, match="world_size=0"):
        replay_gathers(TOY, reuse_distance=0, **{**KNOBS, "world_size": 0})
