"""Property tests: BufferCore under random interleavings of producers and the learner.

A scenario is a random op list; `run` plays it like the system would (rollouts acquire slots,
engines may lag behind the learner, groups may be invalid or filtered, the learner draws one
batch per version then advances) and checks at every step:
  * no trained sample is older than v - eta,
  * admitted + running <= (eta + v + 1) * B  (admitted = accepted and not dropped stale),
  * generated = trained + dropped_stale + dropped_invalid + dropped_filtered + dropped_failed + waiting,
  * liveness: with nothing in flight, admission refused implies a batch can be drawn,
  * with keyed reservations and `overdue: wait`: no batch is drawn while an overdue rollout runs, and
    no group is ever dropped stale unless an engine lagged behind its rollout's admission version.
It is run twice, with and without state_dict round trips (through JSON) mid-sequence; the traces
must be identical.
"""

from __future__ import annotations

import copy

import msgspec
from hypothesis import example, given, settings
from hypothesis import strategies as st

from asyncrl.buffer import BufferCore
from asyncrl.config import BufferConfig
from asyncrl.types import SampleStatus
from tests.buffer._helpers import make_group

PUSH = st.tuples(
    st.just("push"),
    st.integers(0, 1000),  # which in-flight rollout finishes
    st.sampled_from([0, 0, 1, 2]),  # how many versions its engine lags behind its start version
    st.lists(st.sampled_from([0.0, 1.0]), min_size=3, max_size=3),  # rewards
    st.sampled_from(["valid"] * 6 + ["aborted", "nan"]),
)
# Weighted so that runs get long: most ops move rollouts or the learner forward.
KINDS = ["acquire"] * 3 + ["push"] * 4 + ["flush"] * 2 + ["release", "abandon"] + ["get"] * 3 + ["advance"] * 3 + ["roundtrip"]
OPS = st.sampled_from(KINDS).flatmap(
    lambda kind: PUSH.map(lambda op: (kind, *op[1:]))
    if kind in ("push", "flush")
    else st.tuples(st.just(kind), st.integers(0, 1000))
)


@st.composite
def scenarios(draw):
    n = draw(st.integers(1, 3))
    batch_size = n * draw(st.integers(1, 3))
    config = BufferConfig(
        batch_size=batch_size,
        max_staleness=draw(st.integers(0, 2)),
        capacity=draw(st.integers(batch_size, 2 * batch_size)),
        # A one-sample group always has "all equal" rewards: that filter would drop everything.
        group_filter=draw(st.sampled_from(["none", "all_equal"] if n > 1 else ["none"])),
        overdue=draw(st.sampled_from(["wait", "drop"])),
    )
    # keyed: every reservation named (as the rollout workers do); punctual: no engine lags behind admission
    return config, n, draw(st.lists(OPS, min_size=20, max_size=150)), draw(st.booleans()), draw(st.booleans())


def check_invariants(core: BufferCore, n_running: int) -> None:
    s, m = core.staleness, core.metrics()
    assert s.admitted + s.running <= (s.max_staleness + s.version + 1) * s.batch_size
    assert m["buffer/generated"] == sum(
        m[f"buffer/{k}"] for k in ("trained", "dropped_stale", "dropped_invalid", "dropped_filtered", "dropped_failed", "waiting")
    )
    assert s.running == n_running  # every reservation is accounted for
    assert s.admitted == m["buffer/trained"] + m["buffer/waiting"]


def run(config: BufferConfig, n: int, ops: list, roundtrips: bool, keyed: bool = False, punctual: bool = False) -> list:
    core = BufferCore(config)
    in_flight: list[tuple[int, int]] = []  # (group_id, version when its rollout started)
    drawn = 0  # batches the learner drew; it draws one per version, then advances
    next_gid = 0
    lagged = False  # an engine sampled a group on a version older than its rollout's admission
    trace: list = []

    def key(gid: int) -> str | None:
        return f"r{gid}" if keyed else None

    for op in ops:
        v = core.version
        if op[0] == "acquire":
            for _ in range(1 + op[1] % 4):  # a few rollout workers try at once
                ok = core.try_acquire(n, key(next_gid))
                if ok:
                    in_flight.append((next_gid, v))
                    next_gid += 1
                elif not in_flight and drawn == v:
                    probe = copy.deepcopy(core)
                    assert probe.get_batch() is not None or probe.try_acquire(n), "admission and learner both stuck"
                trace.append(("acquire", ok))
        elif op[0] in ("push", "flush") and in_flight:
            _, pick, lag, rewards, kind = op
            chosen = [in_flight[pick % len(in_flight)]] if op[0] == "push" else list(in_flight)
            for gid, started in chosen:  # "flush": every rollout in flight finishes now
                start = started if punctual else max(0, started - lag)
                lagged |= start < started
                group = make_group(gid, rewards[:n], versions=[[start, min(start + i, v)] for i in range(n)])
                if kind == "aborted":
                    group[0].status = SampleStatus.ABORTED
                elif kind == "nan":
                    group[-1].reward = float("nan")
                if core.can_put(group, key(gid)):
                    in_flight.remove((gid, started))
                    result = core.put_group(group, key(gid))
                    trace.append(("put", gid, result.kept, result.dropped_invalid, result.dropped_filtered))
                else:
                    assert core.replay.batch_ready(config.batch_size)  # back-pressure only while the learner can draw
                    trace.append(("full", gid))
        elif op[0] == "release" and in_flight:
            gid, started = in_flight.pop(op[1] % len(in_flight))
            core.release(n, key(gid))
            trace.append(("release", gid))
        elif op[0] == "abandon" and in_flight:  # a rollout given up on (failed / timed out every attempt)
            gid, started = in_flight.pop(op[1] % len(in_flight))
            core.abandon(n, key(gid))
            trace.append(("abandon", gid))
        elif op[0] == "get" and drawn == v:
            overdue = core.overdue()
            batch = core.get_batch()
            if batch is not None:
                assert not (keyed and config.overdue == "wait" and overdue), "drawn while an overdue rollout ran"
                drawn += 1
                assert all(s.oldest_version >= v - config.max_staleness for s in batch.samples)
                gids = [s.group_id for s in batch.samples]
                assert all(gids.count(g) == n for g in gids)  # groups stay whole
                assert gids == sorted(gids, key=gids.index)  # and contiguous
                trace.append(("batch", msgspec.to_builtins(batch)))
            else:
                trace.append(("no batch",))
        elif op[0] == "advance" and drawn == v + 1:
            core.set_version(v + 1)
            trace.append(("version", v + 1))
        elif op[0] == "roundtrip" and roundtrips:
            state = msgspec.json.decode(msgspec.json.encode(core.state_dict()))
            core = BufferCore(config)
            core.load_state_dict(state)
        check_invariants(core, len(in_flight) * n)
        if keyed and config.overdue == "wait" and not lagged:
            assert core.metrics()["buffer/dropped_stale"] == 0, "a punctual group was dropped stale"
        trace.append(core.metrics())
    return trace


# A group admitted at v = 0 finishes after two younger batches (eta = 1): dropped under `overdue: drop`,
# waited for under `wait` (random scenarios seldom hit this order).
_V = [0.0, 1.0, 0.0]
SLOW_GROUP = [("acquire", 3), ("push", 1, 0, _V, "valid"), ("push", 1, 0, _V, "valid"), ("get", 0), ("advance", 0),
              ("acquire", 3), ("push", 1, 0, _V, "valid"), ("push", 1, 0, _V, "valid"), ("get", 0), ("advance", 0),
              ("flush", 0, 0, _V, "valid"), ("get", 0), ("advance", 0), ("get", 0)]


# eta = 2: four rollouts of v = 0 outlast two younger batches; waiting only for the overdue ones (k = 0) would
# draw v = 1's batch from the young pair and leave four samples due by v = 2, one batch: two dropped.
SLOW_FOUR = [("acquire", 3), ("acquire", 1), ("push", 4, 0, _V, "valid"), ("push", 4, 0, _V, "valid"), ("get", 0),
             ("advance", 0), ("acquire", 1), ("push", 4, 0, _V, "valid"), ("push", 4, 0, _V, "valid"), ("get", 0),
             ("flush", 0, 0, _V, "valid")] + [("get", 0), ("advance", 0)] * 4


@settings(max_examples=200, deadline=None)
@given(scenarios())
@example((BufferConfig(batch_size=2, max_staleness=1, capacity=4, overdue="wait"), 1, SLOW_GROUP, True, True))
@example((BufferConfig(batch_size=2, max_staleness=2, capacity=8, overdue="wait"), 1, SLOW_FOUR, True, True))
def test_staleness_bounds_accounting_and_checkpoint_round_trips(scenario):
    config, n, ops, keyed, punctual = scenario
    assert (run(config, n, ops, roundtrips=True, keyed=keyed, punctual=punctual)
            == run(config, n, ops, roundtrips=False, keyed=keyed, punctual=punctual))


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 4), st.integers(0, 2), st.integers(1, 6))
def test_synchronous_and_bounded_async_admission_hand_shape(n, eta, versions):
    """Fill admission at every version: exactly (eta + 1) * B before the first batch, then B per version."""
    config = BufferConfig(batch_size=n * 2, max_staleness=eta, capacity=n * 2 * (eta + 2))
    core = BufferCore(config)
    for v in range(versions):
        got = 0
        while core.try_acquire(n):
            got += n
            core.put_group(make_group(got + 1000 * v, [0.0] * (n - 1) + [1.0], version=v))
        assert got == (config.batch_size * (eta + 1) if v == 0 else config.batch_size)
        batch = core.get_batch()
        assert batch is not None and batch.size == config.batch_size
        assert max(v - s.oldest_version for s in batch.samples) <= eta
        core.set_version(v + 1)
