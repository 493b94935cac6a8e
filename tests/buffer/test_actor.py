"""The buffer's waits: admission, batches, back-pressure and close(), in-process and as a Ray actor."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncrl.buffer.actor import BufferActor, BufferClosedError, BufferService
from asyncrl.config import BufferConfig
from tests.buffer._helpers import make_group

CFG = dict(batch_size=2, max_staleness=0, capacity=2)


async def until(service: BufferService, key: str, value: float) -> None:
    """Yield to the loop until a waiter is parked (no wall-clock assumptions)."""
    for _ in range(1000):
        if (await service.metrics())[key] == value:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{key} never reached {value}")


async def test_acquirers_block_at_the_bound_and_set_version_releases_them():
    buf = BufferService(CFG)
    assert await buf.acquire(2)
    blocked = asyncio.create_task(buf.acquire(2))
    await until(buf, "buffer/waiting_acquire", 1)
    await buf.put_group(make_group(1, [0.0, 1.0]))  # accepting does not free admission
    assert await buf.acquire(2, timeout_s=0) is False and not blocked.done()
    assert (await buf.get_batch(timeout_s=0)).size == 2
    await buf.set_version(1)
    assert await blocked is True


async def test_get_batch_waits_for_data_and_times_out_with_none():
    buf = BufferService(CFG)
    assert await buf.get_batch(timeout_s=0.01) is None
    waiting = asyncio.create_task(buf.get_batch())
    await until(buf, "buffer/waiting_get", 1)
    assert await buf.acquire(2)
    await buf.put_group(make_group(5, [0.0, 1.0]))
    batch = await waiting
    assert [s.group_id for s in batch.samples] == [5, 5]


async def test_put_group_waits_while_full_then_lands_after_a_draw():
    buf = BufferService({**CFG, "max_staleness": 3})
    assert await buf.acquire(2) and await buf.acquire(2)
    await buf.put_group(make_group(1, [0.0, 1.0]))
    pushing = asyncio.create_task(buf.put_group(make_group(2, [0.0, 1.0])))
    await until(buf, "buffer/waiting_put", 1)
    assert (await buf.metrics())["buffer/waiting"] == 2  # capacity holds
    assert [s.group_id for s in (await buf.get_batch()).samples] == [1, 1]
    assert (await pushing).kept == 2


async def test_close_wakes_every_waiter_with_a_clear_outcome():
    buf = BufferService({**CFG, "max_staleness": 3})
    assert await buf.acquire(2) and await buf.acquire(2)
    await buf.put_group(make_group(1, [0.0, 1.0]))
    putter = asyncio.create_task(buf.put_group(make_group(2, [0.0, 1.0])))
    buf2 = BufferService(CFG)
    assert await buf2.acquire(2)
    acquirer = asyncio.create_task(buf2.acquire(2))
    getter = asyncio.create_task(buf2.get_batch())
    await until(buf, "buffer/waiting_put", 1)
    await until(buf2, "buffer/waiting_acquire", 1)
    await until(buf2, "buffer/waiting_get", 1)
    await buf.close()
    await buf2.close()
    with pytest.raises(BufferClosedError):
        await putter
    assert await acquirer is False
    with pytest.raises(BufferClosedError):
        await getter
    assert await buf2.acquire(1) is False


async def test_bad_input_raises_instead_of_waiting():
    buf = BufferService(CFG)
    with pytest.raises(ValueError):
        await buf.acquire(3)  # larger than a batch: could never be admitted
    with pytest.raises(ValueError):
        await buf.acquire(1, timeout_s=-1)
    with pytest.raises(ValueError, match="acquire"):
        await buf.put_group(make_group(1, [0.0, 1.0]))  # no reservation
    with pytest.raises(ValueError):
        await buf.release(1)


@pytest.mark.slow
def test_ray_actor_blocks_releases_back_pressures_and_closes(ray_session):
    ray = ray_session
    actor = BufferActor.remote(BufferConfig(batch_size=2, max_staleness=1, capacity=2))

    def wait_for(key: str, value: float) -> None:
        for _ in range(3000):
            if ray.get(actor.metrics.remote())[key] == value:
                return
            time.sleep(0.01)
        raise AssertionError(f"{key} never reached {value}")

    # Admission: (eta + 0 + 1) * B = 4 samples before version 1.
    assert ray.get(actor.acquire.remote(2)) and ray.get(actor.acquire.remote(2))
    blocked = actor.acquire.remote(2)
    wait_for("buffer/waiting_acquire", 1)
    getter = actor.get_batch.remote()
    wait_for("buffer/waiting_get", 1)  # a waiting call does not block the actor's other calls
    ray.get(actor.put_group.remote(make_group(1, [0.0, 1.0])))
    assert [s.group_id for s in ray.get(getter).samples] == [1, 1]
    ready, _ = ray.wait([blocked], timeout=0)
    assert not ready  # still at the bound: only a new version widens it
    ray.get(actor.set_version.remote(1))
    assert ray.get(blocked) is True

    # Back-pressure: one group fills capacity, the next push waits for the learner's draw.
    ray.get(actor.put_group.remote(make_group(2, [0.0, 1.0], version=0)))
    pushing = actor.put_group.remote(make_group(3, [0.0, 1.0], version=1))
    wait_for("buffer/waiting_put", 1)
    assert ray.get(actor.metrics.remote())["buffer/waiting"] == 2
    assert [s.group_id for s in ray.get(actor.get_batch.remote(timeout_s=30)).samples] == [2, 2]
    assert ray.get(pushing).kept == 2

    state = ray.get(actor.state_dict.remote())
    assert state["staleness"]["version"] == 1 and len(state["replay"]["groups"]) == 1
    ray.get(actor.set_version.remote(3))  # group 3 (version 1) is now stale: dropped, not trained
    getter = actor.get_batch.remote()
    wait_for("buffer/waiting_get", 1)
    ray.get(actor.close.remote())
    with pytest.raises(BufferClosedError):
        ray.get(getter)
    m = ray.get(actor.metrics.remote())
    assert (m["buffer/dropped_stale"], m["buffer/trained"], m["buffer/closed"]) == (2, 4, 1.0)
    ray.kill(actor)
