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
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


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
    args = ap.parse_args()

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
    params = sum(p.numel() for p in model.parameters())  # tied embedding counted once
    model.save_pretrained(out, max_shard_size="5GB")
    tokens = extend_tokenizer(Path(args.tokenizer_from), out, args.vocab_size)
    print(json.dumps({"out": str(out), "parameters": params, "vocab_size": args.vocab_size,
                      "tokenizer_tokens": tokens, "dtype": args.dtype}))


if __name__ == "__main__":
    main()
