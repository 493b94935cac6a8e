#!/usr/bin/env bash
# SGLang's released wheels for the GPU host, which has no package index (issue 23): sglang 0.5.15 and what its
# requirements need beyond the GPU image and our vLLM wheelhouse (benchmarks/sglang/requirements-gpu.txt says how
# that list was made), tarred and cut into parts of at most 50 MiB (a device call carries at most 64 MiB with the working tree: 61 MiB parts never fit).
#
#   bash benchmarks/sglang/wheels.sh OUT_DIR       # -> OUT_DIR/p0/part0 ... (about 1.6 GB: 32 parts)
#   SGL_SLIM=1 bash benchmarks/sglang/wheels.sh OUT_DIR   # about 0.6 GB: 12 parts, without FlashAttention 3 and
#       flashinfer's prebuilt kernels (slim_wheels.py); that engine runs with attention_backend=triton,
#       sampling_backend=pytorch
#
# On the GPU host, one device call per part (each carries OUT_DIR/pK: `mkdir -p /tmp/sgl-parts && cp OUT_DIR/pK/*
# /tmp/sgl-parts/`), then `bash benchmarks/gpu_session.sh sglang-install`, which unpacks them, lets pip's
# resolver choose (against the image and /tmp/site) what to install into /tmp/site-sglang, and starts SGLang's
# engine once on a random Qwen2-0.5B. SGLang's processes then run with
#   PYTHONPATH=/tmp/site-sglang:/tmp/site:$PWD
# so that SGLang's own pins win where they clash with vLLM's (openai 2.6.1 against 3.54.0, openai-harmony 0.0.4
# against 0.0.8, llguidance 0.7.30 against 1.7.6, apache-tvm-ffi 0.1.11 against 0.1.9, transformers 5.12.1
# against the image's 5.17.0), and vLLM's processes never see that directory.
#
# Why 0.5.15: the newest SGLang whose wheel pins the image's torch (2.11.0) and cuda-python 13; its cp312 wheel
# is tagged manylinux_2_34, which pip only offers with that platform named. The two big ones are sglang-kernel
# 0.4.4 (615 MB) and flashinfer-cubin 0.6.12 (448 MB); flashinfer-python 0.6.12 itself is in the wheelhouse.
set -euo pipefail
out=${1:?usage: wheels.sh OUT_DIR}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/sgl-wheels" "$out"
python3 -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any \
  -d "$work/sgl-wheels" -r "$here/requirements-gpu.txt" 2>&1 | { grep -v "is ignored" || true; }
want=$(grep -cvE '^\s*(#|$)' "$here/requirements-gpu.txt")
got=$(ls "$work/sgl-wheels" | wc -l)
[ "$got" -eq "$want" ] || { echo "wheels.sh: $got wheels for $want requirements" >&2; exit 1; }
[ "${SGL_SLIM:-0}" = 1 ] && python3 "$here/slim_wheels.py" "$work/sgl-wheels"
tar cf "$work/sgl.tar" -C "$work" sgl-wheels
(cd "$work" && split -b 50M -d -a 2 sgl.tar part)
i=0
for p in "$work"/part*; do mkdir -p "$out/p$i"; mv "$p" "$out/p$i/part$(printf %02d $i)"; i=$((i + 1)); done
echo "$got wheels, $i parts"; du -sh "$out"
