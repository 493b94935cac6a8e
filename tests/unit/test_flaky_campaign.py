"""benchmarks/flaky_campaign.py: each test id run in a fresh pytest, a row per run, the tally by test."""

from __future__ import annotations

import json

from tests.conftest import import_benchmark


def test_a_campaign_counts_each_runs_result_and_keeps_a_failures_output(tmp_path):
    campaign = import_benchmark("flaky_campaign")
    counter = tmp_path / "count"
    test_file = tmp_path / "test_sometimes.py"
    test_file.write_text(
        "from pathlib import Path\n"
        f"COUNT = Path({str(counter)!r})\n"
        "def test_fails_on_its_second_run():\n"
        "    n = int(COUNT.read_text()) + 1 if COUNT.exists() else 1\n"
        "    COUNT.write_text(str(n))\n"
        "    assert n != 2, 'the second run fails'\n")
    out = tmp_path / "rows.jsonl"
    tally = campaign.run_campaign([str(test_file)], runs=3, hogs=1, out=out, timeout_s=120)
    assert tally == {str(test_file): {"passed": 2, "failed": 1}}
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["run"], r["rc"]) for r in rows] == [(1, 0), (2, 1), (3, 0)]
    assert "the second run fails" in rows[1]["tail"] and "tail" not in rows[0] and rows[0]["hogs"] == 1
