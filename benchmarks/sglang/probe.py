"""Issue 23: settle, on a GPU, what docs/design/sglang-0.5.15-api.md could only read in SGLang's source.

    PYTHONPATH=/tmp/site-sglang:/tmp/site:$PWD python3 benchmarks/sglang/probe.py MODEL_DIR [--out probe.json]

One SGLang engine, built the way the design's replica would build it (off the event loop, in a worker
thread, then driven only through its async API from the main loop), on a Hugging Face model directory
(a random Qwen2: benchmarks/make_random_qwen2.py). Each step prints one JSON line as it finishes and a
failing step records its error and the probe goes on, so a cut run still says what it settled:

  start         the engine built in a thread with skip_tokenizer_init and incremental streaming
  greedy        a non-streaming greedy request with log-probs: the result's keys, meta_info's keys,
                finish_reason, the first (logprob, token id, text) triples, weight_version
  stream        the same request streamed: per chunk, the new token count and weight_version
  commit        a streamed request in flight across pause_generation(retract) ->
                update_weights_from_tensor(flush_cache=False, weight_version="7", CUDA-IPC tensors in HF
                names, the embedding perturbed) -> continue_generation: the chunks' versions and
                num_retractions, whether the tokens changed after the commit
  restore       the original tensors pushed back: greedy tokens equal the first greedy's again
  flush         tm.flush_cache when idle
  abort         a streamed request aborted by rid mid-way: how its stream ends
  state         get_internal_state's round trip (the replica's health call and its ledger's barrier), and
                a request with extra_key (the design's cache salt) accepted
  sleep         a second engine with enable_memory_saver: pause(abort) -> release_memory_occupation ->
                resume(weights) -> push -> resume(kv_cache, cuda_graph) -> continue, greedy tokens after it

`--engine-kwargs JSON` go to every sglang.Engine; the default picks the backends a slim wheel set has
(benchmarks/sglang/slim_wheels.py: attention_backend triton, sampling_backend pytorch).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import traceback
from pathlib import Path

PROMPT = [5, 17, 9, 33, 2, 101, 7, 64]
GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
report: dict = {}


def record(name: str, value) -> None:
    report[name] = value
    print(json.dumps({name: value}, default=str)[:4000], flush=True)


async def step(name: str, coro, timeout: float = 90.0):
    t = time.perf_counter()
    try:
        value = await asyncio.wait_for(coro, timeout)
        record(name, {"ok": True, "seconds": round(time.perf_counter() - t, 3), **(value or {})})
        return value
    except BaseException as err:  # noqa: BLE001 - a probe records every failure and goes on
        record(name, {"ok": False, "seconds": round(time.perf_counter() - t, 3), "error": f"{type(err).__name__}: {err}",
                      "trace": traceback.format_exc()[-1500:]})
        return None


async def chunks_of(gen) -> list[dict]:
    out = []
    async for c in gen:
        meta = c.get("meta_info", {})
        out.append({"n": len(c.get("output_ids") or []), "version": meta.get("weight_version"),
                    "finish": meta.get("finish_reason"), "retractions": meta.get("num_retractions"),
                    "ids": list(c.get("output_ids") or [])})
    return out


def hf_tensors(model: str, device: str) -> list[tuple[str, object]]:
    from safetensors.torch import load_file

    named = []
    for f in sorted(Path(model).glob("*.safetensors")):
        named += [(n, t.to(device)) for n, t in load_file(str(f)).items()]
    return named


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--engine-kwargs", default='{"attention_backend": "triton", "sampling_backend": "pytorch"}')
    ap.add_argument("--skip-sleep", action="store_true")
    args = ap.parse_args()
    kwargs = json.loads(args.engine_kwargs)

    import sglang
    import torch

    record("versions", {"sglang": sglang.__version__, "torch": torch.__version__})
    engine = None

    async def start():
        nonlocal engine
        engine = await asyncio.to_thread(lambda: sglang.Engine(
            model_path=args.model, skip_tokenizer_init=True, incremental_streaming_output=True,
            mem_fraction_static=0.3, log_level="error", **kwargs))
        return {}

    await step("start", start(), timeout=240)
    if engine is None:
        return
    from sglang.srt.managers.io_struct import ContinueGenerationReqInput, PauseGenerationReqInput, UpdateWeightsFromTensorReqInput
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    tm = engine.tokenizer_manager
    first: dict = {}

    async def greedy():
        out = await engine.async_generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
        meta = out["meta_info"]
        first["ids"] = list(out["output_ids"])
        return {"keys": sorted(out), "meta_keys": sorted(meta), "output_ids": out["output_ids"],
                "finish_reason": meta.get("finish_reason"), "logprobs_head": meta.get("output_token_logprobs", [])[:3],
                "weight_version": meta.get("weight_version")}

    await step("greedy", greedy())

    async def stream():
        gen = await engine.async_generate(input_ids=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 32},
                                          stream=True, return_logprob=True)
        cs = await chunks_of(gen)
        return {"chunks": [{k: v for k, v in c.items() if k != "ids"} for c in cs][:12], "count": len(cs),
                "ids_incremental": sum(c["n"] for c in cs) == 32, "same_as_greedy": [i for c in cs for i in c["ids"]][:16] == first.get("ids")}

    await step("stream", stream())

    original = hf_tensors(args.model, "cuda")
    monkey_patch_torch_reductions()

    async def push(named, version: str):
        t = time.perf_counter()
        payload = MultiprocessingSerializer.serialize(named)
        serialized = time.perf_counter() - t
        result = await tm.update_weights_from_tensor(UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[payload], load_format=None, flush_cache=False, weight_version=version), None)
        record(f"push_{version}_timing", {"serialize_s": round(serialized, 4), "total_s": round(time.perf_counter() - t, 4),
                                          "tensors": len(named)})
        return result

    async def commit():
        gen = await engine.async_generate(input_ids=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 400},
                                          stream=True, rid="inflight-1")
        inflight = asyncio.ensure_future(chunks_of(gen))
        await asyncio.sleep(0.2)
        t = time.perf_counter()
        await tm.pause_generation(PauseGenerationReqInput(mode="retract"))
        paused = time.perf_counter() - t
        perturbed = [(n, t + 0.5 * torch.randn_like(t) if "embed_tokens" in n else t) for n, t in original]
        t = time.perf_counter()
        result = await push(perturbed, "7")
        pushed = time.perf_counter() - t
        await tm.continue_generation(ContinueGenerationReqInput())
        cs = await inflight
        after = await engine.async_generate(input_ids=PROMPT, sampling_params=GREEDY)
        return {"update_result": str(result), "pause_s": round(paused, 4), "update_s": round(pushed, 4),
                "inflight_versions": sorted({str(c["version"]) for c in cs}), "inflight_chunks": len(cs),
                "inflight_tokens": sum(c["n"] for c in cs), "retractions": [c["retractions"] for c in cs][-1:],
                "finish": cs[-1]["finish"] if cs else None,
                "version_switch_at": next((sum(x["n"] for x in cs[:i]) for i, c in enumerate(cs) if str(c["version"]) == "7"), None),
                "greedy_changed": list(after["output_ids"]) != first.get("ids"), "after_version": after["meta_info"].get("weight_version")}

    await step("commit", commit())

    async def restore():
        result = await push(original, "8")
        out = await engine.async_generate(input_ids=PROMPT, sampling_params=GREEDY)
        return {"update_result": str(result), "greedy_equal_first": list(out["output_ids"]) == first.get("ids"),
                "version": out["meta_info"].get("weight_version")}

    await step("restore", restore())

    async def flush():
        return {"result": str(await tm.flush_cache(timeout_s=10))}

    await step("flush", flush(), timeout=30)

    async def abort():
        gen = await engine.async_generate(input_ids=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 2000},
                                          stream=True, rid="to-abort")
        got = asyncio.ensure_future(chunks_of(gen))
        await asyncio.sleep(0.2)
        tm.abort_request(rid="to-abort")
        cs = await got
        return {"chunks": len(cs), "tokens": sum(c["n"] for c in cs), "finish": cs[-1]["finish"] if cs else None}

    await step("abort", abort(), timeout=60)

    async def state():
        times = []
        for _ in range(20):
            t = time.perf_counter()
            st = await tm.get_internal_state()
            times.append(time.perf_counter() - t)
        salted = await engine.async_generate(input_ids=PROMPT, sampling_params=GREEDY, extra_key="w8")
        return {"round_trip_ms_median": round(1e3 * sorted(times)[len(times) // 2], 3), "state_head": str(st)[:600],
                "salted_equal_first": list(salted["output_ids"]) == first.get("ids")}

    await step("state", state(), timeout=60)
    try:
        engine.shutdown()
    except BaseException as err:  # noqa: BLE001
        record("shutdown", f"{type(err).__name__}: {err}")
    if args.skip_sleep:
        return
    from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput, ResumeMemoryOccupationReqInput

    async def sleep():
        nonlocal engine, tm
        import torch

        engine = await asyncio.to_thread(lambda: sglang.Engine(
            model_path=args.model, skip_tokenizer_init=True, incremental_streaming_output=True,
            mem_fraction_static=0.3, log_level="error", enable_memory_saver=True, **kwargs))
        tm = engine.tokenizer_manager
        before = await engine.async_generate(input_ids=PROMPT, sampling_params=GREEDY)
        free0 = torch.cuda.mem_get_info()[0]
        await tm.pause_generation(PauseGenerationReqInput(mode="abort"))
        t = time.perf_counter()
        await tm.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=None), None)
        released = time.perf_counter() - t
        free1 = torch.cuda.mem_get_info()[0]
        t = time.perf_counter()
        await tm.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=["weights"]), None)
        await push(original, "9")
        await tm.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=["kv_cache", "cuda_graph"]), None)
        await tm.continue_generation(ContinueGenerationReqInput())
        woke = time.perf_counter() - t
        after = await engine.async_generate(input_ids=PROMPT, sampling_params=GREEDY)
        return {"freed_gb": round((free1 - free0) / 1e9, 2), "release_s": round(released, 3), "wake_and_push_s": round(woke, 3),
                "greedy_equal_first": list(after["output_ids"]) == first.get("ids"),
                "before_equal_first": list(before["output_ids"]) == first.get("ids"),
                "version": after["meta_info"].get("weight_version")}

    await step("sleep", sleep(), timeout=300)
    try:
        engine.shutdown()
    except BaseException as err:  # noqa: BLE001
        record("shutdown2", f"{type(err).__name__}: {err}")


if __name__ == "__main__":
    try:
        asyncio.run(main())
    finally:
        if "--out" in sys.argv:
            Path(sys.argv[sys.argv.index("--out") + 1]).write_text(json.dumps(report, indent=1, default=str))
