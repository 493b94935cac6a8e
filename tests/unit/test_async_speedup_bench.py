"""benchmarks/async_speedup.py's bookkeeping on CPU: which engine replicas joined mid-run and at which
version (issue 30's autoscaler run reads this), and the configs its GPU stages use load. The runs
themselves are `bash benchmarks/gpu_session.sh balanced|scale` on GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import import_benchmark

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return import_benchmark("async_speedup")


def test_a_replica_that_appears_later_is_a_join_with_its_first_version(bench):
    timeline = [
        {"t": 1.0, "policy_version": 1, "replicas": {"a": 1}},
        {"t": 3.0, "policy_version": 2, "replicas": {"a": 2}},
        {"t": 5.0, "policy_version": 3, "replicas": {"a": 3, "b": 3}},
        {"t": 7.0, "policy_version": 4, "replicas": {"a": 4, "b": 4}},
    ]
    assert bench.replica_joins(timeline) == [
        {"replica": "b", "t": 5.0, "first_version": 3, "policy_version": 3, "others": {"a": 3}}]


def test_replicas_of_the_first_poll_are_not_joins_and_a_replica_counts_once(bench):
    timeline = [
        {"t": 1.0, "policy_version": 0, "replicas": {"a": 0, "b": 0}},
        {"t": 2.0, "policy_version": 5, "replicas": {"a": 5}},  # b did not answer this poll
        {"t": 3.0, "policy_version": 6, "replicas": {"a": 6, "b": 6, "c": 5}},
    ]
    joins = bench.replica_joins(timeline)
    assert [(j["replica"], j["first_version"], j["policy_version"]) for j in joins] == [("c", 5, 6)]
    assert bench.replica_joins([]) == []


@pytest.mark.parametrize("name", ["rlhf-gpu2-long.yaml", "rlhf-gpu4-scale.yaml", "rlhf-gpu8.yaml"])
def test_the_gpu_stage_configs_load_with_the_stage_overrides(bench, name, demo_model_path):
    from asyncrl.config import load_config

    sets = [f"model.path={demo_model_path}", "weightsync.verify=full"]
    if name == "rlhf-gpu2-long.yaml":  # what the balanced stage sets after its calibration
        sets += ["buffer.batch_size=384", "trainer.rollout_concurrency=48", "algorithm.max_new_tokens=512"]
    cfg = load_config(bench.apply_overrides(bench._args_from(REPO / "deploy" / name), sets), source=name)
    assert cfg.weightsync.verify == "full"  # (the configs say checksum)
    assert cfg.algorithm.ignore_eos  # fixed-length responses from a random model
    if name in ("rlhf-gpu4-scale.yaml", "rlhf-gpu8.yaml"):
        assert cfg.generator.autoscaling.max_replicas == 2 and cfg.generator.autoscaling.initial_replicas == 1
        assert cfg.trainer.rollout_concurrency > cfg.generator.autoscaling.target_ongoing_requests
    if name == "rlhf-gpu8.yaml":  # 8 GPUs: two engine replicas of TP = 2 beside a TP = 2 x PP = 2 learner
        sc = cfg.learner.strategy_config
        assert (sc["tensor_model_parallel_size"], sc["pipeline_model_parallel_size"]) == (2, 2)
        assert cfg.learner.world_size * cfg.learner.num_gpus_per_rank == 4
        assert cfg.generator.engine_kwargs["tensor_parallel_size"] == cfg.generator.num_gpus == 2


def test_a_window_that_trains_batches_generated_before_it_is_held_to_the_engines_pace(bench):
    # Issue 28's balanced run (two H200s, eta = 2, 4 timed steps): 4 x 384 x 1,024 response tokens trained
    # in 43.3 s while the engine generated 851k tokens (19.6k tokens/s) in that window: more than half of
    # what was trained came from before it, and the engine's pace is 20.0 s per step, not 10.8.
    trained = 4 * 384 * 1024
    out = bench.steady_state(43.3, 4, trained, 851_000)
    assert out["drawn_from_buffer"] == pytest.approx(1 - 851_000 / trained)
    assert out["engine_s_per_step"] == pytest.approx(384 * 1024 / (851_000 / 43.3))
    assert out["steady_s_per_step"] == out["engine_s_per_step"] > 43.3 / 4


def test_a_window_whose_engine_kept_up_keeps_its_own_pace(bench):
    # eta = 0: every trained token was generated inside the window (and more, for the batch in flight)
    out = bench.steady_state(118.8, 4, 4 * 384 * 1024, 4 * 384 * 1024 + 50_000)
    assert out["drawn_from_buffer"] == 0.0
    assert out["steady_s_per_step"] == pytest.approx(118.8 / 4)
    assert bench.steady_state(0.0, 0, 0, 0) == {"drawn_from_buffer": None, "engine_s_per_step": None,
                                                 "steady_s_per_step": None}


def test_the_warm_up_must_leave_steps_to_time(bench):
    with pytest.raises(ValueError, match="warmup=3"):
        bench.run_once({}, 2, 3, Path("/nonexistent"), 1.0, warmup=3)
    with pytest.raises(SystemExit):
        bench.main(["--steps", "4", "--warmup-steps", "3"])


def test_a_negative_evaluation_interval_is_refused_before_anything_starts(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--steps", "4", "--eval-every", "-1"])
    assert "--eval-every=-1" in capsys.readouterr().err


def test_a_run_stopped_at_its_limit_reports_the_steps_it_finished_if_enough_were_timed(bench):
    assert bench.reportable(2, {"state": "finished"}, 10, 10, 1, 500) is True
    assert bench.reportable(2, {"state": "training"}, 9, 10, 1, 500) is False  # 8 timed steps: reported, unfinished
    with pytest.raises(RuntimeError, match=r"2 of 10 steps by its 500 s limit"):
        bench.reportable(2, {"state": "training"}, 2, 10, 1, 500)  # 1 step after the warm-up: nothing to time
    with pytest.raises(RuntimeError, match="did not finish"):
        bench.reportable(0, {"state": "failed"}, 9, 10, 1, 500)


def test_the_balanced_batch_grows_where_generation_outweighs_training_and_is_held_to_its_bounds(bench):
    # generation / training 1.73 at 64 (the 1.5B on two H100s): the ratio falls as batch^-0.35
    b = bench.balanced_batch(2.9, 5.0, 64)
    assert b == 352
    ratio = 5.0 / 2.9 * (b / 64) ** (0.75 - 1.1)
    assert abs(ratio - 0.95) < 0.05
    assert bench.balanced_batch(10.0, 5.0, 256) < 256  # training outweighs generation: a smaller batch
    assert bench.balanced_batch(1.0, 50.0, 64) == 1024 and bench.balanced_batch(50.0, 1.0, 64) == 32
    with pytest.raises(ValueError, match="positive"):
        bench.balanced_batch(0.0, 5.0, 64)


def test_the_balanced_batch_cli_reads_a_calibration_run_and_falls_back_to_its_batch(bench, tmp_path, capsys):
    calib = tmp_path / "calib.json"
    calib.write_text('{"results": [{"steps_timed": 2, "train_s": 5.8, "wait_s": 10.0}]}')
    assert bench.main(["--balanced-batch", str(calib), "64"]) == 0
    assert capsys.readouterr().out.strip() == "352"
    assert bench.main(["--balanced-batch", str(tmp_path / "missing.json"), "64"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == "64" and "calibration failed" in out.err
    for bad in ("many", "0", "-64"):
        with pytest.raises(SystemExit):
            bench.main(["--balanced-batch", str(calib), bad])
    assert "positive integer" in capsys.readouterr().err


def test_the_figures_time_the_steps_after_the_warm_up_and_keep_each_pushs_breakdown(bench):
    from asyncrl.config import load_config

    cfg = load_config({"buffer": {"batch_size": 8}})
    rows = [{"train/step": k, "time/elapsed_s": 10.0 * k, "time/train_s": 6.0, "time/sync_s": 0.5, "train/tokens": 100.0,
             "train/response_tokens": 80.0, "train/reward_mean": 0.1 * k, "rollout/tokens": 80.0 * k,
             "weightsync/push_seconds": 0.4, "weightsync/bytes": 15e9, "weightsync/sender/broadcast_seconds": 0.3,
             "weightsync/replica/r1/load_bucket_seconds": 0.33, "weightsync/failed": 0.0} for k in range(1, 5)]
    out = bench._figures(cfg, 2, rows, rows, 1, 989e12, [])
    assert out["steps_timed"] == 3 and out["wall_s"] == pytest.approx(30.0) and out["train_s"] == pytest.approx(18.0)
    assert out["samples"] == 24 and out["push_s"] == pytest.approx(0.4) and out["push_failed"] == 0
    last = out["per_step"][-1]
    assert last["weightsync/sender/broadcast_seconds"] == 0.3 and last["weightsync/replica/r1/load_bucket_seconds"] == 0.33
    assert last["weightsync/bytes"] == 15e9 and "rollout/tokens" not in last
    assert out["learner_peak_gib"] is None  # (a CPU learner reports none)
    rows[2]["actor/device_peak_gib"], rows[3]["actor/device_peak_gib"] = 41.5, 40.0
    assert bench._figures(cfg, 2, rows, rows, 1, 989e12, [])["learner_peak_gib"] == 41.5


def test_an_interrupted_run_reports_the_steps_it_finished_before_it_stops(bench, tmp_path, monkeypatch):
    """A caller's `timeout -s INT` in the middle of the wait (2026-11-27: a 7B run's tenth step ended 0.3 s after
    it, and its figures were lost): the figures of the steps done are emitted, then the interrupt goes on."""
    import json

    import httpx
    from ray import serve

    import asyncrl.app
    import asyncrl.config

    calls: list[str] = []
    for name in ("shutdown", "start", "run", "delete"):
        monkeypatch.setattr(serve, name, lambda *a, _n=name, **k: calls.append(_n))
    monkeypatch.setattr(asyncrl.app, "build_app", lambda cfg: "app")
    monkeypatch.setattr(asyncrl.config, "load_config", lambda raw, source: raw)
    monkeypatch.setattr(bench, "_replica_versions", lambda control, app: (None, None))
    monkeypatch.setattr(bench, "_figures", lambda cfg, eta, records, rows, *rest: {"eta": eta, "steps": len(rows)})

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(httpx, "get", interrupted)
    emitted: list[dict] = []
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"train/step": i}) + "\n" for i in range(1, 5)))
    with pytest.raises(KeyboardInterrupt):
        bench.run_once({}, 2, 10, run, 500.0, warmup=1, emit=emitted.append)
    assert emitted == [{"eta": 2, "steps": 4, "finished": False, "start_s": None, "first_step_s": None}]  # no record times
    assert calls[-1] == "shutdown" and "delete" in calls  # the app is still torn down
    # too few steps to time: nothing is emitted, and the interrupt (not a RuntimeError) is what the caller sees
    (run / "metrics.jsonl").write_text(json.dumps({"train/step": 1}) + "\n")
    emitted.clear()
    with pytest.raises(KeyboardInterrupt):
        bench.run_once({}, 2, 10, run, 500.0, warmup=1, emit=emitted.append)
    assert emitted == []


def test_the_start_runs_from_the_launch_to_the_training_clock_and_the_first_step_is_its_own(bench):
    # step 1 logged at unix 1130 with 18 s on the training clock: training started at 1112, 92 s after the launch
    rows = [{"train/step": 1, "time": 1130.0, "time/elapsed_s": 18.0}, {"train/step": 2, "time": 1132.0, "time/elapsed_s": 20.0}]
    assert bench.start_figures(1020.0, rows) == {"start_s": pytest.approx(92.0), "first_step_s": 18.0}
    assert bench.start_figures(1020.0, rows[1:]) == {"start_s": None, "first_step_s": None}

