"""Builds and owns the running parts of one training run, each from its own config section.

Owns: construction order (buffer actor, reward pool, learner groups, weightsync publisher,
tracker, prompt data), the engine-facing adapters (generate through the Serve handle, greedy
evaluation, weight publication), checkpoint save/restore of the whole run, and shutdown.
Must never: decide the order of a training step (trainer/loop.py does), or hand a component
another component's config section.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncrl.cluster import ENGINES_STARTING, engine_demand, waiting_for
from asyncrl.config import DataConfig, RootConfig
from asyncrl.data import ArithmeticTask, Prompt, load_jsonl_prompts, render_prompt
from asyncrl.trainer.data_stream import PromptStream
from asyncrl.trainer.placement import build_placement
from asyncrl.trainer.rollout import RolloutCounters, RolloutWorkers, generate_with_retry
from asyncrl.trainer.step import needs_reference
from asyncrl.trainer.tracking import MetricsTracker
from asyncrl.types import GenerationRequest, GenerationResult, Sample, SamplingParams

log = logging.getLogger(__name__)

CHECKPOINT_STATE = "trainer_state.json"
# Longest the start's rollout warm-up may take (16 tokens a request): past it the start goes on without it.
WARM_UP_TIMEOUT_S = 120.0


def load_prompts(data: DataConfig) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held-out eval) prompts for the configured source."""
    if data.kind == "arithmetic":
        task = ArithmeticTask(digits=data.digits, operators=tuple(data.operators), seed=data.seed, train_size=data.train_size,
                              eval_size=data.eval_size)
        return task.train_split(), task.eval_split()
    from asyncrl.data.prompts import ColumnMap
    from asyncrl.data.tables import load_hf_dataset_prompts, load_parquet_prompts

    c = data.columns
    columns = ColumnMap(c.prompt, c.answer, tuple(c.metadata) if isinstance(c.metadata, list) else c.metadata)
    if data.kind == "hf_dataset":
        train = load_hf_dataset_prompts(data.path, data.split, columns)
        if data.eval_split:
            return train, load_hf_dataset_prompts(data.path, data.eval_split, columns)
        return train, load_hf_dataset_prompts(data.eval_path, "train", columns) if data.eval_path else []
    load = load_parquet_prompts if data.kind == "parquet" else load_jsonl_prompts
    return load(data.path, columns), load(data.eval_path, columns) if data.eval_path else []


def _write_run_record(cfg: RootConfig) -> None:
    """`run.json` in the run's logging directory: its config and where its checkpoints and model
    are, as absolute paths, so `asyncrl export RUN_DIR` finds them from the directory alone."""
    run_dir = Path(cfg.logging.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"checkpoint_dir": str(Path(cfg.checkpoint.dir).absolute()), "model_path": str(Path(cfg.model.path).absolute()),
              "config": cfg.model_dump(mode="json")}
    tmp = run_dir / "run.json.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, run_dir / "run.json")


def complete_checkpoints(root: Path) -> list[Path]:
    """The loadable checkpoints under `root`, oldest first. `step_N.tmp` is one being written
    (never loaded); `step_N.old` is a complete one that was being replaced by a new `step_N`: it
    counts only while that new one is not in place."""
    found = {}
    for p in root.glob("step_*"):
        base, _, suffix = p.name.partition(".")
        if suffix in ("", "old") and (p / CHECKPOINT_STATE).exists() and (suffix == "" or base not in found):
            found[base] = p
    return [found[k] for k in sorted(found)]


def _sees(path: str) -> bool:
    return os.path.exists(path)


async def check_shared_checkpoint_dir(directory: str, groups: list[Any], sees: Any = None, here: str | None = None) -> None:
    """Refuse a checkpoint.dir that some learner rank's node does not share with this (the trainer's) one: each rank
    writes its shard of a checkpoint there and the trainer its state, so a node-local path gives checkpoints that no
    one can load. A marker written here must be visible from every node that runs a learner rank (`sees(node_id,
    path)`, default: a zero-CPU Ray task on that node)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = sorted({r["node_id"] for g in groups for r in await g.state() if r.get("node_id")})
    here = here or ray.get_runtime_context().get_node_id()
    if not [n for n in nodes if n != here]:
        return
    root = Path(directory).absolute()
    root.mkdir(parents=True, exist_ok=True)
    marker = root / f".asyncrl-shared-{uuid.uuid4().hex}"
    marker.write_text(here)
    try:
        if sees is None:
            task = ray.remote(num_cpus=0)(_sees)

            async def sees(node: str, path: str) -> bool:
                return await task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(path)
        blind = [n for n in nodes if n != here and not await sees(n, str(marker))]
    finally:
        marker.unlink(missing_ok=True)
    if blind:
        raise RuntimeError(f"checkpoint.dir {root} is not shared: learner node(s) {', '.join(b[:12] for b in blind)} do not "
                           f"see a file the trainer's node wrote there; checkpoints would be split between nodes. Set "
                           "checkpoint.dir to storage every learner node mounts (or checkpoint.interval_steps: 0)")


def distinct(*groups: Any, but: Any = None) -> list[Any]:
    """The learner groups given, each once, without None (a LoRA actor is also the reference) nor `but`."""
    out: list[Any] = []
    for g in groups:
        if g is not None and g is not but and all(g is not o for o in out):
            out.append(g)
    return out


async def _start_learners(cfg: RootConfig, engine: Any) -> tuple[Any, Any, Any, Any]:
    """The run's learner groups (actor; reference and critic where the algorithm needs them),
    started, and their placement beside the engines."""
    from asyncrl.generator.control import EngineControl
    from asyncrl.learner.group import LearnerGroup

    actor = LearnerGroup("actor", cfg.model, cfg.learner, cfg.algorithm, cfg.profiler)
    # A LoRA actor's frozen base is the reference: the actor group answers compute_ref_log_prob with its adapters off
    reference = (None if not needs_reference(cfg.algorithm) else actor if cfg.learner.lora is not None
                 else LearnerGroup("reference", cfg.model, cfg.learner, cfg.algorithm))
    critic = LearnerGroup("critic", cfg.model, cfg.learner, cfg.algorithm) if cfg.algorithm.name == "ppo" else None
    await asyncio.gather(*(g.start() for g in distinct(actor, reference, critic)))
    placement = build_placement(cfg.hybrid, EngineControl(engine), actor, distinct(reference, critic, but=actor),
                                engine_memory_fraction=float(cfg.generator.engine_kwargs.get("gpu_memory_utilization", 0.9)))
    with waiting_for(engine_demand(cfg), ENGINES_STARTING):  # hybrid: the engines' first answer
        await placement.start()
    return actor, reference, critic, placement


def longest_prompt(tokenizer: Any, prompts: list[Prompt], sample: int = 256) -> int:
    """The longest of the first `sample` prompts, rendered and tokenized as rollouts send them."""
    return max((len(tokenizer(render_prompt(tokenizer, p), add_special_tokens=False)["input_ids"]) for p in prompts[:sample]),
               default=1)


def warm_up_samples(cfg: RootConfig, dp: int, prompt_tokens: int | None = None) -> list[Sample]:
    """`dp` x `learner.micro_batch_size` samples of the longest sequence the run should meet: a prompt
    of `prompt_tokens` (the data's longest, `longest_prompt`; at most model.max_model_len -
    algorithm.max_new_tokens, at least 1) and a completion of max_new_tokens, each its own group so
    that every DP shard gets a full micro-batch."""
    response = cfg.algorithm.max_new_tokens
    room = cfg.model.max_model_len - response
    prompt = max(1, room if prompt_tokens is None else min(prompt_tokens, room))
    ids = [1 + (i * 7) % 97 for i in range(prompt + response)]  # any ids below every vocab
    return [Sample(prompt_ids=ids[:prompt], response_ids=ids[prompt:], behavior_logprobs=[-1.0] * response,
                   versions=[0] * response, reward=0.0, group_id=g)
            for g in range(dp * cfg.learner.micro_batch_size)]


async def warm_up_learners(cfg: RootConfig, groups: list[Any | None], placement: Any,
                           prompt_tokens: int | None = None, weights: Any = None) -> None:
    """Each trainable group's warm-up (`LearnerGroup.warm_up`), before the first step, where learner.warm_up asks for
    it. Only once the engines are up: an engine that shares the learner's GPU sizes its KV cache from the memory free
    while it starts, and the warm-up's activations would take some of it. Hybrid: inside `placement.warm_up`, the
    engines asleep and the learner's state on its devices, as in a step; then `weights` (the WeightPublisher) forms
    its groups in the switch's memory, so the first push does not (the separated placement's start formed them)."""
    if not cfg.learner.warm_up:
        return
    if cfg.hybrid.enabled and cfg.generator.engine == "sglang" and not cfg.generator.engine_kwargs.get("enable_weights_cpu_backup"):
        # the warm-up's switch sleeps the engines keeping their weights (level 1), which SGLang does only with a backup
        log.info("learner warm-up skipped: hybrid SGLang engines keep no weights asleep without "
                 "generator.engine_kwargs.enable_weights_cpu_backup; the first step pays it")
        return

    async def run() -> None:
        for g in (g for g in groups if g is not None):
            m = await g.warm_up(warm_up_samples(cfg, g.layout.dp, prompt_tokens))
            log.info("learner %s warmed up in %.1f s (%d tokens a micro-batch%s)", g.role, m.get("learner/warm_up_s", 0.0),
                     int(m.get("learner/warm_up_tokens", 0)),
                     ", optimizer state made" if m.get("learner/warm_up_optimizer") else "")

    async def prepare_push() -> None:
        try:
            await weights.form_groups()
        except Exception as err:  # noqa: BLE001 - the first push forms them then
            log.warning("weightsync: groups not formed at start (%s); the first push forms them", err)

    await placement.warm_up(run, None if weights is None or not cfg.hybrid.enabled else prepare_push)


def _beside_this_process() -> dict[str, Any]:
    """The buffer (no resources of its own) goes on the trainer's node, as weightsync's store and
    registry do, rather than on whichever node Ray picks (maybe an engine or learner node that can
    be lost). Hard affinity: Ray's soft affinity placed a zero-resource actor elsewhere about half
    the time; the node is the trainer's own, alive as long as the trainer is."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)}


@dataclass
class TrainerParts:
    """The started components of a run. `TrainerParts.create` starts them; `close` stops them."""

    cfg: RootConfig
    engine: Any  # DeploymentHandle of the engine deployment
    tokenizer: Any
    buffer: Any  # BufferActor handle
    rewards: Any  # RewardPool, or RemoteRewardPool on reward.pool's nodes
    actor: Any  # LearnerGroup("actor")
    reference: Any | None
    critic: Any | None
    weights: Any  # WeightPublisher (asyncrl.weightsync.service)
    placement: Any  # Separated | Colocation (asyncrl.trainer.placement)
    tracker: MetricsTracker
    stream: PromptStream
    eval_prompts: list[Prompt]
    rollouts: RolloutWorkers = field(init=False)
    eval_scorer: Any = field(init=False)
    start_version: int = 0
    prompt_tokens: int | None = None  # the data's longest prompt (of the first ones): the learners' warm-up shape

    def __post_init__(self) -> None:
        # Held-out evaluation: reward.eval_function (a rule, e.g. exact answers while a reward
        # model trains) in a pool of its own, else the training reward.
        self.eval_scorer = self.rewards
        if self.cfg.reward.eval_function:
            from asyncrl.rewards.pool import RewardPool

            self.eval_scorer = RewardPool(self.cfg.reward.model_copy(update={"kind": "rule", "function": self.cfg.reward.eval_function}))
        common = dict(
            stream=self.stream,
            tokenizer=self.tokenizer,
            generate=self.generate,
            rewards=self.rewards,
            buffer=self.buffer,
            algorithm=self.cfg.algorithm,
            concurrency=self.cfg.trainer.rollout_concurrency,
            seed=self.cfg.trainer.seed,
            seeded=self.cfg.generator.honours_seeds,
            attempts=self.cfg.trainer.rollout_attempts,
            timeout_s=self.cfg.trainer.rollout_timeout_s,
        )
        rollout = self.cfg.rollout
        if rollout.kind == "agent":
            from asyncrl.trainer.agent import AgentRollouts

            base_url = rollout.base_url or f"http://127.0.0.1:{self.cfg.generator.http_port}"
            self.rollouts = AgentRollouts(rollout=rollout, base_url=base_url, scored=self.cfg.reward.kind != "rule", **common)
        else:
            self.rollouts = RolloutWorkers(**common)

    @classmethod
    async def create(cls, cfg: RootConfig, engine: Any) -> "TrainerParts":
        from transformers import AutoTokenizer

        from asyncrl.buffer.actor import BufferActor
        from asyncrl.generator.control import EngineControl
        from asyncrl.rewards.remote import reward_pool
        from asyncrl.weightsync.service import WeightPublisher

        random.seed(cfg.trainer.seed)
        torch.manual_seed(cfg.trainer.seed)
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        train, held_out = load_prompts(cfg.data)
        buffer = BufferActor.options(**_beside_this_process()).remote(cfg.buffer)
        prompt_tokens = longest_prompt(tokenizer, train) if cfg.learner.warm_up else None
        # Hybrid: the learner's state goes to host before the first export (which holds the params itself).
        if cfg.reward.kind == "model":
            from asyncrl.rewards.model import ModelRewards

            rewards = ModelRewards(cfg.reward, cfg.model, cfg.learner, cfg.algorithm)
            (actor, reference, critic, placement), _ = await asyncio.gather(_start_learners(cfg, engine), rewards.start())
        else:
            rewards = reward_pool(cfg.reward)
            actor, reference, critic, placement = await _start_learners(cfg, engine)
        weights = WeightPublisher(cfg.weightsync, engine=EngineControl(engine), learner=actor, hybrid=cfg.hybrid.enabled,
                                  on_gpu=cfg.learner.num_gpus_per_rank > 0,
                                  own_gpus=cfg.learner.num_gpus_per_rank >= 1 and cfg.generator.num_gpus >= 1)
        if cfg.checkpoint.interval_steps or cfg.checkpoint.resume:
            await check_shared_checkpoint_dir(cfg.checkpoint.dir, distinct(actor, critic))
        with waiting_for(engine_demand(cfg), ENGINES_STARTING):
            await weights.start(initial_version=0)  # once the engine replicas are ready
        await warm_up_learners(cfg, [actor, critic], placement, prompt_tokens, weights)
        _write_run_record(cfg)
        tracker = MetricsTracker(cfg.logging.dir, tensorboard=cfg.logging.tensorboard, jsonl=cfg.logging.jsonl,
                                 plot_interval_steps=cfg.logging.plot_interval_steps, wandb=cfg.logging.wandb,
                                 config=cfg.model_dump(mode="json"))
        parts = cls(cfg, engine, tokenizer, buffer, rewards, actor, reference, critic, weights, placement, tracker,
                    PromptStream(train, cfg.trainer.seed), held_out, prompt_tokens=prompt_tokens)
        if cfg.checkpoint.resume and cfg.checkpoint.interval_steps:
            await parts.restore_latest()
        if cfg.trainer.warm_up_rollouts:
            await parts.warm_up_rollouts()
        return parts

    async def warm_up_rollouts(self) -> None:
        """`RolloutWorkers.warm_up` on the first training prompt, one request per engine replica (each replica's
        first request pays for paths vLLM's own start leaves cold), every rule worker started. Agent rollouts
        (their own HTTP path) are left alone; a failure is logged, not raised: the first
        step then pays it, as without the warm-up."""
        from asyncrl.generator.control import EngineControl
        from asyncrl.trainer.agent import AgentRollouts

        if isinstance(self.rollouts, AgentRollouts):
            return
        try:
            replicas = len(await EngineControl(self.engine).stats()) or 1
            workers = self.cfg.reward.num_workers if self.cfg.reward.kind == "rule" else 1
            m = await asyncio.wait_for(self.rollouts.warm_up(self.stream.peek(), replicas, score_at_least=workers),
                                       WARM_UP_TIMEOUT_S)
            log.info("rollouts warmed up: %d request(s) in %.2f s, %d completion(s) scored in %.2f s",
                     replicas, m["generate_s"], int(m["completions"]), m["score_s"])
        except Exception as err:  # noqa: BLE001 - an optimisation: the first step pays it instead
            log.warning("rollout warm-up failed (%s: %s); the first step pays the engines' first requests",
                        type(err).__name__, err)

    # ---- engine-facing adapters ----------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await self.engine.generate.remote(request)

    async def evaluate(self, stopping: Callable[[], bool] | None = None) -> float:
        """Greedy accuracy on the held-out prompts, through the live engines (agent rollouts: the
        agent's mean reward over greedy episodes). `stopping`: as `generate_with_retry`'s."""
        if not self.eval_prompts:
            return float("nan")
        from asyncrl.trainer.agent import AgentRollouts

        if isinstance(self.rollouts, AgentRollouts):
            return await self.rollouts.evaluate(self.eval_prompts, scorer=self.eval_scorer)
        sem = asyncio.Semaphore(32)

        async def one(p: Prompt) -> float:
            ids = self.tokenizer(render_prompt(self.tokenizer, p), add_special_tokens=False)["input_ids"]
            req = GenerationRequest(prompt_ids=ids,
                                    sampling=SamplingParams(n=1, temperature=0.0, max_tokens=self.cfg.algorithm.max_new_tokens, logprobs=False))
            async with sem:  # (a replica being replaced is waited out, a failed call retried as a rollout's)
                result = await generate_with_retry(self.generate, req, attempts=self.cfg.trainer.rollout_attempts,
                                                   counters=RolloutCounters(), timeout_s=self.cfg.trainer.rollout_timeout_s,
                                                   stopping=stopping)
            c = result.completions[0]
            outcome = (await self.eval_scorer.score([c.text], [p.answer], [p.metadata],
                                                    token_ids=[(result.prompt_ids, list(c.token_ids))]))[0]
            return outcome.reward or 0.0

        scores = await asyncio.gather(*(one(p) for p in self.eval_prompts))
        return sum(scores) / len(scores)

    async def publish(self, version: int) -> dict[str, float]:
        return await self.weights.publish(version)

    def reward_metrics(self) -> dict[str, float]:
        """The scorer's `reward/*` counters (a judge's, a reward model's, the rule pool's); of rule workers on
        another node, the calls retried after their actor was lost (their own counters stay in it)."""
        metrics = getattr(self.rewards, "metrics", None)
        return dict(metrics()) if callable(metrics) else {}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.tracker.log(step, metrics)

    # ---- checkpoints -----------------------------------------------------------------------
    def _ckpt_dir(self, version: int) -> Path:
        return Path(self.cfg.checkpoint.dir) / f"step_{version:06d}"

    async def save_checkpoint(self, version: int) -> Path:
        """Learner (model, optimizer, scheduler, RNG) + buffer + data position, written atomically."""
        final = self._ckpt_dir(version)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            await self.actor.save_checkpoint(str(tmp / "actor"))
            if self.critic:
                await self.critic.save_checkpoint(str(tmp / "critic"))
            # No rollout in flight while buffer and prompt position are read: every prompt taken
            # from the stream is either in the saved buffer (or trained) or not taken yet.
            await self.rollouts.quiesce()
            try:
                buffer_state = await self.buffer.state_dict.remote()
                # model_path: the config and tokenizer files `asyncrl export` writes beside the weights.
                state = {"version": version, "stream": self.stream.state_dict(), "model_path": str(Path(self.cfg.model.path).absolute())}
            finally:
                self.rollouts.unquiesce()
            torch.save(buffer_state, tmp / "buffer.pt")
            (tmp / CHECKPOINT_STATE).write_text(json.dumps(state))  # written last: marks the directory complete
        except BaseException:  # (a learner rank lost mid-save): nothing half written stays behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        # A checkpoint of the same version is moved aside, not deleted, until the new one is in
        # place: a kill at any point leaves the previous complete checkpoints loadable.
        aside = final.with_name(final.name + ".old")
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
        self._prune()
        return final

    def _prune(self) -> None:
        """Beyond `checkpoint.keep` complete checkpoints, the oldest go; so does any `step_N.tmp` (one save runs at a
        time: another's is what a run killed while saving left)."""
        root = Path(self.cfg.checkpoint.dir)
        done = sorted(p for p in root.glob("step_*") if "." not in p.name)
        for old in done[: -self.cfg.checkpoint.keep] + list(root.glob("step_*.tmp")):
            shutil.rmtree(old, ignore_errors=True)

    async def restore_latest(self) -> int | None:
        root = Path(self.cfg.checkpoint.dir)
        done = complete_checkpoints(root)
        if not done:
            return None
        path = done[-1]
        state = await self._load_learner_state(path)
        await self.buffer.load_state_dict.remote(torch.load(path / "buffer.pt", weights_only=False), drop_running=True)
        self.stream.load_state_dict(state["stream"])
        self.start_version = state["version"]
        await self.buffer.set_version.remote(self.start_version)
        await self.weights.publish(self.start_version)
        log.info("resumed from %s at version %d", path, self.start_version)
        return self.start_version

    async def restart_learners(self, version: int) -> int | None:
        """Start the learner groups again after a rank failed, with the learner state of the last
        complete checkpoint; the buffer, the prompt stream and the engines (serving `version`)
        keep theirs. Returns that checkpoint's version, or None before the first publication (the
        engines serve the initial weights, which the new groups load)."""
        cfg = self.cfg
        if cfg.hybrid.enabled:
            raise RuntimeError("trainer.max_restarts: restarting the learner is not supported with hybrid placement "
                               "(the engines and the learner share its devices)")
        done = complete_checkpoints(Path(cfg.checkpoint.dir)) if cfg.checkpoint.interval_steps else []
        if not done and version > 0:
            raise RuntimeError(f"trainer.max_restarts: no complete checkpoint under {cfg.checkpoint.dir} to restart the "
                               f"learner from (the engines serve version {version}); set checkpoint.interval_steps")
        for g in distinct(self.actor, self.reference, self.critic):
            with contextlib.suppress(Exception):  # its ranks may be dead already
                await g.shutdown()
        self.actor, self.reference, self.critic, self.placement = await _start_learners(cfg, self.engine)
        await warm_up_learners(cfg, [self.actor, self.critic], self.placement, self.prompt_tokens)
        restored = int((await self._load_learner_state(done[-1]))["version"]) if done else None
        await self.weights.rebind_learner(self.actor)
        return restored

    async def _load_learner_state(self, path: Path) -> dict[str, Any]:
        """Load checkpoint `path`'s trainable roles into the learner groups; returns its trainer state."""
        await self.actor.load_checkpoint(str(path / "actor"))
        if self.critic:
            await self.critic.load_checkpoint(str(path / "critic"))
        return json.loads((path / CHECKPOINT_STATE).read_text())

    async def close(self) -> None:
        with contextlib.suppress(Exception):  # the last version's host copy: its keeper reads learner memory
            await self.weights.drain()
        await self.buffer.close.remote()
        aclose = getattr(self.rewards, "aclose", None)
        if aclose is not None:
            await aclose()  # a reward model's group: its ranks go before the trainer does
        else:
            self.rewards.close()
        if self.eval_scorer is not self.rewards:
            self.eval_scorer.close()
        for g in distinct(self.actor, self.reference, self.critic):
            await g.shutdown()
        self.tracker.close()
