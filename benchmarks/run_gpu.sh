#!/usr/bin/env bash
# The GPU figures of docs/BENCHMARKS.md, on one GPU with no package index and no internet.
#
#   bash benchmarks/run_gpu.sh gen       # generation: `vllm serve` vs our API (SIZE=0.5b|1.5b, SIDES=vllm,asyncrl,vllm)
#   bash benchmarks/run_gpu.sh gen-profile   # the same, with per-process CPU and py-spy profiles per phase
#   bash benchmarks/run_gpu.sh learner   # learner: parity, round trip, step time; then the gpu tests
#   TP=2 bash benchmarks/run_gpu.sh learner   # the same at tensor parallel 2 over two GPUs (no tests)
#
# Expects the GPU wheels unpacked in /tmp/wheelhouse (vllm 0.24.0, megatron-core 0.19.2, ray 2.60.0
# and their needs, for the image's python 3.12 + torch 2.11.0+cu130) and the demo model in
# artifacts/demo-model (its tokenizer is reused). Installs once into /tmp/site, builds the random
# Qwen2-0.5B-shaped model once into /tmp/qwen2-0.5b-random, writes logs and JSON under $OUT.
set -uo pipefail
stage=${1:?usage: run_gpu.sh gen|learner}
OUT=${OUT:-/tmp/bench-out}
SIZE=${SIZE:-0.5b}
case $SIZE in
    0.5b) MODEL_ARGS="" ;;
    1.5b) MODEL_ARGS="--layers 28 --hidden 1536 --heads 12 --kv-heads 2 --ffn 8960" ;;
    *) echo "SIZE must be 0.5b or 1.5b"; exit 2 ;;
esac
MODEL=${MODEL:-/tmp/qwen2-$SIZE-random}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 \
    PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

# (A wheelhouse without vllm, enough for the learner stage, works too.)
if [ ! -f /tmp/site/.wheelhouse-done ]; then
    t0=$SECONDS
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/wheelhouse/*.whl || exit 1
    touch /tmp/site/.wheelhouse-done
    echo "install: $((SECONDS - t0)) s"
fi
# Extra wheels in .whl/ (carried) override the wheelhouse / image: grpcio >= 1.85.1 is what the
# wheelhouse's grpcio-reflection (imported by ray.serve) checks for (the image has 1.84.0), and its
# generated code needs protobuf >= 7.35.1. They are unpacked over /tmp/site (with
# googleapis-common-protos), not installed with `pip --target --upgrade`, which replaces the whole
# google/ namespace directory and drops google.rpc.
if [ ! -f /tmp/site/.extra-done ]; then
    for w in /tmp/wheelhouse/googleapis_common_protos*.whl .whl/*.whl; do
        [ -f "$w" ] && python3 -m zipfile -e "$w" /tmp/site
    done
    touch /tmp/site/.extra-done
    echo "extra wheels unpacked: $(ls .whl/*.whl 2>/dev/null | tr '\n' ' ')"
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c '
import sys, torch, importlib.metadata as m
def v(p):
    try:
        return m.version(p)
    except m.PackageNotFoundError:
        return None
print(sys.version.split()[0], torch.__version__, [(p, v(p)) for p in ("vllm", "megatron-core", "transformers", "ray", "tokenizers", "grpcio", "protobuf")])'
  env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)=' | tr '\n' ' '; echo
  python3 -c 'import ray.serve; print("ray.serve imports")' 2>&1 | tail -1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if [ ! -f "$MODEL/config.json" ]; then
    python3 benchmarks/make_random_qwen2.py --tokenizer-from artifacts/demo-model --out "$MODEL" $MODEL_ARGS 2>&1 | tail -2 | tee "$OUT/make_model.log"
fi

GEN_ARGS="--model $MODEL --dtype bfloat16 --num-gpus 1 --max-model-len 1024 --num-prompts 1024 --concurrency 128 --max-tokens 256 --warmup 64 --sides ${SIDES:-vllm,asyncrl,vllm}"
case $stage in
gen)
    timeout "${GEN_TIMEOUT:-540}" python3 benchmarks/generation.py $GEN_ARGS --log-dir /tmp/gen-logs-$SIZE ${EXTRA_GEN_ARGS:-} \
        > "$OUT/generation-$SIZE.log" 2>&1
    echo "generation rc=$?"
    grep '"benchmark": "generation' "$OUT/generation-$SIZE.log" | tee "$OUT/generation-$SIZE.json"
    grep '^\[generation\]' "$OUT/generation-$SIZE.log" | cut -c1-300
    tar czf "$OUT/vllm-serve-logs-$SIZE.tgz" -C /tmp "gen-logs-$SIZE" 2>/dev/null
    ;;
gen-profile)
    # The same run under benchmarks/profile_generation.py: per-process CPU per phase, and py-spy
    # profiles (GIL-holding samples) when a py-spy binary is carried in .whl/py-spy. TAG names the
    # output folder; EXTRA_GEN_ARGS (e.g. --sides http) go to generation.py.
    spy=$([ -x .whl/py-spy ] && echo "--py-spy .whl/py-spy --gil")
    dir="$OUT/profile-$SIZE${TAG:+-$TAG}"
    timeout "${GEN_TIMEOUT:-540}" python3 benchmarks/profile_generation.py --out "$dir" $spy -- \
        $GEN_ARGS ${EXTRA_GEN_ARGS:-} > "$dir.txt" 2>&1
    echo "profile rc=$?"
    grep '"benchmark": "generation' "$dir/generation.log"
    grep -v '^{' "$dir.txt" | head -150 | cut -c1-200
    # the raw profiles in one file (the device tool brings back a limited number of files)
    ls "$dir"/spy-*.txt > /dev/null 2>&1 && tar czf "$dir-spy.tgz" -C "$dir" $(cd "$dir" && ls spy-*.txt) && rm "$dir"/spy-*.txt
    ;;
learner)
    TP=${TP:-1}
    sfx=$([ "$TP" -gt 1 ] && echo "_tp$TP")
    timeout "${LEARNER_TIMEOUT:-360}" python3 benchmarks/learner_step.py --model "$MODEL" --out "$OUT/learner$sfx.json" \
        --tp "$TP" --sections "${LEARNER_SECTIONS:-parity,bare,role,group}" --collective-timeout-s 180 \
        > "$OUT/learner$sfx.log" 2>&1
    echo "learner_step rc=$?"
    grep '^\[learner_step\]' "$OUT/learner$sfx.log" | cut -c1-1500
    if [ "${RUN_TESTS:-1}" = 1 ] && [ "$TP" = 1 ]; then
        timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/learner/test_gpu_learner.py \
            > "$OUT/pytest_gpu.log" 2>&1
        echo "pytest rc=$?"
        tail -5 "$OUT/pytest_gpu.log"
    fi
    ;;
esac
# Ray's own logs, when a Ray process failed to start.
if [ -d /tmp/ray/session_latest/logs ]; then
    for f in /tmp/ray/session_latest/logs/*.err /tmp/ray/session_latest/logs/raylet.out /tmp/ray/session_latest/logs/dashboard_agent.log; do
        [ -s "$f" ] && { echo "== $f"; tail -n 25 "$f"; }
    done > "$OUT/ray_logs_$stage.txt" 2>&1
fi
