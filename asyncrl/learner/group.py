"""A learner group: `world_size` rank actors of one role, and the dispatch/collect between them.

Owns: the placement group (one bundle per rank), starting the ranks (rank 0 hosts the rendezvous), and the "Megatron
compute" protocol: a batch split over DP (GRPO groups kept whole when possible), each DP shard put in the object
store once for every TP/PP/CP rank of its DP group, results from TP rank 0 / CP rank 0 of the last PP stage
re-assembled in sample order; init-style calls go to every rank. A failure on any rank surfaces as one
`LearnerRankError` naming the rank and call; a call past `call_timeout_s` raises, and the group refuses further calls.
Must never: compute anything itself, or hand per-token results back in any other layout than one python list per
sample (response tokens only, in the batch's order).
Details: docs/design/learner.md, "The learner group".
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from asyncrl.config import AlgorithmConfig, LearnerConfig, ModelConfig, ProfilerConfig
from asyncrl.interfaces import ROLE_VERBS, LearnerRankAPI, RoleAPI, verb_name
from asyncrl.learner.batching import split_by_groups
from asyncrl.learner.parallel import ParallelLayout, megatron_compute_plan
from asyncrl.types import LearnerRankError, Sample, SenderAddress, TrainBatch, WeightExport, error_chain

PerToken = list[list[float]]


def _samples(batch: TrainBatch | Sequence[Sample]) -> list[Sample]:
    return list(batch.samples) if isinstance(batch, TrainBatch) else list(batch)


class LearnerGroup:
    def __init__(
        self, role: str, model_cfg: ModelConfig, learner_cfg: LearnerConfig, algorithm_cfg: AlgorithmConfig,
        profiler_cfg: ProfilerConfig | None = None, *, role_classes: dict[str, type] | None = None,
        call_timeout_s: float = 600.0,
    ) -> None:
        self.role, self.model_cfg, self.learner_cfg = role, model_cfg, learner_cfg
        self.algorithm_cfg, self.profiler_cfg, self.role_classes = algorithm_cfg, profiler_cfg, role_classes
        self.layout = ParallelLayout.from_learner_config(learner_cfg)
        self.plan = megatron_compute_plan(self.layout)
        self.call_timeout_s = call_timeout_s
        self.ranks: list[Any] = []
        self._pg: Any = None
        self._broken: str | None = None
        self._broken_rank: int | None = None  # the rank whose failure broke the group (named by every later call)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> list[dict[str, Any]]:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from asyncrl.learner.rank import actor_class

        cfg = self.learner_cfg
        bundle: dict[str, float] = {"CPU": cfg.num_cpus_per_rank or 0.01}
        if cfg.num_gpus_per_rank:
            bundle["GPU"] = cfg.num_gpus_per_rank
        # The pool's custom resources go into every bundle (the rank asks for them from it); its
        # labels select the nodes each bundle may be reserved on.
        bundle.update(cfg.pool.resources)
        labels = {"bundle_label_selector": [dict(cfg.pool.labels)] * cfg.world_size} if cfg.pool.labels else {}
        self._pg = placement_group([dict(bundle) for _ in range(cfg.world_size)],
                                   strategy=cfg.placement_strategy.upper(), **labels)
        await self._wait_placed(bundle)
        actor_cls = actor_class()
        for r in range(cfg.world_size):
            self.ranks.append(actor_cls.options(
                num_cpus=bundle["CPU"], num_gpus=cfg.num_gpus_per_rank, resources=dict(cfg.pool.resources) or None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=r),
            ).remote(r, cfg.world_size, self.role, self.model_cfg, cfg, self.algorithm_cfg,
                     self.profiler_cfg, self.role_classes))
        ((addr, port),) = await self._gather("master_address", [self.ranks[0].master_address.remote(self.call_timeout_s)], [0])
        outs = await self._gather("setup", [a.setup.remote(addr, port, self.call_timeout_s) for a in self.ranks])
        return outs

    async def _wait_placed(self, bundle: dict[str, float]) -> None:
        """Wait for the placement group; past `call_timeout_s` raise, saying whether any set of live
        nodes could hold it at all (a lost node) or the cluster is only busy."""
        from asyncrl.cluster import Demand, live_nodes, unmet, waiting_for

        cfg = self.learner_cfg
        demand = Demand("learner.pool", bundle, dict(cfg.pool.labels), cfg.world_size, cfg.placement_strategy)
        try:
            with waiting_for(demand):  # /train/status names the pool while Ray has not placed it
                await asyncio.wait_for(self._pg.ready(), self.call_timeout_s)
        except asyncio.TimeoutError:
            import ray

            ray.util.remove_placement_group(self._pg)
            self._pg = None
            why = unmet(demand, live_nodes())
            raise LearnerRankError(None, "placement", (
                f"the placement group of {cfg.world_size} x {bundle} ({cfg.placement_strategy}) was not ready after "
                f"{self.call_timeout_s:.0f} s: " + (f"learner.pool: {why}" if why else "the nodes that qualify are busy"))) from None

    async def shutdown(self) -> None:
        import ray

        for a in self.ranks:
            ray.kill(a, no_restart=True)
        self.ranks = []
        if self._pg is not None:
            ray.util.remove_placement_group(self._pg)
            self._pg = None

    # ------------------------------------------------------------------ transport

    async def _gather(self, method: str, refs: list[Any], ranks: list[int] | None = None,
                      survivable: tuple[type[BaseException], ...] = ()) -> list[Any]:
        """Await every ref; the first failure (or the timeout) raises, naming the rank, and leaves the
        group unusable. `survivable`: errors that leave the ranks in step (every rank answered and each
        failure has one of these in its chain: a weight broadcast whose receiver died); then that
        error is raised for the rank and the group stays usable."""
        if self._broken:
            raise LearnerRankError(self._broken_rank, method, f"group unusable after an earlier failure: {self._broken}")
        ranks = ranks if ranks is not None else list(range(len(refs)))

        async def one(ref: Any) -> Any:
            return await ref

        futs = [asyncio.ensure_future(one(r)) for r in refs]
        done, pending = await asyncio.wait(futs, timeout=self.call_timeout_s,
                                           return_when=asyncio.ALL_COMPLETED if survivable else asyncio.FIRST_EXCEPTION)
        failed = [(rank, fut.exception()) for fut, rank in zip(futs, ranks) if fut in done and fut.exception() is not None]
        if failed:
            for p in pending:
                p.cancel()
            # the deepest match: Ray's remote error is also an instance of its cause's class
            causes = [([e for e in error_chain(exc) if isinstance(e, survivable)] or [None])[-1] for _, exc in failed]
            rank, exc = failed[0]
            if survivable and not pending and all(c is not None for c in causes):
                raise type(causes[0])(f"rank {rank} in {method}: {causes[0]}") from exc
            self._broken, self._broken_rank = f"rank {rank} failed in {method}", rank
            raise LearnerRankError(rank, method, _short(exc)) from exc
        if pending:
            for p in pending:
                p.cancel()
            late = [r for f, r in zip(futs, ranks) if f in pending]
            self._broken, self._broken_rank = f"ranks {late} timed out in {method}", late[0]
            raise LearnerRankError(late[0], method, f"ranks {late} gave no answer within {self.call_timeout_s}s")
        return [f.result() for f in futs]

    async def _compute(self, verb: Callable[..., Any], samples: list[Sample], *per_sample: Any) -> tuple[list[Any], list[list[int]]]:
        """Megatron compute dispatch; returns (result of each DP shard, sample indices of each shard)."""
        import ray

        shards = split_by_groups([s.group_id for s in samples], self.layout.dp)
        payloads = []
        for idx in shards:
            args = [[samples[i] for i in idx]]
            args += [None if rows is None else [rows[i] for i in idx] for rows in per_sample]
            payloads.append([ray.put(a) for a in args])
        method = verb_name(RoleAPI, verb, ROLE_VERBS)
        refs = [a.call.remote(verb, *payloads[self.plan.shard_of_rank[r]]) for r, a in enumerate(self.ranks)]
        outs = await self._gather(method, refs)
        return [outs[r] for r in self.plan.collect_from], shards

    async def _per_token(self, verb: Callable[..., Any], key: str, batch: Any, *per_sample: Any) -> PerToken:
        samples = _samples(batch)
        results, shards = await self._compute(verb, samples, *per_sample)
        out: list[Any] = [None] * len(samples)
        for res, idx in zip(results, shards):
            for i, row in zip(idx, res[key]):
                out[i] = row
        return out

    async def _all(self, verb: Callable[..., Any], *args: Any, survivable: tuple[type[BaseException], ...] = ()) -> list[Any]:
        """Call the rank verb `verb` (by reference: `LearnerRankAPI.state`) on every rank (`survivable`: `_gather`'s)."""
        method = verb_name(LearnerRankAPI, verb)
        return await self._gather(method, [getattr(a, method).remote(*args) for a in self.ranks], survivable=survivable)

    # ------------------------------------------------------------------ API used by the trainer

    async def compute_log_prob(self, batch: TrainBatch | Sequence[Sample]) -> PerToken:
        return await self._per_token(RoleAPI.compute_log_prob, "logprobs", batch)

    async def compute_entropy(self, batch: TrainBatch | Sequence[Sample]) -> PerToken:
        return await self._per_token(RoleAPI.compute_log_prob, "entropy", batch)

    async def compute_ref_log_prob(self, batch: TrainBatch | Sequence[Sample]) -> PerToken:
        return await self._per_token(RoleAPI.compute_ref_log_prob, "logprobs", batch)

    async def compute_values(self, batch: TrainBatch | Sequence[Sample]) -> PerToken:
        return await self._per_token(RoleAPI.compute_values, "values", batch)

    async def compute_rm_score(self, batch: TrainBatch | Sequence[Sample]) -> list[float]:
        return await self._per_token(RoleAPI.compute_rm_score, "scores", batch)

    async def update_actor(
        self, batch: TrainBatch | Sequence[Sample], advantages: PerToken, old_logprobs: PerToken | None,
        ref_logprobs: PerToken | None = None, version_gaps: list[list[int]] | None = None,
    ) -> dict[str, float]:
        """One update; `old_logprobs` None: its first forward gives the proximal log-probs; `version_gaps`
        (per token, versions behind the learner) split its mismatch metrics (ActorRole.update_actor)."""
        results, _ = await self._compute(RoleAPI.update_actor, _samples(batch), advantages, old_logprobs, ref_logprobs,
                                         version_gaps)
        return results[0]  # metrics are already reduced over DP inside the ranks

    async def update_critic(self, batch: TrainBatch | Sequence[Sample], returns: PerToken, old_values: PerToken) -> dict[str, float]:
        results, _ = await self._compute(RoleAPI.update_critic, _samples(batch), returns, old_values)
        return results[0]

    async def warm_up(self, samples: Sequence[Sample]) -> dict[str, float]:
        """A trainable role's warm-up (`RoleAPI.warm_up`) on every rank, `samples` split over DP as a
        batch is (each DP shard must get at least one micro-batch: its ranks' DP all-reduce of the
        zero grads pairs with every other shard's); the slowest rank's metrics."""
        results, _ = await self._compute(RoleAPI.warm_up, list(samples))
        return _slowest(r for r in results if r)

    async def export_weights(self, bucket_mb: float, transport: str = "object_store", verify: str = "full",
                             layout: str = "hf", timeout_s: float = 600.0, gate: str = "") -> WeightExport:
        """One version out of the sending ranks, every rank driving its part (`LearnerRank.export_weights`): packed
        into host buckets (shm, object_store), or broadcast to the engine workers (nccl, gloo, ipc). A broadcast
        that failed on the wire (a receiver died; every rank finished its part of the export) raises the
        sender's `CollectiveError` and leaves the group usable: its broadcast group is closed and the next push
        forms a new one. Anything else is a `LearnerRankError`."""
        from asyncrl.weightsync.collective import CollectiveError

        outs = [o for o in await self._all(LearnerRankAPI.export_weights, bucket_mb, transport, verify, layout,
                                           timeout_s, gate, survivable=(CollectiveError,)) if o is not None]
        out = WeightExport(seconds=_slowest(o.seconds for o in outs))  # stages send one after another's end
        for o in sorted(outs, key=lambda o: o.senders[0] if o.senders else -1):
            out.buckets += o.buckets
            out.metas += o.metas
            out.senders += o.senders
            out.digests += o.digests
            out.bytes += o.bytes
            out.num_tensors += o.num_tensors
            out.num_buckets += o.num_buckets
        return out

    async def set_push_plan(self, plan: bytes | None, host_copies: bool = False) -> None:
        """The sending ranks pack later pushes for this push plan (weightsync/plan.py; None: HF tensors);
        `host_copies`: GPU senders allocate their host copies' pinned buffers now (LearnerRank.set_push_plan)."""
        await self._all(LearnerRankAPI.set_push_plan, plan, host_copies)

    async def collective_addresses(self) -> list[SenderAddress]:
        """Rendezvous addresses of the sending ranks (one per PP stage), in sender order, each with the group the
        rank holds now that can still carry a push."""
        return sorted((a for a in await self._all(LearnerRankAPI.join_collective, None) if a is not None),
                      key=lambda a: a.sender)

    async def join_collective(self, specs: list[dict[str, Any]]) -> list[str]:
        """The sending ranks join their groups of `specs`; the ids joined, in sender order."""
        joined = sorted((a for a in await self._all(LearnerRankAPI.join_collective, specs) if a is not None),
                        key=lambda a: a.sender)
        return [a.group for a in joined]

    async def take_host_copies(self, timeout_s: float) -> tuple[list[Any], dict[str, float]]:
        """The last broadcast's host copies (ObjectRefs, stage 0 first), once every sender kept
        them, and the slowest sender's copy-thread seconds."""
        outs = sorted((o for o in await self._all(LearnerRankAPI.take_host_copies, timeout_s) if o is not None), key=lambda o: o.sender)
        return [ref for o in outs for ref in o.buckets], _slowest(o.seconds for o in outs)

    async def hold_device(self, parts: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Every rank keeps `parts` (params, grads, optimizer; default all) of its offloaded state on
        the device until `release_device` (hybrid placement's learner phase); one answer per rank."""
        return await self._all(LearnerRankAPI.hold_device, list(parts) if parts else None)

    async def release_device(self, parts: Sequence[str] | None = None,
                             wake_need: tuple[float, int] | None = None) -> list[dict[str, Any]]:
        """Every rank drops its hold on `parts`; with `wake_need` (fraction of device memory, bytes) each
        first decides whether its flagged state may stay on its device (`LearnerRank.release_device`)."""
        return await self._all(LearnerRankAPI.release_device, list(parts) if parts else None, wake_need)

    async def save_checkpoint(self, path: str) -> str:
        return (await self._all(LearnerRankAPI.save_checkpoint, str(path)))[0]

    async def load_checkpoint(self, path: str) -> dict[str, Any]:
        return (await self._all(LearnerRankAPI.load_checkpoint, str(path)))[0]

    async def state(self) -> list[dict[str, Any]]:
        return await self._all(LearnerRankAPI.state)

    async def dead_ranks(self, timeout_s: float = 10.0) -> list[int]:
        """Ranks whose actor is gone (died, or its node lost): each is asked for its state alone, apart from the
        group's calls, so the answer does not depend on (or change) whether the group is still usable."""
        import ray

        async def gone(rank: Any) -> bool:
            try:
                await asyncio.wait_for(getattr(rank, verb_name(LearnerRankAPI, LearnerRankAPI.state)).remote(), timeout_s)
                return False
            except (ray.exceptions.RayActorError, asyncio.TimeoutError):
                return True
            except Exception:  # noqa: BLE001 - it answered (with an error): alive
                return False

        answers = await asyncio.gather(*(gone(r) for r in self.ranks))
        return [i for i, dead in enumerate(answers) if dead]


def _slowest(per_rank: Iterable[dict[str, float]]) -> dict[str, float]:
    """Each phase's largest seconds over the sending ranks."""
    out: dict[str, float] = {}
    for seconds in per_rank:
        for k, v in seconds.items():
            out[k] = max(out.get(k, 0.0), v)
    return out


def _short(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) < 4000 else text[:2000] + "\n...\n" + text[-2000:]
