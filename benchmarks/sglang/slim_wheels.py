"""Issue 23: cut SGLang's GPU wheel set (benchmarks/sglang/wheels.sh) from about 1.6 GB to about 0.6 GB, for
device leases where every 60 MiB part is one call.

    python3 benchmarks/sglang/slim_wheels.py WHEEL_DIR

Two wheels are most of the bytes, and both only carry attention kernels that a slim engine does not use:
- flashinfer-cubin (448 MB: flashinfer's prebuilt kernels) is dropped;
- sglang-kernel (615 MB) loses `sgl_kernel/flash_ops.abi3.so` (FlashAttention 3, 1.76 GB unpacked), which
  `sgl_kernel/flash_attn.py` alone imports, when SGLang's fa3 attention backend is chosen. Its RECORD loses the
  file's line, so pip installs the rest as a whole wheel.
A slim SGLang then runs with `attention_backend="triton"` and `sampling_backend="pytorch"` (the engine's
`engine_kwargs`); the fa3 backend needs the full set.
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

DROP = ("flashinfer_cubin-",)
STRIP = {"sglang_kernel-": ("sgl_kernel/flash_ops.",)}


def strip_wheel(path: Path, prefixes: tuple[str, ...]) -> int:
    """Rewrite the wheel at `path` without the members whose names start with `prefixes`; returns the bytes saved."""
    before = path.stat().st_size
    tmp = path.with_suffix(".slim")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        dropped = {i.filename for i in src.infolist() if i.filename.startswith(prefixes)}
        if not dropped:
            raise SystemExit(f"slim_wheels: {path.name} has no member starting with {prefixes}")
        for info in src.infolist():
            if info.filename in dropped:
                continue
            data = src.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(keepends=True)
                                if line.split(b",", 1)[0].decode() not in dropped)
            dst.writestr(info, data)
    tmp.replace(path)
    return before - path.stat().st_size


def main() -> None:
    wheels = Path(sys.argv[1])
    saved = 0
    for whl in sorted(wheels.glob("*.whl")):
        if whl.name.startswith(DROP):
            saved += whl.stat().st_size
            whl.unlink()
            print(f"dropped {whl.name}")
            continue
        for prefix, members in STRIP.items():
            if whl.name.startswith(prefix):
                saved += strip_wheel(whl, members)
                print(f"stripped {members} from {whl.name}")
    print(f"slim: {saved / 1e6:.0f} MB saved")


if __name__ == "__main__":
    main()
