"""The sections of what a run trains on and how it is driven: data, rewards (rule, judge, reward
model), rollouts (single-turn or agent) and the trainer loop's own knobs.

Owns: each section's schema and validation.

Must never: import a component (loading a rule, an agent function or a reward model happens in
`asyncrl.trainer.checks` when the full app is built).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.config.base import ResourcePool, _need_package, _Section
from asyncrl.config.components import LearnerConfig


class DataColumns(_Section):
    """Which fields of a row hold the prompt, the answer and the metadata (kinds jsonl, parquet, hf_dataset).
    A name may be a dotted path into nested objects, e.g. verl's `reward_model.ground_truth`."""

    prompt: str = Field("prompt", min_length=1, description="A non-empty string, or a list of chat messages "
                        "({role, content}, as verl and TRL datasets keep them), rendered with the chat template.")
    answer: str = Field("answer", min_length=1, description="The reference answer the reward compares against (string or number).")
    metadata: str | list[str] | None = Field(
        None, description="A field holding an object, or a list of fields copied by name; None = the `metadata` "
        "field where there is one. Handed to the reward function as strings.")

    @field_validator("metadata")
    @classmethod
    def _names(cls, value: str | list[str] | None) -> str | list[str] | None:
        if value is not None and (value == "" or (isinstance(value, list) and (not value or not all(value)))):
            raise ValueError(f"{value!r}: give a field name, a non-empty list of names, or leave it unset")
        return value


class DataConfig(_Section):
    """Where prompts come from: the embedded arithmetic task, or a user's JSONL file, parquet file
    or local Hugging Face dataset."""

    kind: Literal["arithmetic", "jsonl", "parquet", "hf_dataset"] = Field(
        "arithmetic", description="jsonl: one JSON object per line; parquet: a .parquet file or a folder of them (needs "
        "pyarrow); hf_dataset: a local `datasets` dataset (save_to_disk folder, folder of data files, or one "
        ".parquet/.json/.jsonl/.csv/.arrow file; needs datasets). parquet and hf_dataset: `pip install 'asyncrl[data]'`.")
    path: str | None = Field(None, description="The training prompts (kinds jsonl, parquet, hf_dataset).")
    eval_path: str | None = Field(None, description="Held-out prompts of the same kind (default: none, or data.eval_split).")
    split: str = Field("train", min_length=1, description="hf_dataset: the split to train on.")
    eval_split: str | None = Field(None, min_length=1, description="hf_dataset: a split of `path` to evaluate on (instead of eval_path).")
    columns: DataColumns = Field(default_factory=DataColumns)
    seed: int = 0
    digits: int = Field(2, ge=1, le=6)
    operators: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+"])
    train_size: int = Field(20000, gt=0)
    eval_size: int = Field(200, gt=0)

    @model_validator(mode="after")
    def _paths(self) -> "DataConfig":
        if self.kind != "arithmetic" and not self.path:
            raise ValueError(f"kind={self.kind!r} needs `path`")
        if self.eval_split is not None and self.kind != "hf_dataset":
            raise ValueError(f"eval_split={self.eval_split!r} is for kind='hf_dataset'; kind={self.kind!r} takes eval_path")
        if self.eval_split is not None and self.eval_path is not None:
            raise ValueError("give eval_path or eval_split, not both")
        if self.split != "train" and self.kind != "hf_dataset":
            raise ValueError(f"split={self.split!r} is for kind='hf_dataset'")
        if self.kind in ("parquet", "hf_dataset"):
            try:
                _need_package("pyarrow" if self.kind == "parquet" else "datasets", "data")
            except ValueError as err:
                raise ValueError(f"kind={self.kind!r} {err}") from None
        if not self.operators:
            raise ValueError("operators must not be empty")
        return self


class JudgeConfig(_Section):
    """reward.kind http: an OpenAI-compatible chat endpoint scores each completion (asyncrl/rewards/judge.py)."""

    url: str = Field("", description="Base URL of the judge's OpenAI API, e.g. http://host:8000/v1 (POST {url}/chat/completions).")
    model: str | None = Field(None, description="The judge's model name; None = the first of GET {url}/models.")
    prompt_template: str = Field(
        "Question answer: {answer}\nCandidate answer: {completion}\nScore the candidate from 0 to 10. Score:",
        description="The user message sent to the judge; {completion} and {answer} are filled in (and {metadata[KEY]}).")
    score_pattern: str = Field(r"-?\d+(?:\.\d+)?", description="Regular expression; the last match in the judge's reply "
                               "(its first group if it has one) is the score.")
    scale: float = Field(1.0, gt=0, description="reward = score / scale (e.g. 10 for a 0-10 judge).")
    mode: Literal["score", "agree"] = Field(
        "score", description="score: the reward is the judge's score (above) / scale. agree: the judge answers the problem "
        "itself (prompt_template asks it, e.g. with {metadata[question]}) and the reward is 1 where the last match of "
        "score_pattern in its reply equals the last match in the completion (as numbers where both are), else 0; a "
        "completion without a match scores 0. Reference-free: a stronger model's answer stands in for the label.")
    max_tokens: int = Field(16, gt=0)
    temperature: float = Field(0.0, ge=0)
    timeout_s: float = Field(30.0, gt=0, description="Per judge call; past it the call counts as a timeout (and is retried).")
    retries: int = Field(2, ge=0, description="Extra attempts after a timeout, a connection error or a 5xx / 429.")
    concurrency: int = Field(16, gt=0, description="Judge calls in flight at once.")
    api_key: str | None = Field(None, description="Bearer token for the judge; None = $ASYNCRL_JUDGE_API_KEY if set.")

    @field_validator("score_pattern")
    @classmethod
    def _pattern_compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as err:
            raise ValueError(f"score_pattern={value!r} is not a regular expression: {err}") from None
        return value


class RewardModelConfig(_Section):
    """reward.kind model: a reward model (an HF *ForSequenceClassification with one label, e.g. from `asyncrl
    demo-reward-model`) scores each sequence at its last token, in its own Megatron learner group of the
    reward_model role (asyncrl/rewards/model.py). It reads the policy's token ids as they are, so it must share the
    policy's tokenizer (checked when the app is built)."""

    path: str = Field("", description="HF directory of the reward model (config.json, safetensors with score.weight).")
    world_size: int = Field(1, gt=0, description="Reward-model ranks (one Ray actor each).")
    strategy_config: dict[str, Any] = Field(default_factory=dict, description="Megatron options of its group "
                                            "(tensor_model_parallel_size, ...), as learner.strategy_config.")
    num_cpus_per_rank: float = Field(0.5, ge=0)
    num_gpus_per_rank: float | None = Field(None, ge=0, description="None = learner.num_gpus_per_rank.")
    pool: ResourcePool = Field(default_factory=ResourcePool, description="Nodes that may run its ranks.")
    batch_size: int = Field(64, gt=0, description="Most samples in one scoring pass: completions of concurrent "
                            "rollouts that wait together are scored together.")
    max_wait_s: float = Field(0.05, ge=0, description="How long a waiting completion may wait for others to fill a pass.")
    timeout_s: float = Field(300.0, gt=0, description="Per scoring pass; past it the group counts as failed.")
    max_restarts: int = Field(2, ge=0, description="Restarts of the group after its ranks fail (a pass's completions are "
                              "INVALID_REWARD and their groups dropped); past it every score is invalid, with the reason.")
    sigmoid: bool = Field(False, description="reward = sigmoid(score) instead of the raw score (logit).")

    def gpus_per_rank(self, learner: "LearnerConfig") -> float:
        return learner.num_gpus_per_rank if self.num_gpus_per_rank is None else self.num_gpus_per_rank


class RewardConfig(_Section):
    kind: Literal["rule", "http", "model"] = Field(
        "rule", description="rule = `function` in worker processes; http = `judge`, an OpenAI-compatible model that "
        "scores each completion; model = `model`, a reward model on a Megatron group of its own.")
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    function: str = Field("asyncrl.rewards.math:exact_integer_reward", description="Import path 'module:function' of the rule reward.")
    eval_function: str | None = Field(
        None, description="'module:function' of a rule reward that scores the held-out evaluation instead of the training "
        "reward (e.g. exact answers while a reward model or a judge trains); None = the training reward.")
    timeout_s: float = Field(5.0, gt=0)
    num_workers: int = Field(1, gt=0)
    pool: ResourcePool = Field(
        default_factory=ResourcePool, description="Nodes that may run the reward workers. Set: the worker processes run "
        "under one Ray actor on such a node; empty: beside the trainer, in its replica's process tree.")
    num_cpus: float = Field(0.1, ge=0, description="Ray CPUs of that reward actor (reward.pool set).")
    max_restarts: int = Field(3, ge=0, description="Times that reward actor (reward.pool set) is started again on "
                              "another node of the pool when its own is lost; a call it was scoring is retried there "
                              "(reward/worker_retries counts them). 0: the first loss fails the rollouts it scored.")

    @model_validator(mode="after")
    def _judge_named(self) -> "RewardConfig":
        if self.kind == "http":
            if not self.judge.url.startswith(("http://", "https://")):
                raise ValueError(f"kind='http' needs judge.url, the judge's OpenAI base URL (http://host:port/v1); got {self.judge.url!r}")
            if self.pool.is_set():
                raise ValueError("kind='http' calls the judge from the trainer; reward.pool places rule workers only")
        if self.kind == "model":
            if not self.model.path:
                raise ValueError("kind='model' needs model.path, the reward model's HF directory")
            if self.pool.is_set():
                raise ValueError("kind='model' places the reward model by model.pool; reward.pool places rule workers only")
        return self


class RolloutConfig(_Section):
    """How a prompt becomes samples: one engine call per group (single_turn, the GRPO default), or an agent
    function that talks to the live OpenAI API over episodes (asyncrl/trainer/agent.py)."""

    kind: Literal["single_turn", "agent"] = "single_turn"
    function: str | None = Field(
        None, description="kind agent: 'module:function', an async function (prompt: Prompt, client: openai.AsyncOpenAI) "
        "-> reward; the client is bound to a fresh episode whose turns sample at algorithm.temperature (the default of a "
        "chat call that names none; another temperature gets 400).")
    base_url: str | None = Field(
        None, description="Where the agent's client reaches the gateway; None = http://127.0.0.1:<generator.http_port> "
        "(the trainer on the node of Serve's proxy).")
    episode_timeout_s: float = Field(300.0, gt=0, description="Longest one agent episode may run; past it the episode "
                                     "counts as failed (its group is dropped).")

    @model_validator(mode="after")
    def _function_set(self) -> "RolloutConfig":
        if self.kind == "agent" and not self.function:
            raise ValueError("kind='agent' needs function: 'module:function' (an async function of a prompt and an "
                             "openai.AsyncOpenAI client that returns the reward)")
        if self.function is not None and (self.function.count(":") != 1 or not all(self.function.split(":"))):
            raise ValueError(f"function={self.function!r} must look like 'package.module:function'")
        return self


class TrainerConfig(_Section):
    total_steps: int = Field(100, gt=0)
    rollout_concurrency: int = Field(8, gt=0, description="Prompts in flight at once.")
    rollout_timeout_s: float = Field(
        600.0, gt=0, description="Longest one generation attempt of a prompt group may take; it is then aborted in the "
        "engine and counts as a failed attempt.")
    rollout_attempts: int = Field(
        3, gt=0, description="Attempts per prompt group (failures and timeouts); a group that fails every one is given up "
        "on and counted (buffer/dropped_failed), never retried again.")
    batch_timeout_s: float = Field(
        1800.0, gt=0, description="Longest the learner waits for one batch; past it training stops with an error that "
        "says what the buffer and the rollouts hold (a batch that cannot fill never hangs the run).")
    eval_interval_steps: int = Field(10, ge=0)
    warm_up_rollouts: bool = Field(
        True, description="Before the first step: one short generation of the first prompt per engine replica with the "
        "rollouts' sampling settings (16 tokens at most), its completions scored and then thrown away, so the first "
        "step does not pay the engines' first requests and the reward workers' start.")
    max_restarts: int = Field(
        0, ge=0, description="A learner rank that dies (or hangs past its call timeout) fails the step; up to this many "
        "times per run the learner groups are started again from the last complete checkpoint and the step is redone "
        "on the same batch (the engines keep serving the live version meanwhile). 0: the run fails, naming the rank.")
    seed: int = 0
    pool: ResourcePool = Field(default_factory=ResourcePool, description="Nodes that may run the trainer replica (the training loop; "
                               "the buffer runs on its node too, and, without reward.pool, the reward workers).")
