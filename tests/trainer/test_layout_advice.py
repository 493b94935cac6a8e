"""The learner's layout advisor (asyncrl/trainer/layout_advice.py): which layout of a learner group's GPUs it
estimates fastest among those that fit, and what it says of the configured one. Model shapes are HF configs built
here (no weights); devices are given by their size."""

from __future__ import annotations

import logging

import pytest
from transformers import Qwen2Config

from asyncrl.config import load_config
from asyncrl.trainer.layout_advice import Layout, advise, candidate_layouts, log_layout_advice, rank_bytes, relative_speed
from asyncrl.trainer.placement_choice import learner_bytes

H100 = 81_559 * 2**20  # bytes, as nvidia-smi reports the cards
H200 = 143_771 * 2**20


def _qwen(layers: int, hidden: int, heads: int, kv: int, ffn: int, tied: bool) -> Qwen2Config:
    return Qwen2Config(vocab_size=151_936, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv, intermediate_size=ffn, tie_word_embeddings=tied)


QWEN_1P5B = _qwen(28, 1536, 12, 2, 8960, tied=True)
QWEN_3B = _qwen(36, 2048, 16, 2, 11008, tied=True)
QWEN_7B = _qwen(28, 3584, 28, 4, 18944, tied=False)


def _cfg(gpus: int, tokens: int, strategy: dict | None = None, recompute: str = "none", **learner) -> object:
    """A separated run whose learner ranks hold a GPU each, micro-batches of `tokens` tokens."""
    return load_config({
        "model": {"path": "unused", "dtype": "bfloat16", "max_model_len": tokens},
        "generator": {"num_gpus": 1},
        "learner": {"world_size": gpus, "num_gpus_per_rank": 1, "micro_batch_size": 1,
                    "max_tokens_per_micro_batch": tokens, "strategy_config": dict(strategy or {}),
                    "memory": {"recompute": recompute}, **learner},
    })


def test_the_speeds_are_the_measured_ones_and_one_gpu_is_one():
    # issue 67, two H100s, 1.5B at 8 x 8192: TP=2 + SP trained 0.81x one GPU's tokens/s, CP=2 0.40x
    assert relative_speed(Layout(), 8) == 1.0
    assert relative_speed(Layout(tp=2, sequence_parallel=True), 8) == pytest.approx(0.81)
    assert relative_speed(Layout(cp=2), 8) == pytest.approx(0.40)
    assert relative_speed(Layout(dp=2), 8) == pytest.approx(1.9)
    assert relative_speed(Layout(pp=2), 3) == pytest.approx(2 * 0.95 * 3 / 4)  # the bubble of 3 micro-batches, 2 stages
    assert relative_speed(Layout(recompute="full"), 8) == pytest.approx(0.75)


def test_one_rank_without_parallelism_needs_what_the_placement_choice_counts():
    for recompute in ("none", "full"):
        cfg = _cfg(1, 8192, recompute=recompute)
        assert rank_bytes(QWEN_3B, Layout(recompute=recompute), 8192, 1024, cfg.learner) == pytest.approx(
            learner_bytes(QWEN_3B, 8192, 1024, cfg.learner))


def test_each_parallelism_divides_what_it_splits():
    one = rank_bytes(QWEN_7B, Layout(), 8192, 1024)
    tp = rank_bytes(QWEN_7B, Layout(tp=2, sequence_parallel=True), 8192, 1024)
    assert tp == pytest.approx(one / 2)  # state, activations (norms' inputs too with SP) and the vocab's logits
    assert rank_bytes(QWEN_7B, Layout(tp=2), 8192, 1024) > tp  # without SP the norms' inputs are whole on each rank
    pp, cp = rank_bytes(QWEN_7B, Layout(pp=2), 8192, 1024), rank_bytes(QWEN_7B, Layout(cp=2), 8192, 1024)
    assert one > pp > one / 2 and one > cp > one / 2  # PP halves the state, CP the activations
    assert rank_bytes(QWEN_7B, Layout(dp=8), 8192, 1024) == one  # DP keeps a whole replica (no distributed optimizer)


def test_candidates_are_the_layouts_megatron_takes_for_the_model():
    layouts = candidate_layouts(QWEN_1P5B, 8)  # 12 heads, 2 KV heads, 28 layers
    assert {lay.tp for lay in layouts} == {1, 2} and {lay.pp for lay in layouts} == {1, 2, 4}
    assert all(lay.gpus == 8 and lay.sequence_parallel == (lay.tp > 1) for lay in layouts)
    assert Layout(tp=2, cp=2, pp=1, dp=2, recompute="full", sequence_parallel=True) in layouts


def test_a_model_that_fits_one_gpu_is_advised_data_parallel_and_tp_is_warned_as_slower():
    cfg = _cfg(2, 8192, {"tensor_model_parallel_size": 2, "sequence_parallel": True})
    advice = advise(cfg, QWEN_1P5B, H100)
    assert advice.best.layout == Layout(dp=2)
    assert advice.level == logging.WARNING and "0.43x the training throughput of DP 2 x TP 1" in advice.message
    assert "learner.strategy_config without TP, CP or PP, learner.memory.recompute: none" in advice.message
    assert advise(_cfg(2, 8192), QWEN_1P5B, H100).level == logging.INFO  # the default (DP) is the advice


def test_long_sequences_that_do_not_fit_are_advised_full_recompute_before_context_parallelism():
    # 2 x 32k tokens of a 3B on one H200 beside its engine (deploy/rlhf-gpu1.yaml's sharing): out of memory without
    # recompute (the 2.0 bug this advice exists for); CP would need a second GPU and trains at 0.40x
    cfg = load_config({
        "model": {"path": "unused", "dtype": "bfloat16", "max_model_len": 32768},
        "generator": {"num_gpus": 0.4, "engine_kwargs": {"gpu_memory_utilization": 0.3}},
        "learner": {"num_gpus_per_rank": 0.5, "micro_batch_size": 2, "max_tokens_per_micro_batch": 65536},
    })
    advice = advise(cfg, QWEN_3B, H200)
    assert advice.best.layout == Layout(recompute="full") and not advice.configured.fits(advice.room)
    assert advice.level == logging.WARNING and "learner.memory.recompute: full" in advice.message
    assert advice.room == pytest.approx((0.9 - 0.3) * H200)  # the engine's share is not the learner's
    on_two = advise(_cfg(2, 65536, {"context_parallel_size": 2}), QWEN_3B, H200)
    assert on_two.best.layout == Layout(dp=2, recompute="full")  # two GPUs: DP with recompute beats CP


def test_a_7b_on_eight_h100s_is_not_advised_a_layout_that_does_not_fit():
    advice = advise(_cfg(8, 8192), QWEN_7B, H100)  # every rank a whole replica: ~137 GB of state alone
    assert not advice.configured.fits(advice.room) and advice.best.fits(advice.room)
    assert advice.best.layout.dp < 8 and advice.level == logging.WARNING and "more than fits" in advice.message
    nothing = advise(_cfg(1, 8192), QWEN_7B, H100)  # one H100 holds no 7B with Adam on the device
    assert nothing.best is None and "learner.memory.optimizer: host" in nothing.message


def test_the_advice_is_logged_at_start_only_for_a_gpu_learner_and_never_fails_it(caplog, demo_model_path):
    cfg = load_config({"model": {"path": str(demo_model_path)},
                       "learner": {"world_size": 2, "num_gpus_per_rank": 1,
                                   "strategy_config": {"tensor_model_parallel_size": 2}}})
    with caplog.at_level(logging.INFO, logger="asyncrl.trainer.layout_advice"):
        advice = log_layout_advice(cfg, probe=lambda: H100)
        assert advice is not None and advice.best.layout.dp == 2 and "learner layout: the configured" in caplog.text
        assert log_layout_advice(cfg.model_copy(update={"learner": cfg.learner.model_copy(
            update={"num_gpus_per_rank": 0.0})}), probe=lambda: H100) is None  # a CPU learner: nothing to advise
        assert log_layout_advice(cfg, probe=lambda: None) is None  # no GPU found
        missing = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": "/nonexistent"})})
        assert log_layout_advice(missing, probe=lambda: H100) is None and "advice not given" in caplog.text


def test_asyncrl_layout_prints_the_advice_for_a_config_file(tmp_path, capsys, demo_model_path):
    from asyncrl.cli import main

    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{path: {demo_model_path}}}\nlearner: {{world_size: 2, strategy_config: {{context_parallel_size: 2}}}}\n")
    assert main(["layout", str(config), "--gpu-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "the configured DP 1 x TP 1 x CP 2" in out and "fastest that fits: DP 2 x TP 1 x CP 1 x PP 1" in out
    assert main(["layout", str(tmp_path / "missing.yaml"), "--gpu-gib", "80"]) == 2
    assert "config file not found" in capsys.readouterr().err
    config.write_text("model: {path: /models/elsewhere}\n")  # the model's config from another directory
    assert main(["layout", str(config), "--gpu-gib", "80"]) == 2 and "no readable" in capsys.readouterr().err
    assert main(["layout", str(config), "--gpu-gib", "80", "--gpus", "4", "--model", str(demo_model_path)]) == 0
    assert "4 rank(s)" in capsys.readouterr().out
    encoder = tmp_path / "gpt2"  # a config without the sizes the advisor reads: a clear error, not a traceback
    encoder.mkdir()
    (encoder / "config.json").write_text('{"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2}')
    assert main(["layout", str(config), "--gpu-gib", "80", "--model", str(encoder)]) == 2
    assert "not a decoder the advisor can size" in capsys.readouterr().err


def test_a_sharded_optimizer_lets_data_parallelism_hold_a_model_its_ranks_could_not_hold_whole():
    """The 7B on two H200s at 4,096 tokens: each rank holding the whole optimizer needs ~147 GiB; Megatron's
    distributed optimizer (learner.memory.optimizer: sharded) halves the fp32 main params and Adam's moments, ~105 GiB,
    and DP 2 is estimated faster than any model-parallel layout that fits."""
    advice = advise(_cfg(2, 4096), QWEN_7B, H200)
    assert advice.level == logging.WARNING and not advice.configured.fits(advice.room)
    assert advice.best.layout == Layout(dp=2, optimizer="sharded")
    assert "learner.memory.optimizer: sharded" in advice.message
    device, sharded = (rank_bytes(QWEN_7B, Layout(dp=2, optimizer=o), 4096, 1024) for o in ("device", "sharded"))
    assert device - sharded == pytest.approx(6 * 7_614_699_008)  # 12 bytes a parameter, half of them on each rank
    # configured so, it is what the advice estimates; a LoRA actor or a host optimizer is never offered it
    assert advise(_cfg(2, 4096, memory={"optimizer": "sharded"}), QWEN_7B, H200).configured.layout.optimizer == "sharded"
    lora = advise(_cfg(2, 4096, lora={"rank": 16}), QWEN_7B, H200)
    assert lora.best is not None and lora.best.layout.optimizer == "device"


def test_an_advised_layout_is_taken_only_where_the_config_asks_for_it():
    """learner.layout: advised turns the advice into the learner's config (sizes, SP, recompute, the sharded
    optimizer), validated as written so; configured (the default) keeps the layout, and so does an advice without a
    layout that fits."""
    from asyncrl.trainer.layout_advice import advised_config

    tp2 = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
    configured = _cfg(2, 4096, tp2)
    advice = advise(configured, QWEN_7B, H200)  # DP 2 with the sharded optimizer: ~1.9x one GPU against TP 2's 0.81x
    assert advice.best.layout == Layout(dp=2, optimizer="sharded")
    assert advised_config(configured, advice) is configured
    asked = _cfg(2, 4096, tp2, layout="advised")
    taken = advised_config(asked, advise(asked, QWEN_7B, H200))
    assert taken.learner.strategy_config.get("tensor_model_parallel_size", 1) == 1
    assert "sequence_parallel" not in taken.learner.strategy_config and taken.learner.memory.optimizer == "sharded"
    assert taken.learner.world_size == 2 and taken.learner.layout == "advised"
    # long sequences on one rank: full recompute, written as Megatron's options too
    long = _cfg(1, 65536, layout="advised")
    full = advised_config(long, advise(long, QWEN_3B, H200))
    assert full.learner.memory.recompute == "full" and full.learner.strategy_config["recompute_granularity"] == "full"
    # nothing fits: the configured layout stands (the advice warned)
    huge = _cfg(1, 8192, layout="advised")
    nothing = advise(huge, QWEN_7B, H100)
    assert nothing.best is None and advised_config(huge, nothing) is huge
