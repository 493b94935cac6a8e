"""A weight broadcast whose receiver died: the learner's sending rank fails on the wire (gloo, CPU), the
learner group raises that `CollectiveError` (not a `LearnerRankError`: weightsync recovers from it by
forming a new group, where a learner failure would stop or restart the run) and stays usable, and the
next group carries a whole push. The engines' side of the same recovery: tests/e2e (engine killed)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict

import pytest
import ray

from asyncrl.config import AlgorithmConfig, LearnerConfig, ModelConfig
from asyncrl.learner.group import LearnerGroup
from asyncrl.types import LearnerRankError
from asyncrl.weightsync.collective import CollectiveError, form_specs

pytestmark = pytest.mark.slow


class _Receiver:
    """One engine worker's end of a broadcast group, in a process of its own (so it can die)."""

    def join(self, spec: dict, rank: int) -> bool:
        from asyncrl.weightsync.collective import CollectiveGroup, GroupSpec

        self.group = CollectiveGroup.join(GroupSpec(**spec), rank)
        return True

    def receive(self, timeout_s: float) -> int:
        from asyncrl.weightsync.stream import broadcast_receive_stream

        return sum(b.buffer.numel() for b in broadcast_receive_stream(self.group, time.monotonic() + timeout_s))


async def _form(group: LearnerGroup, prefix: str) -> tuple[list[dict], object]:
    addresses = await group.collective_addresses()
    specs = form_specs("gloo", [(a.host, a.port) for a in addresses], {"engine": 1}, timeout_s=30.0,
                       group_prefix=prefix)
    wire = [asdict(s) for s in specs]
    receiver = ray.remote(num_cpus=0)(_Receiver).remote()
    await asyncio.gather(receiver.join.remote(wire[0], 1), group.join_collective(wire))
    return wire, receiver


def test_a_broadcast_into_a_dead_receiver_fails_on_the_wire_and_the_learner_group_goes_on(ray_session, demo_model_path):
    async def go():
        group = LearnerGroup("actor", ModelConfig(path=str(demo_model_path)),
                             LearnerConfig(world_size=1, lr=1e-3, micro_batch_size=4, num_cpus_per_rank=0.5),
                             AlgorithmConfig(name="grpo", group_size=2), call_timeout_s=120)
        await group.start()
        try:
            wire, receiver = await _form(group, "dead")
            assert [a.group for a in await group.collective_addresses()] == [wire[0]["group_id"]]
            ray.kill(receiver, no_restart=True)
            await asyncio.sleep(1.0)
            t0 = time.monotonic()
            with pytest.raises(CollectiveError, match="rank 0 in export_weights") as err:
                await group.export_weights(0.25, "gloo", "checksum", "engine", 30.0)
            assert not isinstance(err.value, LearnerRankError) and time.monotonic() - t0 < 25  # the wire, not the deadline
            # that group is closed: the next push forms another
            assert [a.group for a in await group.collective_addresses()] == [""]
            states = await group.state()  # the group itself answers, as before the push
            assert len(states) == 1
            wire2, receiver2 = await _form(group, "live")
            got, sent = await asyncio.gather(receiver2.receive.remote(30.0), group.export_weights(0.25, "gloo", "checksum", "engine", 30.0))
            assert sent.num_tensors > 0 and got == sent.bytes
        finally:
            await group.shutdown()

    asyncio.run(go())
