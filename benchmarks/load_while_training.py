"""The API under load while the demo trains, then a SIGTERM drain.

Starts `asyncrl serve CONFIG` (what `make serve` runs), waits until training runs, then keeps
`--concurrency` OpenAI-client requests in flight on the API for `--minutes` while the learner
trains. Every few seconds it samples the training step (`/train/status`) and the resident memory
of each engine replica (its Serve replica process plus its vLLM processes). At the end it sends
SIGTERM to the server and measures how long the drain takes and which of our processes are left.

Reported (one JSON object): requests by HTTP status (anything 5xx other than 503 is a failure),
client exceptions, p50/p99 latency, tokens/s, steps trained during the load and seconds per step,
each engine replica's memory first/max/last, the exit code and seconds of the SIGTERM drain,
whether the drain's accounting line was logged, and processes of ours left afterwards.

  python benchmarks/load_while_training.py --minutes 3 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
OURS = ("VLLM::EngineCore", "VLLM::Worker", "ray::LearnerRank", "ray::ServeReplica", "ray::ServeController",
        "raylet", "gcs_server")


def engine_rss_mb() -> dict[int, float]:
    """Resident MB of each engine replica: its Serve replica process and its descendants."""
    out = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            text = " ".join(p.info["cmdline"] or [])
            if "ServeReplica" in text and "GeneratorEngine" in text:
                procs = [p, *p.children(recursive=True)]
                out[p.pid] = sum(q.memory_info().rss for q in procs) / 2**20
        except psutil.Error:
            continue
    return out


def ours_left(since: float) -> list[str]:
    left = []
    for p in psutil.process_iter(["cmdline", "name", "create_time", "status"]):
        try:
            text = " ".join(p.info["cmdline"] or [p.info["name"] or ""])
            if p.info["create_time"] >= since and p.info["status"] != psutil.STATUS_ZOMBIE and any(k in text for k in OURS):
                left.append(f"{p.pid} {text[:80]}")
        except psutil.Error:
            continue
    return left


async def load(api: str, model: str, concurrency: int, seconds: float, max_tokens: int) -> dict:
    from openai import APIStatusError, AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{api}/v1", api_key="unused", timeout=120, max_retries=0)
    codes: collections.Counter = collections.Counter()
    errors: collections.Counter = collections.Counter()
    latencies: list[float] = []
    tokens = 0
    end = time.monotonic() + seconds

    async def one(i: int) -> None:
        nonlocal tokens
        while time.monotonic() < end:
            t = time.monotonic()
            try:
                r = await client.completions.create(model=model, prompt=f"What is {i % 90 + 10} + {i % 7 + 3}?",
                                                    max_tokens=max_tokens, temperature=1.0)
                codes[200] += 1
                latencies.append(time.monotonic() - t)
                tokens += r.usage.completion_tokens
            except APIStatusError as err:
                codes[err.status_code] += 1
                if err.status_code == 503:
                    await asyncio.sleep(0.2)  # overloaded: back off as a client should
            except Exception as err:  # noqa: BLE001 - counted and reported
                errors[type(err).__name__] += 1
                await asyncio.sleep(0.5)
            i += concurrency

    t0 = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(concurrency)))
    wall = time.monotonic() - t0
    await client.close()
    lat = sorted(latencies)
    return {"codes": dict(codes), "client_errors": dict(errors), "ok": len(lat), "wall_s": wall,
            "tokens_per_s": tokens / wall, "p50_s": statistics.median(lat) if lat else None,
            "p99_s": lat[int(0.99 * (len(lat) - 1))] if lat else None,
            "bad_5xx": sum(n for c, n in codes.items() if c >= 500 and c != 503)}


async def watch(url: str, stop: asyncio.Event, samples: list) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        while not stop.is_set():
            try:
                status = (await http.get(f"{url}/train/status")).json()
                samples.append({"t": time.monotonic(), "step": status.get("step"), "state": status.get("state"),
                                "engine_rss_mb": engine_rss_mb()})
            except httpx.HTTPError:
                pass
            try:
                await asyncio.wait_for(stop.wait(), 5)
            except asyncio.TimeoutError:
                pass


async def main_async(args: argparse.Namespace) -> dict:
    started = time.time()
    log = open(args.log, "w")
    server = subprocess.Popen([str(Path(sys.executable).parent / "asyncrl"), "serve", args.config], cwd=REPO,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url, api = f"http://127.0.0.1:{args.port}", f"http://127.0.0.1:{args.api_port}"
    try:
        deadline = time.monotonic() + args.start_timeout_s
        async with httpx.AsyncClient(timeout=10) as http:
            while True:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the server did not start training (rc {server.poll()}); see {args.log}")
                try:
                    status = (await http.get(f"{url}/train/status")).json()
                    if status.get("state") == "training" and (status.get("step") or 0) >= 1:
                        break
                except (httpx.HTTPError, ValueError):
                    pass
                await asyncio.sleep(3)
        stop, samples = asyncio.Event(), []
        watcher = asyncio.create_task(watch(url, stop, samples))
        result = await load(api, args.model, args.concurrency, args.minutes * 60, args.max_tokens)
        stop.set()
        await watcher
    finally:
        t = time.monotonic()
        server.send_signal(signal.SIGTERM)  # what `timeout`, a scheduler or `kill` sends
        try:
            rc = server.wait(timeout=args.drain_timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
            os.killpg(server.pid, signal.SIGKILL)
        drain_s = time.monotonic() - t
        time.sleep(5)
        log.close()
    steps = [s["step"] for s in samples if s["step"] is not None]
    per_replica = collections.defaultdict(list)
    for s in samples:
        for pid, mb in s["engine_rss_mb"].items():
            per_replica[pid].append(mb)
    text = Path(args.log).read_text(errors="replace")
    return {
        "config": args.config, "concurrency": args.concurrency, "minutes": args.minutes, "max_tokens": args.max_tokens,
        **result,
        "steps_during_load": (steps[-1] - steps[0]) if steps else 0,
        "s_per_step": (samples[-1]["t"] - samples[0]["t"]) / max(1, steps[-1] - steps[0]) if len(steps) > 1 else None,
        "states": sorted({s["state"] for s in samples}),
        "engine_rss_mb_first_max_last": {str(pid): [v[0], max(v), v[-1]] for pid, v in per_replica.items()},
        "sigterm_rc": rc, "sigterm_drain_s": drain_s,
        "traceback_in_log": "Traceback" in text, "segfault_in_log": "Segmentation fault" in text or "SIGSEGV" in text,
        "drain_logged": "stopped at policy version" in text,
        "left_after_sigterm": ours_left(started),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="deploy/rlhf.yaml")
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model", default="asyncrl-policy")
    ap.add_argument("--port", type=int, default=8000, help="Serve's HTTP port (/train/status)")
    ap.add_argument("--api-port", type=int, default=8001, help="the OpenAI API port (the gateway's own)")
    ap.add_argument("--start-timeout-s", type=float, default=900)
    ap.add_argument("--drain-timeout-s", type=float, default=120)
    ap.add_argument("--log", default="/tmp/asyncrl_load_server.log")
    print(json.dumps(asyncio.run(main_async(ap.parse_args()))))


if __name__ == "__main__":
    main()
