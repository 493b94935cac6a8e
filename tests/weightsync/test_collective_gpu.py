"""The collective transport's GPU backends, each member its own process: NCCL between two GPUs
(NCCL refuses two ranks on one device; skipped with fewer than two GPUs) and CUDA IPC handles
between processes sharing one GPU. Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _member(rank: int, spec: dict, weights: dict, out: mp.Queue, done: mp.Barrier) -> None:
    from asyncrl.weightsync.fingerprint import tensor_fingerprint
    from asyncrl.weightsync.bucket import unpack_bucket
    from asyncrl.weightsync.collective import CollectiveGroup, GroupSpec, receive_stream, send_stream

    try:
        spec_ = GroupSpec(**spec)
        device = torch.device("cuda", rank if spec_.backend == "nccl" else 0)  # ipc: everyone on GPU 0
        torch.cuda.set_device(device)
        group = CollectiveGroup.join(spec_, rank, device)
        if rank == 0:
            sent = send_stream(group, ((n, t.cuda()) for n, t in weights.items()), 0.05, verify="sampled", timeout_s=60)
            kept = sent.host_copies.result()  # pinned device-to-host copies, made while sending
            host = {n: t for b in kept for n, t in unpack_bucket(b)}
            out.put(("sent", sorted(sent.digests), sent.bytes, [b.nbytes for b in kept], tensor_fingerprint(host, "full")))
        else:
            got = {}
            for bucket, _ in receive_stream(group, time.monotonic() + 60):
                assert bucket.buffer.is_cuda and bucket.buffer.device == device
                got.update({n: t.cpu().clone() for n, t in unpack_bucket(bucket)})
            # A fingerprint, not the tensors: torch shares CPU tensors put on a queue by file
            # descriptor, which fails once this process has exited.
            out.put(("got", rank, sorted(got), tensor_fingerprint(got, "full")))
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


def _push_in_processes(backend: str, receivers: int, seed: int, tensors: int) -> tuple[dict, tuple, list[tuple]]:
    """One push from a sender process to `receivers` processes; (weights, sent report, receiver reports)."""
    from dataclasses import asdict

    from asyncrl.weightsync.collective import form_specs, free_port

    (spec,) = form_specs(backend, [("127.0.0.1", free_port("127.0.0.1"))], {"engine": receivers}, timeout_s=120,
                         group_prefix=backend)
    g = torch.Generator().manual_seed(seed)
    weights = {f"w{i}": torch.randn(256, 128 + i, generator=g).to(torch.bfloat16) for i in range(tensors)}
    weights["empty"] = torch.empty(0, 4)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    done = ctx.Barrier(receivers + 1)
    procs = [ctx.Process(target=_member, args=(r, asdict(spec), weights, out, done)) for r in range(receivers + 1)]
    for p in procs:
        p.start()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    errors = [r for r in results if r[0] == "error"]
    assert not errors, errors
    return weights, next(r for r in results if r[0] == "sent"), [r for r in results if r[0] == "got"]


def _assert_delivered(weights: dict, sent: tuple, received: list[tuple], receivers: int) -> None:
    from asyncrl.weightsync.fingerprint import tensor_fingerprint

    assert sorted(r[1] for r in received) == list(range(1, receivers + 1))
    for _, _, names, fingerprint in received:
        assert names == sorted(weights) and fingerprint == tensor_fingerprint(weights, "full")  # bit-exact
    assert sent[1] == sorted(weights) and sent[2] == sum(t.numel() * t.element_size() for t in weights.values())
    assert sent[4] == tensor_fingerprint(weights, "full")  # the sender's host copies are bit-exact too


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: two GPUs")
def test_nccl_broadcast_moves_every_bucket_bit_exact_between_two_gpus():
    weights, sent, received = _push_in_processes("nccl", receivers=1, seed=0, tensors=6)
    _assert_delivered(weights, sent, received, receivers=1)
    assert len(sent[3]) > 1  # several buckets went over the wire


def test_ipc_hands_every_bucket_bit_exact_to_processes_sharing_the_gpu():
    """A sender and two receivers on GPU 0, in three processes: each bucket travels as a CUDA IPC
    handle (keyed by the GPU's UUID) and each receiver copies it into its own device memory."""
    weights, sent, received = _push_in_processes("ipc", receivers=2, seed=1, tensors=8)
    _assert_delivered(weights, sent, received, receivers=2)
    assert len(sent[3]) > 2  # more buckets than the window: the sender waited for acknowledgements
