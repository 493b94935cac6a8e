"""Moving a role's params, grads and optimizer state off the accelerator and back (hybrid mode).

Owns: the three moves, driven by a role's `RoleOffload` flags (`param_offload`, `grad_offload`,
`optimizer_offload`), and the device-memory numbers around them. Between calls a role keeps what
its flags say on the host; `onloaded()` brings it back for the duration of a compute call.

Grads of Megatron DDP live in its contiguous grad buffers (`param.main_grad` are views into
them), so those buffers' storage is freed (`resize_(0)`) and re-allocated zeroed on the way back,
the way verl and slime do it; grads are always zeroed before the next step, so nothing is lost.

On a CPU-only machine the host *is* the device: every move is a no-op and memory reads 0
(`offload/noop` = 1). Must never: run while a forward/backward is in flight, or change numerics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from asyncrl.config import RoleOffload


def device_memory_bytes() -> int:
    """Bytes allocated on the current accelerator (0 on CPU-only machines)."""
    return int(torch.cuda.memory_allocated()) if torch.cuda.is_available() else 0


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def offload_params(chunks: list[torch.nn.Module]) -> list[tuple[Any, Any]]:
    """Copy every accelerator-resident parameter storage to host and free it in place
    (`resize_(0)`), returning (storage, host copy) pairs for `reload_params`.

    In place, not `p.data = p.data.to("cpu")`: a tensor that views a parameter's storage (a
    tied head, a cached slice) keeps seeing the parameter after the round trip; re-pointing
    `p.data` left such views on the old memory, and an H100 run showed log-probs drifting by
    0.047 after two updates. Storages shared by several parameters move once."""
    saved, seen = [], set()
    for c in chunks:
        for p in c.parameters():
            storage = p.data.untyped_storage()
            if p.device.type == "cpu" or storage.size() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            saved.append((storage, storage.cpu()))
            storage.resize_(0)
    return saved


def reload_params(saved: list[tuple[Any, Any]]) -> None:
    for storage, host in saved:
        storage.resize_(host.size())
        storage.copy_(host)


def _grad_buffers(chunks: list[torch.nn.Module]) -> list[Any]:
    bufs = []
    for c in chunks:
        for attr in ("buffers", "expert_parallel_buffers"):
            value = getattr(c, attr, None)
            if isinstance(value, (list, tuple)):  # Megatron DDP's grad buffers; nn.Module.buffers is a method
                bufs += list(value)
    return bufs


def free_grads(chunks: list[torch.nn.Module]) -> None:
    for buf in _grad_buffers(chunks):
        if buf.grad_data.device.type != "cpu" and buf.grad_data.untyped_storage().size() > 0:
            buf._asyncrl_grad_bytes = buf.grad_data.untyped_storage().size()
            buf.grad_data.untyped_storage().resize_(0)


def restore_grads(chunks: list[torch.nn.Module]) -> None:
    for buf in _grad_buffers(chunks):
        size = getattr(buf, "_asyncrl_grad_bytes", 0)
        if size and buf.grad_data.untyped_storage().size() == 0:
            buf.grad_data.untyped_storage().resize_(size)
            buf.grad_data.zero_()


def move_optimizer_state(optimizer: Any, device: torch.device, model_params: set[int] | None = None) -> None:
    """Move the optimizer's state (Adam moments) and the parameters it steps when they are its own
    fp32 master copies (mixed precision); the model's own parameters (ids in `model_params`) stay
    where they are: moving those is `param_offload`'s job."""
    keep = model_params or set()
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    for o in opts:
        inner = getattr(o, "optimizer", None)
        if inner is None:
            continue
        for state in inner.state.values():
            for k, v in state.items():
                if torch.is_tensor(v) and v.device != device:
                    state[k] = v.to(device, non_blocking=True)
        for group in inner.param_groups:
            for p in group["params"]:
                if id(p) not in keep and p.device != device:
                    p.data = p.data.to(device, non_blocking=True)


class Offloader:
    """Applies one role's offload flags; a no-op when every flag is off or there is no accelerator."""

    def __init__(self, chunks: list[torch.nn.Module], optimizer: Any, flags: RoleOffload) -> None:
        self.chunks, self.optimizer, self.flags = chunks, optimizer, flags
        self._model_params = {id(p) for c in chunks for p in c.parameters()}
        self._params_host: list[tuple[Any, Any]] = []  # param storages freed on the device, with their host copies
        self.enabled = flags.param_offload or flags.grad_offload or flags.optimizer_offload
        self.offloaded = False
        self.last_report: dict[str, float] = {}

    def offload(self) -> dict[str, float]:
        before = device_memory_bytes()
        cpu = torch.device("cpu")
        if self.flags.param_offload and not self._params_host:
            self._params_host = offload_params(self.chunks)
        if self.flags.grad_offload:
            free_grads(self.chunks)
        if self.flags.optimizer_offload and self.optimizer is not None:
            move_optimizer_state(self.optimizer, cpu, self._model_params)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        self.offloaded = True
        return self._report("offload", before)

    def reload(self) -> dict[str, float]:
        before = device_memory_bytes()
        dev = _device()
        if self._params_host:
            reload_params(self._params_host)
            self._params_host = []
        if self.flags.grad_offload:
            restore_grads(self.chunks)
        if self.flags.optimizer_offload and self.optimizer is not None:
            move_optimizer_state(self.optimizer, dev, self._model_params)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.offloaded = False
        return self._report("reload", before)

    def _report(self, what: str, before: int) -> dict[str, float]:
        self.last_report = {
            f"learner/{what}_mem_before_bytes": float(before),
            f"learner/{what}_mem_after_bytes": float(device_memory_bytes()),
            "learner/offload_noop": 0.0 if torch.cuda.is_available() else 1.0,
        }
        return self.last_report

    @contextlib.contextmanager
    def onloaded(self) -> Iterator[None]:
        """Bring offloaded state back for a compute call, and put it away again after."""
        if not self.enabled:
            yield
            return
        self.reload()
        try:
            yield
        finally:
            self.offload()
