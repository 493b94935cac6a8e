"""The buffer as one Ray actor: BufferCore plus the waiting (admission, back-pressure, batches).

Owns: the asyncio waits around BufferCore and shutdown. `BufferService` is a plain asyncio class
(usable in-process); `BufferActor` is the same class as an async Ray actor with num_cpus=0, so
a call that waits never blocks the actor's other calls.
Must never: busy-poll (every wait is an asyncio.Condition woken by the call that changed the
state), hold a waiter past close(), or contain buffer logic (that lives in core.py).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Sequence

import ray

from asyncrl.buffer.core import BufferCore
from asyncrl.config import BufferConfig
from asyncrl.types import PutResult, Sample, TrainBatch


class BufferClosedError(RuntimeError):
    """The buffer was closed (shutdown); waiting producers and learners are woken with this."""


def _timeout(timeout_s: float | None) -> float | None:
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or math.isnan(timeout_s) or timeout_s < 0:
        raise ValueError(f"timeout_s={timeout_s!r} must be None or a number >= 0")
    return float(timeout_s)


class BufferService:
    """Async front of BufferCore. Every state change notifies the one condition all waiters use."""

    def __init__(self, config: BufferConfig | dict[str, Any]) -> None:
        if isinstance(config, dict):
            config = BufferConfig.model_validate(config)
        self._core = BufferCore(config)
        self._changed = asyncio.Condition()
        self._closed = False
        self._waiters = {"acquire": 0, "put": 0, "get": 0}

    async def _wait(self, kind: str) -> None:
        self._waiters[kind] += 1
        try:
            await self._changed.wait()
        finally:
            self._waiters[kind] -= 1

    async def acquire(self, n: int, timeout_s: float | None = None, key: str | None = None) -> bool:
        """Reserve n samples for one rollout, waiting until admission allows. False on timeout or close.
        `key` names the reservation for put_group / release / abandon (BufferCore: overdue rollouts)."""
        self._core.staleness.can_acquire(n)  # bad n raises here, before any wait
        timeout = _timeout(timeout_s)
        async with self._changed:
            try:
                async with asyncio.timeout(timeout):
                    while not self._closed:
                        if self._core.try_acquire(n, key):
                            return True
                        await self._wait("acquire")
            except TimeoutError:
                return False
        return False

    async def release(self, n: int, key: str | None = None) -> None:
        """A reserved rollout of n samples ended without pushing them."""
        async with self._changed:
            self._core.release(n, key)
            self._changed.notify_all()

    async def abandon(self, n: int, key: str | None = None) -> None:
        """A reserved rollout of n samples was given up on: released and counted (dropped_failed)."""
        async with self._changed:
            self._core.abandon(n, key)
            self._changed.notify_all()

    async def put_group(self, samples: Sequence[Sample], key: str | None = None) -> PutResult:
        """Push a whole group, waiting while the buffer is full (back-pressure)."""
        async with self._changed:
            while True:
                if self._closed:
                    raise BufferClosedError("buffer closed while a group was being pushed")
                if self._core.can_put(samples, key):  # validates: bad input raises, never waits
                    result = self._core.put_group(samples, key)
                    self._changed.notify_all()
                    return result
                await self._wait("put")

    async def get_batch(self, timeout_s: float | None = None) -> TrainBatch | None:
        """One batch for the current version, waiting until it is ready; None on timeout."""
        timeout = _timeout(timeout_s)
        async with self._changed:
            try:
                async with asyncio.timeout(timeout):
                    while True:
                        if self._closed:
                            raise BufferClosedError("buffer closed while the learner waited for a batch")
                        before = self._core.replay.counts.dropped_stale
                        batch = self._core.get_batch()
                        if batch is not None or self._core.replay.counts.dropped_stale != before:
                            self._changed.notify_all()  # room freed and/or slots credited
                        if batch is not None:
                            return batch
                        await self._wait("get")
            except TimeoutError:
                return None

    async def set_version(self, version: int) -> None:
        async with self._changed:
            self._core.set_version(version)
            self._changed.notify_all()

    async def metrics(self) -> dict[str, float]:
        out = self._core.metrics()
        out.update({f"buffer/waiting_{k}": float(v) for k, v in self._waiters.items()})
        out["buffer/closed"] = float(self._closed)
        return out

    async def state_dict(self) -> dict[str, Any]:
        async with self._changed:
            return self._core.state_dict()

    async def load_state_dict(self, state: dict[str, Any], drop_running: bool = True) -> None:
        """Restore a checkpoint. By default in-flight reservations of the saved run are released."""
        async with self._changed:
            self._core.load_state_dict(state, drop_running=drop_running)
            self._changed.notify_all()

    async def close(self) -> None:
        """Wake every waiter: acquire returns False, put_group/get_batch raise BufferClosedError."""
        async with self._changed:
            self._closed = True
            self._changed.notify_all()


BufferActor = ray.remote(num_cpus=0)(BufferService)
