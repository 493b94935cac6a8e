"""Channels: how one packed bucket gets from the publisher to every replica, and a sending rank's host copies.

Owns: the `Channel` interface, `ObjectStoreChannel`, `BroadcastChannel` (gloo or nccl, collective.py, or ipc, ipc.py)
and the broadcasts' host copies (`HostCopies`, `PinnedPool`: made once collected, off the push's critical path).
The shm channel is shm.py's; service.py's `select_channel` picks one.
Must never: decide ordering or retries (push.py), look inside a bucket, drop a device bucket before its copy is done,
or wait without a deadline. Details: docs/design/weightsync.md, "Channels" and "Host copies"."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.weightsync.bucket import Bucket

BACKENDS = ("gloo", "nccl", "ipc")  # the broadcast channels' (collective.py; ipc.py's needs no group)


def is_object_ref(value: Any) -> bool:
    """A Ray object handle (one that travelled nested in another value is left unresolved by Ray)."""
    import ray

    return isinstance(value, ray.ObjectRef)


class ChannelUnavailable(ValueError):
    """The configured channel is not available for this placement / build."""


class Channel:
    """How buckets reach the replicas once the learner ranks put them (shm.py's `pack_into_transport`) or stream them:
    - `payload(handle)`: what each replica's `load_bucket` receives (the handle: Ray maps a top-level ObjectRef's);
    - `fetch(handle)`: the bucket read back on the publisher's side (fingerprint, rollback);
    - `release(handle)`: nobody needs the bucket any more (an object ref frees itself)."""

    name = ""  # the `weightsync.transport` value it serves
    streamed = False  # the senders broadcast while the replicas receive (collective); what is put: their host copies
    by_reference = False  # any Ray process reads a handle where it lies (the WeightStore keeps the handles as they are)
    backend: str | None = None  # a broadcast channel's (gloo, nccl, ipc)

    def payload(self, handle: Any) -> Any:
        return handle

    def fetch(self, handle: Any) -> Bucket:
        raise NotImplementedError

    def release(self, handle: Any) -> None:
        return None


class ObjectStoreChannel(Channel):
    """Ray object store: one `ray.put` per bucket, whose ObjectRef fans out to every replica. The publisher's process
    owns the objects: they live while it holds the handles (the last live version's are kept for rollbacks, push.py)."""

    name = "object_store"
    by_reference = True

    def __init__(self, get_timeout_s: float = 120.0) -> None:
        import ray

        if not ray.is_initialized():
            raise ChannelUnavailable("transport=object_store needs a running Ray runtime (ray.init first)")
        self._ray, self._get_timeout_s = ray, get_timeout_s

    def fetch(self, handle: Any) -> Bucket:
        return self._ray.get(handle, timeout=self._get_timeout_s)


class BroadcastChannel(ObjectStoreChannel):
    """Broadcast groups between the sending learner ranks and every engine worker (collective.py), or CUDA IPC handles
    (ipc.py): the senders stream while the replicas receive (`StreamedSource`); its handles are their host copies in
    the object store. nccl and ipc are refused where the learner holds no GPU (`on_gpu`)."""

    streamed = True

    def __init__(self, backend: str, *, on_gpu: bool, get_timeout_s: float = 120.0) -> None:
        if backend == "nccl" and not on_gpu:
            raise ChannelUnavailable("weightsync.transport='nccl' needs the learner on GPUs (learner.num_gpus_per_rank"
                                     " > 0); use 'gloo' for the same broadcast path on CPU hosts")
        if backend == "ipc" and not on_gpu:  # (CUDA memory of the learner's: never aliased to shared files)
            raise ChannelUnavailable("weightsync.transport='ipc' hands the engines CUDA memory of the learner's and "
                                     "needs the learner on GPUs (learner.num_gpus_per_rank > 0); "
                                     "use 'shm' on one CPU host")
        super().__init__(get_timeout_s)
        self.name = self.backend = backend


# ---- a sending rank's host copies -------------------------------------------------------------------------------

KEEP_THREADS = 2  # buckets kept (put into the object store) at once: more contend for the host's copies


class HostCopyError(RuntimeError):
    pass


class PinnedPool:
    """Pinned host buffers kept between pushes: a push's k-th bucket reuses the last push's k-th buffer if it fits."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = []

    def get(self, index: int, nbytes: int) -> torch.Tensor:
        self._buffers += [None] * (index + 1 - len(self._buffers))
        buf = self._buffers[index]
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[index] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return buf[:nbytes]


@dataclass
class _Copy:
    host: Bucket | None  # what is kept: a device bucket's pinned copy, once enqueued
    device: Bucket | None = None  # the sent device bucket, read by the copy
    index: int = 0  # its place in the push (its pinned buffer's in the pool)
    event: Any = None  # torch.cuda.Event on the copy stream, once the copy is enqueued

    def wait(self, deadline: float) -> Bucket:
        while self.event is not None and not self.event.query():
            if time.monotonic() > deadline:
                raise HostCopyError("device-to-host copy of a bucket not complete by the deadline")
            time.sleep(0.0002)
        self.device = self.event = None
        return self.host  # type: ignore[return-value]


class HostCopies:
    """The host copies of one push from one sender. `add` each sent bucket: the sender keeps its buffer unwritten
    until its next push, which `close`s these first. `result` (once the version is live: on a shared GPU an earlier
    copy would take turns with the engine's apply) copies each device bucket into pinned memory on a side stream and
    keeps each (`keep`, e.g. `ray.put`) on `KEEP_THREADS` threads, in order; `add(bucket, now=True)` copies at once."""

    def __init__(self, keep: Callable[[Bucket], Any] | None, pool: PinnedPool | None) -> None:
        self._keep = keep if keep is not None else (lambda bucket: bucket)
        self._pool = pool if pool is not None else PinnedPool()  # (allocates only for device buckets)
        self._copies: list[_Copy] = []
        self._lock = threading.Lock()
        self._closed = False
        self._keeping = False  # `result` is keeping: the pinned buffers are read until it returns
        self.seconds = {"copy": 0.0, "keep": 0.0}

    @classmethod
    def after(cls, last: "HostCopies | None", keep: Callable[[Bucket], Any] | None) -> "HostCopies":
        """A sender's next push's host copies: the `last` push's are closed first (those nobody collected are dropped),
        their pinned buffers reused unless a keep still reads them."""
        return cls(keep, last._pool if last is not None and last.close() else None)

    def add(self, bucket: Bucket, now: bool = False) -> _Copy:
        buf = bucket.buffer
        if isinstance(buf, torch.Tensor) and buf.is_cuda:
            copy = _Copy(None, bucket, len(self._copies))
            if now:
                self._enqueue(copy)
        else:  # already host memory (a fresh buffer per bucket), kept as it is
            copy = _Copy(Bucket(buffer=buf.numpy() if isinstance(buf, torch.Tensor) else buf, metas=list(bucket.metas),
                                rank=bucket.rank))
        self._copies.append(copy)
        return copy

    def _enqueue(self, copy: _Copy) -> None:
        device: Bucket = copy.device  # type: ignore[assignment]
        buf: torch.Tensor = device.buffer
        nbytes = int(buf.numel())  # (the pinned buffer: the pool's, allocated by the first push and reused)
        pinned = self._pool.get(copy.index, nbytes)
        copy.host = Bucket(buffer=pinned.numpy(), metas=list(device.metas), rank=device.rank)
        stream = _COPY_STREAMS.get(buf.device)
        if stream is None:
            stream = _COPY_STREAMS[buf.device] = torch.cuda.Stream(buf.device)
        stream.wait_stream(torch.cuda.current_stream(buf.device))  # the pack that wrote it
        with torch.cuda.stream(stream):
            pinned.copy_(buf.view(torch.uint8).reshape(-1), non_blocking=True)
            copy.event = stream.record_event()

    def result(self, deadline: float | None = None) -> list[Any]:
        """Every bucket's `keep` result, in order, by `deadline` (default: two minutes); raises the first failure."""
        deadline = time.monotonic() + 120.0 if deadline is None else deadline
        with self._lock:
            if self._closed:
                raise HostCopyError("closed: the sender's next push reuses its buffers")
            for copy in self._copies:
                if copy.event is None and copy.device is not None:
                    self._enqueue(copy)
            self._keeping = True
        try:
            t = time.perf_counter()
            hosts = [copy.wait(deadline) for copy in self._copies]
            self.seconds["copy"] += time.perf_counter() - t
            t = time.perf_counter()
            keepers = ThreadPoolExecutor(KEEP_THREADS, thread_name_prefix="asyncrl-host-keep")
            try:
                return list(keepers.map(self._keep, hosts, timeout=max(0.0, deadline - time.monotonic())))
            except FuturesTimeout:
                raise HostCopyError(f"host copies of {len(hosts)} buckets not kept by the deadline") from None
            except Exception as err:
                raise HostCopyError(f"host copy failed: {type(err).__name__}: {err}") from err
            finally:
                keepers.shutdown(wait=False, cancel_futures=True)
                self.seconds["keep"] += time.perf_counter() - t
        finally:
            self._keeping = False

    def close(self) -> bool:
        """No `result` from now on; the caller's stream waits for the copies enqueued (so the next push may write the
        device buffers). Returns whether the pinned buffers are free again (False while a `keep` still reads them)."""
        with self._lock:
            self._closed = True
            for copy in self._copies:
                device, event = copy.device, copy.event
                if event is not None and device is not None:  # (not waited for yet)
                    torch.cuda.current_stream(device.buffer.device).wait_event(event)
                copy.device = None
        return not self._keeping


_COPY_STREAMS: dict[torch.device, Any] = {}  # the side stream host copies run on, one a device
