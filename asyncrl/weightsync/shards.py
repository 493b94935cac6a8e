"""Shard plans: every TP rank of the learner sends its own shards of the weights, with no gather.

Owns: `localize_layout` (an engine rank's layout rewritten to read the same windows from the pieces,
`plan.Piece`, of the one learner rank whose shards hold them; PlanError where a parameter spans learner
ranks), `plan_layout` (the same for a plan), `build_shard_plan` -> `plan.PushPlan` whose senders are the
learner's TP ranks (x PP stages), and `hf_from_engine` (the HF tensors back from engine-layout buckets).
Must never: guess a window (a view that is not a box of its tensor is refused, not approximated), or
let a parameter draw from two learner ranks (each engine parameter is one sender's bucket entry).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from asyncrl.weightsync.bucket import Bucket, dtype_from_name
from asyncrl.weightsync.plan import EngineLayout, ManifestEntry, Op, ParamLayout, Piece, PlanError, PushPlan, View, build_plan, piece_name, same_ops  # noqa: F401 - Piece, piece_name: the shard vocabulary, defined beside the plan


def _strides(shape: Sequence[int]) -> list[int]:
    out, n = [], 1
    for d in reversed(shape):
        out.append(n)
        n *= int(d)
    return out[::-1]


def _box(view: View, shape: tuple[int, ...]) -> tuple[list[int], list[int | None]] | None:
    """`view` of a contiguous tensor of `shape` as a box: its first element's index per dimension, and
    the tensor dimension each view dimension walks (None: extent 1). None when the view is not a box
    (a reshape that merges or splits dimensions, a stride that is no dimension's)."""
    strides = _strides(shape)
    start, rest = [], view.offset
    for s in strides:
        start.append(rest // s)
        rest %= s
    dims: list[int | None] = []
    for ext, st in zip(view.shape, view.stride):
        if ext == 1:
            dims.append(None)
            continue
        match = [j for j, (sj, nj) in enumerate(zip(strides, shape)) if sj == st and nj > 1 and j not in dims]
        if len(match) != 1 or start[match[0]] + ext > shape[match[0]]:
            return None
        dims.append(match[0])
    return start, dims


def _rebase(view: View, box: tuple[list[int], list[int | None]], shape: tuple[int, ...], dim: int, shift: int) -> View:
    """The same box in a contiguous tensor of `shape` whose index along `dim` is the old one + `shift`."""
    start, dims = list(box[0]), box[1]
    start[dim] += shift
    strides = _strides(shape)
    return View(sum(a * s for a, s in zip(start, strides)), view.shape,
                tuple(1 if j is None else strides[j] for j in dims))


def _inside(box: tuple[list[int], list[int | None]], view: View, window: tuple[int, int, int] | None) -> bool:
    if window is None:
        return True
    dim, lo, hi = window
    start, dims = box
    extent = next((e for e, j in zip(view.shape, dims) if j == dim), 1)
    return lo <= start[dim] and start[dim] + extent <= hi


def localize_layout(layout: EngineLayout, pieces: Sequence[Piece], ranks: int) -> EngineLayout:
    """An engine rank's layout (its ops read from HF tensors) rewritten to read from the learner ranks' pieces, each
    parameter from one sending rank whose pieces hold every op's window: the learner TP rank whose shard holds this
    engine rank's (engine rank x learner TP // `ranks`, the engine's TP size; engine rank modulo learner TP for an
    engine of smaller TP), else the lowest, so an engine rank's replicated parameters come from the rank that sends
    its shards. Raises PlanError naming a parameter no single rank holds (e.g. an engine of a smaller TP size than
    the learner's: its fused QKV spans every learner rank's rows)."""
    if layout.problem:
        return layout
    tp_size = 1 + max((p.tp for p in pieces), default=0)
    want = layout.rank * tp_size // ranks if ranks >= tp_size else layout.rank % tp_size
    by_hf: dict[str, list[Piece]] = {}
    for piece in pieces:
        by_hf.setdefault(piece.hf, []).append(piece)
    tp_of = {piece.sender: piece.tp for piece in pieces}
    params = []
    for p in layout.params:
        boxes = {}
        for op in p.ops:
            if op.src is not None:
                full = by_hf[op.src][0].full if op.src in by_hf else None
                box = _box(op.src_view, full) if full is not None else None  # type: ignore[arg-type]
                if box is None:
                    raise PlanError(f"engine parameter {p.name} reads {op.src} in a way no learner rank's piece of it "
                                    "can be located (no piece, or a window that is not a box of it)")
                boxes[id(op)] = box
        senders: set[int] | None = None
        for op in p.ops:
            if op.src is not None:
                holding = {pc.sender for pc in by_hf[op.src] if _inside(boxes[id(op)], op.src_view, pc.window)}  # type: ignore[arg-type]
                senders = holding if senders is None else senders & holding
        if senders is None:  # only fills
            params.append(p)
            continue
        if not senders:
            raise PlanError(f"engine parameter {p.name} (rank {layout.rank}) draws from more than one learner rank's "
                            "shards")
        mine = sorted(s for s in senders if tp_of[s] == want)
        sender = mine[0] if mine else min(senders)
        ops = []
        for op in p.ops:
            if op.src is None:
                ops.append(op)
                continue
            piece = next(pc for pc in by_hf[op.src] if pc.sender == sender)
            view = op.src_view if piece.window is None else _rebase(
                op.src_view, boxes[id(op)], piece.shape, piece.window[0], -piece.window[1])  # type: ignore[arg-type]
            ops.append(Op(op.dst, piece.name, view, op.value))
        params.append(ParamLayout(p.name, p.dtype, p.shape, tuple(ops)))
    return EngineLayout(layout.rank, tuple(params), "")


def build_shard_plan(hf_manifest: Sequence[ManifestEntry], pieces: Sequence[Piece], layouts: Sequence[EngineLayout],
                     bucket_mb: float) -> PushPlan:
    """A push plan whose buckets every learner rank that holds pieces packs from its own shards, with no
    gather: `layouts` (probed on `hf_manifest`) localized to `pieces` (in each sender's export order).
    Raises PlanError where some engine parameter spans ranks, or some sending rank would send nothing."""
    known = {e.name: e for e in hf_manifest}
    for piece in pieces:
        entry = known.get(piece.hf)
        if entry is None or tuple(entry.shape) != tuple(piece.full) or entry.dtype != piece.dtype:
            raise PlanError(f"learner piece {piece.name} does not match the export's {piece.hf} "
                            f"({None if entry is None else (entry.dtype, tuple(entry.shape))})")
    local = [localize_layout(lay, pieces, len(layouts)) for lay in layouts]
    plan = build_plan([pc.entry() for pc in pieces], local, bucket_mb)
    idle = sorted({pc.sender for pc in pieces} - {b.sender for b in plan.buckets})
    if idle:
        raise PlanError(f"learner ranks {idle} would send nothing (every engine parameter is another rank's)")
    return PushPlan(plan.plan_id, plan.ranks, plan.senders, plan.buckets, plan.manifest, plan.layouts,
                    tuple(pieces), tuple(hf_manifest))


def plan_layout(plan: PushPlan, hf_layout: EngineLayout) -> EngineLayout:
    """An engine rank's layout probed on `plan.probed_manifest`, in `plan`'s terms (what `plan.layouts` holds)."""
    return localize_layout(hf_layout, plan.pieces, plan.ranks) if plan.pieces else hf_layout


def plan_misfit(plan: PushPlan, layouts: Sequence[EngineLayout]) -> str:
    """Why engine ranks of `layouts` (each probed on `plan.probed_manifest`) cannot take `plan`'s buckets, or "":
    each one's layout, in the plan's terms, must be the plan's for its rank."""
    for mine in layouts:
        theirs = [lay for lay in plan.layouts if lay.rank == mine.rank]
        try:
            fits = not mine.problem and len(theirs) == 1 and same_ops(plan_layout(plan, mine), theirs[0])
        except PlanError as err:
            return f"engine rank {mine.rank}: {err}"
        if not fits:
            why = mine.problem or "its parameter layout differs from push plan " + plan.plan_id + "'s"
            return f"engine rank {mine.rank}: {why}"
    return ""


def plan_for(manifest: Sequence[ManifestEntry], layouts: Sequence[EngineLayout], bucket_mb: float,
             pieces: Sequence[Piece] = ()) -> tuple[PushPlan | None, str]:
    """The push plan for engine ranks of `layouts`: a shard plan where the learner's TP `pieces` allow one, else
    the gathered plan, else None; and why it is not the better one ("" when it is)."""
    problems = sorted({layout.problem for layout in layouts if layout.problem})
    if problems:
        return None, problems[0]
    try:
        plan = build_plan(manifest, layouts, bucket_mb)
    except PlanError as err:
        return None, str(err)
    if pieces:
        try:
            return build_shard_plan(manifest, pieces, layouts, bucket_mb), ""
        except PlanError as err:
            return plan, f"TP shards are gathered before each push: {err}"
    return plan, ""

def hf_from_engine(plan: PushPlan, buckets: Iterable[Bucket]) -> dict[str, torch.Tensor]:
    """The HF tensors rebuilt from engine-layout buckets of `plan` (each source element from any
    copy of it); host tensors in the manifest's dtypes. Raises PlanError if some source was never
    copied anywhere (a layout that drops data cannot be inverted)."""
    hf = plan.probed_manifest
    out = {e.name: torch.empty(e.shape, dtype=dtype_from_name(e.dtype)) for e in hf}
    pieces = {pc.name: pc for pc in plan.pieces}  # a shard plan: each op's piece window put back into its HF tensor
    seen: set[str] = set()
    by_key = {(b.rank, tuple(m.name for m in b.metas())): b for b in plan.buckets}
    for bucket in buckets:
        b = by_key.get((bucket.rank, tuple(bucket.names)))
        if b is None:
            raise PlanError(f"a bucket of rank {bucket.rank} starting with {bucket.names[:1]} is not in plan {plan.plan_id}")
        host = bucket.to_host()
        flat = torch.from_numpy(host.buffer) if not isinstance(host.buffer, torch.Tensor) else host.buffer
        for p, off in b.params:
            view = flat[off : off + p.nbytes].view(dtype_from_name(p.dtype)).view(p.shape)
            for op in p.ops:
                if op.src is None:
                    continue
                src, sv = op.src, op.src_view
                piece = pieces.get(src)
                if piece is not None:
                    src = piece.hf
                    if piece.window is not None:
                        box = _box(sv, piece.shape)  # type: ignore[arg-type]
                        if box is None:
                            raise PlanError(f"plan {plan.plan_id}: {op.src}'s window in {p.name} is not a box")
                        sv = _rebase(sv, box, piece.full, piece.window[0], piece.window[1])  # type: ignore[arg-type]
                sv.of(out[src]).copy_(op.dst.of(view))  # type: ignore[union-attr]
                seen.add(src)
    missing = [e.name for e in hf if e.name not in seen]
    if missing:
        raise PlanError(f"{len(missing)} exported tensors are not in any engine parameter, e.g. {missing[:3]}")
    return out


def sender_ranks(plan: PushPlan) -> dict[int, tuple[int, ...]] | None:
    """sender -> the engine ranks its buckets are for, for each sender of `plan` that feeds only some (a
    shard plan's); None where every sender feeds every rank. What each sender's broadcast group holds
    (`collective.form_specs`)."""
    feeds: dict[int, set[int]] = {}
    for b in plan.buckets:
        feeds.setdefault(b.sender, set()).add(b.rank)
    every = set(range(plan.ranks))
    some = {s: tuple(sorted(r)) for s, r in sorted(feeds.items()) if r != every}
    return some or None
