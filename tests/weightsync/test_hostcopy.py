"""The sender's host copies (weightsync/transport.py): kept in order off the caller's thread, failures
reported, bounded, and (on a GPU) copied into pinned buffers that later pushes reuse."""

from __future__ import annotations

import contextlib
import threading
import time

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


def test_every_bucket_is_kept_in_order_off_the_callers_thread():
    threads: list[str] = []

    def keep(bucket):
        threads.append(threading.current_thread().name)
        return bucket

    copies = HostCopies(keep, None, deadline=time.monotonic() + 20)
    for bucket in _buckets(1, "cpu"):  # torch buffers on the host, as a CPU sender packs them
        copies.add(bucket)
    copies.finish()
    kept = copies.result()
    weights = model(1)
    assert len(kept) == 3 and [m.name for b in kept for m in b.metas] == list(weights)
    assert all(torch.equal(t, weights[n]) for n, t in _unpacked(kept).items())
    assert threads and all(name.startswith("asyncrl-host-keep") for name in threads)  # not the caller's


def test_the_copying_thread_starts_with_the_first_bucket_not_before():
    """A sender makes its push's host copies before the push's gate: their thread starts with the first bucket
    (a whole version adds its buckets while the wire runs), or at `result`; one never started closes at once."""
    copies = HostCopies(None, None, deadline=time.monotonic() + 20)
    assert not copies._thread.is_alive() and copies._thread not in threading.enumerate()
    buckets = _buckets(2, "cpu")
    copies.add(buckets[0])
    assert copies._thread.is_alive()
    for bucket in buckets[1:]:
        copies.add(bucket)
    copies.finish()
    assert [m.name for b in copies.result() for m in b.metas] == list(model(2))
    empty = HostCopies(None, None, deadline=time.monotonic() + 20)
    empty.finish()
    assert empty.result() == [] and not empty._thread.is_alive()  # started, ended at once
    unused = HostCopies(None, None, deadline=time.monotonic() + 20)
    assert unused.close() and unused._thread.ident is None  # (never started)
    with pytest.raises(HostCopyError, match="closed"):
        unused.add(buckets[0])


def test_a_deferred_keep_starts_only_at_finish_and_still_keeps_everything_in_order():
    """defer_keep (a whole-version ipc push): nothing is kept while the sender still waits on its
    receivers; finish releases it."""
    kept_at: list[float] = []

    def keep(bucket):
        kept_at.append(time.monotonic())
        return bucket

    copies = HostCopies(keep, None, deadline=time.monotonic() + 20, defer_keep=True)
    for bucket in _buckets(5, "cpu"):
        copies.add(bucket)
    time.sleep(0.3)
    assert kept_at == []  # held back
    released = time.monotonic()
    copies.finish()
    kept = copies.result()
    assert len(kept) == 3 and len(kept_at) == 3 and min(kept_at) >= released
    assert all(torch.equal(t, model(5)[n]) for n, t in _unpacked(kept).items())
    closed = HostCopies(keep, None, deadline=time.monotonic() + 20, defer_keep=True)
    closed.add(_buckets(6, "cpu")[0])
    assert closed.close(5.0)  # closing a deferred push never hangs


def test_a_failing_keep_is_raised_by_result_and_by_the_next_add():
    calls = []

    def keep(bucket):
        calls.append(bucket)
        raise RuntimeError("object store full")

    copies = HostCopies(keep, None, deadline=time.monotonic() + 20)
    first, *rest = _buckets(2)
    copies.add(first)
    time.sleep(0.2)
    with pytest.raises(HostCopyError, match="object store full"):
        copies.add(rest[0])
    with pytest.raises(HostCopyError, match="object store full"):
        copies.result()
    assert len(calls) == 1  # nothing is kept after the first failure


@contextlib.contextmanager
def _stuck_keep(deadline_s: float, **kwargs):
    """HostCopies whose `keep` blocks until `release` is set (set, and the copies closed, at exit)."""
    release = threading.Event()
    copies = HostCopies(lambda b: release.wait(30) and b, None, deadline=time.monotonic() + deadline_s, **kwargs)
    try:
        yield copies, release
    finally:
        release.set()
        copies.close()


def test_result_waits_no_longer_than_its_deadline():
    with _stuck_keep(30) as (copies, _):
        copies.add(_buckets(4)[0])
        t0 = time.monotonic()
        with pytest.raises(HostCopyError, match="not kept by the deadline"):
            copies.result(time.monotonic() + 0.3)
        assert time.monotonic() - t0 < 5


def test_close_reports_a_keep_that_is_still_running():
    """The next push reuses the pinned pool only if the last push's thread has ended."""
    with _stuck_keep(30) as (copies, release):
        copies.add(_buckets(8)[0])
        time.sleep(0.1)
        assert copies.close(timeout_s=0.2) is False  # stuck in keep: the pool must not be reused
        release.set()
        assert copies.close(timeout_s=10) is True
        with pytest.raises(HostCopyError, match="closed"):
            copies.result()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned buffers and device-to-host copies need CUDA")
def test_device_buckets_are_copied_into_pinned_buffers_that_the_next_push_reuses():
    pool = PinnedPool()
    pointers = []
    for seed in (5, 6):  # two pushes: the second writes into the first one's buffers
        copies = HostCopies(None, pool, deadline=time.monotonic() + 60)
        buckets = _buckets(seed, "cuda")
        for bucket in buckets:
            copies.add(bucket)
        del buckets  # the copies hold the device buckets until copied
        copies.finish()
        kept = copies.result()
        pointers.append([b.buffer.ctypes.data for b in kept])
        weights = model(seed)
        assert all(torch.equal(t, weights[n]) for n, t in _unpacked(kept).items())
    assert pointers[0] == pointers[1] and pool.nbytes >= sum(t.numel() * 4 for t in model(0).values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned buffers and device-to-host copies need CUDA")
def test_deferred_device_copies_start_only_when_collected_and_read_the_bytes_then():
    """defer_copy (an ipc sender's whole-version push): nothing is copied while the receivers
    apply; `result` starts the copies and keeps what the device buffers hold at that moment, and
    `close` drops copies that never started."""
    copies = HostCopies(None, PinnedPool(), deadline=time.monotonic() + 60, defer_copy=True)
    buckets = _buckets(7, "cuda")
    added = [copies.add(b) for b in buckets]
    copies.finish()
    time.sleep(0.2)
    assert all(c.pending and not c.done() for c in added)  # not started: the thread waits for the start
    kept = copies.result()
    assert not any(c.pending for c in added)
    weights = model(7)
    assert all(torch.equal(t, weights[n]) for n, t in _unpacked(kept).items())
    dropped = HostCopies(None, PinnedPool(), deadline=time.monotonic() + 60, defer_copy=True)
    copies_left = [dropped.add(b) for b in _buckets(8, "cuda")]
    assert dropped.close() and all(not c.pending and c.device is None for c in copies_left)


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
