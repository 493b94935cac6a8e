"""Shared test data for the learner role/group tests: a fixed GRPO-shaped batch and an HF oracle."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from asyncrl.types import Sample

VOCAB = 284


def make_samples(n: int = 8, group_size: int = 2, seed: int = 0) -> list[Sample]:
    """n samples of varied prompt/response lengths; consecutive `group_size` share a group id."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, r = 3 + (i * 5) % 6, 4 + (i * 3) % 7
        out.append(Sample(
            prompt_ids=torch.randint(1, VOCAB, (p,), generator=g).tolist(),
            response_ids=torch.randint(1, VOCAB, (r,), generator=g).tolist(),
            behavior_logprobs=[-5.0] * r, versions=[0] * r,
            reward=float(i % 2), group_id=i // group_size,
        ))
    return out


def with_behavior(samples: list[Sample], logprobs: list[list[float]]) -> list[Sample]:
    """Copies whose behaviour log-probs are `logprobs` (on-policy: decoupled weight 1)."""
    import msgspec

    return [msgspec.structs.replace(s, behavior_logprobs=list(lp)) for s, lp in zip(samples, logprobs)]


def advantages(samples: list[Sample]) -> list[list[float]]:
    return [[1.0 if s.reward > 0 else -1.0] * len(s.response_ids) for s in samples]


def hf_logprobs(model: Any, samples: list[Sample]) -> list[list[float]]:
    out = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logp = model(ids).logits.float().log_softmax(-1)[0]
        p = len(s.prompt_ids)
        out.append(logp[p - 1 : -1].gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0].tolist())
    return out


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def run(coro):
    return asyncio.run(coro)
