"""Transports: how one packed bucket gets from the publisher to every replica.

Owns: the `Transport` protocol (put a bucket once, hand every replica the same payload, read it back on the owner
side, release it), its implementations and `select_transport` (`WeightsyncConfig.transport` and the placement -> one
of them): `ObjectStoreTransport` (any placement: one `ray.put` per bucket, every replica gets a zero-copy read-only
view), `SharedMemoryTransport` (one host: each bucket written once into a /dev/shm file every replica's workers map),
and `CollectiveTransport` (nccl, gloo or ipc: the sending learner ranks move
each bucket straight into the engine workers' memory, collective.py; its handles are the senders' host copies in the
object store, so restores, retries and late joiners go the object-store way).
Why not vLLM's `weight_transfer` engines: they apply weights as they arrive, with no stage-then-commit check.
Must never: decide ordering or retries (push.py does), or look inside a bucket.
Details: docs/design/weightsync.md, "Transports".
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from asyncrl.config import WeightsyncConfig
from asyncrl.weightsync.bucket import Bucket, SharedAllocator, SharedBucket, write_shared


class TransportUnavailable(ValueError):
    """The configured transport is not available for this placement / build."""


class Transport:
    """How buckets reach the replicas. `streamed`: the senders broadcast while the replicas receive (collective),
    what is put being only their host copies; `by_reference`: any Ray process reads a handle where it lies (the
    WeightStore keeps the handles as they are); `alloc`: a buffer to pack a bucket into so that `put` copies
    nothing (None: none); `backend`: a collective transport's (gloo, nccl, ipc)."""

    name = ""
    streamed = False
    by_reference = False
    backend: str | None = None
    alloc: Callable[[int], Any] | None = None

    def put(self, bucket: Bucket) -> Any:  # `bucket` made available to every replica, once a bucket: its handle
        raise NotImplementedError

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

    def put(self, bucket: Bucket) -> Any:
        return self._ray.put(bucket)

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

    This transport owns the files: `release` unlinks one; `close` (or the transport being
    collected, or the process exiting) unlinks every one it still holds.
    """

    name = "shm"

    def __init__(self) -> None:
        self._files: set[str] = set()
        self._finalizer = weakref.finalize(self, _unlink_all, self._files)
        self._allocator = SharedAllocator()

    def close(self) -> None:
        self._allocator.discard()
        self._finalizer()

    def alloc(self, nbytes: int) -> Any:  # type: ignore[override]
        """A buffer that is already a shared file: a bucket packed into it is put without a copy."""
        return self._allocator(nbytes)

    def put(self, bucket: Bucket) -> SharedBucket:
        shared = write_shared(bucket, self._allocator)
        if shared.path is not None:
            self._files.add(shared.path)
        return shared

    def payload(self, handle: SharedBucket) -> SharedBucket:
        return handle

    def fetch(self, handle: SharedBucket) -> Bucket:
        if not isinstance(handle, SharedBucket):
            raise TypeError(f"transport=shm got a {type(handle).__name__} handle, not a SharedBucket")
        if handle.path is not None:
            self._files.add(handle.path)
        return handle.open()

    def release(self, handle: SharedBucket) -> None:
        if self._allocator.owns(handle.path):  # packed into by this process: reused by a later push
            self._allocator.release(handle.path)  # type: ignore[arg-type]
            return
        handle.unlink()
        self._files.discard(handle.path)


class CollectiveTransport(ObjectStoreTransport):
    """Broadcast groups between the sending learner ranks and every engine worker (collective.py).

    The broadcast itself is not a `put`: the sender streams while the replicas receive
    (`Publisher.publish_streamed`). What this transport puts, fetches and releases are the host
    copies the senders keep in the object store, exactly as `ObjectStoreTransport` does."""

    streamed = True

    def __init__(self, backend: str, get_timeout_s: float = 120.0) -> None:
        from asyncrl.weightsync.collective import BACKENDS

        if backend not in BACKENDS:
            raise TransportUnavailable(f"collective backend must be one of {BACKENDS}, got {backend!r}")
        super().__init__(get_timeout_s)
        self.name = self.backend = backend


def _unlink_all(paths: set[str]) -> None:
    for path in list(paths):
        SharedBucket(path, [], 0).unlink()
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
