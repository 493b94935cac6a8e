"""The side-by-side harness against TRL (benchmarks/peers/, issue 32) on CPU: its scripts parse their arguments
(help, a bad value refused with exit 2 and its name), the asyncrl side turns the shared knobs into a config both
one-GPU placements accept, compare.py renders the table and the PNG from hand-written rows, and the shell
scripts parse. Nothing here runs TRL, vLLM or a GPU: that is `bash benchmarks/gpu_session.sh peers`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import import_benchmark

REPO = Path(__file__).resolve().parents[2]
PEERS = REPO / "benchmarks" / "peers"
SCRIPTS = ("trl_grpo.py", "asyncrl_side.py", "compare.py")


def _asyncrl_side():
    """benchmarks/peers/asyncrl_side.py as a module (the script puts its folders first)."""
    return import_benchmark("asyncrl_side", "peers")


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PEERS / script), *args], capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_exits_zero(script):
    done = _run(script, "--help")
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


@pytest.mark.parametrize(("script", "args", "named"), [
    ("trl_grpo.py", ["--group-size", "1"], "--group-size=1"),
    ("trl_grpo.py", ["--warmup-steps", "0"], "--warmup-steps=0"),
    ("trl_grpo.py", ["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization=1.5"),
    ("trl_grpo.py", ["--prompts-per-step", "3", "--group-size", "4", "--micro-batch-size", "5"], "--micro-batch-size=5"),
    ("asyncrl_side.py", ["--placement", "nowhere"], "--placement"),
    ("asyncrl_side.py", ["--etas", "0", "-1"], "--etas"),
    ("compare.py", ["/nonexistent/peers.json"], "/nonexistent/peers.json"),
])
def test_bad_argument_exits_two_naming_it(script, args, named):
    done = _run(script, *args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert named in done.stderr and "error:" in done.stderr


def test_asyncrl_knobs_make_a_valid_config_for_both_placements():
    asyncrl_side = _asyncrl_side()
    from asyncrl.config import load_config

    a = asyncrl_side.parse_args(["--model", "/models/m", "--prompts-per-step", "4", "--group-size", "4",
                                 "--max-new-tokens", "32", "--max-model-len", "160", "--lr", "3e-6", "--seed", "5"])
    for placement, path in asyncrl_side.CONFIGS.items():
        raw = asyncrl_side.apply_overrides(asyncrl_side._args_from(REPO / path), asyncrl_side.knob_overrides(a, eta=2))
        cfg = load_config(raw, source=f"test {placement}")
        assert (cfg.model.path, cfg.model.dtype, cfg.model.max_model_len) == ("/models/m", "bfloat16", 160)
        assert (cfg.buffer.batch_size, cfg.algorithm.group_size, cfg.algorithm.max_new_tokens) == (16, 4, 32)
        assert cfg.algorithm.ignore_eos and cfg.algorithm.kl_coef == 0.0
        assert (cfg.learner.lr, cfg.learner.lr_warmup_steps, cfg.learner.micro_batch_size) == (3e-6, 0, 16)
        assert (cfg.trainer.seed, cfg.trainer.rollout_concurrency) == (5, 12)  # 4 prompts x (eta 2 + 1)
        assert cfg.generator.engine_kwargs["max_num_seqs"] == 48 and cfg.weightsync.verify == "checksum"
    assert asyncrl_side.CONFIGS["hybrid"].name == "rlhf-hybrid1.yaml"


def _row(system: str, placement: str, eta: int, median: float, split: dict[str, float], **extra) -> dict:
    return {"system": system, "placement": placement, "eta": eta, "model": "/tmp/qwen2-0.5b-random", "params": 494_032_768,
            "samples_per_step": 64, "max_new_tokens": 256, "fixed_length": True, "gpu": "NVIDIA H100 80GB HBM3",
            "steps_timed": 8, "s_per_step_median": median, "s_per_step_mean": median + 0.1, "split_s": split,
            "tokens_per_s": 64 * 256 / (median + 0.1), **extra}


def test_compare_renders_the_table_and_the_png(tmp_path):
    trl = _row("trl", "colocate", 0, 6.0, {"generation": 3.0, "training": 2.5, "weight_sync": 0.4, "idle": 0.2},
               eval=[{"step": 0, "wall_s": 0.0, "accuracy": 0.4}, {"step": 4, "wall_s": 30.0, "accuracy": 0.5}],
               start_s=28.0, first_step_s=6.0)
    ours = _row("asyncrl", "hybrid", 0, 2.5, {"generation": 1.0, "training": 1.3, "weight_sync": 0.3, "idle": 0.0},
                eval=[{"step": 0, "wall_s": 0.0, "accuracy": 0.0}], start_s=81.0, first_step_s=9.0)  # evaluated at its start only: no curve
    rows = tmp_path / "peers.json"
    rows.write_text("[trl] step 1/11 (warm-up): 9.1 s\n" + json.dumps(trl) + "\n" + json.dumps(ours) + "\n"
                    + json.dumps({"side": "vllm", "phase": "plain"}) + "\n")
    md, png = tmp_path / "peers.md", tmp_path / "bars.png"
    done = _run("compare.py", str(rows), "--md", str(md), "--png", str(png))
    assert done.returncode == 0, done.stderr
    lines = md.read_text().splitlines()
    assert lines[0].startswith("| system | model (params) | samples/step x tokens |")
    assert lines[2] == ("| TRL colocate | qwen2-0.5b-random (494M) | 64 x 256 fixed | 8 | 6.000 | 6.100 | 1.00x | "
                        "3.000 | 2.500 | 0.400 | 0.200 | 2,686 | NVIDIA H100 80GB HBM3 |")
    # tokens/s: the means
    assert lines[3].startswith("| asyncrl hybrid eta=0 | qwen2-0.5b-random (494M) | 64 x 256 fixed | 8 | 2.500 | 2.600 | 2.35x | ")
    assert len([ln for ln in lines if ln.startswith("|")]) == 4  # header, rule, two rows: the generation row is skipped
    assert "TRL colocate: 0.400 @ step 0 / 0 s, 0.500 @ step 4 / 30 s" in md.read_text()
    assert "asyncrl hybrid eta=0:" not in md.read_text().partition("Held-out")[2]
    # the first steps: TRL's and ours against it; a row without the figures is left out of that list
    assert "- TRL colocate: start 28.0, first step 6.00" in md.read_text()
    assert "- asyncrl hybrid eta=0: start 81.0, first step 9.00 (1.50x TRL's)" in md.read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_refuses_a_file_without_rows(tmp_path):
    log = tmp_path / "log.txt"
    log.write_text("nothing to see\n{\"side\": \"vllm\"}\n")
    done = _run("compare.py", str(log))
    assert done.returncode == 2 and "no rows" in done.stderr


@pytest.mark.parametrize("script", ["benchmarks/peers/wheels.sh", "benchmarks/gpu_session.sh", "benchmarks/sglang/wheels.sh",
                                    "benchmarks/gpu_jobs.sh", "benchmarks/gpu_wheel_parts.sh"])
def test_shell_scripts_parse(script):
    done = subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_asyncrl_row_splits_each_step_and_leaves_out_warmup_and_evaluation_steps(tmp_path):
    asyncrl_side = _asyncrl_side()
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "hidden_size": 8, "num_hidden_layers": 1, "vocab_size": 10, "num_attention_heads": 2,
        "num_key_value_heads": 1, "intermediate_size": 16, "tie_word_embeddings": True, "max_position_embeddings": 64}))
    a = asyncrl_side.parse_args(["--model", str(tmp_path), "--warmup-steps", "1", "--steps", "3", "--eval-every", "2",
                                 "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4"])
    # time/elapsed_s from the loop's start; the row of step 2 holds an evaluation (its time is inside the step)
    per_step = [{"train/step": n, "time/elapsed_s": t, "time/train_s": tr, "time/sync_s": sy, "train/response_tokens": 16,
                 "train/reward_mean": 0.5, "eval/accuracy": acc, "hybrid/engine_wake_s": sy / 2,
                 "weightsync/push_seconds": sy / 4, "weightsync/sender/host_copy_thread_keep_seconds": tr / 10}
                for n, t, tr, sy, acc in [(1, 30.0, 2.0, 1.0, None), (2, 34.0, 1.0, 0.5, 0.25), (3, 36.0, 1.2, 0.3, None),
                                          (4, 39.0, 1.5, 0.5, None)]]
    evals = [{"step": 0, "time": 1000.0, "accuracy": 0.2}, {"step": 2, "time": 1034.0, "accuracy": 0.25}]
    row = asyncrl_side.row_of(a, 2, {"per_step": per_step, "eval": evals, "staleness_mean": 1.5, "start_s": 80.5,
                                     "first_step_s": 30.0}, "separated")
    assert (row["start_s"], row["first_step_s"]) == (80.5, 30.0) and row["first_step"] == per_step[0]
    assert (row["system"], row["placement"], row["eta"], row["samples_per_step"]) == ("asyncrl", "separated", 2, 4)
    assert [s["warmup"] for s in row["per_step"]] == [True, True, False, False]
    assert row["steps_timed"] == 2 and row["s_per_step_median"] == pytest.approx(2.5)  # steps 3 (2 s) and 4 (3 s)
    assert row["split_s"] == pytest.approx({"generation": 0.75, "training": 1.35, "weight_sync": 0.4, "idle": 0.0})
    assert row["tokens_per_s"] == pytest.approx(32 / 5)
    assert row["eval"] == [{"step": 0, "wall_s": 0.0, "accuracy": 0.2}, {"step": 2, "wall_s": 34.0, "accuracy": 0.25}]
    assert row["params"] > 0 and row["version"].startswith("asyncrl ")
    assert row["settings"]["engine_wake_s_mean"] == pytest.approx(0.2) and "engine_sleep_s_mean" not in row["settings"]
    # every step's push and the host copies kept beside it, named without the prefix
    assert row["weightsync_per_step"][2] == {"step": 3, "push_seconds": 0.075, "sender/host_copy_thread_keep_seconds": 0.12}
