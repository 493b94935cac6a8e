"""Version registry: the state machine, the live rule, the timeline."""

from __future__ import annotations

import pytest

from asyncrl.types import WeightUpdateState as S
from asyncrl.weightsync.push import RegistryError, VersionRegistry


def _kept(reg: VersionRegistry, versions: range) -> list[int]:
    """The versions among `versions` whose records the registry still holds (`get` raises for the others)."""
    out = []
    for v in versions:
        try:
            reg.get(v)
        except RegistryError:
            continue
        out.append(v)
    return out


def _to_committing(reg: VersionRegistry, version: int) -> None:
    reg.begin(version)
    reg.transition(version, S.STAGING)
    reg.transition(version, S.COMMITTING)


def test_happy_path_records_timeline_and_live_version():
    reg = VersionRegistry()
    _to_committing(reg, 1)
    reg.replica_committed(1, "a")
    reg.replica_committed(1, "b")
    rec = reg.go_live(1, ["a", "b"])
    assert rec.state is S.LIVE and reg.live_version == 1 and reg.in_flight is None
    assert [s for s, _ in reg.timeline(1)] == ["idle", "staging", "committing", "live"]
    times = [t for _, t in reg.timeline(1)]
    assert times == sorted(times) and rec.replicas == ["a", "b"]


def test_live_needs_every_replica():
    reg = VersionRegistry()
    _to_committing(reg, 1)
    reg.replica_committed(1, "a")
    with pytest.raises(RegistryError, match=r"\['b'\]"):
        reg.go_live(1, ["a", "b"])
    assert reg.live_version == 0


@pytest.mark.parametrize(
    "path, bad",
    [
        ([], S.COMMITTING),  # IDLE -> COMMITTING skips staging
        ([S.STAGING], S.IDLE),
        ([S.STAGING, S.FAILED], S.STAGING),  # FAILED is terminal
        ([S.STAGING, S.FAILED], S.COMMITTING),
        ([S.STAGING], S.LIVE),  # LIVE only through go_live
    ],
)
def test_illegal_transitions_are_rejected(path, bad):
    reg = VersionRegistry()
    reg.begin(1)
    for state in path:
        reg.transition(1, state, error="x")
    before = reg.get(1).state
    with pytest.raises(RegistryError):
        reg.transition(1, bad)
    assert reg.get(1).state is before


def test_failed_version_is_never_live_and_can_be_pushed_again():
    reg = VersionRegistry()
    _to_committing(reg, 1)
    reg.transition(1, S.FAILED, error="boom")
    with pytest.raises(RegistryError):
        reg.go_live(1, [])
    assert reg.live_version == 0 and reg.get(1).error == "boom"
    reg.begin(1)  # the learner pushes the same version again
    assert reg.get(1).state is S.IDLE and reg.get(1).error is None  # a new record: the failed one's error gone


def test_versions_must_increase_and_one_push_at_a_time():
    reg = VersionRegistry()
    reg.begin(2)
    with pytest.raises(RegistryError, match="still being pushed"):
        reg.begin(3)
    reg.transition(2, S.STAGING)
    reg.transition(2, S.COMMITTING)
    reg.go_live(2, [])
    for v in (1, 2):
        with pytest.raises(RegistryError, match="not newer"):
            reg.begin(v)


def test_a_version_pushed_again_starts_a_record_without_the_failed_pushs_commits():
    reg = VersionRegistry()
    _to_committing(reg, 1)
    reg.replica_committed(1, "a")
    with pytest.raises(RegistryError):
        reg.transition(1, S.STAGING)  # one attempt a push: a failed one ends FAILED
    reg.transition(1, S.FAILED, error="b failed")
    _to_committing(reg, 1)  # pushed again
    assert reg.get(1).replicas == []
    with pytest.raises(RegistryError):
        reg.go_live(1, ["a"])  # "a" committed the failed push only


def test_only_the_last_versions_records_are_kept_and_the_live_ones_always():
    reg = VersionRegistry(history=3)
    for v in range(1, 11):  # v10 fails: v9 stays live
        reg.begin(v)
        reg.transition(v, S.STAGING)
        if v == 10:
            reg.transition(v, S.FAILED, error="x")
            continue
        reg.transition(v, S.COMMITTING)
        reg.replica_committed(v, "r0")
        reg.go_live(v, ["r0"])
    assert _kept(reg, range(12)) == [8, 9, 10] and reg.live_version == 9
    with pytest.raises(RegistryError, match="not registered"):
        reg.timeline(7)
    for v in (11, 12, 13):  # failed pushes do not push the live version's record out
        reg.begin(v)
        reg.transition(v, S.FAILED, error="x")
    assert _kept(reg, range(15)) == [9, 12, 13] and reg.get(9).state is S.LIVE
