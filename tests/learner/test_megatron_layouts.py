"""Real Megatron-core in real processes (gloo on CPU, NCCL on two GPUs): HF parity, round trips,
checkpoints, EP.

Two launches of two ranks each (see _workers.py) feed all tests of this module.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.learner import _workers
from tests.learner._device import expected_backend
from tests.learner._launch import run_ranks

pytestmark = pytest.mark.slow

IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 11, 60, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Move weights far from init so that any layout mistake shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.5 * noise)  # decisive routing
            else:
                p.copy_(0.08 * noise)


def _save_tiny(tmp: Path, name: str, config) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    _randomize(model, seed=len(name))
    out = tmp / name
    model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, str]:
    from transformers import Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    tmp = tmp_path_factory.mktemp("tiny")
    common = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
    return {
        # head_dim 32 != hidden/heads 16, untied, qk-norm
        "qwen3": _save_tiny(tmp, "qwen3", Qwen3Config(**common, intermediate_size=128, head_dim=32,
                                                      tie_word_embeddings=False)),
        # shared expert with gate, unnormalised top-k, and a dense layer (mlp_only_layers)
        "qwen2_moe": _save_tiny(tmp, "qwen2_moe", Qwen2MoeConfig(
            **common, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1],
            tie_word_embeddings=False)),
        "qwen3_moe": _save_tiny(tmp, "qwen3_moe", Qwen3MoeConfig(
            **common, intermediate_size=96, moe_intermediate_size=32, head_dim=16, num_experts=4,
            num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False)),
    }


def _hf_logits(path: str | Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(IDS).logits


def _hf_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "model.safetensors"))


@pytest.fixture(scope="module")
def tp_run(demo_model_path, tiny_dirs, tmp_path_factory) -> dict:
    ckpt = tmp_path_factory.mktemp("ckpt") / "step7"
    results = run_ranks(_workers.run_tp, 2, str(demo_model_path), tiny_dirs["qwen3"], IDS, str(ckpt), _lora_weights(demo_model_path))
    return {"ranks": results, "ckpt": ckpt, "demo": demo_model_path}


@pytest.fixture(scope="module")
def pp_ep_run(demo_model_path, tiny_dirs, tmp_path_factory) -> dict:
    moe = [tiny_dirs["qwen2_moe"], tiny_dirs["qwen3_moe"]]
    ckpt = tmp_path_factory.mktemp("ckpt_vpp") / "step3"
    return {"ranks": run_ranks(_workers.run_pp_ep, 2, str(demo_model_path), moe, IDS, str(ckpt), _lora_weights(demo_model_path)),
            "ckpt": ckpt}


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def _assert_bit_exact(exported: dict[str, torch.Tensor], original: dict[str, torch.Tensor]) -> None:
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


# ----------------------------------------------------------------------------- TP


def test_ranks_ran_on_the_expected_backend(tp_run, pp_ep_run):
    for run in (tp_run, pp_ep_run):
        where = [r["where"] for r in run["ranks"]]
        assert [w["backend"] for w in where] == [expected_backend()] * 2, where
        devices = [w["device"] for w in where]
        assert devices == (["cuda:0", "cuda:1"] if torch.cuda.is_available() else ["cpu", "cpu"]), where


def test_rank_layout_matches_megatron(tp_run, pp_ep_run):
    for run in (tp_run, pp_ep_run):
        for r in run["ranks"]:
            assert r["coords"]["ours"] == r["coords"]["megatron"]


def test_tp2_and_tp1_logits_match_transformers(tp_run, demo_model_path):
    ref = _hf_logits(demo_model_path)
    r0, r1 = tp_run["ranks"]
    assert r1["tp2_logits"] is None  # only TP rank 0 reports
    assert _close(r0["tp2_logits"], ref) < 1e-4
    for r in (r0, r1):  # TP=1, DP=2: both are TP rank 0 of the last stage
        assert _close(r["tp1_logits"], ref) < 1e-4


def test_tp2_round_trip_is_bit_exact(tp_run, demo_model_path):
    _assert_bit_exact(tp_run["ranks"][0]["tp2_export"], _hf_tensors(demo_model_path))


def test_global_grad_norm_counts_each_weight_once(tp_run, demo_model_path):
    full = math.sqrt(sum(t.double().pow(2).sum().item() for t in _hf_tensors(demo_model_path).values()))
    for r in tp_run["ranks"]:
        before, after = r["tp2_grad_norm"]
        assert before == pytest.approx(full, rel=1e-5)
        assert after == pytest.approx(full / 2, rel=1e-4)


@pytest.mark.parametrize("layout", ["tp2", "tp1"])
def test_recompute_selective_and_full_give_no_recompute_grads(tp_run, layout):
    """learner.memory.recompute at TP=2 and at TP=1 (DP=2): the same loss and, for every parameter, the same grad
    as keeping every activation (fp32; selective recomputes our sdpa core attention, full whole layers from
    their input)."""
    for rank in tp_run["ranks"]:
        runs = rank[f"{layout}_recompute"]
        # not a silent fallback: selective runs each core attention again in the backward, full whole layers
        layers = runs["none_calls"]["core_attention"]
        assert layers > 0 and runs["none_calls"] == {"core_attention": layers, "mlp": layers}
        assert runs["selective_calls"] == {"core_attention": 2 * layers, "mlp": layers}
        assert runs["full_calls"] == {"core_attention": 2 * layers, "mlp": 2 * layers}
        assert set(runs["none"]) == set(runs["selective"]) == set(runs["full"]) and len(runs["none"]) > 5
        for mode in ("selective", "full"):
            for name, grad in runs["none"].items():
                assert _close(runs[mode][name], grad) <= 1e-6 * max(1.0, grad.abs().max().item()), (mode, name)


def test_tp_comm_overlap_gives_sequence_parallels_loss_and_grads(tp_run):
    """strategy_config.tp_comm_overlap with TP=2 + SP (asyncrl/learner/tp_overlap.py: the all-gathers and
    reduce-scatters go round the ring in blocks beside the GEMMs): its linears are in place, and the loss and every
    parameter's grad are sequence parallelism's without it (fp32)."""
    for rank in tp_run["ranks"]:
        runs = rank["sp_overlap"]
        assert runs["False_linears"] == ["ColumnParallelLinear", "RowParallelLinear"]
        assert runs["True_linears"] == ["OverlappedColumnParallelLinear", "OverlappedRowParallelLinear"]
        plain, overlapped = runs[False], runs[True]
        assert set(plain) == set(overlapped) and len(plain) > 5
        for name, grad in plain.items():
            assert grad.abs().max().item() > 0, name
            assert _close(overlapped[name], grad) <= 1e-6 * max(1.0, grad.abs().max().item()), name


def test_checkpoint_saved_at_tp2_loads_at_tp1(tp_run, demo_model_path):
    r0, r1 = tp_run["ranks"]
    perturbed = r0["tp2_perturbed_logits"]
    assert _close(perturbed, _hf_logits(demo_model_path)) > 1e-2  # the saved weights differ from HF
    for r in (r0, r1):
        assert _close(r["tp1_from_ckpt_logits"], perturbed) < 1e-4
        assert r["ckpt_extra"]["step"] == 7
        assert r["ckpt_extra"]["asyncrl_layout"]["tp"] == 2
    ckpt = tp_run["ckpt"]
    assert (ckpt / "metadata.json").exists()
    assert not any(p.name.endswith(".incomplete") for p in ckpt.parent.iterdir())


def test_qwen3_qk_norm_untied_at_tp2(tp_run, tiny_dirs):
    r0 = tp_run["ranks"][0]
    assert _close(r0["qwen3_logits"], _hf_logits(tiny_dirs["qwen3"])) < 1e-4
    _assert_bit_exact(r0["qwen3_export"], _hf_tensors(tiny_dirs["qwen3"]))


# ----------------------------------------------------------------------------- PP and EP


def test_pp2_logits_match_transformers(pp_ep_run, demo_model_path):
    first, last = pp_ep_run["ranks"]
    assert first["pp2_logits"] is None
    assert _close(last["pp2_logits"], _hf_logits(demo_model_path)) < 1e-4


def test_pp2_round_trip_each_stage_exports_its_own_layers(pp_ep_run, demo_model_path):
    first, last = (r["pp2_export"] for r in pp_ep_run["ranks"])
    assert "model.embed_tokens.weight" in first and "model.norm.weight" in last
    assert not set(first) & set(last)
    assert {k for k in first if "layers." in k} == {k for k in first if ".layers.0." in k or ".layers.1." in k}
    _assert_bit_exact({**first, **last}, _hf_tensors(demo_model_path))


def test_vpp2_logits_round_trip_and_checkpoint_at_tp1(pp_ep_run, demo_model_path):
    first, last = pp_ep_run["ranks"]
    assert first["vpp2_chunks"] == last["vpp2_chunks"] == 2
    assert first["vpp2_logits"] is None
    assert _close(last["vpp2_logits"], _hf_logits(demo_model_path)) < 1e-4
    # Interleaved: PP rank 0 holds layers 0 and 2, PP rank 1 layers 1 and 3.
    exports = [r["vpp2_export"] for r in pp_ep_run["ranks"]]
    layers = [{k.split(".")[2] for k in e if ".layers." in k} for e in exports]
    assert layers == [{"0", "2"}, {"1", "3"}]
    _assert_bit_exact({**exports[0], **exports[1]}, _hf_tensors(demo_model_path))

    perturbed = last["vpp2_perturbed_logits"]
    assert _close(perturbed, _hf_logits(demo_model_path)) > 1e-2
    for r in (first, last):  # DP=2 at TP=1: both ranks hold the whole model
        assert _close(r["tp1_from_vpp2_ckpt_logits"], perturbed) < 1e-4
        assert r["ckpt_extra"]["asyncrl_layout"]["vpp"] == 2


def test_routing_replay_gives_the_recorded_routes_logits_and_other_routes_other_logits(pp_ep_run):
    """R3 (learner/routing_replay.py) at EP=2 on the Qwen3-MoE shape (2 MoE layers, top-2 of 4 experts)."""
    for r in pp_ep_run["ranks"]:
        rep = r["replay"]
        assert rep["layers"] == 2 and rep["routes_shape"] == (IDS.shape[0], IDS.shape[1], 2, 2)
        if rep["own"] is None:
            continue  # (logits come back on TP rank 0 of the last stage)
        assert _close(rep["replayed"], rep["own"]) < 1e-5  # the layout puts each token's experts back in place
        assert _close(rep["moved"], rep["own"]) > 1e-2  # other experts: other log-probs
        assert _close(rep["cleared"], rep["own"]) < 1e-5  # cleared: the routers choose again


@pytest.mark.parametrize("index,name", [(0, "qwen2_moe"), (1, "qwen3_moe")])
def test_moe_at_ep2(pp_ep_run, tiny_dirs, index, name):
    ref = _hf_logits(tiny_dirs[name])
    for r in pp_ep_run["ranks"]:  # DP=2: both ranks are TP rank 0 of the last stage
        assert _close(r[f"moe{index}_logits"], ref) < 1e-4
        _assert_bit_exact(r[f"moe{index}_export"], _hf_tensors(tiny_dirs[name]))


def _lora_weights(path) -> torch.Tensor:
    """The LoRA checks' loss weights: loss = sum(logits * these)."""
    from transformers import AutoConfig

    g = torch.Generator().manual_seed(3)
    return torch.randn(*IDS.shape, AutoConfig.from_pretrained(path).vocab_size, generator=g)


@pytest.fixture(scope="module")
def peft_run(demo_model_path) -> dict:
    """PEFT's LoRA (r 4, alpha 8, every linear) on the demo model in fp32 with the test's adapter values: logits,
    every adapter's gradient of sum(logits * weights), and the merged weights (merge_and_unload)."""
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_model_path, torch_dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft = get_peft_model(model, PeftLora(r=_workers.LORA_R, lora_alpha=_workers.LORA_ALPHA, lora_dropout=0.0,
                                          target_modules=targets))
    mods = {}
    with torch.no_grad():
        for name, m in peft.named_modules():
            if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {}):
                hf_name = name.removeprefix("base_model.model.")
                a, b = m.lora_A["default"].weight, m.lora_B["default"].weight
                a.copy_(_workers.lora_values(hf_name + ".A", *a.shape))
                b.copy_(_workers.lora_values(hf_name + ".B", *b.shape))
                mods[hf_name] = m
    logits = peft(IDS).logits
    (logits.float() * _lora_weights(demo_model_path)).sum().backward()
    grads = {}
    for hf_name, m in mods.items():
        grads[hf_name + ".A"] = m.lora_A["default"].weight.grad.clone()
        grads[hf_name + ".B"] = m.lora_B["default"].weight.grad.clone()
    merged = {k: v.detach().clone() for k, v in peft.merge_and_unload().state_dict().items()}
    return {"logits": logits.detach(), "grads": grads, "merged": merged}


@pytest.mark.parametrize("layout", ["lora_tp1", "lora_tp2", "lora_pp2"])
def test_lora_trains_the_adapters_alone_and_equals_peft(tp_run, pp_ep_run, peft_run, layout):
    """learner.lora at TP=1, TP=2 and PP=2: only adapter parameters train; B starts at zero and A is drawn the same
    at any layout; with the same adapter values as PEFT the logits, every adapter's gradient and the merged export
    equal PEFT's (fp32)."""
    ranks = [r[layout] for r in (pp_ep_run if layout == "lora_pp2" else tp_run)["ranks"]]
    for r in ranks:
        assert r["trainable"] and all("_lora." in n for n in r["trainable"])
        assert r["init_b_zero"] and r["count"] > 0
    # a PP stage holds its own layers' adapters: the model's are the ranks' together
    logits = next(r["logits"] for r in ranks if r["logits"] is not None)
    grads = {k: v for r in ranks for k, v in r["grads"].items()}
    init_a = {k: v for r in ranks for k, v in r["init_a"].items()}
    exported = {k: v for r in ranks if r["export"] is not None for k, v in r["export"].items()}
    tp1_a = tp_run["ranks"][0]["lora_tp1"]["init_a"]
    for name, a in init_a.items():  # the seeded init: every layout's adapters are TP=1's
        assert torch.equal(a, tp1_a[name]), name
    assert _close(logits, peft_run["logits"]) < 1e-4
    assert set(grads) == set(peft_run["grads"]) and len(grads) == 7 * 2 * 4  # 4 layers
    for name, g in grads.items():
        ref = peft_run["grads"][name]
        # relative to the tensor's norm: fp32 sums in another order differ by ~1e-4 of it (TP=2, a fresh demo
        # model's larger gradients), a wrong part, scale or layout by its whole size
        assert (g - ref).norm() <= 1e-3 * ref.norm(), name
    merged = peft_run["merged"]
    assert set(exported) <= set(merged) and "model.layers.3.mlp.down_proj.weight" in exported
    for name, t in exported.items():
        assert _close(t, merged[name]) < 1e-5, name
    base = _hf_tensors(str(tp_run["demo"]))
    assert _close(exported["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"]) > 1e-4
