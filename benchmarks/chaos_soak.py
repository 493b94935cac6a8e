"""Chaos soak (issue 66): `make serve`'s app under API load for a long run with faults recurring, then SIGTERM.

`asyncrl serve` on a copy of deploy/rlhf.yaml (the CPU demo; its training made endless, `trainer.max_restarts` 1 and a
checkpoint every --checkpoint-every steps so a learner can restart) while --concurrency clients of the `openai`
package send chat and completion requests (every other one streamed) to the app's HTTP API. Every --kill-every
minutes an engine's EngineCore is killed (SIGKILL); at --learner-kill-at minutes one learner rank is. After
--minutes the app gets SIGTERM. It reports requests by status and latency, steps and versions, the buffer's
accounting identity at every status poll (and the ones around each kill), restarts, the RSS of every long-lived
process over time, the exit and what is left running, and checks:

- 0 samples lost: generated = trained + every dropped_* + waiting, at every poll, at each kill and at the end;
- versions published once each and in order (the run's metrics.jsonl);
- >= 99 % of the API requests outside the kills' recovery windows (--window s) answered 200, and every non-200
  answer a 503 inside such a window (a killed engine's requests have nowhere else to go until it is replaced);
- the RSS of every process alive from --rss-reference minutes to the end within +15 % of its value then;
- exit 0 after SIGTERM within 30 s, and none of the app's processes left running.

    python benchmarks/chaos_soak.py --minutes 60 --kill-every 10 --out docs/results/chaos_soak_cpu_DATE.jsonl

Its short variant runs in `make test` (tests/e2e/test_chaos_soak.py): 2 minutes, one kill of each, over gloo.

Exit status 1 when a check fails. The run's own files (config, log, metrics) go under --run-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
DROPPED = ("buffer/dropped_stale", "buffer/dropped_invalid", "buffer/dropped_filtered", "buffer/dropped_failed")
# Command-line markers of the app's processes (RSS is sampled per process; leftovers are looked for after the exit)
PROCESSES = {"engine core": "VLLM::EngineCore", "engine replica": "ServeReplica:asyncrl:GeneratorEngine",
             "trainer": "ServeReplica:asyncrl:Trainer", "gateway": "ServeReplica:asyncrl:GeneratorGateway",
             "learner rank": "ray::LearnerRank", "buffer": "ray::BufferActor", "serve controller": "ServeController",
             "proxy": "ProxyActor", "raylet": "raylet", "gcs": "gcs_server", "serve cli": "asyncrl serve"}
LOG_TAIL_LINES = 120  # of the app's log, in the report of a run with a failed check
LEFTOVER_MARKERS = ("VLLM::", "ray::", "raylet", "gcs_server", "multiprocessing.spawn")  # (spawned helpers too)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "deploy/rlhf.yaml", help="the Serve config to soak")
    ap.add_argument("--minutes", type=float, default=60.0, help="from the first step to the SIGTERM")
    ap.add_argument("--kill-every", type=float, default=10.0, help="minutes between engine kills (0: none)")
    ap.add_argument("--learner-kill-at", type=float, default=None,
                    help="minute of the one learner-rank kill (default: 45 %% of --minutes; negative: none)")
    ap.add_argument("--engine-replicas", type=int, default=2,
                    help="engine replicas kept (min = initial); with one, the API is down while a killed one is replaced")
    ap.add_argument("--concurrency", type=int, default=16, help="API clients at once")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens per API request")
    ap.add_argument("--window", type=float, default=60.0, help="seconds after a kill in which a 503 is expected")
    ap.add_argument("--settle", type=float, default=0.0,
                    help="seconds the load may go on past --minutes while training has not gone past the last kill "
                         "(a slow machine's engine replacement), before the SIGTERM")
    ap.add_argument("--rss-every", type=float, default=30.0, help="seconds between RSS samples")
    ap.add_argument("--rss-reference", type=float, default=10.0,
                    help="minute whose RSS the end is held to (at most a third of --minutes)")
    ap.add_argument("--checkpoint-every", type=int, default=20, help="checkpoint.interval_steps (the learner's restart point)")
    ap.add_argument("--run-dir", type=Path, default=ROOT / "runs/soak", help="the run's config, log, metrics, checkpoints")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds to the first step")
    ap.add_argument("--out", type=Path, default=None, help="append the JSON row to this file")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a config value of the app (VALUE read as YAML), e.g. weightsync.transport=gloo; repeatable")
    ap.add_argument("--free-ports", action="store_true",
                    help="serve the API on free ports instead of the config's (a machine where they are taken: CI)")
    a = ap.parse_args(argv)
    if a.settle < 0:
        ap.error(f"--settle {a.settle:g}: seconds, >= 0")
    for item in a.overrides:
        key, eq, value = item.partition("=")
        if not eq or "." not in key:
            ap.error(f"--set {item!r}: expected SECTION.KEY=VALUE")
        try:
            yaml.safe_load(value)
        except yaml.YAMLError as err:
            ap.error(f"--set {item!r}: the value is not YAML ({str(err).splitlines()[0]})")
    if a.minutes <= 0 or a.concurrency <= 0 or a.window <= 0 or a.rss_every <= 0:
        ap.error("--minutes, --concurrency, --window and --rss-every must be positive")
    if a.learner_kill_at is None:
        a.learner_kill_at = 0.45 * a.minutes
    return a


# ---- pure checks (tests/unit/test_chaos_soak.py) ---------------------------------------------------------------

def identity_gap(buffer: dict[str, float]) -> float | None:
    """generated - (trained + every dropped_* + waiting) of a status's buffer snapshot (0: nothing lost); None for an
    empty snapshot (before the first step)."""
    if "buffer/generated" not in buffer:
        return None
    return buffer["buffer/generated"] - (buffer.get("buffer/trained", 0.0) + sum(buffer.get(k, 0.0) for k in DROPPED)
                                         + buffer.get("buffer/waiting", 0.0))


def victims_of(rows: list[tuple[float, int, Any]], parents: set[int] | None = None) -> list[Any]:
    """`rows`: (create time, parent pid, process) of the processes whose title names what is to be killed. The processes
    themselves, oldest first, and not a child forked with its parent's title (a learner rank's checkpoint writers):
    pids wrap, so the lowest is not the oldest. With `parents` (a Ray actor's: the raylets), only their children: a
    fork whose rank is gone, or any other process that kept the title, is not the actor."""
    pids = {p.pid for *_, p in rows}
    return [p for _, ppid, p in sorted(rows, key=lambda r: r[0])
            if ppid not in pids and (parents is None or ppid in parents)]


def in_order_once(versions: list[int]) -> bool:
    """Whether the published versions are 1, 2, ... n, each once."""
    return versions == list(range(1, len(versions) + 1))


def judge_requests(requests: list[tuple[float, float, str, Any]], kills: list[float], window: float) -> dict[str, Any]:
    """`requests`: (start time, seconds, kind, status: 200, another HTTP code, or a word for a transport error).
    A request is in a window if it ran at some time in [kill, kill + window] of some kill (in flight at the kill
    included). The counts by status, the share answered 200 of all and of those outside every window, and the non-200
    answers that are not a 503 in a window (each such one fails the soak)."""
    by_status: dict[str, int] = {}
    unexpected = []
    outside = outside_ok = 0
    for t, seconds, kind, status in requests:
        by_status[str(status)] = by_status.get(str(status), 0) + 1
        in_window = any(t <= k + window and t + seconds >= k for k in kills)
        outside += not in_window
        outside_ok += not in_window and status == 200
        if status != 200 and not (status == 503 and in_window):
            unexpected.append({"t": round(t, 1), "kind": kind, "status": status})
    total = len(requests)
    return {"total": total, "ok_share": by_status.get("200", 0) / total if total else 0.0, "by_status": by_status,
            "outside_windows": outside, "outside_ok_share": outside_ok / outside if outside else 0.0,
            "unexpected": unexpected}


def latency_figures(requests: list[tuple[float, float, str, Any]]) -> dict[str, dict[str, float]]:
    """Per kind, of the answered (200) requests: count, mean, p50, p90, p99, max seconds."""
    out: dict[str, dict[str, float]] = {}
    for kind in sorted({k for _, _, k, _ in requests}):
        xs = sorted(s for _, s, k, st in requests if k == kind and st == 200)
        if not xs:
            continue

        def q(p: float) -> float:
            return xs[min(len(xs) - 1, int(p * len(xs)))]

        out[kind] = {"count": len(xs), "mean": statistics.fmean(xs), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99),
                     "max": xs[-1]}
    return out


def rss_growth(samples: list[tuple[float, dict[str, float]]], reference_s: float,
               series_s: float = 300.0) -> dict[str, dict[str, Any]]:
    """`samples`: (seconds since the first step, {process: RSS bytes}). For every process in the last sample: its RSS
    `reference_s` into its own life (at the run's `reference_s` for one there from the start; a replacement started
    later, e.g. an engine replica after a kill, from its own start: its first minutes are its load, not growth) and at
    the end, and the growth (end / then - 1); a process younger than that at the end is not judged. `series_mb`: its
    RSS about every `series_s` of its life, to tell a steady leak from steps at the kills."""
    if not samples:
        return {}
    end = samples[-1][1]
    out = {}
    for name in sorted(end):
        born = next(t for t, by in samples if name in by)
        ref = next((by[name] for t, by in samples if t >= born + reference_s and name in by), None)
        if ref:
            series, last = [], None
            for t, by in samples:
                if name in by and (last is None or t >= last + series_s or by is end):
                    series.append([t, round(by[name] / 2**20, 1)])
                    last = t
            out[name] = {"reference_mb": ref / 2**20, "end_mb": end[name] / 2**20, "growth": end[name] / ref - 1,
                         "series_mb": series}
    return out


# ---- the run ------------------------------------------------------------------------------------------------------

@dataclass
class Soak:
    args: argparse.Namespace
    launched: float = 0.0  # wall clock (time.time) of the app's launch: processes created after it are the app's
    t0: float = 0.0  # monotonic time of the first step
    url: str = ""
    requests: list[tuple[float, float, str, Any]] = field(default_factory=list)
    statuses: list[dict[str, Any]] = field(default_factory=list)
    kills: list[dict[str, Any]] = field(default_factory=list)
    rss: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    private_rss: list[tuple[float, dict[str, float]]] = field(default_factory=list)  # RSS less shared pages
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    push_timeout_s: float = 120.0  # weightsync.timeout_s of the app

    def now(self) -> float:
        return time.monotonic() - self.t0

    def processes(self) -> list[tuple[str, Any]]:
        """(label, psutil.Process) of the app's processes (created since the launch), by their command line."""
        import psutil

        out = []
        for p in psutil.process_iter(["cmdline", "create_time", "status"]):
            try:
                if p.info["create_time"] < self.launched - 1 or p.info["status"] == psutil.STATUS_ZOMBIE:
                    continue
                text = " ".join(p.info["cmdline"] or [])
                label = next((name for name, marker in PROCESSES.items() if marker in text), None)
                if label is not None:
                    out.append((label, p))
            except psutil.Error:
                continue
        return out

    def table(self) -> list[list[Any]]:
        """The app's processes now: [label, pid, parent pid, seconds since launch, title], for a failed run's report."""
        import psutil

        rows = []
        for label, p in self.processes():
            try:
                rows.append([label, p.pid, p.ppid(), round(p.create_time() - self.launched, 1), " ".join(p.cmdline())[:60]])
            except psutil.Error:  # gone since the listing
                continue
        return rows

    async def status(self, client: Any) -> dict[str, Any] | None:
        try:
            r = await client.get(f"{self.url}/train/status", timeout=30)
            return r.json() if r.status_code == 200 else None
        except Exception:  # noqa: BLE001 - the app is restarting a part: the next poll sees it
            return None

    async def monitor(self, client: Any) -> None:
        while not self.stop.is_set():
            s = await self.status(client)
            if s is not None:
                gap = identity_gap(s.get("buffer") or {})
                self.statuses.append({"t": round(self.now(), 1), "state": s.get("state"), "step": s.get("step"),
                                      "policy_version": s.get("policy_version"), "restarts": s.get("learner_restarts"),
                                      "gap": gap, "buffer": s.get("buffer")})
                if s.get("state") in ("failed", "finished"):
                    self.stop.set()
                    return
            await asyncio.sleep(5.0)

    async def sample_rss(self) -> None:
        while not self.stop.is_set():
            by_process: dict[str, float] = {}
            private: dict[str, float] = {}  # RSS less shared pages (the object store's shared memory a process touched)
            for label, p in self.processes():
                try:
                    info = p.memory_info()
                    by_process[f"{label} {p.pid}"] = float(info.rss)
                    private[f"{label} {p.pid}"] = float(info.rss - getattr(info, "shared", 0))
                except Exception:  # noqa: BLE001 - gone between the listing and the read
                    continue
            t = round(self.now(), 1)
            self.rss.append((t, by_process))
            self.private_rss.append((t, private))
            try:
                await asyncio.wait_for(self.stop.wait(), self.args.rss_every)
            except asyncio.TimeoutError:
                pass

    async def client(self, i: int, api: Any, model: str) -> None:
        import openai

        k = i
        while not self.stop.is_set():
            kind = ("chat", "completion")[k % 2] + ("_stream" if (k // 2) % 2 else "")
            k += 1
            t, start = self.now(), time.monotonic()
            status: Any = 200
            try:
                if kind.startswith("chat"):
                    out = await api.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": f"What is {10 + k % 80} + {k % 50}?"}],
                        max_tokens=self.args.max_tokens, stream=kind.endswith("stream"))
                else:
                    out = await api.completions.create(model=model, prompt=f"{k % 90} + {k % 40} =",
                                                       max_tokens=self.args.max_tokens, stream=kind.endswith("stream"))
                if kind.endswith("stream"):
                    async for _ in out:
                        pass
            except openai.APIStatusError as err:
                status = err.status_code
            except openai.APITimeoutError:
                status = "timeout"
            except openai.APIConnectionError:
                status = "connection"
            except openai.APIError as err:  # an error event in a stream that had begun: the code the server put in it
                code = str(err.code)
                status = int(code) if code.isdigit() else f"APIError: {err.message[:120]}"
            except Exception as err:  # noqa: BLE001 - e.g. a stream cut mid-way: counted, never fatal
                status = type(err).__name__
            self.requests.append((round(t, 3), time.monotonic() - start, kind, status))
            if status != 200:
                await asyncio.sleep(0.5)  # (a client backs off a little after an error)

    def kill(self, what: str, marker: str) -> None:
        import psutil

        # the process itself, not a child forked with its title (a learner rank's checkpoint writers); oldest first;
        # a Ray actor (the learner rank) only as a child of a raylet
        rows, raylets = [], set()
        for label, p in self.processes():
            try:
                if label == "raylet":
                    raylets.add(p.pid)
                if marker in " ".join(p.cmdline()):
                    rows.append((p.create_time(), p.ppid(), p))
            except psutil.Error:  # gone since the listing
                continue
        victims = victims_of(rows, raylets if marker.startswith("ray::") else None)
        last = self.statuses[-1] if self.statuses else {}
        record = {"what": what, "t": round(self.now(), 1), "step": last.get("step"), "gap_before": last.get("gap"),
                  "candidates": [[p.pid, ppid, round(created - self.launched, 1)] for created, ppid, p in rows]}
        if victims:
            try:
                victims[0].send_signal(signal.SIGKILL)
                record["pid"] = victims[0].pid
            except psutil.Error as err:
                record["error"] = str(err)
        else:
            record["error"] = f"no {marker} process" + (" under a raylet" if rows else "")
        self.kills.append(record)
        print(f"[soak] t={record['t']:.0f} s step {record.get('step')}: killed {what} {record.get('pid', record.get('error'))} "
              f"of {record['candidates']} (pid, parent, s after launch)", flush=True)

    async def faults(self) -> None:
        a = self.args
        plan = [(a.kill_every * 60 * k, "engine", "VLLM::EngineCore")
                for k in range(1, int(a.minutes / a.kill_every) + 1) if a.kill_every > 0 and a.kill_every * k < a.minutes]
        if 0 <= a.learner_kill_at < a.minutes:
            plan.append((a.learner_kill_at * 60, "learner rank", "ray::LearnerRank"))
        for at, what, marker in sorted(plan):
            try:
                await asyncio.wait_for(self.stop.wait(), max(0.0, at - self.now()))
                return
            except asyncio.TimeoutError:
                self.kill(what, marker)

    async def run(self) -> dict[str, Any]:
        import httpx
        import openai

        a = self.args
        cfg = yaml.safe_load(a.config.read_text())
        app = cfg["applications"][0]["args"]
        a.run_dir.mkdir(parents=True, exist_ok=True)
        app.setdefault("trainer", {}).update({"total_steps": 1_000_000, "max_restarts": 1})
        scaling = app.setdefault("generator", {}).setdefault("autoscaling", {})
        scaling.update({"min_replicas": a.engine_replicas, "initial_replicas": a.engine_replicas,
                        "max_replicas": max(a.engine_replicas, int(scaling.get("max_replicas", 1)))})
        app.setdefault("checkpoint", {}).update({"dir": str(a.run_dir / "checkpoints"), "interval_steps": a.checkpoint_every})
        app.setdefault("logging", {}).update({"dir": str(a.run_dir)})
        for item in a.overrides:
            key, _, value = item.partition("=")
            *sections, last = key.split(".")
            node = app
            for name in sections:
                node = node.setdefault(name, {})
            node[last] = yaml.safe_load(value)
        if a.free_ports:
            from asyncrl.weightsync.collective import free_port

            cfg["http_options"]["port"] = free_port("127.0.0.1")
            if "direct_http_port" in app.get("generator", {}):
                app["generator"]["direct_http_port"] = free_port("127.0.0.1")
        self.push_timeout_s = float(app.get("weightsync", {}).get("timeout_s", 120.0))
        config = a.run_dir / "soak.yaml"
        config.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.url = f"http://{cfg['http_options']['host']}:{cfg['http_options']['port']}"
        log = open(a.run_dir / "serve.log", "w")
        self.launched = time.time()
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a cluster of its own, as `make serve`
        proc = subprocess.Popen([str(ROOT / ".venv/bin/asyncrl"), "serve", str(config)], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, env=env)
        report: dict[str, Any] = {"benchmark": "chaos_soak", "config": str(a.config), "minutes": a.minutes,
                                  "kill_every_min": a.kill_every, "learner_kill_at_min": a.learner_kill_at,
                                  "concurrency": a.concurrency, "engine_replicas": a.engine_replicas}
        async with httpx.AsyncClient() as http:
            start = time.monotonic()
            while True:  # to the first step
                s = await self.status(http)
                if s is not None and (s.get("step") or 0) >= 1:
                    break
                if proc.poll() is not None or time.monotonic() - start > a.start_timeout:
                    proc.kill()
                    raise RuntimeError(f"the app did not reach its first step in {a.start_timeout:.0f} s "
                                       f"(exit {proc.poll()}; see {a.run_dir / 'serve.log'})")
                await asyncio.sleep(2.0)
            report["start_s"] = time.monotonic() - start
            self.t0 = time.monotonic()
            print(f"[soak] first step after {report['start_s']:.0f} s; {a.minutes:g} minutes of load and faults", flush=True)
            api = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="-", max_retries=0, timeout=60.0)
            model = (await api.models.list()).data[0].id  # the name the app serves the model under
            tasks = [asyncio.create_task(self.monitor(http)), asyncio.create_task(self.sample_rss()),
                     asyncio.create_task(self.faults())]
            tasks += [asyncio.create_task(self.client(i, api, model)) for i in range(a.concurrency)]
            try:
                await asyncio.wait_for(self.stop.wait(), a.minutes * 60)
            except asyncio.TimeoutError:
                pass
            settle_end = time.monotonic() + a.settle
            while not self.stop.is_set() and time.monotonic() < settle_end and not (
                    self.statuses and self.went_on(self.statuses[-1]["step"], self.statuses[-1]["restarts"])):
                await asyncio.sleep(2.0)
            report["settle_s"] = round(max(0.0, self.now() - a.minutes * 60), 1)
            self.stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            final = await self.status(http)
        report["processes_at_end"] = self.table()
        report["final"] = {k: final.get(k) for k in ("state", "step", "policy_version", "learner_restarts", "error")} if final else None
        gap_end = identity_gap((final or {}).get("buffer") or {})
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            rc = None
        exit_s = time.monotonic() - t
        log.close()
        await asyncio.sleep(5.0)
        left = [f"{p.pid} {' '.join(p.cmdline())[:80]}" for _, p in self.processes()
                if any(m in " ".join(p.cmdline()) for m in LEFTOVER_MARKERS)]
        if rc is None:
            os.killpg(proc.pid, signal.SIGKILL)
        return self.judge(report, gap_end, rc, exit_s, left)

    def went_on(self, step: int | None, restarts: int | None) -> bool:
        """Whether a status's `step` and `restarts` show each learner kill's restart done and a step past the last kill."""
        return (restarts == sum(k["what"] == "learner rank" for k in self.kills)
                and (step or 0) > max((k.get("step") or 0 for k in self.kills), default=0))

    def judge(self, report: dict[str, Any], gap_end: float | None, rc: int | None, exit_s: float,
              left: list[str]) -> dict[str, Any]:
        a = self.args
        metrics = a.run_dir / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        steps_logged = [r for r in records if "train/step" in r]
        versions = [int(r["weightsync/version"]) for r in steps_logged if "weightsync/version" in r]
        # a push that met a killed engine waits for its replacement at most, never out its deadline
        sync_max = max((float(r.get("time/sync_s", 0.0)) for r in steps_logged), default=0.0)
        kill_times = [k["t"] for k in self.kills]
        api = judge_requests(self.requests, kill_times, a.window)
        gaps = [s["gap"] for s in self.statuses if s["gap"] is not None]
        for k in self.kills:  # the first poll after each kill
            after = next((s for s in self.statuses if s["t"] > k["t"] and s["gap"] is not None), None)
            k["gap_after"] = after and after["gap"]
        reference = min(a.rss_reference * 60, a.minutes * 60 / 3)
        series_s = max(60.0, a.minutes * 5)  # about 12 points a run
        growth = rss_growth(self.rss, reference, series_s)
        steps = [s["step"] for s in self.statuses if s["step"] is not None]
        final = report.get("final") or {}
        checks = {
            "no_sample_lost": gap_end == 0 and all(g == 0 for g in gaps)
                              and all(k.get("gap_before") in (0, None) and k.get("gap_after") in (0, None) for k in self.kills),
            "versions_in_order_once": bool(versions) and in_order_once(versions),
            # a 503 while a killed engine is replaced is allowed (below); away from the kills 99 % must be answered
            "api_99pct_200_outside_windows": api["outside_ok_share"] >= 0.99,
            "non_200_only_503_in_windows": not api["unexpected"],
            "rss_within_15pct": bool(growth) and all(g["growth"] <= 0.15 for g in growth.values()),
            "exit_0_within_30s": rc == 0 and exit_s <= 30.0,
            "nothing_left": not left,
            "kills_done": all("pid" in k for k in self.kills),
            "no_push_waited_out_its_deadline": sync_max < self.push_timeout_s,
            # each learner kill restarted the learner once, and training went on past the last kill
            "training_went_on": final.get("state") == "training"
                                and self.went_on(final.get("step"), final.get("learner_restarts")),
        }
        report.update({
            "requests": {k: v for k, v in api.items() if k != "unexpected"}, "unexpected_non_200": api["unexpected"][:50],
            "latency_s": latency_figures(self.requests), "steps": max(steps, default=0),
            # over the load's whole time: --minutes and any settle past them
            "steps_per_min": max(steps, default=0) / (a.minutes + report.get("settle_s", 0.0) / 60),
            "versions": len(versions), "sync_s_max": sync_max,
            "identity_checks": len(gaps) + 1, "identity_gap_end": gap_end, "kills": self.kills,
            "statuses": [{k: s[k] for k in ("t", "state", "step", "restarts")} for s in self.statuses],
            "rss_reference_s": reference, "rss": growth, "rss_samples": len(self.rss),
            "private_rss": rss_growth(self.private_rss, reference, series_s),
            "exit_code": rc, "exit_s": exit_s, "left": left, "checks": checks, "passed": all(checks.values()),
        })
        if not report["passed"]:  # what the app said, where a failed check is read (CI keeps no run directory)
            log = a.run_dir / "serve.log"
            report["log_tail"] = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:] if log.exists() else []
        return report


def summary(r: dict[str, Any]) -> str:
    req = r["requests"]
    lines = [f"[soak] {r['minutes']:g} min, {r['steps']} steps ({r['steps_per_min']:.1f}/min), {r['versions']} versions, "
             f"final {r['final']}",
             f"[soak] requests {req['total']}: {req['by_status']} ({req['ok_share']:.2%} answered 200; "
             f"{req['outside_ok_share']:.2%} of the {req['outside_windows']} outside the kills' windows); "
             f"unexpected non-200: {len(r['unexpected_non_200'])}",
             *(f"[soak] latency {k}: mean {v['mean']:.3f} s, p50 {v['p50']:.3f}, p99 {v['p99']:.3f}, max {v['max']:.2f} "
               f"({v['count']})" for k, v in r["latency_s"].items()),
             *(f"[soak] kill {k['what']} at {k['t']:.0f} s (step {k['step']}): gap before {k.get('gap_before')}, after "
               f"{k.get('gap_after')}" for k in r["kills"]),
             *(f"[soak] rss {name}: {v['reference_mb']:.0f} -> {v['end_mb']:.0f} MiB ({v['growth']:+.1%})"
               for name, v in r["rss"].items()),
             f"[soak] SIGTERM: exit {r['exit_code']} in {r['exit_s']:.1f} s; left running: {len(r['left'])}",
             "[soak] checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in r["checks"].items()),
             *(f"[soak] status t={s['t']} {s['state']} step {s['step']} restarts {s['restarts']}"
               for s in r.get("statuses", []) if not r["passed"]),
             *(f"[soak] at the end: {row}" for row in r.get("processes_at_end", []) if not r["passed"]),
             *(f"[app] {line}" for line in r.get("log_tail", []))]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(Soak(args).run())
    print(summary(report), flush=True)
    line = json.dumps(report)
    print(line)
    if args.out is not None:
        with args.out.open("a") as f:
            f.write(line + "\n")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
