"""benchmarks/chaos_soak.py's judgement of a soak (issue 66), on made-up observations: the accounting identity, the
versions' order, which non-200 answers a kill excuses, latencies by kind and the RSS growth; and which process a kill
takes. The soak itself runs
the real app: `python benchmarks/chaos_soak.py --minutes 60` (docs/BENCHMARKS.md)."""

from __future__ import annotations

import pytest

from tests.conftest import import_benchmark


@pytest.fixture(scope="module")
def soak():
    return import_benchmark("chaos_soak")


def test_the_identity_counts_every_dropped_kind_and_the_waiting(soak):
    buffer = {"buffer/generated": 100.0, "buffer/trained": 64.0, "buffer/dropped_stale": 8.0, "buffer/dropped_invalid": 4.0,
              "buffer/dropped_filtered": 2.0, "buffer/dropped_failed": 4.0, "buffer/waiting": 18.0}
    assert soak.identity_gap(buffer) == 0
    assert soak.identity_gap({**buffer, "buffer/dropped_failed": 0.0}) == 4  # four samples nobody accounts for
    assert soak.identity_gap({}) is None  # (before the first step)


def test_versions_must_be_one_to_n_each_once(soak):
    assert soak.in_order_once([1, 2, 3])
    assert not soak.in_order_once([1, 2, 2, 3]) and not soak.in_order_once([1, 3]) and not soak.in_order_once([2, 1])


def test_only_a_503_inside_a_kills_window_is_excused(soak):
    requests = [(10.0, 0.1, "chat", 200), (101.0, 0.2, "chat", 503), (170.0, 0.1, "completion", 503),
                (102.0, 0.1, "chat_stream", "connection"), (103.0, 0.1, "chat", 500), (99.0, 1.5, "chat", 503),
                (98.0, 1.0, "chat", 503)] + [(t, 0.1, "chat", 200) for t in range(200)]
    out = soak.judge_requests(requests, kills=[100.0], window=60.0)
    assert out["total"] == 207 and out["by_status"] == {"200": 201, "503": 4, "connection": 1, "500": 1}
    # the 503 at 101 s is the kill's, and so is the one in flight at it (99 s for 1.5 s); the one at 170 s is past its
    # window, the one that ended before the kill (98 s for 1 s) came before it; a dropped connection or a 500 never is
    assert [(u["t"], u["status"]) for u in out["unexpected"]] == [(170.0, 503), (102.0, "connection"), (103.0, 500),
                                                                  (98.0, 503)]
    assert out["ok_share"] == pytest.approx(201 / 207)
    # the 99 % bound is judged away from the kill: 139 of the 200s, the one at 10 s, and the 503s at 170 and 98 s
    assert out["outside_windows"] == 142 and out["outside_ok_share"] == pytest.approx(140 / 142)


def test_latencies_are_of_answered_requests_by_kind(soak):
    requests = [(0.0, s, "chat", 200) for s in (0.1, 0.2, 0.3, 0.4)] + [(0.0, 9.0, "chat", 503), (0.0, 1.0, "completion", 200)]
    lat = soak.latency_figures(requests)
    assert lat["chat"]["count"] == 4 and lat["chat"]["max"] == 0.4 and lat["chat"]["mean"] == pytest.approx(0.25)
    assert lat["completion"]["p99"] == 1.0


def test_rss_growth_is_held_to_the_reference_minute_for_processes_alive_through_the_end(soak):
    mb = 2**20
    # engine core 2 was killed and replaced by 3 at 600 s; 4 started at 1500 s, too young at the end to be judged
    samples = [(0.0, {"trainer 1": 100 * mb}), (600.0, {"trainer 1": 200 * mb, "engine core 2": 300 * mb}),
               (630.0, {"trainer 1": 200 * mb, "engine core 3": 100 * mb}),  # (loading)
               (1230.0, {"trainer 1": 210 * mb, "engine core 3": 280 * mb}),
               (1800.0, {"trainer 1": 220 * mb, "engine core 3": 294 * mb, "engine core 4": 300 * mb})]
    growth = soak.rss_growth(samples, reference_s=600.0)
    assert list(growth) == ["engine core 3", "trainer 1"]
    assert growth["trainer 1"]["growth"] == pytest.approx(0.10)  # from 200 at the run's 600 s
    assert growth["engine core 3"]["growth"] == pytest.approx(0.05)  # from 280, 600 s into its own life
    # every 300 s of its life, and the last sample
    assert growth["trainer 1"]["series_mb"] == [[0.0, 100.0], [600.0, 200.0], [1230.0, 210.0], [1800.0, 220.0]]
    assert growth["engine core 3"]["series_mb"] == [[630.0, 100.0], [1230.0, 280.0], [1800.0, 294.0]]
    assert soak.rss_growth(samples, reference_s=5000.0) == {}


def test_a_kill_takes_the_oldest_process_of_a_title_never_a_fork_of_it(soak):
    """The 49th session's soak killed a checkpoint writer the learner rank had forked (it keeps the rank's title): pids
    had wrapped, and the lowest pid was taken. The rank (pid 32371, parent the raylet 100) is the victim, not its fork
    (pid 569), however the pids sort."""
    import types

    rank, fork, other = (types.SimpleNamespace(pid=p) for p in (32371, 569, 40000))
    rows = [(1_000.0, 32371, fork), (500.0, 100, rank), (900.0, 100, other)]
    assert soak.victims_of(rows) == [rank, other]
    assert soak.victims_of([(1_000.0, 32371, fork)]) == [fork]  # (its parent gone from the listing: it is the process)
    assert soak.victims_of([]) == []
    # a Ray actor is a raylet's child: a fork left by a killed rank (parent 1) or any other process that kept the
    # title is never taken for it (a CI soak killed one with the rank's title: no restart followed, and training went on)
    orphan = types.SimpleNamespace(pid=24239)
    assert soak.victims_of([(400.0, 1, orphan), *rows], parents={100}) == [rank, other]
    assert soak.victims_of([(400.0, 1, orphan)], parents={100}) == []


def test_a_bad_set_is_refused_naming_it(soak, capsys):
    for bad, says in (("ab=1", "expected SECTION.KEY=VALUE"), ("a.b", "expected SECTION.KEY=VALUE"), ("a.b=[", "not YAML")):
        with pytest.raises(SystemExit):
            soak.parse_args(["--set", bad])
        assert says in capsys.readouterr().err
    assert soak.parse_args(["--set", "weightsync.transport=ipc"]).overrides == ["weightsync.transport=ipc"]
    with pytest.raises(SystemExit):
        soak.parse_args(["--settle", "-1"])
    assert "--settle -1: seconds, >= 0" in capsys.readouterr().err


def test_training_went_on_needs_each_learner_kills_restart_and_a_step_past_the_last_kill(soak):
    """The check of the end, and the settle phase's wait before it."""
    run = soak.Soak(soak.parse_args([]))
    run.kills = [{"what": "learner rank", "step": 10}, {"what": "engine", "step": 15}]
    assert run.went_on(16, 1)
    assert not run.went_on(15, 1)  # not past the engine kill's step
    assert not run.went_on(16, 0)  # the learner kill restarted nothing
    assert not run.went_on(None, None)
