"""The completion lengths of the peer benchmark's rows (benchmarks/peers/): the pure statistics, the row's
`lengths` over the timed steps, each side's source of the per-step lengths (TRL's generation, asyncrl's
metrics.jsonl) and compare.py's report and warning. Nothing here runs TRL, vLLM or Ray."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import import_benchmark

REPO = Path(__file__).resolve().parents[2]


def _common():
    return import_benchmark("common", "peers")


def test_length_stats_ranks_and_bins():
    s = _common().length_stats([1, 2, 3, 7, 100, 256], 256)
    assert (s["mean"], s["p50"], s["p90"], s["p99"], s["max"], s["count"], s["cut"]) == (61.5, 3, 256, 256, 256, 6, 1)
    assert s["histogram"] == {"le": [1, 2, 4, 8, 16, 32, 64, 128, 256], "count": [1, 1, 1, 1, 0, 0, 0, 1, 1]}


def test_length_stats_bins_are_fixed_by_the_cut():
    common = _common()
    long = common.length_stats([5] * 10, 8192)["histogram"]
    assert long["le"] == [2 ** i for i in range(14)] and sum(long["count"]) == 10
    assert common.length_stats([200], 300)["histogram"]["le"][-2:] == [256, 300]  # the cut closes the last bin
    over = common.length_stats([9, 600], 300)  # a length past the cut still lands in a bin
    assert over["histogram"]["le"][-1] == 1024 and sum(over["histogram"]["count"]) == 2 and over["cut"] == 1
    with pytest.raises(ValueError):
        common.length_stats([], 256)


def test_summarize_keeps_the_timed_steps_lengths_and_none_without_them():
    common = _common()
    steps = [common.StepTime(1, 5.0, 3.0, 1.0, 0.5, 40, warmup=True, completion_lengths=[40]),
             common.StepTime(2, 2.0, 1.0, 0.5, 0.2, 30, completion_lengths=[10, 20]),
             common.StepTime(3, 2.0, 1.0, 0.5, 0.2, 8, completion_lengths=[8])]
    row = common.summarize(steps, 256)
    assert row["lengths"]["count"] == 3 and row["lengths"]["mean"] == pytest.approx(38 / 3)  # warm-up left out
    assert row["per_step"][1]["length_mean"] == 15 and "completion_lengths" not in row["per_step"][1]
    old = [common.StepTime(1, 5.0, 3.0, 1.0, 0.5, 40, warmup=True), common.StepTime(2, 2.0, 1.0, 0.5, 0.2, 30)]
    assert common.summarize(old)["lengths"] is None and common.summarize(old)["per_step"][1]["length_mean"] is None


def test_trl_clock_takes_each_generations_lengths():
    trl = import_benchmark("trl_grpo", "peers")
    clock = trl.PhaseClock(lambda: None)

    def _generate_single_turn(prompts):
        return [[5, 6, 2], [7, 2]], None

    gen = clock.wrap("generation", _generate_single_turn, count_tokens=True)
    gen(None)
    gen(None)
    phases, lengths = clock.take()
    assert lengths == [3, 2, 3, 2] and "generation" in phases
    assert clock.take()[1] == []


def test_asyncrl_side_reads_the_lengths_from_metrics_jsonl(tmp_path):
    asyncrl_side = import_benchmark("asyncrl_side", "peers")
    records = [{"step": 0, "time": 1.0, "eval/accuracy": 0.1},
               {"step": 1, "train/step": 1, "train/response_lengths": [3, 9]},
               {"step": 2, "train/step": 2, "train/response_tokens": 12.0}]  # an asyncrl that did not record them
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert asyncrl_side.response_lengths(tmp_path) == {1: [3, 9]}
    assert asyncrl_side.response_lengths(tmp_path / "absent") == {}

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "hidden_size": 8, "num_hidden_layers": 1, "vocab_size": 10, "num_attention_heads": 2,
        "num_key_value_heads": 1, "intermediate_size": 16, "tie_word_embeddings": True, "max_position_embeddings": 64}))
    a = asyncrl_side.parse_args(["--model", str(tmp_path), "--warmup-steps", "1", "--steps", "2", "--prompts-per-step", "1",
                                 "--group-size", "2", "--max-new-tokens", "16", "--no-fixed-length"])
    per_step = [{"train/step": n, "time/elapsed_s": 10.0 * n, "time/train_s": 1.0, "time/sync_s": 0.5,
                 "train/response_tokens": sum(x), "train/reward_mean": 0.0} for n, x in [(1, [1, 1]), (2, [3, 9]), (3, [16, 4])]]
    row = asyncrl_side.row_of(a, 0, {"per_step": per_step, "eval": []}, "hybrid", {1: [1, 1], 2: [3, 9], 3: [16, 4]})
    assert row["lengths"]["count"] == 4 and row["lengths"]["max"] == 16 and row["lengths"]["cut"] == 1
    assert row["fixed_length"] is False


def _row(system: str, placement: str, mean: float | None, model: str = "/tmp/qwen2-0.5b-random-longtail1500") -> dict:
    row = {"system": system, "placement": placement, "eta": 0, "model": model, "samples_per_step": 64,
           "max_new_tokens": 8192, "fixed_length": False, "gpu": "NVIDIA H200", "steps_timed": 8,
           "s_per_step_median": 30.0, "s_per_step_mean": 31.0, "tokens_per_s": 3000.0,
           "split_s": {"generation": 20.0, "training": 9.0, "weight_sync": 1.0, "idle": 1.0}}
    if mean is not None:
        row["lengths"] = {"mean": mean, "p50": 1000, "p90": 3400, "p99": 6800, "max": 8192, "count": 512, "cut": 2,
                          "histogram": {"le": [2 ** i for i in range(14)], "count": [0] * 13 + [512]}}
    return row


def _compare(tmp_path: Path, rows: list[dict]) -> str:
    path = tmp_path / "peers.json"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "peers" / "compare.py"), str(path)],
                          check=False, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_compare_prints_lengths_and_warns_when_the_workloads_differ(tmp_path):
    out = _compare(tmp_path, [_row("trl", "colocate", 1500.0), _row("asyncrl", "hybrid", 1450.0),
                              _row("asyncrl", "separated", 1100.0), _row("asyncrl", "old", None)])
    assert "- TRL colocate: 1500, 1000, 3400, 6800, 8192 (512 samples, 2 cut)" in out
    assert "asyncrl old" in out.split("Completion lengths")[0]  # a row without lengths still makes its table line
    warnings = [ln for ln in out.splitlines() if ln.startswith("WARNING")]
    assert len(warnings) == 2 and all("asyncrl separated eta=0" in w for w in warnings)  # 1450 vs 1500: within 15 %


def test_compare_does_not_warn_across_settings(tmp_path):
    out = _compare(tmp_path, [_row("trl", "colocate", 1500.0), _row("trl", "colocate", 256.0, model="/tmp/qwen2-0.5b-random")])
    assert "WARNING" not in out and out.count("- TRL colocate") == 2
