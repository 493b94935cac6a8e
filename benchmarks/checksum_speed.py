"""How fast the device checksum of `verify: checksum` reads a push's bytes, against the floors.

Times, on one CUDA device, for a buffer of --gb gigabytes cut into --segments equal segments (a
push's tensors): the checksum kernel as weightsync launches it (`segment_checksums`, with
its result brought to host) and the same kernel at other warp counts, beside a plain int64 sum
of the buffer (a read at memory bandwidth) and a device copy of it. Prints one JSON object.

  python benchmarks/checksum_speed.py --gb 1.07 --segments 290
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    import torch

    from asyncrl.weightsync import fingerprint as ck

    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.07)
    ap.add_argument("--segments", type=int, default=290)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    nbytes = int(args.gb * 1e9) // 4096 * 4096
    buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
    step = nbytes // args.segments // 8 * 8
    segments = [(i * step, step) for i in range(args.segments)]

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize(dev)
        out = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize(dev)
            out.append(time.perf_counter() - t)
        return statistics.median(out)

    row = {"device": torch.cuda.get_device_name(dev), "bytes": nbytes, "segments": args.segments}
    row["checksum_s"] = timed(lambda: ck.segment_checksums(buf, segments))
    kernel = ck._triton_kernel()
    starts, firsts, counts, masks, _ = ck._programs(tuple(segments), dev)
    partials = torch.empty(starts.numel(), dtype=torch.int64, device=dev)
    table = ck._device_table(dev)
    for warps in (2, 4, 8, 16):
        row[f"kernel_warps{warps}_s"] = timed(lambda w=warps: kernel[(starts.numel(),)](
            buf.view(torch.int64), table, starts, firsts, counts, masks, partials, BLOCK=ck._BLOCK, CHUNK=ck.CH, num_warps=w))
    row["int64_sum_s"] = timed(lambda: buf.view(torch.int64).sum())
    other = torch.empty_like(buf)
    row["copy_s"] = timed(lambda: other.copy_(buf))
    row["checksum_gbps"] = nbytes / row["checksum_s"] / 1e9
    print(json.dumps(row))


if __name__ == "__main__":
    main()
