"""Push orchestration against in-process fake replicas: event order, atomicity, timeouts, a push made again."""

from __future__ import annotations

import asyncio
import types
from typing import Any

import numpy as np
import pytest
import torch

from asyncrl.config import WeightsyncConfig
from asyncrl.types import WeightUpdateState as S
from asyncrl.weightsync.fingerprint import tensor_fingerprint
from asyncrl.weightsync.push import BucketSource, Pusher, RegistryError, Step, WeightsyncError

from .fakes import CorruptingChannel, FakeReplica, LocalChannel, model, source_of

BUCKET_MB = 8192 / (1 << 20)  # two 4 KiB tensors per bucket -> 3 buckets for 5 tensors


def _setup(n=2, timeout_s=30.0, transport=None, **kw):
    log: list[tuple[str, str]] = []
    old = model(0)
    replicas = [FakeReplica(f"r{i}", log, weights=dict(old)) for i in range(n)]
    cfg = WeightsyncConfig(bucket_mb=BUCKET_MB, timeout_s=timeout_s)
    pub = Pusher(cfg, transport=transport or LocalChannel(), **kw)
    return pub, replicas, log, old


def _events(log, name):
    return [e for n, e in log if n == name]


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


async def test_replicas_stage_while_serving_and_are_paused_only_for_the_commit():
    pub, replicas, log, _ = _setup(n=3)
    new = model(1)
    result = await pub.push(1, source_of(pub, new), replicas)
    for r in replicas:
        assert _events(log, r.name) == ["begin:1", "load", "pause:keep", "commit:1", "resume"]
        assert r.version == 1 and _same(r.weights, new) and not r.paused
    assert result.fingerprint == tensor_fingerprint(new)
    assert pub.registry.live_version == 1 and pub.registry.get(1).state is S.LIVE
    assert sorted(pub.registry.get(1).replicas) == ["r0", "r1", "r2"]
    m = result.metrics
    assert m["weightsync/bytes"] == 5 * 64 * 16 * 4 and m["weightsync/num_buckets"] == 3
    assert m["weightsync/failed"] == 0
    assert {"weightsync/replica/r0/load_seconds", "weightsync/transport/local/put_seconds",
            "weightsync/timeline/live_s", "weightsync/gbps", "weightsync/pushes_total", "weightsync/on_live_seconds",
            "weightsync/replica/r0/pause_seconds",
            "weightsync/replica/r0/resume_seconds"} <= m.keys()
    assert m["weightsync/timeline/staging_s"] <= m["weightsync/timeline/committing_s"] <= m["weightsync/timeline/live_s"]


async def test_a_single_engine_replica_is_paused_by_its_own_commit():
    pub, replicas, log, _ = _setup(n=1)
    new = model(1)
    await pub.push(1, source_of(pub, new), replicas)
    # One call fewer: the replica's commit pauses, applies, relabels and resumes by itself.
    assert _events(log, "r0") == ["begin:1", "load", "commit:1", "own-pause"]
    assert replicas[0].version == 1 and _same(replicas[0].weights, new)


async def test_a_failed_apply_under_the_commits_own_pause_is_restored_then_resumed():
    pub, replicas, log, old = _setup(n=1)
    pub.seed(source_of(pub, old))
    replicas[0].faults[("commit", 1)] = "partial"
    with pytest.raises(WeightsyncError):
        await pub.push(1, source_of(pub, model(1)), replicas)
    ev = _events(log, "r0")
    assert ev.index("begin:0") > ev.index("commit:1") and ev[-1] == "resume"
    assert replicas[0].version == 0 and _same(replicas[0].weights, old)


async def test_load_failure_aborts_everywhere_and_publishes_nothing():
    pub, replicas, log, old = _setup()
    replicas[1].faults[("load", 1)] = "raise"
    with pytest.raises(WeightsyncError) as info:
        await pub.push(1, source_of(pub, model(1)), replicas)
    err = info.value
    assert err.step is Step.LOAD and err.replicas == ["r1"] and "r1" in str(err) and "load_bucket" in str(err)
    for r in replicas:
        ev = _events(log, r.name)
        assert ev[-1] == "abort" and not any(e.startswith(("commit", "pause")) for e in ev)  # never stopped serving
        assert r.version == 0 and _same(r.weights, old) and r.staged is None and not r.paused
    assert pub.registry.live_version == 0 and pub.registry.get(1).state is S.FAILED
    assert err.metrics["weightsync/failed"] == 1 and pub.totals["pushes_failed_total"] == 1


@pytest.mark.timeout(60)
async def test_a_hanging_replica_times_out_instead_of_hanging():
    pub, replicas, log, old = _setup(timeout_s=0.2)
    replicas[0].faults[("load", -1)] = "hang"
    with pytest.raises(WeightsyncError, match="timed out") as info:
        await pub.push(1, source_of(pub, model(1)), replicas)
    assert info.value.step is Step.LOAD and info.value.replicas == ["r0"]
    assert all(r.version == 0 and _same(r.weights, old) for r in replicas)
    assert pub.registry.get(1).state is S.FAILED and pub.registry.in_flight is None


async def test_a_failed_push_is_aborted_everywhere_and_goes_live_when_pushed_again():
    """One attempt a push: a failed one is FAILED and aborted on every replica; the same version pushed again (what
    `WeightPublisher.publish`'s recovery does) is a new record that goes live."""
    pub, replicas, log, old = _setup()
    replicas[0].faults[("load", 1)] = "raise"  # the first load only
    new = model(1)
    with pytest.raises(WeightsyncError) as info:
        await pub.push(1, source_of(pub, new), replicas)
    assert info.value.step is Step.LOAD and pub.registry.get(1).state is S.FAILED
    assert all(r.version == 0 and _same(r.weights, old) and _events(log, r.name)[-1] == "abort" for r in replicas)
    result = await pub.push(1, source_of(pub, new), replicas)
    ev = _events(log, "r0")
    assert ev[:2] == ["begin:1", "load"] and "abort" in ev
    assert ev[ev.index("abort"):] == ["abort", "begin:1", "load", "pause:keep", "commit:1", "resume"]
    assert all(r.version == 1 and _same(r.weights, new) for r in replicas)
    assert [s for s, _ in pub.registry.timeline(1)] == ["idle", "staging", "committing", "live"]
    assert result.metrics["weightsync/pushes_failed_total"] == 1 and result.metrics["weightsync/pushes_total"] == 2


async def test_corrupted_bucket_fails_verification_and_replicas_keep_the_old_version():
    pub, replicas, log, old = _setup(transport=CorruptingChannel(index=1))
    with pytest.raises(WeightsyncError, match="fingerprint mismatch") as info:
        await pub.push(1, source_of(pub, model(1)), replicas)
    assert info.value.step is Step.COMMIT and info.value.out_of_service == []
    assert all(r.version == 0 and _same(r.weights, old) for r in replicas)
    # A verify failure applied nothing: no restore was needed (only the push ran).
    assert _events(log, "r0").count("begin:1") == 1 and not any(e == "begin:0" for _, e in log)
    assert pub.registry.live_version == 0
    # The next, clean push succeeds.
    pub._transport = LocalChannel()
    new = model(2)
    await pub.push(2, source_of(pub, new), replicas)
    assert all(r.version == 2 and _same(r.weights, new) for r in replicas)


async def test_partial_commit_restores_every_replica_to_the_last_live_version():
    pub, replicas, log, old = _setup()
    pub.seed(source_of(pub, old))  # what the replicas loaded from disk
    replicas[1].faults[("commit", 1)] = "partial"
    with pytest.raises(WeightsyncError) as info:
        await pub.push(1, source_of(pub, model(1)), replicas)
    assert info.value.step is Step.COMMIT and info.value.out_of_service == []
    # r0 had committed v1 and r1 was half applied: both are back on v0, bit for bit.
    for r in replicas:
        assert r.version == 0 and _same(r.weights, old)
        ev = _events(log, r.name)
        assert ev.index("begin:0") > ev.index("commit:1") and ev[-1] == "resume"  # restored while paused
    assert pub.registry.live_version == 0
    assert info.value.metrics["weightsync/rollbacks"] == 2


async def test_unrestorable_replicas_are_reported_out_of_service():
    pub, replicas, log, _ = _setup()
    pub.seed(source_of(pub, model(0)))
    for r in replicas:
        r.allow_reload = False  # a replica that refuses to begin an older version
    replicas[1].faults[("commit", 1)] = "partial"
    with pytest.raises(WeightsyncError, match="out of service") as info:
        await pub.push(1, source_of(pub, model(1)), replicas)
    assert sorted(info.value.out_of_service) == ["r0", "r1"]
    assert pub.registry.get(1).state is S.FAILED and pub.registry.live_version == 0
    assert info.value.metrics["weightsync/out_of_service"] == 2 and pub.totals["out_of_service_total"] == 2


async def test_the_registry_records_each_push_live_or_failed():
    pub, replicas, _, _ = _setup()
    await pub.push(1, source_of(pub, model(1)), replicas)
    assert pub.registry.live_version == 1 and pub.registry.get(1).state is S.LIVE
    with pytest.raises(RegistryError, match="not registered"):  # the one record: no other version's
        pub.registry.get(2)

    replicas[0].faults[("load", 2)] = "raise"
    with pytest.raises(WeightsyncError):
        await pub.push(2, source_of(pub, model(2)), replicas)
    assert [pub.registry.get(v).state for v in (1, 2)] == [S.LIVE, S.FAILED] and pub.registry.live_version == 1
    with pytest.raises(RegistryError, match="not registered"):
        pub.registry.get(3)
    assert "injected load failure" in pub.registry.get(2).error


async def test_on_live_hook_gets_the_committed_buckets():
    from asyncrl.weightsync.bucket import Bucket
    from tests.weightsync.fakes import iter_unpacked

    stored = {}

    async def on_live(version, fingerprint, buckets):
        assert all(isinstance(b, Bucket) for b in buckets)  # cheap to hand to an actor: numpy, out of band
        stored.update(version=version, fp=fingerprint, tensors={n: t.clone() for n, t in iter_unpacked(buckets)})

    pub, replicas, _, _ = _setup(on_live=on_live)
    new = model(1)
    await pub.push(1, source_of(pub, new), replicas)
    assert stored["version"] == 1 and _same(stored["tensors"], new)
    assert stored["fp"] == tensor_fingerprint(new)


@pytest.mark.parametrize("kind, hybrid", [("auto", True), ("ipc", False)])
def test_ipc_is_chosen_for_shared_devices_and_streams_like_the_collectives(kind, hybrid, ray_session):
    from asyncrl.weightsync.service import select_channel
    from asyncrl.weightsync.transport import BroadcastChannel

    transport = select_channel(WeightsyncConfig(transport=kind), on_gpu=True, hybrid=hybrid)
    assert isinstance(transport, BroadcastChannel) and transport.name == "ipc" and transport.streamed


def test_ipc_is_refused_without_a_gpu_learner_naming_what_to_use():
    """CUDA IPC hands the engines the learner's device memory: a CPU learner gets a config error, not an alias."""
    from asyncrl.weightsync.service import select_channel
    from asyncrl.weightsync.transport import ChannelUnavailable

    with pytest.raises(ChannelUnavailable, match="transport='ipc'.*use 'shm'"):
        select_channel(WeightsyncConfig(transport="ipc"), on_gpu=False)


@pytest.mark.parametrize("on_gpu, hybrid, own_gpus, one_host, gpus, expected", [
    (True, True, False, True, 1, "ipc"),        # hybrid: learner and engines take turns on the same devices
    (False, True, False, True, 0, "shm"),       # ... on CPUs (ipc is CUDA memory)
    (True, False, False, True, 1, "ipc"),       # one GPU on the host: everyone shares it (was shm: 0.53 s vs 0.06 s a push)
    (True, False, True, True, 2, "nccl"),       # whole GPUs each, one host
    (True, False, False, True, 2, "shm"),       # fractional GPUs on a host of two: where they sit is Ray's choice
    (False, False, False, True, 0, "shm"),      # CPU learner, one host
    (True, False, True, False, 8, "nccl"),      # several hosts, GPU learner
    (False, False, False, False, 0, "object_store"),
])
def test_auto_transport_follows_where_the_learner_and_engines_sit(on_gpu, hybrid, own_gpus, one_host, gpus, expected):
    from asyncrl.weightsync.service import auto_transport

    assert auto_transport(on_gpu=on_gpu, hybrid=hybrid, own_gpus=own_gpus, one_host=one_host, gpus=gpus) == expected


def test_nccl_with_a_cpu_learner_is_refused_with_the_way_out():
    from asyncrl.weightsync.service import select_channel
    from asyncrl.weightsync.transport import ChannelUnavailable

    with pytest.raises(ChannelUnavailable, match="needs the learner on GPUs.*'gloo'"):
        select_channel(WeightsyncConfig(transport="nccl"), on_gpu=False)


async def test_a_push_of_buckets_the_learner_packed_reads_its_digests_or_hashes_them():
    from asyncrl.weightsync.bucket import iter_buckets

    pub, replicas, log, _ = _setup(n=2)
    new = model(1)
    handles = list(iter_buckets(iter(new.items()), BUCKET_MB))  # LocalChannel: a handle is the bucket
    source = BucketSource(handles, pub._transport)  # no digests from the packer: hashed here
    assert source.hash_seconds > 0 and source.fingerprint() == tensor_fingerprint(new)
    result = await pub.push(1, source, replicas)
    for r in replicas:
        assert _events(log, r.name) == ["begin:1", "load", "pause:keep", "commit:1", "resume"]
        assert r.version == 1 and _same(r.weights, new)
    assert result.fingerprint == tensor_fingerprint(new)
    assert result.metrics["weightsync/bytes"] == 5 * 64 * 16 * 4 and result.metrics["weightsync/num_buckets"] == 3
    assert pub.registry.live_version == 1


async def test_a_push_with_an_unreadable_handle_registers_nothing():
    class Broken(LocalChannel):
        def fetch(self, handle):
            if handle == "gone":
                raise OSError("object lost")
            return super().fetch(handle)

    pub, replicas, log, _ = _setup(transport=Broken())
    with pytest.raises(OSError, match="object lost"):
        await pub.push(1, BucketSource(["gone"], pub._transport), replicas)
    assert pub.registry.in_flight is None and pub.registry.live_version == 0 and log == []
    assert (await pub.push(1, source_of(pub, model(1)), replicas)).fingerprint == tensor_fingerprint(model(1))
    assert pub.registry.live_version == 1


@pytest.mark.parametrize("verify, caught", [("full", True), ("checksum", True), ("off", False)])
async def test_verify_mode_decides_what_a_commit_checks(verify, caught):
    # One flipped byte at the start of a tensor.
    pub, replicas, log, old = _setup(transport=CorruptingChannel(index=1))
    pub._cfg = WeightsyncConfig(bucket_mb=BUCKET_MB, timeout_s=30.0, verify=verify)
    new = model(1)
    if caught:
        with pytest.raises(WeightsyncError, match="fingerprint mismatch"):
            await pub.push(1, source_of(pub, new), replicas)
        assert pub.registry.live_version == 0 and all(_same(r.weights, old) for r in replicas)
    else:  # `off` checks names, dtypes and shapes only: the flipped byte goes live (documented)
        result = await pub.push(1, source_of(pub, new), replicas)
        assert result.fingerprint.startswith("off:") and not _same(replicas[0].weights, new)
    assert all(r.verify == verify for r in replicas)  # the mode travels with the update's first load


async def test_shm_transport_owns_its_files_from_push_to_release_and_packers_write_them_again():
    import os

    from asyncrl.weightsync.shm import FREE, ShmChannel

    transport = ShmChannel()
    pub, replicas, log, old = _setup(transport=transport)
    r1 = await pub.push(1, source_of(pub, model(1)), replicas)
    files1 = [h.path for h in pub._host.handles]
    assert len(files1) == 3 and all(os.path.exists(f) for f in files1)  # the host copy, for rollback
    assert all(_same(r.weights, model(1)) for r in replicas) and r1.fingerprint == tensor_fingerprint(model(1))

    await pub.push(2, source_of(pub, model(2)), replicas)
    files2 = [h.path for h in pub._host.handles]
    assert not set(files1) & set(files2) and all(os.path.exists(f) for f in files2)
    # version 1's files are released to the packers (no fresh pages for the next export), not unlinked
    assert not any(os.path.exists(f) for f in files1) and all(os.path.exists(f + FREE) for f in files1)

    replicas[0].faults[("load", -1)] = "raise"  # a failed push releases its own files, keeps the live ones
    free = {os.path.join(os.path.dirname(files1[0]), n) for n in os.listdir(os.path.dirname(files1[0])) if n.endswith(FREE)}
    source = source_of(pub, model(3))
    written = [h.path for h in source.handles]
    assert len(written) == 3 and all(f + FREE in free for f in written)  # packed into released files (version 1's)
    with pytest.raises(WeightsyncError):
        await pub.push(3, source, replicas)
    assert all(os.path.exists(f + FREE) for f in written) and all(os.path.exists(f) for f in files2)
    assert all(_same(r.weights, model(2)) for r in replicas)

    # an export that takes none of them (another size): once it is read, the released files are unlinked
    other = source_of(pub, {"x": torch.ones(7)})
    assert not any(os.path.exists(f + FREE) or os.path.exists(f) for f in written)
    transport.release(other.handles[0])

    transport.close()  # also run when the transport is collected or the process exits
    assert not any(os.path.exists(f) for f in files2) and not os.path.exists(other.handles[0].path + FREE)


async def test_a_push_with_a_tensor_in_two_buckets_is_refused_and_registers_nothing():
    from asyncrl.weightsync.bucket import iter_buckets

    pub, replicas, log, _ = _setup()
    new = model(1)
    handles = list(iter_buckets(iter(new.items()), BUCKET_MB)) + list(iter_buckets([("layer0.weight", new["layer0.weight"])], BUCKET_MB))
    with pytest.raises(ValueError, match="appears twice"):
        await pub.push(1, BucketSource(handles, pub._transport), replicas)
    assert pub.registry.in_flight is None and pub.registry.live_version == 0 and log == []


class _FlakyControl:
    """EngineControl's `call`, failing the health check `unhealthy` times (a replica being replaced)."""

    def __init__(self, unhealthy: int, empty: int = 0) -> None:
        self.unhealthy, self.empty, self.calls = unhealthy, empty, []

    async def call(self, verb, *args, timeout_s=None):
        self.calls.append(verb.__name__)
        if verb.__name__ == "check_health" and self.unhealthy:
            self.unhealthy -= 1
            raise RuntimeError("replica abc: engine is dead")
        if self.empty:  # the dead replica is gone and its replacement not running yet
            self.empty -= 1
            return {}
        return {"unknown-0": None}


def _recovering_publisher(failures, recovery_s=30.0, unhealthy=1, empty=0):
    """A WeightPublisher whose pushes fail with `failures` (one per attempt) before one succeeds."""
    from asyncrl.weightsync.service import WeightPublisher

    wp = WeightPublisher.__new__(WeightPublisher)
    wp.cfg = WeightsyncConfig(recovery_s=recovery_s, timeout_s=5)
    wp.pusher, wp.recoveries_total, wp.link = object(), 0, None
    wp._stopping = asyncio.Event()
    wp.replicas = type("R", (), {"control": _FlakyControl(unhealthy, empty)})()
    attempts = []

    async def once(version):
        attempts.append(version)
        if len(attempts) <= len(failures):
            step = failures[len(attempts) - 1]
            raise WeightsyncError(f"push {version} failed at {step.value}", version=version, step=step, replicas=["engines"])
        return {"weightsync/push_seconds": 0.1}

    wp._publish_once = once
    return wp, attempts


async def test_a_push_that_failed_on_a_replica_is_pushed_again_once_the_replicas_are_healthy():
    wp, attempts = _recovering_publisher([Step.PAUSE, Step.LOAD], unhealthy=1, empty=1)
    metrics = await wp.publish(7)
    assert attempts == [7, 7, 7] and metrics["weightsync/recoveries"] == 2 and metrics["weightsync/recoveries_total"] == 2
    # The first wait found a replica still dead, then none running, then one healthy; the second found it healthy.
    assert wp.replicas.control.calls == ["check_health"] * 4


@pytest.mark.parametrize("failures, recovery_s", [([Step.EXPORT], 30.0), ([Step.LOAD], 0.0)])
async def test_an_export_failure_or_no_recovery_time_stops_at_the_first_failed_push(failures, recovery_s):
    wp, attempts = _recovering_publisher(failures, recovery_s=recovery_s)
    with pytest.raises(WeightsyncError, match=f"failed at {failures[0].value}"):
        await wp.publish(3)
    assert attempts == [3] and wp.replicas.control.calls == []


async def test_a_stopping_run_does_not_push_a_failed_version_again():
    # The app is stopping (its engines too): the first failure ends the push, no health waits.
    wp, attempts = _recovering_publisher([Step.LOAD], unhealthy=1)
    wp.stop_recovering()
    with pytest.raises(WeightsyncError, match="failed at load"):
        await asyncio.wait_for(wp.publish(8), 5)
    assert attempts == [8] and wp.replicas.control.calls == []
    # A stop that arrives while the push waits for the engines to recover ends the wait at once.
    wp, attempts = _recovering_publisher([Step.LOAD, Step.LOAD], unhealthy=100)
    push = asyncio.create_task(wp.publish(9))
    while not wp.replicas.control.calls:
        await asyncio.sleep(0.01)
    wp.stop_recovering()
    with pytest.raises(WeightsyncError, match="failed at load"):
        await asyncio.wait_for(push, 5)
    assert attempts == [9, 9]


async def test_a_push_that_failed_because_a_learner_rank_died_is_not_retried():
    """The sending learner rank was killed mid-broadcast (seen in the learner-kill e2e test): the receivers
    fail at load_bucket with the rank's LearnerRankError behind it. The learner group is unusable until the
    trainer restarts it, so the push goes up at once instead of being retried for recovery_s."""
    from asyncrl.types import LearnerRankError, learner_failure

    wp, attempts = _recovering_publisher([], recovery_s=30.0, unhealthy=0)
    wp.link = object()

    async def once(version):
        attempts.append(version)
        try:
            raise LearnerRankError(None, "collective_group", "group unusable after an earlier failure: rank 0 died")
        except LearnerRankError as died:
            raise WeightsyncError(f"push {version} failed at load_bucket", version=version, step=Step.LOAD,
                                  replicas=["broadcast group"]) from died

    wp._publish_once = once
    with pytest.raises(WeightsyncError, match="failed at load_bucket") as err:
        await asyncio.wait_for(wp.publish(4), 5)
    assert attempts == [4] and wp.replicas.control.calls == [] and learner_failure(err.value) is not None


async def test_a_failed_collective_send_is_recovered_only_when_a_receiver_is_unhealthy_or_was_waited_for():
    # The broadcast failed and a replica is dead: the receivers' side, so it is pushed again.
    wp, attempts = _recovering_publisher([Step.EXPORT], unhealthy=1)
    wp.link = types.SimpleNamespace(receivers_failed=False)  # a collective transport: the sender streams into the replicas
    metrics = await wp.publish(4)
    assert attempts == [4, 4] and metrics["weightsync/recoveries"] == 1
    # Every replica healthy: the learner's export itself failed, stop at once.
    wp, attempts = _recovering_publisher([Step.EXPORT], unhealthy=0)
    wp.link = types.SimpleNamespace(receivers_failed=False)
    with pytest.raises(WeightsyncError, match="failed at export"):
        await wp.publish(5)
    assert attempts == [5] and wp.replicas.control.calls == ["check_health"]
    # Every replica healthy now, but the publisher stopped the sender, which waited for a group member no load
    # reached (the chaos soak: a replacement replica joined the groups after the push's begin): pushed again.
    wp, attempts = _recovering_publisher([Step.EXPORT], unhealthy=0)
    wp.link = types.SimpleNamespace(receivers_failed=True)
    metrics = await wp.publish(6)
    assert attempts == [6, 6] and metrics["weightsync/recoveries"] == 1


async def test_the_store_hook_never_waits_and_sends_the_newest_version_after_the_one_in_flight():
    """`weight_store_hook`: one store update in flight; versions that go live meanwhile wait in one slot
    (the newest replaces the older), the hook returns at once, and a failed update is the next call's error."""
    from asyncrl.weightsync.bucket import Bucket
    from asyncrl.weightsync.service import weight_store_hook

    sent: list[tuple[int, Any]] = []
    gates: list[asyncio.Future] = []

    class _Store:
        class publish:  # noqa: N801 - Ray's actor-method shape: store.publish.remote(...)
            @staticmethod
            def remote(version, buckets, fingerprint, plan):
                sent.append((version, plan))
                gates.append(_loop.create_future())
                return gates[-1]

    _loop = asyncio.get_running_loop()
    hf = [Bucket(buffer=np.zeros(8, np.uint8), metas=[])]
    engine = [Bucket(buffer=np.zeros(8, np.uint8), metas=[], rank=0)]
    hook = weight_store_hook(_Store(), lambda version: f"plan-{version}")
    await asyncio.wait_for(hook(1, "fp1", engine), 1.0)  # returns while the store has not answered
    for _ in range(50):
        if sent:
            break
        await asyncio.sleep(0.01)
    assert sent == [(1, "plan-1")]
    await hook(2, "fp2", engine)
    await hook(3, "fp3", hf)  # replaces version 2, which never reaches the store
    await asyncio.sleep(0.05)
    assert sent == [(1, "plan-1")]  # one update in flight
    gates[0].set_exception(RuntimeError("store down"))
    for _ in range(50):
        if len(sent) == 2:
            break
        await asyncio.sleep(0.01)
    assert sent == [(1, "plan-1"), (3, None)]  # the newest, and Hugging Face buckets go without a plan
    with pytest.raises(RuntimeError, match="store down"):
        await hook(4, "fp4", engine)  # version 1's failure, reported once; 4 waits behind 3
    gates[1].set_result(None)
    for _ in range(50):
        if len(sent) == 3:
            break
        await asyncio.sleep(0.01)
    assert sent[-1] == (4, "plan-4")
    gates[2].set_result(None)
    await hook(5, "fp5", engine)  # no error left to report


def test_the_store_reads_a_versions_object_refs_where_they_lie(ray_session):
    """A version sent to the WeightStore actor as ObjectRefs (the object-store and collective transports'
    handles) is read there, not copied through the publisher: a late joiner gets the same buckets, with the
    plan for engine-layout buckets and without one for Hugging Face buckets."""
    from asyncrl.weightsync.bucket import iter_buckets
    from asyncrl.weightsync.service import WeightStore
    from tests.weightsync.fakes import iter_unpacked

    ray = ray_session
    store = ray.remote(WeightStore).options(num_cpus=0).remote()
    w = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16)}
    buckets = list(iter_buckets(w.items(), 1e-5))  # one tensor a bucket
    assert len(buckets) == 2
    ray.get(store.publish.remote(1, [ray.put(b) for b in buckets], tensor_fingerprint(w), "a-plan"))
    version, got, fp, plan = ray.get(store.latest.remote())
    assert version == 1 and fp == tensor_fingerprint(w) and plan is None  # HF: no plan
    assert _same(dict(iter_unpacked(got)), w)
    w2 = {k: v * 2 for k, v in w.items()}
    twice = list(iter_buckets(w2.items(), 1e-5))
    for b in twice:
        b.rank = 0
    from asyncrl.weightsync.bucket import digest_key_prefix
    from asyncrl.weightsync.fingerprint import bucket_digests, combine_digests

    fp2 = combine_digests({k: v for b in twice for k, v in bucket_digests(b, "full", digest_key_prefix(b)).items()})
    with pytest.raises(ray.exceptions.RayTaskError, match="fingerprint mismatch"):
        ray.get(store.publish.remote(2, [ray.put(b) for b in twice], fp))
    ray.get(store.publish.remote(2, [ray.put(twice[0]), twice[1]], fp2, "a-plan"))  # refs and buckets alike
    version, _, _, plan = ray.get(store.latest.remote())
    assert version == 2 and plan == "a-plan"
