"""One LoRA linear's forward and backward with the base in bf16 (the merged weight, `_MergedLinear`) against the base
in FP8 (`learner.lora.base_fp8`: `Fp8LoraLinear`, its row quantization compiled, then eager), at the random Qwen2.5-3B's
four linears (QKV 2048 -> 2560, O 2048 -> 2048, gate/up 2048 -> 2 x 11008, down 11008 -> 2048), rank 64, bf16, one
GPU. Per linear: ms per forward + backward (mean over the timed iterations, CUDA events), the FP8/bf16 speed ratio,
and the FP8 output's relative error against the bf16 one. A check of the part before the learner step's figure.

    python benchmarks/lora_fp8_linear.py --tokens 8192 --out /tmp/lora_fp8_linear.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.learner import lora_fp8  # noqa: E402
from asyncrl.learner.lora import LinearAdapters  # noqa: E402

SHAPES = {  # slot: (parts and their rows, in_features)
    "linear_qkv": ({"q_proj": 2048, "k_proj": 256, "v_proj": 256}, 2048),
    "linear_proj": ({"o_proj": 2048}, 2048),
    "linear_fc1": ({"gate_proj": 11008, "up_proj": 11008}, 2048),
    "linear_fc2": ({"down_proj": 2048}, 11008),
}


def timed(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="rows of x (a micro-batch's tokens)")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for eager in (False, True):
        lora_fp8._fused = lora_fp8._quantize if eager else None
        for slot, (parts, fan_in) in SHAPES.items():
            out_rows = sum(parts.values())
            weight = torch.randn(out_rows, fan_in, device=dev, dtype=torch.bfloat16) * fan_in ** -0.5
            make = lambda fp8: LinearAdapters(  # noqa: E731
                slot, parts, fan_in, rank=a.rank, alpha=2.0 * a.rank, dropout=0.0, tp_rank=0, tp_size=1,
                layout=(2, 8, 128), generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16, device=dev,
                base_fp8=fp8)
            base, fp8 = make(False), make(True)
            with torch.no_grad():
                for p in base.B:
                    base.B[p].normal_(std=0.01)
                    fp8.B[p].copy_(base.B[p])
            x = torch.randn(a.tokens, fan_in, device=dev, dtype=torch.bfloat16, requires_grad=True)
            dy = torch.randn(a.tokens, out_rows, device=dev, dtype=torch.bfloat16)

            def step(m):
                return lambda: m.linear(x, weight, None, None).backward(dy)

            with torch.no_grad():
                err = float((fp8.linear(x, weight, None, None) - base.linear(x, weight, None, None)).float().norm()
                            / base.linear(x, weight, None, None).float().norm())
            ms_bf16, ms_fp8 = timed(step(base), a.iters, 3), timed(step(fp8), a.iters, 3)
            row = {"slot": slot, "quantize": "eager" if eager else "compiled", "tokens": a.tokens,
                   "ms_bf16_merged": round(ms_bf16, 3), "ms_fp8_base": round(ms_fp8, 3),
                   "speedup": round(ms_bf16 / ms_fp8, 3), "rel_err_out": round(err, 5),
                   "fused": lora_fp8._fused is not lora_fp8._quantize}
            rows.append(row)
            print("[lora_fp8_linear]", json.dumps(row), flush=True)
        x = torch.randn(a.tokens - 5, 2048, device=dev, dtype=torch.bfloat16)  # rows not a multiple of 16
        q, s = lora_fp8.quantize_rows(x)
        assert q.shape[0] % 16 == 0 and q.shape[0] >= x.shape[0]
    summary = {"bench": "lora_fp8_linear", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "rows": rows, "total_ms": {q: {k: round(sum(r[k] for r in rows if r["quantize"] == q), 3)
                                              for k in ("ms_bf16_merged", "ms_fp8_base")}
                                          for q in ("compiled", "eager")}}
    print("[lora_fp8_linear] total", json.dumps(summary["total_ms"]), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()
