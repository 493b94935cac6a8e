"""The push timeline marks (asyncrl/weightsync/trace.py) and their reader (benchmarks/push_timeline.py):
off by default, one line per mark when on, and the reader's per-push offsets and per-bucket summary."""

from __future__ import annotations

import pytest

from asyncrl.weightsync import trace
from tests.conftest import import_benchmark


@pytest.fixture
def timeline():
    return import_benchmark("push_timeline")


def test_marks_are_written_only_when_a_folder_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(trace, "_DIR", None)
    monkeypatch.setattr(trace, "_file", None)
    trace.mark("pub.attempt")
    assert not trace.enabled() and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(trace, "_DIR", str(tmp_path / "t"))
    trace.mark("pub.attempt")
    trace.mark("pub.live")
    (f,) = (tmp_path / "t").iterdir()
    lines = [line.split() for line in f.read_text().splitlines()]
    assert [label for _, label in lines] == ["pub.attempt", "pub.live"]
    assert float(lines[0][0]) <= float(lines[1][0])
    trace._file.close()


def test_the_timeline_splits_pushes_and_folds_the_buckets(tmp_path, timeline):
    (tmp_path / "trace_1.txt").write_text("100.000 pub.attempt\n100.030 pub.live\n200.000 pub.attempt\n200.020 pub.live\n")
    (tmp_path / "trace_2.txt").write_text("100.010 wrk.landed.0\n100.011 wrk.staged.0\n100.012 wrk.landed.1\n"
                                          "100.015 wrk.staged.1\n200.005 wrk.landed.0\n200.006 wrk.staged.0\n")
    rows = [timeline.summarize(p) for p in timeline.pushes(timeline.read(tmp_path))]
    assert len(rows) == 2
    first = rows[0]
    assert first["pub.live"] == pytest.approx(30.0)
    assert first["wrk.landed.first"] == pytest.approx(10.0)
    assert first["wrk.landed.last(1)"] == pytest.approx(12.0) and first["wrk.staged.last(1)"] == pytest.approx(15.0)
    assert first["wrk.bucket_host_ms.max"] == pytest.approx(3.0) and first["wrk.bucket_host_ms.sum"] == pytest.approx(4.0)
    assert rows[1]["pub.live"] == pytest.approx(20.0) and rows[1]["wrk.landed.last(0)"] == pytest.approx(5.0)


def test_grouped_timelines_take_one_median_per_group_after_its_warm_up(tmp_path, timeline, monkeypatch, capsys):
    # two bucket sizes of a bench, each a warm-up and two timed pushes: live at 90, 10, 12 ms, then 80, 20, 24 ms
    lives = [90, 10, 12, 80, 20, 24]
    (tmp_path / "trace_1.txt").write_text("".join(f"{100 * i}.000 pub.attempt\n{100 * i}.{ms:03d} pub.live\n"
                                                  for i, ms in enumerate(lives, start=1)))
    out = tmp_path / "t.json"
    monkeypatch.setattr("sys.argv", ["push_timeline", str(tmp_path), "--group", "3", "--json", str(out)])
    timeline.main()
    import json

    medians = json.loads(out.read_text())["median"]
    assert [m["pub.live"] for m in medians] == [pytest.approx(11.0), pytest.approx(22.0)]
    assert "median of pushes 1-2" in capsys.readouterr().out
    assert timeline.medians([{"a": 5.0}], skip=1) == {"a": 5.0}  # nothing after the warm-up: the one push


def test_a_traced_stretch_that_stalls_writes_every_threads_stack(tmp_path):
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import time
        from asyncrl.weightsync import trace
        def quick():
            with trace.watch():
                time.sleep(0.05)
        def stalled_receive():
            with trace.watch():
                with trace.watch():  # nested: one timer, cancelled with the outer stretch
                    time.sleep(1.0)
            time.sleep(0.6)  # past the stretch: no more dumps
        quick()
        stalled_receive()
    """)
    env = {**__import__("os").environ, "ASYNCRL_PUSH_TRACE": str(tmp_path), "ASYNCRL_PUSH_TRACE_STALL_S": "0.4"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    (stacks,) = tmp_path.glob("stacks_*.txt")
    text = stacks.read_text()
    assert "stalled_receive" in text and "quick" not in text
    assert 1 <= text.count("Timeout (") <= 2  # at 0.4 s and 0.8 s of the 1 s stretch, none after it


def test_a_stall_limit_that_is_not_a_positive_number_is_refused_by_name():
    assert trace._stall_s("2.5") == 2.5
    for bad in ("soon", "0", "-3", "nan"):
        with pytest.raises(ValueError, match="ASYNCRL_PUSH_TRACE_STALL_S must be a number of seconds > 0"):
            trace._stall_s(bad)
