"""Weights & Biases, offline: a real `wandb` run (no network) written by the metrics tracker holds the
same metric keys and values as TensorBoard and metrics.jsonl, eval curves included, and the run's
config, name and tags. Its files are read back with wandb's own record reader."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from asyncrl.config import WandbConfig, load_config
from asyncrl.trainer.tracking import MetricsTracker

_BLOCK, _HEADER = 32768, 7  # the leveldb log layout of W&B's `.wandb` files: 32 KiB blocks, 7-byte record headers


def _log_records(data: bytes) -> list[bytes]:
    """The records of a `.wandb` file: a 7-byte file header (`:W&B`, magic, version), then leveldb-log
    records (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last) that never cross a 32 KiB block."""
    assert data[:4] == b":W&B", data[:8]
    out, pos, parts = [], _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # the block's tail is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0 and length == 0:  # zero padding
            pos += left
            continue
        body, pos = data[pos + _HEADER:pos + _HEADER + length], pos + _HEADER + length
        if kind == 1:
            out.append(body)
        elif kind == 2:
            parts = body
        elif kind == 3:
            parts += body
        elif kind == 4:
            out.append(parts + body)
        else:
            raise AssertionError(f"record type {kind} at {pos}")
    return out


def read_offline_run(wandb_dir: Path) -> dict[str, Any]:
    """The one offline run under `wandb_dir`: {"name", "project", "tags", "config", "history":
    {step: {key: value}}}, decoded from its `.wandb` record file with wandb's protobuf types."""
    from wandb.proto import wandb_internal_pb2

    (run_dir,) = sorted(Path(wandb_dir).glob("offline-run-*"))
    (records_file,) = run_dir.glob("run-*.wandb")
    out: dict[str, Any] = {"config": {}, "history": {}, "dir": run_dir}
    for data in _log_records(records_file.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out.update(name=record.run.display_name, project=record.run.project, tags=list(record.run.tags))
            out["config"].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            out["config"].update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            out["history"].setdefault(int(row["_step"]), {}).update(row)
    out["config"] = {k: v.get("value", v) if isinstance(v, dict) and set(v) <= {"value", "desc"} else v
                     for k, v in out["config"].items()}
    return out


def _tensorboard_scalars(log_dir: Path) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    out: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            out.setdefault(event.step, {})[tag] = event.value
    return out


def test_offline_run_holds_the_metrics_eval_curve_and_config_tensorboard_has(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = load_config({"logging": {"dir": str(tmp_path), "wandb": {"mode": "offline"}}}).model_dump(mode="json")
    wandb_cfg = WandbConfig(project="asyncrl-test", name="unit", tags=["grpo", "cpu"], mode="offline")
    tracker = MetricsTracker(tmp_path, tensorboard=True, plot_interval_steps=0, wandb=wandb_cfg, config=config)
    tracker.log(0, {"eval/accuracy": 0.45})  # the starting evaluation
    tracker.log(1, {"train/reward_mean": 0.5, "actor/loss": -0.25, "buffer/trained": 16.0, "time/train_s": 1.5})
    tracker.log(2, {"train/reward_mean": 0.625, "actor/loss": float("nan"), "eval/accuracy": 0.5, "buffer/trained": 32.0})
    tracker.close()

    run = read_offline_run(tmp_path / "wandb")
    assert (run["name"], run["project"], run["tags"]) == ("unit", "asyncrl-test", ["grpo", "cpu"])
    assert run["config"]["logging"]["wandb"]["mode"] == "offline" and run["config"]["buffer"] == config["buffer"]
    history = {step: {k: v for k, v in row.items() if not k.startswith("_")} for step, row in run["history"].items()}
    board = _tensorboard_scalars(tmp_path / "tensorboard")  # the same scalars at the same steps (TB keeps float32)
    assert {s: set(row) for s, row in history.items()} == {s: set(row) for s, row in board.items()}
    assert all(math.isclose(history[s][k], board[s][k], rel_tol=1e-6) for s in board for k in board[s])
    assert history[1] == {"train/reward_mean": 0.5, "actor/loss": -0.25, "buffer/trained": 16.0, "time/train_s": 1.5}
    assert "actor/loss" not in history[2]  # NaN is absent, as in TensorBoard (metrics.jsonl writes null)
    assert [history[s]["eval/accuracy"] for s in (0, 2)] == [0.45, 0.5]  # the eval curve
    jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for record in jsonl:
        logged = {k: v for k, v in record.items() if k not in ("step", "time") and v is not None}
        assert logged == history[record["step"]]
    assert math.isclose(run["history"][2]["train/reward_mean"], 0.625)


def test_no_wandb_config_means_no_wandb_run(tmp_path):
    tracker = MetricsTracker(tmp_path, tensorboard=False, plot_interval_steps=0)
    tracker.log(1, {"train/reward_mean": 0.5})
    tracker.close()
    assert not (tmp_path / "wandb").exists()
