#!/usr/bin/env bash
# The GPU wheelhouse (../shared/gpu/wheelhouse.sh: vllm 0.24.0, megatron-core 0.19.2, ray 2.60.0 and what the GPU
# image lacks) cut into parts of 50 MiB in OUT_DIR/pK/partK (default .whl-parts, ignored by git), one device call
# each. wheelhouse.sh cuts 60 MiB parts, and a call carries 64 MiB in all, the working tree (7.4 MB on 2026-12-01)
# included: a 60 MiB part no longer travels beside it.
#
#   bash benchmarks/gpu_wheel_parts.sh [OUT_DIR]     # then, per part K: carry OUT_DIR/pK and run
#   mkdir -p /tmp/parts && cp .whl-parts/pK/* /tmp/parts/       (benchmarks/gpu_session.sh installs them)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.whl-parts}
shared=${SHARED:-../shared}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
grep -qx '/.whl-parts/' .git/info/exclude 2>/dev/null || echo /.whl-parts/ >> .git/info/exclude
bash "$shared/gpu/wheelhouse.sh" "$work/cut60"
cat "$work"/cut60/p*/part* > "$work/wh.tar"  # the parts in order (p0..p9 sort as written: one digit)
rm -rf "$work/cut60" "$out" && mkdir -p "$out"
(cd "$work" && split -b 50M -d -a 1 wh.tar part)
i=0
for p in "$work"/part?; do mkdir -p "$out/p$i"; mv "$p" "$out/p$i/"; i=$((i + 1)); done
tar tf <(cat "$out"/p*/part*) > /dev/null  # the parts make the whole tar again
du -sh "$out"/p*
