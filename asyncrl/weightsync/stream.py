"""One push on a gloo / NCCL group (collective.py's `CollectiveGroup`): the wire protocol and both ends' loops.

Owns: the wire protocol (a 3 x int64 header and every bucket's tensor table as JSON, the buckets back to back, then
an end or abort header: one enqueue for a receiver); `broadcast_send_stream` (pack, broadcast, hash beside the wire,
host copies off the critical path; one wait), through a `SenderRing` where the device cannot hold the whole packed
version; `broadcast_receive_stream` (receive on this member's device, hand each bucket on once complete); the
helpers ipc.py shares.
Must never: wait without a deadline, hand on a bucket before its bytes are here, or leave the receivers waiting on
a sender that failed (an export error sends the abort header first). Details: docs/design/weightsync.md,
"Collective push loops".
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncrl.weightsync.bucket import Bucket, SenderRing, TensorMeta, digest_key_prefix, metas_from_wire, whole_arena
from asyncrl.weightsync.collective import ABORT, END, WHOLE, CollectiveError, CollectiveGroup, SenderAborted
from asyncrl.weightsync.fingerprint import buckets_digests_lazy
from asyncrl.weightsync.plan import PlannedPacker, pack_stream
from asyncrl.weightsync.transport import HostCopies


def _header(group: CollectiveGroup, kind: int, a: int = 0, b: int = 0) -> torch.Tensor:
    return torch.tensor([kind, a, b], dtype=torch.int64, device=group.device)


@dataclass
class SendResult:
    """What a sender hands back to the publisher: per-tensor digests in the push's verify mode, sizes and timings.
    Its host copies (rollbacks, late joiners) are made when collected (`host_copies.result()`)."""

    host_copies: HostCopies | None = None
    digests: dict[str, bytes] = field(default_factory=dict)
    bytes: int = 0
    num_tensors: int = 0
    num_buckets: int = 0
    # hash: enqueueing the checksums and waiting for them; hash_wait: the waiting part alone (the device's reads)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("pack", "broadcast", "host_copy", "hash", "hash_wait"), 0.0))


def broadcast_send_stream(group: CollectiveGroup, named_tensors: Iterable[tuple[str, Any]], bucket_mb: float, *,
                          verify: str, timeout_s: float, keep: Callable[[Bucket], Any] | None = None,
                          plan: Any = None, sender: int = 0, arena: str = "auto", gate: str = "") -> SendResult:
    """The sender's loop for one push: bucket the stream on the tensors' device (the engines' layout with a `plan`),
    send every bucket, hash them beside the wire, register their host copies (`keep` gets each, made when
    collected). A failed stream tells the receivers (abort header) before the error propagates.
    `arena` (a planned version): "whole" packs it into one allocation, "ring" through a `SenderRing` of reused
    slots, "auto" the whole one unless the device cannot hold it (then the ring, for this group's later pushes too).
    `gate`: the push's gate token (collective.py): nothing goes on the wire until every member is ready; a closed
    gate raises `GateClosed` (the stream still read to its end, the group still usable).
    The table goes first, then each bucket as soon as it is packed (packing bucket k + 1 overlaps bucket k on the
    wire), then the end header and one wait for the wire, the checksums running beside it."""
    deadline = time.monotonic() + timeout_s
    out = SendResult()
    # (first: the last push's copies let go of its buckets, or the stream waits for those still being made)
    copies = out.host_copies = group._copies = HostCopies.after(group._copies, keep)
    planned = plan.for_sender(sender) if plan is not None else None
    buffers, ring = None, None
    if planned is not None:
        if arena == "whole" or (arena == "auto" and not group._ring_sender):
            try:
                buffers = whole_arena(planned, group.device)
            except torch.OutOfMemoryError:
                if arena == "whole":
                    raise
                group._ring_sender = True  # this rank's device is short of a whole version: a ring from now on
                logging.getLogger(__name__).warning(
                    "weightsync: group %s rank %d: no device memory for the whole packed version (%.2f GB); "
                    "sending through a ring of reused bucket slots from now on", group.spec.group_id, group.rank,
                    sum(b.nbytes for b in planned) / 1e9)
        if buffers is None:
            ring = SenderRing(planned, group.device, deadline, open_at_once=PlannedPacker(plan, sender, "cpu").max_open())
            buffers = ring.buffer
    # Host copies of a whole version are made when collected, once it is live: beside the broadcasts they would hold
    # the digests' small reads back. A ring copies each bucket as it is sent: its slot is reused once that is done.
    export = Export(pack_stream(named_tensors, bucket_mb, group.device, plan=plan, sender=sender,
                                planned_buffer=buffers), out)
    unsent: list[int] | None = None  # the sizes of the buckets the table announced and the wire has not carried yet
    try:
        # a plan's table is known before anything is packed: made while the gate is shut
        rows = [(b.metas(), b.rank, b.nbytes) for b in planned] if planned is not None else []
        announce = whole_table(group, rows) if planned is not None else []
        if gate:
            group.arrive(gate)
            group.await_gate(gate, deadline)
        buckets: Iterable[Bucket] = export
        if planned is None:  # without a plan every bucket is packed first, and the table is theirs
            buckets = list(export)
            rows = [(b.metas, b.rank, b.nbytes) for b in buckets]
            announce = whole_table(group, rows)
        t = time.perf_counter()
        sending = [group.enqueue_broadcasts(announce, deadline)]  # (not waited for: the first buckets right behind)
        out.seconds["broadcast"] += time.perf_counter() - t
        unsent = [n for *_, n in rows]
        packed: list[tuple[Bucket, Any]] = []
        for k, bucket in enumerate(buckets):  # (bucket k is the table's row k: the packer emits the plan in order)
            finish = copy = None
            if ring is not None:
                # a ring's slot on the host is no copy: it is overwritten by a later bucket (CPU senders, tests)
                kept = bucket if bucket.buffer.is_cuda else Bucket(
                    buffer=bucket.buffer.clone(), metas=bucket.metas, rank=bucket.rank)
                t = time.perf_counter()
                copy = copies.add(kept, now=True)  # done once the slot may be reused
                out.seconds["host_copy"] += time.perf_counter() - t
                finish = hash_whole_lazy([kept], verify, out)
            t = time.perf_counter()
            bc = group.enqueue_broadcasts([bucket.buffer], deadline) if bucket.nbytes else None
            if bc is not None:
                sending.append(bc)
            out.seconds["broadcast"] += time.perf_counter() - t
            if ring is not None:
                ring.sent(planned[k].index, bc, copy)  # type: ignore[index]
            packed.append((bucket, finish))
            unsent.pop(0)
        unsent = None  # (every announced bucket is on the wire: a failure from here on is the wire's or the host's)
        t = time.perf_counter()
        sending.append(group.enqueue_broadcasts([_header(group, END)], deadline))
        out.seconds["broadcast"] += time.perf_counter() - t
        if ring is not None:  # every bucket was hashed and its copy started as it was packed
            finishes = [finish for _, finish in packed]
        else:  # buckets in one arena (whole_arena) are hashed in one pass, others each in their own
            finishes = [hash_whole_lazy([b for b, _ in packed], verify, out)] if packed else []
            t = time.perf_counter()
            for bucket, _ in packed:  # (made once collected; registered while the wire runs)
                copies.add(bucket)
            out.seconds["host_copy"] += time.perf_counter() - t
        group.drop_stale_gate_keys()  # (while the wire runs)
        t = time.perf_counter()
        for s in sending:
            s.wait()
        out.seconds["broadcast"] += time.perf_counter() - t
        for finish in finishes:  # the first waits for the device's checksums, the rest are there by then
            finish()
    except BaseException as err:
        copies.close()
        if unsent is not None and not isinstance(err, CollectiveError):  # not the wire: the receivers are told
            export.failed = True
        if export.failed and not group.broken:  # tell the receivers, so they fail now rather than at their deadline
            # zeros for the announced buckets not sent (they wait for them all), then the abort header behind them
            # (a wire failing too breaks the group: they time out)
            sizes = [n for n in unsent or () if n]
            with contextlib.suppress(CollectiveError):
                zeros = torch.zeros(max(sizes, default=0), dtype=torch.uint8, device=group.device)
                group.broadcast_all([zeros[:n] for n in sizes] + [_header(group, ABORT)], deadline)
        elif isinstance(err, CollectiveError):
            # the wire failed, not the export: finish it unsent, so the ranks exporting beside this one (TP / PP
            # gathers) are not left waiting for it and the learner group stays usable (LearnerGroup.export_weights)
            with contextlib.suppress(Exception):  # the send already failed; that error is the one reported
                for _ in export:
                    pass
        raise
    finally:
        if ring is not None:
            out.seconds["ring_wait"] = ring.waited
    return out


def whole_table(group: CollectiveGroup, buckets: list[tuple[list[TensorMeta], int | None, int]]) -> list[torch.Tensor]:
    """The whole version's header and table on the group's device: every bucket's (tensors, engine rank, size),
    without digests (the receivers' are compared with the sender's at the commit)."""
    raw = json.dumps({"b": buckets}).encode()
    return [_header(group, WHOLE, len(raw), sum(n for *_, n in buckets)),
            torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(group.device)]


def hash_whole_lazy(buckets: list[Bucket], verify: str, out: SendResult) -> Callable[[], None]:
    """Every bucket of a whole-version push hashed in `verify` mode, in one pass where they share one buffer; the
    returned call (made once) waits for the device and records the digests and its wait in `out`. Host copies are
    the caller's."""
    t = time.perf_counter()
    pending = buckets_digests_lazy([(b, digest_key_prefix(b)) for b in buckets], verify)  # type: ignore[arg-type]
    out.seconds["hash"] += time.perf_counter() - t
    out.num_buckets += len(buckets)
    out.bytes += sum(b.payload_bytes for b in buckets)
    out.num_tensors += sum(len(b) for b in buckets)

    def finish() -> None:
        t = time.perf_counter()
        out.digests.update(pending())
        waited = time.perf_counter() - t
        out.seconds["hash"] += waited
        out.seconds["hash_wait"] += waited

    return finish


class Export:
    """The sender's bucket stream (timed as `pack`); `failed` tells an export error (the tensor stream raised) from
    a send error, which only the sender sees."""

    def __init__(self, buckets: Iterable[Bucket], out: SendResult) -> None:
        self._buckets = iter(buckets)
        self._out, self.failed = out, False

    def __iter__(self) -> Iterator[Bucket]:
        while True:
            t = time.perf_counter()
            try:
                bucket = next(self._buckets)
            except StopIteration:
                return
            except BaseException:
                self.failed = True
                raise
            self._out.seconds["pack"] += time.perf_counter() - t
            yield bucket


def broadcast_receive_stream(group: CollectiveGroup, deadline: float) -> Iterator[Bucket]:
    """The receiver's loop for one push on one group: after the header and table, every bucket (back to back, into
    one allocation) and the end header are received as one enqueue; each bucket (on this member's device) is yielded
    once complete here (`Broadcasts.ready`) while later ones still arrive, so its consumer's checksums run beside
    the wire. SenderAborted at an abort header."""
    header = torch.empty(3, dtype=torch.int64, device=group.device)
    group.broadcast_all([header], deadline)
    kind, table_len, nbytes = (int(v) for v in header.tolist())
    if kind == ABORT:
        raise SenderAborted(f"group {group.spec.group_id}: the sender aborted this push")
    if kind != WHOLE or table_len <= 0 or nbytes < 0:
        group.close()
        raise CollectiveError(f"group {group.spec.group_id}: malformed header {[kind, table_len, nbytes]}")
    raw = torch.empty(table_len, dtype=torch.uint8, device=group.device)
    group.broadcast_all([raw], deadline)
    try:  # each bucket's (tensors, engine rank, size)
        rows = [(metas_from_wire(metas), rank, int(n)) for metas, rank, n in json.loads(raw.cpu().numpy().tobytes())["b"]]
        sizes = [n for *_, n in rows]
        if sum(sizes) != nbytes or any(n < 0 for n in sizes):
            raise ValueError(f"a whole-version table of {sizes} bytes for a header of {nbytes}")
    except Exception as err:
        group.close()
        raise CollectiveError(f"group {group.spec.group_id}: malformed whole-version table: {type(err).__name__}: {err}") from err
    block = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
    buckets = [Bucket(buffer=view, metas=metas, rank=rank) for view, (metas, rank, _) in zip(block.split(sizes), rows)]
    end = torch.zeros(3, dtype=torch.int64, device=group.device)  # (no end header read from a push that sent none)
    receiving = group.enqueue_broadcasts([b.buffer for b in buckets if b.nbytes] + [end], deadline,
                                         events=group.device.type == "cuda")
    k = 0
    try:
        for bucket in buckets:
            if bucket.nbytes:
                receiving.ready(k)
                k += 1
            yield bucket
    except GeneratorExit:  # the consumer failed mid-version: the rest of the push is unread
        group.close()
        raise
    receiving.wait()
    kind = int(end[0].item())
    if kind == ABORT:
        raise SenderAborted(f"group {group.spec.group_id}: the sender aborted this push")
    if kind != END:
        group.close()
        raise CollectiveError(f"group {group.spec.group_id}: malformed end header {end.tolist()} after a whole version")

