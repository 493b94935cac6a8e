"""Device-compat layer: lets megatron-core run on a CPU-only torch build (gloo backend).

Owns: the list of CUDA calls Megatron-core makes unconditionally, and their CPU stand-ins (process-wide module
attributes, plus a per-thread `TorchFunctionMode` mapping cuda devices and pinned memory to CPU; another thread
running Megatron code enters `cpu_compat_thread()`); installing them (idempotent, lock-guarded), undoing them
exactly, and a global grad-norm clip that works over gloo (Megatron's own asserts CUDA tensors: build the optimizer
with `clip_grad=0`). The "CUDA" generator is the CPU default generator, so Megatron's RNG tracker keeps its contract.
Must never: do anything when CUDA is available (then `install_cpu_compat()` returns an inactive handle and logs that
it did nothing), change numerics, or patch anything at import time.
Details: docs/design/learner.md, "The CPU compat layer".
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_CPU = torch.device("cpu")
_MISSING = object()
_LOCK = threading.RLock()
_STATE: "_Installed | None" = None


# ----------------------------------------------------------------------------- stand-ins


def _to_cpu_device(device: Any) -> Any:
    """Map any CUDA-looking device spec to CPU; leave everything else alone."""
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return _CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites device arguments of every torch call made on this thread."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs = dict(kwargs)
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs)
            kwargs["pin_memory"] = False
        if args and getattr(func, "__name__", "") == "to":
            # Tensor.to(device, ...) / Tensor.to(0): the first positional after self may be a device.
            args = (args[0],) + tuple(
                _to_cpu_device(a) if isinstance(a, (str, torch.device, int)) else a for a in args[1:]
            )
        return func(*args, **kwargs)


class _FakeStream:
    """A stream that is always done: CPU ops are synchronous."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = _CPU

    def wait_stream(self, *args: Any) -> None: ...
    def wait_event(self, *args: Any) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool:
        return True

    def record_event(self, event: Any = None) -> "_FakeEvent":
        return event or _FakeEvent()

    def __enter__(self) -> "_FakeStream":
        return self

    def __exit__(self, *args: Any) -> None: ...

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _FakeStream)

    def __hash__(self) -> int:
        return 0


class _FakeEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None: ...
    def record(self, *args: Any) -> None: ...
    def wait(self, *args: Any) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _AnyIndexGenerators(tuple):
    """`torch.cuda.default_generators[i]` -> the CPU default generator, for any index or device."""

    def __getitem__(self, index: Any) -> torch.Generator:
        return torch.default_generator

    def __len__(self) -> int:
        return 1


# Every patch gets its own function object: torch._dynamo maps torch.* objects to tracing
# rules and asserts when one object appears under two names with different rules.
def _noop_fn() -> Any:
    def noop(*args: Any, **kwargs: Any) -> None:
        return None

    return noop


def _zero_fn() -> Any:
    def zero(*args: Any, **kwargs: Any) -> int:
        return 0

    return zero


def _cuda_patches() -> dict[tuple[Any, str], Any]:
    """(owner, attribute) -> replacement. Built lazily: nothing happens at import time."""
    cuda = torch.cuda
    stream = _FakeStream()

    def manual_seed(seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    patches: dict[tuple[Any, str], Any] = {
        (cuda, "current_device"): lambda: _CPU,
        (cuda, "set_device"): _noop_fn(),
        (cuda, "synchronize"): _noop_fn(),
        (cuda, "empty_cache"): _noop_fn(),
        (cuda, "device_count"): lambda: 1,
        (cuda, "memory_allocated"): _zero_fn(),
        (cuda, "max_memory_allocated"): _zero_fn(),
        (cuda, "memory_reserved"): _zero_fn(),
        (cuda, "max_memory_reserved"): _zero_fn(),
        (cuda, "reset_peak_memory_stats"): _noop_fn(),
        (cuda, "memory_stats"): lambda *a, **k: {},
        (cuda, "manual_seed"): manual_seed,
        (cuda, "manual_seed_all"): _noop_fn(),  # torch.manual_seed calls it; the CPU seed is already set
        (cuda, "get_rng_state"): get_rng_state,
        (cuda, "set_rng_state"): set_rng_state,
        (cuda.random, "get_rng_state"): get_rng_state,
        (cuda.random, "set_rng_state"): set_rng_state,
        (cuda, "default_generators"): _AnyIndexGenerators(),
        (cuda, "_lazy_call"): lambda callable_, **kwargs: callable_(),
        (cuda, "_lazy_init"): _noop_fn(),
        (cuda, "Stream"): _FakeStream,
        (cuda, "Event"): _FakeEvent,
        (cuda, "current_stream"): lambda *a, **k: stream,
        (cuda, "default_stream"): lambda *a, **k: stream,
        (cuda, "stream"): lambda s=None: contextlib.nullcontext(s),
        (cuda, "set_stream"): _noop_fn(),
        (cuda.nvtx, "range_push"): _noop_fn(),
        (cuda.nvtx, "range_pop"): _noop_fn(),
        (cuda.nvtx, "range"): lambda *a, **k: contextlib.nullcontext(),
        (torch.Tensor, "cuda"): lambda self, *a, **k: self,
        (torch.Tensor, "pin_memory"): lambda self, *a, **k: self,
        (torch.Tensor, "record_stream"): _noop_fn(),
    }
    # megatron's RNG module bound these names at its import; patch the bound copies too.
    try:
        from megatron.core.tensor_parallel import random as mcore_random

        patches[(mcore_random, "_lazy_call")] = lambda callable_, **kwargs: callable_()
        patches[(mcore_random, "_lazy_init")] = _noop_fn()
    except ImportError:  # megatron absent: torch-level patches still stand alone
        pass
    try:
        from megatron.core.transformer.moe import moe_utils

        # 0.16.1 tests `te_general_gemm is not None` but binds the name only when TE imports.
        if not hasattr(moe_utils, "te_general_gemm"):
            patches[(moe_utils, "te_general_gemm")] = None
        from megatron.core.transformer.moe import token_dispatcher

        # The alltoall dispatcher expects its split sizes as numpy after a device->host copy;
        # on CPU the copy is skipped and gloo's all_to_all_single rejects tensor split sizes.
        for module in (moe_utils, token_dispatcher):
            if hasattr(module, "maybe_move_tensor_to_cpu"):
                patches[(module, "maybe_move_tensor_to_cpu")] = _host_copy_fn()
    except ImportError:
        pass
    return patches


def _host_copy_fn() -> Any:
    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor):
            return tensor.detach().cpu().numpy()
        return tensor

    return maybe_move_tensor_to_cpu


# ----------------------------------------------------------------------------- install / undo


@dataclass
class _Installed:
    originals: dict[tuple[Any, str], Any]
    mode: _CudaToCpuMode
    thread_id: int
    refcount: int = 1


@dataclass
class CompatHandle:
    """What `install_cpu_compat()` returns. `active` is False when CUDA is present (nothing patched)."""

    active: bool
    reason: str
    patched: list[str] = field(default_factory=list)

    def uninstall(self) -> None:
        if self.active:
            uninstall_cpu_compat()


def is_installed() -> bool:
    return _STATE is not None


def install_cpu_compat() -> CompatHandle:
    """Redirect Megatron's CUDA calls to CPU. Idempotent (reference counted); no-op with CUDA."""
    global _STATE
    if torch.cuda.is_available() and _STATE is None:
        logger.info("asyncrl cpu compat: CUDA is available, nothing patched")
        return CompatHandle(active=False, reason="cuda available: nothing patched")
    with _LOCK:
        if _STATE is not None:
            _STATE.refcount += 1
            return CompatHandle(active=True, reason="already installed", patched=_names(_STATE.originals))
        patches = _cuda_patches()
        originals = {key: getattr(key[0], key[1], _MISSING) for key in patches}
        for (owner, name), value in patches.items():
            setattr(owner, name, value)
        mode = _CudaToCpuMode()
        mode.__enter__()
        _STATE = _Installed(originals=originals, mode=mode, thread_id=threading.get_ident())
        logger.info("asyncrl cpu compat: %d CUDA calls redirected to CPU", len(patches))
        return CompatHandle(active=True, reason="installed", patched=_names(originals))


def uninstall_cpu_compat(force: bool = False) -> None:
    """Undo one `install_cpu_compat()` (all of them with force=True), restoring every original."""
    global _STATE
    with _LOCK:
        if _STATE is None:
            return
        _STATE.refcount -= 1
        if _STATE.refcount > 0 and not force:
            return
        if threading.get_ident() != _STATE.thread_id:
            raise RuntimeError(
                "uninstall_cpu_compat() must run on the thread that installed it "
                "(torch keeps function modes per thread)"
            )
        _STATE.mode.__exit__(None, None, None)
        for (owner, name), value in _STATE.originals.items():
            if value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        _STATE = None


@contextlib.contextmanager
def cpu_compat() -> Iterator[CompatHandle]:
    """Install for the duration of a block (tests); restores everything on exit."""
    handle = install_cpu_compat()
    try:
        yield handle
    finally:
        handle.uninstall()


@contextlib.contextmanager
def cpu_compat_thread() -> Iterator[None]:
    """Enter the device-rewriting mode on a thread other than the installing one."""
    if _STATE is None or threading.get_ident() == _STATE.thread_id:
        yield
        return
    with _CudaToCpuMode():
        yield


def _names(originals: dict[tuple[Any, str], Any]) -> list[str]:
    return sorted(f"{getattr(owner, '__name__', type(owner).__name__)}.{name}" for owner, name in originals)


# ----------------------------------------------------------------------------- grad clipping


def clip_grad_norm_(parameters: Iterable[torch.nn.Parameter], max_norm: float, norm: float | None = None,
                    dp_sharded: bool = False) -> float:
    """Clip gradients by their global L2 norm over every model-parallel rank; returns the norm before clipping.

    Works on gloo (Megatron's `clip_grad_norm_fp32` asserts CUDA tensors). Each gradient is counted
    once, with Megatron's own filters: tensor-parallel duplicates only on TP rank 0 and the
    pipeline copy of a tied embedding (`shared=True`) not at all. Dense grads are summed over
    the model-parallel group (TP x PP), expert grads (`allreduce=False`) over the expert
    TP x EP x PP group. DP replicas hold equal (all-reduced) grads, so DP is not reduced, unless `dp_sharded` (the
    parameters are a distributed optimizer's shards: each DP rank holds its own part of every gradient, and the sums
    are then reduced over DP, with CP, too; its expert shards are refused by the optimizer, so every grad is dense).
    Uses `main_grad` when Megatron DDP put the gradient there. `norm`: the global norm if the
    caller already measured it (then only the scaling runs). The per-tensor norms are one
    multi-tensor pass (`_foreach_norm`, float32 accumulation), no float32 copy of any gradient.
    """
    if max_norm < 0:
        raise ValueError(f"max_norm={max_norm} must be >= 0 (0 disables clipping)")
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.module import param_is_not_shared

    from asyncrl.learner.parallel import collective_device

    initialized = torch.distributed.is_initialized() and ps.model_parallel_is_initialized()
    tp_rank = ps.get_tensor_model_parallel_rank() if initialized else 0
    grads: list[torch.Tensor] = []
    counted: dict[bool, list[torch.Tensor]] = {False: [], True: []}  # expert? -> grads in the norm
    for p in parameters:
        grad = getattr(p, "main_grad", None)
        if grad is None:
            grad = p.grad
        if grad is None:
            continue
        grads.append(grad)
        # Megatron's rule: a TP-replicated parameter counts on TP rank 0 only.
        not_tp_duplicate = getattr(p, "tensor_model_parallel", False) or tp_rank == 0
        if param_is_not_shared(p) and not_tp_duplicate:
            counted[getattr(p, "allreduce", True) is False].append(grad.detach())
    if norm is None:
        device = collective_device()  # NCCL reduces only device tensors; the grads live there too
        sq = torch.zeros(2, dtype=torch.float32, device=device)  # [dense, expert] sums of squares
        for i, expert in enumerate((False, True)):
            for dev_grads in _by_device(counted[expert]).values():
                norms = torch._foreach_norm(dev_grads, 2, dtype=torch.float32)
                sq[i] += torch.stack(norms).square().sum().to(device)
        if initialized:
            torch.distributed.all_reduce(sq[0:1], group=ps.get_model_parallel_group())
            torch.distributed.all_reduce(sq[1:2], group=ps.get_expert_tensor_model_pipeline_parallel_group())
            if dp_sharded:
                torch.distributed.all_reduce(sq, group=ps.get_data_parallel_group(with_context_parallel=True))
        dense, expert = sq.tolist()
        norm = math.sqrt(dense + expert)
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for dev_grads in _by_device(grads).values():
            torch._foreach_mul_(dev_grads, scale)
    return norm


def _by_device(tensors: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    out: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault((t.device, t.dtype), []).append(t)
    return out
