"""The engine worker's receiver (receiver.py) without an engine: a whole-version ipc push stages
views of the same sender buffers push after push, and the receiver keeps their views and the
apply's parameter lists; so does one applied as it lands from a broadcast group's reused buckets (per
bucket); these pin that what is applied is always the bytes staged now."""

from __future__ import annotations

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


def _push(rx: WorkerReceiver, version: int, buckets: list[Bucket]) -> ApplyReport:
    rx.begin(version, "checksum", "engine", "plan")
    for b in buckets:
        rx.stage(version, b, lazy=True, batch=True)
    rx.digests(version)
    return rx.apply(version)


def test_a_receiver_keeps_the_views_of_a_reused_record_and_applies_the_bytes_staged_now():
    names = [f"p{i}" for i in range(5)]
    live = {n: torch.nn.Parameter(torch.zeros(2, 3), requires_grad=False) for n in names}
    rx = WorkerReceiver(_Hooks())
    rx.plan_id, rx._live = "plan", live  # (as a begin of push plan "plan" takes a real engine's parameters)
    ring = _buckets(names)

    for version, value in enumerate((1.0, 10.0, 100.0), start=1):
        want = _fill(ring, value)
        views_before = {k: v.views for k, v in rx._views.items()}
        assert _push(rx, version, ring).path == "direct"
        assert all(torch.equal(live[n], want[n]) for n in names), version
        if version > 1:  # the same bucket objects: their views were not unpacked again
            assert {k: v.views for k, v in rx._views.items()} == views_before
    assert rx._apply_lists is not None  # the checked parameter lists are kept

    # A parameter whose storage the engine replaced (`param.data = ...`) is followed.
    fresh = torch.zeros(2, 3)
    live["p3"].data = fresh
    want = _fill(ring, 7.0)
    _push(rx, 4, ring)
    assert torch.equal(fresh, want["p3"]) and all(torch.equal(live[n], want[n]) for n in names)

    # Another record (new buffers): views built again, its bytes applied.
    other = _buckets(names, per=3)
    want = _fill(other, -5.0)
    _push(rx, 5, other)
    assert all(torch.equal(live[n], want[n]) for n in names)
    assert set(rx._views) == {id(b) for b in other}  # the old record's views are let go

    # Leaving the groups lets go of the views of their buffers.
    rx.release_views()
    assert rx._views == {} and rx._apply_lists is None
    _push(rx, 6, other)
    assert all(torch.equal(live[n], want[n]) for n in names)

    # An aborted update keeps nothing.
    rx.begin(7, "checksum", "engine", "plan")
    rx.stage(7, other[0], lazy=True, batch=True)
    rx.abort()
    assert rx._views == {} and rx._apply_lists is None


def _received(rx: WorkerReceiver, version: int, buckets: list[Bucket]) -> ApplyReport:
    """A broadcast push, fully staged: stage each bucket as it lands, read the digests, apply."""
    rx.begin(version, "checksum", "engine", "plan")
    for b in buckets:
        rx.stage(version, b, lazy=True)
    rx.digests(version)
    return rx.apply(version)


def test_reused_buckets_keep_their_views_and_copy_lists_and_always_apply_the_bytes_received_now():
    """A broadcast group's whole-version buckets come back as the same objects push after push
    (`Bucket.reused`): the receiver unpacks each once and keeps the lists of the apply's copy into the live
    parameters, yet every push applies the bytes that landed in it, follows a parameter whose storage
    the engine replaced, and keeps nothing of buckets that are not reused."""
    names = [f"p{i}" for i in range(6)]
    live = {n: torch.nn.Parameter(torch.zeros(2, 3), requires_grad=False) for n in names}
    rx = WorkerReceiver(_Hooks())
    rx.plan_id, rx._live = "plan", live
    ring = _buckets(names)
    for b in ring:
        b.reused = True
    first = None
    for version, value in enumerate((1.0, 10.0, 100.0), start=1):
        want = _fill(ring, value)
        assert _received(rx, version, ring).path == "direct"
        assert all(torch.equal(live[n], want[n]) for n in names), version
        kept = {k: v.views for k, v in rx._views.items()}
        assert set(kept) == {id(b) for b in ring} and rx._apply_lists is not None
        if first is None:
            first = (kept, rx._apply_lists)
        else:  # unpacked once, the copy lists made once
            assert all(kept[k] is first[0][k] for k in kept) and rx._apply_lists is first[1]

    fresh = torch.zeros(2, 3)  # the engine replaced a parameter's storage: the kept list holds the parameter
    live["p4"].data = fresh
    want = _fill(ring, 7.0)
    _received(rx, 4, ring)
    assert torch.equal(fresh, want["p4"]) and all(torch.equal(live[n], want[n]) for n in names)

    loose = _buckets(names, per=3)  # a transport's own fresh buckets: applied, nothing kept
    want = _fill(loose, -2.0)
    _received(rx, 5, loose)
    assert all(torch.equal(live[n], want[n]) for n in names) and rx._views == {}

    rx.begin(6, "checksum", "engine", "plan")  # a tensor staged twice is refused, a reused bucket too
    rx.stage(6, ring[0], lazy=True)
    try:
        rx.stage(6, ring[0], lazy=True)
        raise AssertionError("staged twice")
    except ValueError as err:
        assert "staged twice" in str(err)
    rx.abort()
    assert rx._views == {}
