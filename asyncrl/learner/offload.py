"""Moving a role's params, grads and optimizer state off the accelerator and back (hybrid mode).

Owns: the three moves, driven by a role's `RoleOffload` flags, and the device-memory numbers around them. Between
calls a role keeps what its flags say on the host; `onloaded()` brings it back for a compute call, a weight export
or a checkpoint, and `hold`/`release` keep it on the device across the hybrid loop's learner phase (counted, so
nested holders never move anything twice). DDP's grad buffers are freed and re-allocated zeroed on the way back
(grads are zeroed before the next step anyway). On a CPU-only machine every move is a no-op and memory reads 0.
Must never: run while a forward/backward is in flight, or change numerics.
Details: docs/design/learner.md, "Offload".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from asyncrl.config import RoleOffload
from asyncrl.weightsync.transport import PinnedPool


def device_memory_bytes() -> int:
    """Bytes allocated on the current accelerator (0 on CPU-only machines)."""
    return int(torch.cuda.memory_allocated()) if torch.cuda.is_available() else 0


def device_free_bytes() -> int:
    """Free memory of the current accelerator as the driver sees it (every process on it), 0 on CPU."""
    return int(torch.cuda.mem_get_info()[0]) if torch.cuda.is_available() else 0


def device_total_bytes() -> int:
    """Memory of the current accelerator in all (0 on CPU-only machines)."""
    return int(torch.cuda.mem_get_info()[1]) if torch.cuda.is_available() else 0


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def offload_params(chunks: list[torch.nn.Module], pool: PinnedPool | None = None) -> list[tuple[Any, Any]]:
    """Copy every accelerator-resident parameter storage to host and free it in place
    (`resize_(0)`), returning (storage, host copy) pairs for `reload_params`.

    In place, not `p.data = p.data.to("cpu")`: a tensor that views a parameter's storage (a
    tied head, a cached slice) keeps seeing the parameter after the round trip; re-pointing
    `p.data` left such views on the old memory, and log-probs drifted after two updates.
    Storages shared by several parameters move once. The host copies are pinned buffers, the k-th
    storage's the `pool`'s k-th from one offload to the next (as a push's host copies reuse theirs):
    a fresh pageable copy at every hybrid switch goes through the driver's staging buffer and faults
    every host page in again, several times slower than a copy into pinned memory. The copies are
    enqueued together and waited for once, before any storage is freed."""
    pool = PinnedPool() if pool is None else pool
    saved, seen = [], set()
    for c in chunks:
        for p in c.parameters():
            storage = p.data.untyped_storage()
            if p.device.type == "cpu" or storage.size() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            host = pool.get(len(saved), storage.nbytes())
            host.copy_(_as_bytes(storage), non_blocking=True)
            saved.append((storage, host))
    if saved:
        torch.cuda.current_stream().synchronize()
    for storage, _ in saved:
        storage.resize_(0)
    return saved


def reload_params(saved: list[tuple[Any, Any]]) -> None:
    """Back onto the device, in place; the copies are enqueued on the current stream (`Offloader._move` waits)."""
    for storage, host in saved:
        storage.resize_(host.numel())
        _as_bytes(storage).copy_(host, non_blocking=True)


def _as_bytes(storage: Any) -> torch.Tensor:
    """A uint8 tensor over the whole of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))


def _grad_buffers(chunks: list[torch.nn.Module]) -> list[Any]:
    bufs = []
    for c in chunks:
        for attr in ("buffers", "expert_parallel_buffers"):
            value = getattr(c, attr, None)
            if isinstance(value, (list, tuple)):  # Megatron DDP's grad buffers; nn.Module.buffers is a method
                bufs += list(value)
    return bufs


def free_grads(chunks: list[torch.nn.Module]) -> int:
    """Free DDP's grad buffers on the device; the bytes freed."""
    freed = 0
    for buf in _grad_buffers(chunks):
        if buf.grad_data.device.type != "cpu" and buf.grad_data.untyped_storage().size() > 0:
            buf._asyncrl_grad_bytes = buf.grad_data.untyped_storage().size()
            freed += buf._asyncrl_grad_bytes
            buf.grad_data.untyped_storage().resize_(0)
    return freed


def restore_grads(chunks: list[torch.nn.Module]) -> None:
    for buf in _grad_buffers(chunks):
        size = getattr(buf, "_asyncrl_grad_bytes", 0)
        if size and buf.grad_data.untyped_storage().size() == 0:
            buf.grad_data.untyped_storage().resize_(size)
            buf.grad_data.zero_()


def move_optimizer_state(optimizer: Any, device: torch.device, model_params: set[int] | None = None,
                         limit_bytes: int | None = None) -> int:
    """Move the optimizer's state (Adam moments) and the parameters it steps when they are its own
    fp32 master copies (mixed precision); the model's own parameters (ids in `model_params`) stay
    where they are: moving those is `param_offload`'s job. With `limit_bytes`, one parameter's state
    (and master copy) at a time until at least that many bytes have moved (the rest stay). The bytes moved."""
    keep = model_params or set()
    moved = 0
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    for o in opts:
        inner = getattr(o, "optimizer", None)
        if inner is None or type(inner).__name__ == "HybridDeviceOptimizer":
            continue  # none, or learner.memory.optimizer host: its state lives on the host already
        for group in inner.param_groups:
            for p in group["params"]:
                if limit_bytes is not None and moved >= limit_bytes:
                    return moved
                state = inner.state.get(p, {})
                for k, v in state.items():
                    if torch.is_tensor(v) and v.device != device:
                        state[k] = v.to(device, non_blocking=True)
                        moved += v.nbytes
                if id(p) not in keep and p.device != device:
                    moved += p.data.nbytes
                    p.data = p.data.to(device, non_blocking=True)
    return moved


PARTS = ("params", "grads", "optimizer")
# Which parts leave first when only some bytes must: the grads cost nothing to free (they are zeroed before the next
# step anyway), the optimizer's state and the params a copy each way (the params leave last: a weight export reads
# them until the push is done).
RELEASE_ORDER = ("grads", "optimizer", "params")


class Offloader:
    """Applies one role's offload flags; a no-op when every flag is off or there is no accelerator.

    Each part (params, grads, optimizer) is on the device while at least one holder needs it:
    a compute call holds everything for its duration (`onloaded()`), a weight export holds only
    the params, and the hybrid loop holds everything across a whole learner phase
    (`hold` / `release`), so the compute calls inside it move nothing. A flagged part nobody
    holds is put away on the host, unless the last `decide_residency` found room to keep it
    (hybrid `learner_offload: when_short`): then it stays until a later decision finds none."""

    def __init__(self, chunks: list[torch.nn.Module], optimizer: Any, flags: RoleOffload) -> None:
        self.chunks, self.optimizer, self.flags = chunks, optimizer, flags
        self._model_params = {id(p) for c in chunks for p in c.parameters()}
        self._params_host: list[tuple[Any, Any]] = []  # param storages freed on the device, with their host copies
        self._pinned = PinnedPool()  # the host copies' pinned buffers, reused by every offload
        self._flagged = {part for part, on in zip(PARTS, (flags.param_offload, flags.grad_offload, flags.optimizer_offload))
                         if on and (part != "optimizer" or optimizer is not None)}
        self.enabled = bool(self._flagged)
        self._holds = dict.fromkeys(PARTS, 0)
        self._away: set[str] = set()  # flagged parts on the host now (a role starts resident)
        self._keep = False  # the last decide_residency found room: flagged parts stay on the device
        self._short: int | None = None  # else the bytes it found short, still to move (None: no decision, move all)
        self._away_bytes: dict[str, int] = {}  # each part's bytes on the host now
        # Bytes of the model's parameter storages, each once (tied weights, or Megatron's one buffer that all
        # params view): one pushed version, which an ipc sender stages whole beside the learner's state. Taken
        # here, where a role starts resident: an offloaded storage has no address and no bytes.
        self.param_bytes = sum({p.data.untyped_storage().data_ptr(): p.data.untyped_storage().nbytes()
                                for c in chunks for p in c.parameters()}.values())
        self.last_report: dict[str, float] = {}

    def decide_residency(self, need_bytes: int) -> bool:
        """Whether flagged parts may stay on the device from now on: the device (every process on it)
        has at least `need_bytes` free with them there, after this process's allocator returns its
        cached blocks (the learner phase's activations). The hybrid placement asks this once per
        switch to the engines, with what their wake needs. `release` then keeps them, or moves only
        the bytes found short: the cheapest first (`RELEASE_ORDER`)."""
        if not self._flagged:  # nothing of it ever leaves the device
            self._keep, self._short, self.last_report = False, None, {}
            return True
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        free = device_free_bytes()
        self._short = max(0, need_bytes - free)
        self._keep = self._short == 0
        self.last_report = {"learner/residency_free_bytes": float(free), "learner/residency_need_bytes": float(need_bytes),
                            "learner/state_kept": 1.0 if self._keep else 0.0}
        return self._keep

    @property
    def offloaded(self) -> bool:
        return bool(self._away)

    def holds(self) -> dict[str, int]:
        return dict(self._holds)

    def hold(self, parts: tuple[str, ...] = PARTS) -> dict[str, float]:
        """Bring `parts` to the device (those away) and keep them there until `release`."""
        parts = _checked(parts)
        for part in parts:
            self._holds[part] += 1
        return self._move(back=self._away.intersection(parts))

    def release(self, parts: tuple[str, ...] = PARTS) -> dict[str, float]:
        """Drop one hold on `parts`; flagged parts nobody holds any more go to the host."""
        parts = _checked(parts)
        for part in parts:
            if self._holds[part] == 0:
                raise RuntimeError(f"offload: release of {part!r}, which nobody holds")
            self._holds[part] -= 1
        if self._keep:  # room was found for them: nothing goes to the host
            return {}
        return self._move(away={p for p in parts if self._holds[p] == 0} & self._flagged - self._away,
                          partial=self._short is not None)

    def offload(self) -> dict[str, float]:
        """Put every flagged part that nobody holds on the host."""
        return self._move(away={p for p in self._flagged - self._away if self._holds[p] == 0})

    def reload(self) -> dict[str, float]:
        """Bring every part on the host back (until the next `offload`/`release`)."""
        return self._move(back=set(self._away))

    def _move(self, *, away: set[str] = frozenset(), back: set[str] = frozenset(),
              partial: bool = False) -> dict[str, float]:
        """Move `away` to the host or `back` to the device. `partial` (after a residency decision found bytes
        short): the parts of `away` leave in `RELEASE_ORDER` only while bytes are still short, the optimizer's
        state tensor by tensor, and what moves counts against the shortfall."""
        assert not (away and back), "one direction per move"
        if not away and not back:
            return {}
        before = device_memory_bytes()
        if back:
            if "params" in back:
                reload_params(self._params_host)
                self._params_host = []
            if "grads" in back:
                restore_grads(self.chunks)
            if "optimizer" in back:  # (every state tensor on the host: a partial release's too)
                move_optimizer_state(self.optimizer, _device(), self._model_params)
            came_back = sum(self._away_bytes.pop(p, 0) for p in back)
            if self._short is not None:  # what came back is short again until the next decision
                self._short += came_back
        moved: set[str] = set()
        released = 0
        for part in RELEASE_ORDER:
            if part not in away or (partial and self._short <= 0):
                continue
            if part == "grads":
                freed = free_grads(self.chunks)
            elif part == "optimizer":
                freed = move_optimizer_state(self.optimizer, torch.device("cpu"), self._model_params,
                                             limit_bytes=self._short if partial else None)
            else:
                self._params_host = offload_params(self.chunks, self._pinned)
                freed = self.param_bytes
            moved.add(part)
            released += freed
            self._away_bytes[part] = freed
            if partial:
                self._short -= freed
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            if moved:
                torch.cuda.empty_cache()
        self._away = (self._away | moved) - back
        report = self._report("offload" if away else "reload", before)
        if away:
            report["learner/released_bytes"] = float(released)
        if partial:
            report["learner/release_parts"] = float(len(moved))
        return report

    def _report(self, what: str, before: int) -> dict[str, float]:
        self.last_report = {
            f"learner/{what}_mem_before_bytes": float(before),
            f"learner/{what}_mem_after_bytes": float(device_memory_bytes()),
            "learner/offload_noop": 0.0 if torch.cuda.is_available() else 1.0,
        }
        return self.last_report

    @contextlib.contextmanager
    def onloaded(self, parts: tuple[str, ...] = PARTS) -> Iterator[None]:
        """Hold `parts` on the device for a compute call (a no-op inside an outer hold)."""
        self.hold(parts)
        try:
            yield
        finally:
            self.release(parts)


def _checked(parts: tuple[str, ...]) -> tuple[str, ...]:
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"offload parts must be among {PARTS}, got {sorted(unknown)}")
    return tuple(parts)
