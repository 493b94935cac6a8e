"""Which `scaled_dot_product_attention` kernel is fastest for the learner's attention shapes (GPU).

Times forward + backward of causal grouped-query attention (bf16, [b, heads, s, head_dim], K/V with
fewer heads, `enable_gqa`) under each SDPA backend alone, with CUDA events (median of --iters after
warm-up), and checks each output against the math backend in float32. Prints one JSON row.

    python benchmarks/attention_backends.py --seq 4096 --heads 12 --kv-heads 2 --head-dim 128
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(a.batch, a.heads, a.seq, a.head_dim, device=dev, generator=g, dtype=torch.bfloat16)
    k = torch.randn(a.batch, a.kv_heads, a.seq, a.head_dim, device=dev, generator=g, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    go = torch.randn_like(q)
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    flops = 4 * a.batch * a.heads * a.seq * a.seq * a.head_dim / 2 * 3.5  # causal fwd + bwd (2.5x fwd)
    row = {"benchmark": "attention_backends", "shape": vars(a), "device": torch.cuda.get_device_name()}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("default", None)):
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))

        def step():
            if backend is None:
                out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
            else:
                with sdpa_kernel([backend]):
                    out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
            out.backward(go)
            return out

        try:
            out = step()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            for _ in range(3):
                step()
            times = []
            for _ in range(a.iters):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                step()
                e.record()
                torch.cuda.synchronize()
                times.append(s.elapsed_time(e))
            ms = sorted(times)[len(times) // 2]
            row[name] = {"ms_fwd_bwd": round(ms, 3), "tflops": round(flops / ms / 1e9, 1), "rel_err": round(err, 5)}
        except Exception as e:  # noqa: BLE001 - a backend that does not take these inputs
            row[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
    print(json.dumps(row))


if __name__ == "__main__":
    main()
