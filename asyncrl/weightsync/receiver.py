"""The receiving half of a push, inside one engine worker: stage, verify, apply.

Owns: one worker's staged update (`WorkerReceiver`): one version's buckets as they arrive, each tensor's digest
computed as it is staged, and the apply: engine-layout buckets (plan.py) by one fused copy into the live parameters,
keeping every address (captured CUDA graphs stay valid; only where `check_layout` proved the loaders are pure copies),
Hugging Face tensors by the engine's own `reload`. Staging `full` keeps every bucket until the commit; `bucketed`
applies each once it verified against the sender's digests. The engine is reached through `EngineHooks`.
Must never: change what the engine serves before the commit (full staging) or outside a pause (bucketed staging:
the caller pauses first), or apply a staged tensor whose digest differs.
Details: docs/design/weightsync.md, "The worker's receiver".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from asyncrl.types import ApplyReport, LayoutCheck
from asyncrl.weightsync.bucket import Bucket, digest_key_prefix, dtype_from_name, unpack_bucket
from asyncrl.weightsync.fingerprint import PendingDigests, bucket_digests, bucket_digests_lazy, buckets_digests_lazy, check_verify_mode
from asyncrl.weightsync.plan import EngineLayout, ManifestEntry, PlanError, PushPlan, probe_layout, same_ops, verify_layout
from asyncrl.weightsync.shards import plan_layout

STAGING_MODES = ("full", "bucketed")


class EngineHooks(Protocol):
    """What the receiver needs from the engine worker it runs in."""

    rank: int
    device: torch.device

    def model(self) -> torch.nn.Module | None:
        """The engine's model in this process; None where it lives in another (SGLang's scheduler): pushes then
        arrive in Hugging Face layout and `reload` hands them over, and `direct_problem(None)` says why."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
        """The model's own `load_weights` (probed on meta tensors by plan.py)."""

    def reload(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """The engine's own in-place reload of HF tensors (post-load hooks included)."""

    def direct_problem(self, model: torch.nn.Module) -> str:
        """'' if a plain copy into the parameters is a correct apply for this engine, else why not."""

    def checkpoint(self) -> tuple[list[ManifestEntry], Callable[[str], torch.Tensor]] | None:
        """The checkpoint the engine loaded at start (its manifest and a reader), or None."""


@dataclass
class _Kept:
    """What a receiver derives from a bucket that its transport hands again at the next push (the same
    object: an ipc ring's record, a broadcast group's whole-version receive, `Bucket.reused`): its tensor
    views, its fingerprint keys and, once copied into the live parameters, both lists of that copy."""

    bucket: Bucket
    views: list[tuple[str, torch.Tensor]]
    keys: set[str]
    copy: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None


@dataclass
class _Staged:
    version: int
    verify: str
    staging: str
    layout: str  # "engine" or "hf"
    digests: dict[str, bytes] = field(default_factory=dict)
    hf: dict[str, torch.Tensor] = field(default_factory=dict)
    engine: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    keep: list[Any] = field(default_factory=list)  # buffers the staged views point into
    applied: int = 0  # bucketed: parameters already copied into the live weights
    pending: list[PendingDigests] = field(default_factory=list)  # lazy digests still on the device (`digests` waits once)
    batch: list[tuple[Bucket, str]] = field(default_factory=list)  # buckets hashed together at `digests`
    seen: dict[int, _Kept] = field(default_factory=dict)  # reused buckets (and batch), by id


class VerificationError(ValueError):
    """A staged bucket's digests differ from what the sender computed (nothing of it applied)."""


class WorkerReceiver:
    """One engine worker's receiving state; `hooks` is the engine."""

    def __init__(self, hooks: EngineHooks) -> None:
        self.hooks = hooks
        self.verified: EngineLayout | None = None  # the start-time layout, checked against the checkpoint
        self.direct_problem = "layout not checked yet"
        self.plan_id: str | None = None
        self._live: dict[str, torch.Tensor] | None = None
        self._staged: _Staged | None = None
        # A whole-version ipc push stages views of the sender's ring, which are the same bucket
        # objects while the ring is (ipc.py's record cache): their unpacked views, and the apply's
        # parameter lists built from them, are kept from one push to the next.
        # So are a broadcast group's whole-version buckets (stream.py): their views are kept the same way.
        self._views: dict[int, _Kept] = {}
        # (key, live parameters, sources); set_plan, the one place the live parameters change, drops it
        self._apply_lists: tuple[tuple[int, ...], list[torch.Tensor], list[torch.Tensor]] | None = None

    # ---- layout ---------------------------------------------------------------------------------

    def check_layout(self) -> LayoutCheck:
        """At engine start, before any push: read this worker's layout from the engine's loaders
        and check that it rebuilds the loaded parameters from the checkpoint bit for bit."""
        t = time.perf_counter()
        model = self.hooks.model()
        problem = self.hooks.direct_problem(model)
        checkpoint = None if problem or model is None else self.hooks.checkpoint()
        if not problem and checkpoint is None:
            problem = "the engine's checkpoint cannot be read back to check the layout (dummy weights?)"
        layout = None
        if not problem:
            manifest, read = checkpoint  # type: ignore[misc]
            layout = probe_layout(model, manifest, self.hooks.rank, self.hooks.load_weights)
            problem = verify_layout(layout, dict(model.named_parameters()), read)
        self.verified = layout if not problem else None
        self.direct_problem = problem
        return LayoutCheck(rank=self.hooks.rank, direct=not problem, problem=problem, seconds=time.perf_counter() - t,
                           params=len(layout.params) if layout else 0)

    def layout_for(self, manifest: list[ManifestEntry]) -> EngineLayout:
        """This worker's layout for the learner's export `manifest`; its `problem` says why a
        direct copy is not possible (then the push goes in HF layout through `reload`)."""
        model = self.hooks.model()
        if model is None:
            return EngineLayout(self.hooks.rank, (), self.hooks.direct_problem(None))
        layout = probe_layout(model, manifest, self.hooks.rank, self.hooks.load_weights)
        if layout.problem:
            return layout
        if self.direct_problem:
            return EngineLayout(layout.rank, layout.params, self.direct_problem)
        if self.verified is None or not same_ops(layout, self.verified):
            return EngineLayout(layout.rank, layout.params, "the learner's export fills the engine parameters differently "
                                "from the checkpoint the engine was checked against")
        return layout

    def set_plan(self, plan: PushPlan | None) -> None:
        """Engine-layout buckets of `plan` may be applied directly from now on (None: HF only).
        Refused (PlanError) unless this worker's own layout for the plan's manifest is the plan's."""
        self._views, self._apply_lists = {}, None
        if plan is None:
            self.plan_id, self._live = None, None
            return
        mine = self.layout_for(plan.probed_manifest)
        if mine.problem:
            raise PlanError(f"engine rank {self.hooks.rank}: {mine.problem}")
        mine = plan_layout(plan, mine)  # a shard plan's: read from the learner ranks' own pieces
        theirs = [lay for lay in plan.layouts if lay.rank == self.hooks.rank]
        if len(theirs) != 1 or not same_ops(mine, theirs[0]):
            raise PlanError(f"engine rank {self.hooks.rank}: its parameter layout differs from push plan {plan.plan_id}'s")
        self.plan_id = plan.plan_id
        self._live = dict(self.hooks.model().named_parameters())

    # ---- staging ---------------------------------------------------------------------------------

    def begin(self, version: int, verify: str = "full", staging: str = "full", layout: str = "hf") -> None:
        if staging not in STAGING_MODES:
            raise ValueError(f"staging mode {staging!r} is not one of {list(STAGING_MODES)}")
        if layout not in ("hf", "engine"):
            raise ValueError(f"layout {layout!r} is not 'hf' or 'engine'")
        if layout == "engine" and self.plan_id is None:
            raise ValueError("engine-layout buckets but this worker has no push plan (set_plan first)")
        self._staged = _Staged(version, check_verify_mode(verify), staging, layout)

    def _state(self, version: int) -> _Staged:
        staged = self._staged
        if staged is None or staged.version != version:
            raise RuntimeError(f"bucket for version {version} but staging {None if staged is None else staged.version}")
        return staged

    def stage(self, version: int, bucket: Bucket, expected: dict[str, bytes] | None = None,
              lazy: bool = False, batch: bool = False) -> dict[str, bytes]:
        """Stage one bucket (views into `bucket.buffer`, which must stay valid until the commit);
        returns its digests. Engine-layout buckets of other ranks are skipped. Bucketed staging
        applies it at once, after checking it against `expected` (the sender's digests). `lazy`
        (full staging): its digests are only enqueued on the device; `digests` waits for all of
        them at once, and this returns {}. `batch` (with `lazy`; buckets that arrive together, as
        views of one mapping on ipc): not even enqueued until `digests`, which reads them all in
        one pass."""
        staged = self._state(version)
        if (bucket.rank is None) != (staged.layout == "hf"):
            raise ValueError(f"a {'HF' if bucket.rank is None else 'engine'}-layout bucket in a {staged.layout}-layout update")
        if bucket.rank is not None and bucket.rank != self.hooks.rank:
            return {}
        prefix = digest_key_prefix(bucket)
        kept: _Kept | None = None
        if batch or bucket.reused:  # the same bucket as at the last push: what it gave then, again
            kept = self._views.get(id(bucket))
            if kept is None or kept.bucket is not bucket:
                kept = _Kept(bucket, unpack_bucket(bucket), {prefix + m.name for m in bucket.metas})
            staged.seen[id(bucket)] = kept
        keys = kept.keys if kept is not None else {prefix + m.name for m in bucket.metas}
        dup = sorted(k for k in keys if k in staged.digests)
        if len(keys) != len(bucket.metas) or dup:
            if kept is not None:
                staged.seen.pop(id(bucket), None)
            raise ValueError(f"tensor {dup[0] if dup else '?'!r} staged twice for version {version}")
        if lazy and staged.staging == "full":
            if batch:
                staged.batch.append((bucket, prefix))
            else:
                staged.pending.append(bucket_digests_lazy(bucket, staged.verify, prefix))  # type: ignore[arg-type]
            staged.digests.update(dict.fromkeys(keys, b""))  # resolved by `digests`
            digests: dict[str, bytes] = {}
        else:
            digests = bucket_digests(bucket, staged.verify, prefix)  # type: ignore[arg-type]
            if staged.staging == "bucketed":
                if expected is None:
                    raise ValueError("bucketed staging needs the sender's digests with every bucket")
                wrong = sorted(k for k, d in digests.items() if expected.get(k) != d)
                if wrong or set(expected) != set(digests):
                    raise VerificationError(f"fingerprint mismatch for version {version}: bucket tensors {wrong[:3]} "
                                            "differ from the sender's digests; nothing of this bucket applied")
            staged.digests.update(digests)
        views = kept.views if kept is not None else unpack_bucket(bucket)
        if staged.layout == "hf":
            staged.hf.update(views)
        else:
            staged.engine.extend(views)
        staged.keep.append(bucket.buffer)
        if staged.staging == "bucketed" and staged.layout == "engine":
            self._copy_into_live(views, kept=kept)
            staged.applied += len(views)
            staged.engine.clear()
            staged.keep.clear()
        return digests

    def digests(self, version: int) -> dict[str, bytes]:
        staged = self._state(version)
        if staged.batch:
            staged.pending.append(buckets_digests_lazy(staged.batch, staged.verify))  # type: ignore[arg-type]
            staged.batch = []
        if len(staged.pending) > 1 and all(p.device_words is not None for p in staged.pending):
            staged.pending = [PendingDigests.merge(staged.pending)]  # every bucket's checksums: one copy to host
        for finish in staged.pending:  # the first waits for the device, the rest are there by then
            staged.digests.update(finish())
        staged.pending.clear()
        return dict(staged.digests)

    # ---- apply -----------------------------------------------------------------------------------

    def _copy_into_live(self, views: Iterable[tuple[str, torch.Tensor]], key: tuple[int, ...] | None = None,
                        kept: _Kept | None = None) -> None:
        """Copy staged `views` into the live parameters, one fused copy. `key` (the staged
        buckets, when every one is the last push's): the checked lists are kept under it;
        `kept` (the views are this reused bucket's): they are kept with it."""
        live = self._live
        if live is None:
            raise RuntimeError("no push plan: engine-layout tensors cannot be applied")
        if kept is not None and kept.copy is not None:
            with torch.no_grad():
                torch._foreach_copy_(*kept.copy)
            return
        lists = self._apply_lists
        if kept is None and key is not None and lists is not None and lists[0] == key:
            with torch.no_grad():
                torch._foreach_copy_(lists[1], lists[2])
            return
        dst, src = [], []
        same_device = True
        for name, view in views:
            target = live.get(name)
            if target is None:
                raise KeyError(f"engine parameter {name!r} of the plan is not in the engine")
            if target.shape != view.shape or target.dtype != view.dtype:
                raise ValueError(f"{name}: staged {tuple(view.shape)} {view.dtype}, live {tuple(target.shape)} {target.dtype}")
            dst.append(target.data)
            same_device = same_device and view.device == target.device
            src.append(view if view.device == target.device else view.to(target.device, non_blocking=True))
        if dst:
            with torch.no_grad():
                torch._foreach_copy_(dst, src)
        # kept as the parameters themselves (a later `param.data = ...` is followed), never a temporary copy
        if kept is not None:
            kept.copy = ([live[name] for name, _ in views], src) if same_device and dst else None
            return
        self._apply_lists = (key, [live[name] for name, _ in views], src) \
            if key is not None and same_device and dst else None

    def apply(self, version: int) -> ApplyReport:
        """Apply what is staged for `version` (the caller verified the fingerprint and paused the
        engine). Returns the apply path and its seconds. The staged copy is spent either way."""
        staged = self._state(version)
        t = time.perf_counter()
        try:
            if staged.pending or staged.batch:
                raise RuntimeError(f"apply of version {version} before its staged digests were read (and checked)")
            if staged.layout == "engine":
                if staged.staging == "full":
                    # (ids of buckets alive until this push ends: equal keys are the same buckets)
                    whole = staged.seen and sum(len(k.views) for k in staged.seen.values()) == len(staged.engine)
                    key = tuple(staged.seen) if whole else None
                    self._copy_into_live(staged.engine, key)
                if self.hooks.device.type == "cuda":
                    torch.cuda.synchronize(self.hooks.device)
                path = "direct"
            else:
                self.hooks.reload(iter(sorted(staged.hf.items())))
                path = "reload"
            self._views = staged.seen  # the next push's record is most likely this one
            return ApplyReport(path=path, apply_seconds=time.perf_counter() - t, tensors=len(staged.digests))
        except BaseException:
            self._views, self._apply_lists = {}, None
            raise
        finally:
            self._staged = None

    def abort(self) -> None:
        self._staged = None
        self.release_views()

    def release_views(self) -> None:
        """Drop the views kept from the last push (its groups are gone: on ipc they map the old
        sender's buffers, which they would otherwise keep allocated until the next push)."""
        self._views, self._apply_lists = {}, None


def copy_to(bucket: Bucket, device: torch.device) -> Bucket:
    """`bucket` with its buffer in this worker's own memory on `device` (one copy), so that the
    staged views outlive the transport's buffer."""
    buffer = bucket.buffer
    if isinstance(buffer, torch.Tensor):
        own = torch.empty(buffer.numel(), dtype=torch.uint8, device=device)
        own.copy_(buffer.reshape(-1).view(torch.uint8), non_blocking=True)
    else:
        own = torch.from_numpy(buffer).to(device) if device.type != "cpu" else buffer
    return Bucket(buffer=own, metas=list(bucket.metas), rank=bucket.rank)


__all__ = ["EngineHooks", "STAGING_MODES", "VerificationError", "WorkerReceiver", "copy_to", "dtype_from_name"]
