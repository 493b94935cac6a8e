"""Hybrid placement's phase switch (logic, with recording fakes of the engine control and the
learner groups): the order of sleeps, wakes, holds and releases around a step; the engines are
woken even when the push fails; engines that cannot sleep are refused at start."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.config import ConfigError, HybridConfig, load_config
from asyncrl.trainer.placement import Colocation, HybridError, Phase, Separated, build_placement


class Engines:
    def __init__(self, log: list, stats: dict | None = None) -> None:
        self.log, self._stats = log, stats if stats is not None else {"r1": {"sleep_unsupported": None}}

    async def call(self, verb, *args, timeout_s=None):
        self.log.append(("engines", verb.__name__, *args))
        return {"r1": {"replica_id": "r1"}}

    async def wait_ready(self, timeout_s=600.0):
        self.log.append(("engines", "wait_ready"))
        return self._stats


class Group:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    async def hold_device(self, parts=None):
        self.log.append((self.name, "hold", tuple(parts or ())))
        return [{"rank": 0, "device_free_bytes": 3 * 2**30}]

    async def release_device(self, parts=None, wake_need=None):
        self.log.append((self.name, "release", tuple(parts or ())) + ((wake_need,) if wake_need is not None else ()))
        report = {"learner/state_kept": self.kept} if wake_need is not None else {}
        if self.released_gib:
            report["learner/released_bytes"] = self.released_gib * 2**30
        return [{"rank": 0, "device_free_bytes": 5 * 2**30, "report": report}]

    kept = 1.0
    released_gib = 0.0


def _colocation(log, **engine_kw):  # learner_offload always: every switch moves the flagged state, no decision
    return Colocation(HybridConfig(enabled=True, engine_sleep_level=2, learner_offload="always"), Engines(log, **engine_kw),
                      Group("actor", log), [Group("ref", log)])


def test_a_step_sleeps_engines_before_the_learner_and_wakes_weights_before_kv_around_the_push():
    log: list = []
    place = _colocation(log)

    async def publish():
        log.append(("publish",))
        return {"weightsync/push_s": 0.1}

    async def step():
        await place.start()
        del log[:]
        m1 = await place.to_learner()
        assert place.phase is Phase.LEARNING
        m2 = await place.to_engines(publish)
        return m1, m2

    m1, m2 = asyncio.run(step())
    assert log == [
        ("engines", "sleep", 2),
        ("actor", "hold", ()), ("ref", "hold", ()),
        ("actor", "release", ("grads", "optimizer")), ("ref", "release", ()),
        ("engines", "wake_up", ["weights"]),
        ("publish",),
        ("actor", "release", ("params",)),
        ("engines", "wake_up", ["kv_cache"]),
    ]
    assert place.phase is Phase.GENERATING
    assert m1["hybrid/device_free_gib_learning"] == 3.0
    assert m2["weightsync/push_s"] == 0.1 and m2["hybrid/switches"] == 1.0
    assert m2["hybrid/device_free_gib_learner_away"] == 5.0


def test_the_switch_to_the_engines_times_each_of_its_parts_apart_from_the_push():
    """`hybrid/engine_wake_s` (the switch around the push) is the sum of its four parts, each its own
    metric: the clock here advances one second per logged call, the push's own included."""
    log: list = []
    place = _colocation(log)
    place.clock = lambda: float(len(log))

    async def publish():
        log.append(("publish",))
        return {}

    async def step():
        await place.start()
        await place.to_learner()
        return await place.to_engines(publish)

    m = asyncio.run(step())
    parts = {k: m[f"hybrid/{k}"] for k in ("learner_release_s", "weights_wake_s", "params_release_s", "kv_wake_s")}
    assert parts == {"learner_release_s": 2.0, "weights_wake_s": 1.0, "params_release_s": 1.0, "kv_wake_s": 1.0}
    assert m["hybrid/engine_wake_s"] == sum(parts.values()) == 5.0


def test_when_short_asks_each_group_to_decide_with_the_engines_share_and_reports_what_stayed():
    """`learner_offload: when_short`: the first release of the switch (engines asleep, the learner's
    state still on its devices) carries the engines' wake need (their gpu_memory_utilization share
    of a device + the headroom); the params' release after the push follows that decision."""
    log: list = []
    cfg = HybridConfig(enabled=True, learner_offload="when_short", wake_headroom_gib=1.5)
    actor, ref = Group("actor", log), Group("ref", log)
    place = build_placement(cfg, Engines(log), actor, [ref, None], engine_memory_fraction=0.3)

    async def publish():
        return {}

    async def step():
        await place.start()
        await place.to_learner()
        del log[:]
        return await place.to_engines(publish)

    need = (0.3, int(1.5 * 2**30))
    metrics = asyncio.run(step())
    assert log == [("actor", "release", ("grads", "optimizer"), need), ("ref", "release", (), need),
                   ("engines", "wake_up", ["weights"]), ("actor", "release", ("params",)),
                   ("engines", "wake_up", ["kv_cache"])]
    assert metrics["hybrid/learner_state_kept"] == 1.0
    assert metrics["hybrid/learner_released_gib"] == 0.0
    ref.kept, ref.released_gib = 0.0, 2.5  # one group's device was short: 2.5 GiB of its state left
    asyncio.run(place.to_learner())
    short = asyncio.run(place.to_engines(publish))
    assert short["hybrid/learner_state_kept"] == 0.0 and short["hybrid/learner_released_gib"] == 2.5
    assert HybridConfig().learner_offload == "when_short"  # the default
    always = _colocation([])  # always: no decision asked, nothing reported
    asyncio.run(always.start())
    asyncio.run(always.to_learner())
    assert "hybrid/learner_state_kept" not in asyncio.run(always.to_engines(publish))


def test_the_warm_up_runs_with_engines_asleep_at_level_1_and_wakes_them_even_when_it_fails():
    """Before the first step the learner warms up on its devices with the engines asleep; level 1 keeps their
    version-0 weights (no push follows), whatever hybrid.engine_sleep_level says for the steps."""
    log: list = []
    place = _colocation(log)  # engine_sleep_level 2

    async def ok():
        log.append(("warm_up",))
        return "done"

    async def boom():
        log.append(("warm_up",))
        raise RuntimeError("out of memory")

    asyncio.run(place.start())
    del log[:]
    assert asyncio.run(place.warm_up(ok)) == "done"
    expected = [("engines", "sleep", 1), ("actor", "hold", ()), ("ref", "hold", ()), ("warm_up",),
                ("actor", "release", ()), ("ref", "release", ()), ("engines", "wake_up", ["weights", "kv_cache"])]
    assert log == expected and place.phase is Phase.GENERATING
    del log[:]
    with pytest.raises(RuntimeError, match="out of memory"):
        asyncio.run(place.warm_up(boom))
    assert log == expected  # the state put away and the engines awake all the same
    assert asyncio.run(Separated().warm_up(ok)) == "done"


def test_the_warm_up_forms_the_push_groups_in_the_memory_a_push_finds_and_wakes_all_when_that_fails():
    """Hybrid's first push would form weightsync's groups inside its switch (1.8 s of a 3B's first step on one
    H200): the warm-up's switch forms them instead, with the exporter's params alone held and the engines'
    weights awake, as `to_engines` has it at its push; a failure there still leaves everything as `start` does."""
    log: list = []
    place = _colocation(log)

    async def ok():
        log.append(("warm_up",))
        return "done"

    async def form():
        log.append(("form_groups",))

    async def form_fails():
        log.append(("form_groups",))
        raise RuntimeError("group did not form")

    asyncio.run(place.start())
    del log[:]
    assert asyncio.run(place.warm_up(ok, form)) == "done"
    expected = [("engines", "sleep", 1), ("actor", "hold", ()), ("ref", "hold", ()), ("warm_up",),
                ("actor", "release", ("grads", "optimizer")), ("ref", "release", ()), ("engines", "wake_up", ["weights"]),
                ("form_groups",), ("actor", "release", ("params",)), ("engines", "wake_up", ["kv_cache"])]
    assert log == expected and place.phase is Phase.GENERATING
    del log[:]
    with pytest.raises(RuntimeError, match="did not form"):
        asyncio.run(place.warm_up(ok, form_fails))
    assert log == expected  # params put away, the KV cache awake all the same
    del log[:]
    asyncio.run(place.warm_up(ok, None))  # no groups to form: the warm-up's own release, then one wake
    assert log[-3:] == [("actor", "release", ()), ("ref", "release", ()), ("engines", "wake_up", ["weights", "kv_cache"])]


def test_start_puts_the_resident_learner_away_and_refuses_engines_that_cannot_sleep():
    log: list = []
    asyncio.run(_colocation(log).start())
    assert log == [("engines", "wait_ready"), ("actor", "hold", ()), ("ref", "hold", ()),
                   ("actor", "release", ()), ("ref", "release", ())]
    cpu = {"r1": {"sleep_unsupported": "sleep mode is not available on platform 'cpu'"}}
    with pytest.raises(HybridError, match="r1: sleep mode is not available on platform 'cpu'"):
        asyncio.run(_colocation([], stats=cpu).start())
    with pytest.raises(HybridError, match="no running engine replica"):
        asyncio.run(_colocation([], stats={}).start())


def test_a_failed_push_still_puts_the_params_away_and_wakes_the_engines():
    log: list = []
    place = _colocation(log)

    async def publish():
        raise RuntimeError("push failed")

    async def step():
        await place.to_learner()
        await place.to_engines(publish)

    with pytest.raises(RuntimeError, match="push failed"):
        asyncio.run(step())
    assert log[-2:] == [("actor", "release", ("params",)), ("engines", "wake_up", ["kv_cache"])]
    assert place.phase is Phase.GENERATING


def test_phases_out_of_order_are_refused():
    place = _colocation([])

    async def publish():
        return {}

    with pytest.raises(HybridError, match="to_engines in phase generating"):
        asyncio.run(place.to_engines(publish))

    async def twice():
        await place.to_learner()
        await place.to_learner()

    with pytest.raises(HybridError, match="to_learner in phase learning"):
        asyncio.run(twice())


def test_separated_placement_only_publishes():
    assert isinstance(build_placement(HybridConfig(), Engines([]), Group("a", []), []), Separated)

    async def publish():
        return {"x": 1.0}

    place = Separated()
    assert asyncio.run(place.to_learner()) == {}
    assert asyncio.run(place.to_engines(publish)) == {"x": 1.0}


def test_hybrid_config_names_what_it_needs():
    with pytest.raises(ConfigError, match=r"learner.num_gpus_per_rank > 0, generator.num_gpus > 0, "
                                          r"generator.engine_kwargs.enable_sleep_mode: true"):
        load_config({"hybrid": {"enabled": True}})
    ok = load_config({"hybrid": {"enabled": True}, "learner": {"num_gpus_per_rank": 0.5},
                      "generator": {"num_gpus": 0.4, "engine_kwargs": {"enable_sleep_mode": True}}})
    assert ok.hybrid.enabled and ok.hybrid.engine_sleep_level == 2
