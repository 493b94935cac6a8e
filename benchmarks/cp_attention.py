"""One context-parallel rank's attention, profiled on one GPU (issue 67: CP on the fused path for every segment).

A CP rank holds two zig-zag chunks of a row and attends them against the whole row's keys (gathered over CP): a
square causal call for its early chunk and a bottom-right causal call (`sq < sk`) for its late one. This times,
forward + backward, the attention of a row on one GPU (one causal call) against each CP rank's segments, the late
segment through `lower_right_attention` ("merged": the product's path, two cuDNN calls merged by their log-sum-exps on
Hopper for segments of `MERGE_MIN_QUERIES` queries or more) and through
SDPA's `causal_lower_right` bias ("bias": the path before, on flash where flash takes it), and checks both against an
fp32 reference on a small row. The K/V all-gather is not here (one GPU).

    python benchmarks/cp_attention.py --widths 8192 32768 65536 --cp 2 --heads 16 --kv-heads 2 --head-dim 128 \\
        --out docs/results/cp_attention_<machine>_<date>.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch
import torch.nn.functional as F

from asyncrl.learner.attention import attend_segments, bias_lower_right, lower_right_attention, plan_segments, split_for_cp


def flash_refusal(q, k) -> str:
    """Why SDPA's flash check refuses the bias path's bottom-right call ('' where it accepts it)."""
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    params = SDPAParams(q, k, k, None, 0.0, False, k.shape[1] != q.shape[1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = can_use_flash_attention(params, True)
    return "" if ok else "; ".join(str(w.message)[:200] for w in caught) or "refused"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, q, k, v, repeats: int) -> dict:
    """fn(q, k, v) forward + backward: mean and min seconds over `repeats` after one warm-up, and peak GiB."""
    grad = torch.randn(q.shape[0], q.shape[1], q.shape[2], v.shape[3], device=q.device, dtype=q.dtype)
    times = []
    cuda = q.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        for i in range(repeats + 1):
            for t in (q, k, v):
                t.grad = None
            _sync(q.device)
            t0 = time.perf_counter()
            fn(q, k, v).backward(grad)
            _sync(q.device)
            if i:
                times.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError as err:
        torch.cuda.empty_cache()
        return {"error": f"out of memory: {str(err)[:160]}"}
    return {"mean_s": sum(times) / len(times), "min_s": min(times),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0}


def check(width: int, cp: int, heads: int, kv: int, dim: int, device: str = "cuda") -> dict:
    """Max abs difference of both late-segment paths from an fp32 reference (outputs and gradients), per rank."""
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, heads, width, dim, device=device, generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(1, kv, width, dim, device=device, generator=g, dtype=torch.bfloat16) for _ in range(2))
    grad = torch.randn(1, heads, width // cp, dim, device=device, generator=g, dtype=torch.bfloat16)
    scale, out = dim ** -0.5, {}
    for rank in range(cp):
        ql = split_for_cp(q, cp, rank, dim=2)
        segs = plan_segments(width, cp, rank, None)
        results = {}
        for name, late, dtype in (("ref", bias_lower_right, torch.float32), ("merged", lower_right_attention, None),
                                  ("bias", bias_lower_right, None)):
            x, y, z = (t.detach().to(dtype or t.dtype).requires_grad_() for t in (ql, k, v))
            o = attend_segments(x, y, z, segs, scale, late)
            o.backward(grad.to(o.dtype))
            results[name] = [t.detach().float() for t in (o, x.grad, y.grad, z.grad)]
        for name in ("merged", "bias"):
            out[f"rank{rank}_{name}_max_abs_err"] = max(float((a - b).abs().max()) for a, b in
                                                       zip(results[name], results["ref"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[8192, 32768, 65536])
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-bias-over", type=int, default=32768, help="widths above this skip the bias path (its math fallback)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (the timings mean nothing)")
    ap.add_argument("--check-width", type=int, default=2048)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = [{"what": "check", "width": args.check_width, "cp": args.cp,
             **check(args.check_width, args.cp, args.heads, args.kv_heads, args.head_dim, args.device)}]
    print(json.dumps(rows[0]), flush=True)
    for width in args.widths:
        mk = lambda h, s: torch.randn(1, h, s, args.head_dim, device=args.device, dtype=torch.bfloat16,  # noqa: E731
                                      requires_grad=True)
        q, k, v = mk(args.heads, width), mk(args.kv_heads, width), mk(args.kv_heads, width)
        scale = args.head_dim ** -0.5
        row = {"what": "time", "width": width, "cp": args.cp, "heads": args.heads, "kv_heads": args.kv_heads,
               "head_dim": args.head_dim, "repeats": args.repeats,
               "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
               "torch": torch.__version__}
        row["one_gpu"] = timed(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, scale=scale,
                                                                             enable_gqa=True), q, k, v, args.repeats)
        for rank in range(args.cp):
            ql = split_for_cp(q.detach(), args.cp, rank, dim=2).requires_grad_()
            segs = plan_segments(width, args.cp, rank, None)
            late = next(s for s in segs if not s.square)
            row[f"rank{rank}_flash_refusal"] = flash_refusal(ql[:, :, late.q_start : late.q_end],
                                                             k[:, :, late.k_start : late.k_end])
            row[f"rank{rank}_merged"] = timed(lambda a, b, c: attend_segments(a, b, c, segs, scale, lower_right_attention),
                                              ql, k, v, args.repeats)
            row[f"rank{rank}_bias"] = (timed(lambda a, b, c: attend_segments(a, b, c, segs, scale, bias_lower_right),
                                             ql, k, v, args.repeats) if width <= args.skip_bias_over
                                       else {"error": "skipped"})
        one = row["one_gpu"].get("mean_s")
        for path in ("merged", "bias"):
            worst = [row[f"rank{r}_{path}"].get("mean_s") for r in range(args.cp)]
            if one and all(worst):
                # the attention's scaling efficiency on CP GPUs, the all-gather aside: one GPU's row over CP x the
                # slowest rank's share
                row[f"{path}_efficiency"] = one / (args.cp * max(worst))
        print(json.dumps(row), flush=True)
        rows.append(row)
        del q, k, v
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
