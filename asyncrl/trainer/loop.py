"""The training loop: rollout workers -> buffer -> learner -> weightsync -> next version.

Owns: the order of one learner step (batch, proximal/reference log-probs, values, advantages,
update, publish, admit), evaluation, checkpoints and the status snapshot served at
`/train/status`. Components are built from their own config sections by `TrainerParts`
(asyncrl/trainer/parts.py); this module only sequences them.
Must never: hold engine, Megatron or buffer logic (those live in their components), or block
the event loop (every remote call is awaited).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from typing import Any

from asyncrl.cluster import engine_demand, waiting_for
from asyncrl.config import RootConfig
from asyncrl.trainer.logging_setup import progress_line
from asyncrl.trainer.parts import TrainerParts, distinct
from asyncrl.trainer.step import compute_advantages
from asyncrl.types import LearnerRankError, learner_failure, lost_object_or_actor

log = logging.getLogger(__name__)


ACCOUNTING = ("buffer/generated", "buffer/trained", "buffer/dropped_stale", "buffer/dropped_invalid",
              "buffer/dropped_filtered", "buffer/dropped_failed", "buffer/waiting", "buffer/running")


def accounting_line(buffer_metrics: dict[str, float], keys: tuple[str, ...] = ACCOUNTING, sep: str = " ") -> str:
    """`generated=... trained=... ...`: the buffer's accounting from its metrics, for log lines and errors."""
    return sep.join(f"{k.removeprefix('buffer/')}={buffer_metrics[k]:g}" for k in keys if k in buffer_metrics)


class LoopState(enum.StrEnum):
    """The loop's lifecycle, as `/train/status` shows it (a StrEnum: it reads and serialises as its value)."""

    STARTING = "starting"
    TRAINING = "training"
    FINISHED = "finished"  # total_steps reached
    STOPPED = "stopped"  # a drain ended it at a step boundary
    FAILED = "failed"  # an error ended it; `error` says which


# Every legal move; FINISHED, STOPPED and FAILED are final.
_LOOP_MOVES = {
    LoopState.STARTING: {LoopState.TRAINING},
    LoopState.TRAINING: {LoopState.FINISHED, LoopState.STOPPED, LoopState.FAILED},
}


# A batch wait asks the engines whether any replica answers every this many seconds (none: /train/status's
# waiting_for names generator.engine_pool, e.g. after the pool's last node was lost)
ENGINE_CHECK_S = 10.0
NO_ENGINE = "no engine replica answers: Serve starts one where the pool has room"
# A stop requested by the app: how long rollouts in flight may still take before they are cancelled (their slots
# released). Serve takes the engines down beside the trainer, so a request in flight may never be answered.
STOP_ROLLOUTS_S = 5.0


class BatchTimeout(RuntimeError):
    """The learner waited `trainer.batch_timeout_s` for a batch that did not fill."""


class Trainer:
    """Asynchronous PPO/GRPO with bounded staleness over already-started parts."""

    def __init__(self, cfg: RootConfig, parts: TrainerParts) -> None:
        self.cfg = cfg
        self.p = parts
        self.version = parts.start_version
        self.state = LoopState.STARTING
        self.error: str | None = None
        self.last_metrics: dict[str, Any] = {}
        self.eval_history: list[tuple[int, float]] = []
        self._stop = asyncio.Event()  # a drain asked the loop to end after the step in progress
        self._started = time.time()
        # Training's clock (time/elapsed_s): from the rollouts' start, after step 0's evaluation, so
        # the first step's time is that step's (its batch, update and push), not the evaluation's.
        self._training_started: float | None = None
        self.restarts = 0  # learner restarts so far (trainer.max_restarts)

    async def run(self) -> None:
        # Dataflow (what each loop consumes / produces / waits for):
        #   rollout workers, `trainer.rollout_concurrency` at once:
        #     buffer.acquire(n) [waits: accepted + running < (eta + v + 1) * B]
        #     -> engines.generate(prompt, n) -> reward pool -> buffer.put_group(n samples)
        #   learner loop, below:
        #     buffer.get_batch(B) [waits: B samples, none older than v - eta, and every rollout admitted
        #                          at <= v - eta (overdue) arrived; oldest groups first]
        #     -> placement.to_learner [hybrid: engines sleep, learner state onto its devices]
        #     -> actor proximal log-probs (unless the update's first forward gives them),
        #        reference log-probs, critic values (PPO)
        #     -> advantages -> actor (+critic) update: policy version v + 1
        #     -> weightsync.publish(v + 1) [every replica pauses(keep), loads, verifies, commits],
        #        inside placement.to_engines [hybrid: engine weights wake first, KV cache after]
        #     -> buffer.set_version(v + 1) [admits the next rollouts]
        cfg, p = self.cfg, self.p
        self._move(LoopState.TRAINING)
        stop = asyncio.Event()
        rollouts: asyncio.Task | None = None
        try:
            # The starting point of the curves, before any rollout: the evaluation has the engines to
            # itself, and step 1 neither waits behind it nor gets a head start from it. None when no
            # evaluation is asked for (eval_interval_steps 0): greedy decoding of a long-response run
            # can take minutes at the cut.
            if cfg.trainer.eval_interval_steps:
                t = time.monotonic()
                p.log(self.version, await self._evaluate() | {"time/eval_s": time.monotonic() - t})
            self._training_started = time.time()
            rollouts = asyncio.create_task(p.rollouts.run(stop), name="rollouts")
            while self.version < cfg.trainer.total_steps and not self._stop.is_set():
                batch = await self._next_batch(rollouts)
                if batch is None:  # stopped while waiting for it
                    break
                t0 = time.monotonic()
                metrics, t1 = await self._train_and_publish(batch)
                self.version += 1
                metrics |= {"time/train_s": t1 - t0, "time/sync_s": time.monotonic() - t1}
                if cfg.checkpoint.interval_steps and self.version % cfg.checkpoint.interval_steps == 0:
                    # Before set_version admits new rollouts: with eta = 0 nothing is running,
                    # so the saved prompt position is exactly where the resumed run continues.
                    await self._save_checkpoint()
                await p.buffer.set_version.remote(self.version)
                if cfg.trainer.eval_interval_steps and self.version % cfg.trainer.eval_interval_steps == 0:
                    metrics |= await self._evaluate()
                metrics |= await p.buffer.metrics.remote()
                self._record(metrics, batch)
            self._move(LoopState.STOPPED if self.version < cfg.trainer.total_steps else LoopState.FINISHED)
        except Exception as err:
            if self._stop.is_set():  # the step in progress failed because the app is stopping
                self._move(LoopState.STOPPED)
                log.warning("stopping: the step after version %d was abandoned (%s); engines keep version %d",
                            self.version, err, self.version)
                return
            self._move(LoopState.FAILED)
            self.error = repr(err)
            log.exception("training failed")
            raise
        finally:
            stop.set()
            if rollouts is not None:
                if self._stop.is_set():
                    done, _ = await asyncio.wait({rollouts}, timeout=STOP_ROLLOUTS_S)
                    if not done:
                        rollouts.cancel()
                await asyncio.gather(rollouts, return_exceptions=True)

    def _move(self, new: LoopState) -> None:
        if new not in _LOOP_MOVES.get(self.state, set()):
            raise RuntimeError(f"training loop: {self.state} -> {new} is not a legal move")
        self.state = new

    async def _train_and_publish(self, batch: Any) -> tuple[dict[str, Any], float]:
        """One update on `batch` and its push as version + 1; returns its metrics and when the
        update ended. A learner rank that fails meanwhile (`LearnerRankError`, also from inside a
        push) restarts the learner groups from the last complete checkpoint and redoes the step on
        the same batch, up to `trainer.max_restarts` times per run; nothing was published for it."""
        p = self.p
        while True:
            try:
                metrics = await p.placement.to_learner()
                metrics |= await self._learn(batch)
                t1 = time.monotonic()
                metrics |= await p.placement.to_engines(lambda: p.publish(self.version + 1))
                metrics["trainer/learner_restarts"] = float(self.restarts)
                return metrics, t1
            except Exception as err:
                await self._restart_learner_or_raise(err, f"redoing the step after version {self.version}")

    async def _save_checkpoint(self) -> None:
        """The checkpoint of this version; a learner rank that fails while writing it restarts the
        learner (as in a step) and this checkpoint is skipped: the restarted learner holds an
        older checkpoint's state, not this version's (the next one is saved as usual)."""
        try:
            await self.p.save_checkpoint(self.version)
        except Exception as err:
            await self._restart_learner_or_raise(err, f"skipping the checkpoint of version {self.version}")

    async def _restart_learner_or_raise(self, err: Exception, then: str) -> None:
        """Re-raise `err` unless a learner rank failed and `trainer.max_restarts` allows another
        restart; else start the learner groups again from the last complete checkpoint."""
        failed = learner_failure(err)
        if failed is None and not self._stop.is_set() and self.restarts < self.cfg.trainer.max_restarts:
            failed = await self._learner_object_lost(err)
        if failed is None or self._stop.is_set() or self.restarts >= self.cfg.trainer.max_restarts:
            raise err
        self.restarts += 1
        log.warning("%s; restarting the learner (%d of trainer.max_restarts=%d), %s; the engines keep serving "
                    "version %d", failed, self.restarts, self.cfg.trainer.max_restarts, then, self.version)
        restored = await self.p.restart_learners(self.version)
        log.info("learner restarted from %s", f"the checkpoint of version {restored}" if restored is not None
                 else "the model's initial weights")

    async def _learner_object_lost(self, err: Exception) -> LearnerRankError | None:
        """A Ray object or actor lost behind `err` (e.g. a version's bucket a learner rank put, gone with the rank's
        node: OwnerDiedError) is the learner's failure when one of its ranks is gone: the restart path, not a bare run
        failure. Other losses (an engine's) stay `err`'s."""
        if not lost_object_or_actor(err):
            return None
        for group in distinct(self.p.actor, getattr(self.p, "reference", None), getattr(self.p, "critic", None)):
            dead = await group.dead_ranks()
            if dead:
                return LearnerRankError(dead[0], "(an object or actor it owned was lost)", f"{type(err).__name__}: {err}")
        return None

    def request_stop(self) -> None:
        """End the loop at the next step boundary: a step in progress (its update and push) finishes,
        no new one starts, rollouts stop (those in flight push their groups, or are cancelled after
        `STOP_ROLLOUTS_S` with their slots released), `state` = stopped.
        A push that fails meanwhile (the engines may be stopping too) is not retried."""
        self._stop.set()
        weights = getattr(self.p, "weights", None)
        if weights is not None:
            weights.stop_recovering()

    async def _next_batch(self, rollouts: asyncio.Task) -> Any:
        """The next batch, or None once a stop was requested."""
        limit = self.cfg.trainer.batch_timeout_s
        deadline = time.monotonic() + limit
        check_at, no_engine = time.monotonic() + ENGINE_CHECK_S, None
        try:
            while not self._stop.is_set():
                batch = await self.p.buffer.get_batch.remote(timeout_s=min(1.0, max(0.0, deadline - time.monotonic())))
                if batch is not None:
                    # Sample order inside a batch follows completion timing; sort it so a step is a
                    # function of the batch's content (exact resume and reproducible updates).
                    batch.samples.sort(key=lambda s: (s.prompt_index, s.group_id))
                    return batch
                if rollouts.done():
                    rollouts.result()  # re-raise the rollout failure instead of waiting forever
                    raise RuntimeError("rollout workers stopped before the batch was complete")
                if time.monotonic() >= deadline:
                    raise BatchTimeout(await self._batch_timeout_message(limit))
                if time.monotonic() >= check_at:  # a long wait: is any engine replica there to fill it?
                    check_at = time.monotonic() + ENGINE_CHECK_S
                    running = await self._engines_running()
                    if running is False and no_engine is None:
                        no_engine = contextlib.ExitStack()
                        no_engine.enter_context(waiting_for(engine_demand(self.cfg), NO_ENGINE))
                    elif running and no_engine is not None:
                        no_engine.close()
                        no_engine = None
            return None
        finally:
            if no_engine is not None:
                no_engine.close()

    async def _engines_running(self) -> bool | None:
        """Whether any engine replica answers `stats` (None: not known: no engine handle, or the call failed)."""
        engine = getattr(self.p, "engine", None)
        if engine is None:
            return None
        from asyncrl.generator.control import EngineControl
        from asyncrl.interfaces import EngineAPI

        try:
            return bool(await EngineControl(engine).call(EngineAPI.stats, timeout_s=ENGINE_CHECK_S))
        except Exception as err:  # noqa: BLE001 - a failing replica is not a missing one: say nothing
            log.debug("engine check during a batch wait: %r", err)
            return None

    async def _batch_timeout_message(self, limit: float) -> str:
        buf = await self.p.buffer.metrics.remote()
        shown = accounting_line(buf, ACCOUNTING + ("buffer/admitted", "buffer/admission_left", "buffer/overdue"), sep=", ")
        c = self.p.rollouts.counters
        errors = "; ".join(c.errors[-3:]) or "none"
        return (f"no batch of {self.cfg.buffer.batch_size} samples for policy version {self.version} within "
                f"trainer.batch_timeout_s={limit:g} s (buffer: {shown}; rollouts: started={c.started} "
                f"finished={c.finished} failed={c.failed} timeouts={c.timeouts}; last rollout errors: {errors})")

    async def _learn(self, batch: Any) -> dict[str, float]:
        p, algo = self.p, self.cfg.algorithm
        # None: the update's own first forward gives them (AlgorithmConfig.proximal_in_update).
        in_update = algo.proximal_in_update(with_reference=p.reference is not None)
        old_logprobs = None if in_update else await p.actor.compute_log_prob(batch)
        ref_logprobs = await p.reference.compute_ref_log_prob(batch) if p.reference else None
        values = await p.critic.compute_values(batch) if p.critic else None
        advantages, returns, adv_metrics = compute_advantages(batch, algo, old_logprobs, ref_logprobs, values)
        # per token: how many versions behind the learner's the weights that sampled it were
        gaps = [[self.version - v for v in s.versions] for s in batch.samples]
        metrics = await p.actor.update_actor(batch, advantages, old_logprobs, ref_logprobs, gaps)
        if p.critic:
            metrics |= await p.critic.update_critic(batch, returns, values)
        return {**metrics, **adv_metrics}

    async def _evaluate(self) -> dict[str, float]:
        """The held-out accuracy at this version; an evaluation that fails (every attempt of a request, an engine
        lost meanwhile) is skipped with a warning and `eval/failed`, never the run's failure. A stop abandons it: Serve
        takes the engines down beside the trainer, and requests to a deployment going away can wait past the drain."""
        evaluation = asyncio.ensure_future(self.p.evaluate(stopping=self._stop.is_set))
        stopped = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({evaluation, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not evaluation.done():
                log.warning("stopping: the evaluation at version %d abandoned", self.version)
                return {"eval/failed": 1.0}
            accuracy = evaluation.result()
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - a measurement, not training: the next interval evaluates again
            log.warning("evaluation at version %d failed, skipped: %s: %s", self.version, type(err).__name__, err)
            return {"eval/failed": 1.0}
        finally:
            for task in (evaluation, stopped):
                task.cancel()
        self.eval_history.append((self.version, accuracy))
        return {"eval/accuracy": accuracy}

    def _record(self, metrics: dict[str, Any], batch: Any) -> None:
        rewards = [s.reward for s in batch.samples]
        metrics["train/reward_mean"] = sum(rewards) / len(rewards)
        # What the learner processed this step (MFU = 6-8 x params x train/tokens / time/train_s).
        metrics["train/response_tokens"] = float(sum(len(s.response_ids) for s in batch.samples))
        # Each sample's, in batch order: metrics.jsonl keeps the list (the peer benchmark's length
        # distribution); trackers and /train/status keep scalars only.
        metrics["train/response_lengths"] = [len(s.response_ids) for s in batch.samples]
        metrics["train/tokens"] = metrics["train/response_tokens"] + float(sum(len(s.prompt_ids) for s in batch.samples))
        metrics["train/loss_tokens"] = float(sum(sum(s.response_mask) for s in batch.samples))  # < response: episodes' inner prompts
        metrics["train/step"] = self.version
        metrics["time/elapsed_s"] = time.time() - (self._training_started or self._started)
        metrics |= self.p.rollouts.counters.metrics()
        metrics |= self.p.reward_metrics()
        metrics["rollout/tokens_per_s"] = metrics["rollout/tokens"] / max(metrics["time/elapsed_s"], 1e-9)
        self.last_metrics = metrics
        self.p.log(self.version, metrics)
        self.p.tracker.log_batch(self.version, batch.samples)
        shown = metrics | ({"eval/accuracy": self.eval_history[-1][1]} if self.eval_history else {})
        log.info("%s train %.1fs sync %.2fs", progress_line(self.version, self.cfg.trainer.total_steps, shown),
                 metrics["time/train_s"], metrics["time/sync_s"])

    def status(self) -> dict[str, Any]:
        """The snapshot behind GET /train/status."""
        return {
            "state": self.state.value,  # a plain str: the gateway's process need not import the loop
            "error": self.error,
            "step": self.version,
            "total_steps": self.cfg.trainer.total_steps,
            "policy_version": self.version,
            "reward_mean": self.last_metrics.get("train/reward_mean"),
            "eval_accuracy": self.eval_history[-1][1] if self.eval_history else None,
            "eval_history": self.eval_history,
            "buffer": {k: v for k, v in self.last_metrics.items() if k.startswith("buffer/")},
            "elapsed_s": time.time() - self._started,
            "learner_restarts": self.restarts,
            "metrics": {k: v for k, v in self.last_metrics.items() if isinstance(v, (int, float))},
        }

