"""Generation throughput: the HTTP API (Ray Serve gateway -> engine replica) vs a direct vLLM AsyncLLM.

Same model, prompts and sampling (greedy, ignore_eos, so every request makes exactly
--max-tokens tokens), same client concurrency. The direct engine is timed with the output kind the
replica asks vLLM for on a non-streaming request (FINAL_ONLY), the baseline of the ratios, and with
vLLM's default one output per step. HTTP is measured on both endpoints of one app: through Serve's
proxy (--port) and on the gateway's own listener (generator.direct_http_port = --port + 1). Each
phase is warmed up first, then timed over --num-prompts requests. The direct engine is shut down
before Serve starts so the two never compete for cores. Prints one JSON line per side.

    python benchmarks/generation.py --model artifacts/demo-model --num-prompts 256 --concurrency 32 --max-tokens 32

On a GPU, give the engine its device and a real dtype (both sides get the same engine options):

    python benchmarks/generation.py --model /tmp/qwen2-0.5b-random --dtype bfloat16 --num-gpus 1 \
        --max-model-len 1024 --num-prompts 1024 --concurrency 128 --max-tokens 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from functools import partial

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
    return {"model": model, "generator": gen}


async def direct(sections: dict, ids: list[list[int]], concurrency: int, max_tokens: int, warmup: int) -> dict:
    """Two timed phases on one engine: the output kind the replica asks for a non-streaming request
    (FINAL_ONLY: one output per request) and vLLM's default (CUMULATIVE: one output per step)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from asyncrl.config import GeneratorConfig, ModelConfig
    from asyncrl.generator.engine import build_engine_args

    llm = AsyncLLM.from_engine_args(build_engine_args(ModelConfig(**sections["model"]), GeneratorConfig(**sections["generator"])))
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
            results[name] = await timed(concurrency, partial(gen, sp=sp), ids, f"direct_{name}")
        return results
    finally:
        llm.shutdown()


# Where the client's requests are, from the app's /metrics: at the gateway, in the engine replica
# (Serve's handler running), and held by the vLLM engine. Their means over a timed phase.
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


async def http(sections: dict, ids: list[list[int]], concurrency: int, max_tokens: int, warmup: int, port: int,
               max_ongoing: int = 0) -> dict:
    """Both HTTP endpoints of one Serve app: through Serve's proxy (port) and the gateway's own (port + 1).

    The client is aiohttp, one pooled connection per concurrent request. It was httpx until
    2026-11-24: at 128 connections on the H100 machine httpx's pool bookkeeping took 0.45-0.70 of
    a core and the gateway held only 64-86 of the client's 128 requests on average (117-125 with
    aiohttp), so the client, not the API, set part of the pace (docs/BENCHMARKS.md)."""
    import aiohttp
    import ray

    from asyncrl.config import load_config
    from asyncrl.generator.app import run_generator

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"], "TOKENIZERS_PARALLELISM": "false"}})
    gen = {**sections["generator"], "http_port": port, "direct_http_port": port + 1,
           "max_ongoing_requests": max_ongoing or max(64, concurrency), "max_queued_requests": -1}
    cfg = load_config({"model": sections["model"], "generator": gen})
    run_generator(cfg, name="bench", weight_source=None)
    results = {}
    try:
        for name, p in (("proxy", port), ("direct", port + 1)):
            url = f"http://127.0.0.1:{p}/generate"
            connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency)
            async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as client:

                async def gen_one(prompt: list[int]) -> int:
                    body = {"prompt_ids": prompt, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
                    async with client.post(url, json=body) as r:
                        if r.status != 200:
                            raise RuntimeError(f"POST {url}: HTTP {r.status}: {(await r.text())[:300]}")
                        return len((await r.json())["completions"][0]["token_ids"])

                await timed(concurrency, gen_one, ids[:warmup])
                samples: list[dict[str, float]] = []
                sampler = asyncio.create_task(occupancy(f"http://127.0.0.1:{port + 1}/metrics", samples))
                results[name] = await timed(concurrency, gen_one, ids, f"http_{name}")
                sampler.cancel()
                results[name]["occupancy"] = {k: round(sum(s[k] for s in samples) / len(samples), 1) for k in OCCUPANCY} if samples else {}
        return results
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="artifacts/demo-model")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=32, help="requests sent (and not timed) before measuring")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--num-gpus", type=float, default=0.0, help="Ray GPUs for the Serve engine replica (1 on a GPU machine)")
    ap.add_argument("--max-ongoing", type=int, default=0, help="generator.max_ongoing_requests (default: max(64, --concurrency))")
    ap.add_argument("--engine-kwargs", default="{}", help="JSON object passed to vLLM's AsyncEngineArgs on both sides")
    ap.add_argument("--sides", default="direct,http",
                    help="what to time: direct,http (the ratios need both); one side alone is for diagnosis")
    args = ap.parse_args()
    sides = set(args.sides.split(","))
    if not sides or sides - {"direct", "http"}:
        ap.error(f"--sides: a comma list of direct and http, got {args.sides!r}")
    sections = engine_sections(args)
    ids = prompts(sections["model"]["path"], args.num_prompts)
    row: dict = {"benchmark": "generation", "model": args.model, "num_prompts": args.num_prompts,
                 "concurrency": args.concurrency, "max_tokens": args.max_tokens, "dtype": args.dtype,
                 "prompt_tokens_mean": round(sum(map(len, ids)) / len(ids), 1)}
    if "direct" in sides:
        d = asyncio.run(direct(sections, ids, args.concurrency, args.max_tokens, args.warmup))
        direct_tps, per_step_tps = (d[k]["tokens"] / d[k]["seconds"] for k in ("final_only", "per_step"))
        print(json.dumps({"benchmark": "generation_direct", "direct_tokens_per_s": round(direct_tps, 1),
                          "direct_per_step_tokens_per_s": round(per_step_tps, 1)}), flush=True)
        row.update({
            # direct AsyncLLM with the output kind the replica uses for a non-streaming request (one
            # output per request); the ratios below are against it. per_step: vLLM's default kind.
            "direct_tokens_per_s": round(direct_tps, 1), "direct_per_step_tokens_per_s": round(per_step_tps, 1),
            "direct_seconds": round(d["final_only"]["seconds"], 2), "direct_per_step_seconds": round(d["per_step"]["seconds"], 2),
            # Wall-clock (epoch) bounds of each timed phase, to match per-process CPU samples against.
            "direct_window": [round(t, 2) for t in d["final_only"]["window"]],
            "direct_per_step_window": [round(t, 2) for t in d["per_step"]["window"]],
        })
    if "http" in sides:
        h = asyncio.run(http(sections, ids, args.concurrency, args.max_tokens, args.warmup, args.port, args.max_ongoing))
        proxy_tps, gw_tps = (h[k]["tokens"] / h[k]["seconds"] for k in ("proxy", "direct"))
        row.update({
            # through Serve's HTTP proxy (generator.http_port) and the gateway's own port (generator.direct_http_port)
            "http_tokens_per_s": round(proxy_tps, 1), "http_gateway_port_tokens_per_s": round(gw_tps, 1),
            # mean requests at the gateway / in the engine replica / in the vLLM engine during each HTTP phase
            # (the client keeps --concurrency in flight; the engine's share is what decodes)
            "http_occupancy": h["proxy"]["occupancy"], "http_gateway_port_occupancy": h["direct"]["occupancy"],
            "http_seconds": round(h["proxy"]["seconds"], 2), "http_gateway_port_seconds": round(h["direct"]["seconds"], 2),
            "http_window": [round(t, 2) for t in h["proxy"]["window"]],
            "http_gateway_port_window": [round(t, 2) for t in h["direct"]["window"]],
        })
    if sides == {"direct", "http"}:
        row.update({
            "http_over_direct": round(proxy_tps / direct_tps, 3), "http_gateway_port_over_direct": round(gw_tps / direct_tps, 3),
            "http_gateway_port_over_direct_per_step": round(gw_tps / per_step_tps, 3),
        })
    print(json.dumps(row))

if __name__ == "__main__":
    main()
