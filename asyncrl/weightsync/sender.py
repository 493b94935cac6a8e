"""The sending half of a push, inside a learner rank: pack, hash, put or broadcast, keep host copies.

Owns: `SenderEndpoint`, one learner rank's push state (its broadcast group and the rendezvous port it holds until the
group forms, the push plan it packs for, the host copies of its last broadcast), and `pack_into_transport` (the
export packed into host buckets for the shm / object-store transports, each hashed as it is packed). Every rank
drives its exported HF tensor stream to its end (its TP/EP gathers are collective); only the sending ranks (TP/CP/DP
rank 0 of each PP stage) pack: in the engines' layout with a push plan (plan.py), else the HF tensors as exported.

Must never: import the learner (it gets a tensor stream), or decide when a push happens.
Details: docs/design/weightsync.md, "The sender endpoint".
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from asyncrl.types import CollectiveExport, HostCopies, PackedExport, SenderAddress
from asyncrl.weightsync.bucket import SharedAllocator, digest_key_prefix, iter_buckets, write_shared
from asyncrl.weightsync.fingerprint import bucket_digests

if TYPE_CHECKING:
    from asyncrl.weightsync.collective import CollectiveGroup
    from asyncrl.weightsync.stream import SendResult


def send_stream(group: "CollectiveGroup", named_tensors: Iterable[tuple[str, Any]], bucket_mb: float, *,
                verify: str, timeout_s: float, keep: Any = None, plan: Any = None, sender: int = 0,
                arena: str = "auto", gate: str = "") -> "SendResult":
    """Send one version over `group`, by its backend's loop (stream.py: gloo / NCCL; ipc.py: a shared
    device): bucket (in the engines' layout with a `plan`), hash in the `verify` mode, send, and hand
    each bucket's host copy to `keep` off the critical path. `arena` (gloo / NCCL, a whole planned
    version): where the sender packs it; an ipc sender packs into its own ring. `gate` (gloo / NCCL):
    the push's gate token; ipc needs none (a receiver that refuses tells its sender through the store)."""
    if group.spec.backend == "ipc":
        from asyncrl.weightsync.ipc import ipc_send_stream

        return ipc_send_stream(group, named_tensors, bucket_mb, verify=verify, timeout_s=timeout_s, keep=keep, plan=plan,
                               sender=sender)
    from asyncrl.weightsync.stream import broadcast_send_stream

    return broadcast_send_stream(group, named_tensors, bucket_mb, verify=verify, timeout_s=timeout_s, keep=keep,
                                 plan=plan, sender=sender, arena=arena, gate=gate)


def pack_into_transport(tensors: Iterable[tuple[str, Any]], bucket_mb: float, transport: str, verify: str,
                        plan: Any = None, sender: int = 0) -> PackedExport:
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
    return PackedExport(buckets=handles, metas=metas, senders=[sender] * len(handles), digests=digests, seconds=seconds)


class SenderEndpoint:
    """One sending learner rank's end of the weight broadcast groups."""

    def __init__(self) -> None:
        self.group: Any = None  # this rank's broadcast group (collective.py)
        self.reserved: Any = None  # the listening socket of the next group's store
        self.host_copies: Any = None  # its last broadcast's host copies, until taken
        self.plan: Any = None  # the push plan buckets are packed for (None: HF tensors)

    def set_plan(self, plan: bytes | None) -> str | None:
        self.plan = pickle.loads(plan) if plan is not None else None
        return None if self.plan is None else self.plan.plan_id

    def address(self, host: str, sender: int) -> SenderAddress:
        """Where the group this rank will host can rendezvous; the port stays bound (and
        listening) until `join` hands it to the group's store."""
        from asyncrl.weightsync.collective import reserve_port

        self.drop_reserved()
        self.reserved = reserve_port(host)
        return SenderAddress(sender, host, self.reserved.getsockname()[1])

    def drop_reserved(self) -> None:
        sock, self.reserved = self.reserved, None
        if sock is not None:
            sock.close()

    def join(self, specs: list[dict[str, Any]], sender: int, rank: int) -> str:
        """Leave any earlier group, join (as group rank 0) the spec for this stage."""
        from asyncrl.weightsync.collective import GroupSpec, join_as_sender

        self.leave()
        mine = [s for s in specs if s["sender"] == sender]
        if len(mine) != 1:
            raise ValueError(f"rank {rank} (pp stage {sender}): expected one group spec, got {len(mine)}")
        spec = GroupSpec(**mine[0])
        sock, self.reserved = self.reserved, None
        self.group = join_as_sender(spec, sock)
        self._pin_host_copies(sender)
        return spec.group_id

    def _pin_host_copies(self, sender: int) -> None:
        """A sender on a GPU keeps a pinned host copy of every bucket it sends (transport.py); with a push
        plan its buckets' sizes are known, so the pool is allocated now, as the group forms, rather than
        inside the first push (a fresh pinned allocation costs about as much as the copy)."""
        from asyncrl.weightsync.transport import PinnedPool

        group = self.group
        if self.plan is None or group is None or group.device.type != "cuda":
            return
        pool = group._pinned = group._pinned or PinnedPool()
        for i, bucket in enumerate(self.plan.for_sender(sender)):
            pool.get(i, int(bucket.nbytes))

    def group_id(self) -> str | None:
        group = self.group
        return group.spec.group_id if group is not None and not group.broken else None

    def leave(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()

    def send_version(self, tensors: Iterable[tuple[str, Any]], bucket_mb: float, verify: str, timeout_s: float,
                  sender: int, gate: str = "") -> CollectiveExport:
        """One collective push of `tensors` (engine layout when a plan is set); starts the host
        copies `take_host_copies` collects. The stream is always read to its end. `gate`: the push's
        gate token (gloo / NCCL)."""
        import ray

        from asyncrl.weightsync.collective import CollectiveError

        tensors = iter(tensors)
        group = self.group
        if group is None or group.broken:
            for _ in tensors:  # keep the TP peers' gathers going before failing
                pass
            raise CollectiveError("no usable weight broadcast group (join_collective first)")
        try:
            sent = send_stream(group, tensors, bucket_mb, verify=verify, timeout_s=timeout_s, keep=ray.put,
                               plan=self.plan, sender=sender, gate=gate)
        except BaseException:
            for _ in tensors:  # a failed broadcast: still finish the export the TP peers are gathering
                pass
            raise
        self.host_copies = sent.host_copies
        return CollectiveExport(digests=sent.digests, bytes=sent.bytes, num_tensors=sent.num_tensors,
                                num_buckets=sent.num_buckets, seconds=sent.seconds)

    def take_host_copies(self, timeout_s: float, sender: int = 0) -> HostCopies:
        """The host copies (ObjectRefs, in bucket order) of the last broadcast, once all are in
        the object store. Each push's copies are taken once."""
        copies, self.host_copies = self.host_copies, None
        if copies is None:
            raise RuntimeError("no broadcast whose host copies are untaken")
        refs = copies.result(time.monotonic() + timeout_s)
        return HostCopies(sender, refs, dict(copies.seconds))
