"""The learner on a real GPU: HF parity, bit-exact round trip and one bf16 actor update (NCCL, no compat).

Runs `benchmarks/learner_step.py` (the same code the GPU figures in docs/BENCHMARKS.md come from)
on a small random Qwen2 in a subprocess, so the NCCL process group and CUDA state stay out of the
test process. Skipped without CUDA (see tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], timeout: int = 600) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, *args], cwd=ROOT, env=env, check=True, timeout=timeout)


def test_parity_roundtrip_and_bf16_update_on_gpu(tmp_path, demo_model_path):
    model = tmp_path / "qwen2"
    _run(["benchmarks/make_random_qwen2.py", "--tokenizer-from", str(demo_model_path), "--out", str(model),
          "--layers", "2", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--ffn", "512",
          "--vocab-size", "4096", "--dtype", "bfloat16"])
    out = tmp_path / "learner.json"
    _run(["benchmarks/learner_step.py", "--model", str(model), "--sections", "parity,role", "--dtype", "bfloat16",
          "--batch", "4", "--seq-len", "64", "--prompt-len", "32", "--group-size", "2", "--micro-batch-size", "2",
          "--warmup", "1", "--steps", "1", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["env"]["cpu_compat_active"] is False  # compat does nothing when CUDA is there
    assert res["env"]["backend"] == "nccl"
    assert "error" not in res["parity"], res["parity"]
    assert res["parity"]["logits_max_abs_diff"] < 1e-4
    assert res["parity"]["roundtrip_bit_exact"]
    assert "error" not in res["role"], res["role"]
    metrics = res["role"]["last_metrics"]
    assert metrics["actor/applied_steps"] >= 1 and metrics["actor/skipped_steps"] == 0


def test_optimizer_on_host_trains_as_on_device(tmp_path, demo_model_path):
    """learner.memory.optimizer host (Megatron's CPU-offloaded distributed optimizer): the same updates as the
    optimizer on the device, in bf16 (Megatron offloads only the fp32 masters of 16-bit params), with Adam's state off the device."""
    model = tmp_path / "qwen2"
    _run(["benchmarks/make_random_qwen2.py", "--tokenizer-from", str(demo_model_path), "--out", str(model),
          "--layers", "2", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--ffn", "512",
          "--vocab-size", "8192", "--dtype", "bfloat16"])
    res = {}
    for where in ("device", "host"):
        out = tmp_path / f"{where}.json"
        _run(["benchmarks/learner_step.py", "--model", str(model), "--sections", "role", "--dtype", "bfloat16",
              "--batch", "4", "--seq-len", "64", "--prompt-len", "32", "--group-size", "2", "--micro-batch-size", "2",
              "--warmup", "1", "--steps", "2", "--optimizer", where, "--out", str(out)])
        res[where] = json.loads(out.read_text())["role"]
        assert "error" not in res[where], res[where]
    dev, host = res["device"], res["host"]
    assert host["optimizer_class"] == "HybridDeviceOptimizer" and dev["optimizer_class"] != "HybridDeviceOptimizer"
    assert host["last_metrics"]["actor/applied_steps"] == dev["last_metrics"]["actor/applied_steps"] >= 3
    assert abs(host["last_metrics"]["actor/grad_norm"] - dev["last_metrics"]["actor/grad_norm"]) < 1e-3 * dev["last_metrics"]["actor/grad_norm"]
    assert abs(host["logprob_sum_after_updates"] - dev["logprob_sum_after_updates"]) < 1e-4 * abs(dev["logprob_sum_after_updates"])
    assert host["peak_gib"] < dev["peak_gib"]  # Adam's two moments (8 bytes a parameter) stayed on the host
