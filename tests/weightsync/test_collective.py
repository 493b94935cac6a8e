"""The collective transport's wire protocol and its push path, over real gloo groups (one rank per thread). The
NCCL backend runs the same code on GPUs, and ipc (CUDA only) its own: tests/weightsync/test_collective_gpu.py and
benchmarks/weightsync.py --transports nccl,ipc."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import pytest
import torch

from asyncrl.config import WeightsyncConfig
from asyncrl.generator.worker_ext import WeightUpdateExtension
from asyncrl.types import GroupsReport, HostCopies, LoadReport, SenderAddress, WeightExport
from asyncrl.types import WeightUpdateState as S
from asyncrl.weightsync.bucket import digest_key_prefix, unpack_bucket
from asyncrl.weightsync.collective import (
    CollectiveError,
    CollectiveGroup,
    CollectiveReceive,
    GateClosed,
    GroupSpec,
    SenderAborted,
    form_specs,
    free_port,
    join_as_sender,
    reserve_port,
)
from asyncrl.weightsync.fingerprint import bucket_digests, combine_digests, tensor_digests, tensor_fingerprint
from asyncrl.weightsync.push import Pusher, Step, WeightsyncError
from asyncrl.weightsync.stream import broadcast_receive_stream as receive_stream
from asyncrl.weightsync.stream import broadcast_send_stream as send_stream

from .fakes import FakeReplica, LocalChannel, model, streamed

BUCKET_MB = 8192 / (1 << 20)  # two 4 KiB tensors per bucket -> 3 buckets for 5 tensors


def _spec(receivers=2, timeout_s=20.0, gid="g", backend="gloo") -> GroupSpec:
    (spec,) = form_specs(backend, [("127.0.0.1", free_port("127.0.0.1"))], {"rep": receivers},
                         timeout_s=timeout_s, group_prefix=gid)
    return spec


def _push_while_receiving(sender: CollectiveGroup, receivers: list[CollectiveGroup], receive, weights: dict, verify: str):
    """One push of `weights` from `sender` while each receiver runs `receive(group)` in a thread."""
    threads = [threading.Thread(target=receive, args=(g,)) for g in receivers]
    for t in threads:
        t.start()
    sent = send_stream(sender, iter(weights.items()), BUCKET_MB, verify=verify, timeout_s=20)
    for t in threads:
        t.join(30)
    return sent


def _join_all(spec: GroupSpec) -> list[CollectiveGroup]:
    with ThreadPoolExecutor(spec.world_size) as pool:
        return list(pool.map(lambda r: CollectiveGroup.join(spec, r), range(spec.world_size)))


def test_form_specs_gives_each_replica_a_rank_block_in_id_order():
    specs = form_specs("nccl", [("h0", 1), ("h1", 2)], {"b": 2, "a": 1}, timeout_s=5, group_prefix="x")
    assert [s.group_id for s in specs] == ["x-s0", "x-s1"] and [s.sender for s in specs] == [0, 1]
    assert all(s.world_size == 4 and s.receivers == {"a": 1, "b": 2} for s in specs)
    assert specs[1].host == "h1" and specs[1].port == 2
    assert specs[0].receiver_rank("b", 1) == 3
    with pytest.raises(CollectiveError, match="without replica 'c'"):
        specs[0].receiver_rank("c", 0)
    with pytest.raises(CollectiveError, match="outside"):
        specs[0].receiver_rank("b", 2)
    with pytest.raises(CollectiveError, match="no engine replica"):
        form_specs("gloo", [("h", 1)], {}, timeout_s=5, group_prefix="x")
    from dataclasses import asdict

    assert GroupSpec(**asdict(specs[1])) == specs[1]  # as the workers get it


def test_the_senders_reserved_port_stays_taken_until_its_store_serves_the_group_on_it():
    backend = "gloo"
    sock = reserve_port("127.0.0.1")
    port = sock.getsockname()[1]
    with socket.socket() as other, pytest.raises(OSError):  # no other process can take it meanwhile
        other.bind(("127.0.0.1", port))
    (spec,) = form_specs(backend, [("127.0.0.1", port)], {"rep": 1}, timeout_s=20.0, group_prefix="reserved")
    with ThreadPoolExecutor(2) as pool:
        sender, receiver = pool.map(lambda r: join_as_sender(spec, sock) if r == 0 else CollectiveGroup.join(spec, r), (0, 1))
    assert sock.fileno() == -1  # the store owns the socket now
    weights = model(2)
    got: dict[str, torch.Tensor] = {}

    def receive() -> None:
        for bucket in receive_stream(receiver, time.monotonic() + 20):
            got.update({n: t.clone() for n, t in unpack_bucket(bucket)})

    thread = threading.Thread(target=receive)
    thread.start()
    send_stream(sender, iter(weights.items()), BUCKET_MB, verify="full", timeout_s=20)
    thread.join(30)
    assert got.keys() == weights.keys() and all(torch.equal(got[k], weights[k]) for k in weights)
    for g in (sender, receiver):
        g.close()


def test_the_senders_join_drops_a_reserved_socket_that_is_not_on_the_specs_port():
    """A socket from an older address is closed, and the store serves on the spec's port."""
    spec = _spec(receivers=1)
    older = reserve_port("127.0.0.1")
    with ThreadPoolExecutor(2) as pool:
        sender, receiver = pool.map(lambda r: join_as_sender(spec, older) if r == 0 else CollectiveGroup.join(spec, r), (0, 1))
    assert older.fileno() == -1 and sender.rank == 0 and receiver.rank == 1
    for g in (sender, receiver):
        g.close()


def test_every_receiver_gets_every_bucket_bit_exact_and_the_sender_keeps_host_copies():
    backend = "gloo"
    spec = _spec(receivers=2, backend=backend)
    sender, *receivers = _join_all(spec)
    weights = model(3)
    weights["bf16"] = torch.randn(7, 5).to(torch.bfloat16)
    weights["empty"] = torch.empty(0, 3)
    got: dict[int, dict[str, torch.Tensor]] = {}

    mine: dict[int, dict[str, bytes]] = {}

    def receive(group: CollectiveGroup) -> None:
        out: dict[str, torch.Tensor] = {}
        own = mine.setdefault(group.rank, {})
        for bucket in receive_stream(group, time.monotonic() + 20):
            own.update(bucket_digests(bucket, "full"))
            out.update({n: t.clone() for n, t in unpack_bucket(bucket)})
        got[group.rank] = out

    sent = _push_while_receiving(sender, receivers, receive, weights, "full")
    assert sorted(got) == [1, 2]
    # what each receiver hashes of what landed is what the sender hashed (the publisher compares the two at the commit)
    assert mine == {1: sent.digests, 2: sent.digests} and len(sent.digests) == len(weights)
    for out in got.values():
        assert out.keys() == weights.keys() and all(torch.equal(out[k], weights[k]) for k in weights)
    kept = sent.host_copies.result()
    host = {n: t for b in kept for n, t in unpack_bucket(b)}
    assert all(torch.equal(host[k], weights[k]) for k in weights)
    assert sent.num_tensors == len(weights) and sent.bytes == sum(t.numel() * t.element_size() for t in weights.values())
    assert len(kept) >= 3 and set(sent.seconds) == {"pack", "broadcast", "host_copy", "hash", "hash_wait"}
    assert combine_digests(sent.digests, "full") == tensor_fingerprint(weights, "full")
    for g in (sender, *receivers):
        g.close()


def test_a_whole_version_broadcast_receives_every_bucket_into_one_allocation():
    """A broadcast push: one table, then every bucket back to back into one receive buffer (views
    of it, in order), without digests in band (the sender's go back to the publisher only)."""
    spec = _spec(receivers=1)
    sender, receiver = _join_all(spec)
    weights = model(3)
    seen: dict[str, list] = {"storages": [], "tensors": {}, "buffers": []}

    def receive(group: CollectiveGroup) -> None:
        for bucket in receive_stream(group, time.monotonic() + 20):
            seen["buffers"].append(bucket.buffer)  # held, so a freed bucket's memory cannot come back as the next one's
            seen["storages"].append(bucket.buffer.untyped_storage().data_ptr())
            seen["tensors"].update({n: t.clone() for n, t in unpack_bucket(bucket)})

    sent = _push_while_receiving(sender, [receiver], receive, weights, "checksum")
    assert sent.num_buckets >= 3 and len(seen["storages"]) == sent.num_buckets
    assert len(set(seen["storages"])) == 1
    assert all(torch.equal(seen["tensors"][k], weights[k]) for k in weights)
    assert combine_digests(sent.digests, "checksum") == tensor_fingerprint(weights, "checksum")
    sent.host_copies.result()
    for g in (sender, receiver):
        g.close()


def _identity_plan(weights: dict[str, torch.Tensor], bucket_mb: float):
    """A push plan for a module whose parameters are `weights` as named (an engine that loads each
    tensor as it is): probed like an engine's, so the buckets are the engine layout's."""
    from asyncrl.weightsync.plan import ManifestEntry, build_plan, probe_layout

    module = torch.nn.Module()
    for n, t in weights.items():
        module.register_parameter(n, torch.nn.Parameter(torch.zeros_like(t)))
    manifest = [ManifestEntry(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in weights.items()]

    def load(items):
        live = dict(module.named_parameters())
        for n, t in items:
            live[n].data.copy_(t)

    return build_plan(manifest, [probe_layout(module, manifest, load=load)], bucket_mb)


def test_a_planned_whole_push_puts_each_bucket_on_the_wire_as_soon_as_it_is_packed(monkeypatch):
    """With a push plan the sender announces the whole version's table before packing (the plan
    knows it) and broadcasts each bucket once packed: a receiver holds bucket 0 while the export
    is still producing the last tensor. The bytes, the sender's digests after the last bucket and
    the host copies are as without a plan; the buckets share one arena, hashed in one pass once the
    last bucket is on the wire."""
    import asyncrl.weightsync.stream as stream

    passes: list[tuple[int, float]] = []
    one_pass = stream.hash_whole_lazy
    monkeypatch.setattr(stream, "hash_whole_lazy",
                        lambda buckets, *a, **k: passes.append((len(buckets), time.monotonic())) or one_pass(buckets, *a, **k))
    spec = _spec(receivers=1, backend="gloo")
    sender, receiver = _join_all(spec)
    weights = {f"t{i}": torch.full((2048,), float(i)) for i in range(6)}  # 3 planned buckets of 2 tensors
    plan = _identity_plan(weights, 2 * BUCKET_MB)
    assert len(plan.buckets) == 3
    produced: list[float] = []
    received: list[float] = []
    got: dict[str, torch.Tensor] = {}
    theirs: dict[str, bytes] = {}

    def slow_export():
        for n, t in weights.items():
            time.sleep(0.3)
            produced.append(time.monotonic())
            yield n, t

    def receive(group):
        for bucket in receive_stream(group, time.monotonic() + 20):
            received.append(time.monotonic())
            got.update({n: t.clone() for n, t in unpack_bucket(bucket)})
            theirs.update(bucket_digests(bucket, "checksum", digest_key_prefix(bucket)))

    th = threading.Thread(target=receive, args=(receiver,))
    th.start()
    sent = send_stream(sender, slow_export(), BUCKET_MB, verify="checksum", timeout_s=20, plan=plan)
    th.join(30)
    assert len(received) == 3 and received[0] < produced[-1]  # bucket 0 arrived before the export ended
    assert got.keys() == weights.keys() and all(torch.equal(got[k], weights[k]) for k in weights)
    assert theirs == sent.digests and len(sent.digests) == len(weights)
    assert [n for n, _ in passes] == [3] and passes[0][1] > produced[-1]  # every bucket, in one pass at the end
    assert len(sent.host_copies.result()) == 3
    for g in (sender, receiver):
        g.close()


def _planned_push(sender, receiver, weights, plan, **send_kw):
    """One planned whole-version push over gloo; (sent, what the receiver staged, its digests of what landed)."""
    got: dict[str, torch.Tensor] = {}
    theirs: dict[str, bytes] = {}

    def receive(group):
        for bucket in receive_stream(group, time.monotonic() + 20):
            got.update({n: t.clone() for n, t in unpack_bucket(bucket)})
            theirs.update(bucket_digests(bucket, "checksum", digest_key_prefix(bucket)))

    th = threading.Thread(target=receive, args=(receiver,))
    th.start()
    sent = send_stream(sender, iter(weights.items()), BUCKET_MB, verify="checksum", timeout_s=20, plan=plan, **send_kw)
    th.join(30)
    return sent, got, theirs


@pytest.mark.parametrize("verify", ["full", "checksum", "off"])
def test_a_whole_push_is_hashed_alike_on_both_ends_push_after_push(verify):
    """A whole planned version's buckets and end header are one receive, and what the receiver hashes
    of what landed is what the sender hashed, in every verify mode: two pushes of one plan (each
    receiving its own bytes), then one of another plan (other buckets, a table of its own)."""
    spec = _spec(receivers=1, backend="gloo")
    sender, receiver = _join_all(spec)
    g = torch.Generator().manual_seed(5)
    weights = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate([40000, 300, 70000, 5])}  # > 128 KiB: windows
    plans = [_identity_plan(weights, BUCKET_MB)] * 2 + [_identity_plan(weights, 64.0)]
    assert len(plans[2].buckets) < len(plans[0].buckets)
    for step, plan in enumerate(plans):
        pushed = {k: v + step for k, v in weights.items()}
        theirs: dict[str, bytes] = {}
        handed: list = []

        def receive(group):
            got = {}
            for bucket in receive_stream(group, time.monotonic() + 20):
                handed.append(bucket)
                got.update({n: t.clone() for n, t in unpack_bucket(bucket)})
                theirs.update(bucket_digests(bucket, verify, digest_key_prefix(bucket)))
            assert got.keys() == pushed.keys() and all(torch.equal(got[k], pushed[k]) for k in got)

        th = threading.Thread(target=receive, args=(receiver,))
        th.start()
        sent = send_stream(sender, iter(pushed.items()), BUCKET_MB, verify=verify, timeout_s=20, plan=plan)
        th.join(30)
        assert len(handed) == len(plan.buckets) and theirs == sent.digests and len(theirs) == len(weights)
        assert theirs == tensor_digests([(f"0/{k}", v) for k, v in pushed.items()], verify)  # (engine rank 0's keys)
        sent.host_copies.result()
    for grp in (sender, receiver):
        grp.close()


def test_a_sender_ring_sends_a_planned_version_through_reused_slots_bit_exact(monkeypatch, caplog):
    """A sender whose device cannot hold the whole packed version (`arena="ring"`, or `auto` after the
    whole arena's allocation ran out of memory) packs it through a few reused slots. The receiver gets
    the same table and bytes, the digests are the whole arena's, and the host copies (what a restore
    and the late joiners read) are every bucket's own bytes though their slots were overwritten."""
    import asyncrl.weightsync.bucket as arena
    import asyncrl.weightsync.stream as stream

    spec = _spec(receivers=1, backend="gloo")
    sender, receiver = _join_all(spec)
    weights = {f"t{i}": torch.full((2048,), float(i)) for i in range(12)}  # 6 planned buckets of 2 tensors
    plan = _identity_plan(weights, 2 * BUCKET_MB)
    assert len(plan.buckets) == 6
    rings: list = []
    real_ring = stream.SenderRing
    monkeypatch.setattr(stream, "SenderRing", lambda *a, **k: rings.append(real_ring(*a, **k)) or rings[-1])

    whole, got_whole, _ = _planned_push(sender, receiver, weights, plan, arena="whole")
    ring, got, theirs = _planned_push(sender, receiver, weights, plan, arena="ring")
    assert len(rings) == 1 and len(rings[0]._slots) == arena.RING_SLOTS < len(plan.buckets)  # slots were reused
    assert rings[0]._slots[0].untyped_storage().nbytes() < sum(b.nbytes for b in plan.buckets)  # its one arena
    assert got.keys() == weights.keys() and all(torch.equal(got[k], weights[k]) for k in weights)
    assert ring.digests == whole.digests == theirs and ring.num_buckets == whole.num_buckets == 6
    kept = [unpack_bucket(b) for b in ring.host_copies.result()]
    assert {n: t.clone() for b in kept for n, t in b}.keys() == weights.keys()
    assert all(torch.equal(t, weights[n]) for b in kept for n, t in b)  # each copy its own bucket's bytes

    # auto: the whole arena while it fits; once its allocation fails, a ring for this group's later pushes
    assert not sender._ring_sender
    monkeypatch.setattr(stream, "whole_arena", lambda *a, **k: (_ for _ in ()).throw(torch.OutOfMemoryError("no room")))
    with caplog.at_level("WARNING", logger="asyncrl.weightsync.stream"):
        auto, got, _ = _planned_push(sender, receiver, weights, plan)
    assert sender._ring_sender and len(rings) == 2 and auto.digests == whole.digests
    assert "through a ring of reused bucket slots" in caplog.text  # the switch is in the learner's log
    assert all(torch.equal(got[k], weights[k]) for k in weights)
    assert len(auto.host_copies.result()) == 6
    with pytest.raises(torch.OutOfMemoryError):  # "whole" asked for explicitly does not fall back
        send_stream(sender, iter(weights.items()), BUCKET_MB, verify="checksum", timeout_s=5, plan=plan, arena="whole")
    for g in (sender, receiver):
        g.close()


def test_a_sender_ring_waits_for_the_oldest_sent_bucket_and_grows_rather_than_wait_on_one_being_packed():
    """The ring reuses the oldest sent slot only once its broadcast and host copy are done; an export
    that keeps more buckets open than the ring has free slots gets another slot (no wait could end)."""
    from asyncrl.weightsync.bucket import RING_SLOTS, SenderRing

    weights = {f"t{i}": torch.full((2048,), float(i)) for i in range(12)}
    planned = _identity_plan(weights, 2 * BUCKET_MB).for_sender(0)
    ring = SenderRing(planned, torch.device("cpu"), time.monotonic() + 5)
    waits: list[str] = []

    class Done:
        def __init__(self, what):
            self.what = what

        def wait(self, *a):
            waits.append(self.what)

    views = [ring.buffer(b) for b in planned[:RING_SLOTS]]  # every slot open at once
    assert len({v.data_ptr() for v in views}) == RING_SLOTS  # windows of one arena
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1
    extra = ring.buffer(planned[RING_SLOTS])  # none sent yet: a new slot, no wait
    assert len(ring._slots) == RING_SLOTS + 1 and waits == [] and ring.waited == 0
    assert extra.data_ptr() not in {v.data_ptr() for v in views}
    ring.sent(planned[0].index, Done("broadcast 0"), Done("copy 0"))
    reused = ring.buffer(planned[RING_SLOTS + 1])
    assert waits == ["broadcast 0", "copy 0"] and reused.data_ptr() == views[0].data_ptr()


def test_a_whole_arena_gives_each_planned_bucket_an_aligned_window_of_one_allocation():
    from asyncrl.weightsync.bucket import ALIGN, whole_arena

    weights = {f"t{i}": torch.full((1000 + 37 * i,), float(i)) for i in range(6)}  # sizes off the alignment
    planned = _identity_plan(weights, 0.004).for_sender(0)
    assert len(planned) > 2
    buffer = whole_arena(planned, torch.device("cpu"))
    views = [buffer(b) for b in reversed(planned)]  # opened in any order: placed by plan index
    views.reverse()
    assert {v.untyped_storage().data_ptr() for v in views} == {views[0].untyped_storage().data_ptr()}
    spans = sorted((v.storage_offset(), v.storage_offset() + v.numel()) for v in views)
    assert all(start % ALIGN == 0 for start, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))  # disjoint
    assert [v.numel() for v in views] == [b.nbytes for b in planned]



def test_a_planned_packer_writes_each_bucket_into_its_window_of_a_larger_buffer():
    """The ipc ring (take_in_order) and whole_arena hand the packer windows of one allocation: every
    tensor must land in its own bucket's window (an offset taken from the window's start rather than
    the storage's wrote every bucket over the first; both sides' digests of those bytes still agreed)."""
    from asyncrl.weightsync.plan import PlannedPacker

    weights = {f"t{i}": torch.full((1000,), float(i + 1)) for i in range(6)}
    planned = _identity_plan(weights, 0.004)
    assert len(planned.for_sender(0)) > 2
    arena = torch.zeros(1 << 20, dtype=torch.uint8)
    slots, at = {}, 4096  # no window starts at the storage's first byte
    for b in planned.for_sender(0):
        slots[b.index] = at
        at += -(-b.nbytes // 256) * 256
    got: dict[str, torch.Tensor] = {}
    packer = PlannedPacker(planned, 0, "cpu", lambda b: arena[slots[b.index] : slots[b.index] + b.nbytes])
    for bucket in packer.pack(weights.items()):
        got.update({n: t.clone() for n, t in unpack_bucket(bucket)})
    assert got.keys() == weights.keys() and all(torch.equal(got[n], w) for n, w in weights.items())
    assert not arena[:4096].any()  # nothing written before the first window


def test_the_ipc_rings_whole_version_arena_packs_a_planned_version_bit_exact_push_after_push():
    """The ipc sender's whole-version path on a device (ipc.py: plan_whole, take_in_order into
    pack_stream), here on host memory: every planned bucket is a window of the ring's one arena and
    every tensor arrives whole, in the second push too (the same windows, reused)."""
    from asyncrl.weightsync.ipc import IpcRing
    from asyncrl.weightsync.stream import pack_stream

    weights = {f"t{i}": torch.arange(900 + 50 * i, dtype=torch.float32) + 1000 * i for i in range(6)}
    plan = _identity_plan(weights, 0.004)
    sizes = [b.nbytes for b in plan.for_sender(0)]
    assert len(sizes) > 2
    ring = IpcRing(torch.device("cpu"))
    for push in (1, 2):
        ring.release_all()
        ring.plan_whole(sizes)
        version = {n: t * push for n, t in weights.items()}
        buckets = list(pack_stream(version.items(), 0.004, torch.device("cpu"), plan=plan, alloc=ring.take_in_order))
        assert {b.buffer.untyped_storage().data_ptr() for b in buckets} == {ring.arena.untyped_storage().data_ptr()}
        got = {n: t.clone() for b in buckets for n, t in unpack_bucket(b)}
        assert got.keys() == version.keys() and all(torch.equal(got[n], version[n]) for n in version), push

def _assert_a_failing_export_aborts_the_receiver_at_once(sender, receiver, failing, **send_kw) -> None:
    """`failing` (an export that raises "export blew up") sent over the group: the receiver is told
    (SenderAborted) within 30 s, long before its 60 s deadline."""
    errors: list[BaseException] = []

    def receive():
        try:
            for _ in receive_stream(receiver, time.monotonic() + 60):
                pass
        except BaseException as exc:
            errors.append(exc)

    t0 = time.monotonic()
    th = threading.Thread(target=receive)
    th.start()
    with pytest.raises(RuntimeError, match="export blew up"):
        send_stream(sender, failing, BUCKET_MB, timeout_s=60, **send_kw)
    th.join(30)
    assert len(errors) == 1 and isinstance(errors[0], SenderAborted)
    assert time.monotonic() - t0 < 30  # told, not left to its 60 s deadline


def test_a_planned_whole_push_whose_export_fails_midway_aborts_the_receivers_and_the_group_carries_the_next():
    spec = _spec(receivers=1, timeout_s=60.0, backend="gloo")
    sender, receiver = _join_all(spec)
    weights = {f"t{i}": torch.full((2048,), float(i)) for i in range(6)}
    plan = _identity_plan(weights, 2 * BUCKET_MB)

    def failing():
        for i, (n, t) in enumerate(weights.items()):
            if i == 3:  # bucket 0 is on the wire, bucket 1 half packed
                raise RuntimeError("export blew up")
            yield n, t

    _assert_a_failing_export_aborts_the_receiver_at_once(sender, receiver, failing(), verify="checksum", plan=plan)
    got: dict[str, torch.Tensor] = {}

    def receive_all():
        for bucket in receive_stream(receiver, time.monotonic() + 20):
            got.update({n: t.clone() for n, t in unpack_bucket(bucket)})

    th = threading.Thread(target=receive_all)
    th.start()
    send_stream(sender, iter(weights.items()), BUCKET_MB, verify="checksum", timeout_s=20, plan=plan)
    th.join(30)
    assert all(torch.equal(got[k], weights[k]) for k in weights)
    for g in (sender, receiver):
        g.close()


def test_a_failing_export_aborts_the_receivers_at_once():
    backend = "gloo"
    spec = _spec(receivers=1, timeout_s=60.0, backend=backend)
    sender, receiver = _join_all(spec)

    def failing():
        yield "a", torch.ones(2048)
        yield "b", torch.ones(2048)
        yield "c", torch.ones(2048)
        raise RuntimeError("export blew up")

    _assert_a_failing_export_aborts_the_receiver_at_once(sender, receiver, failing(), verify="off")


def test_a_receiver_whose_sender_never_sends_times_out_and_the_group_is_broken():
    backend = "gloo"
    spec = _spec(receivers=1, timeout_s=10.0, backend=backend)
    sender, receiver = _join_all(spec)
    with pytest.raises(CollectiveError, match="broadcast" if backend.startswith("gloo") else "ipc step failed"):
        next(receive_stream(receiver, time.monotonic() + 0.5))
    assert receiver.broken
    with pytest.raises(CollectiveError, match="broken"):
        next(receive_stream(receiver, time.monotonic() + 5))
    sender.close()


# ---- the publisher's streamed path, with replicas that receive over a real gloo group -------------


class GlooReplica(FakeReplica):
    """A fake replica whose `load_bucket(CollectiveReceive)` receives over its real gloo group."""

    group: CollectiveGroup | None = None

    async def load_bucket(self, payload, version, begin=None):
        if not isinstance(payload, CollectiveReceive):  # a restore replays the host copy's buckets
            return await super().load_bucket(payload, version, begin)
        assert payload.version == version
        if begin is not None:
            await self._begin(version, begin)
        self.log.append((self.name, "load"))
        await self._maybe_fault("load")
        deadline = time.monotonic() + payload.timeout_s

        def receive() -> int:
            n = 0
            for bucket in receive_stream(self.group, deadline):
                for name, t in unpack_bucket(bucket):
                    self.staged[name] = t.clone()
                    n += 1
            return n

        return LoadReport(replica_id=self.name, staged_tensors=await asyncio.to_thread(receive))


async def _kept(copies) -> HostCopies:
    return HostCopies(-1, await asyncio.to_thread(copies.result), dict(copies.seconds))


def _export(sent) -> WeightExport:
    """A sender's `SendResult` as the learner group answers it."""
    return WeightExport(digests=[sent.digests], bytes=sent.bytes, num_tensors=sent.num_tensors,
                        num_buckets=sent.num_buckets, seconds=dict(sent.seconds))


class _Link:
    """A `Link` (sources.py) over a test's groups: `send(version, verify)` is the test's, answering the senders'
    `WeightExport` and how to collect that send's host copies (None: none kept); `ensure` forms the groups."""

    sequential = False

    def __init__(self, send, payload, ensure=None, stop=None) -> None:
        self._send, self.payload, self._ensure, self._stop, self._collect = send, payload, ensure, stop, None

    async def ensure(self) -> None:
        if self._ensure is not None:
            await self._ensure()

    async def send(self, version, verify) -> WeightExport:
        sent, self._collect = await self._send(version, verify)
        return sent

    async def stop(self, why: str) -> None:
        if self._stop is not None:
            await self._stop(why)

    async def collect(self) -> HostCopies:
        return HostCopies(-1, [], {}) if self._collect is None else await self._collect()


def _streamed_setup(n=2, timeout_s=20.0):
    log: list[tuple[str, str]] = []
    old = model(0)
    replicas = [GlooReplica(f"r{i}", log, weights=dict(old)) for i in range(n)]
    state = {"sender": None, "prepares": 0, "spec": None}

    async def prepare():
        state["prepares"] += 1
        spec = _spec(receivers=n, timeout_s=timeout_s, gid=f"p{state['prepares']}")
        groups = await asyncio.gather(*(asyncio.to_thread(CollectiveGroup.join, spec, r) for r in range(n + 1)))
        state["sender"], state["spec"] = groups[0], spec
        for r, g in zip(replicas, groups[1:]):
            r.group = g

    cfg = WeightsyncConfig(bucket_mb=BUCKET_MB, timeout_s=timeout_s)
    pub = Pusher(cfg, transport=LocalChannel())
    return pub, replicas, log, old, state, prepare


async def test_a_streamed_push_goes_live_with_the_senders_fingerprint_and_host_copies():
    """The host copies are collected once the version is live (after every replica's commit: on a
    shared GPU, an ipc sender's copies would take turns with the engine's apply)."""
    pub, replicas, log, _, state, prepare = _streamed_setup()
    new = model(1)

    async def send(version, verify):
        sent = await asyncio.to_thread(send_stream, state["sender"], iter(new.items()), BUCKET_MB, verify=verify, timeout_s=20)

        async def collect():
            log.append(("publisher", "collect"))
            return await _kept(sent.host_copies)

        return _export(sent), collect

    result = await pub.push(1, streamed(pub, _Link(send, lambda v: CollectiveReceive(("g",), v, 20.0), prepare)), replicas)
    for r in replicas:
        assert [e for n, e in log if n == r.name] == ["begin:1", "load", "pause:keep", "commit:1", "resume"]
        assert r.version == 1 and all(torch.equal(r.weights[k], new[k]) for k in new)
    assert result.fingerprint == tensor_fingerprint(new) and pub.registry.live_version == 1
    m = result.metrics
    assert m["weightsync/num_buckets"] == 3 and m["weightsync/bytes"] == 5 * 64 * 16 * 4
    assert {"weightsync/sender/broadcast_seconds", "weightsync/sender/host_copy_seconds"} <= m.keys()
    assert 0 < m["weightsync/paused_seconds"] <= m["weightsync/push_seconds"]
    tail, warnings = await pub.drain()
    assert log.index(("publisher", "collect")) > max(log.index((r.name, "commit:1")) for r in replicas)
    assert warnings == [] and tail["weightsync/host_copy_seconds"] > 0 and "weightsync/sender/host_copy_thread_keep_seconds" in tail
    assert _host_version(pub) == 1 and len(pub._host.handles) == 3  # host copies kept for restores
    host = {n: t for b in pub._host.handles for n, t in unpack_bucket(b)}
    assert host.keys() == new.keys() and all(torch.equal(host[k], new[k]) for k in new)


async def test_a_push_returns_before_its_host_copy_and_the_next_push_restores_from_it():
    """The host copy is kept after the push returned (the tail). The next push waits for it before
    pausing anyone, reports its seconds, and a failed commit then restores the version it holds."""
    pub, replicas, log, _, state, prepare = _streamed_setup()
    v1, v2 = model(1), model(2)
    gate = asyncio.Event()
    payload = lambda v: CollectiveReceive(("g",), v, 20.0)  # noqa: E731

    def sender(weights, gated):
        async def send(version, verify):
            sent = await asyncio.to_thread(send_stream, state["sender"], iter(weights.items()), BUCKET_MB, verify=verify, timeout_s=20)

            async def collect():
                if gated:
                    await gate.wait()
                return await _kept(sent.host_copies)

            return _export(sent), collect
        return send

    await pub.push(1, streamed(pub, _Link(sender(v1, True), payload, prepare)), replicas)
    assert pub.registry.live_version == 1 and all(r.version == 1 for r in replicas)
    assert _host_version(pub) is None  # live, its host copy still being made
    asyncio.get_running_loop().call_later(0.3, gate.set)

    replicas[1].faults[("commit", 2)] = "partial"  # v2: r1 half applies it; r0 commits it
    with pytest.raises(WeightsyncError) as info:
        await pub.push(2, streamed(pub, _Link(sender(v2, False), payload, prepare)), replicas)
    assert info.value.step is Step.COMMIT and info.value.out_of_service == []
    for r in replicas:  # both restored from v1's host copy, kept after v1's push had returned
        assert r.version == 1 and all(torch.equal(r.weights[k], v1[k]) for k in v1), r.name
        events = [e for n, e in log if n == r.name]
        assert events[events.index("commit:2"):] == ["commit:2", "abort", "begin:1", "load", "commit:1", "resume"]
    m = info.value.metrics
    assert m["weightsync/host_copy_wait_seconds"] >= 0.2 and m["weightsync/host_copy_seconds"] >= 0.2
    assert "weightsync/sender/host_copy_thread_keep_seconds" in m
    assert pub.registry.live_version == 1 and _host_version(pub) == 1


async def test_host_copies_that_fail_after_the_commit_leave_the_version_live_without_a_host_copy():
    """The host copies are collected after the commit: if they fail, the replicas already serve
    the new version (it is live), the push warns, and no stale host copy stands in for it."""
    pub, replicas, log, _, state, prepare = _streamed_setup()
    new = model(1)

    async def send(version, verify):
        sent = await asyncio.to_thread(send_stream, state["sender"], iter(new.items()), BUCKET_MB, verify=verify, timeout_s=20)

        async def collect():
            await _kept(sent.host_copies)
            raise RuntimeError("object store full")

        return _export(sent), collect

    result = await pub.push(1, streamed(pub, _Link(send, lambda v: CollectiveReceive(("g",), v, 20.0), prepare)), replicas)
    assert pub.registry.live_version == 1 and all(r.version == 1 for r in replicas) and result.warnings == []
    tail, warnings = await pub.drain()  # what the next push would report
    assert tail["weightsync/store_failed"] == 1.0
    assert pub._host is None
    assert len(warnings) == 1 and "object store full" in warnings[0]


async def test_a_sender_failure_publishes_nothing_and_the_push_made_again_forms_a_new_group():
    pub, replicas, log, old, state, prepare = _streamed_setup()
    new = model(1)
    calls = {"n": 0}

    async def send(version, verify):
        calls["n"] += 1
        stream = iter(new.items())
        if calls["n"] == 1:
            def broken():
                yield next(stream)
                yield next(stream)
                yield next(stream)
                raise RuntimeError("export failed mid-stream")
            stream = broken()
        sent = await asyncio.to_thread(send_stream, state["sender"], stream, BUCKET_MB, verify=verify, timeout_s=20)
        return _export(sent), lambda: _kept(sent.host_copies)

    link = _Link(send, lambda v: CollectiveReceive(("g",), v, 20.0), prepare)
    # The version fails and every replica keeps serving the old weights.
    with pytest.raises(WeightsyncError) as info:
        await pub.push(1, streamed(pub, link), replicas)
    assert info.value.step is Step.EXPORT and pub.registry.get(1).state is S.FAILED and pub.registry.live_version == 0
    for r in replicas:
        assert r.version == 0 and all(torch.equal(r.weights[k], old[k]) for k in old) and not r.paused
    # Pushed again (as `WeightPublisher.publish`'s recovery does), over groups formed again: live.
    result = await pub.push(1, streamed(pub, link), replicas)
    assert state["prepares"] == 2 and calls["n"] == 2 and result.metrics["weightsync/failed"] == 0
    for r in replicas:
        assert [e for n, e in log if n == r.name] == ["begin:1", "load", "abort",
                                                      "begin:1", "load", "pause:keep", "commit:1", "resume"]
        assert r.version == 1 and all(torch.equal(r.weights[k], new[k]) for k in new)


async def test_a_streamed_push_a_replica_refuses_reports_the_refusal_not_the_senders_failure():
    """A replica whose update cannot begin (here: it lacks the push plan) refuses at its load, closing the push's
    gate; the sender then fails too, but the push reports the refusal (the service re-forms the plan on it)."""
    from asyncrl.types import Refusal
    from asyncrl.weightsync.collective import CollectiveError

    pub, replicas, log, old, state, prepare = _streamed_setup(n=1)
    replicas[0].faults[("begin", 1)] = "refuse"

    async def send(version, verify):
        await asyncio.sleep(0.1)
        raise CollectiveError("the push's gate was closed by a receiver")

    with pytest.raises(WeightsyncError) as info:
        await pub.push(1, streamed(pub, _Link(send, lambda v: CollectiveReceive(("g",), v, 20.0), prepare)), replicas)
    assert info.value.step is Step.LOAD and info.value.refusals == {"r0": Refusal.PLAN_MISSING}
    assert [e for n, e in log if n == "r0"] == ["begin:1", "abort"] and replicas[0].version == 0


async def test_one_replicas_refusal_is_the_pushs_when_the_others_left_its_closed_gate_without_one():
    """Through a client that fans out (the service's `DeploymentReplicas`): one replica refuses (it lacks the push
    plan, e.g. it started as the plan was formed) and closes the gate, the others fail there without a refusal; the
    push still reports that replica's refusal, at the load, so the service forms the plan again and recovers (when
    only a refusal every replica gave counted, the senders' failure was reported and training stopped)."""
    from asyncrl.types import Refusal, ReplicaControlError
    from asyncrl.weightsync.collective import CollectiveError

    pub, _, _, _, _, prepare = _streamed_setup(n=1)

    class Engines:
        name, fanout = "engines", 2

        async def load_bucket(self, payload, version, begin):
            await asyncio.sleep(0.05)
            raise ReplicaControlError("load_bucket", {"a": "PlanMissing: no plan", "b": "GateClosed: stopped at its gate"},
                                      {}, {"a": Refusal.PLAN_MISSING})

        async def abort_update(self):
            return {}

    async def send(version, verify):
        await asyncio.sleep(0.1)
        raise CollectiveError("the push's gate was closed by a receiver")

    with pytest.raises(WeightsyncError) as info:
        await pub.push(1, streamed(pub, _Link(send, lambda v: CollectiveReceive(("g",), v, 20.0), prepare)), [Engines()])
    assert info.value.step is Step.LOAD and info.value.refusals == {"a": Refusal.PLAN_MISSING}


# ---- the engine worker's half, and group (re)formation ---------------------------------------------


class _Worker(WeightUpdateExtension):
    """The worker extension as vLLM mixes it in, minus vLLM: an engine rank and a device."""

    def __init__(self, rank: int) -> None:
        self.rank, self.device = rank, torch.device("cpu")

    def staged(self, version: int) -> dict:
        return self._asyncrl_rx()._state(version)


def test_engine_workers_receive_from_two_sending_ranks_in_stage_order():
    """PP = 2 on the learner: one group per sending rank; each worker of the replica drains
    group 0 (stage 0's tensors) then group 1, staging and hashing as the file path does."""
    specs = form_specs("gloo", [("127.0.0.1", free_port("127.0.0.1")), ("127.0.0.1", free_port("127.0.0.1"))],
                       {"rep": 2}, timeout_s=30, group_prefix="pp")
    wire = [asdict(s) for s in specs]
    workers = [_Worker(0), _Worker(1)]
    weights = model(4)
    names = sorted(weights)
    stages = [{n: weights[n] for n in names[:2]}, {n: weights[n] for n in names[2:]}]
    with ThreadPoolExecutor(4) as pool:
        joined = [pool.submit(w.asyncrl_join_collective, "rep", wire) for w in workers]
        senders = [f.result(60) for f in [pool.submit(CollectiveGroup.join, s, 0) for s in specs]]
        assert all(f.result(60) == ["pp-s0", "pp-s1"] for f in joined)
    with ThreadPoolExecutor(4) as pool:
        received = [pool.submit(w.asyncrl_receive, 5, None, ["pp-s0", "pp-s1"], 30, "", ["full", "hf"])
                    for w in workers]
        sent = [pool.submit(send_stream, g, iter(st.items()), BUCKET_MB, verify="full", timeout_s=30)
                for g, st in zip(senders, stages)]
        sent = [f.result(60) for f in sent]
        received = [f.result(60) for f in received]
    expected = combine_digests({**sent[0].digests, **sent[1].digests}, "full")
    assert expected == tensor_fingerprint(weights)
    for w, report in zip(workers, received):
        assert combine_digests(report.digests, "full") == expected  # what the replica checks at commit
        state = w.staged(5)
        assert all(torch.equal(dict(state.views)[n], weights[n]) for n in names)
        assert w.asyncrl_join_collective("rep") == ["pp-s0", "pp-s1"]
        w.asyncrl_join_collective("r0", [])  # (joining none leaves every group)
        assert w.asyncrl_join_collective("rep") == []
    # A worker that holds no group for the push fails it by name.
    with pytest.raises(CollectiveError, match="no usable group 'pp-s0'"):
        workers[0].asyncrl_receive(5, None, ["pp-s0"], 1)
    for g in senders:
        g.close()


class _FakeLearner:
    def __init__(self) -> None:
        self.joined: list[list[dict]] = []
        self.held: list[str] = []
        self.gates: list[str] = []
        self.fail = False

    async def export_weights(self, bucket_mb, transport, verify, layout, timeout_s, gate=""):
        self.gates.append(gate)
        if self.fail:
            raise RuntimeError("export failed")
        return WeightExport(buckets=["h0", "h1"] if transport == "ipc" else [])

    async def collective_addresses(self):
        return [SenderAddress(0, "127.0.0.1", 1, self.held[0] if self.held else "")]

    async def join_collective(self, wire):
        self.joined.append(wire)
        self.held = [s["group_id"] for s in wire]
        return self.held


def _fake_replicas():
    """One replica "a" with one worker, as `CollectiveLink` sees replicas: (their info, how often the
    link asked, `members`, `join`)."""
    replicas = {"a": {"workers": 1, "groups": []}}
    asked = {"n": 0}

    async def members():
        asked["n"] += 1
        return {rid: GroupsReport(replica_id=rid, **i) for rid, i in replicas.items()}

    async def join(wire):
        for i in replicas.values():
            i["groups"] = [s["group_id"] for s in wire]

    return replicas, asked, members, join


async def test_groups_are_formed_again_only_when_replicas_change_or_a_member_broke():
    from asyncrl.weightsync.link import CollectiveLink

    learner = _FakeLearner()
    replicas, asked, members, join = _fake_replicas()
    link = CollectiveLink("gloo", learner, members=members, join=join, bucket_mb=1, timeout_s=5)
    await link.ensure()
    payload = link.payload(3)
    assert link.formed == 1 and link.members == {"a": 1}
    assert payload == CollectiveReceive(tuple(link.group_ids), 3, 5, gate=payload.gate) and payload.gate
    await link.ensure()
    assert link.formed == 1 and asked["n"] == 2  # nothing changed: the groups are reused (the replicas asked each time)
    learner.held = []  # the sender's broadcast timed out: its group is broken
    await link.ensure()
    assert link.formed == 2 and learner.held == link.group_ids
    replicas["a"]["groups"] = []  # a replica's worker broke its group
    await link.ensure()
    assert link.formed == 3
    replicas["b"] = {"workers": 2, "groups": []}  # scale-up: a new member needs ranks
    await link.ensure()
    assert link.formed == 4 and link.members == {"a": 1, "b": 2} and link.specs[0].world_size == 4


async def test_an_ipc_link_forms_no_group_and_hands_the_replicas_what_its_senders_answered():
    """ipc: the loads follow the senders' export (`sequential`), their payload the handles it answered; no group
    is formed or asked about, no gate."""
    from asyncrl.weightsync.link import CollectiveLink

    learner = _FakeLearner()
    _, asked, members, join = _fake_replicas()
    link = CollectiveLink("ipc", learner, members=members, join=join, bucket_mb=1, timeout_s=5)
    await link.ensure()
    assert link.sequential and asked["n"] == 0 and link.formed == 0 and learner.joined == []
    sent = await link.send(1, "checksum")
    assert link.payload(1) == sent.buckets == ["h0", "h1"] and learner.gates == [""] and asked["n"] == 0


async def test_a_broadcast_push_has_a_gate_of_its_own_which_a_failed_sender_closes():
    """gloo / NCCL: each attempt's payload names a new gate, which the senders are given; a sender that failed
    closes it (every member still waiting leaves, nothing on the wire)."""
    from asyncrl.weightsync.link import CollectiveLink

    learner = _FakeLearner()
    _, _, members, join = _fake_replicas()
    link = CollectiveLink("nccl", learner, members=members, join=join, bucket_mb=1, timeout_s=5)
    await link.ensure()
    stopped: list[str] = []

    async def cancel(why):
        stopped.append(why)

    link.cancel = cancel
    payload = link.payload(3)
    assert payload.gate and payload.gate.startswith("v3-")
    await link.send(3, "checksum")
    assert learner.gates == [payload.gate] and stopped == []
    assert link.payload(3).gate != payload.gate  # each attempt its own gate
    learner.fail = True
    with pytest.raises(RuntimeError, match="export failed"):
        await link.send(3, "checksum")
    assert len(stopped) == 1 and "a sender failed" in stopped[0]


async def test_a_replica_that_fails_its_health_check_while_the_senders_wait_stops_the_push_at_its_gate(monkeypatch):
    """gloo / NCCL: a push still sending after `WATCH_S` has the replicas' health asked, and again after each: while
    they are healthy, or slow to answer, nothing is stopped; one that is not (its engine died after the groups were checked: it never
    comes to the gate, where the others would wait to the deadline) closes the push's gate at once, as the
    receivers' failure (`receivers_failed`: the service recovers it once the replicas are healthy)."""
    from asyncrl.weightsync import link as link_module
    from asyncrl.weightsync.link import CollectiveLink

    monkeypatch.setattr(link_module, "WATCH_S", 0.02)
    learner = _FakeLearner()
    _, _, members, join = _fake_replicas()
    health = {"asked": 0, "dead": False, "slow": False}

    async def check_health():
        health["asked"] += 1
        if health["slow"]:
            await asyncio.sleep(1.0)
        if health["dead"]:
            raise RuntimeError("replica b: engine is dead")

    link = CollectiveLink("gloo", learner, members=members, join=join, bucket_mb=1, timeout_s=5, health=check_health)
    await link.ensure()
    closed, why = asyncio.Event(), []

    async def cancel(reason):
        why.append(reason)
        closed.set()

    async def slow_export(*args, **kwargs):  # a sender at the gate: it leaves once the gate is closed, or sends
        try:
            await asyncio.wait_for(closed.wait(), 0.2)
        except asyncio.TimeoutError:
            return WeightExport()
        raise GateClosed("stopped at its gate")

    link.cancel, learner.export_weights = cancel, slow_export
    link.payload(3)
    await link.send(3, "checksum")  # healthy: asked, and carried
    assert health["asked"] >= 2 and why == [] and not link.receivers_failed
    health["slow"] = True  # no answer yet is no failure: the push goes on (its deadline bounds a hung replica)
    link.payload(3)
    await link.send(3, "checksum")
    assert why == [] and not link.receivers_failed
    health["slow"], health["dead"] = False, True
    link.payload(3)
    t = time.monotonic()
    with pytest.raises(GateClosed):
        await link.send(3, "checksum")
    assert time.monotonic() - t < 0.2 and link.receivers_failed
    assert "health check" in why[0] and "engine is dead" in why[0]  # (then the failed sender closes it too)


def test_a_worker_whose_update_cannot_begin_refuses_the_push_at_its_gate():
    """The update's first receive starts it on the worker (`begin`): one the worker cannot start (engine-layout
    buckets, no push plan) fails by name and closes the push's gate, so the sender stops before the wire, not at
    its deadline, and the group carries the next push."""
    from asyncrl.weightsync.collective import GateClosed

    spec = _spec(receivers=1, timeout_s=20.0, gid="begin", backend="gloo")
    worker = _Worker(0)
    with ThreadPoolExecutor(2) as pool:
        joined = pool.submit(worker.asyncrl_join_collective, "rep", [asdict(spec)])
        sender = pool.submit(CollectiveGroup.join, spec, 0).result(60)
        assert joined.result(60) == [spec.group_id]
    with pytest.raises(ValueError, match="without the push plan"):
        worker.asyncrl_receive(5, None, [spec.group_id], 20, "p1", ["checksum", "engine", None])
    weights = model(2)
    t = time.monotonic()
    with pytest.raises(GateClosed, match="without the push plan"):
        send_stream(sender, iter(weights.items()), BUCKET_MB, verify="checksum", timeout_s=20, gate="p1")
    assert time.monotonic() - t < 10 and not sender.broken
    with ThreadPoolExecutor(2) as pool:
        received = pool.submit(worker.asyncrl_receive, 6, None, [spec.group_id], 20, "p2", ["checksum", "hf"])
        send_stream(sender, iter(weights.items()), BUCKET_MB, verify="checksum", timeout_s=20, gate="p2")
        assert combine_digests(received.result(60).digests, "checksum") == tensor_fingerprint(weights, "checksum")
    worker.asyncrl_join_collective("rep", [])
    sender.close()


def test_the_gate_opens_once_every_member_arrived_and_a_closed_or_missed_gate_stops_everyone_before_the_wire():
    """A broadcast push's gate (collective.py): nobody goes on until every member is ready; a member that
    refuses, or one that never comes by the deadline, sends everyone away with nothing on the wire, and
    the group stays usable for the next push."""
    from asyncrl.weightsync.collective import GateClosed

    # as a sending rank forms it: its store serves on a pre-bound port (the store's non-libuv server,
    # which wakes no waiter on a compare_set: the gate's decisions must wake them themselves)
    sock = reserve_port("127.0.0.1")
    (spec,) = form_specs("gloo", [("127.0.0.1", sock.getsockname()[1])], {"rep": 2}, timeout_s=20.0, group_prefix="gate")
    with ThreadPoolExecutor(3) as pool:
        groups = list(pool.map(lambda r: CollectiveGroup.join(spec, r, listen_socket=sock if r == 0 else None), range(3)))
    probe = torch.arange(8, dtype=torch.float32)

    def still_usable():
        got = [torch.zeros(8) if g.rank else probe.clone() for g in groups]
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda gt: gt[0].broadcast_all([gt[1]], time.monotonic() + 10), zip(groups, got)))
        assert all(torch.equal(t, probe) for t in got) and not any(g.broken for g in groups)

    def at_gate(token, members, deadline_s=10.0):
        def one(g):
            try:
                g.arrive(token)
                g.await_gate(token, time.monotonic() + deadline_s)
                return "open"
            except GateClosed as err:
                return str(err)
        with ThreadPoolExecutor(len(members)) as pool:
            return list(pool.map(one, members))

    assert at_gate("t1", groups) == ["open"] * 3
    still_usable()
    # a receiver that cannot take the push closes its gate: the others leave at once
    assert groups[2].close_gate("t2", "its begin failed: no plan") == "closed: rank 2: its begin failed: no plan"
    t = time.monotonic()
    out = at_gate("t2", groups[:2])
    assert time.monotonic() - t < 5 and all("stopped at its gate" in o and "no plan" in o for o in out)
    still_usable()
    # a member that never comes: the others close the gate at their deadline
    t = time.monotonic()
    out = at_gate("t3", groups[:2], deadline_s=0.5)
    assert 0.4 < time.monotonic() - t < 5 and all("waited to the deadline" in o for o in out)
    assert groups[2].close_gate("t3", "late").startswith("closed: rank")  # (already decided: the late one is told)
    still_usable()
    # a gate every member reached is open: a close after that changes nothing
    assert at_gate("t4", groups) == ["open"] * 3 and groups[1].close_gate("t4", "too late") == "open"
    for g in groups:
        g.close()


def test_a_sender_at_a_closed_gate_reads_its_export_to_the_end_and_its_next_push_goes_through():
    """send_stream with a gate: a receiver that refuses stops the sender before the wire (GateClosed); the
    sender still reads its tensors to the end (its TP peers' gathers) and the group carries the next push."""
    from asyncrl.weightsync.collective import GateClosed

    spec = _spec(receivers=1, timeout_s=20.0, gid="sgate", backend="gloo")
    sender, receiver = _join_all(spec)
    weights = model(3)
    read: list[str] = []

    def tensors():
        for name, t in weights.items():
            read.append(name)
            yield name, t

    receiver.close_gate("p1", "refused")
    with pytest.raises(GateClosed, match="refused"):
        send_stream(sender, tensors(), BUCKET_MB, verify="checksum", timeout_s=20, gate="p1")
    assert read == list(weights) and not sender.broken and not receiver.broken
    got: dict[str, torch.Tensor] = {}

    def receive(g):
        g.arrive("p2")
        g.await_gate("p2", time.monotonic() + 20)
        for bucket in receive_stream(g, time.monotonic() + 20):
            got.update((n, t.clone()) for n, t in unpack_bucket(bucket))

    th = threading.Thread(target=receive, args=(receiver,))
    th.start()
    send_stream(sender, iter(weights.items()), BUCKET_MB, verify="checksum", timeout_s=20, gate="p2")
    th.join(30)
    assert got.keys() == weights.keys() and all(torch.equal(got[k], weights[k]) for k in weights)
    # The sender drops an earlier push's gate keys from the store once its next push's wire runs, not before
    # its arrival at that push's gate; this push's stay until the next.
    from asyncrl.weightsync.collective import gate_keys

    kv = sender._kv()
    assert not any(kv.check([k]) for k in gate_keys(spec.group_id, "p1")) and kv.check(list(gate_keys(spec.group_id, "p2")))
    sender.arrive("p3")
    assert kv.check(list(gate_keys(spec.group_id, "p2")))
    sender.drop_stale_gate_keys()
    assert not any(kv.check([k]) for k in gate_keys(spec.group_id, "p2")) and kv.check([gate_keys(spec.group_id, "p3")[0]])
    sender.close()
    receiver.close()


def _host_version(pub):
    """The version of the publisher's host copy (None: none kept)."""
    return pub._host.version if pub._host else None
