"""A push plan's buckets shrink toward the end of each sender's stream (plan._runs): the last bucket, which
both ends hash after the wire, is small; and the export puts the output layer behind the embedding, so the
stream does not end on the largest tensor (convert._export_order)."""

from __future__ import annotations

import torch

from asyncrl.weightsync.plan import TAIL_BYTES, EngineLayout, ManifestEntry, Op, ParamLayout, View, build_plan

MIB = 1 << 20


def _layout(sizes_mib: list[float]) -> tuple[list[ManifestEntry], EngineLayout]:
    manifest, params = [], []
    for i, mib in enumerate(sizes_mib):
        n = int(mib * MIB) // 2
        manifest.append(ManifestEntry(f"t{i}", "bfloat16", (n,)))
        params.append(ParamLayout(f"p{i}", "bfloat16", (n,), (Op(View(0, (n,), (1,)), f"t{i}", View(0, (n,), (1,))),)))
    return manifest, EngineLayout(0, tuple(params))


def test_the_buckets_shrink_toward_the_end_of_the_stream():
    sizes = [300, 100] + [40] * 20 + [6, 6, 6]
    manifest, layout = _layout(sizes)
    plan = build_plan(manifest, [layout], 512)
    got = [b.nbytes / MIB for b in plan.buckets]
    names = [p.name for b in plan.buckets for p, _ in b.params]
    assert names == [f"p{i}" for i in range(len(sizes))]  # export order kept: each bucket completes as the export goes
    assert all(b.nbytes <= 512 * MIB for b in plan.buckets)
    assert plan.buckets[-1].nbytes <= TAIL_BYTES  # the bytes hashed after the wire
    # from the end, budgets of 16, 32, 64, ... 512 MiB (a bucket takes one tensor at least); then whole ones
    assert got == [300, 100 + 40 * 10, 40 * 6, 40 * 3, 40, 6, 12]


def test_a_tail_tensor_larger_than_the_tail_budget_gets_a_bucket_of_its_own():
    manifest, layout = _layout([200, 200, 64])
    plan = build_plan(manifest, [layout], 512)
    assert [[p.name for p, _ in b.params] for b in plan.buckets][-1] == ["p2"]


def test_small_buckets_are_cut_from_the_front_as_before():
    manifest, layout = _layout([3, 3, 3, 3, 3])
    plan = build_plan(manifest, [layout], 8)  # (8 MiB <= TAIL_BYTES: greedy from the front)
    assert [[p.name for p, _ in b.params] for b in plan.buckets] == [["p0", "p1"], ["p2", "p3"], ["p4"]]


def test_the_export_puts_the_output_layer_behind_the_embedding():
    from asyncrl.learner.convert import _export_order

    class Chunk(torch.nn.Module):
        def __init__(self, embedding: bool) -> None:
            super().__init__()
            if embedding:
                self.embedding = torch.nn.Module()
                self.embedding.word_embeddings = torch.nn.Linear(2, 2, bias=False)
            self.decoder = torch.nn.Linear(2, 2, bias=False)
            self.output_layer = torch.nn.Linear(2, 2, bias=False)

    assert [n for n, _ in _export_order(Chunk(True))] == [
        "embedding.word_embeddings.weight", "output_layer.weight", "decoder.weight"]
    assert [n for n, _ in _export_order(Chunk(False))] == ["output_layer.weight", "decoder.weight"]
