#!/usr/bin/env bash
# The wheels every GPU device call carries in .whl (ignored; benchmarks/gpu_session.sh unpacks them over the
# GPU wheelhouse's /tmp/site): grpcio / protobuf for Ray's gRPC, and truststore, which the wheelhouse's httpx2 /
# httpcore2 (the openai client's transport) import but the wheelhouse lacks ("No module named 'truststore'" in
# tests/generator/test_sglang_gpu.py on the H200 host, 2026-11-28). For the GPU image: Python 3.12, manylinux.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl \
    grpcio==1.85.1 protobuf==7.36.2 truststore==0.10.5
ls .whl
