"""One engine replica: an engine (behind its driver) plus its weight version, lifecycle and counters.

Owns: the replica's lifecycle (start, catch up from a `WeightStore` before a late replica serves, pause/resume,
sleep/wake, shutdown), token-level generation with a weight version on every token, the commit of a staged weight
version (paused apply, relabel, resume), stats and health. `EngineReplica` implements `asyncrl.interfaces.EngineAPI`
as a plain class; its parts are driver.py (vLLM's: vllm_engine.py), engine_update.py (`weights`: the update state),
version_source.py and replica_types.py; deployment.py wraps it for Ray Serve.
Must never: accept a request that has not passed `validate_request`, change the version label while the engine is
producing tokens, or apply staged tensors whose fingerprint differs from the one the caller committed.
Details: docs/design/generator.md, "The engine replica".
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from asyncrl.config import ConfigError, GeneratorConfig, ModelConfig
from asyncrl.generator.driver import EngineDriver, start_driver
from asyncrl.generator.engine_update import FingerprintMismatch, WeightUpdates
from asyncrl.generator.replica_types import SLEEP_TAGS, PauseMode, ReplicaNotReady, ReplicaState, UpdateState, VersionTracking, WeightUpdateError  # noqa: F401 - WeightUpdateError: the replica's vocabulary
from asyncrl.generator.sampling import Limits, validate_request
from asyncrl.generator.version_source import EngineStamps, LedgerVersions, VersionSource
from asyncrl.generator.versions import CompletionAccumulator
from asyncrl.types import (
    CommitReport,
    CompletionDelta,
    GenerationRequest,
    GenerationResult,
    GroupsReport,
    LoadReport,
    PlanAck,
    PlanRequest,
    Refusal,
    SyncReport,
    UpdateAck,
    UpdateBegin,
)
from asyncrl.weightsync.fingerprint import fingerprint_mode

logger = logging.getLogger(__name__)
HOST_TRIM_EVERY_S = 30.0  # how often a replica looks at its resident set (a read of /proc; a trim only past its slack)


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
        # Set at start: the engine's own stamps (vLLM >= 0.32), else the replica's ledger.
        self._versions: VersionSource | None = None
        self.replica_id = replica_id
        self.weight_source, self.weight_source_namespace = weight_source, weight_source_namespace
        self.state = ReplicaState.STARTING
        self.version = 0
        # the weight-update state (engine_update.py), reaching the workers through the driver once it started
        self.weights = WeightUpdates(replica_id, lambda verb, args, timeout: self.engine.worker_call(verb, args, timeout))
        self._paused_mode: str | None = None  # a pause some caller holds (resume clears it)
        self._asleep: set[str] = set()  # SLEEP_TAGS released now; the engine never runs while any is
        self._weights_discarded = False  # a level-2 sleep dropped the weights; cleared by the next commit
        self._control_lock = asyncio.Lock()  # one control operation at a time
        self._seq = itertools.count()
        self.engine: EngineDriver | None = None  # set at start (`generator.engine`'s driver)
        self.limits: Limits | None = None
        self.counters = {"requests": 0, "requests_failed": 0, "tokens_generated": 0, "ongoing": 0,
                         "updates_committed": 0, "updates_failed": 0, "version_fallbacks": 0,
                         "sleeps": 0, "sleep_seconds": 0.0, "wake_seconds": 0.0}
        self.started_at = time.time()
        from asyncrl.learner.memory import HostMemoryTrim

        self.host_trim = HostMemoryTrim()  # freed host memory given back as the resident set creeps (learner/memory.py)
        self._trim_task: asyncio.Task | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self.engine = engine = start_driver(self.model_cfg, self.gen_cfg)
        self.limits = Limits(max_n=self.gen_cfg.max_n, max_model_len=self.model_cfg.max_model_len,
                             vocab_size=engine.vocab_size)
        if self.version_tracking == "engine" and not engine.stamps_versions:
            raise ConfigError(f"version_tracking='engine' needs an engine that stamps tokens with versions "
                              f"(vLLM >= 0.32: AsyncLLM.update_weight_version); this {engine.name} does not")
        if self.version_tracking == "ledger" or not engine.stamps_versions:
            self._versions = LedgerVersions(engine, self.counters, self.replica_id)
            logger.info("replica %s: per-token versions from the replica's ledger", self.replica_id)
        else:
            self._versions = EngineStamps(engine, self.counters, lambda: self.version)
        await engine.relabel(self.version)
        checks = await self.weights.check_layout()
        problems = sorted({c.problem for c in checks if c.problem})
        if problems:
            logger.info("replica %s: weight pushes will reload through the engine's loader (%s)", self.replica_id, "; ".join(problems))
        else:
            logger.info("replica %s: weight pushes can copy into the live parameters (layout checked in %.2f s)",
                        self.replica_id, max(c.seconds for c in checks))
        self.state = ReplicaState.CATCHING_UP
        await self.sync_from_source()
        self.state = ReplicaState.READY
        self._trim_task = asyncio.get_running_loop().create_task(self._trim_host_memory())

    async def _trim_host_memory(self, every_s: float = HOST_TRIM_EVERY_S) -> None:
        """The replica's heaps keep what requests and pushes freed (tokenizing, detokenizing, bucket reads), so its
        resident set creeps under load though nothing is kept; every `every_s` the creep past its level is given back
        (`HostMemoryTrim`), off the event loop: a trim walks every heap."""
        while self.state is not ReplicaState.STOPPED:
            await asyncio.sleep(every_s)
            try:
                await asyncio.to_thread(self.host_trim.after_step)
            except Exception:  # (never the replica's failure: it only serves memory back)
                logger.exception("replica %s: host memory trim failed", self.replica_id)

    async def sync_from_source(self) -> SyncReport:
        """Load the weight source's latest version if it is newer than ours (late joiners), then
        take the push plan the pushes use now."""
        if not self.weight_source:
            return SyncReport(replica_id=self.replica_id, version=self.version, loaded=False)
        import ray

        try:
            store = ray.get_actor(self.weight_source, namespace=self.weight_source_namespace)
        except ValueError:
            return SyncReport(replica_id=self.replica_id, version=self.version, loaded=False)
        layout = await self._load_latest(store)
        plan_id = await self.weights.adopt_plan(await store.push_plan.remote())
        return SyncReport(replica_id=self.replica_id, version=self.version, loaded=layout is not None, layout=layout,
                          push_plan=plan_id)

    async def _load_latest(self, store: Any) -> str | None:
        """The store's latest version loaded if newer than ours; the layout it came in (None: nothing loaded)."""
        version, buckets, fingerprint, plan = await store.latest.remote()
        if version <= self.version or buckets is None:
            return None
        logger.info("replica %s catching up to weight version %d", self.replica_id, version)
        t0 = time.perf_counter()
        mode = fingerprint_mode(fingerprint)
        layout, plan_id, payloads = "hf", None, list(buckets)
        if plan is not None:  # buckets in an engine layout: ours, or rebuild the HF tensors from them
            try:
                plan_id = await self.weights.take_plan(plan)
                layout = "engine"
            except Exception as err:
                from asyncrl.weightsync.fingerprint import tensor_fingerprint
                from asyncrl.weightsync.plan import hf_from_engine

                logger.info("replica %s: the stored version's layout is not this engine's (%s); loading it as HF tensors",
                            self.replica_id, err)
                tensors = hf_from_engine(plan, payloads)
                payloads, fingerprint = [tensors], tensor_fingerprint(tensors, mode)
        await self.load_bucket(payloads, version, UpdateBegin(mode, layout=layout, plan_id=plan_id))
        await self.commit_update(version, fingerprint)
        logger.info("replica %s serves weight version %d (caught up in %.1f s, %s layout)", self.replica_id,
                    self.version, time.perf_counter() - t0, layout)
        return layout

    def shutdown(self) -> None:
        if self._trim_task is not None:
            self._trim_task.cancel()
        if self.engine is not None:
            self.engine.shutdown()
        self.state = ReplicaState.STOPPED

    # ---- weight updates (the state: engine_update.py's WeightUpdates) ------------------------

    async def set_push_plan(self, request: PlanRequest | None) -> PlanAck:
        """Form and hold the push plan of the learner's export `request` describes (None: pushes reload)."""
        async with self._control_lock:
            return await self.weights.form_plan(request)

    async def load_bucket(self, named_tensors: Any, version: int, begin: UpdateBegin) -> LoadReport:
        """Stage `version` from a payload (a `CollectiveReceive`, or a list of shared files, buckets or their
        ObjectRefs); `begin` starts the update (a refused begin stages nothing)."""
        async with self._control_lock:
            return await self.weights.load(named_tensors, version, begin, self.version)

    async def join_collective(self, specs: list[dict[str, Any]] | None = None, timeout_s: float = 120.0) -> GroupsReport:
        """Join the groups `specs` (every worker, concurrently with the senders); None: join nothing. Answers how many
        workers this replica has (each one receiver rank) and which groups every one of them holds."""
        if (dead := self.engine.dead()) is not None:  # (its workers hold no group a push could use)
            raise WeightUpdateError(f"replica {self.replica_id}: {dead}")
        if specs is None:
            return await self.weights.groups()
        async with self._control_lock:
            return await self.weights.join(specs, timeout_s)

    async def commit_update(self, version: int, fingerprint: str) -> CommitReport:
        """Check the staged version against `fingerprint` (nothing applied if it differs), then, paused, apply it
        and relabel. A caller that did not pause is paused here, and resumed after a successful apply; a failed
        apply leaves the replica paused (weightsync restores the last live version, then resumes it)."""
        async with self._control_lock:
            if "weights" in self._asleep:
                raise WeightUpdateError(f"replica {self.replica_id}: commit of version {version} while its weights are "
                                        "asleep (wake_up(['weights']) first); nothing applied")
            try:
                self.weights.check(version, fingerprint)
            except FingerprintMismatch as err:
                self.counters["updates_failed"] += 1
                await self.weights.drop()
                raise WeightUpdateError(f"replica {self.replica_id}: commit of version {version} rejected, "
                                        f"staying on {self.version}: {err}", Refusal.VERIFY_FAILED) from None
            # The version label may only change while no step runs; pause here if the caller did not.
            paused_here = self.state is ReplicaState.READY and self._may_run()
            t_pause = time.perf_counter()
            if paused_here:
                await self._pause_engine("keep")
                self._paused_mode = "keep"  # held until the apply succeeded
            t_paused = time.perf_counter()
            try:
                # paused: no step runs, so the counts the workers read with the apply hold until resume
                applied = await self.weights.apply(version, before=self._versions.counts_query)
                sampled = await self._versions.counts(applied.before)
            except Exception as err:
                self.counters["updates_failed"] += 1
                raise WeightUpdateError(
                    f"replica {self.replica_id}: commit of version {version} failed while applying (possibly part "
                    f"applied; the replica stays paused until restored): {err}", applying=True
                ) from err
            t_applied = time.perf_counter()
            await self.engine.relabel(version)
            if not paused_here:  # our own pause above cleared the caches, and nothing ran since
                await self.engine.reset_prefix_cache()
            self._versions.mark(version, sampled)  # no await between this and the label change
            self.version = version
            self._weights_discarded = False
            self.counters["updates_committed"] += 1
            # resume what this commit paused, or start an awake engine a level-2 sleep had left without weights
            if paused_here:
                self._paused_mode = None
            t_relabelled = time.perf_counter()
            if self.state is ReplicaState.READY and paused_here and self._may_run():
                await self._resume_sent()
            elif self.state is ReplicaState.READY and (paused_here or self._may_run()):
                await self._settle()
            end = time.perf_counter()
            apply_s = applied.apply_seconds
            return CommitReport(
                replica_id=self.replica_id, version=self.version, path=applied.path,
                # the paused window: the engine's pause, the workers' round trip (the apply in it), relabel, resume
                seconds={"apply": apply_s, "reload": apply_s if applied.path == "reload" else 0.0,
                         "paused": end - t_pause if paused_here else 0.0, "pause_call": t_paused - t_pause,
                         "apply_rpc": t_applied - t_paused, "relabel": t_relabelled - t_applied,
                         "resume_call": end - t_relabelled})

    async def _resume_sent(self) -> None:
        """Resume the engine this commit paused without awaiting its answer: the call is on the wire when this
        returns, so any later call (a pause, a request) reaches the engine after it. A failure is only logged (the
        engine is gone; its health check and the next push say so)."""
        task = asyncio.ensure_future(self._settle())

        def report(done: asyncio.Future) -> None:
            if not done.cancelled() and done.exception() is not None:
                logger.warning("replica %s: resume after a commit failed: %s", self.replica_id, done.exception())

        task.add_done_callback(report)
        self._resuming = task  # (kept referenced until it is done)
        await asyncio.sleep(0)

    async def abort_update(self) -> UpdateAck:
        async with self._control_lock:
            await self.weights.drop()
            return UpdateAck(replica_id=self.replica_id, version=self.version)

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
        assert self.limits is not None and self.engine is not None
        validate_request(request, self.limits)
        engine = self.engine
        self._raise_if_dead()
        prepared = engine.prepare(request.sampling, stream=stream)
        # Callers may reuse request ids (GRPO groups, retries); the engine's id must be unique in flight.
        engine_id = f"{request.request_id}-{next(self._seq)}"
        accs = {i: CompletionAccumulator(i) for i in range(request.sampling.n)}
        source = self._versions
        assert source is not None
        source.open(engine_id, request.sampling.n, self.version)
        self.counters["requests"] += 1
        self.counters["ongoing"] += 1
        try:
            async for out in engine.outputs(engine_id, list(request.prompt_ids), prepared,
                                            lambda: source.handed_over(engine_id)):
                versions_of = source.for_output(engine_id)
                deltas = []
                for c in out.outputs:
                    acc = accs[c.index]
                    new = list(c.token_ids)
                    begin = len(acc.token_ids)
                    versions, final = versions_of(c, begin, len(new))
                    lps, text = engine.read(c, new, prepared)
                    deltas.append(acc.add(request.request_id, new, lps, versions, text, c.finish_reason))
                    if c.finish_reason is not None:
                        acc.routes = engine.routes(c)
                    if final is not None:
                        acc.reconcile(final)
                    self.counters["tokens_generated"] += len(new)
                if deltas:
                    yield deltas, accs
        except Exception as err:
            self.counters["requests_failed"] += 1
            self._raise_if_dead(err)
            raise
        except BaseException:
            self.counters["requests_failed"] += 1
            raise
        finally:
            self.counters["ongoing"] -= 1
            source.close(engine_id)

    def _raise_if_dead(self, cause: BaseException | None = None) -> None:
        """A request to (or on) a replica whose engine died is the service being unavailable until Serve's health
        check replaces the replica (HTTP 503 with Retry-After at the gateway, which retries it once), not an error
        of the request."""
        dead = self.engine.dead() if self.engine is not None else None
        if dead:
            raise ReplicaNotReady(f"replica {self.replica_id}: {dead}; it is being replaced") from cause

    # ---- pause / resume --------------------------------------------------------------------

    async def pause(self, mode: PauseMode = "keep") -> dict[str, Any]:
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause mode must be abort|wait|keep, got {mode!r}")
        if not self._asleep:  # asleep, the engine is paused already and its KV memory released
            await self._pause_engine(mode)
        self._paused_mode = mode
        return {"replica_id": self.replica_id, "paused": True, "mode": mode, "version": self.version}

    async def _pause_engine(self, mode: PauseMode) -> None:
        # Running requests are preempted and recompute their KV on resume, and no prefix computed
        # with old weights survives into the new version (the driver clears the prefix cache).
        await self.engine.pause(mode)

    async def resume(self) -> dict[str, Any]:
        self._paused_mode = None
        running = self._may_run()
        if running:
            await self.engine.run()
        # Asleep (or holding discarded weights): the engine runs at the wake that completes it.
        return {"replica_id": self.replica_id, "paused": False, "running": running, "version": self.version}

    # ---- sleep / wake ----------------------------------------------------------------------
    # Sleep implies a pause: a sleeping replica never runs a step. Running requests are preempted
    # first (their KV dropped; they recompute after wake, on whatever weights are live then), so no
    # request holds KV memory while it is discarded. `wake_up` may go part way (weights first, for
    # a weight update into a replica whose KV cache is still released: hybrid placement); the
    # engine runs again only once everything is awake, no caller holds a pause, and (after a
    # level-2 sleep, which discards the weights) a weight update has been committed.

    def _may_run(self) -> bool:
        return not self._asleep and not self._weights_discarded and self._paused_mode is None

    async def sleep(self, level: int = 1) -> dict[str, Any]:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        reason = self.engine.sleep_unsupported()
        if reason:
            return {"replica_id": self.replica_id, "supported": False, "sleeping": False, "reason": reason}
        async with self._control_lock:
            if not self._asleep:
                t0 = time.perf_counter()
                await self.engine.preempt()
                await self.weights.drop()  # (and a push's kept receive buffers: released with the engine's memory)
                await self.engine.sleep(level)  # keeping the preempted requests
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
        reason = self.engine.sleep_unsupported()
        if reason:
            return {"replica_id": self.replica_id, "supported": False, "sleeping": False, "reason": reason}
        async with self._control_lock:
            todo = [t for t in SLEEP_TAGS if t in wanted and t in self._asleep]  # weights before KV
            if todo:
                t0 = time.perf_counter()
                await self.engine.wake(todo)
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
            await self.engine.run()
        else:
            await self.engine.hold()

    # ---- observability ---------------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        return {
            "replica_id": self.replica_id,
            "state": self.state.value,
            "update_state": self.weights.state.value,
            "version": self.version,
            "push_plan": self.weights.plan_id,  # the push plan whose engine-layout buckets it copies in (None: reloads)
            "paused": self._paused_mode is not None,
            "pause_mode": self._paused_mode,
            "asleep": sorted(self._asleep),
            "engine": self.gen_cfg.engine,
            "sleep_unsupported": self.engine.sleep_unsupported() if self.engine else None,
            "engine_unfinished_requests": self.engine.unfinished_requests() if self.engine else 0,
            "uptime_s": time.time() - self.started_at,
            "host_memory_trims": self.host_trim.trims,
            **{f"generator/{k}": v for k, v in self.counters.items()},
            "generator/tokens_in_flight": self._tokens_in_flight(),
        }

    def _tokens_in_flight(self) -> int:
        """Tokens the engine has produced for sequences still running, returned or not. A
        non-streaming request returns its tokens only when it ends (`tokens_generated` counts
        them then); this is its progress until then (vLLM: read from its output processor)."""
        return self.engine.tokens_in_flight() if self.engine is not None else 0

    async def check_health(self) -> None:
        if self.state not in (ReplicaState.READY, ReplicaState.SLEEPING):
            raise ReplicaNotReady(f"replica {self.replica_id} is {self.state.value}")
        dead = self.engine.dead()
        if dead:
            raise RuntimeError(f"replica {self.replica_id}: {dead}")

