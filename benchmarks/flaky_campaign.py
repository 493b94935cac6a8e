"""Run tests that once failed many times over, each in a fresh pytest, with every core kept busy beside them.

Issue 66's campaign for a test that failed once and was not reproduced: 20 runs with both cores loaded, 0
failures. Each run is `python -m pytest -q -p no:cacheprovider <test id>` (its own Ray, engines and ports, as in
CI); `--hogs` busy-loop processes (default: one per core) run beside it the whole time, at `--hog-nice` (default 15,
the niceness Ray gives its workers: hogs at 0 starve every Ray actor, engines included, which no CI run does; the
first campaign's two-engine fixture did not start in 600 s that way). One JSON row per run goes to `--out` as it ends
(test, run, rc, seconds, the tail of a failure's output), then a summary line per test.

    python benchmarks/flaky_campaign.py --runs 20 --out docs/results/flaky_campaign_cpu_<date>.jsonl \\
        "tests/weightsync/test_collective.py::test_a_failing_export_aborts_the_receivers_at_once[ipc]"
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _hog(nice: int) -> None:
    os.nice(nice)
    while True:
        pass


def run_campaign(tests: list[str], runs: int, hogs: int, out: Path, timeout_s: float,
                 hog_nice: int = 15) -> dict[str, dict[str, int]]:
    """Every test `runs` times (one test after another within each round); returns {test: {passed, failed}}."""
    procs = [mp.Process(target=_hog, args=(hog_nice,), daemon=True) for _ in range(hogs)]
    for p in procs:
        p.start()
    tally = {t: {"passed": 0, "failed": 0} for t in tests}
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        for k in range(1, runs + 1):
            for test in tests:
                t0 = time.monotonic()
                try:
                    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], cwd=ROOT,
                                         capture_output=True, text=True, timeout=timeout_s)
                    rc, tail = res.returncode, (res.stdout + res.stderr)[-3000:]
                except subprocess.TimeoutExpired as exc:
                    rc, tail = 124, f"timed out after {timeout_s} s: {str(exc.stdout or '')[-2000:]}"
                ok = rc == 0
                tally[test]["passed" if ok else "failed"] += 1
                row = {"test": test, "run": k, "rc": rc, "seconds": round(time.monotonic() - t0, 1), "hogs": hogs,
                       "hog_nice": hog_nice, "cpus": os.cpu_count(), **({} if ok else {"tail": tail})}
                with out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"run {k}/{runs} {'ok  ' if ok else 'FAIL'} {row['seconds']:6.1f} s {test}", flush=True)
    finally:
        for p in procs:
            p.terminate()
    return tally


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tests", nargs="+", help="pytest node ids")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--hogs", type=int, default=os.cpu_count() or 2, help="busy-loop processes beside the tests")
    ap.add_argument("--hog-nice", type=int, default=15, help="the hogs' niceness (Ray's workers run at 15)")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="one run's limit")
    ap.add_argument("--out", type=Path, required=True, help="JSON lines, one per run (appended)")
    args = ap.parse_args()
    if args.runs < 1 or args.hogs < 0:
        ap.error("--runs must be >= 1 and --hogs >= 0")
    tally = run_campaign(args.tests, args.runs, args.hogs, args.out, args.timeout_s, args.hog_nice)
    with args.out.open("a") as f:
        for test, n in tally.items():
            f.write(json.dumps({"test": test, "summary": True, **n, "runs": args.runs, "hogs": args.hogs, "hog_nice": args.hog_nice}) + "\n")
            print(f"{test}: {n['passed']} passed, {n['failed']} failed of {args.runs}")
    return 0 if all(n["failed"] == 0 for n in tally.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
