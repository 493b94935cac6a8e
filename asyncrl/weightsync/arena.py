"""Where a gloo / NCCL sender packs a whole planned version (stream.py's `_send_whole_planned`): one
arena for all of it (`whole_arena`), or, where its device cannot hold that beside the learner's
state, a ring of a few reused slots (`SenderRing`). The receivers see no difference.

Owns: the arena's layout (each planned bucket a 64-byte-aligned window) and the ring's slots (which
bucket holds one, when it is free again).

Must never: hand out a slot whose bucket is still on the wire or being copied to the host.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from asyncrl.weightsync.bucket import windows


def whole_arena(planned: list[Any], device: torch.device) -> Callable[[Any], torch.Tensor]:
    """One allocation for a sender's whole planned version, each bucket a 64-byte-aligned window of
    it by its plan index: the buckets are then hashed in one pass (one kernel launch on a device,
    `hash_whole_lazy`) instead of one launch per bucket. Whole-version pushes keep every bucket until
    the broadcasts end anyway, so this holds no more memory than separate buffers. Raises
    torch.OutOfMemoryError where the device cannot hold it (`SenderRing` then)."""
    starts, total = windows(b.nbytes for b in planned)
    offsets = {b.index: at for b, at in zip(planned, starts)}
    arena = torch.empty(total, dtype=torch.uint8, device=device)
    return lambda b: arena.narrow(0, offsets[b.index], b.nbytes)


RING_SLOTS = 4  # a ring's least slots: buckets on the wire or being copied to the host while the next is packed


class SenderRing:
    """A whole planned version sent through a few reused slots, for a sender whose device cannot
    hold the whole version beside its own state (a 7B learner rank at TP = 2 on an 80 GB GPU: 64 GiB of
    weights, gradients and Adam state, and 7.1 GiB of packed version). The receivers are unchanged:
    they get the same table and the same buckets, in the same order, into their whole staging.

    `buffer(planned bucket)` (the packer's `planned_buffer`) hands out a free slot; when none is free it
    waits, on the host and by the deadline, for the oldest sent bucket's broadcast and host copy, then
    reuses its slot. Its checksums need no wait: they run on the stream that packs the next bucket,
    before it. `sent(plan index, broadcasts, host copy)` hands a packed bucket's slot to the wire.
    Slots: `max(slots, the packer's most open buckets + 2)`, so a bucket still being packed never
    waits for one behind it; an export that opens more at once (another order than the plan's manifest)
    gets one more slot rather than a wait that could not end. Costs against the whole arena: a hash
    launch per bucket, not one pass."""

    def __init__(self, planned: list[Any], device: torch.device, deadline: float, *, slots: int = RING_SLOTS,
                 open_at_once: int = 1) -> None:
        size = max((b.nbytes for b in planned), default=0)
        count = max(2, slots, open_at_once + 2)
        starts, total = windows([size] * count)
        arena = torch.empty(total, dtype=torch.uint8, device=device)
        self._slots = [arena.narrow(0, at, size) for at in starts]
        self._size, self._device, self.deadline = size, device, deadline
        self.nbytes = total  # device memory the ring holds (more where it grew)
        self.grown = 0  # slots added because the export opened more buckets at once than the plan's order does
        self._free = list(range(count - 1, -1, -1))
        self._open: dict[int, int] = {}  # plan index -> slot, being packed
        self._flight: deque[tuple[int, Any, Any]] = deque()  # (slot, Broadcasts, host copy), sent
        self.waited = 0.0  # seconds the packer waited for a slot (the wire or the host copies behind)

    def buffer(self, b: Any) -> torch.Tensor:
        if not self._free and not self._flight:  # every slot holds a bucket still being packed: one more slot
            self._slots.append(torch.empty(self._size, dtype=torch.uint8, device=self._device))
            self._free.append(len(self._slots) - 1)
            self.grown += 1
            self.nbytes += self._size
        if not self._free:
            t = time.perf_counter()
            slot, sending, copy = self._flight.popleft()
            if sending is not None:
                sending.wait()
            if copy is not None:
                copy.wait(self.deadline)
            self.waited += time.perf_counter() - t
            self._free.append(slot)
        slot = self._free.pop()
        self._open[b.index] = slot
        return self._slots[slot].narrow(0, 0, b.nbytes)

    def sent(self, index: int, sending: Any, copy: Any) -> None:
        self._flight.append((self._open.pop(index), sending, copy))
