"""Routing replay (R3) for MoE models: the learner's routers take the experts the engine chose for each token.

Owns: the routes' wire form on a `Sample` (little-endian int16 [tokens, MoE layers, top-k], prompt then response),
their layout in a micro-batch's rows, and handing each router of this rank's model its tokens' experts before a
forward (Megatron's `RouterReplay`).
Why: expert choices that differ between the engine's and the learner's kernels dominate an MoE model's engine/learner
mismatch; the gates' weights still come from the learner's own scores, so they train as before.
Must never: replay under a layout whose routers see other tokens than the micro-batch's whole rows (sequence or
context parallel, pipeline stages: the config refuses those), or replay a batch only part of which has routes.
Details: docs/design/learner.md, "Routing replay".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

ROUTE_DTYPE = np.dtype("<i2")  # expert ids up to 32,767


def encode_routes(routes: Any) -> bytes:
    """[tokens, layers, top-k] expert ids (an engine's array) as a Sample's `routes`."""
    arr = np.asarray(routes)
    if arr.ndim != 3:
        raise ValueError(f"routes must be [tokens, layers, top-k], got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(ROUTE_DTYPE).max):
        raise ValueError(f"expert ids must be in [0, {np.iinfo(ROUTE_DTYPE).max}], got [{arr.min()}, {arr.max()}]")
    return arr.astype(ROUTE_DTYPE).tobytes()


def decode_routes(data: bytes, layers: int, topk: int, tokens: int) -> np.ndarray:
    """A Sample's routes as [n, layers, top-k] for a sequence of `tokens` tokens: the engine returns every token's
    route but the last one's (it was sampled, never fed), or all of them."""
    per_token = layers * topk * ROUTE_DTYPE.itemsize
    n, rest = divmod(len(data), per_token)
    if rest or n not in (tokens - 1, tokens):
        raise ValueError(f"routes of {len(data)} bytes do not fit a sequence of {tokens} tokens at {layers} MoE layers "
                         f"x top-{topk} ({per_token} bytes a token): the engine routed another model, or counted other layers")
    routes = np.frombuffer(data, dtype=ROUTE_DTYPE).reshape(n, layers, topk)
    if topk > 1 and routes.size and (np.diff(np.sort(routes, axis=-1), axis=-1) == 0).any():
        raise ValueError(f"routes name an expert twice in a token's top-{topk}: Megatron's dispatch counts each "
                         "expert once per token, so such routes cannot be replayed (the engine routed another way)")
    return routes


def routes_tensor(samples: Sequence[Any], placements: Sequence[Any], rows: int, width: int,
                  layers: int, topk: int) -> torch.Tensor | None:
    """[rows, width, layers, top-k] expert ids laid out as the micro-batch's tokens (placements give each sample's
    row and offset; padding and a sequence's last token route to experts 0..top-k-1, whose outputs no loss reads:
    distinct, since Megatron's dispatch counts each expert once per token and a repeated one breaks its token
    split), or None when no sample carries routes (the routers then choose for themselves)."""
    have = [s.routes is not None for s in samples]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(f"{have.count(False)} of {len(samples)} samples carry no routes: learner.routing_replay needs "
                         "the engine's routes for every sample (generator.engine_kwargs.enable_return_routed_experts)")
    out = torch.arange(topk, dtype=torch.long).expand(rows, width, layers, topk).clone()
    for s, p in zip(samples, placements, strict=True):
        r = decode_routes(s.routes, layers, topk, p.length)
        out[p.row, p.offset : p.offset + len(r)] = torch.from_numpy(r.astype(np.int64))
    return out


class RouteReplayer:
    """This rank's MoE routers (model order) and the replay of one micro-batch's routes into them."""

    def __init__(self, chunks: Sequence[torch.nn.Module], topk: int) -> None:
        self.routers = [m.router_replay for c in chunks for m in c.modules()
                        if getattr(m, "router_replay", None) is not None]
        if not self.routers:
            raise ValueError("learner.routing_replay: the model has no MoE router to replay into (a dense model)")
        self.topk = topk

    @property
    def layers(self) -> int:
        return len(self.routers)

    def set(self, routes: torch.Tensor, device: torch.device) -> None:
        """Replay `routes` [rows, width, layers, top-k] in the next forward (and a recompute of it). The router
        sees a layer's input as [width, rows] flattened (Megatron's sequence-first layout)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if routes.shape[2] != self.layers:
            raise ValueError(f"routes for {routes.shape[2]} MoE layers, this model has {self.layers}")
        for layer, router in enumerate(self.routers):
            idx = routes[:, :, layer, :].transpose(0, 1).reshape(-1, self.topk).to(device, non_blocking=True)
            router.clear_indices()
            router.set_target_indices(idx)
            router.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def clear(self) -> None:
        """The routers choose for themselves again (a micro-batch without routes)."""
        for router in self.routers:
            router.clear_indices()
            router.clear_router_replay_action()
