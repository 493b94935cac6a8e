"""The push plan: where every byte of an engine's parameters comes from, read from the engine itself.

Owns: `probe_layout` (the engine's own `load_weights` run on meta tensors, recording each copy and fill its loaders
make: fused QKV / gate-up, TP shards, padded vocab, tied embeddings, fused experts; a loader doing anything else is
named as unusable), `verify_layout`, `build_plan` -> `PushPlan` (each engine parameter given a sending learner rank,
a bucket and an offset), `plan_misfit`, `PlannedPacker` / `pack_stream` (a sender writes each HF tensor straight
into its places in the buckets) and `hf_from_engine` (the HF tensors back from engine-layout buckets).
Must never: touch an engine's live parameter data (the probe swaps in meta twins and puts the originals back), or import
vLLM (the engine adapter hands in the model).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from asyncrl.weightsync.bucket import ALIGN, Bucket, TensorMeta, dtype_from_name, iter_buckets, unpack_bucket

aten = torch.ops.aten


class PlanError(ValueError):
    """No plan can be made (or used) for this learner export and these engines."""


@dataclass(frozen=True, slots=True)
class View:
    """A strided window into a contiguous tensor, in elements."""

    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def of(self, base: torch.Tensor) -> torch.Tensor:
        """This window of `base` (a contiguous tensor or view)."""
        return base.as_strided(self.shape, self.stride, base.storage_offset() + self.offset)


@dataclass(frozen=True, slots=True)
class Op:
    """One loader step: copy `src`'s window `src_view` into the parameter's window `dst`, or fill
    `dst` with `value` (src None)."""

    dst: View
    src: str | None = None
    src_view: View | None = None
    value: float = 0.0


@dataclass(frozen=True, slots=True)
class ParamLayout:
    name: str
    dtype: str  # torch dtype name without "torch."
    shape: tuple[int, ...]
    ops: tuple[Op, ...]

    @property
    def nbytes(self) -> int:
        return dtype_from_name(self.dtype).itemsize * math.prod(int(d) for d in self.shape)

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(op.src for op in self.ops if op.src is not None))


@dataclass(frozen=True)
class ManifestEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    sender: int = 0  # which sending learner rank (PP stage) exports it


@dataclass(frozen=True)
class EngineLayout:
    """One engine rank's parameters and how the loaders fill them. `problem` is set (and `params`
    may be partial) when a direct copy would not be correct; it says why."""

    rank: int
    params: tuple[ParamLayout, ...]
    problem: str = ""


class _Recorder(TorchDispatchMode):
    """Records the copies and fills that land in a parameter twin; executes view ops (on meta)."""

    def __init__(self, params: dict[int, str], sources: dict[int, str]) -> None:
        super().__init__()
        self.params, self.sources = params, sources
        self.ops: dict[str, list[Op]] = {}
        self.unsupported: list[str] = []

    @staticmethod
    def _key(t: Any) -> int | None:
        return t.untyped_storage()._cdata if isinstance(t, torch.Tensor) and t.device.type == "meta" else None

    @staticmethod
    def _view(t: torch.Tensor) -> View:
        return View(int(t.storage_offset()), tuple(int(s) for s in t.shape), tuple(int(s) for s in t.stride()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        # (a copy or fill touching no meta tensor falls through: it runs)
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            param, source = self.params.get(self._key(dst)), self.sources.get(self._key(src))
            if param is not None and source is not None:
                if dst.dtype != src.dtype and src.dtype.is_floating_point != dst.dtype.is_floating_point:
                    self.unsupported.append(f"{param}: copies {src.dtype} into {dst.dtype}")
                self.ops.setdefault(param, []).append(Op(self._view(dst), source, self._view(src)))
                return dst
            if self._key(dst) is not None or self._key(src) is not None:
                self.unsupported.append(f"a copy the plan cannot follow (into {param or 'an untracked tensor'} "
                                        f"from {source or 'a derived tensor'})")
                return dst
        elif func in (aten.fill_.Scalar, aten.zero_.default) and self._key(dst := args[0]) is not None:
            param = self.params.get(self._key(dst))
            if param is None:
                self.unsupported.append(f"{func} on an untracked tensor")
                return dst
            self.ops.setdefault(param, []).append(Op(self._view(dst), value=float(args[1]) if len(args) > 1 else 0.0))
            return dst
        if getattr(func, "is_view", False) or func in (aten.detach.default, aten.alias.default):
            return func(*args, **kwargs)
        if any(self._key(a) is not None for a in list(args) + list(kwargs.values())):
            self.unsupported.append(str(func))
            if func._schema.is_mutable:
                return args[0]
        return func(*args, **kwargs)


def probe_layout(model: torch.nn.Module, manifest: Sequence[ManifestEntry], rank: int = 0,
                 load: Callable[[Iterable[tuple[str, torch.Tensor]]], Any] | None = None) -> EngineLayout:
    """The layout `model.load_weights` (or `load`) gives the tensors of `manifest` on this rank.

    Every parameter is swapped for a meta twin (same class and attributes) for the duration, so the
    loaders run for real but move no data; the live parameters are put back untouched."""
    live = dict(model.named_parameters())
    twins: dict[int, torch.nn.Parameter] = {}
    saved: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in twins:  # the same class and attributes (weight_loader, output_dim, ...), on meta
                data = torch.empty(tuple(p.shape), dtype=p.dtype, device="meta")
                twins[id(p)] = torch.nn.Parameter._make_subclass(type(p), data, False)
                twins[id(p)].__dict__.update(p.__dict__)
            saved.append((module, key, p))
            module._parameters[key] = twins[id(p)]
    param_keys = {twins[id(p)].untyped_storage()._cdata: n for n, p in live.items()}
    # (the list keeps the source storages alive: their ids key the table)
    sources = [(e.name, torch.empty(e.shape, dtype=dtype_from_name(e.dtype), device="meta")) for e in manifest]
    recorder = _Recorder(param_keys, {t.untyped_storage()._cdata: name for name, t in sources})
    problem = ""
    try:
        with recorder:
            (load or model.load_weights)(iter(sources))  # type: ignore[operator]
    except Exception as err:  # a loader that needs real data
        problem = f"the engine's weight loaders could not run on the plan's probe ({type(err).__name__}: {err})"
    finally:
        for module, key, p in saved:
            module._parameters[key] = p
    if recorder.unsupported and not problem:
        problem = "the engine's weight loaders do more than copy: " + "; ".join(sorted(set(recorder.unsupported))[:5])
    params, untouched = [], []
    for name, p in live.items():
        # Canonical order, by where each step writes (stable: a loader's own order at one offset, e.g. a
        # fill before the copy over it): the layout does not depend on the order of the export.
        ops = tuple(sorted(recorder.ops.get(name, ()), key=lambda op: op.dst.offset))
        if not ops:
            untouched.append(name)
            continue
        covered = sum(math.prod(op.dst.shape) for op in ops)
        if covered != p.numel() and not problem:
            problem = f"{name}: the loaders write {covered} of its {p.numel()} elements"
        params.append(ParamLayout(name, str(p.dtype).removeprefix("torch."), tuple(int(s) for s in p.shape), ops))
    if untouched and not problem:
        problem = f"{len(untouched)} engine parameters get nothing from the export, e.g. {untouched[:3]}"
    return EngineLayout(rank, tuple(params), problem)


def same_ops(a: EngineLayout, b: EngineLayout) -> bool:
    """Two layouts copy the same windows into the same parameters (their problems aside)."""
    return a.rank == b.rank and a.params == b.params


def verify_layout(layout: EngineLayout, live: dict[str, torch.Tensor], read: Callable[[str], torch.Tensor]) -> str:
    """'' when the layout rebuilds every live parameter exactly from the checkpoint tensors `read(name)` returns (on
    host), else which parameter differs. `live`: the parameters of the model the layout was just probed on."""
    if layout.problem:
        return layout.problem
    cache: dict[str, torch.Tensor] = {}
    for p in layout.params:
        target = live[p.name]
        rebuilt = torch.empty(p.shape, dtype=target.dtype, device=target.device)
        for op in p.ops:  # the loaders' steps replayed, in order
            if op.src is None:
                op.dst.of(rebuilt).fill_(op.value)
                continue
            if op.src not in cache:
                cache[op.src] = read(op.src).to(target.device).contiguous()
            op.dst.of(rebuilt).copy_(op.src_view.of(cache[op.src]))  # type: ignore[union-attr]
        if not torch.equal(rebuilt, target.detach()):
            return (f"{p.name}: the engine's loaded values differ from its loaders' copies of the checkpoint "
                    "(post-load processing changed them)")
        for name in p.sources:  # keep at most the sources the next parameters share
            if len(cache) > 8:
                cache.pop(name, None)
    return ""


@dataclass(frozen=True)
class PlannedBucket:
    sender: int
    rank: int
    index: int  # position in the sender's stream (all ranks interleaved)
    nbytes: int
    params: tuple[tuple[ParamLayout, int], ...]  # (layout, byte offset)

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(p.name, p.dtype, p.shape, off, p.nbytes) for p, off in self.params]


@dataclass(frozen=True, eq=False)  # (equal only to itself: its packer is kept by identity, `_program`)
class PushPlan:
    """Per engine rank, every parameter in a bucket of one sending learner rank."""

    plan_id: str
    ranks: int
    senders: int
    buckets: tuple[PlannedBucket, ...]
    manifest: tuple[ManifestEntry, ...]
    layouts: tuple[EngineLayout, ...] = field(repr=False)

    def for_sender(self, sender: int) -> list[PlannedBucket]:
        return [b for b in self.buckets if b.sender == sender]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


def build_plan(manifest: Sequence[ManifestEntry], layouts: Sequence[EngineLayout], bucket_mb: float) -> PushPlan:
    """Assign every engine parameter of every rank to its sender's buckets, in the order its first
    source appears in the export (so the packer emits buckets as the export goes)."""
    ranks = sorted(layout.rank for layout in layouts)
    if ranks != list(range(len(ranks))):
        raise PlanError(f"engine ranks {ranks} are not 0..{len(ranks) - 1}")
    for layout in layouts:
        if layout.problem:
            raise PlanError(f"engine rank {layout.rank}: {layout.problem}")
    order = {e.name: i for i, e in enumerate(manifest)}
    sender_of = {e.name: e.sender for e in manifest}
    cap = int(bucket_mb * (1 << 20))  # (> 0: the config's bound)
    per_stream: dict[tuple[int, int], list[ParamLayout]] = {}
    for layout in sorted(layouts, key=lambda x: x.rank):
        for p in layout.params:
            missing = [s for s in p.sources if s not in order]
            if missing:
                raise PlanError(f"engine parameter {p.name} needs {missing}, which the learner does not export")
            senders = {sender_of[s] for s in p.sources}
            if len(senders) != 1:
                raise PlanError(f"engine parameter {p.name} draws from several learner stages {sorted(senders)}")
            per_stream.setdefault((senders.pop(), layout.rank), []).append(p)
    buckets: list[PlannedBucket] = []
    senders_used = sorted({s for s, _ in per_stream})
    for sender in senders_used:
        chunks: dict[int, list[tuple[list[tuple[ParamLayout, int]], int]]] = {}  # rank -> [(params, nbytes)]
        for rank in ranks:
            params = sorted(per_stream.get((sender, rank), []), key=lambda p: min(order[s] for s in p.sources))
            chunks[rank] = []
            current: list[tuple[ParamLayout, int]] = []
            offset = 0
            for p in params:
                size = (p.nbytes + ALIGN - 1) // ALIGN * ALIGN
                if current and offset + size > cap:
                    chunks[rank].append((current, offset))
                    current, offset = [], 0
                current.append((p, offset))
                offset += size
            if current:
                chunks[rank].append((current, offset))
        first = len(buckets)  # (a bucket's index counts the sender's buckets before it)
        for k in range(max(len(c) for c in chunks.values())):
            for rank in ranks:  # ranks interleaved: bucket k of every rank holds the same sources
                if k < len(chunks[rank]):
                    chunk, nbytes = chunks[rank][k]
                    buckets.append(PlannedBucket(sender, rank, len(buckets) - first, nbytes, tuple(chunk)))
    blob = json.dumps([[b.sender, b.rank, b.nbytes, [[p.name, p.dtype, list(p.shape), off] for p, off in b.params]]
                       for b in buckets] + [[e.name, e.dtype, list(e.shape), e.sender] for e in manifest]
                      + [repr((lay.rank, lay.params, lay.problem)) for lay in layouts])
    plan_id = hashlib.sha256(blob.encode()).hexdigest()[:16]
    return PushPlan(plan_id, len(ranks), len(senders_used), tuple(buckets), tuple(manifest), tuple(layouts))


class _PackProgram:
    """What packing one sender's part of a plan does, worked out once per (plan, sender) and kept (`_program`):
    the pack runs in Python per exported tensor on every push, on the sender's path to the wire. Per bucket: its
    tensors' table, its copies (one slot each, in plan order) and its fills; per source: the slots it goes to."""

    def __init__(self, plan: PushPlan, sender: int) -> None:
        self.buckets = plan.for_sender(sender)
        self.metas = [b.metas() for b in self.buckets]
        self.uses: dict[str, list[tuple[int, int, Op]]] = {}  # source name -> [(bucket position, slot, op)]
        # per bucket, each window as (dtype, shape, stride, element offset in the buffer viewed in that dtype):
        self.copies: list[list[tuple[str, tuple[int, ...], tuple[int, ...], int]]] = []  # by slot
        self.fills: list[list[tuple[str, tuple[int, ...], tuple[int, ...], int, float]]] = []  # (..., value)
        self.dtypes: list[set[str]] = []
        for pos, b in enumerate(self.buckets):
            slots, fills = [], []
            self.copies.append(slots)
            self.fills.append(fills)
            for p, off in b.params:
                at = off // dtype_from_name(p.dtype).itemsize
                for op in p.ops:
                    if op.src is None:
                        fills.append((p.dtype, op.dst.shape, op.dst.stride, at + op.dst.offset, op.value))
                        continue
                    self.uses.setdefault(op.src, []).append((pos, len(slots), op))
                    slots.append((p.dtype, op.dst.shape, op.dst.stride, at + op.dst.offset))
            self.dtypes.append({p.dtype for p, _ in b.params})
        self.counts = [len(c) for c in self.copies]


# the `_PackProgram` of (plan, sender), kept for the last few (a plan hashes by identity)
_program = functools.lru_cache(maxsize=8)(_PackProgram)


class PlannedPacker:
    """Packs one sender's export into its planned buckets, each HF tensor written straight into its place as it
    arrives; yields complete buckets in plan order.
    `buffer(bucket)` returns the uint8 buffer (a tensor, on the host too) to pack a bucket into (a reused one, e.g.
    a persistent IPC buffer); by default a fresh one on `device`. The stream must carry every source the plan names,
    each once; extra tensors are ignored."""

    def __init__(self, plan: PushPlan, sender: int, device: torch.device | str,
                 buffer: Callable[[PlannedBucket], torch.Tensor] | None = None) -> None:
        self.plan = plan
        self.device = torch.device(device)
        self._prog = _program(plan, sender)
        self._buffer = buffer or (lambda b: torch.empty(b.nbytes, dtype=torch.uint8, device=self.device))

    def pack(self, named_tensors: Iterable[tuple[str, Any]]) -> Iterator[Bucket]:
        prog, n = self._prog, len(self._prog.buckets)
        uses_of, device = prog.uses, self.device
        remaining = list(prog.counts)
        buffers: dict[int, torch.Tensor] = {}
        # a bucket's sources by slot, copied together once it is complete (one fused call, not one per op)
        sources: list[list[Any]] = [[None] * c for c in prog.counts]
        seen: set[str] = set()
        emitted = 0

        def emit(pos: int) -> Bucket:
            buf = buffers.pop(pos)  # (taken when its first source arrived: every bucket has one, build_plan)
            typed: dict[str, tuple[torch.Tensor, int]] = {}  # the buffer viewed in each dtype, and its storage offset
            for dtype in prog.dtypes[pos]:
                dt = dtype_from_name(dtype)
                t = buf[: buf.numel() - buf.numel() % dt.itemsize].view(dt)
                # (as_strided's offset is the storage's: a buffer may be a window of a larger one, whole_arena)
                typed[dtype] = (t, t.storage_offset())
            for dtype, shape, stride, at, value in prog.fills[pos]:
                t, base = typed[dtype]
                t.as_strided(shape, stride, base + at).fill_(value)
            dst = [typed[d][0].as_strided(shape, stride, typed[d][1] + at) for d, shape, stride, at in prog.copies[pos]]
            torch._foreach_copy_(dst, sources[pos])
            sources[pos] = []
            return Bucket(buffer=buf, metas=list(prog.metas[pos]), rank=prog.buckets[pos].rank)

        for name, tensor in named_tensors:
            uses = uses_of.get(name)
            if uses is None:  # (a tensor no engine parameter takes)
                continue
            if name in seen:
                raise PlanError(f"the export yielded {name} twice")
            seen.add(name)
            src = tensor if isinstance(tensor, torch.Tensor) else torch.as_tensor(tensor)
            if src.device != device or not src.is_contiguous():
                src = src.to(device, non_blocking=True).contiguous()
            shape, stride = tuple(src.shape), src.stride()
            for pos, slot, op in uses:
                if pos not in buffers:  # (the buffer is taken when the bucket's first source arrives)
                    buffers[pos] = self._buffer(prog.buckets[pos])
                sv = op.src_view
                whole = sv.offset == 0 and sv.shape == shape and sv.stride == stride  # type: ignore[union-attr]
                sources[pos][slot] = src if whole else sv.of(src)  # type: ignore[union-attr]
                remaining[pos] -= 1
            while emitted < n and remaining[emitted] == 0:
                yield emit(emitted)
                emitted += 1
        if emitted < n:
            missing = sorted({name for name, uses in uses_of.items() if name not in seen})
            raise PlanError(f"the export ended without {len(missing)} tensors the plan needs, e.g. {missing[:3]}")

    def max_open(self) -> int:
        """The most buckets open at once when the export arrives in manifest order (how many
        buffers a reused pool needs besides the ones in flight)."""
        remaining, opened = list(self._prog.counts), set()
        emitted, most = 0, 0
        for entry in self.plan.manifest:
            for pos, *_ in self._prog.uses.get(entry.name, ()):
                opened.add(pos)
                remaining[pos] -= 1
            most = max(most, len(opened))
            while emitted < len(remaining) and remaining[emitted] == 0:
                opened.discard(emitted)
                emitted += 1
        return max(1, most)


def pack_stream(named_tensors: Iterable[tuple[str, Any]], bucket_mb: float, device: torch.device, *,
                plan: PushPlan | None = None, sender: int = 0, alloc: Callable[[int], torch.Tensor] | None = None,
                planned_buffer: Callable[[PlannedBucket], torch.Tensor] | None = None) -> Iterator[Bucket]:
    """The sender's buckets on `device`: HF tensors as they come (`iter_buckets`), or with a push `plan` this
    sender's in the engines' layout. `alloc(nbytes)`: reused buffers (ipc); `planned_buffer(planned bucket)`:
    a planned bucket's buffer (`whole_arena`)."""
    if plan is None:
        return iter_buckets(named_tensors, bucket_mb, device=device, alloc=alloc)
    buffer = planned_buffer or (None if alloc is None else (lambda b: alloc(b.nbytes)))
    return PlannedPacker(plan, sender, device, buffer).pack(named_tensors)


def plan_misfit(plan: PushPlan, layouts: Sequence[EngineLayout]) -> str:
    """Why engine ranks of `layouts` (each probed on `plan.manifest`) cannot take `plan`'s buckets, or ""."""
    for mine in layouts:
        theirs = [lay for lay in plan.layouts if lay.rank == mine.rank]
        if mine.problem or len(theirs) != 1 or not same_ops(mine, theirs[0]):
            return f"engine rank {mine.rank}: {mine.problem or 'its parameter layout differs from plan ' + plan.plan_id}"
    return ""


def hf_from_engine(plan: PushPlan, buckets: Iterable[Bucket]) -> dict[str, torch.Tensor]:
    """The HF tensors rebuilt from engine-layout buckets of `plan` (each source element from any copy of it): host
    tensors in the manifest's dtypes. Raises PlanError if some source was never copied anywhere."""
    out = {e.name: torch.empty(e.shape, dtype=dtype_from_name(e.dtype)) for e in plan.manifest}
    by_key = {(b.rank, tuple(m.name for m in b.metas())): b for b in plan.buckets}
    seen: set[str] = set()
    for bucket in buckets:
        b = by_key.get((bucket.rank, tuple(bucket.names)))
        if b is None:
            raise PlanError(f"a bucket of rank {bucket.rank} starting with {bucket.names[:1]} is not in plan {plan.plan_id}")
        views = dict(unpack_bucket(bucket))  # (on its device: each copy lands in a host tensor)
        for p, _ in b.params:
            for op in (op for op in p.ops if op.src is not None):
                op.src_view.of(out[op.src]).copy_(op.dst.of(views[p.name]))  # type: ignore[union-attr]
                seen.add(op.src)
    missing = [e.name for e in plan.manifest if e.name not in seen]
    if missing:
        raise PlanError(f"{len(missing)} exported tensors are not in any engine parameter, e.g. {missing[:3]}")
    return out
