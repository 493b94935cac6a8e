"""benchmarks/make_random_qwen2.py --eos-mean-tokens: the long-tail workload lives in the weights. The rewiring
leaves every other logit alone and gives EOS a logit that only the scale moves; a built model, sampled by
transformers' own `generate` at temperature 1, ends its responses after about the mean asked for, with a tail."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import import_benchmark

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "artifacts" / "demo-model"
TINY = ["--vocab-size", "1024", "--layers", "2", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--ffn", "512"]


def test_raise_eos_moves_the_eos_logit_only():
    from transformers import AutoModelForCausalLM

    make = import_benchmark("make_random_qwen2")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make.qwen2_config(512, 2, 64, 4, 2, 128, 1024))
    model.eval()
    d0 = make.raise_eos(model, eos_id=2)
    x = torch.randint(3, 512, (2, 40))
    final: list[torch.Tensor] = []  # the residual stream the final norm reads
    model.model.norm.register_forward_hook(lambda module, args, out: final.append(args[0]))
    with torch.no_grad():
        logits = model(x).logits
        # at every position (the attention weights sum to 1 within rounding)
        assert torch.allclose(final[0][..., d0], torch.full((2, 40), make.EOS_CARRIER), rtol=0, atol=1e-5)
        assert torch.all(logits[..., 2] == 0)  # scale 0 until calibrated
        model.model.norm.weight[d0] = 3.0
        raised = model(x).logits
    others = torch.ones(512, dtype=torch.bool)
    others[2] = False
    assert torch.equal(raised[..., others], logits[..., others])
    rms = final[0].pow(2).mean(-1).add(1e-6).sqrt()
    assert torch.allclose(raised[..., 2], 3.0 * make.EOS_CARRIER / rms, rtol=1e-4)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as built


@pytest.mark.slow
@pytest.mark.skipif(not (DEMO / "tokenizer.json").is_file(), reason="needs artifacts/demo-model (make demo-model)")
def test_built_model_samples_a_long_tail_of_the_asked_mean(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    mean, cut = 200, 1024
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "make_random_qwen2.py"), "--tokenizer-from", str(DEMO),
                           "--out", str(tmp_path), *TINY, "--eos-mean-tokens", str(mean), "--eos-max-new-tokens", str(cut)],
                          check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    calibration = json.loads((tmp_path / "eos_calibration.json").read_text())
    assert calibration["expected"]["mean"] == pytest.approx(mean, rel=0.03)  # bf16 rounds the scale
    assert calibration["expected"]["p99"] > 3 * mean

    tok = AutoTokenizer.from_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.dtype == torch.bfloat16 and tok.eos_token_id == model.generation_config.eos_token_id == 2
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 34?"}], add_generation_prompt=True,
                                     return_dict=True, return_tensors="pt")["input_ids"].repeat(64, 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread is several times faster than two on a shared 2-core host
    try:
        torch.manual_seed(0)
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, temperature=1.0, top_p=1.0,
                             top_k=0, max_new_tokens=cut, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    finally:
        torch.set_num_threads(threads)
    completions = out.sequences[:, prompt.shape[1]:].tolist()
    lengths = [row.index(2) + 1 if 2 in row else len(row) for row in completions]
    assert statistics.fmean(lengths) == pytest.approx(mean, rel=0.25)
    assert max(lengths) > 2.5 * statistics.fmean(lengths)  # a tail, not lengths bunched at the mean
    # Along the paths actually sampled, EOS is as likely per step as calibrated (far less noisy than the lengths)
    p = torch.stack(out.logits, 1).float().softmax(-1)[..., 2]  # [samples, steps]
    alive = torch.arange(p.shape[1])[None] < torch.tensor(lengths)[:, None]
    assert float(p[alive].mean()) == pytest.approx(calibration["p_eos_mean"], rel=0.15)
