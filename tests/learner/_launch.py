"""Run a function on N local ranks (real processes) and collect what each returns.

Each rank: installs the CPU compat layer (when there is no CUDA), joins a process group on a free
port (gloo on CPU; NCCL on a GPU host, rank r on GPU r, TF32 off), runs `fn(rank, world_size, *args)`,
and writes its return value (or its traceback) to a file that the parent reads back. A failure on
any rank raises in the parent with that traceback. `fn` returns host tensors only.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from tests.learner._device import require_gpus


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from asyncrl.learner.compat import install_cpu_compat
    from asyncrl.learner.parallel import destroy_model_parallel, init_distributed
    from tests.learner._device import fp32_exact

    install_cpu_compat()
    fp32_exact()
    result: Any
    try:
        init_distributed(rank, world_size, "127.0.0.1", port)
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:
        result = ("error", traceback.format_exc())
    tmp = Path(out_dir) / f"rank{rank}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(result, f)
    os.replace(tmp, Path(out_dir) / f"rank{rank}.pkl")  # the parent never sees a half file
    if result[0] == "ok":
        destroy_model_parallel()


def _first_error(out_dir: Path) -> tuple[int, str] | None:
    for path in sorted(out_dir.glob("rank*.pkl")):
        try:
            with open(path, "rb") as f:
                status, value = pickle.load(f)
        except (EOFError, pickle.UnpicklingError):
            continue  # still being written
        if status != "ok":
            return int(path.stem[4:]), value
    return None


# One fork server per test session imports the heavy modules once; every rank forks from it
# (a fresh interpreter per rank costs ~10 s of imports on a loaded 2-core machine).
mp.get_context("forkserver").set_forkserver_preload(
    ["torch", "transformers", "megatron.core.models.gpt", "asyncrl.learner.model", "tests.learner._workers"]
)


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 300) -> list[Any]:
    """Spawn `world_size` ranks running `fn`; return the per-rank results (index = rank)."""
    require_gpus(world_size)
    # CUDA is not fork-safe once initialised, and the fork server's imports may initialise it:
    # on a GPU host every rank is a fresh interpreter.
    start_method = "spawn" if torch.cuda.is_available() else "forkserver"
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _entry, args=(world_size, free_port(), out_dir, fn, args), nprocs=world_size,
            join=False, start_method=start_method,
        )
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=0.5):
            failed = _first_error(Path(out_dir))
            if failed is not None or time.monotonic() > deadline:
                # A failed rank leaves its peers blocked in a collective: stop them.
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                if failed is not None:
                    raise RuntimeError(f"rank {failed[0]} failed:\n{failed[1]}")
                raise TimeoutError(f"ranks did not finish in {timeout_s}s")
        results = []
        for rank in range(world_size):
            with open(Path(out_dir) / f"rank{rank}.pkl", "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results
