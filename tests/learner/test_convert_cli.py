"""`asyncrl convert`: HF -> dist checkpoint at TP=2 -> HF on one rank gives the same tensors back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.cli import main

pytestmark = pytest.mark.slow


def test_hf_to_mcore_tp2_and_back_is_bit_exact(demo_model_path, tmp_path):
    mcore, back = tmp_path / "mcore", tmp_path / "hf"
    assert main(["convert", "hf-to-mcore", "--hf", str(demo_model_path), "--out", str(mcore), "--tp", "2"]) == 0
    assert (mcore / "metadata.json").exists()
    assert main(["convert", "mcore-to-hf", "--mcore", str(mcore), "--out", str(back),
                 "--hf-config", str(demo_model_path)]) == 0
    original = load_file(str(Path(demo_model_path) / "model.safetensors"))
    restored = load_file(str(back / "model.safetensors"))
    assert set(restored) == set(original)
    for name, tensor in original.items():
        assert torch.equal(restored[name], tensor), name
    assert (back / "config.json").exists() and (back / "tokenizer.json").exists()


def test_bad_layout_fails_before_starting_processes(demo_model_path, tmp_path):
    from asyncrl.config import ConfigError

    with pytest.raises(ConfigError, match="num_attention_heads=4 is not divisible by tensor_model_parallel_size=3"):
        main(["convert", "hf-to-mcore", "--hf", str(demo_model_path), "--out", str(tmp_path / "x"), "--tp", "3"])
