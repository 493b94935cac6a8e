"""The sender's host copies (weightsync/transport.py): made when collected, kept in order off the caller's thread,
failures reported, bounded, and (on a GPU) copied into pinned buffers that later pushes reuse."""

from __future__ import annotations

import contextlib
import threading
import time
import types

import pytest
import torch

from asyncrl.weightsync.bucket import iter_buckets, unpack_bucket
from asyncrl.weightsync.transport import HostCopies, HostCopyError, PinnedPool

from .fakes import model

BUCKET_MB = 8192 / (1 << 20)  # two 4 KiB tensors per bucket -> 3 buckets for 5 tensors


def _buckets(seed: int, device: str | None = None):
    return list(iter_buckets(iter(model(seed).items()), BUCKET_MB, device=device))


def _unpacked(kept) -> dict[str, torch.Tensor]:
    return {n: t.clone() for b in kept for n, t in unpack_bucket(b)}


def _deadline(s: float = 20.0) -> float:
    return time.monotonic() + s


def test_nothing_is_kept_before_result_and_then_every_bucket_in_order_off_the_callers_thread():
    threads: list[str] = []

    def keep(bucket):
        threads.append(threading.current_thread().name)
        return bucket

    copies = HostCopies(keep, None)
    for bucket in _buckets(1, "cpu"):  # torch buffers on the host, as a CPU sender packs them
        copies.add(bucket)
    time.sleep(0.1)
    assert threads == []  # made when collected (once the version is live), not as the sender adds them
    kept = copies.result(_deadline())
    weights = model(1)
    assert len(kept) == 3 and [m.name for b in kept for m in b.metas] == list(weights)
    assert all(torch.equal(t, weights[n]) for n, t in _unpacked(kept).items())
    assert threads and all(name.startswith("asyncrl-host-keep") for name in threads)  # not the caller's
    assert HostCopies(keep, None).result(_deadline()) == []


def test_a_failing_keep_is_raised_by_result():
    def keep(bucket):
        raise RuntimeError("object store full")

    copies = HostCopies(keep, None)
    for bucket in _buckets(2):
        copies.add(bucket)
    with pytest.raises(HostCopyError, match="object store full"):
        copies.result(_deadline())


@contextlib.contextmanager
def _stuck_keep():
    """HostCopies whose `keep` blocks until `release` is set (set at exit)."""
    release = threading.Event()
    copies = HostCopies(lambda b: release.wait(30) and b, None)
    try:
        yield copies, release
    finally:
        release.set()


def test_result_waits_no_longer_than_its_deadline():
    with _stuck_keep() as (copies, _):
        copies.add(_buckets(4)[0])
        t0 = time.monotonic()
        with pytest.raises(HostCopyError, match="not kept by the deadline"):
            copies.result(_deadline(0.3))
        assert time.monotonic() - t0 < 5


def test_close_reports_a_keep_that_is_still_running_and_stops_a_later_result():
    """The next push closes the last one's copies first: it reuses the pinned pool only if no keep still reads it,
    and a collect that comes after that gets nothing (the buffers are the new push's)."""
    with _stuck_keep() as (copies, release):
        copies.add(_buckets(8)[0])
        collecting = threading.Thread(target=lambda: copies.result(_deadline()), daemon=True)
        collecting.start()
        time.sleep(0.2)
        assert copies.close() is False  # stuck in keep: the pool must not be reused
        release.set()
        collecting.join(10)
        assert copies.close() is True
        with pytest.raises(HostCopyError, match="closed"):
            copies.result(_deadline())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned buffers and device-to-host copies need CUDA")
def test_device_buckets_are_copied_into_pinned_buffers_that_the_next_push_reuses():
    pool = PinnedPool()
    pointers = []
    for seed in (5, 6):  # two pushes: the second writes into the first one's buffers
        copies = HostCopies(None, pool)
        buckets = _buckets(seed, "cuda")
        for bucket in buckets:
            copies.add(bucket)
        del buckets  # the copies hold the device buckets until copied
        kept = copies.result(_deadline(60))
        pointers.append([b.buffer.ctypes.data for b in kept])
        weights = model(seed)
        assert all(torch.equal(t, weights[n]) for n, t in _unpacked(kept).items())
    assert pointers[0] == pointers[1] and sum(b.nbytes for b in kept) >= sum(t.numel() * 4 for t in model(0).values())
    assert [pool.get(i, b.nbytes).data_ptr() for i, b in enumerate(kept)] == pointers[1]  # the pool's own buffers


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned buffers and device-to-host copies need CUDA")
def test_device_copies_start_when_collected_unless_asked_now_and_close_drops_the_rest():
    """A whole-version push's copies are made at `result` and read what the device buffers hold then; a ring's
    (`now`) at once; `close` drops those not started and lets the device buffers go."""
    copies = HostCopies(None, PinnedPool())
    buckets = _buckets(7, "cuda")
    added = [copies.add(b, now=i == 0) for i, b in enumerate(buckets)]
    assert added[0].event is not None and all(c.event is None for c in added[1:])
    kept = copies.result(_deadline(60))
    assert all(c.device is None for c in added)
    weights = model(7)
    assert all(torch.equal(t, weights[n]) for n, t in _unpacked(kept).items())
    dropped = HostCopies(None, PinnedPool())
    left = [dropped.add(b) for b in _buckets(8, "cuda")]
    assert dropped.close() and all(c.event is None and c.device is None for c in left)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_digests_of_device_tensors_equal_those_of_their_host_copies():
    from asyncrl.weightsync.fingerprint import tensor_digests

    g = torch.Generator().manual_seed(7)
    a = {"w": torch.randn(1000, 300, generator=g).to(torch.bfloat16), "b": torch.randn(5, generator=g),
         "e": torch.empty(0, 2), "odd": torch.arange(7, dtype=torch.uint8), "big": torch.randn(3 << 20, generator=g)}
    on_gpu = [(n, t.cuda()) for n, t in a.items()]
    for mode in ("full", "checksum", "off"):  # checksum: CUDA int64 arithmetic wraps as on the host
        assert tensor_digests(on_gpu, mode) == {n: tensor_digests([(n, t)], mode)[n] for n, t in a.items()}, mode


def test_a_senders_next_host_copies_close_the_last_and_reuse_their_pinned_pool_unless_a_keep_still_reads_it():
    first = HostCopies.after(None, None)
    second = HostCopies.after(first, None)
    assert second._pool is first._pool is not None
    with pytest.raises(HostCopyError, match="closed"):
        first.result(_deadline())  # the next push took its buffers: nothing of it is collected any more
    second._keeping = True  # a keep of the last push's copies still reads their pinned buffers
    third = HostCopies.after(second, None)
    assert third._pool is not None and third._pool is not second._pool
    host = HostCopies.after(None, None)
    for bucket in _buckets(3, "cpu"):
        host.add(bucket, now=True)
    assert len(host.result(_deadline())) == 3 and host._pool._buffers == []  # host buckets: no pinned buffers


def test_a_gpu_sender_pins_its_first_push_host_buffers_at_start_once(monkeypatch):
    """`SenderEndpoint.pin_host_copies` (the learner rank's `set_push_plan(..., host_copies=True)`): the pinned
    buffers of the sender's planned buckets are allocated then, not by the first push's copies (beside the next
    step's training); the first push (ipc, or a group's first) takes them through `HostCopies.after`, and a plan
    formed again later allocates nothing more. (Pinning is recorded here, not done: this host has no GPU.)"""
    import pickle

    from asyncrl.weightsync.link import SenderEndpoint

    from .test_collective import _identity_plan

    pinned: list[tuple[int, int]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(PinnedPool, "get", lambda self, i, n: pinned.append((i, n)))
    plan = _identity_plan({f"t{i}": torch.zeros(2048) for i in range(6)}, 0.01)
    endpoint = SenderEndpoint()
    endpoint.plan = pickle.loads(pickle.dumps(plan))
    endpoint.pin_host_copies(0)
    assert pinned == [(i, b.nbytes) for i, b in enumerate(plan.for_sender(0))] and len(pinned) >= 3
    unsent = endpoint._copies  # an empty HostCopies holding the pool, which the first push closes
    pool = unsent._pool
    first = endpoint._copies = HostCopies.after(unsent, None)  # (the first push, as an ipc one takes it)
    assert first._pool is pool and pool is not None
    endpoint.pin_host_copies(0)  # the plan formed again: the buffers in use stay the sender's, none more pinned
    assert endpoint._copies is first and len(pinned) == len(plan.for_sender(0))
    assert HostCopies.after(first, None)._pool is pool  # and the next push reuses them
    left = HostCopies(None, pool)
    endpoint.group = types.SimpleNamespace(_copies=left, close=lambda: None)
    endpoint.leave()  # a group left (the replicas changed): its last copies go to the next group's first push,
    assert endpoint._copies is left and HostCopies.after(endpoint._copies, None)._pool is pool  # with the pool
