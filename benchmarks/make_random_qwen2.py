"""A randomly initialised Qwen2-0.5B-shaped HF checkpoint, for benchmarks on machines with no internet.

Shape of Qwen2-0.5B: hidden 896, 24 layers, 14 query heads, 2 KV heads (head_dim 64), SwiGLU 4864,
q/k/v biases, tied embeddings, rope_theta 1e6, vocab 151936: 494,032,768 parameters.
Weights are `transformers`' own random init (std 0.02), so the model generates noise: good for
throughput and parity, useless for quality.

The tokenizer is the demo model's (BPE trained on the demo task, 284 tokens), with filler tokens
`<xN>` appended to its BPE vocabulary until it covers every model id: the engine can then detokenize
whatever the random model samples. Fillers have no merges, so they never come out of encoding:
prompts tokenize exactly as with the demo tokenizer.

    python benchmarks/make_random_qwen2.py --tokenizer-from artifacts/demo-model --out /tmp/qwen2-0.5b-random

With --experts N it is a Qwen2-MoE instead (routed experts of --moe-ffn, top --moe-topk, a gated
shared expert of --shared-ffn), e.g. for the learner's MoE figures on one GPU.

With --eos-mean-tokens N the weights stop on their own: sampled at temperature 1, responses end with EOS
after about N tokens on average, long-tailed (the long-tail workload of benchmarks/peers/). It lives in the
checkpoint, so every engine samples it alike; `raise_eos` says how, `calibrate_eos_scale` how N is met, and
eos_calibration.json beside the weights records the result.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
CALIBRATION_FILE = "eos_calibration.json"
# Calibration input: uniform random tokens (what a random model samples), a few sequences, the first
# sampled token after CALIBRATION_PROMPT positions (an arithmetic prompt with the chat template is ~30).
CALIBRATION_SEQUENCES = 4
CALIBRATION_PROMPT = 32
# What residual dimension d0 carries at every position: of the order of one residual entry, so that it
# barely moves the RMS the norms divide by (one dimension among hidden_size).
EOS_CARRIER = 1.0


def qwen2_config(vocab_size: int, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, max_pos: int,
                 tied: bool = True):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=ffn, tie_word_embeddings=tied,
        rope_theta=1_000_000.0, max_position_embeddings=max_pos, rms_norm_eps=1e-6,
        use_sliding_window=False, bos_token_id=None, eos_token_id=2, pad_token_id=0,
    )


def qwen2_moe_config(vocab_size: int, layers: int, hidden: int, heads: int, kv_heads: int, max_pos: int,
                     experts: int, topk: int, moe_ffn: int, shared_ffn: int):
    """Qwen2-MoE (Qwen1.5-MoE layout): every layer routed experts (softmax top-k, no renormalising)
    plus a gated shared expert."""
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=moe_ffn, moe_intermediate_size=moe_ffn,
        shared_expert_intermediate_size=shared_ffn, num_experts=experts, num_experts_per_tok=topk,
        norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=True,
        rope_theta=1_000_000.0, max_position_embeddings=max_pos, rms_norm_eps=1e-6, use_sliding_window=False,
        bos_token_id=None, eos_token_id=2, pad_token_id=0, output_router_logits=False,
    )


def extend_tokenizer(src: Path, out: Path, vocab_size: int) -> int:
    """Copy the tokenizer files; pad tokenizer.json's BPE vocab with `<xN>` up to `vocab_size` ids."""
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    used = set(vocab.values()) | {a["id"] for a in tok.get("added_tokens", [])}
    if max(used) >= vocab_size:
        raise ValueError(f"tokenizer has id {max(used)} >= vocab_size={vocab_size}")
    for i in range(vocab_size):
        if i not in used:
            vocab[f"<x{i}>"] = i  # printable ASCII only: byte-level decoding maps it to itself
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    return len(vocab) + len([a for a in tok.get("added_tokens", []) if a["id"] not in vocab.values()])


def tokenizer_eos_id(src: Path) -> int:
    """The id of the tokenizer's eos_token (what vLLM, TRL and transformers stop on)."""
    eos = json.loads((src / "tokenizer_config.json").read_text())["eos_token"]
    eos = eos["content"] if isinstance(eos, dict) else eos
    tok = json.loads((src / "tokenizer.json").read_text())
    ids = {a["content"]: a["id"] for a in tok.get("added_tokens", [])} | tok["model"]["vocab"]
    return ids[eos]


@torch.no_grad()
def raise_eos(model: Any, eos_id: int) -> int:
    """Rewire a random dense Qwen2 so that its EOS logit is `scale * EOS_CARRIER / rms(x)` at every position,
    `scale` being the final norm's weight at residual dimension d0 (0 until `calibrate_eos_scale` sets it),
    and the rest of the model is left as it was (nothing else reads or writes d0). Returns d0.

    Layer 0's value channel 0 (of KV head 0) is its bias alone (weight row zeroed), so every query head of
    that group outputs exactly EOS_CARRIER there (attention weights sum to 1); o_proj moves it from query
    head 0 into d0 only. Every other writer of d0 (embedding column, o_proj and down_proj rows) and every
    reader (each layer's two norm weights) is zeroed, so d0 is EOS_CARRIER at every position. The LM head's
    EOS row is e_d0 (the embedding's EOS row too when tied: EOS as an input never matters), so no random
    term adds to the EOS logit, and its column d0 is zero elsewhere, so no other logit sees the constant.
    """
    cfg = model.config
    d0 = cfg.hidden_size - 1
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    group = cfg.num_attention_heads // cfg.num_key_value_heads  # query heads reading KV head 0
    body = model.model
    body.embed_tokens.weight[:, d0] = 0
    for layer in body.layers:
        layer.input_layernorm.weight[d0] = 0
        layer.post_attention_layernorm.weight[d0] = 0
        layer.self_attn.o_proj.weight[d0] = 0
        layer.mlp.down_proj.weight[d0] = 0
    attn = body.layers[0].self_attn
    attn.v_proj.weight[0] = 0
    attn.v_proj.bias[0] = EOS_CARRIER
    attn.o_proj.weight[:, [h * head_dim for h in range(group)]] = 0
    attn.o_proj.weight[d0, 0] = 1
    head = model.lm_head.weight  # the embedding's own tensor when tied
    head[:, d0] = 0
    head[eos_id] = 0
    head[eos_id, d0] = 1
    body.norm.weight[d0] = 0
    return d0


@torch.no_grad()
def eos_profile(model: Any, eos_id: int, d0: int, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence and position of `tokens` [B, T]: the final norm's output at d0 for a weight of 1 (in the
    model's dtype: EOS_CARRIER / rms), and the log-sum-exp of every logit but EOS's (fp32). Neither depends
    on the scale: the EOS logit for scale g is then exactly dtype(dtype(g) * u), as the model computes it."""
    norm = model.model.norm.weight
    kept = norm[d0].clone()
    norm[d0] = 1
    us, lses = [], []
    for row in tokens.to(norm.device):  # one sequence at a time: attention memory grows with T^2 off GPU
        hidden = model.model(input_ids=row[None], use_cache=False).last_hidden_state[0]
        us.append(hidden[:, d0])
        lse = []
        for chunk in hidden.split(1024):
            logits = model.lm_head(chunk).float()
            logits[:, eos_id] = -math.inf
            lse.append(torch.logsumexp(logits, dim=-1))
        lses.append(torch.cat(lse))
    norm[d0] = kept
    return torch.stack(us), torch.stack(lses)


def length_survival(p: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """P(length > t) for t = 0 .. max_new_tokens - 1, averaged over sequences, from per-step EOS
    probabilities p [B, steps] (step j: the j-th sampled token); steps past p's end repeat the mean of its
    last quarter."""
    steps = p.shape[1]
    if steps < max_new_tokens:
        tail = p[:, -max(steps // 4, 1):].mean(dim=1, keepdim=True)
        p = torch.cat([p, tail.expand(-1, max_new_tokens - steps)], dim=1)
    alive = torch.cumprod(1 - p[:, :max_new_tokens - 1].double(), dim=1)
    return torch.cat([torch.ones(p.shape[0], 1, dtype=alive.dtype, device=alive.device), alive], dim=1).mean(dim=0)


def length_summary(survival: torch.Tensor) -> dict[str, float | int]:
    """Expected mean, p50/p90/p99 and share cut at the end, of lengths min(L, max_new_tokens)."""
    cdf = 1 - survival.cpu()
    n = len(survival)

    def quantile(q: float) -> int:
        hit = (cdf >= q).nonzero()
        return int(hit[0]) if len(hit) else n

    return {"mean": float(survival.sum()), "p50": quantile(0.5), "p90": quantile(0.9), "p99": quantile(0.99),
            "share_cut": float(survival[-1])}


def calibrate_eos_scale(model: Any, eos_id: int, d0: int, mean_tokens: float, max_new_tokens: int,
                        positions: int, seed: int) -> dict[str, Any]:
    """Set the final norm's weight at d0 so that the expected response length (cut at max_new_tokens) over
    uniform random inputs is `mean_tokens`; returns what was measured (eos_calibration.json)."""
    dtype = model.model.norm.weight.dtype
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.config.vocab_size, (CALIBRATION_SEQUENCES, CALIBRATION_PROMPT + positions - 1),
                           generator=gen)
    u, lse = eos_profile(model, eos_id, d0, tokens)
    u, lse = u[:, CALIBRATION_PROMPT - 1:], lse[:, CALIBRATION_PROMPT - 1:]  # the sampled steps only

    def p_eos(scale: float) -> torch.Tensor:
        logit = (torch.tensor(scale, dtype=dtype, device=u.device) * u).to(dtype).float()
        return torch.sigmoid(logit - lse)

    def expected(scale: float) -> float:
        return float(length_survival(p_eos(scale), max_new_tokens).sum())

    if expected(0.0) <= mean_tokens:
        raise ValueError(f"--eos-mean-tokens={mean_tokens}: the model without a raised EOS already averages "
                         f"{expected(0.0):.0f} tokens under a cut of {max_new_tokens}")
    lo, hi = 0.0, 1.0
    while expected(hi) > mean_tokens:
        lo, hi = hi, hi * 2
    for _ in range(40):  # E[length] falls as the scale rises
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected(mid) > mean_tokens else (lo, mid)
    # The checkpoint holds the scale in its dtype: of the representable values around it, the closest in mean.
    near = torch.tensor((lo + hi) / 2, dtype=dtype)
    around = [near] + [torch.nextafter(near, torch.tensor(to, dtype=dtype)) for to in (0.0, math.inf)]
    scale = min((float(g) for g in around), key=lambda g: abs(expected(g) - mean_tokens))
    with torch.no_grad():
        model.model.norm.weight[d0] = scale
    p = p_eos(scale)
    return {"eos_token_id": eos_id, "residual_dim": d0, "carrier": EOS_CARRIER, "scale": scale,
            "mean_tokens_asked": mean_tokens, "max_new_tokens": max_new_tokens, "p_eos_mean": float(p.mean()),
            "p_eos_p10_p90": [float(q) for q in torch.quantile(p.flatten().double().cpu(), torch.tensor([0.1, 0.9], dtype=torch.float64))],
            "expected": length_summary(length_survival(p, max_new_tokens)),
            "calibration": {"sequences": CALIBRATION_SEQUENCES, "positions": positions, "prompt": CALIBRATION_PROMPT,
                            "device": str(u.device), "dtype": str(dtype).removeprefix("torch.")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer-from", default="artifacts/demo-model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab-size", type=int, default=151936)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=4864)
    ap.add_argument("--max-position-embeddings", type=int, default=32768)
    ap.add_argument("--experts", type=int, default=0, help="> 0: a Qwen2-MoE with this many routed experts per layer")
    ap.add_argument("--moe-topk", type=int, default=4)
    ap.add_argument("--moe-ffn", type=int, default=1408, help="each routed expert's SwiGLU size")
    ap.add_argument("--shared-ffn", type=int, default=5632, help="the shared expert's SwiGLU size")
    ap.add_argument("--untied", action="store_true", help="a separate LM head (Qwen2-7B: --layers 28 --hidden 3584 --heads 28 "
                    "--kv-heads 4 --ffn 18944 --untied, 7,615,616,512 parameters)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="dtype the weights are saved in")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eos-mean-tokens", type=float, default=0,
                    help="> 0: raise EOS in the weights so that temperature-1 responses average this many tokens, "
                    "long-tailed, under a cut of --eos-max-new-tokens (0: EOS as initialised, never sampled)")
    ap.add_argument("--eos-max-new-tokens", type=int, default=8192, help="the cut the mean is calibrated under "
                    "(the workload's max_new_tokens)")
    ap.add_argument("--eos-calibration-positions", type=int, default=0,
                    help="sampled steps the calibration measures per sequence (0 = --eos-max-new-tokens; past them "
                    "the last quarter's mean EOS probability is assumed): shorter for a CPU")
    args = ap.parse_args()
    if args.eos_mean_tokens:
        if args.experts:
            ap.error("--eos-mean-tokens: dense models only (drop --experts)")
        if not 1 <= args.eos_mean_tokens < args.eos_max_new_tokens:
            ap.error(f"--eos-mean-tokens={args.eos_mean_tokens}: must be in [1, --eos-max-new-tokens={args.eos_max_new_tokens})")
        if args.eos_calibration_positions < 0:
            ap.error(f"--eos-calibration-positions={args.eos_calibration_positions}: must be >= 0")

    from transformers import AutoModelForCausalLM

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.experts:
        cfg = qwen2_moe_config(args.vocab_size, args.layers, args.hidden, args.heads, args.kv_heads,
                               args.max_position_embeddings, args.experts, args.moe_topk, args.moe_ffn, args.shared_ffn)
    else:
        cfg = qwen2_config(args.vocab_size, args.layers, args.hidden, args.heads, args.kv_heads, args.ffn,
                           args.max_position_embeddings, tied=not args.untied)
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):  # random init of 0.5B params is seconds on a GPU, a minute on 2 cores (7B: 45 GB peak)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model = model.to(getattr(torch, args.dtype))
    calibration = None
    if args.eos_mean_tokens:
        eos_id = tokenizer_eos_id(Path(args.tokenizer_from))
        if eos_id != cfg.eos_token_id:
            raise SystemExit(f"the tokenizer's eos_token is id {eos_id}, the config's eos_token_id {cfg.eos_token_id}")
        d0 = raise_eos(model, eos_id)
        try:
            calibration = calibrate_eos_scale(model, eos_id, d0, args.eos_mean_tokens, args.eos_max_new_tokens,
                                              args.eos_calibration_positions or args.eos_max_new_tokens, args.seed)
        except ValueError as err:
            raise SystemExit(str(err)) from None
        (out / CALIBRATION_FILE).write_text(json.dumps(calibration, indent=1) + "\n")
    params = sum(p.numel() for p in model.parameters())  # tied embedding counted once
    model.save_pretrained(out, max_shard_size="5GB")
    tokens = extend_tokenizer(Path(args.tokenizer_from), out, args.vocab_size)
    print(json.dumps({"out": str(out), "parameters": params, "vocab_size": args.vocab_size,
                      "tokenizer_tokens": tokens, "dtype": args.dtype} | ({"eos": calibration} if calibration else {})))


if __name__ == "__main__":
    main()
