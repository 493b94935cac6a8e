"""Transports: how one packed bucket gets from the publisher to every replica, and a sending rank's host copies.

Owns: the `Transport` protocol (put a bucket once, hand every replica the same payload, read it back, release it) and
`select_transport` (`WeightsyncConfig.transport` and the placement -> one of them): `ObjectStoreTransport` (one
`ray.put` per bucket, every replica a zero-copy read-only view), `SharedMemoryTransport` (one host: each bucket
written once into a /dev/shm file every replica's workers map) and `CollectiveTransport` (nccl, gloo or ipc: the
senders move each bucket straight into the engine workers' memory, collective.py; its handles are the senders' host
copies in the object store). And those host copies (`HostCopies`, `PinnedPool`): each sent device bucket copied to
pinned host memory on a side stream and kept (`ray.put`) by `KEEP_THREADS` threads, off the push's critical path;
and a sending learner rank's export packed into host buckets of shm or the object store (`pack_into_transport`).
Must never: decide ordering or retries (push.py), look inside a bucket, drop a device bucket before its copy is done,
or wait without a deadline. Details: docs/design/weightsync.md, "Transports" and "Host copies".
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.config import WeightsyncConfig
from asyncrl.types import WeightExport
from asyncrl.weightsync.bucket import FREE, Bucket, SharedAllocator, SharedBucket, digest_key_prefix, iter_buckets, write_shared
from asyncrl.weightsync.fingerprint import bucket_digests

BACKENDS = ("gloo", "nccl", "ipc")  # the collective transports (collective.py)


def is_object_ref(value: Any) -> bool:
    """A Ray object handle (one that travelled nested in another value is left unresolved by Ray)."""
    import ray

    return isinstance(value, ray.ObjectRef)


class TransportUnavailable(ValueError):
    """The configured transport is not available for this placement / build."""


class Transport:
    """How buckets reach the replicas, once the learner ranks put them (`pack_into_transport`). `streamed`: the
    senders broadcast while the replicas receive (collective), what is put being only their host copies;
    `by_reference`: any Ray process reads a handle where it lies (the WeightStore keeps the handles as they are);
    `backend`: a collective transport's (gloo, nccl, ipc)."""

    name = ""
    streamed = False
    by_reference = False
    backend: str | None = None

    def payload(self, handle: Any) -> Any:  # what every replica's `load_bucket` receives for this bucket
        raise NotImplementedError

    def fetch(self, handle: Any) -> Bucket:  # the bucket read back on the publisher's side (fingerprint, rollback)
        raise NotImplementedError

    def release(self, handle: Any) -> None:  # the bucket is no longer needed by anyone
        raise NotImplementedError


class ObjectStoreTransport(Transport):
    """Ray object store: one `ray.put` per bucket, the same ObjectRef fans out to all replicas.

    The publisher's process owns the objects, so they live as long as it holds the handles
    (the last live version's buckets are kept for rollbacks; see push.py).
    """

    name = "object_store"
    by_reference = True  # ObjectRefs: the WeightStore keeps them as they are (push.py, `_keep_live`)

    def __init__(self, get_timeout_s: float = 120.0) -> None:
        import ray

        if not ray.is_initialized():
            raise TransportUnavailable("transport=object_store needs a running Ray runtime (ray.init first)")
        self._ray = ray
        self._get_timeout_s = get_timeout_s

    def payload(self, handle: Any) -> Any:
        # Passed as a top-level actor-call argument, Ray resolves it before the call and the
        # numpy buffer inside is mapped from shared memory, not copied.
        return handle

    def fetch(self, handle: Any) -> Bucket:
        return self._ray.get(handle, timeout=self._get_timeout_s)

    def release(self, handle: Any) -> None:
        # Dropping the last reference frees the object; nothing to do beyond letting go.
        return None


class SharedMemoryTransport(Transport):
    """Same host only: one shared file per bucket (bucket.py's `SharedBucket`), mapped by every
    replica's workers. Buckets the learner ranks wrote themselves are adopted when first read.

    This transport owns the files: `release` hands one back to the packers (`SharedBucket.recycle`: the next export
    writes into it again), and one that no export took by the export after is unlinked; `close` (or the transport
    being collected, or the process exiting) unlinks every one it still holds.
    """

    name = "shm"

    def __init__(self) -> None:
        self._files: set[str] = set()
        self._recycled: set[str] = set()  # released since the last export was read
        self._finalizer = weakref.finalize(self, _unlink_all, self._files, self._recycled)

    def close(self) -> None:
        self._finalizer()

    def payload(self, handle: SharedBucket) -> SharedBucket:
        return handle

    def fetch(self, handle: SharedBucket) -> Bucket:
        if not isinstance(handle, SharedBucket):
            raise TypeError(f"transport=shm got a {type(handle).__name__} handle, not a SharedBucket")
        if handle.path is not None and handle.path not in self._files:  # a new export's: the packers are done
            _unlink_all(set(), self._recycled)  # with the files released before it: one still free stays unused
            self._files.add(handle.path)
        return handle.open()

    def release(self, handle: SharedBucket) -> None:
        handle.recycle()
        self._files.discard(handle.path)
        if handle.path is not None:
            self._recycled.add(handle.path)


class CollectiveTransport(ObjectStoreTransport):
    """Broadcast groups between the sending learner ranks and every engine worker (collective.py).

    The sender streams while the replicas receive (a `StreamedSource`); what this transport fetches and
    releases are the host copies the senders keep in the object store, as `ObjectStoreTransport` does."""

    streamed = True

    def __init__(self, backend: str, get_timeout_s: float = 120.0) -> None:
        if backend not in BACKENDS:
            raise TransportUnavailable(f"collective backend must be one of {BACKENDS}, got {backend!r}")
        super().__init__(get_timeout_s)
        self.name = self.backend = backend


def _unlink_all(files: set[str], recycled: set[str]) -> None:
    """Every file a transport holds, and those it released that no packer took (a taken one is another's now)."""
    for paths, suffix in ((files, ""), (recycled, FREE)):
        for path in list(paths):
            SharedBucket(path, [], 0).unlink(suffix)
        paths.clear()


def single_host() -> bool:
    """Whether the running Ray cluster has one live node (so every process shares /dev/shm)."""
    import ray

    return ray.is_initialized() and sum(1 for n in ray.nodes() if n.get("Alive")) == 1


def cluster_gpus() -> float:
    """GPUs of the running Ray cluster (0 without one)."""
    import ray

    return float(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else 0.0


def auto_transport(*, on_gpu: bool, hybrid: bool, own_gpus: bool, one_host: bool, gpus: float) -> str:
    """What `transport: auto` means (the rule, apart from the cluster it reads):
    - hybrid (learner and engines take turns on the same devices): ipc;
    - one host with the learner on GPUs: ipc when the host has one GPU (every rank and engine shares it:
      handles, no copy through host memory), nccl when each learner rank and each engine holds whole GPUs
      of its own (`own_gpus`), else shm (fractional GPUs on a host of several: where they sit is Ray's choice);
    - one host, CPU learner: shm; several hosts: nccl with a GPU learner, object_store on CPU hosts.
    On one GPU ipc is the fastest by far: no bytes cross host memory (docs/BENCHMARKS.md)."""
    if hybrid:
        return "ipc"
    if one_host:
        if on_gpu and 0 < gpus <= 1:
            return "ipc"
        if on_gpu and own_gpus:
            return "nccl"
        return "shm"
    return "nccl" if on_gpu else "object_store"


def select_transport(config: WeightsyncConfig, *, on_gpu: bool = False, hybrid: bool = False,
                     own_gpus: bool = False) -> Transport:
    """`config.transport`, with `auto` resolved by `auto_transport` against the running cluster.
    `on_gpu`: the learner's ranks hold GPUs (whatever this process sees); `own_gpus`: every learner
    rank and every engine replica holds at least one whole GPU."""
    kind = config.transport
    if kind == "auto":
        one_host = single_host()
        kind = auto_transport(on_gpu=on_gpu, hybrid=hybrid, own_gpus=own_gpus, one_host=one_host,
                              gpus=cluster_gpus() if one_host and on_gpu else 0.0)
    if kind == "object_store":
        return ObjectStoreTransport(get_timeout_s=config.timeout_s)
    if kind == "shm":
        return SharedMemoryTransport()
    if kind == "nccl" and not on_gpu:
        raise TransportUnavailable("weightsync.transport='nccl' needs the learner on GPUs (learner.num_gpus_per_rank > 0); "
                                   "use 'gloo' for the same broadcast path on CPU hosts")
    if kind in ("nccl", "gloo", "ipc"):
        return CollectiveTransport(kind, get_timeout_s=config.timeout_s)
    raise TransportUnavailable(
        f"weightsync.transport={config.transport!r} resolves to {kind!r} (on_gpu={on_gpu}, hybrid={hybrid}), "
        "which is not implemented in this build; use transport='nccl' (GPUs), 'ipc' (shared devices), 'gloo', 'shm' (one host) or 'object_store'"
    )


# ---- a sending rank's host copies -------------------------------------------------------------------------------

KEEP_THREADS = 2  # buckets kept (put into the object store) at once: more contend for the host's copies


class HostCopyError(RuntimeError):
    pass


class PinnedPool:
    """Pinned host buffers by bucket index, kept between pushes (a push's k-th bucket reuses the
    last push's k-th buffer when it is large enough)."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = []

    def get(self, index: int, nbytes: int) -> torch.Tensor:
        while len(self._buffers) <= index:
            self._buffers.append(None)
        buf = self._buffers[index]
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[index] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return buf[:nbytes]

    def trim(self, count: int) -> None:
        """Free the buffers past the first `count` (the model shrank, or the bucket size changed)."""
        del self._buffers[count:]

    @property
    def nbytes(self) -> int:
        return sum(int(b.numel()) for b in self._buffers if b is not None)


@dataclass
class _Copy:
    host: Bucket
    device: Bucket | None = None  # held until `event` completed: the copy still reads it
    event: Any = None  # torch.cuda.Event on the copy stream
    pending: bool = False  # a deferred copy not started yet (HostCopies.start_copies)
    pinned: Any = None  # a deferred copy's pinned destination (`host` is its numpy view)

    def done(self) -> bool:
        return not self.pending and (self.event is None or self.event.query())

    def wait(self, deadline: float) -> Bucket:
        while self.pending:  # started by another thread (start_copies), or dropped by close
            if time.monotonic() > deadline:
                raise HostCopyError("device-to-host copy of a bucket not started by the deadline")
            time.sleep(0.0002)
        if self.event is not None:
            while not self.event.query():
                if time.monotonic() > deadline:
                    raise HostCopyError("device-to-host copy of a bucket not complete by the deadline")
                time.sleep(0.0002)
        self.device = None
        return self.host


class HostCopies:
    """The host copies of one push from one sender; `add` each sent bucket, then `finish`.

    `add` returns at once (every bucket of a push is kept until the push ends, so nothing bounds
    the copies in flight); `result` waits for all and returns what `keep` returned for each, in
    bucket order. `seconds`: `wait` is the time `add` spent (on the critical path), `copy` and
    `keep` the thread's time waiting for copies and keeping them. `keep` runs behind the copies."""

    def __init__(self, keep: Callable[[Bucket], Any] | None, pool: PinnedPool | None, *, deadline: float,
                 keep_threads: int = KEEP_THREADS, defer_keep: bool = False, defer_copy: bool = False) -> None:
        self._keep = keep if keep is not None else (lambda bucket: bucket)
        self._keepers = ThreadPoolExecutor(keep_threads, thread_name_prefix="asyncrl-host-keep")
        self._kept_futures: list[Future] = []
        self._pool, self._deadline = pool, deadline
        self._queue: queue.Queue[_Copy | None] = queue.Queue()
        self._kept: list[Any] = []
        self._error: BaseException | None = None
        self._streams: dict[torch.device, Any] = {}
        self._count = 0
        self._finished = False
        # defer_keep: `keep` starts only at `finish` (its serialisation competes for this process's
        # GIL with a sender still waiting on its receivers); the device-to-host copies run at once.
        self._release = threading.Event()
        if not defer_keep:
            self._release.set()
        # defer_copy: the device-to-host copies start only at `start_copies` (or `result`), i.e. once
        # the push is live: on a GPU the receivers share (ipc), copies running in this process
        # would take turns on the device with the engine's apply, inside its paused window.
        self._deferred: list[_Copy] = []
        self._copy_gate = threading.Event()
        if not defer_copy:
            self._copy_gate.set()
        self.seconds = {"wait": 0.0, "copy": 0.0, "keep": 0.0}  # keep: summed over the keeper threads
        self._lock = threading.Lock()
        # Started by the first bucket (or `result`), not here: a sender makes this before its push's gate, and a
        # thread's start waits for the new thread to run, milliseconds of that path in a busy process. A whole version
        # adds its buckets while the wire runs.
        self._thread = threading.Thread(target=self._run, name="asyncrl-host-copies", daemon=True)

    # ---- the sender's side -------------------------------------------------------------------
    def add(self, bucket: Bucket) -> _Copy:
        self._check()
        self._start_thread()
        t = time.perf_counter()
        buf = bucket.buffer
        if isinstance(buf, torch.Tensor) and buf.is_cuda:
            if self._copy_gate.is_set():
                copy = self._start_device_copy(bucket)
            else:
                pinned = self._pinned(bucket)
                copy = _Copy(Bucket(buffer=pinned.numpy(), metas=list(bucket.metas), rank=bucket.rank),
                             device=bucket, pending=True, pinned=pinned)
                self._deferred.append(copy)
        else:  # already host memory (a fresh buffer per bucket), kept as it is
            copy = _Copy(Bucket(buffer=buf.numpy() if isinstance(buf, torch.Tensor) else buf, metas=list(bucket.metas),
                                rank=bucket.rank))
        self.seconds["wait"] += time.perf_counter() - t
        self._count += 1
        self._queue.put(copy)
        return copy

    def _start_thread(self) -> None:
        if self._thread.ident is None:  # (set once started)
            with self._lock:
                if self._thread.ident is None:
                    self._thread.start()

    def _pinned(self, bucket: Bucket) -> torch.Tensor:
        nbytes = int(bucket.buffer.numel())
        return self._pool.get(self._count, nbytes) if self._pool is not None else torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _enqueue_copy(self, bucket: Bucket, pinned: torch.Tensor) -> Any:
        buf: torch.Tensor = bucket.buffer
        stream = self._streams.get(buf.device)
        if stream is None:
            stream = self._streams[buf.device] = torch.cuda.Stream(buf.device)
        stream.wait_stream(torch.cuda.current_stream(buf.device))  # the pack that wrote it
        with torch.cuda.stream(stream):
            pinned.copy_(buf.view(torch.uint8).reshape(-1), non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def _start_device_copy(self, bucket: Bucket) -> _Copy:
        pinned = self._pinned(bucket)
        return _Copy(Bucket(buffer=pinned.numpy(), metas=list(bucket.metas), rank=bucket.rank), device=bucket,
                     event=self._enqueue_copy(bucket, pinned))

    def start_copies(self) -> None:
        """Start the deferred device-to-host copies (`defer_copy`); idempotent. Not after `close`."""
        if self._copy_gate.is_set():
            return
        with self._lock:
            if self._error is None:
                for copy in self._deferred:
                    copy.event = self._enqueue_copy(copy.device, copy.pinned)  # type: ignore[arg-type]
                    copy.pending, copy.pinned = False, None
            self._deferred = []
            self._copy_gate.set()

    def finish(self) -> None:
        """No more buckets: the pool keeps as many buffers as this push used."""
        if self._pool is not None:
            self._pool.trim(self._count)
        self._end()

    def _end(self) -> None:
        self._release.set()
        if not self._finished:
            self._finished = True
            self._queue.put(None)

    def result(self, deadline: float | None = None) -> list[Any]:
        """What `keep` returned for every bucket, in order; raises the first failure."""
        self.start_copies()
        self._end()
        self._start_thread()
        self._thread.join(max(0.0, (deadline if deadline is not None else self._deadline) - time.monotonic()))
        if self._thread.is_alive():
            kept = sum(f.done() for f in self._kept_futures)
            raise HostCopyError(f"host copies of {self._count} buckets not kept by the deadline ({kept} kept)")
        self._check()
        return list(self._kept)

    def close(self, timeout_s: float = 30.0) -> bool:
        """Stop the thread and drop what was kept; returns whether it ended, i.e. whether the pool
        is free again (a `keep` stuck past `timeout_s` may still read its pinned buffer)."""
        if self._error is None:
            self._error = HostCopyError("closed")
        with self._lock:  # copies never started read nothing: drop them
            for copy in self._deferred:
                copy.device, copy.pending = None, False
            self._deferred = []
            self._copy_gate.set()
        self._end()
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        self._kept.clear()
        return not self._thread.is_alive()

    def _check(self) -> None:
        if self._error is not None:
            raise HostCopyError(f"host copy failed: {type(self._error).__name__}: {self._error}") from self._error

    # ---- the threads ---------------------------------------------------------------------------
    def _run(self) -> None:
        """Wait for each copy in order, hand it to a keeper thread; at the end, collect in order."""
        while (copy := self._queue.get()) is not None:
            try:
                self._copy_gate.wait(max(0.0, self._deadline - time.monotonic()))
                if self._error is None:
                    t = time.perf_counter()
                    host = copy.wait(self._deadline)
                    self.seconds["copy"] += time.perf_counter() - t  # `wait` dropped the device bucket
                    self._release.wait(max(0.0, self._deadline - time.monotonic()))
                    self._kept_futures.append(self._keepers.submit(self._keep_one, host))
                    continue
            except BaseException as err:  # noqa: BLE001 - reported by `result` / the next `add`
                self._error = err
            copy.device = None
        for future in self._kept_futures:  # in bucket order
            try:
                self._kept.append(future.result())
            except BaseException as err:  # noqa: BLE001
                if self._error is None:
                    self._error = err
        self._keepers.shutdown(wait=False)

    def _keep_one(self, host: Bucket) -> Any:
        t = time.perf_counter()
        try:
            if self._error is not None:  # an earlier bucket failed or the push was closed: keep nothing more
                raise self._error
            return self._keep(host)
        except BaseException as err:
            if self._error is None:
                self._error = err
            raise
        finally:
            with self._lock:
                self.seconds["keep"] += time.perf_counter() - t


def pack_into_transport(tensors: Iterable[tuple[str, Any]], bucket_mb: float, transport: str, verify: str,
                        plan: Any = None, sender: int = 0) -> WeightExport:
    """Pack the stream into host buckets (engine layout with `plan`), each written straight into
    its shared file (shm) or put into the object store, and hash each as it is packed."""
    import ray

    if transport not in ("object_store", "shm"):
        raise ValueError(f"transport={transport!r}: learner ranks can put buckets into object_store or shm only")
    allocator = SharedAllocator() if transport == "shm" else None
    if plan is None:
        buckets = iter_buckets(tensors, bucket_mb, device="cpu", alloc=allocator)
    else:
        from asyncrl.weightsync.plan import PlannedPacker

        buffer = None if allocator is None else (lambda b: allocator(b.nbytes))
        buckets = PlannedPacker(plan, sender, "cpu", buffer).pack(tensors)
    handles, metas, digests = [], [], []
    seconds = {"pack": 0.0, "hash": 0.0, "put": 0.0}
    try:
        while True:
            t = time.perf_counter()
            bucket = next(buckets, None)
            seconds["pack"] += time.perf_counter() - t
            if bucket is None:
                break
            t = time.perf_counter()
            digests.append(bucket_digests(bucket, verify, digest_key_prefix(bucket)))  # type: ignore[arg-type]
            seconds["hash"] += time.perf_counter() - t
            t = time.perf_counter()
            metas.append(list(bucket.metas))
            if allocator is not None:
                handles.append(write_shared(bucket, allocator))
            else:
                host = bucket if not isinstance(bucket.buffer, torch.Tensor) else type(bucket)(
                    buffer=bucket.buffer.numpy(), metas=list(bucket.metas), rank=bucket.rank)
                handles.append(ray.put(host))
            seconds["put"] += time.perf_counter() - t
            del bucket  # one packed bucket alive at a time in this heap
    except BaseException:
        if allocator is not None:  # object-store refs free themselves when dropped
            allocator.discard()
            for h in handles:
                h.unlink()
        raise
    return WeightExport(buckets=handles, metas=metas, senders=[sender] * len(handles), digests=digests,
                        bytes=sum(m.nbytes for ms in metas for m in ms), num_tensors=sum(map(len, metas)),
                        num_buckets=len(handles), seconds=seconds)
