"""The receiving half of a push inside one worker that holds weights: its staged update (`WorkerReceiver`) and its
verbs (`WorkerVerbs`), apart from any engine. vLLM's workers mix the verbs in (generator/worker_ext.py); the SGLang
replica holds one in its own process (generator/sglang_engine.py) and hands the verified tensors to SGLang.

Owns: layout, plan, begin / stage / receive / apply / abort, collective groups, kept buffers. Digests are computed as
tensors are staged; the apply copies engine-layout buckets (plan.py) into the live parameters in one fused copy,
keeping every address (where `check_layout` proved the loaders pure copies), or reloads HF tensors through the engine.
Every bucket is kept until the commit. Details: docs/design/weightsync.md, "The worker's receiver".
Must never: import an engine (vLLM's worker never imports SGLang, nor the reverse), change what the engine serves
before the commit or outside a pause, apply a tensor whose digest differs, or touch the version label."""

from __future__ import annotations

import contextlib
import pickle
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import torch

from asyncrl.types import ApplyReport, LayoutCheck, ReceiveReport
from asyncrl.weightsync.bucket import Bucket, digest_key_prefix, metas_from_wire, unpack_bucket
from asyncrl.weightsync.fingerprint import PendingDigests, buckets_digests_lazy
from asyncrl.weightsync.ipc import ipc_open
from asyncrl.weightsync.plan import EngineLayout, ManifestEntry, probe_layout, same_ops, verify_layout
from asyncrl.weightsync.shm import SharedBucket


class EngineHooks(Protocol):
    """What the receiver needs from the engine worker it runs in."""

    rank: int
    device: torch.device

    def model(self) -> torch.nn.Module | None:
        """The model in this process; None where it lives in another (SGLang's scheduler): pushes then arrive in
        HF layout for `reload`, and `direct_problem(None)` says why."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
        """The model's own `load_weights` (probed on meta tensors by plan.py)."""

    def reload(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """The engine's own in-place reload of HF tensors (post-load hooks included)."""

    def direct_problem(self, model: torch.nn.Module) -> str:
        """'' if a plain copy into the parameters is a correct apply for this engine, else why not."""

    def checkpoint(self) -> tuple[list[ManifestEntry], Callable[[str], torch.Tensor]] | None:
        """The checkpoint the engine loaded at start (its manifest and a reader), or None."""


@dataclass
class _Staged:
    version: int
    verify: str
    layout: str  # "engine" or "hf"
    digests: dict[str, bytes] = field(default_factory=dict)
    views: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # every staged tensor (each holds its buffer)
    pending: list[PendingDigests] = field(default_factory=list)  # lazy digests still on the device (`digests` waits once)
    batch: list[tuple[Bucket, str]] = field(default_factory=list)  # buckets hashed together at `digests`


class WorkerReceiver:
    """One engine worker's weight-update state, all of it: its checked layout, the plan, what is staged, the
    collective groups it holds and the ipc senders' buffers it has open; `hooks` is the engine."""

    def __init__(self, hooks: EngineHooks) -> None:
        self.hooks = hooks
        self.groups: dict[str, Any] = {}  # group id -> `CollectiveGroup` (weightsync/collective.py)
        self.opened: dict[bytes, tuple[Any, Bucket, list]] = {}  # ipc: a handle -> (its table, its view, its tensors)
        self.verified: EngineLayout | None = None  # the start-time layout, checked against the checkpoint
        self.checked = LayoutCheck(rank=hooks.rank, direct=False, problem="layout not checked yet")  # the start-time check
        self.plan_id: str | None = None
        self._live: dict[str, torch.Tensor] | None = None
        self._staged: _Staged | None = None

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
        self.checked = LayoutCheck(rank=self.hooks.rank, direct=not problem, problem=problem,
                                   seconds=time.perf_counter() - t, params=len(layout.params) if layout else 0)
        return self.checked

    def layout_for(self, manifest: list[ManifestEntry]) -> EngineLayout:
        """This worker's layout for the learner's export `manifest`; its `problem` says why a
        direct copy is not possible (then the push goes in HF layout through `reload`)."""
        model = self.hooks.model()
        if model is None:
            return EngineLayout(self.hooks.rank, (), self.hooks.direct_problem(None))
        layout = probe_layout(model, manifest, self.hooks.rank, self.hooks.load_weights)
        if layout.problem or self.checked.problem:  # (a check without a problem verified a layout)
            return EngineLayout(layout.rank, layout.params, layout.problem or self.checked.problem)
        if not same_ops(layout, self.verified):
            return EngineLayout(layout.rank, layout.params, "the learner's export fills the engine parameters differently "
                                "from the checkpoint the engine was checked against")
        return layout

    def begin(self, version: int, verify: str = "full", layout: str = "hf", plan_id: str | None = None) -> None:
        """Start staging `version`; engine-layout buckets are of push plan `plan_id` (its replica checked that this
        worker's layout is the plan's), applied by a copy into the live parameters. The replica checked the modes."""
        if layout == "engine" and not plan_id:
            raise ValueError("engine-layout buckets without the push plan they were packed for")
        if layout == "engine" and plan_id != self.plan_id:  # another plan's buckets: read the parameters again
            self.plan_id, self._live = plan_id, dict(self.hooks.model().named_parameters())
        self._staged = _Staged(version, verify, layout)

    def _state(self, version: int) -> _Staged:
        staged = self._staged
        if staged is None or staged.version != version:
            raise RuntimeError(f"bucket for version {version} but staging {None if staged is None else staged.version}")
        return staged

    def stage(self, version: int, bucket: Bucket, batch: bool = False,
              views: list[tuple[str, torch.Tensor]] | None = None) -> None:
        """Stage one bucket (views into `bucket.buffer`) and its digests, a device's only enqueued (`digests` waits for
        all at once). `batch` (buckets that arrive together, views of one ipc mapping): not even enqueued until
        `digests`, which hashes them all in one pass. `views`: the bucket's tensors, unpacked before (an ipc buffer)."""
        staged = self._state(version)
        if (bucket.rank is None) != (staged.layout == "hf"):
            raise ValueError(f"a {'HF' if bucket.rank is None else 'engine'}-layout bucket in a {staged.layout}-layout update")
        if bucket.rank is not None and bucket.rank != self.hooks.rank:
            return
        prefix = digest_key_prefix(bucket)
        keys = {prefix + m.name for m in bucket.metas}
        dup = sorted(k for k in keys if k in staged.digests)
        if len(keys) != len(bucket.metas) or dup:
            raise ValueError(f"tensor {dup[0] if dup else '?'!r} staged twice for version {version}")
        if batch:
            staged.batch.append((bucket, prefix))
        else:
            staged.pending.append(buckets_digests_lazy([(bucket, prefix)], staged.verify))  # type: ignore[arg-type]
        staged.digests.update(dict.fromkeys(keys, b""))  # resolved by `digests`
        staged.views.extend(unpack_bucket(bucket) if views is None else views)

    def digests(self, version: int) -> dict[str, bytes]:
        staged = self._state(version)
        if staged.batch:
            staged.pending.append(buckets_digests_lazy(staged.batch, staged.verify))  # type: ignore[arg-type]
            staged.batch = []
        if staged.pending:  # (checksums all still on the device reach the host in one copy)
            staged.digests.update(PendingDigests.merge(staged.pending)())
            staged.pending.clear()
        return dict(staged.digests)

    def _copy_into_live(self, views: Iterable[tuple[str, torch.Tensor]]) -> None:
        live = self._live  # (taken by the engine-layout begin, which needs a plan)
        dst, src = [], []
        # (vLLM's parameter classes take every attribute read through their `__torch_function__`: not here)
        with torch._C.DisableTorchFunctionSubclass():
            for name, view in views:
                target = live.get(name)
                if target is None:
                    raise KeyError(f"engine parameter {name!r} of the plan is not in the engine")
                if target.shape != view.shape or target.dtype != view.dtype:
                    raise ValueError(f"{name}: staged {tuple(view.shape)} {view.dtype}, live {tuple(target.shape)} {target.dtype}")
                dst.append(target.data)  # (the parameter as it is now: a later `param.data = ...` is followed)
                src.append(view if view.device == target.device else view.to(target.device, non_blocking=True))
        if dst:
            with torch.no_grad():
                torch._foreach_copy_(dst, src)

    def apply(self, version: int) -> ApplyReport:
        """Apply what is staged for `version` (the caller verified the fingerprint and paused the
        engine). Returns the apply path and its seconds. The staged copy is spent either way."""
        staged = self._state(version)
        t = time.perf_counter()
        try:
            if staged.pending or staged.batch:
                raise RuntimeError(f"apply of version {version} before its staged digests were read (and checked)")
            if staged.layout == "engine":
                self._copy_into_live(staged.views)
                if self.hooks.device.type == "cuda":
                    torch.cuda.synchronize(self.hooks.device)
                path = "direct"
            else:
                self.hooks.reload(iter(sorted(staged.views, key=lambda kv: kv[0])))
                path = "reload"
            return ApplyReport(path=path, apply_seconds=time.perf_counter() - t, tensors=len(staged.digests))
        finally:
            self._staged = None

    def abort(self) -> None:
        self._staged = None


class WorkerVerbs:
    """The `asyncrl_*` verbs of one worker that holds weights (the prefix: never a clash with the worker's own), over
    its one `WorkerReceiver`. A subclass gives the engine (`_asyncrl_hooks`), `rank` and, off the CPU, `device`.
    What each verb takes and answers: `asyncrl.interfaces.WorkerAPI` (plain arguments: vLLM's RPC is msgpack)."""

    # HF buckets of a shared file go to the device (SGLang takes them over CUDA IPC); vLLM's loaders read host ones
    _asyncrl_hf_on_device = False

    def _asyncrl_hooks(self) -> EngineHooks:
        raise NotImplementedError

    def _asyncrl_rx(self) -> WorkerReceiver:
        rx = self.__dict__.get("_asyncrl_receiver")
        if rx is None:
            rx = self.__dict__["_asyncrl_receiver"] = WorkerReceiver(self._asyncrl_hooks())
        return rx

    # ---- layout and plan ------------------------------------------------------------------------
    def asyncrl_layout(self, manifest: bytes | None = None) -> LayoutCheck:
        from asyncrl.weightsync.collective import warm_push_kernels

        rx = self._asyncrl_rx()
        warm_push_kernels(rx.hooks.device)  # (before any push, as a group member does at its join; ipc joins none)
        if manifest is None:
            return rx.check_layout()
        layout = pickle.dumps(rx.layout_for(pickle.loads(manifest)), protocol=pickle.HIGHEST_PROTOCOL)
        return msgspec.structs.replace(rx.checked, layout=layout)

    # ---- one update -----------------------------------------------------------------------------
    def asyncrl_receive(self, version: int, wires: list[tuple] | None, groups: list[str] | None = None,
                        timeout_s: float = 0.0, gate: str = "", begin: list[Any] | None = None) -> ReceiveReport:
        """Every bucket of `groups` is received in order within `timeout_s`; a worker that cannot take the push
        closes the broadcast's `gate` on every group."""
        rx = self._asyncrl_rx()
        if groups is None:
            rx.begin(version, *(begin or []))
            now: dict[bytes, tuple[Any, Bucket, list]] = {}
            for wire in wires or []:
                if isinstance(wire[0], bytes):  # views of the sender's ring, hashed in one pass at the end
                    kept = rx.opened.get(wire[0])  # (the same view with the same table: the same bucket and views)
                    if kept is None or kept[0] != wire[1:]:
                        bucket = ipc_open(wire[0], metas_from_wire(wire[1]), wire[2])
                        kept = (wire[1:], bucket, unpack_bucket(bucket))
                    now[wire[0]] = kept
                    rx.stage(version, kept[1], batch=True, views=kept[2])
                else:
                    rx.stage(version, self._asyncrl_open(wire))
            rx.opened = now  # (one push's: an older ring's mapping goes)
            return ReceiveReport(digests=rx.digests(version))
        from asyncrl.weightsync.collective import CollectiveError
        from asyncrl.weightsync.stream import broadcast_receive_stream

        deadline = time.monotonic() + timeout_s
        try:  # one that cannot take the push refuses it: its other members must not wait for this worker
            rx.begin(version, *(begin or []))
            missing = [gid for gid in groups if gid not in rx.groups or rx.groups[gid].broken]
            if missing:
                raise CollectiveError(f"worker holds no usable group {missing[0]!r} (has {sorted(rx.groups)})")
        except (ValueError, CollectiveError) as err:
            self.asyncrl_abort_update(groups, f"{type(err).__name__}: {err}", gate)
            raise
        if gate:  # ready on every group at once; each group's decision is awaited when its turn comes (a
            for gid in groups:  # later PP stage may only start sending once an earlier one is done)
                rx.groups[gid].arrive(gate)
        for gid in groups:
            group = rx.groups[gid]
            if gate:
                group.await_gate(gate, deadline)
            for bucket in broadcast_receive_stream(group, deadline):
                rx.stage(version, bucket)  # one wait for every digest, below
        return ReceiveReport(digests=rx.digests(version))

    def _asyncrl_open(self, wire: tuple) -> Bucket:
        """The bucket of a shared file's `wire` (mapped copy-on-write), where the parameters live: HF tensors stay
        on the host for the engine's loaders unless the engine takes them on its device."""
        path, metas, rank = wire
        bucket, device = SharedBucket.from_wire(path, metas, rank).open(), self._asyncrl_rx().hooks.device
        if device.type == "cpu" or (rank is None and not self._asyncrl_hf_on_device):
            return bucket
        # one copy into this worker's own device memory: the staged views outlive the file's mapping
        return Bucket(buffer=torch.from_numpy(bucket.buffer).to(device), metas=list(bucket.metas), rank=rank)

    def asyncrl_apply(self, version: int, before: str = "") -> ApplyReport:
        if before and (not before.startswith("asyncrl_") or before.startswith("asyncrl_apply")):
            raise ValueError(f"{before!r} is not a worker query to run before an apply")
        first = [getattr(self, before)()] if before else []
        return msgspec.structs.replace(self._asyncrl_rx().apply(version), before=first)

    def asyncrl_abort_update(self, group_ids: list[str] | None = None, why: str = "", gate: str = "") -> None:
        rx = self._asyncrl_rx()
        rx.abort()
        for gid in group_ids or []:  # refused, best effort: every member at the gate `gate` stops at once
            group = rx.groups.get(gid)
            if group is not None and not group.broken and gate:
                with contextlib.suppress(Exception):  # a group whose store is gone has nobody waiting
                    group.close_gate(gate, why)

    # ---- collective groups (weightsync/collective.py) ---------------------------------------------
    def asyncrl_join_collective(self, replica_id: str, specs: list[dict[str, Any]] | None = None) -> list[str]:
        """Leave every earlier group, then join those of `specs` (one per sending learner rank, in sender order)."""
        from asyncrl.weightsync.collective import CollectiveGroup, GroupSpec

        rx = self._asyncrl_rx()
        if specs is None:
            return [gid for gid, g in rx.groups.items() if not g.broken]
        for group in rx.groups.values():
            group.close()
        rx.groups = {}
        parsed = [GroupSpec(**raw) for raw in specs]
        mine = int(self.rank)  # type: ignore[attr-defined]
        try:
            for spec in parsed:
                rx.groups[spec.group_id] = CollectiveGroup.join(spec, spec.receiver_rank(replica_id, mine),
                                                                getattr(self, "device", None))
        except BaseException:  # all or none
            for group in rx.groups.values():
                group.close()
            rx.groups = {}
            raise
        return [s.group_id for s in parsed]
