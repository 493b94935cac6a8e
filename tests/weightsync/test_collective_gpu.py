"""The collective transport's GPU backends, each member its own process: NCCL between two GPUs
(NCCL refuses two ranks on one device; skipped with fewer than two GPUs) and CUDA IPC handles
(ipc.py) between processes sharing one GPU. Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from .test_collective import _identity_plan

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _member(rank: int, spec: dict, weights: dict, out: mp.Queue, done: mp.Barrier, pushes: int, step: mp.Barrier,
            planned: bool = False, arena: str = "auto") -> None:
    from asyncrl.weightsync.bucket import digest_key_prefix, unpack_bucket
    from asyncrl.weightsync.collective import CollectiveGroup, GroupSpec
    from asyncrl.weightsync.fingerprint import bucket_digests, combine_digests, tensor_fingerprint
    from asyncrl.weightsync.stream import broadcast_receive_stream as receive_stream
    from asyncrl.weightsync.stream import broadcast_send_stream as send_stream

    try:
        spec_ = GroupSpec(**spec)
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        group = CollectiveGroup.join(spec_, rank, device)
        # planned: the buckets are an engine layout's (PlannedPacker)
        plan = _identity_plan(weights, 0.15) if planned and rank == 0 else None
        for push in range(pushes):  # the same group carries every push
            version = {n: t * (push + 1) for n, t in weights.items()}
            if rank == 0:
                sent = send_stream(group, ((n, t.cuda()) for n, t in version.items()), 0.15, verify="checksum", timeout_s=60,
                                   plan=plan, arena=arena)
                kept = sent.host_copies.result()  # pinned device-to-host copies, made when collected
                host = {n: t for b in kept for n, t in unpack_bucket(b)}
                out.put(("sent", push, sorted(sent.digests), sent.bytes, [b.nbytes for b in kept],
                         tensor_fingerprint(host, "full"), 0, combine_digests(sent.digests, "checksum")))
            else:
                got, staged, mine = {}, [], {}
                for bucket in receive_stream(group, time.monotonic() + 60):
                    assert bucket.buffer.is_cuda and bucket.buffer.device == device
                    # as a worker hashes each bucket when it has it (keys prefixed by the engine rank where planned)
                    mine.update(bucket_digests(bucket, "checksum", digest_key_prefix(bucket)))
                    staged.append(bucket)
                # read after the push, as a staging worker reads them at its commit
                got.update({n: t.cpu().clone() for b in staged for n, t in unpack_bucket(b)})
                # A fingerprint, not the tensors: torch shares CPU tensors put on a queue by file
                # descriptor, which fails once this process has exited.
                out.put(("got", push, rank, sorted(got), tensor_fingerprint(got, "full"), 0,
                         combine_digests(mine, "checksum")))
            step.wait(120)  # the next push starts once this one was read (a commit, in the engines)
    except BaseException as exc:  # report, do not hang the parent
        out.put(("error", rank, f"{type(exc).__name__}: {exc}"))
    # The sender hosts the group's store: it leaves only after every receiver read the end marker
    # (as a learner rank does, whose group outlives the push).
    try:
        done.wait(120)
    except Exception:  # a member that failed before the barrier: already reported
        pass
    if "group" in locals():
        group.close()


def _ipc_member(rank: int, weights: dict, out: mp.Queue, wires: list, pushes: int, step: mp.Barrier,
                planned: bool) -> None:
    """ipc.py's two ends in one process each, on GPU 0: the sender packs into its ring and answers handles (as
    a learner rank's `send_version`), each receiver opens them (as a worker's `asyncrl_receive`, once per handle)."""
    from asyncrl.weightsync.bucket import digest_key_prefix, metas_from_wire, unpack_bucket
    from asyncrl.weightsync.fingerprint import bucket_digests, combine_digests, tensor_fingerprint
    from asyncrl.weightsync.ipc import IpcRing, ipc_open, ipc_send
    from asyncrl.weightsync.transport import HostCopies, PinnedPool

    try:
        torch.cuda.set_device(0)
        # planned: an engine layout's buckets, packed into windows of the ring's one arena (take_in_order), where
        # each tensor must land in its own bucket's window
        plan = _identity_plan(weights, 0.15) if planned and rank == 0 else None
        ring, pool, opened = IpcRing(torch.device("cuda", 0)), PinnedPool(), {}
        for push in range(pushes):  # the same ring carries every push
            version = {n: t * (push + 1) for n, t in weights.items()}
            if rank == 0:
                copies = HostCopies(None, pool)
                handles, sent = ipc_send(ring, copies, ((n, t.cuda()) for n, t in version.items()), 0.15,
                                         verify="checksum", plan=plan)
                for q in wires:
                    q.put([h.wire() for h in handles])
                kept = copies.result()
                host = {n: t for b in kept for n, t in unpack_bucket(b)}
                ring_bytes = sum(int(b.numel()) for b in ring.buffers + ([] if ring.arena is None else [ring.arena]))
                out.put(("sent", push, sorted(sent.digests), sent.bytes, [b.nbytes for b in kept],
                         tensor_fingerprint(host, "full"), ring_bytes, combine_digests(sent.digests, "checksum")))
            else:
                now, new, mine = {}, 0, {}
                for handle, metas, r in wires[rank - 1].get(timeout=120):
                    bucket = opened.get(handle)
                    if bucket is None:
                        bucket, new = ipc_open(handle, metas_from_wire(metas), r), new + 1
                    now[handle] = bucket
                    assert bucket.buffer.is_cuda
                    mine.update(bucket_digests(bucket, "checksum", digest_key_prefix(bucket)))
                opened = now
                got = {n: t.cpu().clone() for b in now.values() for n, t in unpack_bucket(b)}
                out.put(("got", push, rank, sorted(got), tensor_fingerprint(got, "full"), new,
                         combine_digests(mine, "checksum")))
            step.wait(120)  # the next push starts once this one was read (a commit, in the engines)
    except BaseException as exc:  # report, do not hang the parent
        out.put(("error", rank, f"{type(exc).__name__}: {exc}"))


def _push_in_processes(backend: str, receivers: int, seed: int, tensors: int, pushes: int = 1,
                       planned: bool = False, arena: str = "auto") -> tuple[dict, list, list]:
    """`pushes` pushes from a sender process to `receivers` processes (push k sends the weights
    times k + 1); (weights, sent reports, receiver reports)."""
    from dataclasses import asdict

    from asyncrl.weightsync.collective import form_specs, free_port

    g = torch.Generator().manual_seed(seed)
    weights = {f"w{i}": torch.randn(256, 128 + i, generator=g).to(torch.bfloat16) for i in range(tensors)}
    if not planned:  # an engine layout has no empty parameter
        weights["empty"] = torch.empty(0, 4)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    done, step = ctx.Barrier(receivers + 1), ctx.Barrier(receivers + 1)
    if backend == "ipc":
        wires = [ctx.Queue() for _ in range(receivers)]
        procs = [ctx.Process(target=_ipc_member, args=(r, weights, out, wires, pushes, step, planned))
                 for r in range(receivers + 1)]
    else:
        (spec,) = form_specs(backend, [("127.0.0.1", free_port("127.0.0.1"))], {"engine": receivers}, timeout_s=120,
                             group_prefix=backend)
        procs = [ctx.Process(target=_member, args=(r, asdict(spec), weights, out, done, pushes, step, planned, arena))
                 for r in range(receivers + 1)]
    for p in procs:
        p.start()
    results = []
    while len([r for r in results if r[0] != "error"]) < len(procs) * pushes and not any(r[0] == "error" for r in results):
        results.append(out.get(timeout=300))
    for p in procs:
        p.join(60)
    errors = [r for r in results if r[0] == "error"]
    assert not errors, errors
    return weights, sorted(r for r in results if r[0] == "sent"), sorted(r for r in results if r[0] == "got")


def _assert_delivered(weights: dict, sent: list, received: list, receivers: int, pushes: int = 1,
                      key_prefix: str = "") -> None:
    """`key_prefix`: what the sender's digest keys carry (the engine rank, "0/", for a planned push: the
    same parameter name exists on every engine rank; bucket.digest_key_prefix)."""
    from asyncrl.weightsync.fingerprint import tensor_fingerprint

    for push in range(pushes):
        version = {n: t * (push + 1) for n, t in weights.items()}
        got = [r for r in received if r[1] == push]
        assert sorted(r[2] for r in got) == list(range(1, receivers + 1))
        (s,) = [r for r in sent if r[1] == push]
        for _, _, _, names, fingerprint, _, hashed in got:
            assert names == sorted(version) and fingerprint == tensor_fingerprint(version, "full")  # bit-exact
            assert hashed == s[7]  # what the receiver hashed as buckets landed is what the sender hashed
        assert s[2] == sorted(key_prefix + n for n in version) and s[3] == sum(t.numel() * t.element_size() for t in version.values())
        assert s[5] == tensor_fingerprint(version, "full")  # the sender's host copies are bit-exact too


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: two GPUs")
def test_nccl_broadcast_moves_every_bucket_bit_exact_between_two_gpus():
    """The whole version back to back: the sender hashes beside the wire, each receiver hashes each bucket
    as it lands."""
    weights, sent, received = _push_in_processes("nccl", receivers=1, seed=0, tensors=6, pushes=2)
    _assert_delivered(weights, sent, received, receivers=1, pushes=2)
    assert len(sent[0][4]) > 1  # several buckets went over the wire


def test_ipc_hands_every_bucket_bit_exact_to_processes_sharing_the_gpu():
    """A sender and two receivers on GPU 0, in three processes: each bucket travels as a CUDA IPC
    handle (keyed by the GPU's UUID) and each receiver stages views of the sender's buffers, which
    hold the whole version. The second push packs into the same sender buffers, whose handles the
    receivers opened once."""
    weights, sent, received = _push_in_processes("ipc", receivers=2, seed=1, tensors=8, pushes=2)
    _assert_delivered(weights, sent, received, receivers=2, pushes=2)  # HF tensors: names carry no rank
    assert len(sent[0][4]) > 2  # several buckets
    assert sent[0][6] == sent[1][6] > 0  # the second push allocated no new sender buffer
    assert sent[0][6] >= sum(sent[0][4])  # the whole version stays in the sender's buffers (the receivers' staging)
    for rank in (1, 2):
        opened = [r[5] for r in sorted(received) if r[2] == rank]
        assert opened[0] == len(sent[0][4]) and opened[1] == 0  # ... so the receivers opened no new handle


def test_ipc_hands_a_planned_whole_version_bit_exact_from_the_senders_arena():
    """The whole version in an engine layout (a push plan) over ipc: the sender packs every
    planned bucket into its window of the ring's one arena (take_in_order) and the receivers stage views
    of those windows. Each tensor must arrive in its own window: an offset counted from the window rather
    than the storage once wrote every bucket over the first, and both sides' checksums still agreed."""
    weights, sent, received = _push_in_processes("ipc", receivers=2, seed=2, tensors=8, pushes=2, planned=True)
    _assert_delivered(weights, sent, received, receivers=2, pushes=2, key_prefix="0/")
    assert len(sent[0][4]) > 2  # several planned buckets, so several windows of the arena
    assert sent[0][6] >= sum(sent[0][4])  # ... which holds the whole version


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: two GPUs")
def test_nccl_sends_a_planned_whole_version_through_a_sender_ring_bit_exact():
    """A sender short of device memory for the whole packed version (a 7B learner rank on an 80 GB GPU)
    packs it through a ring of reused slots (stream.SenderRing): each slot is packed again only once its
    broadcast and its host copy are done, so every receiver and the host copies get each bucket's own bytes."""
    weights, sent, received = _push_in_processes("nccl", receivers=1, seed=3, tensors=16, pushes=2, planned=True,
                                                 arena="ring")
    _assert_delivered(weights, sent, received, receivers=1, pushes=2, key_prefix="0/")
    assert len(sent[0][4]) > 4  # more planned buckets than the ring's slots: slots were reused
