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


def test_a_worker_opens_each_ipc_buffer_once_and_applies_its_bytes_as_they_are_now(monkeypatch):
    """The ipc wires through the worker's verb, as vLLM's RPC hands them over (a msgpack round trip): a handle seen
    before with the same table is neither opened nor unpacked again, yet every push applies the ring's bytes of now,
    into vLLM's own parameter class (whose `__torch_function__` the apply steps around)."""
    import msgspec
    from vllm.model_executor.parameter import BasevLLMParameter

    from asyncrl.weightsync import worker_verbs

    names = [f"p{i}" for i in range(5)]
    model = torch.nn.Module()
    for n in names:
        model.register_parameter(n, BasevLLMParameter.__new__(BasevLLMParameter, torch.zeros(2, 3)))
    live = dict(model.named_parameters())
    ring = _buckets(names)
    by_handle = {f"h{i}".encode(): b for i, b in enumerate(ring)}
    opened: list[bytes] = []

    def ipc_open(handle: bytes, metas: list, rank: int | None = None) -> Bucket:
        opened.append(handle)
        assert metas == list(by_handle[handle].metas)  # (the table, rebuilt from the wire)
        return Bucket(buffer=by_handle[handle].buffer, metas=metas, rank=rank)

    class Worker(worker_verbs.WorkerVerbs):
        rank = 0

        def _asyncrl_hooks(self) -> _Hooks:
            hooks = _Hooks()
            hooks.model = lambda: model
            return hooks

    monkeypatch.setattr(worker_verbs, "ipc_open", ipc_open)
    worker = Worker()

    def push(version: int, wires: list) -> None:
        worker.asyncrl_receive(version, msgspec.msgpack.decode(msgspec.msgpack.encode(wires)), None, 0.0, "",
                               ["checksum", "engine", "plan"])
        assert worker.asyncrl_apply(version).path == "direct"

    wires = [(h, b.metas, b.rank) for h, b in by_handle.items()]
    for version, value in enumerate((1.0, 10.0, 100.0), start=1):
        want = _fill(ring, value)
        push(version, wires)
        assert all(torch.equal(live[n].data, want[n]) for n in names), version
    assert sorted(opened) == sorted(by_handle)  # each buffer opened at the first push only

    moved = [ring[0].metas[1], ring[0].metas[0]]  # the same handle with another table is opened again
    moved = [moved[0]._replace(offset=0), moved[1]._replace(offset=64)]
    ring[0] = by_handle[b"h0"] = Bucket(buffer=ring[0].buffer, metas=moved, rank=0)
    want = _fill(ring, 5.0)
    push(4, [(h, b.metas, b.rank) for h, b in by_handle.items()])
    assert opened.count(b"h0") == 2 and len(opened) == len(by_handle) + 1
    assert all(torch.equal(live[n].data, want[n]) for n in names)
