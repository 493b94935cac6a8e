"""`asyncrl status` and `asyncrl export`'s logic: the status text, fetching it over real HTTP
(a stdlib server standing in for the app's route), and finding the checkpoint to export.
The commands against a running app and a trained checkpoint are in tests/e2e/test_training_loop.py."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from asyncrl.cli import main
from asyncrl.trainer.export import ExportError, export_run, find_checkpoint
from asyncrl.trainer.status_view import StatusUnavailable, fetch_status, format_status

STATUS = {
    "state": "training", "error": None, "step": 12, "total_steps": 400, "policy_version": 12,
    "reward_mean": 0.453125, "eval_accuracy": 0.565, "eval_history": [[0, 0.45], [10, 0.565]],
    "buffer": {"buffer/generated": 3200.0, "buffer/trained": 3072.0, "buffer/waiting": 100.0, "buffer/running": 64.0,
               "buffer/dropped_stale": 20.0, "buffer/dropped_invalid": 0.0, "buffer/dropped_filtered": 0.0,
               "buffer/dropped_failed": 8.0, "buffer/staleness_mean": 1.5, "buffer/staleness_max": 2.0},
    "elapsed_s": 83.4, "learner_restarts": 0,
    "metrics": {"time/train_s": 1.17, "time/sync_s": 0.14, "rollout/tokens_per_s": 8612.0},
}


def test_status_text_shows_progress_reward_accuracy_and_accounting():
    text = format_status(STATUS)
    lines = text.splitlines()
    assert lines[0].split() == ["state", "training", "step", "12/400", "policy", "version", "12", "elapsed", "1m23s"]
    assert "reward       0.453" in text and "held-out accuracy 0.565 (at step 10), first 0.450 at step 0" in text
    assert ("generated 3200 = trained 3072 + waiting 100 + dropped (dropped_stale 20  dropped_invalid 0  "
            "dropped_filtered 0  dropped_failed 8)   running 64") in text
    assert "does not add up" not in text
    assert "staleness    mean 1.50   max 2" in text
    assert "train 1.17 s   sync 0.14 s   rollout 8612 tokens/s" in text
    broken = {**STATUS, "state": "failed", "error": "BatchTimeout('no batch')", "learner_restarts": 1,
              "buffer": {**STATUS["buffer"], "buffer/generated": 3300.0}}
    text = format_status(broken)
    assert "accounting does not add up: 3300 != 3200" in text
    assert "error        BatchTimeout('no batch')" in text and "1 learner restart(s)" in text


def test_status_text_before_the_first_step():
    text = format_status({"state": "starting", "step": 0, "total_steps": 5, "policy_version": 0, "reward_mean": None,
                          "eval_accuracy": None, "eval_history": [], "buffer": {}, "elapsed_s": 2.0, "metrics": {}})
    assert text.splitlines() == ["state        starting   step 0/5   policy version 0   elapsed 0m02s",
                                 "reward       -   held-out accuracy -"]


@pytest.fixture
def fake_app():
    """A real HTTP server answering /train/status as the gateway does (200 with the snapshot, or 503)."""
    answers = {"status": 200, "body": STATUS}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path != "/train/status":
                self.send_response(404)
                self.end_headers()
                return
            body = json.dumps(answers["body"]).encode()
            self.send_response(answers["status"])
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", answers
    server.shutdown()


def test_status_command_prints_the_snapshot_and_exit_codes(fake_app, capsys):
    url, answers = fake_app
    assert fetch_status(url) == STATUS == fetch_status(url + "/train/status/")
    assert fetch_status(url.removeprefix("http://")) == STATUS
    assert main(["status", url]) == 0
    assert capsys.readouterr().out.strip() == format_status(STATUS)
    assert main(["status", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == STATUS
    answers["body"] = {**STATUS, "state": "failed", "error": "boom"}
    assert main(["status", url]) == 1  # a failed run is a failing exit code, for scripts
    answers.update(status=503, body={"detail": "no training loop attached"})
    assert main(["status", url]) == 2
    assert "HTTP 503: no training loop attached" in capsys.readouterr().err
    answers.update(status=200, body={"hello": 1})
    with pytest.raises(StatusUnavailable, match="not a training status"):
        fetch_status(url)


def test_status_command_names_an_unreachable_app(capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    assert main(["status", f"http://127.0.0.1:{port}", "--timeout", "5"]) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}/train/status: cannot connect" in err and "make serve" in err


def _checkpoint(root: Path, version: int, *, model_path: str | None = None, suffix: str = "", complete: bool = True) -> Path:
    path = root / f"step_{version:06d}{suffix}"
    (path / "actor").mkdir(parents=True)
    (path / "actor" / "metadata.json").write_text("{}")
    if complete:
        state = {"version": version, "stream": {}} | ({"model_path": model_path} if model_path else {})
        (path / "trainer_state.json").write_text(json.dumps(state))
    return path


def test_find_checkpoint_takes_the_newest_complete_or_the_named_step(tmp_path):
    ckpts = tmp_path / "run" / "ckpt"
    _checkpoint(ckpts, 1)
    two = _checkpoint(ckpts, 2)
    _checkpoint(ckpts, 3, suffix=".tmp")  # being written: never exported
    _checkpoint(ckpts, 4, complete=False)  # no state file: incomplete
    assert find_checkpoint(ckpts) == two  # the checkpoint directory itself
    assert find_checkpoint(tmp_path / "run") == two  # a run directory holding it
    assert find_checkpoint(ckpts, step=1) == ckpts / "step_000001"
    assert find_checkpoint(two) == two  # one checkpoint
    with pytest.raises(ExportError, match=r"no complete checkpoint of step 3 under .*; there are steps \[1, 2\]"):
        find_checkpoint(ckpts, step=3)
    with pytest.raises(ExportError, match="is the checkpoint of step 2, not --step 1"):
        find_checkpoint(two, step=1)
    with pytest.raises(ExportError, match="no complete checkpoint"):
        find_checkpoint(tmp_path / "run" / "ckpt" / "step_000004")
    with pytest.raises(ExportError, match="is not a directory"):
        find_checkpoint(tmp_path / "nowhere")


def test_find_checkpoint_follows_the_run_record(tmp_path):
    """The trainer's run.json names checkpoint.dir, which may lie outside the run directory."""
    elsewhere = _checkpoint(tmp_path / "shared" / "ckpts", 7)
    run = tmp_path / "runs" / "demo"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"checkpoint_dir": str(elsewhere.parent), "model_path": "m", "config": {}}))
    assert find_checkpoint(run) == elsewhere
    (run / "run.json").write_text("[]")
    with pytest.raises(ExportError, match="is not a run record"):
        find_checkpoint(run)


def test_export_refuses_what_it_cannot_export_before_starting_ranks(tmp_path, demo_model_path, capsys):
    old = _checkpoint(tmp_path / "ckpt", 1)  # written before checkpoints named their model
    with pytest.raises(ExportError, match="pass --hf-config MODEL_DIR"):
        export_run(tmp_path / "ckpt", tmp_path / "out")
    _checkpoint(tmp_path / "ckpt2", 1, model_path=str(tmp_path / "gone"))
    with pytest.raises(ExportError, match=r"gone has no config.json \(named by .*pass --hf-config"):
        export_run(tmp_path / "ckpt2", tmp_path / "out")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="exists and is not empty"):
        export_run(old, tmp_path / "busy", hf_config=demo_model_path)
    (old / "actor" / "metadata.json").unlink()
    with pytest.raises(ExportError, match="has no actor checkpoint"):
        export_run(old, tmp_path / "out", hf_config=demo_model_path)
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--step", "9"]) == 2
    assert "no complete checkpoint of step 9" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_demo_judge_model_refuses_a_config_without_one_training_app_or_an_existing_run(tmp_path, capsys, monkeypatch):
    """`asyncrl demo-judge-model` checks its training config before it starts anything: exactly one
    training application, and no earlier run in its logging directory (exit 2, nothing started)."""
    import yaml

    monkeypatch.chdir(tmp_path)
    gen_only = {"applications": [{"name": "g", "import_path": "asyncrl.app:generator_app_builder", "args": {}}]}
    (tmp_path / "gen.yaml").write_text(yaml.safe_dump(gen_only))
    assert main(["demo-judge-model", "--config", "gen.yaml", "--out", "judge"]) == 2
    assert "must hold one training application" in capsys.readouterr().err
    assert main(["demo-judge-model", "--config", "missing.yaml", "--out", "judge"]) == 2
    assert "--config missing.yaml" in capsys.readouterr().err
    (tmp_path / "bad.yaml").write_text("applications: [\n")
    assert main(["demo-judge-model", "--config", "bad.yaml", "--out", "judge"]) == 2
    assert "--config bad.yaml" in capsys.readouterr().err
    wrong = {"applications": [{"name": "t", "import_path": "asyncrl.app:app_builder", "args": {"trainer": {"total_steps": 0}}}]}
    (tmp_path / "wrong.yaml").write_text(yaml.safe_dump(wrong))
    assert main(["demo-judge-model", "--config", "wrong.yaml", "--out", "judge"]) == 2
    assert "trainer.total_steps" in capsys.readouterr().err  # a config error names its field
    teacher = Path(__file__).resolve().parents[2] / "deploy" / "rlhf-judge-teacher.yaml"
    cfg = yaml.safe_load(teacher.read_text())
    (tmp_path / "runs" / "judge-teacher").mkdir(parents=True)  # the teacher's logging.dir, from an earlier run
    (tmp_path / "teacher.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["demo-judge-model", "--config", "teacher.yaml", "--out", "judge"]) == 2
    assert "runs/judge-teacher exists (an earlier run); remove it first" in capsys.readouterr().err
    assert not (tmp_path / "judge").exists()
