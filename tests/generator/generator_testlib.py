"""Shared helpers of the generator tests (not a test module)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import torch

from asyncrl.demo_model import load_hf_tensors
from asyncrl.interfaces import EngineAPI
from asyncrl.types import UpdateBegin

ADMIN_TOKEN = "test-admin-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def perturbed_weights(model_dir: Path, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """The demo model's tensors plus seeded noise: a 'next policy version' with visibly different outputs."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in load_hf_tensors(str(model_dir)).items()}


def _hf_model(model_dir: Path, weights: dict[str, torch.Tensor] | None):
    """transformers' model of `model_dir` in float32, with `weights` loaded over its own if given."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if weights is not None:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
        model.tie_weights()
    return model.eval()


def hf_greedy(model_dir: Path, weights: dict[str, torch.Tensor] | None, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by transformers on the given weights (the reference for the engine)."""
    model = _hf_model(model_dir, weights)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
            pad_token_id=0, min_new_tokens=max_new_tokens,
        )
    return out[0, len(prompt_ids):].tolist()


def hf_logit_gaps(model_dir: Path, weights: dict[str, torch.Tensor] | None, prompt_ids: list[int],
                  token_ids: list[int]) -> list[float]:
    """For each of `token_ids` after `prompt_ids`, how far its logit lies below the best one under transformers
    (float32, teacher-forced): 0 where it is the argmax. The reference for an engine that computes in half
    precision, whose greedy picks may differ from float32's where two logits are that close."""
    model = _hf_model(model_dir, weights)
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt_ids) + list(token_ids)])).logits[0, len(prompt_ids) - 1:-1]
    picked = logits.gather(1, torch.tensor(token_ids).unsqueeze(1)).squeeze(1)
    return (logits.max(dim=1).values - picked).tolist()


def assert_half_precision_greedy(model_dir: Path, weights: dict[str, torch.Tensor] | None, prompt_ids: list[int],
                                 token_ids: list[int], tol: float = 0.05) -> None:
    """`token_ids` are greedy picks of these weights up to half-precision rounding: each within `tol` of the best
    float32 logit, and most of them the float32 argmax itself."""
    gaps = hf_logit_gaps(model_dir, weights, prompt_ids, token_ids)
    assert max(gaps) <= tol, [round(g, 4) for g in gaps]
    assert sum(g == 0 for g in gaps) >= 0.75 * len(gaps), [round(g, 4) for g in gaps]


def wait_until(predicate, timeout_s: float, interval_s: float = 0.5, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def form_push_plan(control, tensors: dict[str, torch.Tensor], bucket_mb: float = 64.0):
    """A push plan for `tensors` with every engine replica behind `control` (as weightsync's
    service asks for it): each forms it from its workers' layouts of the export and holds it."""
    import asyncio
    import pickle

    from tests.weightsync.fakes import plan_request

    acks = asyncio.run(control.call(EngineAPI.set_push_plan, plan_request(tensors, bucket_mb)))
    assert all(a.plan is not None for a in acks.values()), [a.problem for a in acks.values()]
    assert len({a.plan_id for a in acks.values()}) == 1
    return pickle.loads(next(iter(acks.values())).plan)


def push_weights(control, version: int, tensors: dict[str, torch.Tensor], *, plan=None, bucket_mb: float = 64.0,
                 verify: str = "full"):
    """Push `tensors` as `version` to every engine replica behind `control` through weightsync's
    publisher (engine layout with `plan`, else HF tensors); returns the PushResult."""
    import asyncio

    from asyncrl.config import WeightsyncConfig
    from asyncrl.weightsync.push import Pusher, VersionRegistry
    from asyncrl.weightsync.service import DeploymentReplicas
    from tests.weightsync.fakes import LocalChannel, source_of

    cfg = WeightsyncConfig(bucket_mb=bucket_mb, verify=verify, timeout_s=120.0)
    pub = Pusher(cfg, transport=LocalChannel(), registry=VersionRegistry(version - 1))
    return asyncio.run(pub.push(version, source_of(pub, tensors, plan), [DeploymentReplicas(control, cfg.timeout_s)]))


def push_by_steps(control, version: int, tensors: dict[str, torch.Tensor], fingerprint: str) -> dict:
    """The replica's update steps by hand (begin, load, commit with the given fingerprint), as a
    faulty publisher would call them; aborts on failure and re-raises the ReplicaControlError."""
    import asyncio

    try:
        asyncio.run(control.call(EngineAPI.load_bucket, tensors, version, UpdateBegin()))
        return asyncio.run(control.call(EngineAPI.commit_update, version, fingerprint))
    except BaseException:
        asyncio.run(control.call(EngineAPI.abort_update))
        raise


def generate_across_a_commit(post, control, body: dict, tensors: dict[str, torch.Tensor], version: int,
                             interval_s: float = 0.05):
    """`post(body)` (a /generate request) in a thread; once the replica has made its first 5 tokens, every
    replica is paused ("keep"), takes `tensors` as `version` through the update steps (begin, load, commit
    with their fingerprint) and is resumed. Returns the request's response."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from asyncrl.weightsync.fingerprint import tensor_fingerprint

    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(post, body)
        # a non-streaming response comes whole at the end; the replica's in-flight count shows its progress
        wait_until(lambda: list(asyncio.run(control.stats()).values())[0]["generator/tokens_in_flight"] >= 5,
                   60, interval_s=interval_s, what="first tokens")
        asyncio.run(control.pause("keep"))
        try:
            asyncio.run(control.call(EngineAPI.load_bucket, tensors, version, UpdateBegin()))
            asyncio.run(control.call(EngineAPI.commit_update, version, tensor_fingerprint(tensors)))
        finally:
            asyncio.run(control.resume())
        return fut.result(timeout=120)
