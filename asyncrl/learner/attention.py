"""Fused core attention for Megatron's `SelfAttention`, with context parallelism, needing no TE.

Owns: `SDPAttention` (the layer spec's `core_attention`), the document layout of a packed row (`DocLayout`, passed
where Megatron passes `packed_seq_params`), the zig-zag CP split (`cp_chunk_index`, `split_for_cp`), the K/V
all-gather over CP with its reduce-scatter backward, and the plan of attention segments per rank (`plan_segments`).
How: each (query chunk, document) intersection is one causal `scaled_dot_product_attention` call against that
document's keys (grouped-query heads passed as they are); no mask tensor is ever built.
Must never: gather K/V over CP without a matching backward (the gradient of a rank's keys is the sum of every rank's
contribution), or read the device to plan segments (plans come from Python ints, so the forward never syncs).
Details: docs/design/learner.md, "Fused core attention".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F

try:  # megatron-core's record type for what `packed_seq_params` carries
    from megatron.core.packed_seq_params import PackedSeqParams as _PackedBase
except ImportError:  # pragma: no cover - planning helpers stay importable without Megatron
    _PackedBase = object  # type: ignore[assignment,misc]


@dataclass
class DocLayout(_PackedBase):  # type: ignore[misc,valid-type]
    """Document boundaries of a packed row, in global columns (before any CP split).

    Megatron hands `packed_seq_params` to the core attention untouched; in the `sbhd` format it
    only reads `max_seqlen_q` / `max_seqlen_kv` (the RoPE table length) and `cp_group`.
    `bounds` = (start_0, start_1, ..., end) covers the whole row: padding past the last
    document is a document of its own.
    """

    bounds: tuple[int, ...] = ()

    @classmethod
    def for_row(cls, doc_lengths: list[int], width: int, cp_group: Any = None) -> "DocLayout":
        starts = [0]
        for n in doc_lengths:
            starts.append(starts[-1] + n)
        if starts[-1] > width:
            raise ValueError(f"documents of {starts[-1]} tokens do not fit a row of {width}")
        if starts[-1] < width:
            starts.append(width)
        return cls(qkv_format="sbhd", max_seqlen_q=width, max_seqlen_kv=width, cp_group=cp_group,
                   bounds=tuple(starts))


# ----------------------------------------------------------------------------- CP layout (pure)


def cp_chunk_index(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two of 2*CP equal chunks a CP rank holds: r and 2*CP-1-r (early + late: equal work)."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} must lie in [0, cp_size={cp_size})")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def local_positions(width: int, cp_size: int, cp_rank: int) -> list[int]:
    """Global columns of this rank's local positions, in local order."""
    if cp_size == 1:
        return list(range(width))
    if width % (2 * cp_size):
        raise ValueError(f"width={width} is not divisible by 2 * context_parallel_size={2 * cp_size}")
    c = width // (2 * cp_size)
    a, b = cp_chunk_index(cp_size, cp_rank)
    return list(range(a * c, (a + 1) * c)) + list(range(b * c, (b + 1) * c))


def split_for_cp(t: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's zig-zag share of `t` along `dim` (the sequence dimension)."""
    if cp_size == 1:
        return t
    width = t.shape[dim]
    if width % (2 * cp_size):
        raise ValueError(f"sequence width {width} is not divisible by 2 * context_parallel_size={2 * cp_size}")
    chunks = t.chunk(2 * cp_size, dim=dim)
    a, b = cp_chunk_index(cp_size, cp_rank)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


@lru_cache(maxsize=64)
def _global_order(width: int, cp_size: int) -> tuple[int, ...]:
    """Index into the rank-ordered all-gather ([rank 0's chunks, rank 1's, ...]) giving global order."""
    c = width // (2 * cp_size)
    where = {}
    for r in range(cp_size):
        for slot, chunk in enumerate(cp_chunk_index(cp_size, r)):
            where[chunk] = (2 * r + slot) * c
    return tuple(i for chunk in range(2 * cp_size) for i in range(where[chunk], where[chunk] + c))


@dataclass(frozen=True)
class Segment:
    """Queries [q_start, q_end) (local positions) attend to keys [k_start, k_end) (global)."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int

    @property
    def square(self) -> bool:
        return self.q_end - self.q_start == self.k_end - self.k_start


@lru_cache(maxsize=256)
def plan_segments(width: int, cp_size: int, cp_rank: int, bounds: tuple[int, ...] | None = None) -> tuple[Segment, ...]:
    """Every attention call this rank makes for a row of `width` global columns.

    `bounds`: document starts plus the row end (None: one document, the whole row). Segments
    come in local query order and cover every local position exactly once.
    """
    bounds = bounds or (0, width)
    if bounds[0] != 0 or bounds[-1] != width or any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"document bounds {bounds} must rise strictly from 0 to the row width {width}")
    if cp_size == 1:
        chunks = [(0, width)]
    else:
        if width % (2 * cp_size):
            raise ValueError(f"width={width} is not divisible by 2 * context_parallel_size={2 * cp_size}")
        c = width // (2 * cp_size)
        chunks = [(i * c, (i + 1) * c) for i in cp_chunk_index(cp_size, cp_rank)]
    segments, local = [], 0
    for gs, ge in chunks:
        for ds, de in zip(bounds, bounds[1:]):
            qs, qe = max(gs, ds), min(ge, de)
            if qs < qe:
                segments.append(Segment(local + qs - gs, local + qe - gs, ds, qe))
        local += ge - gs
    return tuple(segments)


# ----------------------------------------------------------------------------- CP collectives


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over a group; backward sums every rank's gradient of this rank's
    slice (reduce-scatter; gloo has none, so there an all-reduce and a slice)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        size = torch.distributed.get_world_size(group)
        x = x.contiguous()
        out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        if torch.distributed.get_backend(group) == "nccl":
            torch.distributed.all_gather_into_tensor(out, x, group=group)
        else:
            torch.distributed.all_gather(list(out.chunk(size)), x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        group = ctx.group
        size, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
        grad = grad.contiguous()
        if torch.distributed.get_backend(group) == "nccl":
            out = torch.empty((grad.shape[0] // size, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
            torch.distributed.reduce_scatter_tensor(out, grad, group=group)
            return out, None
        torch.distributed.all_reduce(grad, group=group)
        return grad.chunk(size)[rank].contiguous(), None


@lru_cache(maxsize=64)
def _global_order_on(width: int, cp_size: int, device: torch.device) -> torch.Tensor:
    """`_global_order` as an index tensor on `device`, made once: building it per call copied
    `width` ints from host to device in every attention layer, a host wait each time on a GPU."""
    return torch.tensor(_global_order(width, cp_size), device=device)


def gather_sequence(x: torch.Tensor, width: int, group: Any) -> torch.Tensor:
    """[S/CP, ...] zig-zag share on every rank -> [S, ...] in global order, differentiable."""
    size = torch.distributed.get_world_size(group)
    full = _GatherSequence.apply(x, group)
    return full.index_select(0, _global_order_on(width, size, x.device))


class _SumOverGroup(torch.autograd.Function):
    """Forward: all-reduce (sum) of per-rank partial results that do not overlap. Backward: the
    identity, because every rank then computes the same loss from the sum (a sum's backward
    would count that gradient once per rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def combine_over_cp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum disjoint per-CP-rank pieces of a per-token result (see `_SumOverGroup`)."""
    if group is None or torch.distributed.get_world_size(group) == 1:
        return x
    return _SumOverGroup.apply(x, group)


# ----------------------------------------------------------------------------- the module


class SDPAttention(torch.nn.Module):
    """Megatron `core_attention` on `scaled_dot_product_attention` (see the module docstring).

    Takes query [sq, b, np, hn], key / value [sk, b, ng, hn] (this rank's positions, TP-local
    heads) and returns [sq, b, np * hn]. Causal self-attention only; no dropout (RL fine-tuning
    runs with attention_dropout = 0; a non-zero value is refused at construction).
    """

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None, **_: Any) -> None:
        super().__init__()
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.enums import AttnMaskType

        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"attention_dropout={dropout}: the fused learner attention runs without dropout (set 0)")
        if attention_type != "self" or attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"SDPAttention computes causal self-attention, got {attention_type} / {attn_mask_type}")
        if getattr(config, "window_size", None) is not None:
            raise ValueError("window_size (sliding-window attention) is not supported by the learner's attention")
        self.config = config
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        if config.apply_query_key_layer_scaling:
            raise ValueError("apply_query_key_layer_scaling is not supported by the learner's attention")
        cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self.cp_group = cp_group if cp_group is not None else ps.get_context_parallel_group()
        self.cp_size = torch.distributed.get_world_size(self.cp_group) if config.context_parallel_size > 1 else 1
        self.cp_rank = torch.distributed.get_rank(self.cp_group) if self.cp_size > 1 else 0

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None,
                **_: Any) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by the learner's attention")
        sq, b, heads, hn = query.shape
        width = sq * self.cp_size
        bounds = getattr(packed_seq_params, "bounds", None) or None
        if bounds is not None and b != 1:
            raise ValueError(f"a packed row (document bounds) must be a batch of 1, got {b} rows")
        if self.cp_size > 1:
            key = gather_sequence(key, width, self.cp_group)
            value = gather_sequence(value, width, self.cp_group)
        # [s, b, h, d] -> [b, h, s, d]: views, the head dim stays contiguous for the fused kernels
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = attend_segments(q, k, v, plan_segments(width, self.cp_size, self.cp_rank, bounds), self.scale)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)


def attend_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: tuple[Segment, ...],
                    scale: float, lower_right: Any = None) -> torch.Tensor:
    """Queries [b, h, sq, d] (this rank's positions) against keys / values [b, g, sk, d] (the whole row, g dividing
    h), one fused call per segment, concatenated in local query order. `lower_right(q, k, v, scale)`: the
    bottom-right segments' call (`lower_right_attention`; benchmarks/cp_attention.py times `bias_lower_right`)."""
    lower_right = lower_right or lower_right_attention
    gqa = k.shape[1] != q.shape[1]
    if len(segments) == 1 and segments[0].square:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    parts = []
    for s in segments:
        qs, ks, vs = q[:, :, s.q_start : s.q_end], k[:, :, s.k_start : s.k_end], v[:, :, s.k_start : s.k_end]
        if s.square:
            parts.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa))
        else:
            parts.append(lower_right(qs, ks, vs, scale))
    return torch.cat(parts, dim=2)


# Below this many queries a bottom-right call stays one call: the split's two launches, copies and merge cost more
# than cuDNN saves on so little work (benchmarks/cp_attention.py: a CP=2 rank at 8k tokens a row was slower split).
MERGE_MIN_QUERIES = 4096


def cudnn_lower_right_ok(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether `lower_right_attention` takes the split path on cuDNN's kernels: CUDA on Hopper or later (where SDPA
    picks cuDNN first), half precision, heads of at most 128 in multiples of 8, grouped-query heads dividing."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 128
            and q.shape[1] % k.shape[1] == 0 and torch.backends.cuda.cudnn_sdp_enabled()
            and torch.cuda.get_device_capability(q.device) >= (9, 0))


def lower_right_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of queries that are the last `sq` of the `sk` key positions (a CP rank's later chunk, or a
    document begun in an earlier chunk): query i sees keys [0, sk - sq + i]. On cuDNN (`cudnn_lower_right_ok`, at
    least `MERGE_MIN_QUERIES` queries) it is two calls merged by their log-sum-exps (`_MergedLowerRight`); elsewhere
    SDPA's `causal_lower_right` bias, which runs on flash where flash takes the call (slower than cuDNN where SDPA
    prefers cuDNN) and else materialises the mask."""
    if q.shape[2] >= MERGE_MIN_QUERIES and cudnn_lower_right_ok(q, k):
        return _MergedLowerRight.apply(q, k, v, scale, (_cudnn_forward, _cudnn_backward))
    return bias_lower_right(q, k, v, scale)


def bias_lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The bottom-right causal call as one SDPA call with its `causal_lower_right` bias (no mask tensor unless SDPA
    falls back to the math kernel)."""
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def _cudnn_forward(q, k, v, causal: bool, scale: float):
    """One fused attention call: (output, log-sum-exp [b, h, sq, 1] fp32, what its backward needs)."""
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _cudnn_backward(dout, q, k, v, out, lse, causal: bool, scale: float, saved):
    cum_q, cum_k, max_q, max_k, seed, offset = saved
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal, scale=scale)


class _MergedLowerRight(torch.autograd.Function):
    """Bottom-right causal attention as two fused calls: the queries against the keys before their own block (no
    mask) and against their own block (square, causal); outputs merged by the log-sum-exps, in fp32. Backward: each
    call's own backward kernel fed the merged output and log-sum-exp (its probabilities are then the merged softmax's,
    and its row terms dO . O the merged output's), query gradients summed, key / value gradients side by side.
    `kernels`: (forward, backward) of one call, `_cudnn_forward` / `_cudnn_backward`."""

    @staticmethod
    def forward(ctx, q, k, v, scale, kernels):  # type: ignore[override]
        forward, _ = kernels
        p = k.shape[2] - q.shape[2]
        q = q.contiguous()
        parts = [(k[:, :, :p].contiguous(), v[:, :, :p].contiguous(), False),
                 (k[:, :, p:].contiguous(), v[:, :, p:].contiguous(), True)]
        (o1, l1, s1), (o2, l2, s2) = (forward(q, kk, vv, causal, scale) for kk, vv, causal in parts)
        lse = torch.logaddexp(l1, l2)
        out = (o1.float() * torch.exp(l1 - lse) + o2.float() * torch.exp(l2 - lse)).to(q.dtype)
        ctx.save_for_backward(q, out, lse, parts[0][0], parts[0][1], parts[1][0], parts[1][1])
        ctx.scale, ctx.kernels, ctx.calls = scale, kernels, (s1, s2)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, out, lse, k1, v1, k2, v2 = ctx.saved_tensors
        backward, dout = ctx.kernels[1], dout.contiguous()
        dq1, dk1, dv1 = backward(dout, q, k1, v1, out, lse, False, ctx.scale, ctx.calls[0])
        dq2, dk2, dv2 = backward(dout, q, k2, v2, out, lse, True, ctx.scale, ctx.calls[1])
        return dq1 + dq2, torch.cat([dk1, dk2], dim=2), torch.cat([dv1, dv2], dim=2), None, None
