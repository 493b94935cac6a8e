"""Prefix-affinity request routing for the engine deployment (`generator.routing: prefix_affinity`).

Owns: a Ray Serve `RequestRouter` that sends requests whose prompts share their first `prefix_tokens` tokens to the
same replica (rendezvous hashing over the live replica ids, so a replica joining or leaving moves only its share),
falling back to the others when the preferred one refuses, so same-prefix requests hit a warm prefix cache.
Why not Serve's `PrefixCacheAffinityRouter`: it keys on text prompts and blocks on a `ray.get` per routed request;
ours are token ids, routed inside the gateway's event loop.
Must never: block, or refuse to route when the preferred replica is unavailable.
Details: docs/design/generator.md, "Prefix-affinity routing".
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


def rank_replicas(replica_ids: Sequence[str], prompt_ids: Sequence[int], prefix_tokens: int) -> list[str]:
    """Replica ids ordered by rendezvous score for this prompt prefix (best first)."""
    key = ",".join(map(str, prompt_ids[:prefix_tokens])).encode()

    def score(rid: str) -> bytes:
        return hashlib.blake2b(key + b"|" + rid.encode(), digest_size=8).digest()

    return sorted(replica_ids, key=score, reverse=True)


def _prompt_ids(pending: PendingRequest | None) -> list[int] | None:
    if pending is None:
        return None
    for arg in list(pending.args) + list(pending.kwargs.values()):
        ids = getattr(arg, "prompt_ids", None)
        if isinstance(ids, list):
            return ids
    return None


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, prefix_tokens: int = 64, **kwargs: Any) -> None:
        self.prefix_tokens = prefix_tokens

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ids = _prompt_ids(pending_request)
        if ids is None:  # control calls etc.: any replica
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        order = rank_replicas(list(by_id), ids, getattr(self, "prefix_tokens", 64))
        # Rank 1: the preferred replica; rank 2: everyone else (least loaded wins there).
        return [[by_id[order[0]]], [by_id[rid] for rid in order[1:]]] if len(order) > 1 else [[by_id[order[0]]]]
