"""Reward-model rewards (`reward.kind: model`): a reward model on a Megatron group of its own scores each sequence.

Owns: `check_reward_model` (a one-label sequence-classification checkpoint with a score head, on a supported
architecture, sharing the policy's tokenizer) and `ModelRewards`, the trainer's scorer over a `LearnerGroup` of the
`reward_model` role: passes of at most `reward.model.batch_size` (waiting at most `max_wait_s`), each bounded by
`timeout_s`, the group restarted after its ranks fail (at most `max_restarts` times), and the `reward/model_*` counters.
Must never: re-tokenise text (it scores the token ids the engine consumed and produced), score a failed pass as 0
(its completions are INVALID_REWARD with the reason, and the buffer drops their groups), or wait on the group
without a deadline.
Details: docs/design/rewards.md, "Reward-model rewards".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from pathlib import Path
from typing import Any

from asyncrl.config import AlgorithmConfig, LearnerConfig, ModelConfig, RewardConfig
from asyncrl.rewards.pool import RewardOutcome, TokenIds
from asyncrl.types import Sample, SampleStatus

log = logging.getLogger(__name__)
_MAX_ERROR_CHARS = 300


class RewardModelError(ValueError):
    """The reward model's directory cannot serve as a reward model for this policy."""


def check_reward_model(path: str, policy_path: str) -> None:
    """Raise RewardModelError naming what is wrong with `path` as the reward model of `policy_path`."""
    from transformers import AutoConfig, AutoTokenizer

    from asyncrl.learner.convert import SafetensorsDir
    from asyncrl.learner.model import UnsupportedModelError, model_arch

    where = Path(path)
    if not (where / "config.json").is_file():
        raise RewardModelError(f"{path!r} is not an HF model directory (no config.json)")
    try:
        hf = AutoConfig.from_pretrained(path)
        model_arch(hf)
    except UnsupportedModelError as err:
        raise RewardModelError(f"{path!r}: {err}") from None
    except (OSError, ValueError) as err:
        raise RewardModelError(f"{path!r}: cannot read its config: {err}") from None
    try:
        reader = SafetensorsDir(path)
    except FileNotFoundError as err:
        raise RewardModelError(str(err)) from None
    if "score.weight" not in reader.file_of:
        raise RewardModelError(
            f"{path!r} has no score.weight: a reward model is a trained *ForSequenceClassification checkpoint "
            "(a causal LM's directory would score with a random head)")
    labels = getattr(hf, "num_labels", None)
    if labels != 1:
        raise RewardModelError(f"{path!r} has num_labels={labels}; a reward model scores with one label")
    try:
        rm_vocab = AutoTokenizer.from_pretrained(path).get_vocab()
        policy_vocab = AutoTokenizer.from_pretrained(policy_path).get_vocab()
    except (OSError, ValueError) as err:
        raise RewardModelError(f"cannot load the tokenizers of {path!r} and the policy {policy_path!r}: {err}") from None
    if rm_vocab != policy_vocab:
        differ = len(set(rm_vocab.items()) ^ set(policy_vocab.items()))
        raise RewardModelError(
            f"{path!r}'s tokenizer differs from the policy's ({differ} token/id pairs not shared): the reward model "
            "reads the policy's token ids as they are")


class _Pending:
    __slots__ = ("prompt_ids", "response_ids", "future")

    def __init__(self, prompt_ids: list[int], response_ids: list[int], future: asyncio.Future) -> None:
        self.prompt_ids, self.response_ids, self.future = prompt_ids, response_ids, future


class ModelRewards:
    """The trainer's scorer when reward.kind is model. `await start()` before the first score."""

    def __init__(self, config: RewardConfig, model_cfg: ModelConfig, learner_cfg: LearnerConfig,
                 algorithm_cfg: AlgorithmConfig, *, group_factory: Any = None) -> None:
        rm = config.model
        self.config = rm
        self._model_cfg = model_cfg.model_copy(update={"path": rm.path})
        fields = learner_cfg.model_dump()
        fields.update(world_size=rm.world_size, strategy_config=dict(rm.strategy_config),
                      num_cpus_per_rank=rm.num_cpus_per_rank, pool=rm.pool.model_dump(),
                      num_gpus_per_rank=rm.gpus_per_rank(learner_cfg))
        self._learner_cfg = LearnerConfig.model_validate(fields)
        self._algorithm_cfg = algorithm_cfg
        self._group_factory = group_factory or self._new_group
        self._group: Any = None
        self._queue: list[_Pending] = []
        self._arrived = asyncio.Event()
        self._batcher: asyncio.Task | None = None
        self._down: str | None = None  # why every score is invalid now (restarts used up)
        self._counts = {"passes": 0, "samples": 0, "valid": 0, "invalid": 0, "failures": 0, "restarts": 0}
        self._pass_s = 0.0

    def _new_group(self) -> Any:
        from asyncrl.learner.group import LearnerGroup

        return LearnerGroup("reward_model", self._model_cfg, self._learner_cfg, self._algorithm_cfg,
                            call_timeout_s=self.config.timeout_s)

    async def start(self) -> None:
        self._group = self._group_factory()
        await self._group.start()
        self._batcher = asyncio.get_running_loop().create_task(self._run_batches())

    async def score(self, completions: list[str], answers: list[str], metadata: list[dict[str, Any]] | None = None,
                    token_ids: TokenIds | None = None) -> list[RewardOutcome]:
        if token_ids is None or len(token_ids) != len(completions):
            raise ValueError("reward.kind model scores token ids: pass token_ids, one (prompt ids, response ids) per completion")
        if self._batcher is None:
            raise RuntimeError("ModelRewards.start() was not awaited")
        loop = asyncio.get_running_loop()
        slots: list[RewardOutcome | asyncio.Future] = []
        for prompt_ids, response_ids in token_ids:
            if self._down:
                slots.append(self._invalid(self._down))
            elif not response_ids:
                slots.append(self._invalid("empty response: nothing for the reward model to score"))
            else:
                fut = loop.create_future()
                self._queue.append(_Pending(list(prompt_ids), list(response_ids), fut))
                slots.append(fut)
        self._arrived.set()
        return [await s if isinstance(s, asyncio.Future) else s for s in slots]

    async def _run_batches(self) -> None:
        while True:
            await self._arrived.wait()
            deadline = time.monotonic() + self.config.max_wait_s
            while len(self._queue) < self.config.batch_size and time.monotonic() < deadline:
                await asyncio.sleep(min(0.005, self.config.max_wait_s))
            batch, self._queue = self._queue[: self.config.batch_size], self._queue[self.config.batch_size :]
            if not self._queue:
                self._arrived.clear()
            if not batch:
                continue
            try:
                await self._score_pass(batch)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - the batcher must outlive any one pass
                log.exception("reward model pass crashed")
                for p in batch:
                    if not p.future.done():
                        p.future.set_result(self._invalid(f"reward model pass crashed: {type(err).__name__}: {err}"[:_MAX_ERROR_CHARS]))

    async def _score_pass(self, batch: list[_Pending]) -> None:
        samples = [Sample(prompt_ids=p.prompt_ids, response_ids=p.response_ids, behavior_logprobs=[0.0] * len(p.response_ids),
                          versions=[0] * len(p.response_ids), reward=0.0, group_id=i, prompt_index=i)
                   for i, p in enumerate(batch)]
        self._counts["passes"] += 1
        self._counts["samples"] += len(batch)
        started = time.monotonic()
        try:
            if self._down:
                raise RuntimeError(self._down)
            scores = await asyncio.wait_for(self._group.compute_rm_score(samples), self.config.timeout_s + 5.0)
        except asyncio.CancelledError:
            for p in batch:
                if not p.future.done():
                    p.future.set_result(self._invalid("the reward model was closed while scoring"))
            raise
        except Exception as err:  # noqa: BLE001 - every failure is an invalid reward, with its reason
            why = f"reward model pass failed: {type(err).__name__}: {err}"[:_MAX_ERROR_CHARS]
            self._counts["failures"] += 1
            log.warning("%s; %d completions are INVALID_REWARD", why, len(batch))
            for p in batch:
                if not p.future.done():
                    p.future.set_result(self._invalid(why))
            await self._restart(why)
            return
        finally:
            self._pass_s += time.monotonic() - started
        for p, value in zip(batch, scores):
            if p.future.done():
                continue
            if value is None or not math.isfinite(value):
                p.future.set_result(self._invalid(f"the reward model's score {value!r} is not a finite number"))
                continue
            reward = 1.0 / (1.0 + math.exp(-value)) if self.config.sigmoid else float(value)
            self._counts["valid"] += 1
            p.future.set_result(RewardOutcome(reward, SampleStatus.VALID, None))

    async def _restart(self, why: str) -> None:
        """A new group after a failed pass; past max_restarts the scorer goes down for good."""
        if self._down:
            return
        with contextlib.suppress(Exception):
            await self._group.shutdown()
        while self._counts["restarts"] < self.config.max_restarts:
            self._counts["restarts"] += 1
            log.warning("restarting the reward model group (%d of %d) after: %s",
                        self._counts["restarts"], self.config.max_restarts, why)
            self._group = self._group_factory()
            try:
                await self._group.start()
                return
            except Exception as err:  # noqa: BLE001
                why = f"its restart failed: {type(err).__name__}: {err}"[:_MAX_ERROR_CHARS]
                with contextlib.suppress(Exception):
                    await self._group.shutdown()
        self._down = (f"the reward model is down after {self.config.max_restarts} restarts "
                      f"(reward.model.max_restarts); last failure: {why}")[:_MAX_ERROR_CHARS]
        log.error("%s", self._down)

    def _invalid(self, why: str) -> RewardOutcome:
        self._counts["invalid"] += 1
        return RewardOutcome(None, SampleStatus.INVALID_REWARD, why)

    def metrics(self) -> dict[str, float]:
        out = {f"reward/model_{k}": float(v) for k, v in self._counts.items()}
        out["reward/model_down"] = float(self._down is not None)
        out["reward/model_mean_pass_size"] = self._counts["samples"] / max(self._counts["passes"], 1)
        out["reward/model_pass_s"] = self._pass_s
        return out

    async def aclose(self) -> None:
        if self._batcher is not None:
            self._batcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._batcher
            self._batcher = None
        for p in self._queue:
            if not p.future.done():
                p.future.set_result(self._invalid("the reward model was closed"))
        self._queue = []
        if self._group is not None:
            with contextlib.suppress(Exception):
                await self._group.shutdown()
