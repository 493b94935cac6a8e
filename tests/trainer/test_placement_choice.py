"""`hybrid.enabled: auto` (asyncrl/trainer/placement_choice.py): which placement a one-GPU run takes, why, and the
config that carries it out. Model shapes are HF configs built here (no weights)."""

from __future__ import annotations

import pytest
from transformers import Qwen2Config

from asyncrl.config import HybridConfig, load_config
from asyncrl.trainer.placement import build_placement
from asyncrl.trainer.placement_choice import apply_choice, choose_placement, layer_activation_bytes, model_params, resolve_placement

H200 = 143_771 * 2**20  # bytes, as nvidia-smi reports the card


def _qwen(layers: int, hidden: int, heads: int, kv: int, ffn: int, tied: bool) -> Qwen2Config:
    return Qwen2Config(vocab_size=151_936, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv, intermediate_size=ffn, tie_word_embeddings=tied)


QWEN_3B = _qwen(36, 2048, 16, 2, 11008, tied=True)
QWEN_7B = _qwen(28, 3584, 28, 4, 18944, tied=False)


def _one_gpu(**over) -> object:
    """deploy/rlhf-gpu1.yaml's sharing of one GPU (engine 0.4 of it at 30 % of its memory, learner 0.5)."""
    raw = {"model": {"path": "unused", "dtype": "bfloat16", "max_model_len": 384},
           "generator": {"num_gpus": 0.4, "engine_kwargs": {"gpu_memory_utilization": 0.3}},
           "learner": {"num_gpus_per_rank": 0.5, "micro_batch_size": 16},
           "hybrid": {"enabled": "auto"}}
    for section, values in over.items():
        raw.setdefault(section, {}).update(values)
    return load_config(raw)


def test_parameter_counts_match_the_built_checkpoints():
    # what benchmarks/make_random_qwen2.py reported for these shapes (the 3B on the H200, 2026-12-01)
    assert model_params(QWEN_3B) == 3_085_938_688
    assert model_params(_qwen(24, 896, 14, 2, 4864, tied=True)) == 494_032_768


def test_a_3b_beside_its_engine_fits_one_h200_so_it_runs_separated():
    choice = choose_placement(_one_gpu(), QWEN_3B, H200)
    assert not choice.hybrid and choice.name == "separated"
    assert "both fit at once" in choice.reason and "3.09B parameters" in choice.reason


def test_a_7b_does_not_fit_beside_its_engine_so_it_runs_hybrid_with_sleep_and_offload():
    cfg = _one_gpu(learner={"actor": {"grad_offload": False}})  # a flag the user set stays as set
    choice = choose_placement(cfg, QWEN_7B, H200)
    assert choice.hybrid and "take turns" in choice.reason
    done = apply_choice(cfg, choice)
    assert done.hybrid.enabled is True and done.generator.engine_kwargs["enable_sleep_mode"] is True
    assert done.generator.engine_kwargs["gpu_memory_utilization"] == 0.3
    assert (done.learner.actor.param_offload, done.learner.actor.grad_offload, done.learner.actor.optimizer_offload) == (
        True, False, True)
    assert cfg.hybrid.enabled == "auto"  # the given config is left as it was


@pytest.mark.parametrize("learner, per_param, hybrid", [
    ({"lora": {"rank": 64}}, "x 2 B", False),  # frozen bf16 weights alone: no grads, no optimizer state
    ({"memory": {"optimizer": "host"}}, "x 10 B", True),  # Adam's moments on the host: 71 GiB + 28 GiB activations
    ({"memory": {"optimizer": "host", "recompute": "full"}}, "x 10 B", False),  # ... and each layer's input alone
])
def test_lora_a_host_optimizer_and_recompute_count_in_the_choice(learner, per_param, hybrid):
    """LoRA, a host optimizer and full recompute shrink what the actor keeps on the device: the 7B that takes turns
    with its engine by default (above) fits beside it with LoRA, or with both of the others, and `auto` says what
    it counted."""
    choice = choose_placement(_one_gpu(learner=learner), QWEN_7B, H200)
    assert choice.hybrid is hybrid and per_param in choice.reason, choice.reason


def test_a_wide_swiglu_micro_batch_counts_what_it_keeps():
    """The 7B with LoRA beside its engine ran out of memory on one H200 with micro-batches of 16 x 1,152 tokens
    (18,432: 89.4 GiB held by the learner when it failed in its warm-up's forward, the engine 45.6 GiB), where
    Megatron's 34 h bytes a token and layer said 74 GiB; with micro-batches of 4 it trained beside the engine. The
    estimate counts Qwen's SwiGLU (FFN 5.3 h): the first takes turns, the second runs separated."""
    for micro_batch, hybrid in ((16, True), (4, False)):
        cfg = _one_gpu(model={"max_model_len": 1152}, learner={"lora": {"rank": 64}, "micro_batch_size": micro_batch})
        choice = choose_placement(cfg, QWEN_7B, H200)
        assert choice.hybrid is hybrid, choice.reason
    assert layer_activation_bytes(QWEN_7B) > 34 * QWEN_7B.hidden_size * 1.35


@pytest.mark.parametrize("over, device, words", [
    ({}, None, "no GPU"),
    ({"generator": {"num_gpus": 1}, "learner": {"num_gpus_per_rank": 1}}, H200, "devices of their own"),
])
def test_no_shared_device_means_separated(over, device, words):
    choice = choose_placement(_one_gpu(**over), QWEN_7B, device)
    assert not choice.hybrid and words in choice.reason
    assert apply_choice(_one_gpu(**over), choice).hybrid.enabled is False


def test_resolving_leaves_a_set_placement_alone_and_decides_auto(demo_model_path, caplog):
    fixed = load_config({"model": {"path": str(demo_model_path)}, "hybrid": {"enabled": False}})
    assert resolve_placement(fixed, probe=lambda: pytest.fail("no probe for a set placement")) is fixed
    auto = load_config({"model": {"path": str(demo_model_path)}, "hybrid": {"enabled": "auto"}})
    with caplog.at_level("WARNING"):
        done = resolve_placement(auto, probe=lambda: None)  # a CPU-only host
    assert done.hybrid.enabled is False and "placement (hybrid.enabled: auto): separated: no GPU" in caplog.text


def test_auto_without_a_readable_model_config_is_a_config_error_naming_the_path(tmp_path):
    from asyncrl.config import ConfigError

    auto = load_config({"model": {"path": str(tmp_path / "nowhere")}, "hybrid": {"enabled": "auto"}})
    with pytest.raises(ConfigError, match=r"hybrid.enabled='auto' sizes the learner from model.path=.*nowhere"):
        resolve_placement(auto, probe=lambda: None)


def test_an_unresolved_auto_never_reaches_the_placement_switch():
    with pytest.raises(ValueError, match="decided when the app starts"):
        build_placement(HybridConfig(enabled="auto"), None, None, [])
