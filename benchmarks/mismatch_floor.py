"""The floor of the engine/learner log-prob mismatch on the demo model in float32, and where it comes from.

The same sampled tokens are scored several ways and pairs of them are compared token by token:
  E_batch    vLLM offline (the replica's engine arguments), all requests in one `generate`: each sampled
             token's log-prob (decode path), temperature 1, a fixed seed per request
  E_again    the same call again (run-to-run determinism at a fixed batch)
  E_alone    the same requests, one per `generate` (batch variance; compared up to each sequence's first
             token that differs, the count of such sequences reported)
  E_prefill  the engine's prefill path: `prompt_logprobs` of prompt + E_batch's completion
  H          transformers fp32, one sequence per forward, SDPA attention (H_eager: its eager attention)
  M          the Megatron learner (a real one-rank `LearnerGroup` in a local Ray session), `compute_log_prob`, its
             default attention on CPU (SDPA); M_local: learner.attention=local (Megatron's unfused attention)
Per pair: tokens compared, the share bitwise equal, mean and max |d| and k3 = mean(exp(d) - 1 - d), d = a - b, in
float64 (expm1), and as the learner's `mismatch/k3` metric computes it (`k3_metric`, asyncrl.algorithms.mismatch;
float32 before 2026-12-02, when this benchmark's rows showed it reading ~1e-9 at a true 1e-13: `k3_f32` there).
The engine parts run in child processes, once as is and once with VLLM_BATCH_INVARIANT=1 (vLLM's batch-invariant
mode): if that engine starts, its E_batch / E_again / E_alone / E_prefill are compared too, and its E_batch
against the default engine's; if not, the header row records the error's first line.
Prints a markdown table; writes a header row (versions, CPU model, settings) and one row per pair to --out.

  python benchmarks/mismatch_floor.py
  python benchmarks/mismatch_floor.py --ignore-eos --max-new-tokens 64 --skip-batch-invariant --out /tmp/floor.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))
from bench_ray import init_ray  # noqa: E402

PerToken = list[list[float]]
VERSIONS = ("vllm", "torch", "megatron-core", "transformers", "ray")
# (a, b) per engine mode, then across sources; E_alone is compared only where its tokens agree with E_batch's.
ENGINE_PAIRS = (("E_batch", "E_alone"), ("E_batch", "E_again"), ("E_batch", "E_prefill"))
CROSS_PAIRS = (("E_batch", "H"), ("E_batch", "M"), ("E_prefill", "H"), ("E_prefill", "M"), ("H", "M"), ("H", "H_eager"),
               ("H_eager", "M"), ("M", "M_local"), ("H_eager", "M_local"), ("H", "M_local"), ("E_batch", "M_local"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="artifacts/demo-model", help="HF model directory")
    ap.add_argument("--prompts", type=int, default=32, help="arithmetic-task training prompts")
    ap.add_argument("--samples", type=int, default=4, help="completions per prompt (each its own request and seed)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0, help="request i samples with seed --seed + i")
    ap.add_argument("--ignore-eos", action="store_true", help="every completion --max-new-tokens long (longer contexts)")
    ap.add_argument("--micro-batch-size", type=int, default=8, help="the learner's micro-batch (padded rows)")
    ap.add_argument("--num-cpus", type=int, default=2, help="logical CPUs of the local Ray runtime")
    ap.add_argument("--skip-batch-invariant", action="store_true", help="leave out the VLLM_BATCH_INVARIANT=1 engine")
    ap.add_argument("--out", type=Path, default=Path("docs/results/mismatch_floor_cpu_2026-12-02.jsonl"),
                    help="JSONL rows (overwritten)")
    ap.add_argument("--engine-child", type=Path, default=None, help=argparse.SUPPRESS)  # the engine part, in a child
    a = ap.parse_args(argv)
    for name in ("prompts", "samples", "max_new_tokens", "micro_batch_size", "num_cpus"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(a, name)}: must be >= 1")
    return a


def build_prompts(model: str, count: int) -> list[list[int]]:
    """The first `count` training prompts of the arithmetic task, rendered as the trainer renders them."""
    from transformers import AutoTokenizer

    from asyncrl.data import ArithmeticTask, render_prompt

    tok = AutoTokenizer.from_pretrained(model)
    return [tok(render_prompt(tok, p), add_special_tokens=False)["input_ids"] for p in ArithmeticTask().train_split()[:count]]


def engine_kwargs(model: str) -> dict[str, Any]:
    """The replica's engine arguments (asyncrl.generator.vllm_engine) that differ from vLLM's defaults, for `vllm.LLM`
    (no served name, no weight-update extension: nothing is pushed here)."""
    from asyncrl.config import GeneratorConfig, ModelConfig
    from asyncrl.generator.vllm_engine import build_engine_args

    args = build_engine_args(ModelConfig(path=model, dtype="float32"), GeneratorConfig())
    out = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)
           if f.default is not dataclasses.MISSING and getattr(args, f.name) != f.default}
    for name in ("served_model_name", "worker_extension_cls"):
        out.pop(name, None)
    return out


def engine_run(a: argparse.Namespace) -> dict[str, Any]:
    """E_batch, E_again, E_alone and E_prefill (tokens and log-probs) of one engine in this process."""
    from vllm import LLM, SamplingParams

    prompts = [p for p in build_prompts(a.model, a.prompts) for _ in range(a.samples)]
    seeds = [a.seed + i for i in range(len(prompts))]
    kwargs = engine_kwargs(a.model)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    out: dict[str, Any] = {"engine_kwargs": {k: str(v) for k, v in kwargs.items()}, "start_s": time.perf_counter() - t0}

    def sampling(seed: int) -> Any:
        return SamplingParams(temperature=1.0, max_tokens=a.max_new_tokens, seed=seed, logprobs=0, ignore_eos=a.ignore_eos)

    def decoded(results: list[Any]) -> dict[str, list]:
        tokens, logps = [], []
        for r in results:
            c = r.outputs[0]
            tokens.append(list(c.token_ids))
            logps.append([c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)])
        return {"tokens": tokens, "logprobs": logps}

    try:
        reqs = [{"prompt_token_ids": p} for p in prompts]
        t0 = time.perf_counter()
        out["E_batch"] = decoded(llm.generate(reqs, [sampling(s) for s in seeds], use_tqdm=False))
        out["E_again"] = decoded(llm.generate(reqs, [sampling(s) for s in seeds], use_tqdm=False))
        out["E_alone"] = decoded([llm.generate([r], sampling(s), use_tqdm=False)[0] for r, s in zip(reqs, seeds)])
        completions = out["E_batch"]["tokens"]
        scored = llm.generate([{"prompt_token_ids": p + c} for p, c in zip(prompts, completions)],
                              SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, seed=0), use_tqdm=False)
        out["E_prefill"] = {"tokens": completions, "logprobs": [
            [r.prompt_logprobs[len(p) + i][t].logprob for i, t in enumerate(c)] for r, p, c in zip(scored, prompts, completions)]}
        out["generate_s"] = time.perf_counter() - t0
    finally:
        llm.llm_engine.engine_core.shutdown()  # its processes, before the child leaves (see main)
    out["prompts"] = prompts
    return out


def first_error_line(text: str) -> str:
    """The first `SomeError: message` in a child's output, with the frame that raised it; else its last line."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        found = re.search(r"\b([A-Z]\w*(?:Error|Exception): .*)$", line)
        if found:
            frames = [m for x in lines[:i] if (m := re.search(r'File "([^"]+)", line (\d+), in (\w+)', x))]
            where = f" (at {Path(frames[-1][1]).name}:{frames[-1][2]} in {frames[-1][3]})" if frames else ""
            return found[1].strip() + where
    rest = [x for x in lines if x.strip()]
    return rest[-1].strip() if rest else ""


def engine_child(a: argparse.Namespace, batch_invariant: bool, timeout_s: float = 1200) -> dict[str, Any]:
    """engine_run in a fresh process (VLLM_BATCH_INVARIANT is read at import); {"error": ...} when it fails."""
    env = dict(os.environ, VLLM_BATCH_INVARIANT="1" if batch_invariant else "0")
    with tempfile.TemporaryDirectory() as tmp:
        dump, log = Path(tmp) / "engine.json", Path(tmp) / "engine.log"
        cmd = [sys.executable, __file__, "--engine-child", str(dump), "--model", a.model, "--prompts", str(a.prompts),
               "--samples", str(a.samples), "--max-new-tokens", str(a.max_new_tokens), "--seed", str(a.seed)]
        cmd += ["--ignore-eos"] if a.ignore_eos else []
        t0 = time.perf_counter()
        # Output to a file, not a pipe: a pipe stays open while any process the engine started lives on.
        with log.open("w") as sink:
            try:
                rc = subprocess.run(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
            except subprocess.TimeoutExpired:
                return {"error": f"timed out after {timeout_s:.0f} s", "wall_s": time.perf_counter() - t0}
        wall = time.perf_counter() - t0
        if rc != 0 or not dump.is_file():
            return {"error": first_error_line(log.read_text(errors="replace")), "returncode": rc, "wall_s": wall}
        res = json.loads(dump.read_text())
    res["wall_s"] = wall
    return res


def hf_logprobs(model: str, prompts: list[list[int]], completions: list[list[int]], attention: str) -> PerToken:
    """transformers fp32 with `attention` (its attn_implementation), one unpadded sequence per forward
    (tests/learner/_data.py's indexing)."""
    import torch
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation=attention).eval()
    out = []
    with torch.no_grad():
        for p, c in zip(prompts, completions):
            logp = net(torch.tensor([p + c])).logits.float().log_softmax(-1)[0]
            out.append(logp[len(p) - 1:-1].gather(-1, torch.tensor(c)[:, None])[:, 0].tolist())
    return out


def megatron_logprobs(a: argparse.Namespace, prompts: list[list[int]], completions: list[list[int]],
                      behavior: PerToken, attentions: tuple[str, ...]) -> dict[str, PerToken]:
    """Per learner.attention in `attentions`: the actor's `compute_log_prob` in a one-rank LearnerGroup (Megatron over
    gloo), one group after the other in a local Ray session."""
    import ray

    from asyncrl.config import AlgorithmConfig, LearnerConfig, ModelConfig
    from asyncrl.learner.group import LearnerGroup
    from asyncrl.types import Sample

    samples = [Sample(prompt_ids=p, response_ids=c, behavior_logprobs=list(b), versions=[0] * len(c), reward=0.0,
                      group_id=i // a.samples) for i, (p, c, b) in enumerate(zip(prompts, completions, behavior))]

    async def one(attention: str) -> PerToken:
        learner = LearnerConfig(world_size=1, micro_batch_size=a.micro_batch_size, num_cpus_per_rank=0.5, attention=attention)
        group = LearnerGroup("actor", ModelConfig(path=a.model, dtype="float32"), learner, AlgorithmConfig(group_size=a.samples))
        await group.start()
        try:
            return await group.compute_log_prob(samples)
        finally:
            await group.shutdown()

    init_ray(a.num_cpus)
    try:
        return {att: asyncio.run(one(att)) for att in attentions}
    finally:
        ray.shutdown()


def compare(a: PerToken, b: PerToken, tokens_a: list[list[int]], tokens_b: list[list[int]]) -> dict[str, Any]:
    """Token-by-token figures of a vs b, each sequence up to its first token that differs between the two (past
    it the contexts differ); `diverged_sequences`: those whose tokens differ."""
    diffs: list[float] = []
    pa: list[float] = []
    pb: list[float] = []
    equal = diverged = 0
    for ra, rb, ta, tb in zip(a, b, tokens_a, tokens_b, strict=True):
        n = next((k for k, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        diverged += ta != tb
        pa += ra[:n]
        pb += rb[:n]
        for x, y in zip(ra[:n], rb[:n], strict=True):
            equal += x == y
            diffs.append(x - y)
    count = len(diffs)
    return {"sequences": len(a), "diverged_sequences": diverged, "tokens": count,
            "bitwise_equal": equal / count if count else None,
            "mean_abs_diff": sum(map(abs, diffs)) / count if count else None,
            "max_abs_diff": max(map(abs, diffs)) if count else None,
            "k3": sum(math.expm1(d) - d for d in diffs) / count if count else None,
            "k3_metric": k3_metric(pa, pb) if count else None}


def k3_metric(a: list[float], b: list[float]) -> float:
    """k3 as the learner's `mismatch/k3` metric computes it (asyncrl.algorithms.mismatch) from float32
    log-probs, d = a - b."""
    import torch

    from asyncrl.algorithms.mismatch import mismatch_metrics, mismatch_sums

    pa, pb = torch.tensor([a], dtype=torch.float32), torch.tensor([b], dtype=torch.float32)
    return mismatch_metrics(mismatch_sums(pa, pb, torch.ones_like(pa, dtype=torch.bool)), prefix="m")["m/k3"]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def header(a: argparse.Namespace, default: dict[str, Any], bi: dict[str, Any] | None, timings: dict[str, float]) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    def ver(name: str) -> str:
        for dist in (name, f"{name}-cpu"):
            try:
                return version(dist)
            except PackageNotFoundError:
                continue
        return "absent"

    import torch

    if bi is None:
        bi_row: dict[str, Any] = {"run": False}
    else:
        bi_row = {"run": True, "started": "error" not in bi, "error": bi.get("error"), "returncode": bi.get("returncode"),
                  "wall_s": bi.get("wall_s")}
    return {"kind": "header", "bench": "mismatch_floor", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "versions": {n: ver(n) for n in VERSIONS}, "cpu": cpu_model(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "model": a.model, "dtype": "float32", "prompts": a.prompts,
            "samples": a.samples, "max_new_tokens": a.max_new_tokens, "ignore_eos": a.ignore_eos, "seed": a.seed, "temperature": 1.0,
            "learner_micro_batch_size": a.micro_batch_size, "engine_kwargs": default["engine_kwargs"],
            "batch_invariant": bi_row, "timings_s": timings}


def pair_rows(mode: str, logps: dict[str, PerToken], tokens: dict[str, list[list[int]]],
              pairs: tuple[tuple[str, str], ...]) -> list[dict[str, Any]]:
    return [{"kind": "pair", "mode": mode, "a": x, "b": y, **compare(logps[x], logps[y], tokens[x], tokens[y])} for x, y in pairs]


def table(rows: list[dict[str, Any]]) -> str:
    def num(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = ["| engine | a | b | tokens | diverged seqs | bitwise equal | mean abs diff | max abs diff | k3 | k3 (mismatch/k3 metric) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['a']} | {r['b']} | {r['tokens']} | {r['diverged_sequences']}/{r['sequences']} | "
                     f"{num(r['bitwise_equal'], '.4f')} | {num(r['mean_abs_diff'], '.3e')} | {num(r['max_abs_diff'], '.3e')} | "
                     f"{num(r['k3'], '.3e')} | {num(r['k3_metric'], '.3e')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.engine_child is not None:
        a.engine_child.write_text(json.dumps(engine_run(a)))
        # The interpreter's teardown can abort after that ("terminate called without an active exception": native
        # threads vLLM leaves behind), failing a run whose work is done; nothing is left to run (tests/conftest.py).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    print("engine (default) ...", flush=True)
    default = engine_child(a, batch_invariant=False)
    if "error" in default:
        raise SystemExit(f"the default engine failed: {default['error']}")
    timings["engine_default"] = default["wall_s"]
    bi = None
    if not a.skip_batch_invariant:
        print("engine (VLLM_BATCH_INVARIANT=1) ...", flush=True)
        bi = engine_child(a, batch_invariant=True)
        timings["engine_batch_invariant"] = bi["wall_s"]
        if "error" in bi:
            print(f"VLLM_BATCH_INVARIANT=1 engine failed (rc {bi.get('returncode')}): {bi['error']}", flush=True)
    prompts, completions = default["prompts"], default["E_batch"]["tokens"]
    t0 = time.perf_counter()
    print("transformers ...", flush=True)
    h = hf_logprobs(a.model, prompts, completions, "sdpa")
    h_eager = hf_logprobs(a.model, prompts, completions, "eager")
    timings["transformers"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    print("megatron learner ...", flush=True)
    learner = megatron_logprobs(a, prompts, completions, default["E_batch"]["logprobs"], ("auto", "local"))
    m, m_local = learner["auto"], learner["local"]
    timings["megatron"] = time.perf_counter() - t0

    names = ("E_batch", "E_again", "E_alone", "E_prefill")
    logps = {n: default[n]["logprobs"] for n in names} | {"H": h, "H_eager": h_eager, "M": m, "M_local": m_local}
    tokens = {n: default[n]["tokens"] for n in names} | {n: completions for n in ("H", "H_eager", "M", "M_local")}
    rows = pair_rows("default", logps, tokens, ENGINE_PAIRS + CROSS_PAIRS)
    if bi is not None and "error" not in bi:
        bl = {n: bi[n]["logprobs"] for n in names} | {"H": h, "M": m, "E_batch(default)": default["E_batch"]["logprobs"]}
        bt = {n: bi[n]["tokens"] for n in names} | {"H": completions, "M": completions, "E_batch(default)": completions}
        rows += pair_rows("batch_invariant", bl, bt, ENGINE_PAIRS + (("E_batch", "E_batch(default)"), ("E_batch", "H"),
                                                                      ("E_batch", "M")))
    timings["total"] = time.perf_counter() - t_start
    head = header(a, default, bi, timings)
    print(table(rows))
    print(json.dumps(head))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with a.out.open("w") as f:
        for r in [head, *rows]:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {a.out} ({len(rows)} pairs) in {timings['total']:.0f} s")


if __name__ == "__main__":
    main()
