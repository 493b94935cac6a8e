"""The broadcast groups of a collective push (gloo / NCCL / ipc), as the publisher keeps them.

Owns: `CollectiveLink`, the groups between a learner group's sending ranks and every engine worker
of the running replicas: formed before the first push and again whenever the running replicas,
the senders or (under a shard plan) the engine ranks each sender feeds change; each push's gate
token, its senders' call and the replicas' check beside it. service.py builds one per run; the
replicas' and the learner's sides are the calls it is given.

Must never: decide when a version is live (push.py), or reach a replica except through the calls
it was given.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from asyncrl.types import GroupsReport

log = logging.getLogger("asyncrl.weightsync.service")  # (one logger name for the whole service's lines)


class CollectiveLink:
    """The broadcast groups between a learner group's sending ranks (one group each, PP stage
    order) and every engine worker of a set of replicas, for collective transports.

    `members()` returns {replica_id: GroupsReport (its workers, the groups every one holds)} and
    `join(specs)` makes every replica join (both as the generator's replicas answer
    `collective_info` / `join_collective`). `ensure()` forms the groups unless the current ones
    still hold exactly the running replicas and no member's group broke (a timed-out or failed
    broadcast breaks it on that member); `send`, `payload` and `cancel` are `publish_streamed`'s.

    `ensure()` asks nobody right after a push that every member of the groups took and no other
    replica was sent (`pushed`), which saves two round trips per push. A replica that has gone
    since, or one outside the groups, fails that push without waiting for its deadline, and the
    retry forms the groups again: on ipc its receive fails at once, or it is missing and `cancel`
    stops the sender; on gloo / NCCL every member waits at the push's gate (collective.py) before
    the wire, and `send` asks the replicas (`check`) beside the push, closing the gate when the
    running replicas are not the groups' members."""

    def __init__(self, backend: str, learner: Any, *, members: Callable[[], Awaitable[dict[str, Any]]],
                 join: Callable[[list[dict[str, Any]]], Awaitable[Any]], bucket_mb: float, timeout_s: float,
                 ipc_window: int | None = None, check: Callable[[], Awaitable[dict[str, Any]]] | None = None,
                 ranks_of: Callable[[], dict[int, tuple[int, ...]] | None] | None = None) -> None:
        from asyncrl.weightsync.collective import IPC_WINDOW

        self.backend, self.learner = backend, learner
        self._members_call, self._join_call = members, join
        # sender -> the engine ranks whose workers its group holds (`WeightPublisher.sender_ranks`; None: all)
        self._ranks_of = ranks_of
        self.membership: dict[int, tuple[int, ...]] | None = None  # ... as the groups were formed
        self.bucket_mb, self.timeout_s = bucket_mb, timeout_s
        self.ipc_window = IPC_WINDOW if ipc_window is None else ipc_window
        self.specs: list[Any] = []
        self.members: dict[str, int] = {}  # replica id -> engine workers, as the groups were formed
        self.formed = 0  # how many times groups were formed
        # gloo / NCCL: the replicas' collective_info, asked beside each push (None: not checked)
        self._check_call = check
        self._gate = ""  # gloo / NCCL: the gate token of the push in flight (payload -> send, cancel)
        self.checks_skipped = 0  # ensure() calls that asked nobody (right after a clean push)
        self._clean = False  # the last push reached exactly the groups' members, and every one took it
        self._stores: dict[str, Any] = {}  # group id -> a client of its store (cancel)
        # this attempt was stopped for the receivers' sake (`stop`): a failed send is then the engines' failure
        self.receivers_failed = False

    def forget(self) -> None:
        """The groups are gone (a new learner group): the next `ensure` forms them."""
        self.specs, self.members, self._clean, self._stores, self.membership = [], {}, False, {}, None

    def pushed(self, reached: dict[str, Any]) -> None:
        """A push over the current groups succeeded, and reached (and was taken by) the replicas `reached`."""
        self._clean = bool(self.specs) and set(reached) == set(self.members)

    async def cancel(self, why: str) -> None:
        """Stop the push in flight where members still wait for one that is gone (every receiver's
        call has returned): ipc's sender waiting for acknowledgements, or (gloo / NCCL) everyone
        still at the push's gate. A broadcast already on the wire cannot be stopped so: it ends at
        its deadline. Best effort; never raises."""
        from asyncrl.weightsync.collective import close_gate
        from asyncrl.weightsync.ipc import cancel_key

        gate = self._gate
        if self.backend != "ipc" and not gate:
            return

        def put() -> None:
            for spec in self.specs:
                try:
                    store = self._store(spec)
                    if self.backend == "ipc":
                        store.set(cancel_key(spec.group_id), why[:2000])
                    else:
                        close_gate(store, spec.group_id, gate, f"the publisher: {why}")
                except Exception as err:  # the sender's process (the store) is gone: it is not waiting either
                    log.warning("weightsync: could not stop the push on group %s: %s", spec.group_id, err)

        await asyncio.to_thread(put)

    async def stop(self, why: str) -> None:
        """`cancel` for the receivers' sake: a member that will not answer (every replica's load returned), or
        running replicas that are not the groups' members. The push then failed on the engines' side (the
        service recovers it once they are healthy), however the senders report it."""
        self.receivers_failed = True
        await self.cancel(why)

    def _store(self, spec: Any) -> Any:
        """A client of `spec`'s group store, made once per group."""
        import datetime

        import torch.distributed as dist

        store = self._stores.get(spec.group_id)
        if store is None:
            store = self._stores[spec.group_id] = dist.TCPStore(
                spec.host, spec.port, is_master=False, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
        return store

    @property
    def group_ids(self) -> list[str]:
        return [s.group_id for s in self.specs]

    async def ensure(self) -> None:
        from dataclasses import asdict

        from asyncrl.weightsync.collective import form_specs

        clean, self._clean = self._clean, False  # once: a failed push's retry asks
        if clean and self.specs:
            self.checks_skipped += 1
            return
        info, senders = await asyncio.gather(self._members_call(), self.learner.collective_groups())
        members, problem = self._replicas_fit(info)
        membership = self._ranks_of() if self._ranks_of is not None else None
        if self.specs and problem is None and set(senders) == set(self.group_ids) and membership == self.membership:
            return
        addresses = await self.learner.collective_addresses()
        specs = form_specs(self.backend, [(a.host, a.port) for a in addresses], members, timeout_s=self.timeout_s,
                           group_prefix=f"asyncrl-ws{os.getpid()}-{self.formed + 1}", ipc_window=self.ipc_window,
                           ranks_of=membership)
        wire = [asdict(s) for s in specs]
        self.specs, self.members, self._stores = [], {}, {}
        # Every member rendezvouses at once: the replicas' workers and the sending ranks.
        await asyncio.gather(self._join_call(wire), self.learner.join_collective(wire))
        self.specs, self.members, self.membership = specs, members, membership
        self.formed += 1
        log.info("weightsync: %s broadcast group(s) %s formed with %d replica(s), %s ranks%s", self.backend,
                 self.group_ids, len(members), "/".join(str(s.world_size) for s in specs),
                 f" (engine ranks per sender: {membership})" if membership else "")

    def payload(self, version: int) -> Any:
        """The replicas' side of one push attempt; on gloo / NCCL it names a new gate, which `send` uses."""
        from asyncrl.weightsync.collective import CollectiveReceive

        broadcast = self.backend != "ipc"
        self.receivers_failed = False
        self._gate = f"v{version}-{uuid.uuid4().hex[:12]}" if broadcast else ""
        return CollectiveReceive(tuple(self.group_ids), version, self.timeout_s, gate=self._gate)

    async def send(self, version: int, verify: str) -> Any:  # noqa: ARG002 - the label travels with the payload
        """The senders' side of the attempt `payload` described. On gloo / NCCL the replicas are asked
        beside it whether they are still the groups' members; if not, the gate closes (nobody waits
        for a member that is gone, or sends to a group a new replica is not in), and the retry forms
        the groups again. A sender that failed closes the gate too (receivers still at it leave)."""
        from asyncrl.weightsync.push import StreamedSend

        gate = self._gate
        checking = asyncio.ensure_future(self._check_members(gate)) if gate and self._check_call is not None else None
        try:
            sent = await self.learner.broadcast_hf_tensors(self.bucket_mb, verify, self.timeout_s, gate)
        except BaseException as err:
            if gate:
                await self.cancel(f"a sender failed: {type(err).__name__}: {str(err)[:300]}")
            raise
        finally:
            if checking is not None and not checking.done():  # the senders are past the gate: it is moot
                checking.cancel()
        return StreamedSend([], sent.digests, sent.bytes, sent.num_tensors, sent.seconds, collect=self._collect,
                            num_buckets=sent.num_buckets)

    def _replicas_fit(self, info: dict[str, GroupsReport]) -> tuple[dict[str, int], str | None]:
        """The replicas' `collective_info` answers as {replica id: engine workers}, and what keeps them from
        the current groups (None: they are exactly the groups' members, each holding every group)."""
        members = {rid: i.workers for rid, i in info.items()}
        if members != self.members:
            return members, f"the running replicas {sorted(members)} are not the groups' members {sorted(self.members)}"
        if not all(set(self.group_ids) <= set(i.groups) for i in info.values()):
            return members, "a replica no longer holds every group"
        return members, None

    async def _check_members(self, gate: str) -> None:
        """Close push `gate`'s gate unless the running replicas are exactly the groups' members, each
        still holding every group (a gate every member reached is open already: then this changes nothing)."""
        try:
            _, problem = self._replicas_fit(await self._check_call())  # type: ignore[misc]
        except Exception as err:  # a replica that cannot answer is not there to receive either
            problem = f"the replicas did not answer ({type(err).__name__}: {str(err)[:300]})"
        if problem is not None and gate == self._gate:
            log.info("weightsync: push %s stopped at its gate: %s", gate, problem)
            await self.stop(problem)

    async def _collect(self) -> Any:
        from asyncrl.weightsync.push import KeptCopies

        refs, seconds = await self.learner.take_host_copies(self.timeout_s)
        return KeptCopies(refs, seconds)
