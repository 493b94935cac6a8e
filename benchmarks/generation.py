"""Generation throughput and latency: `vllm serve` against asyncrl's API, same client, prompts and load.

One run starts each server in turn on the same engine options (model, dtype, context length,
GPU), never two at once, and drives each with the same aiohttp client: `--num-prompts` token-id
prompts, `--concurrency` requests in flight, greedy with `ignore_eos` so every request makes
exactly `--max-tokens` tokens. Each phase is warmed up (`--warmup` requests), then timed; a phase
reports tokens/s, requests/s and the p50/p99 request latency.

Sides (`--sides`, in order; a side may repeat, e.g. `vllm,asyncrl,vllm` brackets ours):
  vllm     `vllm serve MODEL` (vLLM's own OpenAI server, its own defaults) on /v1/completions:
           phases `plain` (no log-probs) and `logprobs` (`logprobs: 1`).
  asyncrl  our Serve app (engine replica + gateway), the same two phases on the gateway's own port
           (generator.direct_http_port; `--endpoints gateway,proxy` adds Serve's proxy), then the
           rollout paths, both with behaviour log-probs and per-token versions:
           `rollout` (POST /generate, what an external RL client sends) and `handle` (the trainer's
           own requests: a Serve handle call of the engine deployment's `generate`).
  direct   vLLM's `AsyncLLM` in this process with the replica's engine arguments (diagnosis only).
  sglang   SGLang's own server (`python -m sglang.launch_server`, its OpenAI /v1/completions), the peer of an
           asyncrl side with `--engine sglang`: phases `plain` and `logprobs`, as `vllm`.

`--engine sglang` (GPU only): the asyncrl side runs SGLang engine replicas (`--engine-pythonpath`: SGLang's
packages, e.g. /tmp/site-sglang:/tmp/site:$PWD on the GPU host), `direct` is SGLang's `Engine` in a child process
with those packages, and the ratios are against the best `sglang` side. `--engine-kwargs` then go to SGLang's
ServerArgs (the slim wheel set needs {"attention_backend": "triton", "sampling_backend": "pytorch"}).

Prints one JSON line per side and phase, then a summary row with asyncrl / vllm ratios (against
the best `vllm serve` run of each phase, so a repeat on a noisy machine cannot flatter us).

    python benchmarks/generation.py --model artifacts/demo-model --num-prompts 256 --concurrency 32 --max-tokens 32
    python benchmarks/generation.py --model /tmp/qwen2-0.5b-random --dtype bfloat16 --num-gpus 1 \
        --max-model-len 1024 --num-prompts 1024 --concurrency 128 --max-tokens 256 --sides vllm,asyncrl,vllm
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from bench_ray import init_ray

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def prompts(model: str, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from asyncrl.data import ArithmeticTask, render_chat_prompt

    tok = AutoTokenizer.from_pretrained(model)
    items = ArithmeticTask().train_split()
    return [tok.encode(render_chat_prompt(tok, items[i % len(items)].prompt), add_special_tokens=False) for i in range(count)]


async def bounded(concurrency: int, jobs) -> list[int]:
    sem = asyncio.Semaphore(concurrency)

    async def one(job):
        async with sem:
            return await job()

    return await asyncio.gather(*(one(j) for j in jobs))


async def timed(concurrency: int, one, ids: list[list[int]], phase: str | None = None) -> dict:
    """`one(prompt) -> tokens` over every prompt, `concurrency` at a time: tokens, seconds and the
    phase's wall-clock (epoch) window. A named phase is announced on stderr when it starts and ends
    (benchmarks/profile_generation.py samples the processes between the two)."""

    def mark(what: str) -> None:
        if phase:
            print(f"[generation] phase {phase} {what} {time.time():.2f}", file=sys.stderr, flush=True)

    mark("start")
    wall0, t0 = time.time(), time.perf_counter()
    tokens = sum(await bounded(concurrency, [lambda p=p: one(p) for p in ids]))
    result = {"tokens": tokens, "seconds": time.perf_counter() - t0, "window": [wall0, time.time()]}
    mark("end")
    return result


def engine_sections(args: argparse.Namespace) -> dict:
    """The `model` and `generator` config sections both sides are built from."""
    model = {"path": os.path.abspath(args.model), "dtype": args.dtype, "max_model_len": args.max_model_len}
    gen = {"engine_kwargs": json.loads(args.engine_kwargs), "num_gpus": args.num_gpus}
    if args.engine == "sglang":
        gen.update(engine="sglang", engine_pythonpath=args.engine_pythonpath or None)
    return {"model": model, "generator": gen}


async def direct_sglang(sections: dict, ids: list[list[int]], concurrency: int, max_tokens: int, warmup: int) -> dict:
    """`direct` for SGLang: its `Engine` (built in a thread, as the replica builds it), with the replica's server
    arguments; two timed phases: one result per request, and streamed (one chunk per step)."""
    from asyncrl.config import GeneratorConfig, ModelConfig
    from asyncrl.generator.sglang_engine import engine_ports, server_kwargs, start_engine, stop_engine

    port, nccl_port = engine_ports()
    engine = start_engine(server_kwargs(ModelConfig(**sections["model"]), GeneratorConfig(**sections["generator"]),
                                        port=port, nccl_port=nccl_port))
    params = {"temperature": 0, "max_new_tokens": max_tokens, "ignore_eos": True}

    async def final(p: list[int]) -> int:
        out = await engine.async_generate(input_ids=p, sampling_params=params, return_logprob=True)
        return len(out["output_ids"])

    async def streamed(p: list[int]) -> int:
        n = 0
        async for chunk in await engine.async_generate(input_ids=p, sampling_params=params, return_logprob=True, stream=True):
            n += len(chunk["output_ids"])
        return n

    results = {}
    try:
        for name, one in (("final_only", final), ("per_step", streamed)):
            await timed(concurrency, one, ids[:warmup])
            results[name] = await timed_latency(concurrency, one, ids, f"direct_{name}")
        return results
    finally:
        stop_engine(engine)


async def direct(sections: dict, ids: list[list[int]], concurrency: int, max_tokens: int, warmup: int) -> dict:
    """Two timed phases on one engine: the output kind the replica asks for a non-streaming request
    (FINAL_ONLY: one output per request) and vLLM's default (CUMULATIVE: one output per step)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from asyncrl.config import GeneratorConfig, ModelConfig
    from asyncrl.generator.vllm_engine import start_engine

    llm, _ = start_engine(ModelConfig(**sections["model"]), GeneratorConfig(**sections["generator"]))
    counter = iter(range(10**9))

    async def gen(p: list[int], sp) -> int:
        n = 0
        async for out in llm.generate({"prompt_token_ids": p}, sp, f"b{next(counter)}"):
            n = len(out.outputs[0].token_ids)
        return n

    results = {}
    try:
        for name, kind in (("final_only", RequestOutputKind.FINAL_ONLY), ("per_step", RequestOutputKind.CUMULATIVE)):
            sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, output_kind=kind)
            await timed(concurrency, partial(gen, sp=sp), ids[:warmup])
            results[name] = await timed_latency(concurrency, partial(gen, sp=sp), ids, f"direct_{name}")
        return results
    finally:
        llm.shutdown()



# Where the client's requests are, from the app's /metrics: at the gateway, in the engine replicas
# (Serve's handler running) and held by the vLLM engines. Their means over a timed phase.
OCCUPANCY = {"gateway": "asyncrl_generator_queue_depth", "replica": "asyncrl_generator_replica_ongoing_requests",
             "engine": "asyncrl_generator_replica_engine_requests"}


async def occupancy(url: str, samples: list[dict[str, float]], every_s: float = 0.5) -> None:
    """Sample the OCCUPANCY gauges (summed over replicas) until cancelled."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as client:
        while True:
            await asyncio.sleep(every_s)
            try:
                async with client.get(url) as r:
                    text = await r.text()
            except (aiohttp.ClientError, asyncio.TimeoutError):
                continue
            row = dict.fromkeys(OCCUPANCY, 0.0)
            for line in text.splitlines():
                for key, metric in OCCUPANCY.items():
                    if line.startswith(metric + " ") or line.startswith(metric + "{"):
                        row[key] += float(line.rsplit(" ", 1)[1])
            samples.append(row)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summarize(side: str, phase: str, r: dict, n: int) -> dict:
    lat = r["latencies"]
    return {"benchmark": "generation_phase", "side": side, "phase": phase, "requests": n, "tokens": r["tokens"],
            "seconds": round(r["seconds"], 2), "tokens_per_s": round(r["tokens"] / r["seconds"], 1),
            "requests_per_s": round(n / r["seconds"], 2), "p50_s": round(percentile(lat, 0.5), 3),
            "p99_s": round(percentile(lat, 0.99), 3), "window": [round(t, 2) for t in r["window"]]}


async def timed_latency(concurrency: int, one, ids: list[list[int]], phase: str) -> dict:
    """`timed` that also keeps each request's latency."""
    latencies: list[float] = []

    async def wrapped(p):
        t0 = time.perf_counter()
        n = await one(p)
        latencies.append(time.perf_counter() - t0)
        return n

    r = await timed(concurrency, wrapped, ids, phase)
    r["latencies"] = latencies
    return r


def completions_client(client, url: str, model: str, max_tokens: int, logprobs: bool):
    """One `/v1/completions` request per prompt; returns the completion tokens it made."""

    async def one(prompt: list[int]) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        if logprobs:
            body["logprobs"] = 1
        async with client.post(url, json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"POST {url}: HTTP {r.status}: {(await r.text())[:300]}")
            data = await r.json()
        choice = data["choices"][0]
        if logprobs and len(choice["logprobs"]["token_logprobs"]) != data["usage"]["completion_tokens"]:
            raise RuntimeError(f"{url}: {len(choice['logprobs']['token_logprobs'])} log-probs for "
                               f"{data['usage']['completion_tokens']} tokens")
        return data["usage"]["completion_tokens"]

    return one


def generate_client(client, url: str, max_tokens: int):
    """One `/generate` request per prompt with behaviour log-probs; checks one version per token."""

    async def one(prompt: list[int]) -> int:
        body = {"prompt_ids": prompt, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, "logprobs": True}
        async with client.post(url, json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"POST {url}: HTTP {r.status}: {(await r.text())[:300]}")
            c = (await r.json())["completions"][0]
        if not len(c["token_ids"]) == len(c["logprobs"]) == len(c["versions"]):
            raise RuntimeError(f"{url}: {len(c['token_ids'])} tokens, {len(c['logprobs'])} log-probs, {len(c['versions'])} versions")
        return len(c["token_ids"])

    return one


async def run_phases(label: str, base: str, model: str, phases: list[tuple[str, str]], ids, args, handle=None,
                     metrics_url: str | None = None) -> list[dict]:
    """Each (phase, kind) over HTTP at `base` (kind: plain | logprobs | rollout) or, for kind
    `handle`, through the engine deployment's Serve handle. With `metrics_url` (our app), each
    phase also reports where the requests were on average (OCCUPANCY)."""
    import aiohttp

    rows = []
    connector = aiohttp.TCPConnector(limit=args.concurrency, limit_per_host=args.concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=900)) as client:
        for phase, kind in phases:
            if kind == "handle":
                one = handle_client(handle, args.max_tokens)
            elif kind == "rollout":
                one = generate_client(client, f"{base}/generate", args.max_tokens)
            else:
                one = completions_client(client, f"{base}/v1/completions", model, args.max_tokens, kind == "logprobs")
            await timed(args.concurrency, one, ids[: args.warmup])
            samples: list[dict[str, float]] = []
            sampler = asyncio.create_task(occupancy(metrics_url, samples)) if metrics_url else None
            row = summarize(label, phase, await timed_latency(args.concurrency, one, ids, f"{label}_{phase}"), len(ids))
            if sampler is not None:
                sampler.cancel()
                row["occupancy"] = {k: round(sum(x[k] for x in samples) / len(samples), 1) for k in OCCUPANCY} if samples else {}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def handle_client(handle, max_tokens: int):
    from asyncrl.types import GenerationRequest, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=True)

    async def one(prompt: list[int]) -> int:
        result = await handle.generate.remote(GenerationRequest(prompt_ids=prompt, sampling=sp))
        c = result.completions[0]
        if not len(c.token_ids) == len(c.logprobs) == len(c.versions):
            raise RuntimeError(f"handle: {len(c.token_ids)} tokens, {len(c.logprobs)} log-probs, {len(c.versions)} versions")
        return len(c.token_ids)

    return one


# `vllm serve` through vLLM's own CLI entry point. vllm-cpu installs as the distribution
# "vllm-cpu" and the CLI asks for the version of "vllm" (platform detection already knows to
# ask for "vllm-cpu"): the CLI's own lookup falls back the same way.
VLLM_CLI = """
import importlib.metadata as md, sys, types, vllm.entrypoints.cli.main as cli
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        if name != "vllm":
            raise
        return md.version("vllm-cpu")
cli.importlib = types.SimpleNamespace(metadata=types.SimpleNamespace(version=version))  # this module's name only
sys.argv[0] = "vllm"
cli.main()
"""


def vllm_serve_command(args: argparse.Namespace, port: int) -> list[str]:
    """`vllm serve` with the engine options both servers share: model, dtype, context length,
    `--engine-kwargs`, and on CPU the host-memory options the replica sets there too."""
    from asyncrl.config import GeneratorConfig, ModelConfig
    from asyncrl.generator.vllm_engine import build_engine_args

    cmd = [sys.executable, "-c", VLLM_CLI, "serve", os.path.abspath(args.model), "--port", str(port), "--served-model-name", "bench",
           "--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--disable-uvicorn-access-log"]
    shared = json.loads(args.engine_kwargs)
    if not args.num_gpus:
        ours = vars(build_engine_args(ModelConfig(path=args.model, dtype=args.dtype, max_model_len=args.max_model_len),
                                      GeneratorConfig(engine_kwargs=shared)))
        shared = {k: ours[k] for k in ("gpu_memory_utilization", "enable_chunked_prefill", "max_num_batched_tokens")} | shared
    for key, value in shared.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            cmd.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            cmd += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return cmd


async def wait_ready(url: str, proc, timeout_s: float) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
            try:
                async with client.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(1)
    raise RuntimeError(f"the server was not ready after {timeout_s} s")


def _server_side(cmd: list[str], env: dict[str, str], port: int, args: argparse.Namespace, ids, label: str,
                 log_dir: Path) -> list[dict]:
    """A peer's own OpenAI server (`cmd`, in a session of its own, its log in `log_dir`): started, the
    `plain` / `logprobs` phases run on its /v1/completions, stopped (its whole process group)."""
    print(f"[generation] {label}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    log = open(log_dir / f"{label}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        t0 = time.perf_counter()
        asyncio.run(wait_ready(f"http://127.0.0.1:{port}/v1/models", proc, args.start_timeout_s))
        print(f"[generation] {label} ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        phases = [(p, p) for p in args.phases if p in ("plain", "logprobs")]
        return asyncio.run(run_phases(label, f"http://127.0.0.1:{port}", "bench", phases, ids, args))
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def side_vllm(args: argparse.Namespace, ids, label: str, log_dir: Path) -> list[dict]:
    port = args.port + 10
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"]}
    return _server_side(vllm_serve_command(args, port), env, port, args, ids, label, log_dir)


def side_sglang(args: argparse.Namespace, ids, label: str, log_dir: Path) -> list[dict]:
    """SGLang's own OpenAI server on the same model, dtype, context length and `--engine-kwargs`."""
    port = args.port + 20
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", os.path.abspath(args.model), "--port", str(port),
           "--served-model-name", "bench", "--dtype", args.dtype, "--context-length", str(args.max_model_len)]
    for key, value in json.loads(args.engine_kwargs).items():
        flag = "--" + key.replace("_", "-")
        cmd += ([flag] if value is True else [] if value is False else [flag, str(value)])
    env = {**os.environ, "PYTHONPATH": args.engine_pythonpath or os.environ.get("PYTHONPATH", "")}
    return _server_side(cmd, env, port, args, ids, label, log_dir)


def side_asyncrl(args: argparse.Namespace, sections: dict, ids, label: str, replicas: int = 1) -> list[dict]:
    import ray
    from ray import serve

    from asyncrl.app import run_generator
    from asyncrl.config import load_config
    from asyncrl.generator.deployment import ENGINE_DEPLOYMENT

    runtime_env = {"env_vars": {"VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"], "TOKENIZERS_PARALLELISM": "false"}}
    init_ray(max(4, os.cpu_count() or 4), runtime_env=runtime_env)
    port = args.port
    gen = {**sections["generator"], "http_port": port, "direct_http_port": port + 1,
           "max_ongoing_requests": args.max_ongoing or 4 * args.concurrency, "max_queued_requests": -1}
    if replicas > 1:  # that many engine replicas share the GPUs (each engine takes its share of the memory)
        gen.update(num_gpus=args.num_gpus / replicas, autoscaling={"min_replicas": replicas, "max_replicas": replicas})
    cfg = load_config({"model": sections["model"], "generator": gen})
    t0 = time.perf_counter()
    run_generator(cfg, name="bench", weight_source=None)
    print(f"[generation] {label} ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    try:
        rows = []
        http = [(p, p) for p in args.phases if p in ("plain", "logprobs")]
        for endpoint in args.endpoints:
            base = f"http://127.0.0.1:{port + 1 if endpoint == 'gateway' else port}"
            named = [(p if endpoint == "gateway" else f"{p}_proxy", k) for p, k in http]
            if endpoint == args.endpoints[0] and "rollout" in args.phases:
                named.append(("rollout", "rollout"))
            rows += asyncio.run(run_phases(label, base, cfg.model.served_name, named, ids, args,
                                           metrics_url=f"http://127.0.0.1:{port + 1}/metrics"))
        if "handle" in args.phases:
            handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name="bench")
            rows += asyncio.run(run_phases(label, "", "", [("handle", "handle")], ids, args, handle=handle,
                                           metrics_url=f"http://127.0.0.1:{port + 1}/metrics"))
        return rows
    finally:
        serve.shutdown()
        ray.shutdown()


def side_direct(sections: dict, ids, args: argparse.Namespace) -> list[dict]:
    if args.engine == "sglang":  # SGLang's packages only in a child process (their pins clash with vLLM's)
        job = json.dumps({"sections": sections, "ids": ids, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                          "warmup": args.warmup})
        env = {**os.environ, "PYTHONPATH": args.engine_pythonpath or os.environ.get("PYTHONPATH", "")}
        out = subprocess.run([sys.executable, __file__, "--sglang-direct-child"], input=job, capture_output=True, text=True,
                             env=env, timeout=args.start_timeout_s + 1800)
        if out.returncode:
            raise RuntimeError(f"SGLang direct side failed ({out.returncode}): {out.stderr[-2000:]}")
        d = json.loads(out.stdout.strip().splitlines()[-1])
    else:
        d = asyncio.run(direct(sections, ids, args.concurrency, args.max_tokens, args.warmup))
    rows = [summarize("direct", phase, d[phase], len(ids)) for phase in ("final_only", "per_step")]
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def ratios(rows: list[dict], peer: str = "vllm") -> dict:
    """asyncrl / best `peer` server run (vllm serve, or SGLang's server), per phase; rollout paths against the
    peer's `logprobs`. Keys say `over_vllm` / `over_sglang`."""
    best: dict[str, dict] = {}
    for r in rows:
        if r["side"].startswith(peer) and r["tokens_per_s"] > best.get(r["phase"], {}).get("tokens_per_s", 0):
            best[r["phase"]] = r
    out: dict = {}
    for r in rows:
        if not r["side"].startswith("asyncrl"):
            continue
        base = best.get({"rollout": "logprobs", "handle": "logprobs"}.get(r["phase"], r["phase"].removesuffix("_proxy")))
        if base:
            key = r["phase"] if r["side"] == "asyncrl" else f"{r['side']}_{r['phase']}"
            out[f"{key}_over_{peer}"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
            out[f"{key}_p99_over_{peer}"] = round(r["p99_s"] / base["p99_s"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="artifacts/demo-model")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=32, help="requests sent (and not timed) before each phase")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--num-gpus", type=float, default=0.0, help="Ray GPUs for the Serve engine replica (1 on a GPU machine)")
    ap.add_argument("--max-ongoing", type=int, default=0, help="generator.max_ongoing_requests (default: 4 x --concurrency)")
    ap.add_argument("--engine-kwargs", default="{}", help="JSON object of vLLM engine options given to every server")
    ap.add_argument("--sides", default="vllm,asyncrl,vllm", help="comma list of vllm, asyncrl, direct (in order; may "
                    "repeat); asyncrlxN runs N engine replicas on the same GPUs (each 1/N of --num-gpus and of the memory)")
    ap.add_argument("--phases", default="plain,logprobs,rollout,handle")
    ap.add_argument("--endpoints", default="gateway", help="asyncrl HTTP endpoints: gateway (its own port), proxy (Serve's)")
    ap.add_argument("--start-timeout-s", type=float, default=600)
    ap.add_argument("--log-dir", default=None, help="where vllm serve's logs go (default: a temporary folder)")
    ap.add_argument("--engine", default="vllm", choices=["vllm", "sglang"], help="the engine of the asyncrl and direct sides")
    ap.add_argument("--engine-pythonpath", default="", help="SGLang's packages first (its server, direct side and replicas)")
    if sys.argv[1:] == ["--sglang-direct-child"]:  # side_direct's child, with SGLang's packages
        job = json.loads(sys.stdin.read())
        print(json.dumps(asyncio.run(direct_sglang(job["sections"], job["ids"], job["concurrency"], job["max_tokens"],
                                                   job["warmup"]))), flush=True)
        return
    args = ap.parse_args()
    sides = args.sides.split(",")
    args.phases, args.endpoints = args.phases.split(","), args.endpoints.split(",")
    kinds = [re.sub(r"x\d+$", "", s) if s.startswith("asyncrl") else s for s in sides]
    if args.engine == "sglang" and not args.num_gpus:
        ap.error("--engine sglang needs --num-gpus (SGLang has no CPU backend here)")
    if set(kinds) - {"vllm", "asyncrl", "direct", "sglang"} or set(args.phases) - {"plain", "logprobs", "rollout", "handle"} \
            or set(args.endpoints) - {"gateway", "proxy"}:
        ap.error("--sides: vllm|asyncrl|direct|sglang; --phases: plain|logprobs|rollout|handle; --endpoints: gateway|proxy")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="generation-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    sections = engine_sections(args)
    ids = prompts(sections["model"]["path"], args.num_prompts)
    rows: list[dict] = []
    for i, side in enumerate(sides):
        label = f"{side}{sum(s == side for s in sides[:i]) + 1}" if sides.count(side) > 1 else side
        if side == "vllm":
            rows += side_vllm(args, ids, label, log_dir)
        elif side == "sglang":
            rows += side_sglang(args, ids, label, log_dir)
        elif side.startswith("asyncrl"):
            rows += side_asyncrl(args, sections, ids, label, int(side.removeprefix("asyncrl").removeprefix("x") or 1))
        else:
            rows += side_direct(sections, ids, args)
    print(json.dumps({"benchmark": "generation", "model": args.model, "num_prompts": args.num_prompts,
                      "concurrency": args.concurrency, "max_tokens": args.max_tokens, "dtype": args.dtype,
                      "prompt_tokens_mean": round(sum(map(len, ids)) / len(ids), 1), "sides": sides,
                      "engine": args.engine, **ratios(rows, "sglang" if args.engine == "sglang" else "vllm"),
                      "phases": {f"{r['side']}/{r['phase']}": r["tokens_per_s"] for r in rows}}), flush=True)


if __name__ == "__main__":
    main()
