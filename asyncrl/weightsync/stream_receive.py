"""The receiving half of a push on a gloo / NCCL group (collective.py's `CollectiveGroup`): the receiver's
loop, beside the sender's in stream.py, whose wire protocol it reads.

Owns: `broadcast_receive_stream` (allocate on this member's device, receive, hand each bucket on with
the sender's digests where they come in band), and what a receiver keeps from one push to the next
of the same table: the decoded table (`WholeTable`) and, on a GPU, the buffers and `Bucket` objects
it received into (`KEEP_RECEIVE_BUFFERS`, `Bucket.reused`), until `CollectiveGroup.release_kept`.

Must never: wait without a deadline, or hand on a bucket before its bytes are here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from asyncrl.weightsync.bucket import Bucket, TensorMeta
from asyncrl.weightsync.collective import ABORT, BUCKET, END, WHOLE, CollectiveError, CollectiveGroup, SenderAborted
from asyncrl.weightsync.stream import decode_table


def broadcast_receive_stream(group: CollectiveGroup, deadline: float) -> Iterator[tuple[Bucket, dict[str, bytes]]]:
    """The receiver's loop for one push on one group: yields each bucket (its buffer on this
    member's device) with the sender's digests of it ({} for a whole version's: its table carries
    none), until the sender's end header. Raises SenderAborted on an abort header."""
    while True:
        header = torch.empty(3, dtype=torch.int64, device=group.device)
        group.broadcast(header, deadline)
        kind, table_len, nbytes = (int(v) for v in header.tolist())
        if kind == END:
            return
        if kind == ABORT:
            raise SenderAborted(f"group {group.spec.group_id}: the sender aborted this push")
        if kind == WHOLE and table_len > 0 and nbytes >= 0:
            yield from _receive_whole(group, table_len, nbytes, deadline)
            return
        if kind != BUCKET or table_len <= 0 or nbytes < 0:
            group.broken = True
            group.close()
            raise CollectiveError(f"group {group.spec.group_id}: malformed header {[kind, table_len, nbytes]}")
        raw = torch.empty(table_len, dtype=torch.uint8, device=group.device)
        group.broadcast(raw, deadline)
        metas, rank, digests = decode_table(raw.cpu().numpy().tobytes())
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
        if nbytes:
            group.broadcast(buffer, deadline)
        yield Bucket(buffer=buffer, metas=metas, rank=rank), digests


@dataclass
class WholeTable:
    """A whole version's table as a receiver reads it: each bucket's (tensors, engine rank, size).
    Kept by the group from one push to the next: a plan's table is the same every push, so the next
    one skips the decoding (its raw bytes are compared instead)."""

    raw: bytes
    nbytes: int
    buckets: list[tuple[list[TensorMeta], int | None, int]]

    @classmethod
    def decode(cls, raw: bytes, group_id: str, nbytes: int) -> "WholeTable":
        table = json.loads(raw.decode())
        buckets = []
        for text, n in table["b"]:
            metas, rank, _ = decode_table(text.encode())
            buckets.append((metas, rank, int(n)))
        sizes = [n for *_, n in buckets]
        if sum(sizes) != nbytes or any(n < 0 for n in sizes):
            raise CollectiveError(f"group {group_id}: a whole-version table of {sizes} bytes for a header of {nbytes}")
        return cls(raw, nbytes, buckets)


# Devices on which a receiver keeps a whole version's buffers from push to push (`_receive_whole`): a GPU's caching
# allocator holds that memory between pushes anyway, where host memory would go back to the system.
KEEP_RECEIVE_BUFFERS = {"cuda"}


def _read_table(group: CollectiveGroup, table_len: int, nbytes: int, deadline: float) -> WholeTable:
    raw_t = torch.empty(table_len, dtype=torch.uint8, device=group.device)
    group.broadcast(raw_t, deadline)
    raw = raw_t.cpu().numpy().tobytes()
    kept = group._whole_table
    if kept is not None and kept.raw == raw and kept.nbytes == nbytes:
        return kept
    try:
        table = WholeTable.decode(raw, group.spec.group_id, nbytes)
    except Exception as err:
        group.broken = True
        group.close()
        if isinstance(err, CollectiveError):
            raise
        raise CollectiveError(f"group {group.spec.group_id}: malformed whole-version table: {type(err).__name__}: {err}") from err
    group._whole_table = table
    return table


def _receive_whole(group: CollectiveGroup, table_len: int, nbytes: int,
                   deadline: float) -> Iterator[tuple[Bucket, dict[str, bytes]]]:
    """A whole version: one table, then every bucket back to back into one allocation of
    `nbytes`, then the end header, all received as one enqueue. Each bucket is handed on as soon as it is complete here (`Broadcasts.ready`: by
    the deadline), while the later ones are still arriving, so the consumer's checksums of it run
    beside the wire. The generator ends with the push, or raises SenderAborted at an abort header behind the buckets. The next push of the same table
    reuses the buckets, and the memory they were received into, on a GPU (`Bucket.reused`,
    `KEEP_RECEIVE_BUFFERS`; the group keeps them, as the caching allocator would keep that memory
    anyway, until `release_kept` or its close): a
    consumer keeps its work per bucket (views, copy lists) instead of redoing it: host time a bucket that can
    otherwise put the receiver behind the wire."""
    table = _read_table(group, table_len, nbytes, deadline)
    kept = group._kept
    if kept is None or kept[0] is not table:  # (the same table: the same buckets, into the same memory)
        keep = group.device.type in KEEP_RECEIVE_BUFFERS
        block = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
        buckets, at = [], 0
        for metas, rank, n in table.buckets:
            buckets.append(Bucket(buffer=block.narrow(0, at, n), metas=metas, rank=rank, reused=keep))
            at += n
        end = torch.empty(3, dtype=torch.int64, device=group.device)
        kept = (table, buckets, end)
        group._kept = kept if keep else None
    _, buckets, end = kept
    end.fill_(0)  # (no end header read from a push that did not send one)
    receiving = group.enqueue_broadcasts([b.buffer for b in buckets if b.nbytes] + [end], deadline,
                                         events=group.device.type == "cuda")
    k = 0
    try:
        for bucket in buckets:
            if bucket.nbytes:
                receiving.ready(k)
                k += 1
            yield bucket, {}
    except GeneratorExit:  # the consumer failed mid-version: the rest of the push is unread
        group.broken = True
        group.close()
        raise
    receiving.wait()
    kind = int(end[0].item())
    if kind == ABORT:
        raise SenderAborted(f"group {group.spec.group_id}: the sender aborted this push")
    if kind != END:
        group.broken = True
        group.close()
        raise CollectiveError(f"group {group.spec.group_id}: malformed end header {end.tolist()} after a whole version")
