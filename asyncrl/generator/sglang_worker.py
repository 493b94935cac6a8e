"""The SGLang replica's weight worker: weightsync's verbs (worker_verbs.py) in the replica's own process.

Owns: `SglangHooks` (weightsync's `EngineHooks` where the model lives in SGLang's scheduler processes: pushes arrive
in Hugging Face layout and the apply is SGLang's `update_weights_from_tensor`) and `SglangWorker` (the verbs, run by
the driver in a thread of the replica's process; the version ledger's count query among them).
How: SGLang has no hook to verify inside its processes, so the whole version is staged on this replica's device,
its fingerprint checked, and only then handed over (one device copy of the version more than vLLM's direct apply).
Must never: import SGLang at module import time (the driver's start does), or hand SGLang a tensor whose digest was
not checked (the receiver's apply runs only after the commit's fingerprint check).
Details: docs/design/generator.md, "The SGLang weight worker".
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from asyncrl.types import ApplyReport
from asyncrl.weightsync.plan import ManifestEntry
from asyncrl.weightsync.worker_verbs import WorkerVerbs

NO_DIRECT = ("SGLang's parameters live in its scheduler processes: a push is staged and verified in the replica's "
             "process, then handed to SGLang's load_weights (update_weights_from_tensor)")


class SglangHooks:
    """`EngineHooks` for the SGLang replica's own process. `call(coro, timeout)` runs a coroutine on the
    replica's event loop from the worker's thread and returns its result (the driver's `on_loop`)."""

    rank = 0

    def __init__(self, tm: Any, tp_size: int, call: Callable[..., Any], timeout_s: float = 600.0) -> None:
        self.tm, self.tp_size, self.call, self.timeout_s = tm, tp_size, call, timeout_s
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.version: int | None = None  # the version being applied (SGLang's own label for it)

    def model(self) -> None:
        return None  # (in SGLang's scheduler processes)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
        raise RuntimeError(NO_DIRECT)

    def direct_problem(self, model: Any) -> str:
        return NO_DIRECT

    def checkpoint(self) -> tuple[list[ManifestEntry], Callable[[str], torch.Tensor]] | None:
        return None

    def reload(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Hand the verified tensors to SGLang: one CUDA-IPC payload (every TP rank takes the whole HF
        tensors and shards them in its loader), the prefix cache left alone (SGLang asserts when it is
        flushed with requests parked; the driver salts the cache by version instead)."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
        named = own_storages([(name, tensor) for name, tensor in weights])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the staged copies are complete before another process reads them
        payload = MultiprocessingSerializer.serialize(named)
        label = None if self.version is None else str(self.version)
        request = UpdateWeightsFromTensorReqInput(serialized_named_tensors=[payload] * self.tp_size, load_format=None,
                                                  flush_cache=False, weight_version=label)
        ok, message = self.call(self.tm.update_weights_from_tensor(request, None), self.timeout_s)
        if not ok:
            raise RuntimeError(f"SGLang refused the weights: {message}")


def received_from_another_process(storage: torch.UntypedStorage) -> bool:
    """True for a CUDA storage this process opened from another process's IPC handle (an ipc push's views
    of the sender's ring), which torch refuses to share on: the test is torch's own, asking it for a
    handle (what SGLang's serializer does next for every storage it sends)."""
    if storage.device.type != "cuda":
        return False
    try:
        storage._share_cuda_()
    except RuntimeError as err:
        if "received from another process" in str(err):
            return True
        raise
    return False


def own_storages(named: list[tuple[str, torch.Tensor]],
                 foreign: Callable[[torch.UntypedStorage], bool] = received_from_another_process
                 ) -> list[tuple[str, torch.Tensor]]:
    """`named` with every tensor on a `foreign` storage moved onto a copy of that storage in this process's
    own memory: one device copy per storage (an ipc bucket's views share one), the views rebuilt over it at
    their offsets, shapes and strides. SGLang takes the tensors over CUDA IPC, and torch does not hand on
    what it received ("Attempted to send CUDA tensor received from another process").
    The copy lives until SGLang has loaded it (the caller's payload holds it)."""
    copies: dict[tuple[str, int], torch.UntypedStorage | None] = {}
    out = []
    for name, t in named:
        storage = t.untyped_storage()
        key = (str(storage.device), storage.data_ptr())
        if key not in copies:
            copies[key] = None
            if foreign(storage):
                whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
                copies[key] = whole.clone().untyped_storage()
        own = copies[key]
        if own is not None:
            t = torch.empty(0, dtype=t.dtype, device=t.device).set_(own, t.storage_offset(), t.size(), t.stride())
        out.append((name, t))
    return out


class SglangWorker(WorkerVerbs):
    """weightsync's worker verbs for an SGLang replica (rank 0 of one engine: SGLang's TP ranks each take
    the whole tensors)."""

    rank = 0
    _asyncrl_hf_on_device = True  # (SGLang takes the staged tensors over CUDA IPC; host ones would be copied again)

    def __init__(self, hooks: SglangHooks, counts: Callable[[], dict[str, int]]) -> None:
        self._hooks = hooks
        self._counts = counts
        self.device = hooks.device

    def _asyncrl_hooks(self) -> SglangHooks:
        return self._hooks

    def asyncrl_apply(self, version: int, before: str = "") -> ApplyReport:
        self._hooks.version = version
        return super().asyncrl_apply(version, before)

    def asyncrl_sampled_token_counts(self) -> dict[str, int]:
        """Output tokens per sequence (SGLang rid) as the replica's TokenizerManager holds them, read while
        paused and after a control round trip behind the pause (`counts`), so every token the scheduler made
        before it has arrived (the scheduler answers its calls in order, on the same path as its outputs)."""
        return self._counts()


def run_on(loop: asyncio.AbstractEventLoop) -> Callable[..., Any]:
    """`call(coro, timeout)`: run `coro` on `loop` from another thread and wait for its result."""

    def call(coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    return call
