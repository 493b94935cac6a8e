"""Metrics of one weight push, returned as a flat `weightsync/...` dict (never logged from here).

Owns: the timers and counters a push fills in, and their names: `weightsync/` version, bytes and counts, the phase
seconds and rates (push, stage, commit, fingerprint, pack, apply, paused; `*_gbps`), how the push ran (apply_direct,
layout_engine, staging_bucketed), `transport/<name>/...`,
`sender/<phase>_seconds` (collective senders), `replica/<name>/<step>_seconds` and `timeline/<state>_s`. Collective
transports keep the live version's host copy after the push returned (push.py, "the tail"), so its metrics
(host_copy_seconds, host_copy_wait_seconds, on_live_seconds, ...) come with the next push and describe the PREVIOUS
version. Cumulative counters (pushes_total, ...) are added by the publisher.
Must never: import Ray, a transport or the registry.
Details (every name and what it measures): docs/design/weightsync.md, "Push metrics".
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

_GB = 1e9


def _rate(num_bytes: float, seconds: float) -> float:
    return num_bytes / seconds / _GB if seconds > 0 else 0.0


@dataclass
class PushMetrics:
    version: int
    transport: str
    num_replicas: int
    started: float = field(default_factory=time.perf_counter)
    bytes: int = 0
    num_tensors: int = 0
    num_buckets: int = 0
    attempts: int = 0
    retries: int = 0
    failed: bool = False
    push_seconds: float = 0.0
    stage_seconds: float = 0.0
    commit_seconds: float = 0.0
    fingerprint_seconds: float = 0.0
    put_seconds: float = 0.0
    rollbacks: int = 0
    out_of_service: int = 0
    store_failed: bool = False
    on_live_seconds: float = 0.0
    paused_seconds: float = 0.0
    pack_seconds: float = 0.0
    layout: str = "hf"
    staging: str = "full"
    paths: set[str] = field(default_factory=set)  # apply paths the replicas reported ("direct", "reload")
    own_paused: float = 0.0  # the longest pause a replica's commit took itself
    failed_commit: bool = False
    host_copy_wait_seconds: float = 0.0
    host_copy_seconds: float = 0.0
    sender_seconds: dict[str, float] = field(default_factory=dict)  # collective transports: the sender's phases
    replica_seconds: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))

    def replica_time(self, replica: str, step: str, seconds: float) -> None:
        self.replica_seconds[replica][step] += seconds

    def finish(self) -> None:
        self.push_seconds = time.perf_counter() - self.started
        self.paused_seconds = max(self.paused_seconds, self.own_paused)

    def as_dict(self, timeline: list[tuple[str, float]] | None = None) -> dict[str, float]:
        p = "weightsync/"
        out: dict[str, float] = {
            p + "version": self.version,
            p + "bytes": self.bytes,
            p + "num_tensors": self.num_tensors,
            p + "num_buckets": self.num_buckets,
            p + "num_replicas": self.num_replicas,
            p + "attempts": self.attempts,
            p + "retries": self.retries,
            p + "failed": float(self.failed),
            p + "rollbacks": self.rollbacks,
            p + "out_of_service": self.out_of_service,
            p + "store_failed": float(self.store_failed),
            p + "push_seconds": self.push_seconds,
            p + "on_live_seconds": self.on_live_seconds,
            p + "paused_seconds": self.paused_seconds,
            p + "host_copy_wait_seconds": self.host_copy_wait_seconds,
            p + "host_copy_seconds": self.host_copy_seconds,
            p + "stage_seconds": self.stage_seconds,
            p + "commit_seconds": self.commit_seconds,
            p + "fingerprint_seconds": self.fingerprint_seconds,
            p + "gbps": _rate(self.bytes, self.push_seconds),
            p + "pack_seconds": self.pack_seconds,
            p + "pack_gbps": _rate(self.bytes, self.pack_seconds),
            p + "stage_gbps": _rate(self.bytes, self.stage_seconds),
            p + "verify_gbps": _rate(self.bytes, self.fingerprint_seconds),
            p + "layout_engine": float(self.layout == "engine"),
            p + "staging_bucketed": float(self.staging == "bucketed"),
            p + "aggregate_gbps": _rate(self.bytes * self.num_replicas, self.stage_seconds),
        }
        t = f"{p}transport/{self.transport}/"
        out[t + "bytes"] = self.bytes
        out[t + "put_seconds"] = self.put_seconds
        out[t + "put_gbps"] = _rate(self.bytes, self.put_seconds)
        for phase, seconds in sorted(self.sender_seconds.items()):
            out[f"{p}sender/{phase}_seconds"] = seconds
        apply_s = max((steps.get("apply", 0.0) for steps in self.replica_seconds.values()), default=0.0)
        out[p + "apply_seconds"] = apply_s
        out[p + "apply_gbps"] = _rate(self.bytes, apply_s)
        if self.paths:
            out[p + "apply_direct"] = float(self.paths == {"direct"})
        for name, steps in sorted(self.replica_seconds.items()):
            r = f"{p}replica/{name}/"
            load = steps.get("load_bucket", 0.0)
            out[r + "load_seconds"] = load
            out[r + "load_gbps"] = _rate(self.bytes, load)
            out[r + "commit_seconds"] = steps.get("commit_update", 0.0)
            for step, seconds in steps.items():
                if step not in ("load_bucket", "commit_update"):
                    out[f"{r}{step}_seconds"] = seconds
        if timeline:
            t0 = timeline[0][1]
            for state, ts in timeline:
                out[f"{p}timeline/{state}_s"] = ts - t0  # a retry's later entry overwrites: last wins
        return out
