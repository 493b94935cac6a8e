"""Resource pools against the Ray cluster: can the live nodes host what each component asks for?

Owns: what one replica / rank / worker of each component asks Ray for (CPU, GPU, a pool's custom
resources and node labels), matching Ray's label selectors against node labels, and the check run
when the app is built (`check_pools`): a pool that no live node offers, or a learner placement
group that no set of nodes can hold, is a `PoolUnavailable` naming the config field and listing
every node's resources and labels (Ray would keep it pending for ever); what this process waits
for Ray to place now, and why (`waiting_for`, `waits_now`: `/train/status`'s `waiting_for`).

Must never: start, place or kill anything (it only reads `ray.nodes()`), or judge current load: it
checks what the nodes *offer* (their totals), so a pool that is merely busy passes and waits in
Ray's queue as usual.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from asyncrl.config import ConfigError, ResourcePool, RewardConfig, RootConfig

# Ray rounds fractional resources to 1/10000; a demand within this of a total still fits.
_EPS = 1e-4
# What the app's small deployments ask for (asyncrl/app.py); kept here so the check asks the same.
GATEWAY_NUM_CPUS = 0.1
TRAINER_NUM_CPUS = 0.25


class PoolUnavailable(ConfigError):
    """No live node (or set of nodes) can host a component's resource pool."""


@dataclass(frozen=True)
class NodeOffer:
    """One live Ray node: its total resources and its labels."""

    node_id: str
    resources: dict[str, float]
    labels: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        res = ", ".join(f"{k}: {v:g}" for k, v in sorted(self.resources.items())
                        if not k.startswith("node:") and k not in ("memory", "object_store_memory"))
        labels = ", ".join(f"{k}={v}" for k, v in sorted(self.labels.items()) if not k.startswith("ray.io/"))
        return f"node {self.node_id[:8]} {{{res}}}" + (f" labels {{{labels}}}" if labels else "")


@dataclass(frozen=True)
class Demand:
    """What one unit (replica, rank, worker actor) of a component asks for, where it may go."""

    field: str  # the config field of the pool, e.g. "generator.engine_pool"
    resources: dict[str, float]
    labels: dict[str, str]
    count: int = 1  # units that must be placeable at once
    strategy: str = "pack"  # learner placement groups only

    def fits(self, node: NodeOffer) -> int:
        """How many units this node could hold at most (0 = it does not qualify)."""
        if not all(selector_matches(sel, node.labels.get(key)) for key, sel in self.labels.items()):
            return 0
        most = math.inf
        for name, amount in self.resources.items():
            if amount <= 0:
                continue
            most = min(most, math.floor((node.resources.get(name, 0.0) + _EPS) / amount))
        return self.count if most == math.inf else int(most)


def selector_matches(selector: str, value: str | None) -> bool:
    """Ray's label selector semantics: `v`, `!v`, `in(a,b)`, `!in(a,b)` (a missing label matches
    only the negated forms)."""
    negate = selector.startswith("!")
    body = selector[1:] if negate else selector
    allowed = {v.strip() for v in body[3:-1].split(",")} if body.startswith("in(") and body.endswith(")") else {body}
    return (value not in allowed) if negate else (value in allowed)


def _demand(field_name: str, pool: ResourcePool, cpus: float, gpus: float, count: int = 1, strategy: str = "pack") -> Demand:
    resources = {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **pool.resources}
    return Demand(field_name, {k: v for k, v in resources.items() if v > 0}, dict(pool.labels), count, strategy)


def demands(cfg: RootConfig) -> list[Demand]:
    """Every component's demand, as the app will ask Ray for it."""
    gen, lrn = cfg.generator, cfg.learner
    a = gen.autoscaling
    engines = max(1, a.min_replicas, a.initial_replicas or 0)
    out = [
        _demand("generator.engine_pool", gen.engine_pool, gen.num_cpus, gen.num_gpus, count=engines),
        _demand("generator.gateway_pool", gen.gateway_pool, GATEWAY_NUM_CPUS, 0.0),
        _demand("trainer.pool", cfg.trainer.pool, TRAINER_NUM_CPUS, 0.0),
        _demand("learner.pool", lrn.pool, lrn.num_cpus_per_rank or 0.01, lrn.num_gpus_per_rank,
                count=lrn.world_size, strategy=lrn.placement_strategy),
    ]
    if cfg.reward.pool.is_set():
        out.append(reward_demand(cfg.reward))
    if cfg.reward.kind == "model":
        rm = cfg.reward.model
        out.append(_demand("reward.model.pool", rm.pool, rm.num_cpus_per_rank or 0.01, rm.gpus_per_rank(lrn), count=rm.world_size,
                           strategy=lrn.placement_strategy))
    return out


def reward_demand(reward: RewardConfig) -> Demand:
    """What the reward actor on reward.pool asks for, as `demands` counts it."""
    return _demand("reward.pool", reward.pool, reward.num_cpus, 0.0)


def engine_demand(cfg: RootConfig) -> Demand:
    """What the engine deployment asks for (generator.engine_pool), as `demands` counts it."""
    return next(d for d in demands(cfg) if d.field == "generator.engine_pool")


ENGINES_STARTING = "no engine replica answers yet: starting, or the nodes that qualify are busy"


def _asks(demand: Demand) -> str:
    asks = "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(demand.resources.items())) + "}"
    if demand.labels:
        asks += " on labels {" + ", ".join(f"{k}={v}" for k, v in sorted(demand.labels.items())) + "}"
    return asks


def unmet(demand: Demand, nodes: list[NodeOffer]) -> str | None:
    """Why the nodes cannot host `demand` (None = they can)."""
    fits = [d for d in (demand.fits(n) for n in nodes) if d > 0]
    asks = _asks(demand)
    if not fits:
        return f"no live node offers {asks}"
    if demand.strategy == "strict_pack" and max(fits) < demand.count:
        return (f"placement_strategy 'strict_pack' needs one node holding all {demand.count} x {asks}; "
                f"the most any node holds is {max(fits)}")
    if demand.strategy == "strict_spread" and len(fits) < demand.count:
        return f"placement_strategy 'strict_spread' needs {demand.count} nodes offering {asks}; {len(fits)} do"
    if sum(fits) < demand.count:
        return f"{demand.count} x {asks} needed; the nodes that qualify hold {sum(fits)} in all"
    return None


def check_pools(cfg: RootConfig, nodes: list[NodeOffer]) -> None:
    """Raise PoolUnavailable naming every pool the live nodes cannot host, with the cluster's offer."""
    problems = [f"  {d.field}: {why}" for d in demands(cfg) if (why := unmet(d, nodes))]
    if problems:
        cluster = "\n".join(f"    {n.describe()}" for n in nodes) or "    (no live node)"
        raise PoolUnavailable("resource pools the Ray cluster cannot host (Ray would wait for them for ever):\n"
                              + "\n".join(problems) + f"\n  the cluster's live nodes:\n{cluster}")


def live_nodes() -> list[NodeOffer]:
    """The connected Ray cluster's live nodes."""
    import ray

    return [NodeOffer(n["NodeID"], dict(n.get("Resources") or {}), dict(n.get("Labels") or {}))
            for n in ray.nodes() if n.get("Alive")]


def check_live_cluster(cfg: RootConfig) -> None:
    """`check_pools` against the connected Ray cluster; nothing to check when no pool is set."""
    import ray

    pools = (cfg.generator.engine_pool, cfg.generator.gateway_pool, cfg.trainer.pool, cfg.learner.pool, cfg.reward.pool,
             cfg.reward.model.pool)
    if ray.is_initialized() and (any(p.is_set() for p in pools) or cfg.learner.placement_strategy != "pack"):
        check_pools(cfg, live_nodes())


# What this process waits for Ray to place now (`waiting_for`), read by `/train/status` (`waits_now`).
_WAITS: dict[int, tuple[Demand, float, str]] = {}
_WAIT_KEYS = itertools.count()


@contextlib.contextmanager
def waiting_for(demand: Demand, placeable: str = "the nodes that qualify are busy") -> Iterator[None]:
    """Mark the block as waiting for Ray to place `demand` (a learner placement group, the engine
    replicas): `waits_now` lists it until the block ends. `placeable`: what to say while the live nodes
    could hold it (busy ones, or units still starting)."""
    key = next(_WAIT_KEYS)
    _WAITS[key] = (demand, time.monotonic(), placeable)
    try:
        yield
    finally:
        del _WAITS[key]


def waits_now(nodes: list[NodeOffer] | None = None) -> list[dict[str, object]]:
    """The waits in progress, oldest first: the pool's config field, what it asks, for how long, and
    why it is not placed (checked against `nodes`, the live cluster by default: a pool no live node
    offers any more, e.g. after a node loss, says so)."""
    if not _WAITS:
        return []
    unreadable = None
    if nodes is None:
        try:
            nodes = live_nodes()
        except Exception as err:  # noqa: BLE001 - a status read never fails on the cluster's answer
            nodes, unreadable = [], f"the cluster's nodes could not be read: {err!r}"
    now, out = time.monotonic(), []
    for demand, since, placeable in sorted(_WAITS.values(), key=lambda w: w[1]):
        why = unreadable or unmet(demand, nodes) or placeable
        out.append({"pool": demand.field, "asks": f"{demand.count} x {_asks(demand)}", "for_s": round(now - since, 1),
                    "why": why})
    return out
