"""Samples -> model-ready tensors for one learner rank: alignment, micro-batches, packing, DP split.

Owns: the token layout every role uses, and the plans that cut a batch into micro-batches (by count or by a token
budget), pack several sequences into one row, and split a batch over DP. Alignment: response token j of a sequence
at column offset o after P prompt tokens is predicted at column o + P + j - 1 (`MicroBatch.gather_index`), and
every per-token tensor lives in the response layout [num_seqs, L] (L the batch's longest response; `response_mask`
from the loss mask); a sample needs P >= 1. Packed rows restart position ids per sequence and attention stays
within each document, so packed results equal unpacked ones up to rounding. `width_multiple` pads rows on the
right, after every real token.
Must never: touch a model, a process group or Ray; reorder samples inside a DP shard (results are scattered back by
index, but order is kept so runs are reproducible).
Details: docs/design/learner.md, "Batching".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from asyncrl.learner.parallel import split_for_dp
from asyncrl.types import Sample


@dataclass(frozen=True)
class Placement:
    """Where one sequence sits inside a micro-batch's `input_ids`."""

    row: int
    offset: int  # first column of the sequence in its row
    prompt_len: int
    response_len: int

    @property
    def length(self) -> int:
        return self.prompt_len + self.response_len


@dataclass
class MicroBatch:
    """Tensors for one forward pass, plus the map back to samples (see the module docstring)."""

    sample_index: list[int]  # positions of its sequences in the shard's sample list
    input_ids: torch.Tensor  # [rows, T] long, right-padded with `pad_id`
    position_ids: torch.Tensor  # [rows, T] long, restarting at 0 per sequence
    attention_mask: torch.Tensor | None  # [rows, 1, T, T] bool (True = masked) when packed; None = plain causal
    placements: list[Placement]
    gather_index: torch.Tensor  # [n, L] long: flattened column whose output predicts response token j
    response_mask: torch.Tensor  # [n, L] bool
    labels: torch.Tensor  # [n, L] long: response token j (0 where masked)
    routes: torch.Tensor | None = None  # [rows, T, MoE layers, top-k] the engine's experts (routing replay)

    @property
    def num_tokens(self) -> int:
        return sum(p.length for p in self.placements)

    @property
    def packed(self) -> bool:
        """One row holding several sequences (its attention must stay inside each of them)."""
        return self.input_ids.shape[0] == 1 and len(self.placements) > 1

    @property
    def last_token_index(self) -> torch.Tensor:
        """[n] flattened column of each sequence's last token (a reward model's score position)."""
        t = self.input_ids.shape[1]
        return torch.tensor([p.row * t + p.offset + p.length - 1 for p in self.placements], dtype=torch.long)


def sequence_lengths(samples: Sequence[Sample]) -> list[int]:
    return [len(s.prompt_ids) + len(s.response_ids) for s in samples]


def plan_micro_batches(
    lengths: Sequence[int], micro_batch_size: int, max_tokens: int | None = None
) -> list[list[int]]:
    """Contiguous index groups. Without `max_tokens`: `micro_batch_size` sequences each.

    With `max_tokens` (dynamic batch size): greedy in order, a group closes when the next
    sequence would push its token total past the budget; a sequence longer than the budget goes
    alone (it cannot be split). `micro_batch_size` is then ignored.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    n = len(lengths)
    if max_tokens is None:
        return [list(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be >= 1")
    groups: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, length in enumerate(lengths):
        if current and total + length > max_tokens:
            groups.append(current)
            current, total = [], 0
        current.append(i)
        total += length
    if current:
        groups.append(current)
    return groups


def _block_causal_mask(placements: Sequence[Placement], rows: int, width: int) -> torch.Tensor:
    allowed = torch.zeros(rows, width, width, dtype=torch.bool)
    for p in placements:
        s, e = p.offset, p.offset + p.length
        allowed[p.row, s:e, s:e] = torch.ones(p.length, p.length, dtype=torch.bool).tril()
    return (~allowed).unsqueeze(1)


def build_micro_batch(
    samples: Sequence[Sample], indices: Sequence[int], *, response_width: int, pack: bool = False,
    pad_id: int = 0, width_multiple: int = 1, dense_mask: bool = True, routes_shape: tuple[int, int] | None = None,
) -> MicroBatch:
    """Lay out `samples[indices]` (one row each, or one packed row) with their gather maps; with `routes_shape`
    (MoE layers, top-k) also the samples' routes (learner/routing_replay.py)."""
    chosen = [samples[i] for i in indices]
    placements: list[Placement] = []
    if pack:
        offset = 0
        for s in chosen:
            placements.append(Placement(0, offset, len(s.prompt_ids), len(s.response_ids)))
            offset += len(s.prompt_ids) + len(s.response_ids)
        rows, width = 1, offset
    else:
        placements = [Placement(r, 0, len(s.prompt_ids), len(s.response_ids)) for r, s in enumerate(chosen)]
        rows, width = len(chosen), max(p.length for p in placements)
    if width_multiple < 1:
        raise ValueError(f"width_multiple={width_multiple} must be >= 1")
    width = -(-width // width_multiple) * width_multiple
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((rows, width), dtype=torch.long)
    n = len(chosen)
    gather = torch.zeros((n, response_width), dtype=torch.long)
    mask = torch.zeros((n, response_width), dtype=torch.bool)
    labels = torch.zeros((n, response_width), dtype=torch.long)
    for i, (s, p) in enumerate(zip(chosen, placements)):
        if p.prompt_len < 1:
            raise ValueError(f"sample {indices[i]} has an empty prompt: its first token has no prediction")
        if p.response_len > response_width:
            raise ValueError(f"sample {indices[i]} has {p.response_len} response tokens > response_width={response_width}")
        ids = torch.tensor(list(s.prompt_ids) + list(s.response_ids), dtype=torch.long)
        input_ids[p.row, p.offset : p.offset + p.length] = ids
        position_ids[p.row, p.offset : p.offset + p.length] = torch.arange(p.length)
        first = p.row * width + p.offset + p.prompt_len - 1  # predicts response token 0
        gather[i, : p.response_len] = torch.arange(first, first + p.response_len)
        if s.loss_mask is None:
            mask[i, : p.response_len] = True
        else:
            if len(s.loss_mask) != p.response_len:
                raise ValueError(f"sample {indices[i]} has a loss_mask of {len(s.loss_mask)} for {p.response_len} response tokens")
            mask[i, : p.response_len] = torch.tensor(s.loss_mask, dtype=torch.bool)
        labels[i, : p.response_len] = ids[p.prompt_len :]
    attention = _block_causal_mask(placements, rows, width) if pack and n > 1 and dense_mask else None
    routes = None
    if routes_shape is not None:
        from asyncrl.learner.routing_replay import routes_tensor

        routes = routes_tensor(chosen, placements, rows, width, *routes_shape)
    return MicroBatch(
        sample_index=list(indices), input_ids=input_ids, position_ids=position_ids,
        attention_mask=attention, placements=placements, gather_index=gather,
        response_mask=mask, labels=labels, routes=routes,
    )


def make_micro_batches(
    samples: Sequence[Sample], *, micro_batch_size: int, max_tokens: int | None = None,
    pack: bool = False, response_width: int | None = None, pad_id: int = 0, width_multiple: int = 1,
    dense_mask: bool = True, routes_shape: tuple[int, int] | None = None,
) -> list[MicroBatch]:
    """Cut a shard into micro-batches (see `plan_micro_batches`), each laid out by `build_micro_batch`."""
    if not samples:
        return []
    width = response_width if response_width is not None else max(len(s.response_ids) for s in samples)
    width = max(width, 1)
    plan = plan_micro_batches(sequence_lengths(samples), micro_batch_size, max_tokens)
    return [
        build_micro_batch(samples, g, response_width=width, pack=pack, pad_id=pad_id,
                          width_multiple=width_multiple, dense_mask=dense_mask, routes_shape=routes_shape)
        for g in plan
    ]


def response_tensor(
    rows: Sequence[Sequence[float]], indices: Sequence[int], width: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[len(indices), width] tensor of per-token values in the response layout (0 past each row)."""
    out = torch.zeros((len(indices), width), dtype=dtype)
    for i, k in enumerate(indices):
        row = rows[k]
        if len(row):
            out[i, : len(row)] = torch.as_tensor(list(row), dtype=dtype)
    return out


def unpad_response(values: torch.Tensor, lengths: Sequence[int]) -> list[list[float]]:
    """Per-sample python lists from a [n, L] response-layout tensor."""
    v = values.detach().to(torch.float64).cpu()
    return [v[i, :n].tolist() for i, n in enumerate(lengths)]


# ----------------------------------------------------------------------------- DP split


def split_by_groups(group_ids: Sequence[int], dp_size: int) -> list[list[int]]:
    """Split sample indices over `dp_size` shards, keeping GRPO groups whole when possible.

    Groups are the runs of consecutive equal `group_id`s. When there are at least `dp_size`
    groups, whole groups are dealt out contiguously, balancing the sample count of the largest
    shard. With fewer groups than shards, groups cannot all stay whole, so samples are split
    evenly instead. Every shard is non-empty and the shards, concatenated, give 0..n-1 in order.
    """
    n = len(group_ids)
    if dp_size < 1:
        raise ValueError(f"dp_size={dp_size} must be >= 1")
    if n < dp_size:
        raise ValueError(f"cannot split {n} samples over dp_size={dp_size}: every DP rank needs at least one")
    runs: list[list[int]] = []
    for i, g in enumerate(group_ids):
        if runs and group_ids[runs[-1][0]] == g:
            runs[-1].append(i)
        else:
            runs.append([i])
    if len(runs) < dp_size:
        base, extra = divmod(n, dp_size)
        out, start = [], 0
        for d in range(dp_size):
            size = base + (1 if d < extra else 0)
            out.append(list(range(start, start + size)))
            start += size
        return out
    shards = split_for_dp(runs, dp_size, [len(r) for r in runs])
    return [[i for run in shard for i in run] for shard in shards]
