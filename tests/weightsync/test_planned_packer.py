"""The sender's planned packer (plan.PlannedPacker): what it writes, push after push, from a program
worked out once per (plan, sender)."""

from __future__ import annotations

import pytest
import torch

from asyncrl.weightsync.plan import EngineLayout, ManifestEntry, Op, ParamLayout, PlanError, PlannedPacker, View, build_plan


def _fused(rows: dict[str, int], cols: int, fill_rows: int = 0) -> tuple[list[ManifestEntry], ParamLayout]:
    """One engine parameter made of `rows` (HF name -> rows) stacked, then `fill_rows` of zeros (padding)."""
    manifest, ops, at = [], [], 0
    for name, n in rows.items():
        manifest.append(ManifestEntry(name, "float32", (n, cols)))
        ops.append(Op(View(at * cols, (n, cols), (cols, 1)), name, View(0, (n, cols), (cols, 1))))
        at += n
    if fill_rows:
        ops.append(Op(View(at * cols, (fill_rows, cols), (cols, 1)), value=0.0))
    shape = (at + fill_rows, cols)
    return manifest, ParamLayout("+".join(rows), "float32", shape, tuple(ops))


def _model() -> tuple[list[ManifestEntry], EngineLayout]:
    manifest, params = [], []
    for i in range(6):
        m, p = _fused({f"l{i}.q": 4, f"l{i}.k": 2, f"l{i}.v": 2}, 8, fill_rows=2 if i == 0 else 0)
        manifest += m
        params.append(p)
    # an engine parameter taking a window of its source (rows 2..5 of a 6 x 8 tensor)
    manifest.append(ManifestEntry("w", "float32", (6, 8)))
    params.append(ParamLayout("w_rows", "float32", (4, 8), (Op(View(0, (4, 8), (8, 1)), "w", View(16, (4, 8), (8, 1))),)))
    return manifest, EngineLayout(0, tuple(params))


def _unpack(buckets, layout: EngineLayout) -> dict[str, torch.Tensor]:
    out = {}
    for b in buckets:
        for m in b.metas:
            out[m.name] = b.buffer[m.offset: m.offset + m.nbytes].view(torch.float32).view(m.shape).clone()
    assert sorted(out) == sorted(p.name for p in layout.params)
    return out


def _expected(layout: EngineLayout, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for p in layout.params:
        t = torch.full(p.shape, float("nan"))
        for op in p.ops:
            window = op.dst.of(t)
            window.copy_(op.src_view.of(tensors[op.src]) if op.src is not None else torch.full_like(window, op.value))
        out[p.name] = t
    return out


def test_every_push_packs_its_own_tensors_into_the_plans_places():
    manifest, layout = _model()
    plan = build_plan(manifest, [layout], 0.0005)  # a few buckets
    assert len(plan.buckets) > 3
    for push in range(3):  # the program is kept: later pushes must still write this push's values
        tensors = {e.name: torch.randn(e.shape) + push for e in manifest}
        got = _unpack(PlannedPacker(plan, 0, "cpu").pack(tensors.items()), layout)
        want = _expected(layout, tensors)
        assert all(torch.equal(got[n], want[n]) for n in want)


def test_a_new_plan_is_packed_by_its_own_program_not_a_kept_one():
    manifest, layout = _model()
    tensors = {e.name: torch.randn(e.shape) for e in manifest}
    for bucket_mb in (0.0005, 1.0, 0.0005):
        plan = build_plan(manifest, [layout], bucket_mb)
        buckets = list(PlannedPacker(plan, 0, "cpu").pack(tensors.items()))
        assert len(buckets) == len(plan.buckets)
        got, want = _unpack(buckets, layout), _expected(layout, tensors)
        assert all(torch.equal(got[n], want[n]) for n in want)
        del plan


def test_a_source_shaped_otherwise_than_the_manifest_is_read_through_its_window():
    """The export may hand a tensor flat (same elements): the packer takes the plan's window of it."""
    manifest, layout = _model()
    plan = build_plan(manifest, [layout], 1.0)
    tensors = {e.name: torch.randn(e.shape) for e in manifest}
    flat = {n: t.reshape(-1) for n, t in tensors.items()}
    got, want = _unpack(PlannedPacker(plan, 0, "cpu").pack(flat.items()), layout), _expected(layout, tensors)
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_an_export_that_repeats_or_misses_a_tensor_is_refused():
    manifest, layout = _model()
    plan = build_plan(manifest, [layout], 1.0)
    tensors = [(e.name, torch.randn(e.shape)) for e in manifest]
    with pytest.raises(PlanError, match="yielded l0.q twice"):
        list(PlannedPacker(plan, 0, "cpu").pack([tensors[0]] + tensors))
    with pytest.raises(PlanError, match=r"without 1 tensors the plan needs, e.g. \['w'\]"):
        list(PlannedPacker(plan, 0, "cpu").pack(tensors[:-1]))
    # a tensor no engine parameter takes is passed over: the same buckets as without it
    extra = list(PlannedPacker(plan, 0, "cpu").pack(tensors[:3] + [("extra", torch.zeros(1))] + tensors[3:]))
    plain = list(PlannedPacker(plan, 0, "cpu").pack(tensors))
    assert [b.metas for b in extra] == [b.metas for b in plain]
    assert all(torch.equal(a.buffer, b.buffer) for a, b in zip(extra, plain))
