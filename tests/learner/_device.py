"""Where the learner tests' ranks run: gloo on a CPU host, NCCL with one GPU per rank on a GPU host.

The tests assert the backend every rank reports, so a GPU run whose ranks silently fell back to
gloo on the host (e.g. rank actors started without a GPU) cannot pass as a GPU result. Parity is
checked in float32 against `transformers` on the host, so TF32 is kept off in the ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch


def expected_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def require_gpus(world_size: int) -> None:
    """Skip on a GPU host with fewer GPUs than ranks: NCCL refuses two ranks of a group on one device."""
    if not fits(world_size):
        pytest.skip(f"{world_size} NCCL ranks need {world_size} GPUs, found {torch.cuda.device_count()}")


def fits(world_size: int) -> bool:
    """Whether this host can run a group of `world_size` ranks: always on CPU (gloo), on a GPU host
    one GPU per rank."""
    return not torch.cuda.is_available() or torch.cuda.device_count() >= world_size


def num_gpus_per_rank(world_size: int) -> float:
    """What each rank actor asks Ray for: nothing on a CPU host; a whole GPU when the group has
    several ranks (a fractional share could put two of them on one device); a quarter for a
    one-rank group, so that the four one-rank groups of test_roles_ws1 share a GPU."""
    if not torch.cuda.is_available():
        return 0.0
    require_gpus(world_size)
    return 1.0 if world_size > 1 else 0.25


def fp32_exact() -> None:
    """No TF32 in this process's float32 matmuls (nothing to do on CPU)."""
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")


def placement(group: Any) -> list[dict[str, Any]]:
    """Turn TF32 off inside every rank actor of a started `LearnerGroup` and report, per rank, its
    process-group backend and the GPU ids Ray gave it."""
    import ray

    def probe(_rank: Any) -> dict[str, Any]:
        # Self-contained (cloudpickled by value): the rank actor need not import tests/.
        import ray
        import torch

        if torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            torch.set_float32_matmul_precision("highest")
        return {"backend": torch.distributed.get_backend(), "gpu_ids": [str(i) for i in ray.get_gpu_ids()]}

    return ray.get([a.__ray_call__.remote(probe) for a in group.ranks])


def assert_placement(ranks: list[dict[str, Any]]) -> None:
    """Every rank on the expected backend; on GPU, the ranks of one group on distinct GPUs."""
    assert [r["backend"] for r in ranks] == [expected_backend()] * len(ranks), ranks
    if torch.cuda.is_available():
        assert all(len(r["gpu_ids"]) == 1 for r in ranks), ranks
        if len(ranks) > 1:
            assert len({r["gpu_ids"][0] for r in ranks}) == len(ranks), ranks
