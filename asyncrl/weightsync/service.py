"""The training loop's weightsync entry point (learner export -> atomic push -> every engine replica), and the store
of the live version for replicas that start later.

Owns: wiring one run's pieces (its channel, `select_channel`; the learner's export, the push plan formed with the
engines, the `Pusher`, the deployment as one `ReplicaClient`, the collective groups), the one recovery path
(`WeightPublisher.publish` pushes a failed version again once the replicas are healthy), and the `WeightStore` actor
a late replica loads before it reports healthy. Must never: sequence a training step (trainer/loop.py), or let a
version go live that a running replica did not commit (push.py; the store is told only once it is live).
Details: docs/design/weightsync.md."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import time
from collections.abc import Callable
from typing import Any

from asyncrl.config import WeightsyncConfig
from asyncrl.interfaces import EngineAPI
from asyncrl.types import PlanRequest, Refusal, learner_failure
from asyncrl.weightsync.bucket import Bucket, digest_key_prefix
from asyncrl.weightsync.fingerprint import bucket_digests, combine_digests, fingerprint_mode
from asyncrl.weightsync.link import CollectiveLink
from asyncrl.weightsync.plan import ManifestEntry, PlanError
from asyncrl.weightsync.push import Pusher, VersionRegistry, WeightsyncError
from asyncrl.weightsync.shm import ShmChannel
from asyncrl.weightsync.sources import BucketSource, DeploymentReplicas, Step, StreamedSource
from asyncrl.weightsync.transport import BroadcastChannel, Channel, ObjectStoreChannel, is_object_ref

log = logging.getLogger(__name__)


def auto_transport(*, on_gpu: bool, hybrid: bool, own_gpus: bool, one_host: bool, gpus: float) -> str:
    """What `transport: auto` means, apart from the cluster it reads: ipc where the learner and the engines share
    GPUs (hybrid, or a host of one GPU: handles, no bytes cross host memory); nccl where each holds whole GPUs of
    its own, and across GPU hosts; shm for a hybrid or one-host run otherwise (CPUs, or fractional GPUs on a host of
    several: where they sit is Ray's choice); object_store across CPU hosts."""
    if hybrid or (one_host and on_gpu and 0 < gpus <= 1):  # the engines share the learner's devices
        return "ipc" if on_gpu else "shm"
    if one_host and not (on_gpu and own_gpus):  # CPUs, or GPUs where Ray places each process
        return "shm"
    return "nccl" if on_gpu else "object_store"


def select_channel(config: WeightsyncConfig, *, on_gpu: bool = False, hybrid: bool = False,
                   own_gpus: bool = False) -> Channel:
    """`config.transport`'s channel, `auto` resolved against the running cluster (`auto_transport`; flags: as below)."""
    kind = config.transport
    if kind == "auto":  # (one live node: every process shares /dev/shm; its GPUs)
        import ray

        one_host = ray.is_initialized() and sum(1 for n in ray.nodes() if n.get("Alive")) == 1
        kind = auto_transport(on_gpu=on_gpu, hybrid=hybrid, own_gpus=own_gpus, one_host=one_host,
                              gpus=float(ray.cluster_resources().get("GPU", 0)) if one_host and on_gpu else 0.0)
    if kind == "object_store":
        return ObjectStoreChannel(get_timeout_s=config.timeout_s)
    if kind == "shm":
        return ShmChannel()
    return BroadcastChannel(kind, on_gpu=on_gpu, get_timeout_s=config.timeout_s)  # (gloo, nccl or ipc: the rest)


class WeightPublisher:
    """`start()` once, then `publish(version)` after each learner update."""

    def __init__(self, cfg: WeightsyncConfig, *, engine: Any, learner: Any, hybrid: bool = False, on_gpu: bool = False,
                 own_gpus: bool = False) -> None:
        # engine: fans a call out to every engine replica (the generator's EngineControl).
        # on_gpu: the learner ranks hold GPUs (this process may not: it is the controller's).
        # own_gpus: every learner rank and engine replica holds whole GPUs (transport auto: nccl on one host).
        self.cfg, self.learner, self.hybrid, self.on_gpu, self.own_gpus = cfg, learner, hybrid, on_gpu, own_gpus
        self.replicas = DeploymentReplicas(engine, cfg.timeout_s)
        self.plan: Any = None  # the push plan the engines and the learner's senders hold (None: HF tensors)
        self.manifest: list[Any] = []
        self.pusher: Pusher | None = None
        self.transport: Channel | None = None
        self.store: Any = None
        self.link: CollectiveLink | None = None  # collective transports only
        self.recoveries_total = 0
        self._stopping = asyncio.Event()  # the run is stopping: a failed push is not pushed again

    async def start(self, initial_version: int = 0) -> None:
        """Create (or attach to) the store actor, and keep a host copy of the weights the engines already serve
        (`initial_version`) so a torn first push can roll back."""
        import ray

        await self.replicas.control.wait_ready(timeout_s=max(600.0, self.cfg.timeout_s))
        # On this (the trainer's) node, hard: the store holds the live version and must not die with an engine or
        # learner node; Ray often places a zero-resource actor elsewhere, even under soft affinity.
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.store = ray.remote(WeightStore).options(
            name=STORE_NAME, namespace=STORE_NAMESPACE, get_if_exists=True, num_cpus=0, scheduling_strategy=here
        ).remote()
        transport = select_channel(self.cfg, on_gpu=self.on_gpu, hybrid=self.hybrid, own_gpus=self.own_gpus)
        self.pusher = Pusher(
            self.cfg, transport=transport, registry=VersionRegistry(initial_version),
            on_live=weight_store_hook(self.store, lambda version: self.plan),
        )
        self.transport = transport
        if transport.streamed:
            control = self.replicas.control
            self.link = CollectiveLink(
                transport.backend, self.learner, bucket_mb=self.cfg.bucket_mb, timeout_s=self.cfg.timeout_s,
                # through the replicas' client: the fan-out a push reads is then the one just counted
                members=lambda: self.replicas.call(EngineAPI.join_collective),
                join=lambda wire: control.call(EngineAPI.join_collective, wire, self.cfg.timeout_s, timeout_s=self.cfg.timeout_s + 30.0),
                health=self._healthy,
            )
        # The seed (and, for collective transports, every host copy) lives in the object store.
        export = await self.learner.export_weights(self.cfg.bucket_mb, "object_store" if transport.streamed
                                                   else transport.name, self.cfg.verify)
        self.manifest = [ManifestEntry(m.name, m.dtype, tuple(m.shape), sender)
                         for metas, sender in zip(export.metas, export.senders) for m in metas]
        try:
            self.pusher.seed(BucketSource(export.buckets, transport, self.cfg.verify, export.digests))
        except BaseException:  # nothing keeps the start export's buckets: free them (shm files) now
            for handle in export.buckets:
                transport.release(handle)
            raise
        await self.form_plan()
        if not self.hybrid:
            await self.form_groups()

    async def form_groups(self) -> None:
        """Form the groups before the first push (a push re-forms lost ones): by `start` when separated; hybrid, in
        the start's warm-up switch, memory as a push finds it (Colocation.warm_up)."""
        if self.link is None:
            return
        t = time.monotonic()
        await self.link.ensure()
        log.info("weightsync: groups formed before the first push in %.1f s", time.monotonic() - t)

    async def form_plan(self) -> None:
        """Every engine replica forms the push plan of the learner's export from its workers' layouts; if all formed
        the same one, the sending learner ranks get it, else every replica drops its own (pushes reload)."""
        plan, problem, timeout_s = None, "weightsync.apply is 'reload'", max(600.0, self.cfg.timeout_s)
        if self.cfg.apply != "reload":
            request = PlanRequest(manifest=dump_manifest(self.manifest), bucket_mb=self.cfg.bucket_mb)
            acks = await self.replicas.control.call(EngineAPI.set_push_plan, request, timeout_s=timeout_s)
            problems = sorted({f"{rid}: {a.problem}" for rid, a in acks.items() if a.plan is None})
            if problems:
                problem = problems[0]
            elif len({a.plan_id for a in acks.values()}) != 1:
                problem = f"the engine replicas' push plans differ ({len({a.plan_id for a in acks.values()})} kinds)"
            else:
                plan = pickle.loads(next(iter(acks.values())).plan)
                for why in {a.problem for a in acks.values() if a.problem}:
                    log.info("weightsync: %s", why)
        if plan is None:
            await self.replicas.control.call(EngineAPI.set_push_plan, None, timeout_s=timeout_s)
            if self.cfg.apply == "direct":
                raise PlanError(f"weightsync.apply is 'direct' but no push plan can be made: {problem}")
        senders_before = self.plan.senders if self.plan is not None else None
        await self.store.set_push_plan.remote(plan)  # a replica that starts later takes it there (sync_from_source)
        await self.learner.set_push_plan(pickle.dumps(plan) if plan is not None else None, host_copies=self._pins())
        self.plan = plan
        if self.link is not None and senders_before != (plan.senders if plan is not None else None):
            self.link.forget()  # other learner ranks send now: the groups form again
        if plan is not None:
            log.info("weightsync: push plan %s: %d engine rank(s), %d buckets, %.1f MB; engines copy into their "
                     "parameters", plan.plan_id, plan.ranks, len(plan.buckets), plan.nbytes / 1e6)
        else:
            log.info("weightsync: pushes carry HF tensors and engines reload them (%s)", problem)

    def _pins(self) -> bool:
        """Whether the sending ranks keep pinned host copies of what they send (ipc, NCCL: device buckets)."""
        return self.on_gpu and self.transport is not None and self.transport.backend in ("ipc", "nccl")

    async def rebind_learner(self, learner: Any) -> None:
        """A restarted learner group takes the old one's place: it packs for the same push plan (same model and
        manifest); the next push forms the groups again with its ranks. The live version's host copy stays."""
        self.learner = learner
        if self.link is not None:
            self.link.learner = learner
            self.link.forget()
        await learner.set_push_plan(pickle.dumps(self.plan) if self.plan is not None else None, host_copies=self._pins())

    async def publish(self, version: int) -> dict[str, float]:
        """Push the learner's current weights as `version`; returns the push metrics. A push that failed on the engine
        side (Serve replaces a dead replica) is pushed again, as the same version, once every running replica is
        healthy, until `weightsync.recovery_s` runs out. Raises `WeightsyncError` (engines on the previous version)
        when the export itself failed or recovery ran out."""
        if self.pusher is None:
            raise RuntimeError("WeightPublisher.start() was not called")
        deadline = time.monotonic() + self.cfg.recovery_s
        recoveries = 0
        while True:
            try:
                metrics = await self._publish_once(version)
                metrics["weightsync/recoveries"] = float(recoveries)
                self.recoveries_total += recoveries
                metrics["weightsync/recoveries_total"] = float(self.recoveries_total)
                return metrics
            except WeightsyncError as err:
                if self._stopping.is_set() or time.monotonic() >= deadline or learner_failure(err) is not None or (
                        err.step is Step.EXPORT and not await self._receivers_may_be_at_fault()):
                    # A failed learner rank (its group unusable until the trainer restarts it from a checkpoint)
                    # is not the engines' to recover: retrying would spin until recovery_s, so it goes up at once.
                    raise
                if Refusal.PLAN_MISSING in err.refusals.values():  # a replica that started later: form the plan with it
                    await self.form_plan()
                recoveries += 1
                log.warning("weightsync: push of version %d failed (%s); pushing again once the engine replicas "
                            "are healthy (%.0f s of recovery left)", version, err, deadline - time.monotonic())
                await self._wait_healthy(deadline)

    def stop_recovering(self) -> None:
        """The run is stopping (its engines may be going away): a push that fails, or one waiting for the engines
        to recover, gives up at once instead of after `recovery_s`."""
        self._stopping.set()

    async def _receivers_may_be_at_fault(self) -> bool:
        """After an EXPORT failure, whether to recover: a collective send also fails when a receiving replica died
        mid-broadcast, or when the publisher stopped it for a group member no load reached; not when every running
        replica is healthy and it was not stopped (the learner's export failed). A host transport's involves none."""
        if self.link is None:
            return False
        if self.link.receivers_failed:
            return True
        try:
            return not await self._healthy()
        except Exception:
            return True

    async def _healthy(self, timeout_s: float = 30.0) -> bool:
        """Whether a replica runs and every running one passes its health check (raises for one that fails it)."""
        return await self.replicas.control.call(EngineAPI.check_health, timeout_s=min(timeout_s, self.cfg.timeout_s))

    async def _wait_healthy(self, deadline: float) -> None:
        """Until at least one replica runs and every running one passes its health check (Serve has
        replaced a dead one), or the deadline; never less than a second, so retries cannot spin."""
        delay = 1.0
        await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        while True:
            try:
                timeout = max(1.0, min(self.cfg.timeout_s, deadline - time.monotonic()))
                if await self._healthy(timeout):
                    return
                problem: object = "no running replica"
            except Exception as err:  # a dead or starting replica: wait for Serve to settle
                problem = err
            if time.monotonic() + delay >= deadline or self._stopping.is_set():
                return  # the next attempt fails (or succeeds) and reports it
            log.info("weightsync: engine replicas not healthy yet (%s)", problem)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)
            delay = min(2 * delay, 10.0)

    async def _publish_once(self, version: int) -> dict[str, float]:
        plan_id = None if self.plan is None else self.plan.plan_id
        if self.link is not None:  # (the senders broadcast as the push loads: no export beforehand)
            source, seconds = StreamedSource(self.link, self.transport, self.cfg.timeout_s, self.cfg.verify, plan_id), {}
        else:
            export = await self.learner.export_weights(self.cfg.bucket_mb, self.transport.name, self.cfg.verify,
                                                       "hf" if plan_id is None else "engine")
            source = BucketSource(export.buckets, self.transport, self.cfg.verify, export.digests, plan_id)
            seconds = export.seconds
        result = await self.pusher.push(version, source, [self.replicas])
        metrics = dict(result.metrics)
        metrics.update({f"weightsync/sender/{k}_seconds": v for k, v in seconds.items()})
        metrics["weightsync/engine_replicas"] = float(len(self.replicas.last_results))
        if self.link is not None:  # how often the broadcast groups formed: at start, again when the replicas changed
            metrics["weightsync/groups_formed"] = float(self.link.formed)
        for warning in result.warnings:
            log.warning("%s", warning)
        return metrics

    async def drain(self) -> None:
        """Wait for the last live version's host copy (kept after its push returned; push.py)."""
        if self.pusher is not None:
            _, warnings = await self.pusher.drain()
            for warning in warnings:
                log.warning("%s", warning)


def dump_manifest(manifest: Any) -> bytes:
    """The learner's export manifest as `PlanRequest` carries it."""
    return pickle.dumps(list(manifest), protocol=pickle.HIGHEST_PROTOCOL)


STORE_NAME = "asyncrl_weight_store"  # the named actor late replicas load from
STORE_NAMESPACE = "asyncrl"


class WeightStore:
    """The latest committed (version, buckets, fingerprint, plan), as a named Ray actor: `publish` checks the version
    increases and the fingerprint matches; `latest` is (0, None, "", None) before any. Also the plan pushes use now
    (`push_plan`): a replica that starts before the first push takes it, so that push finds it held."""

    def __init__(self) -> None:
        self._version = 0
        self._buckets: list[Any] | None = None
        self._fingerprint = ""
        self._plan: Any = None
        self._push_plan: Any = None
        self._refs: list[Any] = []  # the latest version's ObjectRefs, when it came as such

    def publish(self, version: int, buckets: list[Any], fingerprint: str, plan: Any = None) -> None:
        """`buckets`: packed (bucket.py), or ObjectRefs of buckets (read here, where they lie: mapped, not copied,
        on the same node; the refs are kept with them, which keeps the objects)."""
        if not isinstance(version, int) or version <= self._version:
            raise ValueError(f"version={version!r} must be an int greater than the stored {self._version}")
        refs = [b for b in buckets if is_object_ref(b)]
        if refs:
            import ray

            got = iter(ray.get(refs))
            buckets = [next(got) if is_object_ref(b) else b for b in buckets]
        mode, digests = fingerprint_mode(fingerprint), {}
        for bucket in buckets:
            digests.update(bucket_digests(bucket, mode, digest_key_prefix(bucket)))
        actual = combine_digests(digests, mode)
        if actual != fingerprint:
            raise ValueError(f"fingerprint mismatch for version {version}: given {fingerprint[:24]}, tensors hash to {actual[:24]}")
        if refs and all(b.rank is None for b in buckets):
            plan = None  # (sent as refs, unseen by the hook) Hugging Face buckets: no engine layout to apply them in
        self._version, self._buckets, self._fingerprint, self._plan = version, list(buckets), fingerprint, plan
        self._refs = refs

    def latest(self) -> tuple[int, list[Any] | None, str, Any]:
        """(version, buckets, fingerprint, the plan of engine-layout buckets) in one call: a version and its plan."""
        return self._version, self._buckets, self._fingerprint, self._plan

    def set_push_plan(self, plan: Any) -> None:
        self._push_plan = plan

    def push_plan(self) -> Any:
        return self._push_plan


def weight_store_hook(store: Any, plan_of: Callable[[int], Any]) -> Callable[[int, str, list[Any]], Any]:
    """`on_live` hook publishing a live version to the `WeightStore` actor, with the push plan (`plan_of(version)`,
    read as it goes live) for engine-layout buckets. It returns at once: the store only serves replicas that start
    later. One update is in flight at a time (sent from a thread: sending buckets copies them into the object store);
    a version that goes live meanwhile waits, a newer one replacing it (a late joiner that loads an older one is
    brought up by the next push). A failed update is the next call's error (the publisher warns)."""
    state: dict[str, Any] = {"task": None, "next": None, "error": None}

    async def send(args: tuple[int, list[Any], str, Any] | None) -> None:  # (store.publish's arguments)
        while args is not None:
            try:
                await (await asyncio.to_thread(store.publish.remote, *args))
            except Exception as exc:  # noqa: BLE001 - the next call raises it
                state["error"] = exc
            args, state["next"] = state["next"], None

    async def publish(version: int, fingerprint: str, buckets: list[Any]) -> None:
        hf = all(isinstance(b, Bucket) and b.rank is None for b in buckets)  # (ObjectRefs: the store tells)
        args = (version, buckets, fingerprint, None if hf else plan_of(version))  # as it went live
        task = state["task"]
        if task is not None and not task.done():
            state["next"] = args  # (replacing one that waited)
        else:
            state["task"] = asyncio.ensure_future(send(args))
        error, state["error"] = state["error"], None
        if error is not None:
            raise error

    return publish
