"""The engine worker's receiver (worker_verbs.py) without an engine: staging the same sender buffers push after push
(an ipc ring, hashed in one pass; a broadcast's buckets, each as it lands), what is applied is always the bytes
staged now, into the parameters as the engine holds them now."""

from __future__ import annotations

import pytest
import torch

from asyncrl.types import ApplyReport
from asyncrl.weightsync.bucket import Bucket, TensorMeta
from asyncrl.weightsync.worker_verbs import WorkerReceiver


class _Hooks:
    rank = 0
    device = torch.device("cpu")


def _buckets(names: list[str], per: int = 2) -> list[Bucket]:
    """Engine-layout buckets of float32 (2, 3) tensors, `per` to a bucket."""
    out = []
    for i in range(0, len(names), per):
        metas = [TensorMeta(n, "float32", (2, 3), 64 * j, 24) for j, n in enumerate(names[i:i + per])]
        out.append(Bucket(buffer=torch.zeros(64 * len(metas), dtype=torch.uint8), metas=metas, rank=0))
    return out


def _fill(buckets: list[Bucket], value: float) -> dict[str, torch.Tensor]:
    """Write `value + k` into the k-th tensor of the buffers (as a sender repacking its ring does)."""
    want, k = {}, 0
    for b in buckets:
        for m in b.metas:
            t = torch.full((2, 3), value + k)
            b.buffer[m.offset:m.offset + m.nbytes].copy_(t.reshape(-1).view(torch.uint8))
            want[m.name], k = t, k + 1
    return want


def _push(rx: WorkerReceiver, version: int, buckets: list[Bucket], batch: bool) -> ApplyReport:
    rx.begin(version, "checksum", "engine", "plan")
    for b in buckets:
        rx.stage(version, b, batch=batch)
    rx.digests(version)
    return rx.apply(version)


@pytest.mark.parametrize("batch", [True, False], ids=["ipc", "broadcast"])
def test_a_receiver_applies_the_bytes_staged_now_push_after_push(batch):
    names = [f"p{i}" for i in range(5)]
    live = {n: torch.nn.Parameter(torch.zeros(2, 3), requires_grad=False) for n in names}
    rx = WorkerReceiver(_Hooks())
    rx.plan_id, rx._live = "plan", live  # (as a begin of push plan "plan" takes a real engine's parameters)
    ring = _buckets(names)
    for version, value in enumerate((1.0, 10.0, 100.0), start=1):
        want = _fill(ring, value)
        assert _push(rx, version, ring, batch).path == "direct"
        assert all(torch.equal(live[n], want[n]) for n in names), version

    # A parameter whose storage the engine replaced (`param.data = ...`) is followed.
    fresh = torch.zeros(2, 3)
    live["p3"].data = fresh
    want = _fill(ring, 7.0)
    _push(rx, 4, ring, batch)
    assert torch.equal(fresh, want["p3"]) and all(torch.equal(live[n], want[n]) for n in names)

    other = _buckets(names, per=3)  # other buffers, another bucketing
    want = _fill(other, -5.0)
    _push(rx, 5, other, batch)
    assert all(torch.equal(live[n], want[n]) for n in names)

    rx.begin(6, "checksum", "engine", "plan")  # a tensor staged twice is refused
    rx.stage(6, ring[0], batch=batch)
    with pytest.raises(ValueError, match="staged twice"):
        rx.stage(6, ring[0], batch=batch)
    rx.abort()  # nothing staged is left
    with pytest.raises(RuntimeError, match="staging None"):
        rx.apply(6)
