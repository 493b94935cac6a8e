"""ReplayBuffer and BufferCore on hand cases: whole groups, FIFO, drops with exact counts, capacity."""

from __future__ import annotations

import math

import msgspec
import pytest

from asyncrl.buffer import BufferCore, BufferFullError, ReplayBuffer
from asyncrl.config import BufferConfig
from asyncrl.types import SampleStatus
from tests.buffer._helpers import make_group

IDENTITY = ("trained", "dropped_stale", "dropped_invalid", "dropped_filtered", "dropped_failed", "waiting")


def identity_holds(m: dict[str, float]) -> bool:
    return m["buffer/generated"] == sum(m[f"buffer/{k}"] for k in IDENTITY)


def buf(**kw) -> ReplayBuffer:
    return ReplayBuffer(BufferConfig(**{"batch_size": 4, "max_staleness": 1, "capacity": 16, **kw}))


def ids(batch) -> list[int]:
    return [s.group_id for s in batch.samples]


def test_batches_are_whole_groups_in_fifo_order():
    b = buf()
    for gid in (7, 3, 9):
        b.put_group(make_group(gid, [0.0, 1.0]))
    batch = b.get_batch(4, current_version=0, max_staleness=1)
    assert ids(batch) == [7, 7, 3, 3] and batch.size == 4
    assert batch.policy_version == 0 and batch.step == 0
    assert b.get_batch(4, 0, 1) is None  # only 2 samples left: a group is never split
    b.put_group(make_group(1, [1.0, 0.0]))
    assert ids(b.get_batch(4, 0, 1)) == [9, 9, 1, 1]
    m = b.metrics()
    assert m["buffer/trained"] == 8 and m["buffer/waiting"] == 0 and identity_holds(m)


def test_stale_groups_are_dropped_with_exact_counts_and_never_trained():
    b = buf()
    b.put_group(make_group(1, [0.0, 1.0], version=0))  # oldest 0: stale at v=3, eta=1
    b.put_group(make_group(2, [0.0, 1.0], versions=[[3, 3], [1, 3]]))  # one token at 1: whole group stale
    b.put_group(make_group(3, [0.0, 1.0], version=2))
    b.put_group(make_group(4, [0.0, 1.0], versions=[[2, 3], [3, 3]]))
    batch = b.get_batch(4, current_version=3, max_staleness=1)
    assert ids(batch) == [3, 3, 4, 4]
    assert all(s.oldest_version >= 2 for s in batch.samples)
    m = b.metrics()
    assert m["buffer/dropped_stale"] == 4 and m["buffer/trained"] == 4 and identity_holds(m)
    assert m["buffer/staleness_max"] == 1.0 and m["buffer/staleness_mean"] == pytest.approx(3 / 4)


def test_all_equal_filter_drops_groups_without_signal():
    b = buf(group_filter="all_equal")
    assert b.put_group(make_group(1, [1.0, 1.0])).dropped_filtered == 2
    assert b.put_group(make_group(2, [0.0, 1.0])).kept == 2
    assert buf(group_filter="none").put_group(make_group(1, [1.0, 1.0])).kept == 2
    m = b.metrics()
    assert (m["buffer/dropped_filtered"], m["buffer/waiting"], m["buffer/generated"]) == (2, 2, 4)


@pytest.mark.parametrize(
    "group",
    [
        make_group(1, [1.0, 0.0], statuses=[SampleStatus.VALID, SampleStatus.ABORTED]),
        make_group(1, [1.0, 0.0], statuses=[SampleStatus.INVALID_REWARD, SampleStatus.VALID]),
        make_group(1, [1.0, math.nan]),
        make_group(1, [math.inf, 0.0]),
        make_group(1, [1.0, 0.0], versions=[[0], []]),  # no response tokens, hence no version
    ],
)
def test_a_group_with_an_invalid_member_is_dropped_whole(group):
    b = buf()
    result = b.put_group(group)
    assert (result.kept, result.dropped_invalid, result.dropped_filtered) == (0, 2, 0)
    m = b.metrics()
    assert m["buffer/dropped_invalid"] == 2 and m["buffer/invalid_samples"] == 1
    assert m["buffer/waiting"] == 0 and identity_holds(m)


@pytest.mark.parametrize(
    "bad, exc",
    [
        ([], ValueError),
        ("not a list", ValueError),
        ([{"reward": 1.0}], TypeError),
        (make_group(1, [1.0]) + make_group(2, [0.0]), ValueError),  # two group ids
        (make_group(1, [1.0] * 5), ValueError),  # larger than a batch
    ],
)
def test_malformed_groups_raise_and_count_nothing(bad, exc):
    b = buf()
    with pytest.raises(exc):
        b.put_group(bad)
    assert b.metrics()["buffer/generated"] == 0


def test_mismatched_lengths_and_duplicate_group_are_rejected():
    b = buf()
    g = make_group(1, [1.0, 0.0])
    g[1].versions = [0]
    with pytest.raises(ValueError, match="versions"):
        b.put_group(g)
    b.put_group(make_group(2, [1.0, 0.0]))
    with pytest.raises(ValueError, match="already waiting"):
        b.put_group(make_group(2, [1.0, 0.0]))
    assert b.metrics()["buffer/generated"] == 2


def test_capacity_refuses_without_change_and_frees_on_draw():
    b = buf(capacity=4)
    b.put_group(make_group(1, [0.0, 1.0]))
    b.put_group(make_group(2, [0.0, 1.0]))
    before = b.metrics()
    assert not b.has_room(make_group(3, [0.0, 1.0]))
    with pytest.raises(BufferFullError):
        b.put_group(make_group(3, [0.0, 1.0]))
    assert b.metrics() == before
    assert b.put_group(make_group(4, [0.0, 0.0], statuses=[SampleStatus.ABORTED] * 2)).dropped_invalid == 2
    b.get_batch(4, 0, 1)
    assert b.put_group(make_group(3, [0.0, 1.0])).kept == 2


def test_mixed_group_sizes_give_the_longest_fitting_prefix_and_never_deadlock():
    b = buf(capacity=4)
    b.put_group(make_group(1, [0.0, 1.0, 1.0]))
    assert b.get_batch(4, 0, 1) is None  # 3 < B and the next group might be a single sample
    # Over capacity, but refusing would deadlock: 3 waiting samples cannot make a batch.
    b.put_group(make_group(2, [0.0, 1.0]))
    assert ids(b.get_batch(4, 0, 1)) == [1, 1, 1]  # the next group does not fit: short batch
    assert ids(b.get_batch(2, 0, 1)) == [2, 2]


def test_state_dict_round_trip_gives_identical_batches():
    a = buf(capacity=32)
    for gid in range(6):
        a.put_group(make_group(gid, [0.0, float(gid)], version=gid % 3))
    a.get_batch(4, 1, 1)
    state = msgspec.json.decode(msgspec.json.encode(a.state_dict()))  # serialisable as plain data
    b = buf(capacity=32)
    b.load_state_dict(state)
    assert b.metrics() == a.metrics()
    for v in (1, 2, 3):
        for g in (a, b):
            g.put_group(make_group(100 + v, [1.0, 0.0], version=v))
        ba, bb = a.get_batch(4, v, 1), b.get_batch(4, v, 1)
        assert msgspec.to_builtins(ba) == msgspec.to_builtins(bb)
        assert a.metrics() == b.metrics()


def test_corrupt_state_is_refused_and_leaves_the_buffer_alone():
    b = buf()
    b.put_group(make_group(1, [0.0, 1.0]))
    good = b.state_dict()
    for bad in ({}, {**good, "format": 99}, {**good, "groups": [[{"reward": "x"}]]}, {**good, "counts": {"trained": -1}}):
        with pytest.raises(ValueError):
            b.load_state_dict(bad)
    assert b.state_dict() == good


def test_core_ties_pushes_to_reservations():
    core = BufferCore(BufferConfig(batch_size=4, max_staleness=0, capacity=8, group_filter="all_equal"))
    with pytest.raises(ValueError, match="acquire"):
        core.put_group(make_group(1, [0.0, 1.0]))  # no reservation
    assert core.try_acquire(2) and core.try_acquire(2) and not core.try_acquire(2)
    core.put_group(make_group(1, [1.0, 1.0]))  # filtered: its 2 slots are released, not accepted
    assert core.staleness.admitted == 0 and core.try_acquire(2)
    core.put_group(make_group(2, [0.0, 1.0]))
    core.put_group(make_group(3, [0.0, 1.0]))
    assert core.get_batch().size == 4 and not core.try_acquire(2)
    core.set_version(1)
    assert core.try_acquire(2)
    saved = core.state_dict()
    fresh = BufferCore(core.config)
    fresh.load_state_dict(saved, drop_running=True)  # the in-flight rollout died with the old process
    assert fresh.staleness.running == 0 and fresh.staleness.capacity_left() == 4


def test_core_credits_stale_drops_so_admission_stays_live(caplog):
    core = BufferCore(BufferConfig(batch_size=2, max_staleness=0, capacity=8))
    assert core.try_acquire(2)
    core.put_group(make_group(1, [0.0, 1.0], version=0))
    assert core.get_batch().size == 2
    core.set_version(1)
    assert core.try_acquire(2, key="late")
    core.put_group(make_group(2, [0.0, 1.0], version=0), key="late")  # an engine still on version 0
    with caplog.at_level("WARNING", logger="asyncrl.buffer.replay"):
        assert core.get_batch() is None  # stale at v=1, eta=0: dropped, never trained
    # the drop says what a run's log needs to explain it: its tokens older than its admission
    assert "group 2 of 2 samples, oldest token version 0, admitted at 1, arrived at 1" in caplog.text
    m = core.metrics()
    assert m["buffer/dropped_stale"] == 2 and m["buffer/accepted"] == 4 and m["buffer/admitted"] == 2
    # Without the credit, admitted + running would sit at the limit (4) with an empty buffer for ever.
    assert core.try_acquire(2)


def test_an_abandoned_rollout_is_counted_released_and_survives_a_checkpoint():
    core = BufferCore(BufferConfig(batch_size=4, max_staleness=0, capacity=8))
    assert core.try_acquire(2) and core.try_acquire(2) and not core.try_acquire(2)
    core.abandon(2)  # its generation failed on every attempt: never pushed, never retried
    m = core.metrics()
    assert (m["buffer/dropped_failed"], m["buffer/generated"], m["buffer/waiting"]) == (2, 2, 0) and identity_holds(m)
    assert core.staleness.running == 2 and core.try_acquire(2)  # its slots are free again
    with pytest.raises(ValueError):
        core.abandon(6)  # more than is reserved: refused, nothing counted
    with pytest.raises(ValueError):
        core.abandon(0)
    assert core.metrics()["buffer/dropped_failed"] == 2
    fresh = BufferCore(core.config)
    fresh.load_state_dict(core.state_dict())
    assert fresh.metrics()["buffer/dropped_failed"] == 2
    old = core.state_dict()
    del old["replay"]["counts"]["dropped_failed"]  # a checkpoint from before the counter existed
    fresh.load_state_dict(old)
    assert fresh.metrics()["buffer/dropped_failed"] == 0


@pytest.mark.parametrize("overdue", ["wait", "drop"])
def test_a_slow_group_is_waited_for_and_trained_first_not_dropped(overdue):
    """eta = 1, B = 4, groups of 2: a long rollout admitted at v = 0 is still generating when younger
    groups could fill the batch at v = 1. `wait` holds the batch until it arrives and trains it first
    (it would be stale at v = 2); `drop` trains the younger groups and drops it at the next draw."""
    core = BufferCore(BufferConfig(batch_size=4, max_staleness=1, capacity=16, overdue=overdue))
    for k in ("long", "a", "b", "c"):
        assert core.try_acquire(2, k)
    core.put_group(make_group(1, [0.0, 1.0], version=0), "a")
    core.put_group(make_group(2, [0.0, 1.0], version=0), "b")
    assert ids(core.get_batch()) == [1, 1, 2, 2]
    core.set_version(1)
    assert core.metrics()["buffer/overdue"] == 4  # "long" and "c", admitted at v 0 <= 1 - eta
    for k in ("d", "e"):
        assert core.try_acquire(2, k)
    core.put_group(make_group(4, [0.0, 1.0], version=1), "d")
    core.put_group(make_group(5, [0.0, 1.0], version=1), "e")
    if overdue == "wait":
        assert core.get_batch() is None  # a full batch of younger groups waits for the overdue one
        core.put_group(make_group(3, [1.0, 0.0], versions=[[0, 1], [0, 0]]), "c")
        assert core.get_batch() is None and core.overdue() == 2  # "long" still generating
        core.put_group(make_group(0, [1.0, 0.0], versions=[[0, 1], [0, 1]]), "long")
        assert core.metrics()["buffer/overdue"] == 0
        assert ids(core.get_batch()) == [3, 3, 0, 0]  # oldest first, though they arrived last
        core.set_version(2)
        assert ids(core.get_batch()) == [4, 4, 5, 5]
        assert core.metrics()["buffer/dropped_stale"] == 0
    else:
        assert ids(core.get_batch()) == [4, 4, 5, 5]
        core.set_version(2)
        core.put_group(make_group(0, [1.0, 0.0], versions=[[0, 1], [0, 1]]), "long")
        core.put_group(make_group(3, [1.0, 0.0], version=0), "c")
        assert core.get_batch() is None
        assert core.metrics()["buffer/dropped_stale"] == 4


def test_reservation_keys_are_checked_and_survive_a_checkpoint():
    core = BufferCore(BufferConfig(batch_size=4, max_staleness=0, capacity=8))
    assert core.try_acquire(2, "x")
    with pytest.raises(ValueError, match="already held"):
        core.try_acquire(2, "x")
    with pytest.raises(TypeError):
        core.try_acquire(2, 7)
    with pytest.raises(ValueError, match="no running reservation"):
        core.release(2, "y")
    with pytest.raises(ValueError, match="holds 2 samples, not 1"):
        core.put_group(make_group(1, [1.0]), "x")
    assert core.staleness.running == 2 and core.overdue() == 2  # eta 0: due at once
    kept = BufferCore(core.config)
    kept.load_state_dict(msgspec.json.decode(msgspec.json.encode(core.state_dict())), drop_running=False)
    assert kept.overdue() == 2 and kept.get_batch() is None
    kept.put_group(make_group(1, [0.0, 1.0]), "x")  # the same key still names it after the restore
    dropped = BufferCore(core.config)
    dropped.load_state_dict(core.state_dict(), drop_running=True)  # (the actor's default) in-flight ones are gone
    assert dropped.overdue() == 0 and dropped.staleness.running == 0
    old = core.state_dict()
    del old["tickets"]  # a checkpoint from before the keys existed
    dropped.load_state_dict(old)
    assert dropped.overdue() == 0 and dropped.staleness.running == 2  # its rollouts unkeyed: never waited for
    bad = {**core.state_dict(), "tickets": [["x", 0, 9]]}
    with pytest.raises(ValueError, match="exceed"):
        BufferCore(core.config).load_state_dict(bad, drop_running=False)


def test_a_full_buffer_still_takes_the_group_a_draw_waits_for():
    """capacity = B under eta 2: the draw at v = 1 waits for a rollout of v = 0 (k = 1: its samples would be
    due with more than one batch left to hold them), so that rollout's group must land though the buffer is full,
    or the learner and the rollout would wait on each other."""
    core = BufferCore(BufferConfig(batch_size=2, max_staleness=2, capacity=2, overdue="wait"))
    for k in "abcdef":
        assert core.try_acquire(1, k)
    core.put_group(make_group(4, [1.0], version=0), "e")
    core.put_group(make_group(5, [1.0], version=0), "f")
    assert ids(core.get_batch()) == [4, 5]
    core.set_version(1)
    for k in "gh":
        assert core.try_acquire(1, k)
    core.put_group(make_group(6, [1.0], version=1), "g")
    core.put_group(make_group(7, [1.0], version=1), "h")  # full now (2 of 2), a batch of two is there
    assert core.get_batch() is None  # but a..d (v 0, due by v 2) would be stranded: it waits for them
    assert core.can_put(make_group(0, [1.0], version=0), "a")  # full, yet a group the draw waits for fits
    for gid, k in enumerate("abcd"):
        core.put_group(make_group(gid, [1.0], version=0), k)
    assert ids(core.get_batch()) == [0, 1]
    core.set_version(2)
    assert ids(core.get_batch()) == [2, 3]
    assert core.metrics()["buffer/dropped_stale"] == 0
