"""Distributed checkpoints of one learner group (Megatron `dist_checkpointing`, torch_dist format).

Owns: building the sharded state dict (model chunks, optional optimizer, optional scheduler,
per-rank RNG state, caller `extra`), writing it atomically, and loading it back into a possibly
different TP/PP layout (sharded tensors carry global shapes/offsets, so any layout can read them).

Atomic write: every rank writes into the sibling `.<name>.incomplete`; after a barrier rank 0
renames it into place (an older checkpoint at `path` is moved aside first and removed after), then
a final barrier. A crash leaves either the previous checkpoint or none, never a half one.

Must never: decide when or where to checkpoint (the trainer does), or talk to other components.
All functions are collective over the default process group.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import sys
import threading
import time
from multiprocessing.managers import SyncManager
from pathlib import Path
from typing import Any

import torch

LAYOUT_KEY = "asyncrl_layout"


def _layout() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {
        "world_size": torch.distributed.get_world_size(),
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "vpp": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
    }


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The bare model under any wrappers (Megatron DDP, Float16Module, ...): Megatron's DDP
    also has `sharded_state_dict`, but its keys gain a "module." prefix that a plain
    model's `load_state_dict` does not accept."""
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk


def _model_sharded_state_dict(model_chunks: list[torch.nn.Module]) -> dict[str, Any]:
    if not model_chunks:
        raise ValueError("model_chunks is empty")
    if len(model_chunks) == 1:
        return {"model": _unwrap(model_chunks[0]).sharded_state_dict()}
    # Megatron's convention for virtual pipeline chunks.
    return {f"model{i}": _unwrap(c).sharded_state_dict() for i, c in enumerate(model_chunks)}


def _rng_sharded_object(layout: dict[str, int]):
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    rank = torch.distributed.get_rank()
    return ShardedObject("rng_state", state, (layout["world_size"],), (rank,), replica_id=0)


def _build(model_chunks, optimizer, scheduler, rng: bool, layout: dict[str, int]) -> dict[str, Any]:
    state = _model_sharded_state_dict(model_chunks)
    if optimizer is not None:
        model_sd = state["model"] if len(model_chunks) == 1 else state
        state["optimizer"] = optimizer.sharded_state_dict(model_sd)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict() if hasattr(scheduler, "state_dict") else scheduler
    if rng:
        state["rng_state"] = _rng_sharded_object(layout)
    return state


def _strategy():
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    return get_default_save_sharded_strategy("torch_dist")


def _writer_queue_ends_with_this_process() -> None:
    """Megatron's torch_dist writer reports through a queue served by a `multiprocessing` Manager process that it
    starts at the first save (`filesystem_async._results_queue`). A rank killed with SIGKILL where nothing reaps its
    children (its node's raylet gone with it) left that process running with parent 1: the queue is made here
    instead, by a Manager whose process ends once its parent is gone. Idempotent."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "absent") is not None:  # made already, or a Megatron without it
        return
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=_end_with_parent, initargs=(os.getpid(),))
    filesystem_async._results_queue = manager.Queue()  # (the proxy keeps its manager)


def _end_with_parent(parent: int, poll_s: float = 0.5) -> None:
    """In a child process: a daemon thread that ends it once `parent` is no longer its parent (it died, and the
    child was handed to another)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="asyncrl-parent-watch", daemon=True).start()


# The rank's pid while a save runs (0: none): a child it forks meanwhile is one of Megatron's writers.
_SAVING = {"pid": 0}


def _writer_forked() -> None:
    """In a child forked (`os.register_at_fork`) while its parent saves: it ends once the rank is gone. A Ray actor
    is seen dead when its process's sockets close, and a forked writer holds copies of them: a rank killed mid-save
    with a writer alive stayed alive to Ray, and every call to it (the trainer's save, so its restart) waited."""
    parent, _SAVING["pid"] = _SAVING["pid"], 0  # (the writer's own forks are not writers of this rank)
    if parent:
        _end_with_parent(parent)


os.register_at_fork(after_in_child=_writer_forked)


@contextlib.contextmanager
def _writers_and_rank_end_together(poll_s: float = 0.2):
    """While a save runs, its writer processes and this rank end together, either way round.
    - A writer killed (the OOM killer, a kill -9): Megatron's torch_dist save waits for each writer to report, without
      a deadline, so the save, the rank and the run waited forever. A child of this process ended by a signal ends the
      rank too (exit 1, the reason on stderr), and the trainer's restart path takes over from the last complete
      checkpoint. (`waitid` with WNOWAIT reads a child's end without reaping it: its `multiprocessing` owner does.)
    - The rank killed: each writer it forked ends within a second (`_writer_forked`)."""
    import psutil

    me = psutil.Process()
    before = {c.pid for c in me.children()}
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(poll_s):
            for child in me.children():
                if child.pid in before:
                    continue
                try:
                    end = os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                except ChildProcessError:  # reaped meanwhile: it ended normally
                    continue
                if end is not None and end.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
                    print(f"asyncrl: checkpoint writer process {child.pid} was killed by signal {end.si_status} during "
                          "a save, which would wait for it forever: ending this learner rank, so that the learner "
                          "restarts from the last complete checkpoint", file=sys.stderr, flush=True)
                    os._exit(1)

    thread = threading.Thread(target=watch, name="asyncrl-writer-watch", daemon=True)
    thread.start()
    _SAVING["pid"] = os.getpid()
    try:
        yield
    finally:
        _SAVING["pid"] = 0
        stop.set()
        thread.join()


def save_checkpoint(
    path: str | Path,
    model_chunks: list[torch.nn.Module],
    optimizer: Any = None,
    extra: dict[str, Any] | None = None,
    *,
    scheduler: Any = None,
    save_rng: bool = True,
) -> Path:
    """Write model (+ optimizer, scheduler, RNG, extra) to `path` atomically. Collective."""
    from megatron.core import dist_checkpointing

    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict, got {type(extra).__name__}")
    path = Path(path).absolute()
    tmp = path.parent / f".{path.name}.incomplete"
    rank = torch.distributed.get_rank()
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a crash mid-save
        tmp.mkdir(parents=True)
    torch.distributed.barrier()
    layout = _layout()
    state = _build(model_chunks, optimizer, scheduler, save_rng, layout)
    state["extra"] = dict(extra or {})
    state[LAYOUT_KEY] = layout
    _writer_queue_ends_with_this_process()
    with _writers_and_rank_end_together():
        dist_checkpointing.save(state, str(tmp), sharded_strategy=_strategy())
    torch.distributed.barrier()
    if rank == 0:
        old = path.parent / f".{path.name}.old"
        if path.exists():
            if old.exists():
                shutil.rmtree(old)
            path.rename(old)
        tmp.rename(path)
        if old.exists():
            shutil.rmtree(old)
    torch.distributed.barrier()
    return path


def _zero_step_restored(state: Any) -> None:
    """Megatron saves an optimizer's shared step only when it is truthy (`if step:`), so a state saved before the
    first step (step 0: a warmed, fresh optimizer's) loads back without one and torch's Adam refuses it (KeyError
    'step'). Each torch optimizer state dict in `state` ('state' beside 'param_groups') whose per-parameter states
    hold no step gets Megatron's `common_step` of 0, in place."""
    if isinstance(state, dict):
        inner = state.get("state")
        if isinstance(inner, dict) and "param_groups" in state and "common_step" not in inner:
            per = [v for v in inner.values() if isinstance(v, dict)]
            if per and all("step" not in v for v in per):
                inner["common_step"] = 0
        for value in state.values():
            _zero_step_restored(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            _zero_step_restored(value)


def saved_extra(path: str | Path) -> dict[str, Any]:
    """The `extra` a checkpoint was saved with (its common state alone: no model is built or read)."""
    from megatron.core import dist_checkpointing

    return dict(dist_checkpointing.load_common_state_dict(str(path)).get("extra", {}))


def load_checkpoint(
    path: str | Path,
    model_chunks: list[torch.nn.Module],
    optimizer: Any = None,
    *,
    scheduler: Any = None,
    load_rng: bool = True,
    strict: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by `save_checkpoint` (any TP/PP layout); returns its `extra`.

    RNG state is restored only when the layout is the same as at save time (per-rank streams do
    not map across layouts). Returns the saved `extra` with `LAYOUT_KEY` added (the saved layout).
    """
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not (path / "metadata.json").exists():
        raise FileNotFoundError(f"no dist checkpoint at {path} (metadata.json missing)")
    common = dist_checkpointing.load_common_state_dict(str(path))
    saved_layout = common.get(LAYOUT_KEY, {})
    layout = _layout()
    has_rng = "rng_state" in _saved_keys(path)
    rng = load_rng and has_rng and saved_layout == layout
    state = _build(model_chunks, optimizer, scheduler, rng, layout)
    loaded = dist_checkpointing.load(state, str(path))
    if len(model_chunks) == 1:
        _unwrap(model_chunks[0]).load_state_dict(loaded["model"], strict=strict)
    else:
        for i, c in enumerate(model_chunks):
            _unwrap(c).load_state_dict(loaded[f"model{i}"], strict=strict)
    if optimizer is not None:
        _zero_step_restored(loaded["optimizer"])
        optimizer.load_state_dict(loaded["optimizer"])
        from asyncrl.learner.gpu_fusions import use_fused_adam

        use_fused_adam(optimizer)  # the loaded param groups replaced the `fused` flag (CUDA only)
    if scheduler is not None and "scheduler" in common and hasattr(scheduler, "load_state_dict"):
        scheduler.load_state_dict(common["scheduler"])
    if rng:
        _restore_rng(loaded["rng_state"])
    extra = dict(common.get("extra", {}))
    extra[LAYOUT_KEY] = saved_layout
    return extra


def _saved_keys(path: Path) -> set[str]:
    from megatron.core import dist_checkpointing

    try:
        meta = dist_checkpointing.load_sharded_metadata(str(path))
    except Exception:  # older metadata readers: assume no RNG rather than fail the load
        return set()
    return {k.split("/")[0] for k in meta}


def _restore_rng(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["cpu"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
