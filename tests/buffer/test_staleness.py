"""StalenessManager on hand-checked cases: the admission rule, slot transitions, checkpoints."""

from __future__ import annotations

import pytest

from asyncrl.buffer.staleness import StalenessManager


def fill(m: StalenessManager, n: int) -> int:
    """Acquire groups of n until refused; return samples reserved."""
    got = 0
    while m.try_acquire(n):
        got += n
    return got


def test_eta0_admits_exactly_one_batch_before_version_1():
    m = StalenessManager(batch_size=8, max_staleness=0)
    assert fill(m, 2) == 8  # at most B running + accepted at v = 0
    m.on_accepted(4)
    assert not m.try_acquire(2)  # accepting does not free slots
    m.on_rejected(2)
    assert m.try_acquire(2)  # a rejected rollout gives its slots back
    m.on_accepted(4)
    assert (m.admitted, m.running) == (8, 0)
    assert not m.try_acquire(1)
    m.set_version(1)
    assert m.capacity_left() == 8
    assert fill(m, 4) == 8


def test_eta2_bounds_in_flight_to_three_batches_and_grows_one_batch_per_version():
    m = StalenessManager(batch_size=4, max_staleness=2)
    assert fill(m, 1) == 12  # (eta + 0 + 1) * B
    m.on_accepted(12)
    assert not m.try_acquire(1)
    m.set_version(1)
    assert fill(m, 1) == 4
    m.set_version(3)
    assert m.limit() == 24 and fill(m, 2) == 8
    assert m.admitted + m.running == m.limit()


def test_group_reservation_never_overshoots_the_bound():
    # The strict `accepted + running < limit` check would admit 3 + 3 = 6 > 4 here.
    m = StalenessManager(batch_size=4, max_staleness=0)
    assert m.try_acquire(3)
    assert not m.try_acquire(3)
    assert m.try_acquire(1)
    assert m.running == 4 == m.limit()


def test_stale_drop_credits_slots_back():
    m = StalenessManager(batch_size=2, max_staleness=0)
    assert m.try_acquire(2)
    m.on_accepted(2)
    assert not m.try_acquire(2)
    m.on_dropped(2)  # the buffer dropped them stale: never trained
    assert m.accepted_total == 2 and m.admitted == 0
    assert m.try_acquire(2)


@pytest.mark.parametrize(
    "call, exc",
    [
        (lambda m: m.try_acquire(0), ValueError),
        (lambda m: m.try_acquire(5), ValueError),  # larger than a batch
        (lambda m: m.try_acquire(True), TypeError),
        (lambda m: m.try_acquire(1.0), TypeError),
        (lambda m: m.on_accepted(1), ValueError),  # nothing is running
        (lambda m: m.on_rejected(-1), ValueError),
        (lambda m: m.on_dropped(1), ValueError),  # nothing was accepted
    ],
)
def test_bad_calls_raise_and_change_nothing(call, exc):
    m = StalenessManager(batch_size=4, max_staleness=1)
    before = m.state()
    with pytest.raises(exc):
        call(m)
    assert m.state() == before


def test_version_never_goes_back():
    m = StalenessManager(batch_size=4, max_staleness=1, version=3)
    m.set_version(3)
    with pytest.raises(ValueError, match="older"):
        m.set_version(2)
    assert m.version == 3


def test_state_round_trip_and_bad_state():
    m = StalenessManager(batch_size=4, max_staleness=1)
    m.try_acquire(3)
    m.on_accepted(2)
    m.on_rejected(1)
    m.try_acquire(2)
    m.set_version(2)
    other = StalenessManager(batch_size=4, max_staleness=1)
    other.load_state(m.state())
    assert other.state() == m.state() and other.capacity_left() == m.capacity_left()
    assert other.metrics() == m.metrics()
    with pytest.raises(ValueError, match="batch_size"):
        StalenessManager(batch_size=8, max_staleness=1).load_state(m.state())
    with pytest.raises(ValueError, match="keys"):
        other.load_state({"version": 1})
    with pytest.raises(ValueError):
        other.load_state({**m.state(), "running": -1})
    assert other.state() == m.state()
