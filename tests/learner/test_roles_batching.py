"""Pure logic of the learner roles: token alignment, micro-batch plans, packing, DP split,
exact gradient-accumulation shares, LR schedule, profiler trace. No process, no Megatron."""

from __future__ import annotations

import json
import math

import pytest
import torch

from asyncrl.algorithms import aggregate
from asyncrl.algorithms.correction import Correction
from asyncrl.config import LearnerConfig, ProfilerConfig
from asyncrl.learner.batching import build_micro_batch, make_micro_batches, plan_micro_batches, response_tensor, split_by_groups, unpad_response
from asyncrl.learner.profiler import StepProfiler
from asyncrl.learner.roles.accumulate import behavior_loss_mask, denominator
from asyncrl.learner.roles.optim import lr_at
from asyncrl.types import Sample


def _sample(prompt, response, group=0, behavior=None):
    return Sample(
        prompt_ids=list(prompt), response_ids=list(response),
        behavior_logprobs=list(behavior if behavior is not None else [-1.0] * len(response)),
        versions=[0] * len(response), reward=0.0, group_id=group,
    )


def test_alignment_hand_example():
    # prompt [10, 11], response [20, 21, 22]: input = 10 11 20 21 22; output at column 1 predicts
    # 20, column 2 predicts 21, column 3 predicts 22. Second sample shorter, right padded.
    s0, s1 = _sample([10, 11], [20, 21, 22]), _sample([12], [30])
    mb = build_micro_batch([s0, s1], [0, 1], response_width=3)
    assert mb.input_ids.tolist() == [[10, 11, 20, 21, 22], [12, 30, 0, 0, 0]]
    assert mb.attention_mask is None
    t = mb.input_ids.shape[1]
    assert mb.gather_index[0].tolist() == [1, 2, 3]
    assert mb.gather_index[1, :1].tolist() == [t + 0]
    assert mb.response_mask.tolist() == [[True, True, True], [True, False, False]]
    assert mb.labels.tolist() == [[20, 21, 22], [30, 0, 0]]
    # The label of each gathered position is the next input token.
    flat_ids = mb.input_ids.reshape(-1)
    sel = mb.gather_index[mb.response_mask]
    assert flat_ids[sel + 1].tolist() == mb.labels[mb.response_mask].tolist()
    assert mb.last_token_index.tolist() == [4, t + 1]


def test_a_multi_turn_loss_mask_keeps_the_inner_prompt_tokens_out_of_the_loss():
    """An episode's response holds a follow-up question (mask 0) between sampled turns (mask 1): the
    tokens stay in the input (the model reads them), the loss and the token count skip them."""
    episode = _sample([10, 11], [20, 21, 30, 31, 22])
    episode.loss_mask = [1, 1, 0, 0, 1]
    plain = _sample([12], [40, 41])
    for pack in (False, True):
        mb = build_micro_batch([episode, plain], [0, 1], response_width=5, pack=pack)
        assert mb.input_ids.reshape(-1)[:7].tolist() == [10, 11, 20, 21, 30, 31, 22]
        assert mb.response_mask.tolist() == [[True, True, False, False, True], [True, True, False, False, False]]
        assert mb.labels[mb.response_mask].tolist() == [20, 21, 22, 40, 41]
        assert denominator(mb.response_mask, "token-mean") == 5
    episode.loss_mask = [1, 0]
    with pytest.raises(ValueError, match="loss_mask of 2 for 5 response tokens"):
        build_micro_batch([episode], [0], response_width=5)


def test_behaviour_logprobs_share_the_response_layout():
    samples = [_sample([1], [2, 3], behavior=[-0.5, -0.25]), _sample([1, 2], [4], behavior=[-2.0])]
    rows = response_tensor([s.behavior_logprobs for s in samples], [1, 0], width=2)
    assert rows.tolist() == [[-2.0, 0.0], [-0.5, -0.25]]
    assert unpad_response(rows, [1, 2]) == [[-2.0], [-0.5, -0.25]]


def test_packing_resets_positions_and_blocks_attention():
    s0, s1 = _sample([5, 6], [7]), _sample([8], [9, 10])
    mb = build_micro_batch([s0, s1], [0, 1], response_width=2, pack=True)
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 9, 10]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1, 2]]
    allowed = ~mb.attention_mask[0, 0]
    assert allowed[3, :3].sum() == 0  # second sequence never sees the first
    assert allowed[5, 3:].tolist() == [True, True, True]
    assert allowed[1].tolist() == [True, True, False, False, False, False]
    assert mb.gather_index.tolist() == [[1, 0], [3, 4]]
    flat = mb.input_ids.reshape(-1)
    assert flat[mb.gather_index[mb.response_mask] + 1].tolist() == [7, 9, 10]


def test_micro_batches_by_count_and_token_budget():
    assert plan_micro_batches([5] * 5, 2) == [[0, 1], [2, 3], [4]]
    # Budget 10: 4+5 fit, 3 opens a new group, 12 exceeds the budget and goes alone.
    assert plan_micro_batches([4, 5, 3, 6, 12, 1], 99, max_tokens=10) == [[0, 1], [2, 3], [4], [5]]
    samples = [_sample([1] * p, [2] * r) for p, r in [(2, 2), (3, 3), (1, 1), (4, 4)]]
    mbs = make_micro_batches(samples, micro_batch_size=8, max_tokens=8)
    assert [mb.sample_index for mb in mbs] == [[0], [1, 2], [3]]
    assert all(mb.num_tokens <= 8 for mb in mbs)
    assert {mb.response_mask.shape[1] for mb in mbs} == {4}  # batch-wide response width


def test_dp_split_keeps_order_and_groups():
    groups = [0, 0, 0, 1, 1, 2, 2, 2, 2, 3]
    shards = split_by_groups(groups, 2)
    assert [i for s in shards for i in s] == list(range(len(groups)))
    for s in shards:
        assert s
    owner = {i: d for d, s in enumerate(shards) for i in s}
    for g in set(groups):
        assert len({owner[i] for i, gg in enumerate(groups) if gg == g}) == 1
    # Fewer groups than DP ranks: groups cannot stay whole, every rank still gets samples.
    assert split_by_groups([7, 7, 7, 7], 2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError):
        split_by_groups([0], 2)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_micro_batch_shares_sum_to_full_batch_loss(mode):
    g = torch.Generator().manual_seed(0)
    values = torch.randn(7, 5, generator=g)
    mask = torch.rand(7, 5, generator=g) > 0.3
    mask[3] = False  # a row without valid tokens
    full = aggregate(values, mask, mode)
    total_d = denominator(mask, mode)
    shares = sum(
        aggregate(values[a:b], mask[a:b], mode) * denominator(mask[a:b], mode) / total_d
        for a, b in [(0, 2), (2, 3), (3, 7)]
    )
    assert torch.allclose(shares, full, atol=1e-6)


def test_behavior_loss_mask_drops_capped_tokens():
    mask = torch.tensor([[True, True, False]])
    old = torch.tensor([[0.0, 0.0, 0.0]])
    beh = torch.tensor([[-0.1, -3.0, -9.0]])  # weights e^0.1, e^3 (> cap 5), masked
    assert behavior_loss_mask(mask, old, beh, Correction(upper=5.0)).tolist() == [[True, False, False]]
    assert behavior_loss_mask(mask, old, None, Correction(upper=5.0)).tolist() == [[True, True, False]]


def test_lr_schedule():
    cfg = LearnerConfig(lr=1.0, min_lr=0.1, lr_warmup_steps=2, lr_decay_style="cosine", lr_decay_steps=4)
    assert [lr_at(s, cfg) for s in (0, 1)] == [0.5, 1.0]
    assert lr_at(2, cfg) == pytest.approx(1.0)
    assert lr_at(4, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert lr_at(100, cfg) == pytest.approx(0.1)
    lin = LearnerConfig(lr=1.0, min_lr=0.0, lr_decay_style="linear", lr_decay_steps=10)
    assert lr_at(5, lin) == pytest.approx(0.5)
    assert lr_at(3, LearnerConfig(lr=0.3)) == 0.3


def test_profiler_writes_one_trace_for_the_chosen_rank_and_range(tmp_path):
    cfg = ProfilerConfig(use_profile=True, profile_ranks=[1], step_start=2, step_end=3, save_path=str(tmp_path))
    chosen, other = StepProfiler(cfg, rank=1), StepProfiler(cfg, rank=0)
    for _ in range(4):
        for prof in (chosen, other):
            with prof.step():
                torch.ones(8, 8) @ torch.ones(8, 8)
    assert other.trace_path is None
    assert chosen.trace_path == tmp_path / "rank1_steps2-3.json"
    events = json.loads(chosen.trace_path.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"asyncrl/step_2", "asyncrl/step_3"} <= names
    assert "asyncrl/step_1" not in names and "asyncrl/step_4" not in names


def test_the_heap_profile_names_the_line_whose_allocations_grew_over_its_steps(tmp_path):
    """`heap`: the lines whose Python allocations grew from step_start to step_end, largest first, for the
    chosen rank only; a list that grows every step is named, with its growth."""
    cfg = ProfilerConfig(heap=True, profile_ranks=[0], step_start=2, step_end=4, save_path=str(tmp_path))
    chosen, other = StepProfiler(cfg, rank=0), StepProfiler(cfg, rank=1)
    kept: list[bytes] = []
    for _ in range(5):
        for prof in (chosen, other):
            with prof.step():
                kept.append(bytes(256 * 1024))  # the leak: 256 KiB a step, kept
    assert other.heap_path is None and chosen.trace_path is None  # (no torch trace: use_profile is off)
    assert chosen.heap_path == tmp_path / "rank0_heap_steps2-4.txt"
    head, columns, first, *_ = chosen.heap_path.read_text().splitlines()
    assert "steps 2-4 (3)" in head and "RSS" in head and columns.startswith("size_diff_kib")
    kib, count, where = first.split(" ", 2)
    assert "test_roles_batching.py" in where and float(kib) >= 3 * 256  # (at least the chosen rank's three steps)
    import tracemalloc

    assert not tracemalloc.is_tracing()  # stopped again: it was not on before


def test_offload_round_trip_keeps_state_and_reports_memory():
    from asyncrl.config import RoleOffload
    from asyncrl.learner.offload import Offloader

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]

    class _Wrapped:  # what move_optimizer_state expects of a Megatron optimizer
        optimizer = opt

    off = Offloader([model], _Wrapped(), RoleOffload(param_offload=True, grad_offload=True, optimizer_offload=True))
    with off.onloaded():
        assert not off.offloaded
        assert all(p.device == before[0].device for p in model.parameters())
    assert off.offloaded
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(t.device.type == "cpu" for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    report = off.last_report
    if not torch.cuda.is_available():  # host == device: nothing moves, memory reads 0
        assert report["learner/offload_noop"] == 1.0
        assert report["learner/offload_mem_before_bytes"] == report["learner/offload_mem_after_bytes"] == 0.0
    assert not Offloader([model], None, RoleOffload()).enabled


@pytest.mark.gpu
def test_params_go_to_pinned_host_buffers_reused_by_every_offload_and_come_back_in_place():
    """The hybrid switch's params release: each storage once (a tied head shares the embedding's), into pinned host
    memory (the fast copy), the same buffers at every offload, the device storage freed; back in place, so a view of a
    parameter made before still reads it."""
    from asyncrl.config import RoleOffload
    from asyncrl.learner.offload import Offloader

    emb = torch.nn.Embedding(64, 32).cuda()
    head = torch.nn.Linear(32, 64, bias=False).cuda()
    head.weight = torch.nn.Parameter(emb.weight.data)  # tied: another parameter over the same storage
    model = torch.nn.ModuleList([emb, head, torch.nn.Linear(32, 32).cuda()])
    view = emb.weight[3:7]
    before = [p.detach().clone() for p in model.parameters()]
    off = Offloader([model], None, RoleOffload(param_offload=True))
    buffers = []
    for _ in range(2):
        off.offload()
        assert all(p.data.untyped_storage().size() == 0 for p in model.parameters())
        assert len(list(model.parameters())) == 4 and len(off._params_host) == 3  # the shared storage once
        assert all(h.is_pinned() for _, h in off._params_host)
        buffers.append([h.data_ptr() for _, h in off._params_host])
        off.reload()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert torch.equal(view, before[0][3:7]) and head.weight.data_ptr() == emb.weight.data_ptr()
    assert buffers[0] == buffers[1]


GRAD_BYTES, OPT_TENSOR_BYTES, OPT_TENSORS = 10 << 30, 10 << 30, 3  # the fakes' sizes: grads, the optimizer's tensors


def _recorded_moves(monkeypatch) -> list[tuple[str, str]]:
    """The offloader's moves recorded as (part, "away" | "back") instead of made, with the bytes each would move
    (an optimizer move with a limit: whole tensors until the limit is reached, as `move_optimizer_state`'s, recorded
    as ("optimizer", "away", bytes)); this host's device is the host."""
    import asyncrl.learner.offload as off_mod

    moves: list[tuple] = []

    def optimizer(opt, dev, keep, limit_bytes=None):
        if dev.type != "cpu":
            moves.append(("optimizer", "back"))
            return OPT_TENSOR_BYTES * OPT_TENSORS
        n = OPT_TENSORS if limit_bytes is None else min(OPT_TENSORS, -(-limit_bytes // OPT_TENSOR_BYTES))
        moves.append(("optimizer", "away") if limit_bytes is None else ("optimizer", "away", n * OPT_TENSOR_BYTES))
        return n * OPT_TENSOR_BYTES

    monkeypatch.setattr(off_mod, "offload_params", lambda chunks, pool: moves.append(("params", "away")) or [("s", "h")])
    monkeypatch.setattr(off_mod, "reload_params", lambda saved: moves.append(("params", "back")))
    monkeypatch.setattr(off_mod, "free_grads", lambda chunks: moves.append(("grads", "away")) or GRAD_BYTES)
    monkeypatch.setattr(off_mod, "restore_grads", lambda chunks: moves.append(("grads", "back")))
    monkeypatch.setattr(off_mod, "move_optimizer_state", optimizer)
    monkeypatch.setattr(off_mod, "_device", lambda: torch.device("meta"))
    return moves


def test_offload_holds_nest_and_move_each_part_once(monkeypatch):
    """The hybrid learner phase holds everything; compute calls inside it move nothing; an export
    holds only the params; a part goes to host when its last holder releases it."""
    from asyncrl.config import RoleOffload
    from asyncrl.learner.offload import Offloader

    moves = _recorded_moves(monkeypatch)
    model = torch.nn.Linear(2, 2)
    off = Offloader([model], object(), RoleOffload(param_offload=True, grad_offload=True, optimizer_offload=True))

    off.offload()  # the role starts resident; the hybrid start puts it away
    assert sorted(moves) == [("grads", "away"), ("optimizer", "away"), ("params", "away")] and off.offloaded
    moves.clear()
    off.hold()  # learner phase
    assert sorted(moves) == [("grads", "back"), ("optimizer", "back"), ("params", "back")] and not off.offloaded
    moves.clear()
    with off.onloaded():  # a compute call inside the phase
        pass
    assert moves == []
    off.release(("grads", "optimizer"))  # before the push: the export still needs the params
    assert sorted(moves) == [("grads", "away"), ("optimizer", "away")]
    moves.clear()
    with off.onloaded(("params",)):  # the export
        pass
    assert moves == []
    off.release(("params",))
    assert moves == [("params", "away")]
    moves.clear()
    with off.onloaded(("params",)):  # an export outside any hold brings the params back and away again
        pass
    assert moves == [("params", "back"), ("params", "away")]
    assert off.holds() == {"params": 0, "grads": 0, "optimizer": 0}
    with pytest.raises(RuntimeError, match="release of 'grads', which nobody holds"):
        off.release(("grads",))
    with pytest.raises(ValueError, match="offload parts must be among"):
        off.hold(("kv_cache",))


def test_when_short_keeps_flagged_state_while_the_engines_wake_fits_and_moves_it_when_it_does_not(monkeypatch):
    """hybrid `learner_offload: when_short`: one decision per switch (free device memory against what the
    engines' wake needs) governs every release until the next; the params follow the grads' decision."""
    import asyncrl.learner.offload as off_mod
    from asyncrl.config import RoleOffload
    from asyncrl.learner.offload import Offloader

    moves = _recorded_moves(monkeypatch)
    free = {"bytes": 30 << 30}
    monkeypatch.setattr(off_mod, "device_free_bytes", lambda: free["bytes"])
    off = Offloader([torch.nn.Linear(2, 2)], object(), RoleOffload(param_offload=True, grad_offload=True, optimizer_offload=True))
    off.hold()
    off.release()  # the hybrid start: no decision yet, so everything goes to the host
    assert off.offloaded
    moves.clear()

    off.hold()  # a learner phase: back on the device
    assert off.decide_residency(26 << 30)  # 30 GiB free >= 26 GiB for the engines' wake
    assert off.last_report["learner/state_kept"] == 1.0 and off.last_report["learner/residency_need_bytes"] == 26 << 30
    off.release(("grads", "optimizer"))
    off.release(("params",))  # after the push: follows the decision
    with off.onloaded():  # a compute call outside the phase finds it all there
        pass
    assert not off.offloaded and sorted(moves) == [("grads", "back"), ("optimizer", "back"), ("params", "back")]
    moves.clear()

    off.hold()  # the next phase moves nothing: it stayed
    assert moves == []
    free["bytes"] = 20 << 30  # the learner grew (or the engines need more): short now
    assert not off.decide_residency(61 << 30) and off.last_report["learner/state_kept"] == 0.0
    off.release(("grads", "optimizer"))
    off.release(("params",))  # 41 GiB short: the grads' 10 and all three 10 GiB optimizer tensors do not cover it
    assert moves == [("grads", "away"), ("optimizer", "away", 30 << 30), ("params", "away")] and off.offloaded
    assert Offloader([torch.nn.Linear(2, 2)], None, RoleOffload()).decide_residency(1 << 40)  # nothing flagged: stays
    tied = torch.nn.Module()
    tied.a = torch.nn.Linear(3, 5, bias=False)
    tied.b = torch.nn.Linear(3, 5, bias=False)
    tied.b.weight = tied.a.weight  # one storage, counted once
    assert Offloader([tied], None, RoleOffload()).param_bytes == 5 * 3 * 4
    flat = torch.nn.Module()  # params that are views of one buffer (Megatron DDP's): the whole buffer, once
    buf = torch.zeros(40)
    flat.a, flat.b = torch.nn.Parameter(buf[:10].view(2, 5)), torch.nn.Parameter(buf[10:].view(6, 5))
    assert Offloader([flat], None, RoleOffload()).param_bytes == 40 * 4


def test_when_short_moves_only_the_bytes_short_the_free_grads_first(monkeypatch):
    """A switch that finds the engines' wake a few GiB short moves only that much: the grads first (freed, no copy),
    then the optimizer's state tensor by tensor, the params last; the learner phase brings back what left, and a
    compute call between two decisions puts as much away again."""
    import asyncrl.learner.offload as off_mod
    from asyncrl.config import RoleOffload
    from asyncrl.learner.offload import Offloader

    moves = _recorded_moves(monkeypatch)
    free = {"bytes": 20 << 30}
    monkeypatch.setattr(off_mod, "device_free_bytes", lambda: free["bytes"])
    off = Offloader([torch.nn.Linear(2, 2)], object(), RoleOffload(param_offload=True, grad_offload=True, optimizer_offload=True))
    off.hold()
    assert not off.decide_residency(26 << 30)  # 6 GiB short: the grads' 10 cover it
    off.release(("grads", "optimizer"))
    off.release(("params",))
    assert moves == [("grads", "away")] and off.offloaded and off.last_report["learner/release_parts"] == 0.0
    moves.clear()
    off.hold()
    assert moves == [("grads", "back")] and not off.offloaded
    moves.clear()
    assert not off.decide_residency(35 << 30)  # 15 GiB short: the grads, then one 10 GiB optimizer tensor
    off.release(("grads", "optimizer"))
    off.release(("params",))
    assert moves == [("grads", "away"), ("optimizer", "away", 10 << 30)]
    moves.clear()
    with off.onloaded():  # a compute call before the next decision: back, then as much away again
        pass
    assert moves == [("grads", "back"), ("optimizer", "back"), ("grads", "away"), ("optimizer", "away", 10 << 30)]
    moves.clear()
    off.hold()
    assert sorted(moves) == [("grads", "back"), ("optimizer", "back")]
    moves.clear()
    assert off.decide_residency(20 << 30)  # room again: nothing moves
    off.release(("grads", "optimizer"))
    off.release(("params",))
    assert moves == [] and not off.offloaded


def test_unflagged_parts_never_move(monkeypatch):
    import asyncrl.learner.offload as off_mod
    from asyncrl.config import RoleOffload
    from asyncrl.learner.offload import Offloader

    moves: list[str] = []
    monkeypatch.setattr(off_mod, "offload_params", lambda chunks, pool: moves.append("params away") or [])
    monkeypatch.setattr(off_mod, "free_grads", lambda chunks: moves.append("grads away"))
    off = Offloader([torch.nn.Linear(2, 2)], None, RoleOffload(param_offload=True, optimizer_offload=True))
    with off.onloaded():
        pass
    assert moves == ["params away"]  # no optimizer (None) to move, grads not flagged


def test_optimizer_offload_moves_master_copies_but_never_the_model_params(monkeypatch):
    """Mixed precision: the optimizer steps fp32 master copies of the model's bf16 params; those
    copies are optimizer state too (1.84 GiB of the 1.98 GiB left on an H100 for a 0.5B model
    before this was fixed). The model's own params move only with param_offload."""
    from asyncrl.learner.offload import move_optimizer_state

    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    model_params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_(True) for p in model_params]
    moved: list[int] = []

    def fake_to(self, *args, **kwargs):  # this host has one device: record the moves instead
        moved.append(id(self))
        return self

    class _Wrapped:
        def __init__(self, params):
            self.optimizer = torch.optim.Adam(params)

    keep = {id(p) for p in model_params}
    mixed, fp32 = _Wrapped(masters), _Wrapped(model_params)  # fp32: the optimizer steps the model's own params
    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    move_optimizer_state(mixed, torch.device("meta"), keep)
    assert len(moved) == len(masters)
    moved.clear()
    move_optimizer_state(fp32, torch.device("meta"), keep)
    assert moved == []


def test_a_limited_optimizer_move_stops_once_enough_bytes_have_moved_and_the_rest_follow_later():
    """`limit_bytes` (a switch found only some bytes short): a parameter's state moves whole, parameter after parameter,
    until the limit is reached; the bytes moved are the answer, and a move without a limit then takes whatever is
    still behind."""
    from asyncrl.learner.offload import move_optimizer_state

    params = [torch.nn.Parameter(torch.ones(n)) for n in (100, 200, 300)]

    class _Wrapped:
        optimizer = torch.optim.Adam(params)

    for p in params:
        p.grad = torch.ones_like(p)
    _Wrapped.optimizer.step()
    state = _Wrapped.optimizer.state
    nbytes = [sum(v.nbytes for v in state[p].values() if torch.is_tensor(v)) for p in params]  # moments (+ step)
    keep = {id(p) for p in params}  # (the model's own params: this host's tensors cannot become meta in place)
    meta = torch.device("meta")  # this host has one device: meta stands for the other side
    assert move_optimizer_state(_Wrapped(), meta, keep, limit_bytes=1) == nbytes[0]
    assert state[params[0]]["exp_avg"].device == meta and state[params[1]]["exp_avg"].device.type == "cpu"
    assert move_optimizer_state(_Wrapped(), meta, keep, limit_bytes=nbytes[1] + 1) == nbytes[1] + nbytes[2]
    assert all(v.device == meta for p in params for v in state[p].values() if torch.is_tensor(v))
    assert move_optimizer_state(_Wrapped(), meta, keep) == 0  # nothing left behind


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_a_warmed_optimizer_steps_exactly_as_a_fresh_one(weight_decay):
    """warm_torch_optimizer: state made and kernels run at lr 0 on zero grads; the params untouched, and the next
    real step (grads given to one param, another left without) lands bit for bit where a fresh optimizer's does."""
    from asyncrl.learner.roles.optim import warm_torch_optimizer

    def model_and_opt():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=weight_decay)

    fresh, fresh_opt = model_and_opt()
    warm, warm_opt = model_and_opt()
    before = [p.detach().clone() for p in warm.parameters()]
    warm_torch_optimizer(warm_opt)
    assert all(torch.equal(a, b) for a, b in zip(before, warm.parameters()))
    assert all(p.grad is None for p in warm.parameters()) and warm_opt.param_groups[0]["lr"] == 1e-2
    assert len(warm_opt.state) == 4 and all(float(s["step"]) == 0 for s in warm_opt.state.values())
    for _ in range(3):
        for m, opt in ((fresh, fresh_opt), (warm, warm_opt)):
            opt.zero_grad(set_to_none=True)
            m[0](torch.arange(8.0).reshape(2, 4)).square().sum().backward()  # m[1] gets no grad
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), warm.parameters()))
    for p, q in zip(fresh.parameters(), warm.parameters()):
        sa, sb = fresh_opt.state.get(p, {}), warm_opt.state[q]
        assert all(torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])) for k in sa)
    with pytest.raises(ValueError, match="already has state"):
        warm_torch_optimizer(warm_opt)

