"""The collective transport's GPU backends, each member its own process: NCCL between two GPUs
(NCCL refuses two ranks on one device; skipped with fewer than two GPUs) and CUDA IPC handles
between processes sharing one GPU. Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _member(rank: int, spec: dict, weights: dict, out: mp.Queue) -> None:
    from asyncrl.generator.weights import tensor_fingerprint
    from asyncrl.weightsync.bucket import unpack_bucket
    from asyncrl.weightsync.collective import CollectiveGroup, GroupSpec, receive_stream, send_stream

    try:
        torch.cuda.set_device(rank)
        group = CollectiveGroup.join(GroupSpec(**spec), rank, torch.device("cuda", rank))
        if rank == 0:
            sent = send_stream(group, ((n, t.cuda()) for n, t in weights.items()), 0.05, verify="sampled", timeout_s=60)
            out.put(("sent", sorted(sent.digests), sent.bytes, [b.nbytes for b in sent.host_buckets]))
        else:
            got = {}
            for bucket in receive_stream(group, time.monotonic() + 60):
                assert bucket.buffer.is_cuda
                got.update({n: t.cpu().clone() for n, t in unpack_bucket(bucket)})
            # A fingerprint, not the tensors: torch shares CPU tensors put on a queue by file
            # descriptor, which fails once this process has exited.
            out.put(("got", sorted(got), tensor_fingerprint(got, "full")))
        group.close()
    except BaseException as exc:  # report, do not hang the parent
        out.put(("error", rank, f"{type(exc).__name__}: {exc}"))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: two GPUs")
def test_nccl_broadcast_moves_every_bucket_bit_exact_between_two_gpus():
    from dataclasses import asdict

    from asyncrl.weightsync.collective import form_specs, free_port

    (spec,) = form_specs("nccl", [("127.0.0.1", free_port("127.0.0.1"))], {"engine": 1}, timeout_s=120, group_prefix="gpu")
    g = torch.Generator().manual_seed(0)
    weights = {f"w{i}": torch.randn(256, 128 + i, generator=g).to(torch.bfloat16) for i in range(6)}
    weights["empty"] = torch.empty(0, 4)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, asdict(spec), weights, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    errors = [r for r in results if r[0] == "error"]
    assert not errors, errors
    from asyncrl.generator.weights import tensor_fingerprint

    _, names, fingerprint = next(r for r in results if r[0] == "got")
    sent = next(r for r in results if r[0] == "sent")
    assert names == sorted(weights) and fingerprint == tensor_fingerprint(weights, "full")  # bit-exact
    assert sent[1] == sorted(weights) and sent[2] == sum(t.numel() * t.element_size() for t in weights.values())
    assert len(sent[3]) > 1  # several buckets went over the wire


def _ipc_member(rank: int, spec: dict, weights: dict, out: mp.Queue) -> None:
    from asyncrl.generator.weights import tensor_fingerprint
    from asyncrl.weightsync.bucket import unpack_bucket
    from asyncrl.weightsync.collective import CollectiveGroup, GroupSpec, receive_stream, send_stream

    try:
        torch.cuda.set_device(0)
        group = CollectiveGroup.join(GroupSpec(**spec), rank, torch.device("cuda", 0))
        if rank == 0:
            sent = send_stream(group, ((n, t.cuda()) for n, t in weights.items()), 0.05, verify="sampled", timeout_s=60)
            out.put(("sent", sorted(sent.digests), sent.bytes, [b.nbytes for b in sent.host_buckets]))
        else:
            got = {}
            for bucket in receive_stream(group, time.monotonic() + 60):
                assert bucket.buffer.is_cuda
                got.update({n: t.cpu().clone() for n, t in unpack_bucket(bucket)})
            out.put(("got", rank, sorted(got), tensor_fingerprint(got, "full")))
        group.close()
    except BaseException as exc:  # report, do not hang the parent
        out.put(("error", rank, f"{type(exc).__name__}: {exc}"))


def test_ipc_hands_every_bucket_bit_exact_to_processes_sharing_the_gpu():
    """A sender and two receivers on GPU 0, in three processes: each bucket travels as a CUDA IPC
    handle (keyed by the GPU's UUID) and each receiver copies it into its own device memory."""
    from dataclasses import asdict

    from asyncrl.weightsync.collective import form_specs, free_port

    (spec,) = form_specs("ipc", [("127.0.0.1", free_port("127.0.0.1"))], {"engine": 2}, timeout_s=120, group_prefix="ipc")
    g = torch.Generator().manual_seed(1)
    weights = {f"w{i}": torch.randn(256, 128 + i, generator=g).to(torch.bfloat16) for i in range(8)}
    weights["empty"] = torch.empty(0, 4)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_ipc_member, args=(r, asdict(spec), weights, out)) for r in range(3)]
    for p in procs:
        p.start()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    errors = [r for r in results if r[0] == "error"]
    assert not errors, errors
    from asyncrl.generator.weights import tensor_fingerprint

    received = [r for r in results if r[0] == "got"]
    assert sorted(r[1] for r in received) == [1, 2]
    for _, _, names, fingerprint in received:
        assert names == sorted(weights) and fingerprint == tensor_fingerprint(weights, "full")  # bit-exact
    sent = next(r for r in results if r[0] == "sent")
    assert sent[1] == sorted(weights) and sent[2] == sum(t.numel() * t.element_size() for t in weights.values())
    assert len(sent[3]) > 2  # more buckets than the window: the sender waited for acknowledgements
