#!/usr/bin/env bash
# Jobs side by side in one device call on a multi-GPU host, each a stage of benchmarks/gpu_session.sh on its own
# GPUs with its own Ray head (NO_CLEANUP + RAY_PORT_BASE: gpu_session.sh's own_ray), its own output folder and
# its own settings; everything they wrote is tarred into $OUT/jobs.tgz (the device brings back only a few files).
#
#   bash benchmarks/gpu_jobs.sh CAP "NAME|GPUS|STAGE|KEY=VALUE ..." ...
#
# CAP: seconds from this script's start after which every job is stopped and its files taken as they are (keep
# it under the call's limit). In a KEY=VALUE, "+" stands for a space (PEERS_RUNS=trl+gpu1). JOB_GAP (15) seconds
# between job starts. Example (docs/BENCHMARKS.md, 2026-11-27, sixteenth session):
#   bash benchmarks/gpu_jobs.sh 540 "peers15|0|peers|PEERS_RUNS=trl+gpu1 PEERS_MODEL=/tmp/qwen2-1.5b-long" \
#       "push|1,2|push|TRANSPORT=nccl STEPS=bench:random500m+bench:random1500m" "gputests|3|push|STEPS=collective+direct"
set -u
CAP=${1:?CAP seconds}; shift
export RAY_AUTH_MODE=disabled  # heads started at once race on ~/.ray/auth_token (gpu_session.sh)
mkdir -p "$OUT"
base=30000
for spec in "$@"; do
  IFS='|' read -r name gpus stage envs <<< "$spec"
  base=$((base + 2000))
  ( export CUDA_VISIBLE_DEVICES=$gpus NO_CLEANUP=1 RAY_PORT_BASE=$base OUT=$OUT/$name
    for kv in $envs; do export "${kv//+/ }"; done
    mkdir -p "$OUT"; echo "job $name gpus=$gpus stage=$stage start t=$SECONDS" > "$OUT/stdout.txt"
    timeout -k 10 $((CAP - SECONDS - 5)) bash benchmarks/gpu_session.sh "$stage" >> "$OUT/stdout.txt" 2>&1
    echo "job $name end rc=$? t=$SECONDS" >> "$OUT/stdout.txt" ) &
  sleep "${JOB_GAP:-15}"
done
while [ -n "$(jobs -r)" ] && [ $SECONDS -lt "$CAP" ]; do sleep 2; done
# Each job's own Ray head (gpu_session.sh own_ray: --temp-dir=/tmp/ray_BASE) goes with it: a job stopped at the cap
# otherwise left its engine on the GPU (35 GB on GPU 0 after the cap of 2026-11-27's first call), in the way of the
# next call's jobs. Its actors and their engines end with the raylet (owner_watch.py).
for ((b = 32000; b <= base; b += 2000)); do
  pkill -9 -f "[r]aylet.*ray_$b/" 2>/dev/null; pkill -9 -f "[g]cs_server.*ray_$b/" 2>/dev/null
done
for d in "$OUT"/*/; do echo "== $(basename "$d")"; cut -c1-400 "$d/stdout.txt" | tail -40; done
nvidia-smi --query-gpu=index,memory.used --format=csv,noheader
# Only the tarball stays: the device brings back a few files per call and leaves the rest (the twenty-sixth
# session lost a job's rows that way, with two calls of this script in one device call). KEEP_FILES=1 keeps them.
( cd "$OUT" && tar czf jobs.tgz */ && { [ -n "${KEEP_FILES:-}" ] || rm -rf -- */; } )
