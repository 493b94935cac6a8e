"""The sending learner rank's per-push Python of a planned pack (`PlannedPacker`), without a device:
a Qwen2-0.5B-shaped export (24 layers, 290 tensors; fused QKV and gate/up in the engine's layout)
with a tiny hidden size, so that the copies cost next to nothing and what is timed is the Python
around them (on the GPU path that Python runs before the first bucket goes on the wire).

    python benchmarks/sender_pack_python.py [--layers 24] [--hidden 64] [--against REV]

`--against REV` also times `asyncrl/weightsync/plan.py` as it was at git revision REV, in the same
run (alternating rounds), so the two are compared on one noisy host. Prints one JSON row per packer:
milliseconds per push (the median of the rounds), and checks both pack the same bytes."""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from asyncrl.weightsync import plan as current
from asyncrl.weightsync.plan import EngineLayout, ManifestEntry, ParamLayout


def qwen2_like(layers: int, hidden: int, vocab: int, m: Any = current) -> tuple[list[ManifestEntry], EngineLayout]:
    """The HF export and one engine rank's layout of a Qwen2-shaped model (tied embeddings), in plan module `m`'s
    types (a revision's plan.py reads its own)."""
    manifest: list[ManifestEntry] = []
    params: list[ParamLayout] = []

    def param(name: str, shape: tuple[int, ...], sources: list[tuple[str, int]]) -> None:
        cols = shape[1] if len(shape) > 1 else 1
        stride = (cols, 1) if len(shape) > 1 else (1,)
        ops, row = [], 0
        for hf, rows in sources:
            hshape = (rows,) + shape[1:]
            manifest.append(m.ManifestEntry(hf, "bfloat16", hshape))
            ops.append(m.Op(m.View(row * cols, hshape, stride), hf, m.View(0, hshape, stride)))
            row += rows
        params.append(m.ParamLayout(name, "bfloat16", shape, tuple(ops)))

    h, kv, ffn = hidden, max(hidden // 7, 8), hidden * 5
    param("model.embed_tokens.weight", (vocab, h), [("model.embed_tokens.weight", vocab)])
    for i in range(layers):
        p = f"model.layers.{i}."
        param(p + "self_attn.qkv_proj.weight", (h + 2 * kv, h),
              [(p + "self_attn.q_proj.weight", h), (p + "self_attn.k_proj.weight", kv), (p + "self_attn.v_proj.weight", kv)])
        param(p + "self_attn.qkv_proj.bias", (h + 2 * kv,),
              [(p + "self_attn.q_proj.bias", h), (p + "self_attn.k_proj.bias", kv), (p + "self_attn.v_proj.bias", kv)])
        param(p + "self_attn.o_proj.weight", (h, h), [(p + "self_attn.o_proj.weight", h)])
        param(p + "mlp.gate_up_proj.weight", (2 * ffn, h), [(p + "mlp.gate_proj.weight", ffn), (p + "mlp.up_proj.weight", ffn)])
        param(p + "mlp.down_proj.weight", (h, ffn), [(p + "mlp.down_proj.weight", h)])
        param(p + "input_layernorm.weight", (h,), [(p + "input_layernorm.weight", h)])
        param(p + "post_attention_layernorm.weight", (h,), [(p + "post_attention_layernorm.weight", h)])
    param("model.norm.weight", (h,), [("model.norm.weight", h)])
    return manifest, m.EngineLayout(0, tuple(params))


def plan_module_at(rev: str) -> Any:
    """asyncrl/weightsync/plan.py as it was at `rev`, imported under another name."""
    root = Path(__file__).resolve().parents[1]
    shown = subprocess.run(["git", "show", f"{rev}:asyncrl/weightsync/plan.py"], cwd=root, capture_output=True, text=True)
    if shown.returncode != 0:
        raise SystemExit(f"--against {rev}: no asyncrl/weightsync/plan.py at that revision ({shown.stderr.strip()})")
    text = shown.stdout
    path = Path(tempfile.mkdtemp()) / "plan_at_rev.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"plan_at_{rev}", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--bucket-mb", type=float, default=0.25, help="bucket cap (the tiny export makes a few buckets)")
    ap.add_argument("--pushes", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--against", default="", help="a git revision whose plan.py is timed beside the current one")
    args = ap.parse_args()
    for flag in ("layers", "hidden", "vocab", "pushes", "rounds"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be at least 1")
    if args.bucket_mb <= 0:
        ap.error("--bucket-mb must be positive")
    manifest, _ = qwen2_like(args.layers, args.hidden, args.vocab)
    tensors = [(e.name, torch.randn(e.shape).to(torch.bfloat16)) for e in manifest]
    packers = {"current": current}
    if args.against:
        packers[args.against] = plan_module_at(args.against)
    plans = {}
    for k, m in packers.items():  # each packer's own plan, of the same model in that module's types
        own_manifest, own_layout = qwen2_like(args.layers, args.hidden, args.vocab, m)
        plans[k] = m.build_plan(own_manifest, [own_layout], args.bucket_mb)
    packed = {}
    for k, m in packers.items():  # the same tensors' bytes from each (alignment gaps are not written)
        packed[k] = [[b.buffer[t.offset:t.offset + t.nbytes].clone() for t in b.metas]
                     for b in m.PlannedPacker(plans[k], 0, "cpu").pack(iter(tensors))]
    ref = packed["current"]
    for k, buckets in packed.items():
        if len(buckets) != len(ref) or not all(len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
                                               for a, b in zip(buckets, ref)):
            raise SystemExit(f"{k} packs other bytes than the current packer")
    times: dict[str, list[float]] = {k: [] for k in packers}
    for r in range(args.rounds + 1):  # the first round warms up; packers alternate within each round
        for k, m in packers.items():
            t = time.perf_counter()
            for _ in range(args.pushes):
                for _ in m.PlannedPacker(plans[k], 0, "cpu").pack(iter(tensors)):
                    pass
            if r:
                times[k].append((time.perf_counter() - t) / args.pushes)
    for k, ts in times.items():
        ms = statistics.median(ts) * 1e3
        print(json.dumps({"bench": "sender_pack_python", "packer": k, "tensors": len(manifest), "buckets": len(ref),
                          "ms_per_push": round(ms, 3), "us_per_tensor": round(ms * 1e3 / len(manifest), 2),
                          "rounds": args.rounds, "pushes": args.pushes}))


if __name__ == "__main__":
    main()
