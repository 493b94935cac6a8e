"""Process groups of one learner rank, and the dispatch/collect protocol over them.

Owns: the parallel layout (TP, PP, VPP, CP, EP, expert-TP, DP) read from `strategy_config`,
its validation (before torch.distributed is touched), `torch.distributed` + Megatron
`parallel_state` initialisation, model-parallel RNG seeding, and pure functions that decide which
rank gets which data shard and which ranks' results are collected.

Must never: start processes or actors (the caller owns them), build models, or move data itself:
the dispatch helpers only compute plans, the transport belongs to the caller.

Rank layout (Megatron's default order "tp-cp-ep-dp-pp", tp fastest):
    rank = tp + TP * (cp + CP * (dp + DP * pp))
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch

from asyncrl.config import ConfigError, LearnerConfig

T = TypeVar("T")


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of every parallel dimension of one learner group."""

    world_size: int
    tp: int = 1
    pp: int = 1
    vpp: int | None = None  # virtual pipeline chunks per PP rank (None = no interleaving)
    cp: int = 1
    ep: int = 1
    etp: int = 1  # expert tensor parallel
    sequence_parallel: bool = False
    overlap_p2p_comm: Any = None  # as given in strategy_config (None = not given)
    batch_p2p_comm: Any = None

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @classmethod
    def from_learner_config(cls, cfg: LearnerConfig) -> "ParallelLayout":
        s = cfg.strategy_config
        tp = int(s.get("tensor_model_parallel_size", 1))
        return cls(
            world_size=cfg.world_size,
            tp=tp,
            pp=int(s.get("pipeline_model_parallel_size", 1)),
            vpp=s.get("virtual_pipeline_model_parallel_size"),
            cp=int(s.get("context_parallel_size", 1)),
            ep=int(s.get("expert_model_parallel_size", 1)),
            # Megatron's default: expert TP follows TP when not given.
            etp=int(s.get("expert_tensor_parallel_size") or tp),
            sequence_parallel=bool(s.get("sequence_parallel", False)),
            overlap_p2p_comm=s.get("overlap_p2p_comm"),
            batch_p2p_comm=s.get("batch_p2p_comm"),
        )


def validate_layout(layout: ParallelLayout, hf_config: Any = None) -> None:
    """Raise ConfigError naming the bad value for any layout Megatron would reject or hang on."""
    mp = layout.tp * layout.pp * layout.cp
    if layout.world_size % mp:
        raise ConfigError(
            f"world_size={layout.world_size} is not divisible by TP*PP*CP="
            f"{layout.tp}*{layout.pp}*{layout.cp}={mp}"
        )
    emp = layout.etp * layout.ep * layout.pp
    if layout.world_size % emp:
        raise ConfigError(
            f"world_size={layout.world_size} is not divisible by expert_tensor_parallel_size*"
            f"expert_model_parallel_size*PP={layout.etp}*{layout.ep}*{layout.pp}={emp}"
        )
    if layout.vpp is not None:
        if not isinstance(layout.vpp, int) or isinstance(layout.vpp, bool) or layout.vpp < 1:
            raise ConfigError(f"virtual_pipeline_model_parallel_size={layout.vpp!r} must be a positive integer")
        if layout.vpp > 1 and layout.pp < 2:
            raise ConfigError(
                f"virtual_pipeline_model_parallel_size={layout.vpp} needs pipeline_model_parallel_size > 1, "
                f"got {layout.pp}"
            )
    if layout.sequence_parallel and layout.tp < 2:
        raise ConfigError(f"sequence_parallel=True needs tensor_model_parallel_size > 1, got {layout.tp}")
    if (layout.vpp or 1) > 1:
        # Measured on CPU (PP=2 x VPP=2 over gloo): batched p2p crosses the activation and gradient
        # messages of the one neighbour rank (wrong grads, or a shape error in backward), and
        # unbatched p2p without overlap aborts the rank. The interleaved schedule runs only as
        # Megatron-LM runs it: overlap_p2p_comm=True, batch_p2p_comm=False (the defaults here).
        if layout.overlap_p2p_comm not in (None, True):
            raise ConfigError(
                f"overlap_p2p_comm={layout.overlap_p2p_comm!r} with virtual_pipeline_model_parallel_size="
                f"{layout.vpp}: the interleaved schedule needs True (leave it unset)"
            )
        if layout.batch_p2p_comm not in (None, False):
            raise ConfigError(
                f"batch_p2p_comm={layout.batch_p2p_comm!r} with virtual_pipeline_model_parallel_size="
                f"{layout.vpp}: the interleaved schedule needs False (leave it unset)"
            )
    if hf_config is not None:
        _validate_against_model(layout, hf_config)


def _validate_against_model(layout: ParallelLayout, hf: Any) -> None:
    heads = hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    if heads % layout.tp:
        raise ConfigError(f"num_attention_heads={heads} is not divisible by tensor_model_parallel_size={layout.tp}")
    if kv_heads % layout.tp:
        raise ConfigError(
            f"num_key_value_heads={kv_heads} is not divisible by tensor_model_parallel_size={layout.tp}"
        )
    chunks = layout.pp * (layout.vpp or 1)
    if hf.num_hidden_layers % chunks:
        raise ConfigError(
            f"num_hidden_layers={hf.num_hidden_layers} is not divisible by PP*VPP="
            f"{layout.pp}*{layout.vpp or 1}={chunks}"
        )
    experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None)
    if experts:
        if experts % layout.ep:
            raise ConfigError(f"num_experts={experts} is not divisible by expert_model_parallel_size={layout.ep}")
    elif layout.ep > 1:
        raise ConfigError(
            f"expert_model_parallel_size={layout.ep} but model_type={hf.model_type!r} has no experts"
        )


# ----------------------------------------------------------------------------- process groups


def init_distributed(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str | None = None,
    timeout_s: float = 600.0,
    store: Any = None,
) -> str:
    """Join the learner's default process group (gloo on CPU, nccl on GPU); returns the backend.

    `store`: a rendezvous store instead of `tcp://master_addr:master_port` (a learner group's rank 0
    binds its store before the others are told the port, so no other process can take it; every
    rank of the group must then pass a store, hosted or client, since torch prefixes the keys of
    an `init_method` store but not of a given one)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
    if not 0 < int(master_port) < 65536:
        raise ValueError(f"master_port={master_port} is not a valid port")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA; use 'gloo' on CPU")
    if torch.distributed.is_initialized():
        if torch.distributed.get_rank() != rank or torch.distributed.get_world_size() != world_size:
            raise RuntimeError(
                f"torch.distributed already initialised as rank {torch.distributed.get_rank()} of "
                f"{torch.distributed.get_world_size()}, asked rank {rank} of {world_size}"
            )
        return torch.distributed.get_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    where = {"store": store} if store is not None else {"init_method": f"tcp://{master_addr}:{int(master_port)}"}
    torch.distributed.init_process_group(
        backend=backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s), **where,
    )
    return backend


def init_model_parallel(learner_cfg: LearnerConfig, hf_config: Any = None) -> ParallelLayout:
    """Validate the layout, then set up Megatron's parallel_state and seed the model-parallel RNG.

    Must run after `init_distributed` on every rank of the group (it is collective). On CPU the
    compat layer must be installed first (`compat.install_cpu_compat()`).
    """
    layout = ParallelLayout.from_learner_config(learner_cfg)
    validate_layout(layout, hf_config)
    if not torch.distributed.is_initialized():
        raise RuntimeError("init_model_parallel() needs torch.distributed: call init_distributed() first")
    if torch.distributed.get_world_size() != layout.world_size:
        raise ConfigError(
            f"learner.world_size={layout.world_size} but torch.distributed has "
            f"{torch.distributed.get_world_size()} ranks"
        )
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if (layout.vpp or 1) > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(learner_cfg.seed)
    return layout


def collective_device() -> torch.device:
    """Where small tensors handed to `torch.distributed` must live: the current GPU under NCCL
    (it takes no host tensors), the host otherwise (gloo, or no process group)."""
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def destroy_model_parallel() -> None:
    """Tear down Megatron groups and the default process group (for tests and clean exits)."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------- dispatch / collect (pure)


@dataclass(frozen=True)
class RankCoords:
    rank: int
    tp: int
    cp: int
    dp: int
    pp: int


def rank_coords(rank: int, layout: ParallelLayout) -> RankCoords:
    """Coordinates of `rank` in the dense (non-expert) grid, order tp-cp-dp-pp."""
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank={rank} must lie in [0, world_size={layout.world_size})")
    tp = rank % layout.tp
    cp = (rank // layout.tp) % layout.cp
    dp = (rank // (layout.tp * layout.cp)) % layout.dp
    pp = rank // (layout.tp * layout.cp * layout.dp)
    return RankCoords(rank=rank, tp=tp, cp=cp, dp=dp, pp=pp)


def split_for_dp(items: Sequence[T], dp_size: int, token_counts: Sequence[int] | None = None) -> list[list[T]]:
    """Split `items` into `dp_size` contiguous, non-empty shards (concatenated they give `items` back).

    Without token counts the shard lengths differ by at most one. With token counts the split
    minimises the largest shard's token total (contiguous partition), so no DP rank waits long
    on another.
    """
    n = len(items)
    if dp_size < 1:
        raise ValueError(f"dp_size={dp_size} must be >= 1")
    if n < dp_size:
        raise ValueError(f"cannot split {n} items over dp_size={dp_size}: every DP rank needs at least one")
    if token_counts is None:
        base, extra = divmod(n, dp_size)
        shards, start = [], 0
        for i in range(dp_size):
            size = base + (1 if i < extra else 0)
            shards.append(list(items[start : start + size]))
            start += size
        return shards
    if len(token_counts) != n:
        raise ValueError(f"token_counts has {len(token_counts)} entries for {n} items")
    if any(c < 0 for c in token_counts):
        raise ValueError(f"token_counts must be >= 0, got {min(token_counts)}")
    lo, hi = max(token_counts), sum(token_counts)
    while lo < hi:  # smallest cap whose greedy packing needs <= dp_size shards
        mid = (lo + hi) // 2
        if len(_greedy_bounds(token_counts, mid)) <= dp_size:
            hi = mid
        else:
            lo = mid + 1
    bounds = _greedy_bounds(token_counts, lo)
    while len(bounds) < dp_size:  # split a multi-item shard: never raises the max, keeps order
        i = next(k for k, (s, e) in enumerate(bounds) if e - s > 1)
        s, e = bounds[i]
        bounds[i : i + 1] = [(s, e - 1), (e - 1, e)]
    return [list(items[s:e]) for s, e in bounds]


def _greedy_bounds(counts: Sequence[int], cap: int) -> list[tuple[int, int]]:
    bounds, start, total = [], 0, 0
    for i, c in enumerate(counts):
        if i > start and total + c > cap:
            bounds.append((start, i))
            start, total = i, 0
        total += c
    bounds.append((start, len(counts)))
    return bounds


@dataclass(frozen=True)
class DispatchPlan:
    """Which shard every rank receives, and which rank's output is collected for each shard.

    `shard_of_rank[r]` is the shard index rank r computes on (None: the rank gets no data);
    `collect_from[i]` is the rank whose output is shard i's result.
    """

    num_shards: int
    shard_of_rank: tuple[int | None, ...]
    collect_from: tuple[int, ...]


def megatron_compute_plan(layout: ParallelLayout) -> DispatchPlan:
    """The Megatron compute rule: every TP/PP/CP rank of DP group d gets shard d; results come
    from TP rank 0 / CP rank 0 of the last PP stage (where logits and losses live)."""
    coords = [rank_coords(r, layout) for r in range(layout.world_size)]
    collect = [None] * layout.dp
    for c in coords:
        if c.tp == 0 and c.cp == 0 and c.pp == layout.pp - 1:
            collect[c.dp] = c.rank
    return DispatchPlan(
        num_shards=layout.dp,
        shard_of_rank=tuple(c.dp for c in coords),
        collect_from=tuple(collect),  # type: ignore[arg-type]
    )


def pp_as_dp_plan(layout: ParallelLayout) -> DispatchPlan:
    """PP ranks act as extra data parallelism (for per-stage work such as weight export or
    stage-local statistics): shard index = pp * DP + dp, all TP/CP ranks of it get the same
    shard, results come from its TP rank 0 / CP rank 0."""
    coords = [rank_coords(r, layout) for r in range(layout.world_size)]
    num = layout.dp * layout.pp
    collect = [None] * num
    shard_of = []
    for c in coords:
        shard = c.pp * layout.dp + c.dp
        shard_of.append(shard)
        if c.tp == 0 and c.cp == 0:
            collect[shard] = c.rank
    return DispatchPlan(num_shards=num, shard_of_rank=tuple(shard_of), collect_from=tuple(collect))  # type: ignore[arg-type]


def one_to_all_plan(world_size: int) -> DispatchPlan:
    """Init-style calls (build, load, save): every rank gets the same single item; all answer."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    return DispatchPlan(num_shards=1, shard_of_rank=(0,) * world_size, collect_from=tuple(range(world_size)))


def dispatch(plan: DispatchPlan, shards: Sequence[T]) -> list[T | None]:
    """Per-rank payloads for a plan (index = rank)."""
    if len(shards) != plan.num_shards:
        raise ValueError(f"plan wants {plan.num_shards} shards, got {len(shards)}")
    return [None if s is None else shards[s] for s in plan.shard_of_rank]


def collect(plan: DispatchPlan, outputs_by_rank: Sequence[T]) -> list[T]:
    """Pick each shard's result from the per-rank outputs (index = rank), in shard order."""
    if len(outputs_by_rank) != len(plan.shard_of_rank):
        raise ValueError(f"expected {len(plan.shard_of_rank)} rank outputs, got {len(outputs_by_rank)}")
    return [outputs_by_rank[r] for r in plan.collect_from]
