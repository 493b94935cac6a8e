"""Transports: how one packed bucket gets from the publisher to every replica, and a sending rank's host copies.

Owns: the `Channel` protocol (hand every replica the payload of a bucket the learner ranks put, read it, release it),
`select_channel` (config and placement -> `ObjectStoreChannel`: one `ray.put` a bucket, read as zero-copy views;
`ShmChannel`: one host, one /dev/shm file a bucket that every replica's workers map; `BroadcastChannel`:
nccl, gloo (collective.py) or ipc (ipc.py), whose handles are the senders' host copies in the object store), those
host copies (`HostCopies`, `PinnedPool`: made once collected, off the push's critical path), and a learner rank's
export packed into shm or object-store buckets (`pack_into_transport`).
Must never: decide ordering or retries (push.py), look inside a bucket, drop a device bucket before its copy is done,
or wait without a deadline. Details: docs/design/weightsync.md, "Transports" and "Host copies"."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.config import WeightsyncConfig
from asyncrl.types import WeightExport
from asyncrl.weightsync.bucket import FREE, Bucket, SharedAllocator, SharedBucket, digest_key_prefix, write_shared
from asyncrl.weightsync.fingerprint import bucket_digests
from asyncrl.weightsync.plan import pack_stream

BACKENDS = ("gloo", "nccl", "ipc")  # the collective transports (collective.py; ipc.py's needs no group)


def is_object_ref(value: Any) -> bool:
    """A Ray object handle (one that travelled nested in another value is left unresolved by Ray)."""
    import ray

    return isinstance(value, ray.ObjectRef)


class ChannelUnavailable(ValueError):
    """The configured channel is not available for this placement / build."""


class Channel:
    """How buckets reach the replicas, once the learner ranks put them (`pack_into_transport`)."""

    name = ""
    streamed = False  # the senders broadcast while the replicas receive (collective); what is put: their host copies
    by_reference = False  # any Ray process reads a handle where it lies (the WeightStore keeps the handles as they are)
    backend: str | None = None  # a collective transport's (gloo, nccl, ipc)

    def payload(self, handle: Any) -> Any:
        """What every replica's `load_bucket` receives for this bucket: the handle itself (an ObjectRef, passed as a
        top-level actor-call argument, is resolved by Ray before the call, its numpy buffer mapped, not copied)."""
        return handle

    def fetch(self, handle: Any) -> Bucket:  # the bucket read back on the publisher's side (fingerprint, rollback)
        raise NotImplementedError

    def release(self, handle: Any) -> None:  # the bucket is no longer needed by anyone (an object ref frees itself)
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
        self._ray = ray
        self._get_timeout_s = get_timeout_s

    def fetch(self, handle: Any) -> Bucket:
        return self._ray.get(handle, timeout=self._get_timeout_s)


class ShmChannel(Channel):
    """Same host only: one shared file per bucket (`SharedBucket`), mapped by every replica's workers. It owns the
    files, adopting one the learner ranks wrote when first read: `release` hands one back to the packers
    (`SharedBucket.recycle`: the next export writes into it again), one no export took by the export after is
    unlinked, and `close` (or the transport's collection, or process exit) unlinks every one it still holds."""

    name = "shm"

    def __init__(self) -> None:
        self._files: set[str] = set()
        self._recycled: set[str] = set()  # released since the last export was read
        self._finalizer = weakref.finalize(self, _unlink_all, self._files, self._recycled)

    def close(self) -> None:
        self._finalizer()

    def fetch(self, handle: SharedBucket) -> Bucket:
        if handle.path is not None and handle.path not in self._files:  # a new export's: the packers are done
            _unlink_all(set(), self._recycled)  # with the files released before it: one still free stays unused
            self._files.add(handle.path)
        return handle.open()

    def release(self, handle: SharedBucket) -> None:
        handle.recycle()
        self._files.discard(handle.path)
        if handle.path is not None:
            self._recycled.add(handle.path)


class BroadcastChannel(ObjectStoreChannel):
    """Broadcast groups between the sending learner ranks and every engine worker (collective.py): the senders stream
    while the replicas receive (`StreamedSource`); it fetches and releases their host copies in the object store."""

    streamed = True

    def __init__(self, backend: str, get_timeout_s: float = 120.0) -> None:
        super().__init__(get_timeout_s)
        self.name = self.backend = backend


def _unlink_all(files: set[str], recycled: set[str]) -> None:
    """Every file a transport holds, and those it released that no packer took (a taken one is another's now)."""
    for paths, suffix in ((files, ""), (recycled, FREE)):
        for path in list(paths):
            SharedBucket(path, [], 0).unlink(suffix)
        paths.clear()


def auto_transport(*, on_gpu: bool, hybrid: bool, own_gpus: bool, one_host: bool, gpus: float) -> str:
    """What `transport: auto` means, apart from the cluster it reads: ipc where the learner and the engines share
    GPUs (hybrid, or a host of one GPU: handles, no bytes cross host memory); nccl where each holds whole GPUs of
    its own, and across GPU hosts; shm for a hybrid or one-host run otherwise (CPUs, or fractional GPUs on a host of
    several: where they sit is Ray's choice); object_store across CPU hosts."""
    if hybrid:
        return "ipc" if on_gpu else "shm"
    if one_host:
        if on_gpu and 0 < gpus <= 1:
            return "ipc"
        if on_gpu and own_gpus:
            return "nccl"
        return "shm"
    return "nccl" if on_gpu else "object_store"


def select_channel(config: WeightsyncConfig, *, on_gpu: bool = False, hybrid: bool = False,
                   own_gpus: bool = False) -> Channel:
    """`config.transport`, with `auto` resolved by `auto_transport` against the running cluster.
    `on_gpu`: the learner's ranks hold GPUs (whatever this process sees); `own_gpus`: every learner
    rank and every engine replica holds at least one whole GPU."""
    kind = config.transport
    if kind == "auto":  # (one live node: every process shares /dev/shm; its GPUs)
        import ray

        one_host = ray.is_initialized() and sum(1 for n in ray.nodes() if n.get("Alive")) == 1
        kind = auto_transport(on_gpu=on_gpu, hybrid=hybrid, own_gpus=own_gpus, one_host=one_host,
                              gpus=float(ray.cluster_resources().get("GPU", 0)) if one_host and on_gpu else 0.0)
    if kind == "object_store":
        return ObjectStoreChannel(get_timeout_s=config.timeout_s)
    if kind == "shm":
        return ShmChannel()
    if kind == "nccl" and not on_gpu:
        raise ChannelUnavailable("weightsync.transport='nccl' needs the learner on GPUs (learner.num_gpus_per_rank > 0); "
                                 "use 'gloo' for the same broadcast path on CPU hosts")
    if kind == "ipc" and not on_gpu:
        raise ChannelUnavailable("weightsync.transport='ipc' hands the engines CUDA memory of the learner's and needs "
                                 "the learner on GPUs (learner.num_gpus_per_rank > 0); use 'shm' on one CPU host")
    return BroadcastChannel(kind, get_timeout_s=config.timeout_s)  # (gloo, nccl or ipc: the config's other kinds)


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


def pack_into_transport(tensors: Iterable[tuple[str, Any]], bucket_mb: float, transport: str, verify: str,
                        plan: Any = None, sender: int = 0) -> WeightExport:
    """Pack the stream into host buckets (engine layout with `plan`), each written straight into
    its shared file (shm) or put into the object store, and hash each as it is packed."""
    import ray

    if transport not in ("object_store", "shm"):
        raise ValueError(f"transport={transport!r}: learner ranks can put buckets into object_store or shm only")
    allocator = SharedAllocator() if transport == "shm" else None
    buckets = pack_stream(tensors, bucket_mb, torch.device("cpu"), plan=plan, sender=sender, alloc=allocator)
    handles, metas, digests = [], [], []
    seconds = {"pack": 0.0, "hash": 0.0, "put": 0.0}
    try:
        t = time.perf_counter()
        for bucket in buckets:
            seconds["pack"] += time.perf_counter() - t
            t = time.perf_counter()
            digests.append(bucket_digests(bucket, verify, digest_key_prefix(bucket)))  # type: ignore[arg-type]
            seconds["hash"] += time.perf_counter() - t
            t = time.perf_counter()
            metas.append(list(bucket.metas))
            if allocator is not None:
                handles.append(write_shared(bucket, allocator))
            else:
                host = Bucket(buffer=bucket.buffer.numpy(), metas=list(bucket.metas), rank=bucket.rank)
                handles.append(ray.put(host))  # (numpy: Ray's pickle-5 path moves it out of band)
            seconds["put"] += time.perf_counter() - t
            del bucket  # one packed bucket alive at a time in this heap
            t = time.perf_counter()
        seconds["pack"] += time.perf_counter() - t  # (the export's end)
    except BaseException:
        if allocator is not None:  # object-store refs free themselves when dropped
            allocator.discard()
            for h in handles:
                h.unlink()
        raise
    return WeightExport(buckets=handles, metas=metas, senders=[sender] * len(handles), digests=digests,
                        bytes=sum(m.nbytes for ms in metas for m in ms), num_tensors=sum(map(len, metas)),
                        num_buckets=len(handles), seconds=seconds)
