"""Pure logic of the learner layer: layout validation, dispatch plans, DP splits, HF name checks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.config import ConfigError, LearnerConfig
from asyncrl.learner.convert import WeightMismatchError, check_hf_tensors, expected_hf_shapes
from asyncrl.learner.model import UnsupportedModelError, model_arch, padded_vocab_size
from asyncrl.learner.parallel import (
    ParallelLayout,
    collect,
    dispatch,
    megatron_compute_plan,
    one_to_all_plan,
    pp_as_dp_plan,
    rank_coords,
    split_for_dp,
    validate_layout,
)


def _qwen2(**kw):
    from transformers import Qwen2Config

    base = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2)
    return Qwen2Config(**{**base, **kw})


# ----------------------------------------------------------------------------- split_for_dp


@given(st.lists(st.integers(), min_size=1, max_size=60), st.integers(1, 8))
def test_split_keeps_order_and_balances_counts(items, dp):
    if len(items) < dp:
        with pytest.raises(ValueError, match=f"dp_size={dp}"):
            split_for_dp(items, dp)
        return
    shards = split_for_dp(items, dp)
    assert len(shards) == dp and all(shards)
    assert [x for s in shards for x in s] == items
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


@given(st.lists(st.integers(0, 100), min_size=1, max_size=40), st.integers(1, 6))
def test_split_by_tokens_is_optimal_contiguous_partition(tokens, dp):
    if len(tokens) < dp:
        return
    items = list(range(len(tokens)))
    shards = split_for_dp(items, dp, token_counts=tokens)
    assert len(shards) == dp and all(shards)
    assert [x for s in shards for x in s] == items
    worst = max(sum(tokens[i] for i in s) for s in shards)
    assert worst == _best_max(tokens, dp)


def _best_max(tokens, k):
    """Brute-force optimum by DP over prefixes (tiny inputs)."""
    n = len(tokens)
    prefix = [0]
    for t in tokens:
        prefix.append(prefix[-1] + t)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for parts in range(1, k + 1):
        for end in range(1, n + 1):
            for start in range(parts - 1, end):
                cand = max(best[parts - 1][start], prefix[end] - prefix[start])
                best[parts][end] = min(best[parts][end], cand)
    return best[k][n]


def test_split_by_tokens_hand_case_and_errors():
    assert split_for_dp(list("abcd"), 2, token_counts=[10, 1, 1, 1]) == [["a"], ["b", "c", "d"]]
    with pytest.raises(ValueError, match="token_counts has 2 entries"):
        split_for_dp([1, 2, 3], 1, token_counts=[1, 2])


# ----------------------------------------------------------------------------- plans


def test_megatron_compute_plan_tp2_pp2_dp2():
    layout = ParallelLayout(world_size=8, tp=2, pp=2)
    plan = megatron_compute_plan(layout)
    # rank = tp + 2*dp + 4*pp
    assert plan.shard_of_rank == (0, 0, 1, 1, 0, 0, 1, 1)
    assert plan.collect_from == (4, 6)  # TP rank 0 of the last stage, per DP group
    payload = dispatch(plan, ["A", "B"])
    assert payload == ["A", "A", "B", "B", "A", "A", "B", "B"]
    assert collect(plan, [f"r{r}" for r in range(8)]) == ["r4", "r6"]


def test_pp_as_dp_and_one_to_all_plans():
    layout = ParallelLayout(world_size=4, tp=2, pp=2)
    plan = pp_as_dp_plan(layout)
    assert plan.num_shards == 2 and plan.shard_of_rank == (0, 0, 1, 1) and plan.collect_from == (0, 2)
    every = one_to_all_plan(3)
    assert dispatch(every, ["cfg"]) == ["cfg"] * 3 and collect(every, [1, 2, 3]) == [1, 2, 3]
    with pytest.raises(ValueError, match="wants 2 shards"):
        dispatch(plan, ["only one"])


@given(st.sampled_from([1, 2]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 3]))
def test_rank_coords_cover_the_grid_once(tp, pp, dp):
    layout = ParallelLayout(world_size=tp * pp * dp, tp=tp, pp=pp)
    coords = {(c.tp, c.dp, c.pp) for c in (rank_coords(r, layout) for r in range(layout.world_size))}
    assert len(coords) == layout.world_size


# ----------------------------------------------------------------------------- bad configs


@pytest.mark.parametrize(
    "layout,hf_kw,match",
    [
        (ParallelLayout(world_size=3, tp=2), {}, "world_size=3 is not divisible by TP"),
        (ParallelLayout(world_size=3, tp=3), {}, "num_attention_heads=4 is not divisible by tensor_model_parallel_size=3"),
        (ParallelLayout(world_size=4, tp=4), {}, "num_key_value_heads=2 is not divisible"),
        (ParallelLayout(world_size=3, pp=3), {}, "num_hidden_layers=4 is not divisible by PP\\*VPP=3\\*1"),
        (ParallelLayout(world_size=2, pp=2, vpp=4), {}, "PP\\*VPP=2\\*4"),
        (ParallelLayout(world_size=2, vpp=2), {}, "needs pipeline_model_parallel_size > 1"),
        (ParallelLayout(world_size=2, pp=2, vpp=2, batch_p2p_comm=True), {}, "batch_p2p_comm=True with virtual_pipeline_model_parallel_size=2"),
        (ParallelLayout(world_size=2, pp=2, vpp=2, overlap_p2p_comm=False), {}, "overlap_p2p_comm=False with virtual"),
        (ParallelLayout(world_size=2, ep=2), {}, "expert_model_parallel_size=2 but model_type='qwen2' has no experts"),
        (ParallelLayout(world_size=2, sequence_parallel=True), {}, "sequence_parallel=True needs tensor_model_parallel_size > 1"),
    ],
)
def test_bad_layouts_name_the_value(layout, hf_kw, match):
    with pytest.raises(ConfigError, match=match):
        validate_layout(layout, _qwen2(**hf_kw))


def test_experts_not_divisible_by_ep():
    from transformers import Qwen3MoeConfig

    hf = Qwen3MoeConfig(num_hidden_layers=2, num_experts=6, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ConfigError, match="num_experts=6 is not divisible by expert_model_parallel_size=4"):
        validate_layout(ParallelLayout(world_size=4, ep=4), hf)


def test_vpp_layout_with_default_p2p_is_accepted():
    cfg = LearnerConfig(world_size=2, strategy_config={
        "pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2, "overlap_p2p_comm": True,
    })
    validate_layout(ParallelLayout.from_learner_config(cfg), _qwen2())


def test_vpp_config_gets_megatron_lms_p2p_settings():
    from asyncrl.learner.model import transformer_config_from_hf

    cfg = transformer_config_from_hf(_qwen2(), {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2})
    assert (cfg.overlap_p2p_comm, cfg.batch_p2p_comm) == (True, False)


@pytest.mark.parametrize(
    "m,pp,configured,group",
    [(4, 2, 2, 2), (3, 2, 2, 3), (5, 2, 2, 3), (7, 4, 4, 7), (8, 4, 4, 4), (9, 4, 4, 5), (6, 4, 4, 6), (12, 4, 5, 6), (3, 2, 8, 3)],
)
def test_vp_group_size_satisfies_megatrons_rule(m, pp, configured, group):
    from asyncrl.learner.roles.base import vp_group_size

    g = vp_group_size(m, pp, configured)
    assert g == group
    assert pp <= g <= m and (m % g == 0 or m % g >= pp)  # what the interleaved schedule checks


def test_vp_group_size_refuses_fewer_micro_batches_than_pp():
    from asyncrl.learner.roles.base import vp_group_size

    with pytest.raises(ValueError, match="fewer than PP=4"):
        vp_group_size(3, 4, 4)


def test_learner_config_feeds_the_layout():
    cfg = LearnerConfig(world_size=8, strategy_config={"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2})
    layout = ParallelLayout.from_learner_config(cfg)
    assert (layout.tp, layout.pp, layout.dp, layout.etp) == (2, 2, 2, 2)


def test_unsupported_architectures_name_model_type():
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModelError, match="model_type='gpt2'"):
        model_arch(GPT2Config())
    with pytest.raises(UnsupportedModelError, match="use_sliding_window=True"):
        model_arch(_qwen2(use_sliding_window=True))


def test_vocab_padding():
    assert padded_vocab_size(284, {}) == 384
    assert padded_vocab_size(284, {"tensor_model_parallel_size": 2}) == 512
    assert padded_vocab_size(100, {"make_vocab_size_divisible_by": 8, "tensor_model_parallel_size": 3}) == 120


def test_hf_key_check_names_missing_unexpected_and_bad_shapes():
    hf = _qwen2(tie_word_embeddings=True)
    shapes = expected_hf_shapes(hf)
    assert "lm_head.weight" in expected_hf_shapes(_qwen2(tie_word_embeddings=False))
    assert "model.layers.3.self_attn.q_proj.bias" in shapes and "lm_head.weight" not in shapes  # tied
    check_hf_tensors(shapes, hf)
    broken = dict(shapes)
    del broken["model.layers.1.mlp.up_proj.weight"]
    broken["model.layers.9.extra.weight"] = (1,)
    broken["model.norm.weight"] = (65,)
    with pytest.raises(WeightMismatchError) as err:
        check_hf_tensors(broken, hf)
    msg = str(err.value)
    assert "model.layers.1.mlp.up_proj.weight" in msg and "model.layers.9.extra.weight" in msg
    assert "model.norm.weight: (65,) != (64,)" in msg


def test_rank0_keeps_its_rendezvous_port_bound_until_the_group_joins():
    """A probed-then-released port can be taken by another process before the store binds it
    (seen as EADDRINUSE in a learner group's setup): rank 0 binds the store first and keeps it."""
    import socket

    from asyncrl.config import AlgorithmConfig, ModelConfig
    from asyncrl.learner.rank import LearnerRank

    rank = LearnerRank(0, 2, "actor", ModelConfig(path="unused"), LearnerConfig(world_size=2), AlgorithmConfig())
    host, port = rank.master_address(30.0)
    with socket.socket() as s, pytest.raises(OSError):
        s.bind((host, port))  # held: nobody else can take it between now and setup
    assert rank.master_address(30.0) == (host, port)  # asking again gives the same store
