"""verl's side of the peer benchmark (benchmarks/peers/verl_grpo.py) on CPU, without verl: the script's arguments
(help, a bad value refused with exit 2 and its name), the hydra overrides it builds from the shared knobs, the
parquet rows it hands verl (the same prompts and answers as TRL's side), its reward, the StepTime of each step
from verl's own metric names, and the wheel script's syntax. Running verl needs the GPU host:
`PEERS_RUNS=verl bash benchmarks/gpu_session.sh peers`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import import_benchmark

REPO = Path(__file__).resolve().parents[2]
PEERS = REPO / "benchmarks" / "peers"


def _verl_grpo():
    return import_benchmark("verl_grpo", "peers")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PEERS / "verl_grpo.py"), *args], check=False, capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def _model(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "hidden_size": 8, "num_hidden_layers": 1, "vocab_size": 10, "num_attention_heads": 2,
        "num_key_value_heads": 1, "intermediate_size": 16, "tie_word_embeddings": True, "max_position_embeddings": 4096}))
    return tmp_path


def test_help_exits_zero_without_verl():
    done = _run("--help")
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout and "--mode" in done.stdout


@pytest.mark.parametrize(("args", "named"), [
    (["--mode", "one_step_off"], "--mode"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization=1.5"),
    (["--group-size", "1"], "--group-size=1"),
    (["--prompts-per-step", "3", "--group-size", "4", "--micro-batch-size", "5"], "--micro-batch-size=5"),
])
def test_bad_argument_exits_two_naming_it(args, named):
    done = _run(*args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert named in done.stderr and "error:" in done.stderr


def test_knobs_become_verl_overrides(tmp_path):
    verl_grpo = _verl_grpo()
    a = verl_grpo.parse_args(["--model", str(_model(tmp_path)), "--prompts-per-step", "4", "--group-size", "6",
                              "--max-new-tokens", "32", "--lr", "3e-6", "--micro-batch-size", "8", "--seed", "5",
                              "--set", "actor_rollout_ref.rollout.enforce_eager=true"])
    ov = verl_grpo.verl_overrides(a, tmp_path / "t.parquet", tmp_path / "v.parquet", tmp_path)
    kv = dict(o.split("=", 1) for o in ov)
    assert len(kv) == len(ov)  # no key given twice
    actor, rollout = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    assert kv["algorithm.adv_estimator"] == "grpo" and kv["trainer.v1.trainer_mode"] == "sync"
    assert (kv["data.train_batch_size"], kv[f"{actor}.ppo_mini_batch_size"], kv[f"{rollout}.n"]) == ("4", "4", "6")
    assert kv[f"{actor}.ppo_micro_batch_size_per_gpu"] == kv[f"{rollout}.log_prob_micro_batch_size_per_gpu"] == "8"
    assert (kv["data.max_response_length"], kv["data.max_prompt_length"], kv[f"{rollout}.max_model_len"]) == ("32", "128", "160")
    assert kv[f"{rollout}.ignore_eos"] == "true" and kv[f"{rollout}.tensor_model_parallel_size"] == "1"
    assert (kv[f"{actor}.use_kl_loss"], kv["algorithm.use_kl_in_reward"], kv[f"{actor}.loss_agg_mode"]) == ("false", "false", "token-mean")
    assert (kv[f"{actor}.optim.lr"], kv[f"{actor}.optim.weight_decay"], kv[f"{actor}.optim.lr_warmup_steps"]) == ("3e-06", "0.0", "0")
    assert kv[f"{actor}.clip_ratio"] == "0.2" and kv[f"{actor}.grad_clip"] == "1.0" and kv[f"{actor}.ppo_epochs"] == "1"
    assert kv["actor_rollout_ref.model.use_remove_padding"] == "false"
    assert kv["actor_rollout_ref.model.enable_gradient_checkpointing"] == "false"
    assert kv["+actor_rollout_ref.model.override_config.attn_implementation"] == "sdpa"
    assert kv[f"{actor}.fsdp_config.dtype"] == "bfloat16" and kv[f"{actor}.fsdp_config.model_dtype"] == "fp32"
    assert kv["reward.custom_reward_function.path"] == str(PEERS / "verl_grpo.py")
    assert kv["reward.custom_reward_function.name"] == "compute_score"
    assert kv["trainer.n_gpus_per_node"] == "1" and kv["trainer.total_training_steps"] == "11"  # 3 warm-up + 8
    assert kv["trainer.logger"] == "[console,file]" and kv["trainer.test_freq"] == "-1"
    assert kv["data.shuffle"] == "false" and kv["data.seed"] == "5" and kv["actor_rollout_ref.model.path"] == str(tmp_path)
    assert ov[-1] == "actor_rollout_ref.rollout.enforce_eager=true"  # --set comes last: it wins
    b = verl_grpo.parse_args(["--model", str(tmp_path), "--no-fixed-length", "--mode", "colocate_async", "--eval-every", "5"])
    kv = dict(o.split("=", 1) for o in verl_grpo.verl_overrides(b, tmp_path / "t", tmp_path / "v", tmp_path))
    assert kv[f"{rollout}.ignore_eos"] == "false" and kv["trainer.v1.trainer_mode"] == "colocate_async"
    assert kv["trainer.test_freq"] == "5" and kv["trainer.val_before_train"] == "true"
    assert kv[f"{actor}.ppo_micro_batch_size_per_gpu"] == "64"  # 0 = the whole batch of 8 x 8


def test_parquet_rows_are_trls_prompts_and_answers(tmp_path):
    import pandas as pd

    verl_grpo = _verl_grpo()
    trl_grpo = import_benchmark("trl_grpo", "peers")
    a = verl_grpo.parse_args(["--model", str(tmp_path), "--prompts-per-step", "2", "--warmup-steps", "1", "--steps", "2",
                              "--seed", "3"])
    train_path, val_path = verl_grpo.write_datasets(a, tmp_path)
    train = pd.read_parquet(train_path).to_dict("records")
    theirs, held_out = trl_grpo.build_prompts(a, len(train))
    assert len(train) == (1 + 2 + 2) * 2  # every step's prompts and the batch colocate_async generates ahead
    assert [list(r["prompt"]) for r in train] == [[{"role": "user", "content": p.prompt}] for p in theirs]
    assert [r["reward_model"]["ground_truth"] for r in train] == [p.answer for p in theirs]
    assert {r["data_source"] for r in train} == {verl_grpo.DATA_SOURCE}
    assert [r["extra_info"]["index"] for r in train] == list(range(len(train)))
    val = pd.read_parquet(val_path)
    assert list(val["reward_model"].map(lambda m: m["ground_truth"])) == [p.answer for p in held_out]
    other = trl_grpo.build_prompts(verl_grpo.parse_args(["--model", str(tmp_path), "--seed", "4"]), len(train))[0]
    assert [p.prompt for p in other] != [p.prompt for p in theirs]  # the seed does pick the order


def test_compute_score_is_exact_integer_reward():
    verl_grpo = _verl_grpo()
    assert verl_grpo.compute_score("arithmetic", "The answer is 42", "42") == 1.0
    assert verl_grpo.compute_score("arithmetic", "41", "42", extra_info={"index": 0}) == 0.0


def test_verl_metrics_become_step_times_and_evaluations(tmp_path):
    verl_grpo = _verl_grpo()
    a = verl_grpo.parse_args(["--model", str(tmp_path), "--prompts-per-step", "2", "--group-size", "4", "--warmup-steps", "1",
                              "--steps", "2"])
    # verl's FileLogger lines: the step-0 validation alone, then one line per training step (validation merged in)
    lines = [{"step": 0, "data": {"val-core/arithmetic/acc/mean@1": 0.25}}]
    for step, (wall, gen, old, upd, sync, length) in enumerate([(9.0, 5.0, 1.0, 2.0, 0.5, 30.0), (4.0, 2.0, 0.5, 1.0, 0.25, 32.0),
                                                                  (5.0, 2.5, 0.5, 1.5, 0.25, 31.5)], start=1):
        lines.append({"step": step, "data": {"timing_s/step": wall, "timing_s/gen": gen, "timing_s/old_log_prob": old,
                                             "timing_s/update_actor": upd, "timing_s/adv": 0.1, "timing_s/update_weights": sync,
                                             "response_length/mean": length, "critic/score/mean": 0.5}})
    lines.append({"step": 3, "data": {"val-core/arithmetic/acc/mean@1": 0.5, "timing_s/testing": 2.0}})
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    records = verl_grpo.read_metrics(path)
    steps = verl_grpo.step_times(records, a)
    assert [(s.step, s.warmup) for s in steps] == [(1, True), (2, False), (3, False)]
    s = steps[1]
    assert (s.wall_s, s.generation_s, s.training_s, s.weight_sync_s) == (4.0, 2.0, 1.5, 0.25)
    assert s.completion_tokens == 32 * 8 and s.idle_s == pytest.approx(0.25)
    assert steps[2].completion_tokens == 252
    assert verl_grpo.evaluations(records) == [{"step": 0, "wall_s": 0.0, "accuracy": 0.25},
                                              {"step": 3, "wall_s": 20.0, "accuracy": 0.5}]
    summary = verl_grpo.summarize(steps)
    assert summary["steps_timed"] == 2 and summary["s_per_step_median"] == pytest.approx(4.5)
    assert summary["tokens_per_s"] == pytest.approx((256 + 252) / 9.0)


def test_verl_wheels_script_parses():
    done = subprocess.run(["bash", "-n", str(PEERS / "verl_wheels.sh")], check=False, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
