"""The broadcast groups of a collective push (gloo / NCCL; ipc needs none), from outside the engines: the sending
learner rank's end and the publisher's.

Owns: `SenderEndpoint`, one sending learner rank's push state (its group and the rendezvous port it holds until the
group forms, or its ipc ring; its push plan, the host copies of its last push) and the sending of one version;
`CollectiveLink`, the groups between a learner group's sending ranks and every engine worker of the running
replicas as the publisher keeps them (formed again whenever the replicas or the senders change), each push's gate
token, its senders' call and the replicas' health check beside it.
Must never: import the learner (a rank hands its tensor stream in), decide when a version is live (push.py), or
reach a replica except through the calls it was given. Details: docs/design/weightsync.md, "The sender endpoint".
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import pickle
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.types import HostCopies, SenderAddress, WeightExport
from asyncrl.weightsync import collective, transport
from asyncrl.weightsync.ipc import IpcRing, ipc_send
from asyncrl.weightsync.stream import broadcast_send_stream

log = logging.getLogger("asyncrl.weightsync.service")  # (one logger name for the whole service's lines)
WATCH_S = 2.0  # a gloo / NCCL push still sending after this long has the replicas' health asked, and again after each


class SenderEndpoint:
    """One sending learner rank's end of the weight broadcast groups."""

    def __init__(self) -> None:
        self.group: Any = None  # this rank's broadcast group (collective.py)
        self.reserved: Any = None  # the listening socket of the next group's store
        self.host_copies: Any = None  # its last broadcast's host copies, until taken
        self.plan: Any = None  # the push plan buckets are packed for (None: HF tensors)
        self.ring: Any = None  # ipc: the device buffers each version is packed into (ipc.py)
        # the next push's `HostCopies.after` closes these: the last ipc push's, the left group's, or before the first
        # push an empty one holding the buffers `pin_host_copies` made
        self._copies: Any = None
        self._pinned = False

    def set_plan(self, plan: bytes | None) -> str | None:
        """The push plan later pushes pack for (at start, before any push: the push's kernels are loaded here, where
        a member of a group loads them as it joins, and an ipc sender joins none)."""
        self.plan = pickle.loads(plan) if plan is not None else None
        if torch.cuda.is_available():
            collective.warm_push_kernels("cuda")  # (this process's device)
        return None if self.plan is None else self.plan.plan_id

    def pin_host_copies(self, sender: int) -> None:
        """Allocate, once at start, the pinned host buffers of a GPU sender's host copies (sizes known from the push
        plan): pinned by the first push's copies instead, a whole version would hold the next training step back.
        The first push takes them (`HostCopies.after`); later pushes reuse theirs."""
        if self._pinned or self._copies is not None or self.plan is None or not torch.cuda.is_available():
            return
        pool = transport.PinnedPool()
        for i, bucket in enumerate(self.plan.for_sender(sender)):
            pool.get(i, int(bucket.nbytes))
        self._copies, self._pinned = transport.HostCopies(None, pool), True

    def address(self, host: str, sender: int) -> SenderAddress:
        """Where the group this rank will host can rendezvous (the port stays bound, and listening, until
        `join` hands it to the group's store), and the group it holds now if that can still carry a push."""
        self.drop_reserved()
        self.reserved = collective.reserve_port(host)
        held = self.group.spec.group_id if self.group is not None and not self.group.broken else ""
        return SenderAddress(sender, host, self.reserved.getsockname()[1], held)

    def drop_reserved(self) -> None:
        sock, self.reserved = self.reserved, None
        if sock is not None:
            sock.close()

    def join(self, specs: list[dict[str, Any]], sender: int, rank: int) -> str:
        """Leave any earlier group, join (as group rank 0) the spec for this stage."""
        self.leave()
        mine = [s for s in specs if s["sender"] == sender]
        if len(mine) != 1:
            raise ValueError(f"rank {rank} (pp stage {sender}): expected one group spec, got {len(mine)}")
        spec = collective.GroupSpec(**mine[0])
        sock, self.reserved = self.reserved, None
        self.group = collective.join_as_sender(spec, sock)
        self.group._copies, self._copies = self._copies, None
        return spec.group_id

    def leave(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            self._copies = group._copies or self._copies
            group.close()

    def send_version(self, tensors: Iterable[tuple[str, Any]], bucket_mb: float, verify: str, timeout_s: float,
                     sender: int, plan: Any = None, gate: str = "", backend: str = "") -> WeightExport:
        """One collective push of `tensors` (in `plan`'s engine layout, else as HF tensors); registers the host
        copies `take_host_copies` collects. The stream is always read to its end. `gate`: the push's gate token
        (gloo / NCCL). ipc (`backend`): no group; the answer carries the handles every replica's load opens."""
        import ray

        tensors = iter(tensors)
        handles: list[Any] = []
        try:
            if backend == "ipc":
                # (first: the last push's copies read the ring; before the first push, the buffers pinned at start)
                copies = self._copies = transport.HostCopies.after(self._copies, ray.put)
                if self.ring is None:
                    self.ring = IpcRing(collective.member_device(None))
                handles, sent = ipc_send(self.ring, copies, tensors, bucket_mb, verify=verify, plan=plan, sender=sender)
            elif self.group is None or self.group.broken:
                raise collective.CollectiveError("no usable weight broadcast group (join_collective first)")
            else:
                sent = broadcast_send_stream(self.group, tensors, bucket_mb, verify=verify, timeout_s=timeout_s,
                                             keep=ray.put, plan=plan, sender=sender, gate=gate)
        except BaseException:
            for _ in tensors:  # a failed push: still finish the export the TP peers are gathering
                pass
            raise
        self.host_copies = sent.host_copies  # (once sent: a collect of the attempt before this one takes that one's)
        return WeightExport(buckets=handles, metas=[h.metas for h in handles],
                            senders=[sender] * len(handles) if backend == "ipc" else [sender], digests=[sent.digests],
                            bytes=sent.bytes, num_tensors=sent.num_tensors, num_buckets=sent.num_buckets,
                            seconds=sent.seconds)

    def take_host_copies(self, timeout_s: float, sender: int = 0) -> HostCopies:
        """The host copies (ObjectRefs, in bucket order) of the last broadcast, once all are in
        the object store. Each push's copies are taken once."""
        copies, self.host_copies = self.host_copies, None
        if copies is None:
            raise RuntimeError("no broadcast whose host copies are untaken")
        refs = copies.result(time.monotonic() + timeout_s)
        return HostCopies(sender, refs, dict(copies.seconds))


class CollectiveLink:
    """A `StreamedSource`'s `Link` (sources.py) over the groups of the replicas `members()` ({replica_id:
    GroupsReport}) names and `join(specs)` joins, one a sending rank in PP stage order. `ensure()`, before each push,
    forms them unless they hold exactly the running replicas and no member's group broke; a replica that comes later
    fails that push at the gate, one that fails its `health` check or whose load returned without reaching the gate
    `stop`s the senders, and the push made again (service.py) forms them again. ipc (`sequential`): no group."""

    def __init__(self, backend: str, learner: Any, *, members: Callable[[], Awaitable[dict[str, Any]]],
                 join: Callable[[list[dict[str, Any]]], Awaitable[Any]], bucket_mb: float, timeout_s: float,
                 health: Callable[[], Awaitable[Any]] | None = None) -> None:
        self.backend, self.learner = backend, learner
        self.sequential = backend == "ipc"  # the loads follow the senders' export (its handles are their payload)
        self._handles: list[Any] = []  # ipc: the last send's
        self._members_call, self._join_call = members, join
        self.bucket_mb, self.timeout_s = bucket_mb, timeout_s
        self.specs: list[Any] = []
        self.members: dict[str, int] = {}  # replica id -> engine workers, as the groups were formed
        self.formed = 0  # how many times groups were formed
        self._gate = ""  # gloo / NCCL: the gate token of the push in flight (payload -> send, cancel)
        self._health = health  # raises unless every running replica is healthy
        self.receivers_failed = False  # stopped for the receivers (`stop`): a failed send is then the engines' failure

    def forget(self) -> None:
        """The groups are gone (a new learner group): the next `ensure` forms them."""
        self.specs, self.members = [], {}

    async def cancel(self, why: str) -> None:
        """Close the gate of the push in flight, where members still wait for one that is gone (every receiver's
        call has returned). A broadcast already on the wire ends at its deadline. Best effort; never raises."""
        gate = self._gate
        if not gate:
            return

        def put() -> None:
            for spec in self.specs:
                try:  # (a client of the group's store, made here: a cancel is a failed push's, rare)
                    store = dist.TCPStore(spec.host, spec.port, is_master=False, timeout=datetime.timedelta(seconds=10),
                                          wait_for_workers=False)
                    collective.decide_gate(store, spec.group_id, gate, f"closed: the publisher: {why}")
                except Exception as err:  # the sender's process (the store) is gone: it is not waiting either
                    log.warning("weightsync: could not stop the push on group %s: %s", spec.group_id, err)

        await asyncio.to_thread(put)

    async def stop(self, why: str) -> None:
        """`cancel` for the receivers' sake (a member that will not answer, or running replicas that are not the
        groups' members): the push failed on the engines' side, however the senders report it."""
        self.receivers_failed = True
        await self.cancel(why)

    @property
    def group_ids(self) -> list[str]:
        return [s.group_id for s in self.specs]

    async def ensure(self) -> None:
        if self.sequential:  # (ipc: no group)
            return
        info, addresses = await asyncio.gather(self._members_call(), self.learner.collective_addresses())
        # {replica id: engine workers}: kept while exactly the groups' members run, each holding every group
        members = {rid: i.workers for rid, i in info.items()}
        held = {a.group for a in addresses if a.group}
        if self.specs and members == self.members and held == set(self.group_ids) \
                and all(held <= set(i.groups) for i in info.values()):
            return
        specs = collective.form_specs(self.backend, [(a.host, a.port) for a in addresses], members,
                                      timeout_s=self.timeout_s, group_prefix=f"asyncrl-ws{os.getpid()}-{self.formed + 1}")
        wire = [asdict(s) for s in specs]
        self.specs, self.members = [], {}
        # Every member rendezvouses at once: the replicas' workers and the sending ranks.
        await asyncio.gather(self._join_call(wire), self.learner.join_collective(wire))
        self.specs, self.members = specs, members
        self.formed += 1
        log.info("weightsync: %s broadcast group(s) %s formed with %d replica(s), %s ranks", self.backend,
                 self.group_ids, len(members), "/".join(str(s.world_size) for s in specs))

    def payload(self, version: int) -> Any:
        """The replicas' side of one push attempt: on gloo / NCCL it names a new gate, which `send` uses; on ipc,
        the handles the last `send` answered."""
        if self.sequential:
            return list(self._handles)
        self.receivers_failed = False
        self._gate = f"v{version}-{uuid.uuid4().hex[:12]}"
        return collective.CollectiveReceive(tuple(self.group_ids), version, self.timeout_s, gate=self._gate)

    async def send(self, version: int, verify: str) -> WeightExport:  # noqa: ARG002 - the label travels with the payload
        """The senders' side of the attempt `payload` described. A sender that failed closes the push's gate
        (gloo / NCCL: receivers still at it leave)."""
        gate = self._gate
        watching = asyncio.ensure_future(self._watch(gate)) if gate and self._health is not None else None
        try:
            sent = await self.learner.export_weights(self.bucket_mb, self.backend, verify, "engine", self.timeout_s, gate)
            self._handles = list(sent.buckets)  # (ipc's: the payload; gloo / NCCL answer none)
        except BaseException as err:
            if gate:
                await self.cancel(f"a sender failed: {type(err).__name__}: {str(err)[:300]}")
            raise
        finally:
            if watching is not None:
                watching.cancel()
        return sent

    async def _watch(self, gate: str) -> None:
        """Beside a push's senders: a replica whose engine died after `ensure` never comes to the gate, where the
        other members (engine workers, their steps held) would wait to the deadline; a failed check stops it."""
        while True:
            await asyncio.sleep(WATCH_S)
            try:
                await asyncio.wait_for(self._health(), 4 * WATCH_S)  # type: ignore[misc]
            except (asyncio.TimeoutError, TimeoutError):  # no answer yet is no failure (the deadline bounds a hung one)
                continue
            except Exception as err:  # unhealthy
                if gate == self._gate:
                    await self.stop(f"a replica failed its health check ({type(err).__name__}: {str(err)[:300]})")
                return

    async def collect(self) -> HostCopies:
        """The last send's host copies (every sender's, in sender order), once made."""
        refs, seconds = await self.learner.take_host_copies(self.timeout_s)
        return HostCopies(-1, refs, seconds)
