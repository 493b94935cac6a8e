"""Line up the push marks of `ASYNCRL_PUSH_TRACE=DIR` (asyncrl/weightsync/trace.py), push by push.

    python benchmarks/push_timeline.py DIR [--skip 1] [--group N] [--json out.json]

Every process that took part wrote DIR/trace_<pid>.txt (`<wall time> <label>` lines). A push starts
at the publisher's `pub.attempt` mark; each mark after it (until the next push) is shown as
milliseconds from that start. The per-bucket marks of a worker (`wrk.landed.K`: bucket K complete
on this worker; `wrk.staged.K`: its checksum and copy enqueued) are summed up as the first and last
bucket and the longest host time spent on one bucket. The last table is the median over the
pushes after the first `--skip` (warm-up); with `--group N`, one such table per N pushes in turn (a
bench of several bucket sizes: each size's warm-up and timed pushes).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def read(folder: Path) -> list[tuple[float, int, str]]:
    marks = []
    for f in sorted(folder.glob("trace_*.txt")):
        pid = int(f.stem.split("_")[1])
        for line in f.read_text().splitlines():
            t, _, label = line.partition(" ")
            if label:
                marks.append((float(t), pid, label))
    return sorted(marks)


def pushes(marks: list[tuple[float, int, str]]) -> list[list[tuple[float, int, str]]]:
    starts = [i for i, (_, _, label) in enumerate(marks) if label == "pub.attempt"]
    return [marks[a:b] for a, b in zip(starts, starts[1:] + [len(marks)])]


def summarize(push: list[tuple[float, int, str]]) -> dict[str, float]:
    """{label: ms from the push's start} (the first time each label was passed in the push; per-bucket
    marks folded into first / last and the longest host time on one bucket)."""
    t0 = push[0][0]
    out: dict[str, float] = {}
    landed: dict[tuple[int, int], float] = {}
    staged: dict[tuple[int, int], float] = {}
    for t, pid, label in push:
        ms = 1e3 * (t - t0)
        head, _, k = label.rpartition(".")
        if head in ("wrk.landed", "wrk.staged") and k.isdigit():
            (landed if head == "wrk.landed" else staged)[(pid, int(k))] = ms
            continue
        out.setdefault(label, ms)
    if landed:
        last = max(k for _, k in landed)
        out["wrk.landed.first"] = min(v for (_, k), v in landed.items() if k == 0)
        out[f"wrk.landed.last({last})"] = max(v for (_, k), v in landed.items() if k == last)
        out[f"wrk.staged.last({last})"] = max(v for (_, k), v in staged.items() if k == last) if staged else float("nan")
        out["wrk.bucket_host_ms.max"] = max(staged[key] - landed[key] for key in staged if key in landed)
        out["wrk.bucket_host_ms.sum"] = sum(staged[key] - landed[key] for key in staged if key in landed)
    return out


def medians(rows: list[dict[str, float]], skip: int) -> dict[str, float]:
    """The median of each label over `rows` after the first `skip` (or over all of them if none is left)."""
    timed = rows[skip:] or rows
    labels = {k for row in timed for k in row}
    return {k: statistics.median(row[k] for row in timed if k in row) for k in labels}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--skip", type=int, default=1, help="pushes left out of the median (warm-up), in each group")
    ap.add_argument("--group", type=int, default=0,
                    help="pushes per group, one median each (weightsync.py --bucket-mb 64,256 --repeats 3: 4, a "
                         "warm-up and 3 pushes per size); 0: one group of every push")
    ap.add_argument("--json", type=Path, help="write every push's marks and the medians here")
    args = ap.parse_args()
    if args.group < 0 or args.skip < 0:
        ap.error("--group and --skip must be >= 0")
    rows = [summarize(p) for p in pushes(read(args.folder))]
    if not rows:
        raise SystemExit(f"no pushes (no pub.attempt mark) in {args.folder}")
    for i, row in enumerate(rows):
        print(f"push {i}: " + "  ".join(f"{k} {v:.2f}" for k, v in sorted(row.items(), key=lambda kv: kv[1])))
    size = args.group or len(rows)
    groups = [rows[a:a + size] for a in range(0, len(rows), size)]
    out = []
    for g, group in enumerate(groups):
        median = medians(group, args.skip)
        out.append(median)
        first = g * size
        print(f"\nmedian of pushes {first + min(args.skip, len(group) - 1)}-{first + len(group) - 1}, ms from the publisher's attempt:")
        for k, v in sorted(median.items(), key=lambda kv: kv[1]):
            print(f"  {v:9.2f}  {k}")
    if args.json:
        args.json.write_text(json.dumps({"pushes": rows, "median": out[0] if len(out) == 1 else out}, indent=1))


if __name__ == "__main__":
    main()
