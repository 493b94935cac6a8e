"""Shard plans (plan.build_shard_plan): every TP rank of the learner sends its own shards, no gather.

The engine here is a small torch module whose loaders do what vLLM's tensor-parallel loaders do (rows of
q/k/v into one fused parameter, a column window of o_proj, a row window of the padded vocabulary with the
padding filled, a norm whole); its layout is read by `probe_layout` as for a real engine. The learner side
is `convert.shard_pieces` on shards made by `convert.shard_from_hf`, the inverse the learner loads with.
Each test checks bytes: what an engine rank gets from the learner ranks' own pieces equals what its
loaders make of the whole HF tensors.
"""

from __future__ import annotations

import pytest
import torch

from asyncrl.learner.convert import ParamMap, ShardExportError, shard_from_hf, shard_pieces, vocab_edges, vocab_from_edges, vocab_window
from asyncrl.learner.model import ModelArch
from asyncrl.weightsync.plan import ManifestEntry, PlanError, PlannedPacker, build_plan, fill_param, probe_layout
from asyncrl.weightsync.shards import Piece, build_shard_plan, hf_from_engine, localize_layout, piece_name, plan_layout, plan_misfit

H, HEADS, KV, HD, FFN, VOCAB = 8, 4, 2, 2, 12, 14
ARCH = ModelArch("qwen2", 1, H, HEADS, KV, HD, FFN, VOCAB, False, True, False, 1e4, 1e-6, 64)
MAPS = {
    "qkv": ParamMap(["q.weight", "k.weight", "v.weight"], "qkv"),
    "qkv_bias": ParamMap(["q.bias", "k.bias", "v.bias"], "qkv"),
    "o": ParamMap(["o.weight"], "row"),
    "fc1": ParamMap(["gate.weight", "up.weight"], "fc1"),
    "norm": ParamMap(["norm.weight"], "replicated"),
    "col": ParamMap(["col.weight"], "column"),
}


def _hf(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"q.weight": (HEADS * HD, H), "k.weight": (KV * HD, H), "v.weight": (KV * HD, H),
              "q.bias": (HEADS * HD,), "k.bias": (KV * HD,), "v.bias": (KV * HD,), "o.weight": (H, HEADS * HD),
              "gate.weight": (FFN, H), "up.weight": (FFN, H), "norm.weight": (H,), "col.weight": (8, H),
              "embed.weight": (VOCAB, H)}
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize("kind", sorted(MAPS))
def test_each_ranks_pieces_are_its_windows_of_the_hf_tensors(kind, size):
    hf = _hf()
    pm = MAPS[kind]
    for rank in range(size):
        shard = shard_from_hf(pm, [hf[n] for n in pm.hf_names], ARCH, rank, size, VOCAB)
        pieces = shard_pieces(pm, shard, ARCH, rank, size)
        assert [p[0] for p in pieces] == pm.hf_names
        for name, part, full, window in pieces:
            assert full == tuple(hf[name].shape)
            want = hf[name] if window is None else hf[name].narrow(window[0], window[1], window[2] - window[1])
            assert torch.equal(part, want), (name, rank)
            assert (window is None) == (size == 1 or kind == "norm")


def test_a_padded_vocabulary_has_no_pieces_of_its_own():
    with pytest.raises(ShardExportError, match="vocab"):
        shard_pieces(ParamMap(["embed.weight"], "vocab"), torch.zeros(6, H), ARCH, 0, 2)


class _Engine(torch.nn.Module):
    """One engine TP rank of `tp`, with loaders in vLLM's manner (narrow the HF tensor to this rank's part,
    copy it into its place; the vocabulary padded to a multiple of 4 rows per rank, the padding zeroed)."""

    def __init__(self, rank: int, tp: int) -> None:
        super().__init__()
        self.rank, self.tp = rank, tp
        q, kv = HEADS * HD // tp, KV * HD // tp
        self.rows = (q, kv, kv)
        self.qkv = torch.nn.Parameter(torch.zeros(q + 2 * kv, H))
        self.qkv_bias = torch.nn.Parameter(torch.zeros(q + 2 * kv))
        self.o = torch.nn.Parameter(torch.zeros(H, HEADS * HD // tp))
        self.gate_up = torch.nn.Parameter(torch.zeros(2 * FFN // tp, H))
        self.norm = torch.nn.Parameter(torch.zeros(H))
        self.col = torch.nn.Parameter(torch.zeros(8 // tp, H))
        self.per_rank = -(-VOCAB // (4 * tp)) * 4
        self.embed = torch.nn.Parameter(torch.zeros(self.per_rank, H))

    def load_weights(self, weights) -> None:
        r = self.rank
        for name, t in weights:
            base, _, what = name.partition(".")
            if base in ("q", "k", "v"):
                i = "qkv".index(base)
                n = self.rows[i]
                dst = self.qkv if what == "weight" else self.qkv_bias
                dst.data.narrow(0, sum(self.rows[:i]), n).copy_(t.narrow(0, r * n, n))
            elif base == "o":
                n = self.o.shape[1]
                self.o.data.copy_(t.narrow(1, r * n, n))
            elif base in ("gate", "up"):
                n = FFN // self.tp
                self.gate_up.data.narrow(0, 0 if base == "gate" else n, n).copy_(t.narrow(0, r * n, n))
            elif base == "norm":
                self.norm.data.copy_(t)
            elif base == "col":
                n = self.col.shape[0]
                self.col.data.copy_(t.narrow(0, r * n, n))
            elif base == "embed":
                lo = r * self.per_rank
                n = max(0, min(VOCAB - lo, self.per_rank))
                if n:
                    self.embed.data.narrow(0, 0, n).copy_(t.narrow(0, lo, n))
                if n < self.per_rank:
                    self.embed.data.narrow(0, n, self.per_rank - n).fill_(0)


def _manifest(hf: dict[str, torch.Tensor]) -> list[ManifestEntry]:
    return [ManifestEntry(n, "float32", tuple(t.shape)) for n, t in hf.items()]


def _vocab_shards(hf: dict[str, torch.Tensor], tp: int) -> list[torch.Tensor]:
    """The learner's vocabulary shards, padded as Megatron pads (here to a multiple of 3 x TP rows: 18 at TP = 2,
    9 a rank, where the engine's loaders above take 8)."""
    padded = -(-VOCAB // (3 * tp)) * 3 * tp
    return [shard_from_hf(ParamMap(["embed.weight"], "vocab"), [hf["embed.weight"]], ARCH, r, tp, padded) for r in range(tp)]


def _learner(hf: dict[str, torch.Tensor], tp: int, halo: int = 2) -> tuple[list[Piece], dict[int, list[tuple[str, torch.Tensor]]]]:
    """Each learner TP rank's pieces (the vocabulary as its rows and `halo` of each neighbour's, as the shard
    export gives it) and export."""
    pieces, exports = [], {}
    shards = _vocab_shards(hf, tp)
    edges = [vocab_edges(s, halo) for s in shards]
    for rank in range(tp):
        out = []
        for pm in MAPS.values():
            shard = shard_from_hf(pm, [hf[n] for n in pm.hf_names], ARCH, rank, tp, VOCAB)
            out += shard_pieces(pm, shard, ARCH, rank, tp)
        part, window = vocab_from_edges(shards[rank], edges, rank, tp, VOCAB, halo)
        out.append(("embed.weight", part, tuple(hf["embed.weight"].shape), window))
        pieces += [Piece(n, rank, rank, "float32", full, window) for n, _, full, window in out]
        exports[rank] = [(piece_name(n, rank), t) for n, t, _, _ in out]
    return pieces, exports


def _engine_params(hf, layouts, tp):
    """Every engine rank's parameters as its loaders make them from the whole HF tensors."""
    return {lay.rank: {p.name: fill_param(p, torch.empty(p.shape), hf.__getitem__) for p in lay.params} for lay in layouts}


def _layouts(hf, tp):
    return [probe_layout(_Engine(r, tp), _manifest(hf), r) for r in range(tp)]


@pytest.mark.parametrize("learner_tp,engine_tp", [(2, 2), (2, 4), (1, 2)])
def test_a_shard_plan_gives_each_engine_rank_the_bytes_its_loaders_would(learner_tp, engine_tp):
    hf = _hf(1)
    layouts = _layouts(hf, engine_tp)
    assert not any(lay.problem for lay in layouts), [lay.problem for lay in layouts]
    pieces, exports = _learner(hf, learner_tp)
    plan = build_shard_plan(_manifest(hf), pieces, layouts, 1e-4)  # small buckets: several per sender
    assert plan.senders == learner_tp and plan.pieces and len(plan.buckets) > 2 * learner_tp
    want = _engine_params(hf, layouts, engine_tp)
    buckets = []
    for sender, export in exports.items():
        for bucket in PlannedPacker(plan, sender, "cpu", host_numpy=False).pack(export):
            buckets.append(bucket)
            for meta in bucket.metas:
                got = bucket.buffer[meta.offset: meta.offset + meta.nbytes].view(torch.float32).view(meta.shape)
                assert torch.equal(got, want[bucket.rank][meta.name]), (sender, bucket.rank, meta.name)
    got = {(b.rank, m.name) for b in buckets for m in b.metas}
    assert got == {(r, n) for r, ps in want.items() for n in ps}  # every parameter of every rank, once
    # each engine rank reads everything (the vocabulary and the norm too) from the learner rank whose shards
    # hold its own: learner rank r for engine rank r, or (an engine of twice the learner's TP) r // 2
    for b in plan.buckets:
        assert b.sender == b.rank * learner_tp // engine_tp
    # the inverse (a replica of another layout catching up from these buckets) gives the HF tensors back
    back = hf_from_engine(plan, buckets)
    assert sorted(back) == sorted(hf) and all(torch.equal(back[n], hf[n]) for n in hf)


@pytest.mark.parametrize("tp", [2, 3, 4])
@pytest.mark.parametrize("halo", [1, 2, 5])
def test_a_ranks_vocabulary_piece_is_its_rows_and_its_neighbours_edges(tp, halo):
    """`vocab_from_edges`: a TP rank's vocabulary piece is exactly the HF rows of its window (its own shard of the
    padded vocabulary, `halo` rows of each neighbour's on either side, the padding cut), built from every rank's
    `vocab_edges` (what one gather of a few rows brings, not the whole vocabulary); the whole of it at TP 1."""
    hf = _hf(7)
    shards = _vocab_shards(hf, tp)
    halo = min(halo, shards[0].shape[0])
    edges = [vocab_edges(s, halo) for s in shards]
    rows = shards[0].shape[0]
    for rank in range(tp):
        part, window = vocab_from_edges(shards[rank], edges, rank, tp, VOCAB, halo)
        lo, hi = vocab_window(rank, tp, rows, VOCAB, halo)
        assert window == (0, lo, hi) and torch.equal(part, hf["embed.weight"][lo:hi]), (rank, window)
        assert hi == min(VOCAB, (rank + 1) * rows + halo) and lo == min(hi, max(0, rank * rows - halo))
    whole, window = vocab_from_edges(_vocab_shards(hf, 1)[0], [], 0, 1, VOCAB, halo)
    assert window is None and torch.equal(whole, hf["embed.weight"])


def test_a_vocabulary_window_short_of_the_engine_ranks_rows_makes_no_shard_plan():
    """Without the neighbours' rows the engine's rank 1 (rows 8-13) is not inside the learner's rank 1 (rows
    9-13): no shard plan (the service falls back to the gathered one), rather than a wrong row."""
    hf = _hf(8)
    pieces, _ = _learner(hf, 2, halo=0)
    with pytest.raises(PlanError, match="more than one learner rank"):
        build_shard_plan(_manifest(hf), pieces, _layouts(hf, 2), 1.0)


def test_an_engine_of_smaller_tp_than_the_learner_has_no_shard_plan():
    hf = _hf(2)
    pieces, _ = _learner(hf, 2)
    with pytest.raises(PlanError, match="more than one learner rank"):
        build_shard_plan(_manifest(hf), pieces, _layouts(hf, 1), 1.0)


def test_the_engines_own_plan_and_a_workers_check_agree():
    """A replica checks a plan it did not form by probing its workers' layouts on the HF export and localizing them
    (`shards.plan_misfit`): each must be exactly the plan's layout for its rank."""
    hf = _hf(3)
    layouts = _layouts(hf, 2)
    pieces, _ = _learner(hf, 2)
    plan = build_shard_plan(_manifest(hf), pieces, layouts, 1.0)
    assert plan.probed_manifest == _manifest(hf)
    for r in range(2):
        mine = plan_layout(plan, probe_layout(_Engine(r, 2), plan.probed_manifest, r))
        assert mine == plan.layouts[r]
    assert plan_misfit(plan, [probe_layout(_Engine(r, 2), plan.probed_manifest, r) for r in range(2)]) == ""
    gathered = build_plan(_manifest(hf), layouts, 1.0)
    assert gathered.plan_id != plan.plan_id and plan_layout(gathered, layouts[0]) == layouts[0]
    assert plan_misfit(plan, _layouts(hf, 1)).startswith("engine rank 0")  # an engine of another TP size


def test_pieces_that_do_not_match_the_export_are_refused():
    hf = _hf(4)
    pieces, _ = _learner(hf, 2)
    bad = [Piece(p.hf, p.sender, p.tp, p.dtype, (p.full[0] + 1,) + p.full[1:], p.window) if p.hf == "o.weight" else p
           for p in pieces]
    with pytest.raises(PlanError, match="o.weight@0 does not match"):
        build_shard_plan(_manifest(hf), bad, _layouts(hf, 2), 1.0)


def test_a_rank_that_would_send_nothing_makes_no_shard_plan():
    hf = _hf(5)
    pieces, _ = _learner(hf, 2)
    # a third "rank" holding only a copy of the norm: every engine rank prefers its own TP index's
    lonely = pieces + [Piece("norm.weight", 2, 2, "float32", (H,), None)]
    with pytest.raises(PlanError, match=r"learner ranks \[2\] would send nothing"):
        build_shard_plan(_manifest(hf), lonely, _layouts(hf, 2), 1.0)


def test_a_window_that_is_no_box_of_the_tensor_is_refused():
    hf = _hf(6)
    layout = _layouts(hf, 2)[0]
    p = next(p for p in layout.params if p.name == "o")
    from asyncrl.weightsync.plan import EngineLayout, Op, ParamLayout, View

    op = p.ops[0]
    odd = Op(op.dst, op.src, View(0, (4, 16), (16, 1)), op.value)  # rows of o.weight merged pairwise: no box
    bent = EngineLayout(0, (ParamLayout("o", p.dtype, p.shape, (odd,)),))
    pieces, _ = _learner(hf, 2)
    with pytest.raises(PlanError, match="o reads o.weight in a way"):
        localize_layout(bent, pieces, 2)


class _Control:
    """The engine replicas' fan-out, as `WeightPublisher.form_plan` calls it: one replica of `tp` ranks that
    forms its plan as a replica does (shards.plan_for over its ranks' probed layouts)."""

    def __init__(self, tp: int) -> None:
        self.tp, self.plans = tp, []

    async def call(self, verb, *args, timeout_s=None):  # noqa: ARG002
        import pickle

        from asyncrl.interfaces import EngineAPI
        from asyncrl.types import PlanAck
        from asyncrl.weightsync.shards import plan_for

        if verb is not EngineAPI.set_push_plan:
            raise AssertionError(verb)
        plan, why, request = None, "no plan asked for", args[0]
        if request is not None:
            manifest = pickle.loads(request.manifest)  # (service.dump_manifest)
            layouts = [probe_layout(_Engine(r, self.tp), manifest, r) for r in range(self.tp)]
            plan, why = plan_for(manifest, layouts, request.bucket_mb, pickle.loads(request.pieces) if request.pieces else ())
        self.plans.append(plan)
        return {"r0": PlanAck(replica_id="r0", plan_id=plan and plan.plan_id, plan=plan and pickle.dumps(plan), problem=why)}


class _Learner:
    """The learner group as `form_plan` calls it; `export` is its start export as the ranks answer it: one
    `PieceManifest` per TP rank (the pieces it holds, or why it cannot send them as they are)."""

    def __init__(self, pieces, problem: str = "") -> None:
        from asyncrl.types import PieceManifest, WeightExport

        by_rank = sorted({p.sender for p in pieces})
        self.export = WeightExport(pieces=[PieceManifest(problem=problem)] if problem else [
            PieceManifest(sender=r, tp=r, pieces=[(p.hf, p.dtype, p.full, p.window) for p in pieces if p.sender == r])
            for r in reversed(by_rank)])  # (the service orders them by sender)
        self.plans = []

    async def set_push_plan(self, blob, host_copies=False):
        import pickle

        self.plans.append(pickle.loads(blob) if blob is not None else None)


def _publisher(engine_tp: int, learner: _Learner, backend: str = "gloo", **cfg):
    from types import SimpleNamespace

    from asyncrl.config import WeightsyncConfig
    from asyncrl.weightsync.service import WeightPublisher

    pub = WeightPublisher(WeightsyncConfig(bucket_mb=1, **cfg), engine=None, learner=learner)
    control = _Control(engine_tp)
    pub.replicas = SimpleNamespace(control=control)
    pub.manifest = _manifest(_hf())
    pub.transport = SimpleNamespace(backend=backend)
    pub.pieces = pub._pieces(learner.export)  # as `start` reads them from the learner's start export
    pub.publisher = SimpleNamespace(set_plan=lambda plan: None)
    forgot = []
    pub.link = SimpleNamespace(forget=lambda: forgot.append(1))
    return pub, control, forgot


@pytest.mark.parametrize("engine_tp,backend,senders", [
    (2, "gloo", 2),   # equal TP: each learner rank sends its own shards
    (2, "nccl", 2),
    (1, "gloo", 1),   # an engine of smaller TP: gathered (its fused QKV spans both learner ranks)
    (2, "ipc", 1),    # ipc: always gathered
])
def test_the_service_forms_a_shard_plan_where_it_can_and_the_gathered_one_otherwise(engine_tp, backend, senders):
    import asyncio

    pieces, _ = _learner(_hf(), 2)
    learner = _Learner(pieces)
    pub, control, forgot = _publisher(engine_tp, learner, backend)
    asyncio.run(pub.form_plan())
    assert pub.plan is not None and pub.plan.senders == senders and bool(pub.plan.pieces) == (senders == 2)
    # the engines and every learner rank hold the same plan; the groups form again with the new senders
    assert control.plans[-1].plan_id == learner.plans[-1].plan_id == pub.plan.plan_id
    assert forgot == [1]
    asyncio.run(pub.form_plan())  # the same senders again: the groups stay
    assert forgot == [1]
    # each shard sender's group holds only the engine rank it feeds (engine rank r from learner rank r)
    assert pub.sender_ranks() == ({0: (0,), 1: (1,)} if senders == 2 else None)


def test_a_learner_that_cannot_send_its_shards_gets_the_gathered_plan():
    import asyncio

    learner = _Learner([], "expert parameter decoder.layers.0.mlp.experts...: sent gathered")
    pub, _, _ = _publisher(2, learner)
    asyncio.run(pub.form_plan())
    assert pub.pieces == b"" and pub.plan.senders == 1 and not pub.plan.pieces
