"""The training loop (`asyncrl/trainer/loop.py`, `Trainer.run`) over scripted parts: the order of one
step, the checkpoint taken while no rollout of the next version can start, a resumed run going on
from its checkpoint's version, and a stop that lets the step in progress finish. (The real parts:
tests/e2e/test_training_loop.py.)"""

from __future__ import annotations

import asyncio
import types

import pytest

from asyncrl.config import RootConfig
from asyncrl.trainer.loop import LoopState, Trainer
from asyncrl.trainer.rollout import RolloutCounters
from asyncrl.types import Sample, TrainBatch


def _sample(prompt_index: int, group_id: int, reward: float, versions: tuple[int, int] = (0, 0)) -> Sample:
    return Sample(prompt_ids=[1, 2], response_ids=[3, 4], behavior_logprobs=[-0.5, -0.5], versions=list(versions),
                  reward=reward, group_id=group_id, prompt_index=prompt_index)


class _Remote:
    """A Ray actor method: `.remote(...)` returns something to await."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        async def call():
            return self.fn(*args, **kwargs)

        return call()


class _Group:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    async def compute_log_prob(self, batch):
        self.log.append((f"{self.name}.compute_log_prob", [(s.prompt_index, s.group_id) for s in batch.samples]))
        return [[-0.5, -0.5] for _ in batch.samples]

    async def compute_ref_log_prob(self, batch):
        self.log.append((f"{self.name}.compute_ref_log_prob",))
        return [[-0.4, -0.4] for _ in batch.samples]

    async def update_actor(self, batch, advantages, old_logprobs, ref_logprobs, version_gaps):
        self.log.append((f"{self.name}.update_actor", ref_logprobs is not None, old_logprobs is not None))
        self.gaps = version_gaps
        return {"actor/loss": 0.1}


def _parts(log: list, *, start_version: int = 0, kl: bool = False, on_step=None):
    batches = [0]

    def get_batch(timeout_s):
        batches[0] += 1
        log.append(("buffer.get_batch",))
        # arrival order, not prompt order: the loop sorts before learning
        # token versions up to the loop's: version_gaps are counted from it
        v = start_version + batches[0] - 1
        return TrainBatch(samples=[_sample(7, 71, 1.0, (v, v)), _sample(7, 71, 0.0, (v - 1, v)),
                                   _sample(3, 30, 1.0, (v - 2, v - 1)), _sample(3, 30, 0.0, (v, v))],
                          step=0, policy_version=0)

    class Placement:
        async def to_learner(self):
            log.append(("placement.to_learner",))
            return {}

        async def to_engines(self, publish):
            log.append(("placement.to_engines",))
            return await publish()

    async def publish(version):
        log.append(("publish", version))
        if on_step is not None:
            on_step(version)
        return {"weightsync/version": float(version)}

    async def save_checkpoint(version):
        log.append(("save_checkpoint", version))

    async def evaluate(stopping):
        assert stopping() is False  # the loop's stop, which the evaluation's requests read
        log.append(("evaluate",))
        return 0.5

    async def run_rollouts(stop):
        log.append(("rollouts.run",))
        await stop.wait()
        log.append(("rollouts.stopped",))

    return types.SimpleNamespace(
        start_version=start_version,
        rollouts=types.SimpleNamespace(run=run_rollouts, counters=RolloutCounters()),
        buffer=types.SimpleNamespace(
            get_batch=_Remote(get_batch),
            set_version=_Remote(lambda v: log.append(("buffer.set_version", v))),
            metrics=_Remote(lambda: {"buffer/generated": 4.0}),
        ),
        placement=Placement(),
        actor=_Group("actor", log),
        reference=_Group("reference", log) if kl else None,
        critic=None,
        publish=publish,
        save_checkpoint=save_checkpoint,
        evaluate=evaluate,
        log=lambda version, metrics: log.append(("log", version)),
        tracker=types.SimpleNamespace(log_batch=lambda version, samples: None),
        reward_metrics=lambda: {},
        weights=None,
    )


def _cfg(total_steps: int, algorithm: dict | None = None, **trainer) -> RootConfig:
    return RootConfig.model_validate({
        "trainer": {"total_steps": total_steps, **trainer},
        "checkpoint": {"interval_steps": 1},
        "algorithm": {"group_size": 2, "kl_coef": 0.1, **(algorithm or {})},
        "buffer": {"batch_size": 4, "max_staleness": 0},
    })


def _step(log: list, k: int) -> list:
    """The calls of the k-th step (1-based), from its batch to the line it logs."""
    i = [i for i, e in enumerate(log) if e[0] == "buffer.get_batch"][k - 1]
    end = next(j for j in range(i, len(log)) if log[j][0] == "log")
    return [e[0] for e in log[i:end]]


async def test_one_step_runs_in_order_and_checkpoints_before_admitting_the_next_version():
    log: list = []
    trainer = Trainer(_cfg(2, eval_interval_steps=2), _parts(log, kl=True))
    await trainer.run()
    assert trainer.state == "finished" and trainer.version == 2
    assert log[:2] == [("evaluate",), ("log", 0)]  # the curves' starting point first
    assert ("rollouts.run",) in log
    assert _step(log, 1) == ["buffer.get_batch", "placement.to_learner", "actor.compute_log_prob",
                             "reference.compute_ref_log_prob", "actor.update_actor", "placement.to_engines",
                             "publish", "save_checkpoint", "buffer.set_version"]
    # the step that reaches eval_interval_steps evaluates after admitting the next version
    assert [e for e in _step(log, 2) if e != "rollouts.run"][-2:] == ["buffer.set_version", "evaluate"]  # (the
    # rollout task's first turn comes at the first real wait: the fakes here never wait before the evaluation's)
    assert [e for e in log if e[0] in ("publish", "save_checkpoint", "buffer.set_version")] == [
        ("publish", 1), ("save_checkpoint", 1), ("buffer.set_version", 1),
        ("publish", 2), ("save_checkpoint", 2), ("buffer.set_version", 2)]
    # the batch reached the learner sorted by (prompt_index, group_id), whatever order it came in
    assert next(e for e in log if e[0] == "actor.compute_log_prob")[1] == [(3, 30), (3, 30), (7, 71), (7, 71)]
    assert log[-1] == ("rollouts.stopped",)  # the rollout workers are stopped when the loop ends
    assert trainer.status()["eval_history"] == [(0, 0.5), (2, 0.5)]
    assert type(trainer.status()["state"]) is str and trainer.status()["state"] == "finished"


async def test_no_evaluation_at_all_when_none_is_asked_for():
    """eval_interval_steps 0: not even step 0's (a long-response run's greedy decoding would run to the cut)."""
    log: list = []
    trainer = Trainer(_cfg(2, eval_interval_steps=0), _parts(log))
    await trainer.run()
    assert trainer.state == "finished" and ("evaluate",) not in log and trainer.status()["eval_history"] == []


async def test_an_evaluation_that_fails_is_skipped_and_training_goes_on():
    """An engine lost while the held-out set is generated (the chaos soak's run failed on this): that evaluation is
    skipped with `eval/failed`, the run trains to its end and the next interval evaluates again."""
    log: list = []
    parts = _parts(log)
    calls = []

    async def evaluate(stopping):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("ReplicaNotReady: engine is dead")
        return 0.5

    parts.evaluate = evaluate
    logged = []
    parts.log = lambda version, metrics: logged.append((version, dict(metrics)))
    trainer = Trainer(_cfg(3, eval_interval_steps=1), parts)
    await trainer.run()
    assert trainer.state == "finished" and trainer.version == 3 and len(calls) == 4
    assert trainer.status()["eval_history"] == [(0, 0.5), (2, 0.5), (3, 0.5)]
    assert [m.get("eval/failed") for _, m in logged if "eval/failed" in m] == [1.0]


@pytest.mark.parametrize("algorithm, separate", [
    ({}, False),  # no reference: the update's first forward is the proximal pass
    ({"proximal_logprobs": "separate_pass"}, True),  # asked for
])
async def test_the_proximal_pass_runs_only_where_the_update_cannot_give_it(algorithm, separate):
    log: list = []
    await Trainer(_cfg(1, algorithm), _parts(log)).run()
    step = _step(log, 1)
    assert ("actor.compute_log_prob" in step) is separate
    assert step[step.index("placement.to_learner") + 1] == ("actor.compute_log_prob" if separate else "actor.update_actor")
    assert next(e for e in log if e[0] == "actor.update_actor") == ("actor.update_actor", False, separate)


async def test_the_update_hears_how_many_versions_behind_each_token_was_sampled():
    log: list = []
    parts = _parts(log, start_version=5)
    await Trainer(_cfg(6), parts).run()  # one step, from version 5
    # the batch as the learner gets it, sorted by (prompt_index, group_id): versions (3, 4), (5, 5), (5, 5), (4, 5)
    assert parts.actor.gaps == [[2, 1], [0, 0], [0, 0], [1, 0]]


async def test_a_kl_penalty_in_the_reward_keeps_the_proximal_pass():
    log: list = []
    await Trainer(_cfg(1, {"kl_mode": "reward"}), _parts(log, kl=True)).run()
    assert _step(log, 1)[2:5] == ["actor.compute_log_prob", "reference.compute_ref_log_prob", "actor.update_actor"]


async def test_the_loop_runs_once_and_a_failure_is_final():
    log: list = []
    trainer = Trainer(_cfg(2), _parts(log))
    trainer.p.publish = _failing_publish
    with pytest.raises(RuntimeError, match="engines on fire"):
        await trainer.run()
    assert trainer.state == LoopState.FAILED and "engines on fire" in trainer.error
    with pytest.raises(RuntimeError, match="failed -> training is not a legal move"):
        await trainer.run()  # a failed loop is not started again (the app builds a new one)


async def _failing_publish(version):
    raise RuntimeError("engines on fire")


async def test_a_resumed_run_goes_on_from_its_checkpoints_version():
    log: list = []
    trainer = Trainer(_cfg(5), _parts(log, start_version=3))
    await trainer.run()
    assert trainer.version == 5 and trainer.state == "finished"
    assert [e for e in log if e[0] == "publish"] == [("publish", 4), ("publish", 5)]
    assert log[:2] == [("evaluate",), ("log", 3)]


async def test_a_stop_lets_the_step_in_progress_finish_and_starts_no_other():
    log: list = []
    trainer: Trainer | None = None

    def stop_during_push(version):
        trainer.request_stop()

    trainer = Trainer(_cfg(10), _parts(log, on_step=stop_during_push))
    await asyncio.wait_for(trainer.run(), 30)
    assert trainer.state == "stopped" and trainer.version == 1
    # the step whose push the stop arrived in still checkpoints and admits its version
    assert [e for e in log if e[0] in ("publish", "save_checkpoint", "buffer.set_version")] == [
        ("publish", 1), ("save_checkpoint", 1), ("buffer.set_version", 1)]
    assert sum(e[0] == "buffer.get_batch" for e in log) == 1


async def test_a_stop_abandons_an_evaluation_still_waiting_for_the_engines():
    """The chaos soak's late exits (36.7 and 35 s against the app's 30 s drain) both stopped at an evaluation step:
    Serve took the engines down while the held-out set was being generated, and the requests waited. A stop now
    abandons the evaluation at once: the loop ends at that step boundary."""
    log: list = []
    parts = _parts(log)
    trainer: Trainer | None = None
    started, cancelled = asyncio.Event(), []

    async def evaluate(stopping):
        if trainer.version == 0:
            return 0.5
        started.set()
        try:
            await asyncio.Event().wait()  # the engines are going away: never answered
        except asyncio.CancelledError:
            cancelled.append(trainer.version)
            raise

    parts.evaluate = evaluate
    trainer = Trainer(_cfg(10, eval_interval_steps=1), parts)
    run = asyncio.create_task(trainer.run())
    await asyncio.wait_for(started.wait(), 10)
    trainer.request_stop()
    await asyncio.wait_for(run, 5)
    assert trainer.state == "stopped" and trainer.version == 1 and cancelled == [1]


async def test_a_stop_cancels_rollouts_still_waiting_for_an_engine_after_a_grace(monkeypatch):
    """On the app's stop Serve takes the engines down beside the trainer: a rollout whose request is never answered
    is cancelled `STOP_ROLLOUTS_S` after the step ended (its slots released by the cancel), not waited for until the
    app's drain deadline."""
    import asyncrl.trainer.loop as loop

    monkeypatch.setattr(loop, "STOP_ROLLOUTS_S", 0.2)
    log: list = []
    trainer: Trainer | None = None
    parts = _parts(log, on_step=lambda version: trainer.request_stop())

    async def deaf_rollouts(stop):
        log.append(("rollouts.run",))
        try:
            await asyncio.sleep(3600)  # a request to an engine that went away: `stop` is never looked at
        except asyncio.CancelledError:
            log.append(("rollouts.cancelled",))
            raise

    parts.rollouts.run = deaf_rollouts
    trainer = Trainer(_cfg(10), parts)
    await asyncio.wait_for(trainer.run(), 10)
    assert trainer.state == "stopped" and ("rollouts.cancelled",) in log
