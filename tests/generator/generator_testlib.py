"""Shared helpers of the generator tests (not a test module)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import torch

from asyncrl.generator.weights import load_hf_tensors

ADMIN_TOKEN = "test-admin-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def perturbed_weights(model_dir: Path, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """The demo model's tensors plus seeded noise: a 'next policy version' with visibly different outputs."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in load_hf_tensors(str(model_dir)).items()}


def hf_greedy(model_dir: Path, weights: dict[str, torch.Tensor] | None, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by transformers on the given weights (the reference for the engine)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if weights is not None:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
        model.tie_weights()
    model.eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
            pad_token_id=0, min_new_tokens=max_new_tokens,
        )
    return out[0, len(prompt_ids):].tolist()


def wait_until(predicate, timeout_s: float, interval_s: float = 0.5, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
