#!/usr/bin/env bash
# The two-H200 figures of docs/BENCHMARKS.md ("GPU (two H200): NCCL and CUDA-IPC ..."), one stage per device
# call: bash benchmarks/gpu_session.sh nccl|ipc|async|offload (output under $OUT); on one GPU, hybrid
# placement: bash benchmarks/gpu_session.sh sleep (the sleep/wake GPU test), then hybrid-loop (the demo
# co-located, deploy/rlhf-hybrid1.yaml, with its logs packed into $OUT/loop.tgz); on two GPUs, the learner's
# layout tests over NCCL: bash benchmarks/gpu_session.sh learner2, and the learner's speed at TP=2 + SP and CP=2:
# learner2-speed; on one GPU, the learner on a random Qwen2-MoE: moe. On a 4-GPU host (docs/BENCHMARKS.md, "GPU (four
# H200), third lease"): install (in the last wheel part's call), then quad (balanced | peers | push side by side),
# scale (the 7B with the autoscaler) and duo (the NCCL push | demo-nccl); balanced, demo-nccl also alone; sglang-install
# (issue 23: SGLang's parts from benchmarks/sglang/wheels.sh in /tmp/sgl-parts, installed apart and started once) and
# sglang-tests (its GPU tests and the demo with it);
# gpu8 (issue 30's full layout, deploy/rlhf-gpu8.yaml, on an 8-GPU host). Expects the GPU wheelhouse parts
# in /tmp/parts (see the device README: 8 carried parts) and carries .whl (benchmarks/gpu_extra_wheels.sh: grpcio, protobuf, truststore) and
# artifacts/demo-model. Installs once into /tmp/site; grpcio/protobuf are unpacked over it, because
# `pip --target --upgrade` would replace the whole google/ namespace and drop google.rpc.
# Stages run side by side on a 4-GPU host (quad, duo) call this script once per job with NO_CLEANUP=1 and a
# RAY_PORT_BASE: such a job starts a Ray head of its own on ports from that base (own_ray) and leaves other jobs'
# Ray and vLLM processes alone.
set -uo pipefail
# Ray 2.60 turns token authentication on for a new local cluster and writes the token to ~/.ray/auth_token;
# clusters started at once on one host race on that file (seen on the 4-GPU host: `ray.init()` giving up after
# 30 s, "The current node timed out during startup", while `ray start --head` alone always came up). These
# machines reach nothing outside: no tokens.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
own_ray() {  # own_ray BASE: a head node on ports BASE.. (its own temp dir), and RAY_ADDRESS pointing at it
  local b=$1
  timeout 120 ray start --head --port=$b --ray-client-server-port=$((b+1)) --node-manager-port=$((b+2)) \
      --object-manager-port=$((b+3)) --dashboard-agent-grpc-port=$((b+4)) --dashboard-agent-listen-port=$((b+5)) \
      --metrics-export-port=$((b+6)) --runtime-env-agent-port=$((b+7)) --dashboard-port=$((b+8)) \
      --min-worker-port=$((b+100)) --max-worker-port=$((b+999)) --temp-dir=/tmp/ray_$b --include-dashboard=false \
      --disable-usage-stats --num-cpus ${RAY_CPUS:-16} > $OUT/ray_start_$b.log 2>&1
  echo "ray head on port $b rc=$?"
  export RAY_ADDRESS=127.0.0.1:$b
}
if [ ! -d /tmp/site/vllm ]; then
  cat /tmp/parts/part* | tar xf - -C /tmp
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/wheelhouse/*.whl 2>&1 | grep -v WARNING | tail -3
fi
# grpcio / protobuf for Ray's gRPC: unpacked over /tmp/site (pip --target --upgrade would replace
# the whole google/ namespace directory and drop google.rpc).
if [ ! -f /tmp/site/.extra-done ]; then
  for w in /tmp/wheelhouse/googleapis_common_protos*.whl .whl/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done
  touch /tmp/site/.extra-done
fi
mkdir -p $OUT
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1
if [ -n "${NO_CLEANUP:-}" ] && [ -n "${RAY_PORT_BASE:-}" ] && [ "$1" != quad ] && [ "$1" != duo ]; then own_ray $RAY_PORT_BASE; fi
# The demo and the async runs start Ray from their driver (ray.init) unless RAY_ADDRESS names a head: on a fresh
# two-H200 host (2026-11-29) that start timed out twice in a row ("The current node timed out during startup"),
# while `ray start --head` (own_ray) right after came up and the demo ran. Such a stage gets a head of its own.
# (A head does not outlive its device call: the next call starts one again.)
case $1 in demo-nccl|async)
  if [ -z "${RAY_ADDRESS:-}" ]; then  # (side by side, NO_CLEANUP: other jobs' Ray processes are left alone)
    [ -n "${NO_CLEANUP:-}" ] || { pkill -9 -f "[r]ay::"; pkill -9 -f "[r]aylet"; pkill -9 -f "[g]cs_server"
                                  rm -rf /tmp/ray/session_*; sleep 1; }
    own_ray ${RAY_PORT_BASE:-30000}
  fi ;;
esac
MODEL=/tmp/qwen2-0.5b-random
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
case $1 in
push)
  # The weight push in the engines' own layout (issue 22; TRANSPORT=nccl on two GPUs: learner on
  # GPU 1, engine on GPU 0, issue 28), step by step in $STEPS (each
  # writes its log under $OUT as it goes: a call cut short still brings back what ran):
  #   bench:MODEL  push vs raw over ipc (benchmarks/weightsync.py; random500m, random1500m = 3.1 GB)
  #   direct       a vLLM engine decodes transformers' tokens after a push; Triton checksums = numpy's
  #   collective   the ipc transport between processes (buffers reused, handles opened once)
  #   ckspeed      the device checksum's speed (benchmarks/checksum_speed.py)
  # PROFILE_DIR: each bench step also profiles one push (sender, replica, publisher) into it
  #   engine:NAME  the steps after it push into NAME's replicas (vllm | sglang), as ENGINE does for all of them
  for step in ${STEPS:-bench:random500m direct bench:random1500m collective}; do
    case $step in
    engine:*) ENGINE=${step#engine:} ;;
    bench:*)  # bench:MODEL or bench:MODEL:VERIFY (a verify mode for this step alone)
      m=${step#bench:}; v=${VERIFY:-checksum}
      case $m in *:*) v=${m#*:}; m=${m%%:*} ;; esac
      t=${TRANSPORT:-ipc}; log=$OUT/ws_push_${t}_${m##*/}_$v${SENDER_ARENA:+_$SENDER_ARENA}${ENGINE:+_$ENGINE}.log
      # the install call's random 7B (bench:/tmp/qwen2-7b-random) may still be being written
      for i in $(seq 1 60); do pgrep -f "[m]ake_random_qwen2.py.*$m.tmp" > /dev/null || break; sleep 5; done
      # SENDER_ARENA (gloo / nccl): auto, whole or ring (weightsync.py --sender-arena)
      # BENCH_TIMEOUT (360): a fresh host's random 1.5B took 204 s to build and start its engine (2026-11-27, H100s)
      # ENGINE (vllm): sglang pushes into SGLang replicas (after sglang-install; HF layout, its own staging);
      # BUCKET_MB (64): a size in MiB, or a comma list measured in turn on the same engines (64,256)
      ASYNCRL_PROFILE_DIR=${PROFILE_DIR:-} timeout ${BENCH_TIMEOUT:-360} python3 benchmarks/weightsync.py --models $m --replicas 1 --repeats 3 --transports $t \
          --gpus 0.5 --dtype bfloat16 --verify $v --sender-arena ${SENDER_ARENA:-auto} \
          --bucket-mb ${BUCKET_MB:-64} --timeout-s ${PUSH_TIMEOUT:-90} --engine ${ENGINE:-vllm} --engine-pythonpath "$([ "${ENGINE:-vllm}" = sglang ] && echo /tmp/site-sglang:/tmp/site:$PWD)" > $log 2>&1
      echo "weightsync $t $m verify=$v rc=$?"; grep '^{' $log | tee -a $OUT/ws_push.json
      grep '^\[weightsync' $log | tail -4  # where it got (each push's time)
      grep -v '^{' $log | grep -iE "error|Traceback|layout" | tail -8 | cut -c1-400
      ;;
    ckspeed)  # the device checksum against a plain read and a copy of the same bytes
      timeout 120 python3 benchmarks/checksum_speed.py --gb 1.07 --segments 290 2>&1 | tee -a $OUT/checksum_speed.json | cut -c1-600
      ;;
    direct|collective)
      f=$([ $step = direct ] && echo test_direct_gpu.py || echo test_collective_gpu.py)
      timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -m gpu tests/weightsync/$f > $OUT/${step}_gpu_test.log 2>&1
      echo "$step pytest rc=$?"; grep -E "passed|failed|Error|assert" $OUT/${step}_gpu_test.log | head -12 | cut -c1-600
      ;;
    esac
  done
  ;;
nccl)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/weightsync/test_collective_gpu.py \
      tests/weightsync/test_hostcopy.py > $OUT/collective_gpu_test.log 2>&1
  echo "pytest rc=$?"; tail -15 $OUT/collective_gpu_test.log | cut -c1-600
  timeout 380 python3 benchmarks/weightsync.py --models random500m --replicas 1 --repeats 3 --transports ${TRANSPORTS:-nccl,shm} \
      --gpus 0.5 --dtype bfloat16 --verify ${VERIFY:-checksum} > $OUT/ws_nccl.log 2>&1
  echo "weightsync rc=$?"; grep '^{' $OUT/ws_nccl.log | tee $OUT/ws_nccl.json; grep -v '^{' $OUT/ws_nccl.log | tail -6 | cut -c1-400
  ;;
ws-tests|ipc)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/weightsync/test_collective_gpu.py \
      tests/weightsync/test_hostcopy.py > $OUT/collective_gpu_test.log 2>&1
  echo "pytest rc=$?"; tail -15 $OUT/collective_gpu_test.log | cut -c1-600
  [ "$1" = ipc ] || exit 0
  # VERIFY: one or more verify modes (one benchmark run each), e.g. VERIFY="full checksum" TRANSPORTS=ipc
  for v in ${VERIFY:-checksum}; do
    CUDA_VISIBLE_DEVICES=0 timeout 400 python3 benchmarks/weightsync.py --models random500m --replicas 1 --repeats 3 \
        --transports ${TRANSPORTS:-ipc,shm} --gpus 0.5 --dtype bfloat16 --verify $v > $OUT/ws_ipc_$v.log 2>&1
    echo "weightsync verify=$v rc=$?"; grep '^{' $OUT/ws_ipc_$v.log | tee -a $OUT/ws_ipc.json; grep -v '^{' $OUT/ws_ipc_$v.log | tail -6 | cut -c1-400
  done
  ;;
async)
  timeout 420 python3 benchmarks/async_speedup.py --config deploy/rlhf-gpu2.yaml --steps 30 --num-cpus 32 \
      --out $OUT/async_speedup.json > $OUT/async_speedup.log 2>&1
  echo "async rc=$?"; tail -12 $OUT/async_speedup.log | cut -c1-400
  ;;
sleep)
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/generator/test_sleep_gpu.py \
      > $OUT/sleep_gpu_test.log 2>&1
  echo "pytest rc=$?"; tail -25 $OUT/sleep_gpu_test.log | cut -c1-800
  ;;
hybrid-loop)
  CONFIG=${CONFIG:-deploy/rlhf-hybrid1.yaml} OUT=$OUT/loop bash benchmarks/gpu_loop_smoke.sh
  tar czf $OUT/loop.tgz -C $OUT loop && rm -rf $OUT/loop
  ;;
long-e2e)
  # Issue 62: deploy/rlhf-gpu1-long.yaml end to end (responses up to 16k tokens, engine and learner on the one GPU)
  # for LONG_STEPS (20) steps: the random 3B shape with EOS raised (as the peers stage's long tail builds it), then
  # gpu_loop_smoke.sh until that step or LONG_TIMEOUT (480 s) of `serve run`; the run's jsonl rows come back in $OUT/long.
  M=/tmp/qwen2.5-3b-random-longtail1500
  if [ ! -f $M/config.json ]; then
    timeout 240 python3 benchmarks/make_random_qwen2.py --tokenizer-from artifacts/demo-model --out $M --layers 36 --hidden 2048 \
        --heads 16 --kv-heads 2 --ffn 11008 --eos-mean-tokens 1500 --eos-max-new-tokens 8192 > $OUT/make_long.log 2>&1
    echo "make model rc=$? t=$SECONDS s"; tail -1 $OUT/make_long.log | cut -c1-600
  fi
  ray stop --force > /dev/null 2>&1
  CONFIG=deploy/rlhf-gpu1-long.yaml STEPS=${LONG_STEPS:-20} SERVE_TIMEOUT=${LONG_TIMEOUT:-480} OUT=$OUT/long \
      bash benchmarks/gpu_loop_smoke.sh
  echo "long-e2e t=$SECONDS s"; tail -3 $OUT/long/serve.log | cut -c1-400
  python3 - $OUT/long <<'PY'
import json, pathlib, sys
d = pathlib.Path(sys.argv[1])
rows = [json.loads(l) for f in sorted(d.glob("*.jsonl")) for l in f.read_text().splitlines() if l.startswith("{")]
print(len(rows), "rows")
for r in rows[-22:]:
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
           if k == "step" or k.startswith("time/") or "failed" in k or "len" in k or k in ("buffer/trained", "buffer/dropped_stale")})
PY
  tar czf $OUT/long.tgz -C $OUT long 2>/dev/null
  ;;
learner2)
  # The CPU (gloo) learner tests unchanged, one rank per GPU over NCCL: PP=2, EP=2 (MoE), DP=2, TP=2 -> TP=1
  # checkpoint re-layout, the LearnerGroup layouts (TP=2 + SP, CP=2, PP=2, VPP=2, packed rows) against
  # TP=1 and transformers, the critic at those layouts; then a TP=2 vLLM engine over both GPUs fed by
  # a TP=2 learner's push. TESTS overrides the list. SIGINT first, so a hang still ends with pytest's
  # traceback and summary.
  nvidia-smi -L | tee $OUT/gpus.txt
  timeout -s INT -k 20 ${TEST_TIMEOUT:-480} python3 -m pytest -q -rA -p no:cacheprovider --durations=15 \
      ${TESTS:-tests/learner/test_megatron_layouts.py tests/learner/test_group.py tests/weightsync/test_engine_tp2.py} \
      > $OUT/learner2.log 2>&1
  echo "pytest rc=$?"; grep -E '^(PASSED|FAILED|ERROR|SKIPPED) | in [0-9.]+s( |$)' $OUT/learner2.log | cut -c1-400
  tail -8 $OUT/learner2.log | cut -c1-600
  ;;
learner2-speed)
  # The learner at 1.5B, 8 x 8192 tokens, micro-batch 1 (issue 29): one GPU, then TP=2 + SP and CP=2 over
  # both GPUs, in one call (the same random model and batch). learner_speed.sh finds the wheels installed.
  # Data parallelism runs through the group section (the batch split over DP as a run's): LAYOUTS="1gpu-group dp2
  # dp2sh" (dp2sh: learner.memory.optimizer sharded), e.g. SHAPES=3b:16x4096:2 for issue 67's DP=2 on the 3B.
  # tp2spo: TP=2 + SP with strategy_config.tp_comm_overlap (LAYOUTS="1gpu tp2sp tp2spo" is its A/B).
  touch /tmp/site/.learner-wheels
  for lay in ${LAYOUTS:-1gpu tp2sp cp2}; do
    sec=${SECTIONS:-role}
    case $lay in 1gpu) par="" ;; tp2sp) par="--tp 2 --sequence-parallel" ;; cp2) par="--cp 2" ;; tp2) par="--tp 2" ;;
      tp2spo) par="--tp 2 --sequence-parallel --tp-comm-overlap" ;;
      1gpu-group) par=""; sec=group ;; dp2) par="--dp 2"; sec=group ;; dp2sh) par="--dp 2 --optimizer sharded"; sec=group ;;
    esac
    OUT=$OUT SECTIONS=$sec TAG=$lay PARALLEL="$par" STEP_TIMEOUT=${STEP_TIMEOUT:-200} \
        bash benchmarks/learner_speed.sh ${SHAPES:-1.5b:8x8192:1}
  done
  ;;
gpu4)
  # Four GPUs (issue 30): a random Qwen2-7B-shaped model (15.2 GB in bf16) trained by GRPO in the separated
  # placement of deploy/rlhf-gpu4.yaml (engine TP = 2 on two GPUs, learner TP = 2 + SP on two), eta in ETAS,
  # NSTEPS learner steps each (the first is warm-up); SETS adds --set overrides. The model is built once per
  # warm machine.
  M=/tmp/qwen2-7b-random
  for i in $(seq 1 60); do pgrep -f "[m]ake_random_qwen2.py.*$M.tmp" > /dev/null || break; sleep 5; done  # the install call's build
  if [ ! -f $M/config.json ]; then
    timeout 400 python3 benchmarks/make_random_qwen2.py --tokenizer-from artifacts/demo-model --out $M --layers 28 \
        --hidden 3584 --heads 28 --kv-heads 4 --ffn 18944 --untied > $OUT/make_7b.log 2>&1
    echo "make 7b rc=$?"; tail -1 $OUT/make_7b.log | cut -c1-300
  fi
  echo "7b model ready at t=$SECONDS s"
  pkill -9 -f "[r]ay::"; pkill -9 -f "[r]aylet"; pkill -9 -f "[g]cs_server"; rm -rf /tmp/ray/session_*; sleep 1
  sets=(--set model.path=$M); for kv in ${SETS:-}; do sets+=(--set "$kv"); done
  # ray.init's own start gave up after 30 s once on a fresh 4-GPU host ("node timed out during startup",
  # no raylet log): start the node apart, where its errors are printed, and connect to it.
  # no expandable_segments here: vLLM TP = 2 custom all-reduce fails on it (custom_all_reduce.cuh: invalid argument)
  timeout 180 ray start --head --num-cpus 48 --include-dashboard=false --disable-usage-stats > $OUT/ray_start.log 2>&1
  echo "ray start rc=$?"; grep -iE "error|fail|started" $OUT/ray_start.log | head -5 | cut -c1-300
  # the app's own limit 45 s before the call's: a run cut short still reports the steps it finished
  RAY_ADDRESS=auto timeout -s INT -k 30 ${RUN_TIMEOUT:-520} python3 benchmarks/async_speedup.py --timeout-s $((${RUN_TIMEOUT:-520} - 45)) \
      --config deploy/rlhf-gpu4.yaml --steps ${NSTEPS:-6} --etas ${ETAS:-0} --num-cpus 48 "${sets[@]}" \
      --out $OUT/gpu4_eta${ETAS// /_}.json > $OUT/gpu4.log 2>&1
  echo "gpu4 rc=$?"; grep -v '^{' $OUT/gpu4.log | grep -E '^\||machine|push / raw' | cut -c1-400
  # the push plan formed, and the raw probe
  grep -hE "push plan |raw broadcast of" $OUT/gpu4.log /tmp/ray/session_latest/logs/*.err \
      /tmp/ray/session_latest/logs/*.out 2>/dev/null | sort -u | head -6 | cut -c1-300
  grep -iE "error|Traceback|out of memory|OOM" $OUT/gpu4.log | head -12 | cut -c1-400
  ls /tmp/ray/session_latest/logs > /dev/null 2>&1 && tar czf $OUT/ray_logs.tgz -C /tmp/ray/session_latest logs 2>/dev/null
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader
  ;;
pair)
  # Two GPU pairs at once on a 4-GPU host: GPUs 0,1 run the NCCL push benchmark (issue 28; MODELS), GPUs
  # 2,3 the LearnerGroup layout tests over NCCL (issue 29), each with a Ray of its own.
  ( export CUDA_VISIBLE_DEVICES=0,1 RAY_ADDRESS=local RAY_TMPDIR=/tmp/ray_a
    for m in ${MODELS:-random500m random1500m}; do
      timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/weightsync.py --models $m --replicas 1 --repeats 3 --transports nccl \
          --gpus 0.5 --dtype bfloat16 --verify ${VERIFY:-checksum} > $OUT/ws_push_nccl_${m##*/}.log 2>&1
      echo "weightsync nccl $m rc=$?" >> $OUT/pair_a.txt; grep '^{' $OUT/ws_push_nccl_${m##*/}.log >> $OUT/ws_push.json
    done ) &
  ( export CUDA_VISIBLE_DEVICES=2,3 RAY_ADDRESS=local RAY_TMPDIR=/tmp/ray_b
    timeout -s INT -k 20 ${TEST_TIMEOUT:-520} python3 -m pytest -q -rA -p no:cacheprovider --durations=20 -x \
        ${TESTS:-tests/learner/test_group.py} > $OUT/learner2.log 2>&1
    echo "pytest rc=$?" >> $OUT/pair_b.txt ) &
  wait
  cat $OUT/pair_a.txt; cut -c1-1500 $OUT/ws_push.json 2>/dev/null
  grep -hv '^{' $OUT/ws_push_nccl_*.log | grep -iE "error|Traceback" | tail -6 | cut -c1-300
  cat $OUT/pair_b.txt; grep -E '^(PASSED|FAILED|ERROR|SKIPPED) | in [0-9.]+s( |$)' $OUT/learner2.log | cut -c1-300
  tail -4 $OUT/learner2.log | cut -c1-400
  ;;
cp-attention)
  # Issue 67, one GPU: a CP rank's attention (its bottom-right causal segments as the product computes them, two
  # cuDNN calls merged on Hopper, against SDPA's causal_lower_right bias) vs the row on one GPU
  # (benchmarks/cp_attention.py), then its GPU test.
  timeout ${CP_TIMEOUT:-240} python3 benchmarks/cp_attention.py --widths ${CP_WIDTHS:-8192 32768 65536} --cp ${CP:-2} \
      --out $OUT/cp_attention.jsonl > $OUT/cp_attention.log 2>&1
  echo "cp_attention rc=$?"; cut -c1-1500 $OUT/cp_attention.log | tail -8
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/learner/test_attention_gpu.py > $OUT/attn_gpu.log 2>&1
  echo "pytest rc=$?"; tail -5 $OUT/attn_gpu.log | cut -c1-600
  ;;
moe)
  # A random Qwen2-MoE (16 routed experts, top 4, a gated shared expert) through the learner on one GPU:
  # parity vs transformers, HF round trip, bare fwd+bwd and ActorRole step time (EP = 1).
  M=/tmp/qwen2-moe-random
  [ -f $M/config.json ] || python3 benchmarks/make_random_qwen2.py --tokenizer-from artifacts/demo-model --out $M \
      --layers 12 --hidden 1024 --heads 16 --kv-heads 4 --experts 16 --moe-topk 4 --moe-ffn 1024 --shared-ffn 2048 \
      > $OUT/make_moe.log 2>&1
  tail -1 $OUT/make_moe.log | cut -c1-300
  timeout 480 python3 benchmarks/learner_step.py --model $M --sections parity,bare,role --out $OUT/moe.json > $OUT/moe.log 2>&1
  echo "moe rc=$?"; grep '^\[learner_step\]' $OUT/moe.log | cut -c1-2500; tail -3 $OUT/moe.log | cut -c1-600
  ;;
longseq)
  # Issue 62: the learner alone on long sequences (benchmarks/learner_step.py, role section: compute_log_prob and
  # update_actor on random tokens, one rank). LONGSEQ: entries split by ';', each "MODEL BATCH SEQ_LEN [learner_step
  # flags]", MODEL 3b (the random Qwen2.5-3B shape, /tmp/qwen2.5-3b-random, as the peers stage builds it) or 7b
  # (Qwen2.5-7B's: 28 layers, hidden 3584, 28 heads, 4 KV heads, FFN 18944, untied). Each model's config says
  # max_position_embeddings 131072 (random weights: RoPE has no learned positions). One JSON per entry under $OUT;
  # an entry gets LONGSEQ_TIMEOUT (240 s) and none starts with less than 60 s of LONGSEQ_BUDGET (560 s) left.
  IFS=';' read -ra entries <<< "${LONGSEQ:-3b 2 32768 --recompute full}"
  i=0
  for e in "${entries[@]}"; do
    read -r key batch seq flags <<< "$e"
    case $key in
    3b) M=/tmp/qwen2.5-3b-random; shape="--layers 36 --hidden 2048 --heads 16 --kv-heads 2 --ffn 11008" ;;
    7b) M=/tmp/qwen2.5-7b-random; shape="--layers 28 --hidden 3584 --heads 28 --kv-heads 4 --ffn 18944 --untied" ;;
    *) echo "longseq: unknown model '$key' (3b 7b)"; continue ;;
    esac
    if [ ! -f $M/config.json ]; then
      timeout 300 python3 benchmarks/make_random_qwen2.py --tokenizer-from artifacts/demo-model --out $M $shape \
          --max-position-embeddings 131072 > $OUT/make_$key.log 2>&1
      echo "make $key rc=$? t=$SECONDS s"
    fi
    python3 -c "import json,sys; p=sys.argv[1]; c=json.load(open(p)); c['max_position_embeddings']=max(c['max_position_embeddings'],131072); json.dump(c,open(p,'w'),indent=1)" $M/config.json
    left=$(( ${LONGSEQ_BUDGET:-560} - SECONDS )); cap=${LONGSEQ_TIMEOUT:-240}; [ $cap -lt $left ] && left=$cap
    if [ $left -lt 60 ]; then echo "longseq [$e]: skipped, $left s left"; continue; fi
    i=$((i + 1)); log=$OUT/longseq_$i.log
    echo "longseq $i [$e]: starts at t=$SECONDS s, at most $left s"
    timeout -k 10 $left python3 benchmarks/learner_step.py --model $M --sections role --batch $batch --seq-len $seq \
        --prompt-len 256 --group-size $(( batch > 1 ? batch : 2 )) --micro-batch-size 1 --warmup 1 --steps 2 $flags --out $OUT/longseq_$i.json > $log 2>&1
    echo "longseq $i rc=$? t=$SECONDS s"
    grep '^\[learner_step\] role:' $log | cut -c1-1800
    grep -iE "Traceback|Error|out of memory" $log | grep -v Warning | tail -4 | cut -c1-400
  done
  nvidia-smi --query-gpu=memory.used --format=csv,noheader
  ;;
offload)
  [ -f $MODEL/config.json ] || python3 benchmarks/make_random_qwen2.py --tokenizer-from artifacts/demo-model --out $MODEL > $OUT/make_model.log 2>&1
  timeout 400 python3 benchmarks/learner_step.py --model $MODEL --sections offload --offload-each-flag \
      --out $OUT/offload.json > $OUT/offload.log 2>&1
  echo "offload rc=$?"; grep '^\[learner_step\]' $OUT/offload.log | cut -c1-3000
  ;;
peers)
  # Issue 32, side by side with TRL on one GPU (docs/BENCHMARKS.md "Side by side with TRL"): TRL's GRPOTrainer with
  # vLLM colocated (benchmarks/peers/trl_grpo.py), then asyncrl hybrid (deploy/rlhf-hybrid1.yaml) at HYBRID_ETAS
  # (default 0), then asyncrl separated on the one GPU (deploy/rlhf-gpu1.yaml) at GPU1_ETAS (default "0 2"), all on
  # the same model (PEERS_MODEL, default the random Qwen2-0.5B), PEERS_PROMPTS x PEERS_GROUP samples per step
  # (8 x 8), completions of exactly PEERS_TOKENS tokens (256), lr PEERS_LR (1e-6), bf16; PEERS_WARMUP steps (3)
  # left out, PEERS_STEPS (8) timed. Rows go to $OUT/peers.json (each run appends when it ends), the table to
  # $OUT/peers.md, the bars to $OUT/peers.png. PEERS_ARGS adds knobs to both sides (e.g. "--micro-batch-size 16",
  # or "--no-fixed-length --eval-every 25" for the demo model). PEERS_RUNS picks runs from "trl hybrid hybrid-resident hybrid-always hybrid-level1 gpu1 serve verl" (hybrid: the default
  # learner_offload when_short; hybrid-resident: the learner's state never offloaded; hybrid-always: offloaded at every switch; hybrid-level1: the engine keeps its weights asleep; default the
  # first three; PEERS_SERVE=1 adds serve: `vllm serve` vs our API, benchmarks/generation.py). A run gets at most
  # its cap (TRL_TIMEOUT 240, HYBRID_TIMEOUT 300: a cold machine takes 100-130 s to its app, GPU1_TIMEOUT 320, SERVE_TIMEOUT 400 s) and never more than is
  # left of PEERS_BUDGET (560 s since this script began). Expects TRL's parts (benchmarks/peers/wheels.sh) in
  # /tmp/peer-parts; installs them once into /tmp/site-peers, which only the TRL run puts on its path.
  # Run `verl` (not among the defaults): verl 0.9.1's GRPO recipe, FSDP + vLLM co-located (benchmarks/peers/verl_grpo.py,
  # VERL_MODE sync or colocate_async), cap VERL_TIMEOUT (300 s); its parts (benchmarks/peers/verl_wheels.sh) in
  # /tmp/verl-parts, installed once into /tmp/site-verl and transformers 5.10.2 into /tmp/site-verl-tf, both first
  # on the path of that run only.
  runs=${PEERS_RUNS:-trl hybrid gpu1}; [ "${PEERS_SERVE:-0}" = 1 ] && runs="$runs serve"
  if [[ " $runs " == *" verl "* ]] && [ ! -f /tmp/site-verl/.verl-done ]; then  # only verl's run needs them
    rm -rf /tmp/verl-wheels
    cat /tmp/verl-parts/part* | tar xf - -C /tmp || { echo "peers: no verl parts in /tmp/verl-parts"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-verl /tmp/verl-wheels/*.whl 2>&1 | grep -v WARNING | tail -3
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-verl-tf /tmp/verl-wheels/tf/*.whl 2>&1 | grep -v WARNING | tail -3
    touch /tmp/site-verl/.verl-done
  fi
  if [[ " $runs " == *" trl "* ]] && [ ! -f /tmp/site-peers/.peers-done ]; then  # only TRL's run needs them
    rm -rf /tmp/peer-wheels
    cat /tmp/peer-parts/part* | tar xf - -C /tmp || { echo "peers: no TRL parts in /tmp/peer-parts"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-peers /tmp/peer-wheels/*.whl 2>&1 | grep -v WARNING | tail -3
    touch /tmp/site-peers/.peers-done
  fi
  M=${PEERS_MODEL:-$MODEL}; tokens=${PEERS_TOKENS:-256}; eos_flags=""; pargs=${PEERS_ARGS:-}
  # PEERS_WORKLOAD: fixed (default: every completion exactly PEERS_TOKENS) or longtail: the random model ends its
  # completions itself, EOS raised in its weights (make_random_qwen2.py --eos-mean-tokens PEERS_EOS_MEAN, 1500,
  # calibrated under the cut PEERS_TOKENS, 8192; built beside the fixed one as $M-longtail<mean>), and every
  # side samples to EOS (--no-fixed-length)
  case ${PEERS_WORKLOAD:-fixed} in
  fixed) ;;
  longtail) M=$M-longtail${PEERS_EOS_MEAN:-1500}; tokens=${PEERS_TOKENS:-8192}; pargs="$pargs --no-fixed-length"
            eos_flags="--eos-mean-tokens ${PEERS_EOS_MEAN:-1500} --eos-max-new-tokens $tokens" ;;
  *) echo "peers: unknown PEERS_WORKLOAD '${PEERS_WORKLOAD}' (fixed longtail)"; exit 1 ;;
  esac
  if [ ! -f $M/config.json ]; then  # PEERS_SHAPE: make_random_qwen2.py's shape flags (default Qwen2-0.5B's)
    python3 benchmarks/make_random_qwen2.py --tokenizer-from artifacts/demo-model --out $M ${PEERS_SHAPE:-} $eos_flags > $OUT/make_model.log 2>&1
    echo "make model rc=$? t=$SECONDS s"; tail -1 $OUT/make_model.log | cut -c1-900
  fi
  # 1.5B and up on one H100 (2026-11-27): a whole batch of 64 as one micro-batch ran both TRL and asyncrl out of
  # memory beside their engines; both sides then take micro-batches of 16 (PEERS_ARGS naming one wins)
  if [[ "$pargs" != *--micro-batch-size* ]] && [ "$(python3 -c "import json; print(int(json.load(open('$M/config.json'))['hidden_size'] >= 1536))" 2>/dev/null)" = 1 ]; then
    pargs="$pargs --micro-batch-size 16"; echo "peers: micro-batches of 16 for $M"
  fi
  knobs=(--model $M --prompts-per-step ${PEERS_PROMPTS:-8} --group-size ${PEERS_GROUP:-8} --max-new-tokens $tokens
         --lr ${PEERS_LR:-1e-6} --warmup-steps ${PEERS_WARMUP:-3} --steps ${PEERS_STEPS:-8} --out $OUT/peers.json $pargs)
  # ASYNCRL_SETS: config overrides for every asyncrl run (--set KEY=VALUE words); the long-tail workload's default
  # packs each micro-batch's sequences into one row under a token budget instead of padding them to the longest
  asets=(); for kv in ${ASYNCRL_SETS:-$([ "${PEERS_WORKLOAD:-fixed}" = longtail ] && echo "learner.sequence_packing=true learner.max_tokens_per_micro_batch=8192")}; do
    asets+=(--set "$kv"); done
  for run in $runs; do
    case $run in trl) cap=${TRL_TIMEOUT:-240} ;; hybrid|hybrid-resident|hybrid-always|hybrid-level1) cap=${HYBRID_TIMEOUT:-300} ;;
                 gpu1|gpu1-separate|gpu1-r3|gpu1-fp8|gpu1-lora) cap=${GPU1_TIMEOUT:-320} ;; serve) cap=${SERVE_TIMEOUT:-400} ;; verl) cap=${VERL_TIMEOUT:-300} ;;
                 *) echo "peers: unknown run '$run' (trl hybrid hybrid-resident hybrid-always hybrid-level1 gpu1 gpu1-separate gpu1-r3 gpu1-fp8 gpu1-lora serve verl)"; continue ;; esac
    left=$(( ${PEERS_BUDGET:-560} - SECONDS )); [ $cap -lt $left ] && left=$cap
    if [ $left -lt 60 ]; then echo "peers $run: skipped, $left s left of PEERS_BUDGET"; continue; fi
    # ray.init's own start timed out here after TRL's run ("node timed out during startup"): clear what is
    # left, start the node apart (its errors printed) and connect to it, as the gpu4 stage does.
    if [ -n "${NO_CLEANUP:-}" ]; then
      export RAY_ADDRESS=${RAY_ADDRESS:-local}  # beside other jobs: a Ray of its own (own_ray), theirs left alone
    else
      ray stop --force > /dev/null 2>&1; pkill -9 -f "[r]aylet"; pkill -9 -f "[g]cs_server"; rm -rf /tmp/ray/session_*
      unset RAY_ADDRESS
      if [ $run != trl ] && [ $run != serve ] && [ $run != verl ]; then  # verl's main_ppo starts its own (ray.init)
        timeout 90 ray start --head --num-cpus 16 --include-dashboard=false --disable-usage-stats > $OUT/ray_start.log 2>&1 \
            && export RAY_ADDRESS=auto || { echo "ray start failed:"; tail -3 $OUT/ray_start.log | cut -c1-300; }
      fi
    fi
    echo "peers $run: starts at t=$SECONDS s, at most $left s"
    log=$OUT/peers_$run.log
    case $run in
    trl)
      # TRL_ARGS: trl_grpo.py's own flags (e.g. --gradient-checkpointing, TRL's default, for the long tail)
      PYTHONPATH=/tmp/site-peers:$PYTHONPATH timeout -k 15 $left python3 benchmarks/peers/trl_grpo.py ${TRL_ARGS:-} "${knobs[@]}" > $log 2>&1 ;;
    hybrid|hybrid-always|hybrid-resident|hybrid-level1)
      case $run in
      hybrid) extra=() ;;  # the default learner_offload when_short: state kept where the engines' wake fits beside it
      # the learner's flagged state to host at every switch (the default before 2026-11-27)
      hybrid-always) extra=(--tag "(learner_offload always)" --set hybrid.learner_offload=always) ;;
      # the learner's params, grads and optimizer state kept on the GPU
      hybrid-resident) extra=(--tag "(learner state resident)" --set learner.actor.param_offload=false
                              --set learner.actor.grad_offload=false --set learner.actor.optimizer_offload=false) ;;
      # the engine keeps its weights in host memory asleep (the default before 2026-12-02: level 2 drops them)
      hybrid-level1) extra=(--tag "(engine sleep level 1)" --set hybrid.engine_sleep_level=1) ;;
      esac
      timeout -s INT -k 30 $left python3 benchmarks/peers/asyncrl_side.py --placement hybrid --etas ${HYBRID_ETAS:-0} \
          --num-cpus 16 "${asets[@]}" "${extra[@]}" "${knobs[@]}" > $log 2>&1 ;;
    gpu1|gpu1-separate|gpu1-r3|gpu1-fp8|gpu1-lora)
      # gpu1-separate: the proximal log-probs from a pass of their own before each update (the default takes them
      # from the update's first forward), for the ratio of the two in one call; gpu1-r3 (a MoE PEERS_MODEL, e.g.
      # PEERS_SHAPE="--experts 16 ..."): the learner's routers replay the engine's routes (learner.routing_replay),
      # the row's mismatch beside gpu1's without it (issue 63)
      extra=(); [ $run = gpu1-separate ] && extra=(--tag "(separate proximal pass)" --set algorithm.proximal_logprobs=separate_pass)
      [ $run = gpu1-r3 ] && extra=(--tag "(routing replay)" --set learner.routing_replay=true)
      # gpu1-fp8: the engine quantizes its linears to FP8 (vLLM's online per-tensor FP8), each push re-quantized by
      # vLLM's layerwise reload; the row's mismatch is bf16 learner vs FP8 engine (issue 61)
      [ $run = gpu1-fp8 ] && extra=(--tag "(FP8 rollouts)" --set generator.engine_kwargs.quantization=fp8)
      # gpu1-lora: LoRA adapters (LORA_RANK, 64; alpha twice it) on every linear, the base frozen (issue 65)
      [ $run = gpu1-lora ] && extra=(--tag "(LoRA r${LORA_RANK:-64})" --set learner.lora.rank=${LORA_RANK:-64}
                                     --set learner.lora.alpha=$(( 2 * ${LORA_RANK:-64} )))
      timeout -s INT -k 30 $left python3 benchmarks/peers/asyncrl_side.py --placement separated --etas ${GPU1_ETAS:-0 2} \
          --num-cpus 16 "${asets[@]}" "${extra[@]}" "${knobs[@]}" > $log 2>&1 ;;
    verl)
      PYTHONPATH=/tmp/site-verl-tf:/tmp/site-verl:$PYTHONPATH timeout -s INT -k 30 $left python3 benchmarks/peers/verl_grpo.py \
          --mode ${VERL_MODE:-sync} ${VERL_ARGS:-} "${knobs[@]}" > $log 2>&1 ;;  # VERL_ARGS: e.g. --work-dir DIR (its metrics.jsonl)
    serve)
      timeout -s INT -k 30 $left python3 benchmarks/generation.py --model $M --dtype bfloat16 --num-gpus 1 --max-model-len 1024 \
          --num-prompts 512 --concurrency 64 --max-tokens ${PEERS_TOKENS:-256} --warmup 64 --sides vllm,asyncrl,vllm > $log 2>&1 ;;
    esac
    echo "peers $run rc=$? t=$SECONDS s"
    # asyncrl's own logs (the trainer's start phases, the learner ranks', the engine's) before the next run clears Ray
    case $run in hybrid*|gpu1*)
      L=/tmp/ray/session_latest/logs
      for f in $(grep -lE "asyncrl|Megatron|vllm" $L/worker-*.err $L/worker-*.out 2>/dev/null | head -30); do
        echo "== $f"; tail -300 $f | cut -c1-400; done > $L/serve/workers_tail.txt 2>/dev/null
      tar czf $OUT/serve_$run.tgz -C $L serve 2>/dev/null ;; esac
    grep -E '^\[(trl|asyncrl|verl)\]|^\| ' $log | cut -c1-300
    grep -iE "Traceback|Error|out of memory" $log | grep -v Warning | tail -8 | cut -c1-400
  done
  [ -s $OUT/peers.json ] && python3 benchmarks/peers/compare.py $OUT/peers.json --md $OUT/peers.md --png $OUT/peers.png
  nvidia-smi --query-gpu=memory.used --format=csv,noheader
  ;;
sglang-install)
  # Issue 23: SGLang's wheels (benchmarks/sglang/wheels.sh; the parts in /tmp/sgl-parts) installed into
  # /tmp/site-sglang: pip's resolver, run against the image and /tmp/site (PYTHONPATH), picks from the carried
  # wheels only what is missing or pinned otherwise (a dry run's report), then those are installed without
  # deps. Then SGLang's own engine starts once on the random Qwen2-0.5B and decodes 16 greedy tokens: the
  # install's check. SGLang's processes run with PYTHONPATH=/tmp/site-sglang:/tmp/site:$PWD.
  if [ ! -f /tmp/site-sglang/.done ]; then
    rm -rf /tmp/sgl-wheels; cat /tmp/sgl-parts/part* | tar xf - -C /tmp || { echo "sglang: no parts in /tmp/sgl-parts"; exit 1; }
    timeout 300 python3 -m pip install --dry-run -q --no-index --find-links /tmp/sgl-wheels --report /tmp/sgl-report.json \
        sglang==0.5.15 > $OUT/sgl_resolve.log 2>&1
    if [ $? -eq 0 ]; then
      python3 -c "import json; print('\n'.join(i['download_info']['url'].removeprefix('file://') for i in json.load(open('/tmp/sgl-report.json'))['install']))" > /tmp/sgl-install.txt
    else  # e.g. a dependency of a wheelhouse package (flashinfer's cuda-tile, cudnn-frontend) that vLLM never needed:
      # every carried wheel then goes in (requirements-gpu.txt holds only what the image and /tmp/site lack or pin
      # otherwise), and the engine's start below says whether SGLang runs
      echo "sglang: pip could not resolve sglang==0.5.15 against the image; installing every carried wheel:"
      grep -v WARNING $OUT/sgl_resolve.log | tail -6 | cut -c1-400
      ls /tmp/sgl-wheels/*.whl > /tmp/sgl-install.txt
    fi
    echo "sglang: $(wc -l < /tmp/sgl-install.txt) wheels to install:"; xargs -n1 basename < /tmp/sgl-install.txt | tr '\n' ' '; echo
    timeout 300 python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-sglang $(cat /tmp/sgl-install.txt) \
        > $OUT/sgl_install.log 2>&1 && touch /tmp/site-sglang/.done \
        || { echo "sglang: install failed:"; grep -v WARNING $OUT/sgl_install.log | tail -5 | cut -c1-400; exit 1; }
  fi
  [ -f $MODEL/config.json ] || python3 benchmarks/make_random_qwen2.py --tokenizer-from artifacts/demo-model --out $MODEL > $OUT/make_model.log 2>&1
  # SGL_SMOKE=0: no smoke run (benchmarks/sglang/probe.py, run next, starts the engine itself)
  [ "${SGL_SMOKE:-1}" = 0 ] && exit 0
  PYTHONPATH=/tmp/site-sglang:/tmp/site:$PWD timeout ${SGL_TIMEOUT:-300} python3 - $MODEL > $OUT/sgl_smoke.log 2>&1 <<'PY'
import json
import os
import sys
import time

import sglang

print("sglang", sglang.__version__, flush=True)
t = time.time()
# the backends a slim wheel set has (benchmarks/sglang/slim_wheels.py); the full set takes '{}'
kwargs = json.loads(os.environ.get("SGL_ENGINE_KWARGS") or '{"attention_backend": "triton", "sampling_backend": "pytorch"}')
engine = sglang.Engine(model_path=sys.argv[1], mem_fraction_static=0.3, log_level="error", **kwargs)
print(f"engine up in {time.time() - t:.1f} s", flush=True)
out = engine.generate(input_ids=[[5, 17, 9, 33, 2]], sampling_params={"temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
print("generated", out, flush=True)
engine.shutdown()
PY
  echo "sglang smoke rc=$?"; tail -12 $OUT/sgl_smoke.log | cut -c1-400
  ;;
install)
  # The last wheel part's call: the install above, TRL's parts (.peer-parts/p0, carried) unpacked for the peers
  # stage, and the random 7B built in the background (setsid: it outlives this call, for the scale stage; on the CPUs, the GPUs being busy with quad).
  mkdir -p /tmp/peer-parts && cp .peer-parts/p0/* /tmp/peer-parts/ 2>/dev/null
  M=/tmp/qwen2-7b-random
  # NO_7B=1: no 7B (a lease without the scale stage: its build would take the CPUs from the jobs beside it)
  if [ -z "${NO_7B:-}" ] && [ ! -f $M/config.json ] && [ ! -d $M.tmp ]; then
    CUDA_VISIBLE_DEVICES= setsid bash -c "python3 benchmarks/make_random_qwen2.py --tokenizer-from artifacts/demo-model --out $M.tmp --layers 28 \
        --hidden 3584 --heads 28 --kv-heads 4 --ffn 18944 --untied > /tmp/make_7b.log 2>&1 && mv $M.tmp $M" < /dev/null > /dev/null 2>&1 &
  fi
  python3 -c "import vllm, megatron.core, ray; print('vllm', vllm.__version__, 'mcore', megatron.core.__version__, 'ray', ray.__version__)"
  ;;
balanced)
  # Issue 28, two GPUs (CUDA_VISIBLE_DEVICES): eta = 0, 2, 1 with the same samples, where one step's generation and
  # training take about the same time (deploy/rlhf-gpu2-long.yaml, responses of exactly BALANCED_TOKENS tokens).
  # Default: a random Qwen2-1.5B, 512-token responses, BATCH 384 samples, chosen from these measurements
  # (docs/BENCHMARKS.md, issue 28's sections of 2026-11-26 and -27). The decode is bound by the engine's per-step
  # host work, which grows with the sequences in flight and hardly with the model: 4.6-4.9 ms a token for 64
  # sequences at 0.5B and 1.5B alike, ~13 ms for 256 and ~18 ms for 384 (0.5B). So generation per step grows as the
  # batch's ~0.75th power whatever the model, while training grows about linearly (1.1th power) and with the
  # model. The 0.5B never balances (generation / training 2.19 at 64, 1.38 at 256, 1.57 at 384); the 1.5B at 64 x
  # 1,024 tokens was 5.0 s of generation against 2.9 s of training, so about 384 samples of 512 tokens should
  # balance (estimated, not yet measured). BATCH=auto: a short eta = 0 run at BATCH0 (256) samples measures both,
  # and the batch is scaled by those exponents toward generation = 0.95 x training (at eta = 2 the engine
  # generated ~11 % slower, the learner beside it). Read the steady speedup column: a short run's wall time at
  # eta > 0 includes batches generated during its warm-up steps (async_speedup.py: steady_state).
  # BALANCED_MODEL / BALANCED_SHAPE (make_random_qwen2.py's flags) for another random model.
  export RAY_ADDRESS=${RAY_ADDRESS:-local}  # or a node started apart (RAY_ADDRESS=auto)
  M=${BALANCED_MODEL:-/tmp/qwen2-1.5b-long}  # its own copy: the peers job beside it builds $MODEL at the same time
  shape=${BALANCED_SHAPE-"--layers 28 --hidden 1536 --heads 12 --kv-heads 2 --ffn 8960"}
  [ -f $M/config.json ] || python3 benchmarks/make_random_qwen2.py --tokenizer-from artifacts/demo-model --out $M $shape > $OUT/make_model.log 2>&1
  B0=${BATCH0:-256}
  sets=(--set model.path=$M --set algorithm.max_new_tokens=${BALANCED_TOKENS:-512})
  BATCH=${BATCH:-384}
  if [ "$BATCH" = auto ]; then
    timeout -s INT -k 20 ${CALIB_TIMEOUT:-240} python3 benchmarks/async_speedup.py --config deploy/rlhf-gpu2-long.yaml --steps 3 \
        --etas 0 --num-cpus 16 "${sets[@]}" --set buffer.batch_size=$B0 --set trainer.rollout_concurrency=$((B0 / 8)) \
        --out $OUT/calib.json > $OUT/calib.log 2>&1
    echo "calibration rc=$?"
    BATCH=$(python3 benchmarks/async_speedup.py --balanced-batch $OUT/calib.json $B0)
  fi
  echo "batch $BATCH"
  # WARMUP (3) steps left out of each run: an eta > 0 engine runs ahead during the first, and those batches
  # should be drained before the timed window (the steady column says what remains)
  timeout -s INT -k 20 ${RUN_TIMEOUT:-400} python3 benchmarks/async_speedup.py --config deploy/rlhf-gpu2-long.yaml \
      --steps ${NSTEPS:-9} --warmup-steps ${WARMUP:-3} --etas ${ETAS:-0 2 1} --num-cpus 16 "${sets[@]}" --set buffer.batch_size=$BATCH \
      --set trainer.rollout_concurrency=$((BATCH / 8)) --out $OUT/balanced.json > $OUT/balanced.log 2>&1
  echo "balanced rc=$?"; grep -v '^{' $OUT/balanced.log | grep -E '^\||machine|failed|push / raw' | cut -c1-400
  grep -iE "Traceback|Error|out of memory" $OUT/balanced.log | grep -v Warning | tail -6 | cut -c1-300
  ;;
scale)
  # Issue 30 on four GPUs: the random Qwen2-7B trained with deploy/rlhf-gpu4-scale.yaml (learner TP = 2, engine
  # replicas of TP = 1), Serve's autoscaler adding the second engine replica mid-run; ETAS (2), NSTEPS (10). On
  # GPUs under 100 GB: micro-batches of 2,048 tokens and SCALE_STAGING (below; the learner's 64 GiB need room). On four
  # H100s (2026-11-27) the app took 100 s to start, the first push came 184 s after it (the first step's
  # generation and training), then ~18.5 s a step: 14 steps did not fit a call; 10 do. Upscale delays measured
  # there: 60 s asked for the second replica at 96 s (before the first push: it then takes the push plan from the
  # WeightStore, engine.sync_from_source), 150 s at 353 s (too late for 10 steps); the yaml's 100 s aims between.
  M=/tmp/qwen2-7b-random
  for i in $(seq 1 60); do pgrep -f "[m]ake_random_qwen2.py.*$M.tmp" > /dev/null || break; sleep 5; done  # the install call's build
  if [ ! -f $M/config.json ]; then
    timeout 400 python3 benchmarks/make_random_qwen2.py --tokenizer-from artifacts/demo-model --out $M --layers 28 \
        --hidden 3584 --heads 28 --kv-heads 4 --ffn 18944 --untied > $OUT/make_7b.log 2>&1
    echo "make 7b rc=$? t=$SECONDS s"; tail -1 $OUT/make_7b.log | cut -c1-300
  fi
  echo "7b model ready at t=$SECONDS s"
  sets=(--set model.path=$M)
  mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  # Under 100 GB a learner rank cannot also hold the whole packed version (7.1 GiB): the rank's sender packs through
  # a ring of slots (stream.SenderRing, chosen when the whole arena does not fit), and each engine's staged version
  # (15.2 GB) gets room beside vLLM (gpu_memory_utilization 0.7).
  if [ "${mem:-0}" -lt 100000 ]; then
    sets+=(--set learner.max_tokens_per_micro_batch=2048 --set generator.engine_kwargs.gpu_memory_utilization=0.7)
  fi
  for kv in ${SETS:-}; do sets+=(--set "$kv"); done
  echo "sets: ${sets[*]}"
  pkill -9 -f "[r]ay::"; pkill -9 -f "[r]aylet"; pkill -9 -f "[g]cs_server"; rm -rf /tmp/ray/session_*; sleep 1
  timeout 180 ray start --head --num-cpus 48 --include-dashboard=false --disable-usage-stats > $OUT/ray_start.log 2>&1
  echo "ray start rc=$?"
  # The app's own limit comes 45 s before the call's, so a run cut short still reports the steps it finished
  RAY_ADDRESS=auto timeout -s INT -k 30 ${RUN_TIMEOUT:-470} python3 benchmarks/async_speedup.py --timeout-s $((${RUN_TIMEOUT:-470} - 45)) \
      --config deploy/rlhf-gpu4-scale.yaml --steps ${NSTEPS:-10} --etas ${ETAS:-2} --num-cpus 48 "${sets[@]}" \
      --out $OUT/scale.json > $OUT/scale.log 2>&1
  echo "scale rc=$? t=$SECONDS s"; grep -v '^{' $OUT/scale.log | grep -E '^\||machine|joined|failed|push / raw' | cut -c1-400
  grep -iE "Traceback|Error|out of memory" $OUT/scale.log | grep -v Warning | tail -10 | cut -c1-400
  ls /tmp/ray/session_latest/logs > /dev/null 2>&1 && tar czf $OUT/ray_logs.tgz -C /tmp/ray/session_latest logs 2>/dev/null
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader
  ;;
gpu8)
  # Issue 30's full layout on an 8-GPU host (deploy/rlhf-gpu8.yaml): the random Qwen2-7B, learner TP = 2 x PP = 2 on
  # four GPUs, engine replicas of TP = 2 autoscaled from 1 to 2 on the other four, the second one after the first
  # push; ETAS (2; run "0" in a call of its own for the speedup), NSTEPS (12). The model is built as the scale stage
  # builds it (or by the install stage in the background).
  M=/tmp/qwen2-7b-random
  for i in $(seq 1 60); do pgrep -f "[m]ake_random_qwen2.py.*$M.tmp" > /dev/null || break; sleep 5; done
  if [ ! -f $M/config.json ]; then
    timeout 400 python3 benchmarks/make_random_qwen2.py --tokenizer-from artifacts/demo-model --out $M --layers 28 \
        --hidden 3584 --heads 28 --kv-heads 4 --ffn 18944 --untied > $OUT/make_7b.log 2>&1
    echo "make 7b rc=$? t=$SECONDS s"
  fi
  sets=(--set model.path=$M); for kv in ${SETS:-}; do sets+=(--set "$kv"); done
  pkill -9 -f "[r]ay::"; pkill -9 -f "[r]aylet"; pkill -9 -f "[g]cs_server"; rm -rf /tmp/ray/session_*; sleep 1
  timeout 180 ray start --head --num-cpus 64 --include-dashboard=false --disable-usage-stats > $OUT/ray_start.log 2>&1
  echo "ray start rc=$?"
  RAY_ADDRESS=auto timeout -s INT -k 30 ${RUN_TIMEOUT:-480} python3 benchmarks/async_speedup.py --timeout-s $((${RUN_TIMEOUT:-480} - 45)) \
      --config deploy/rlhf-gpu8.yaml --steps ${NSTEPS:-12} --etas ${ETAS:-2} --num-cpus 64 "${sets[@]}" \
      --out $OUT/gpu8.json > $OUT/gpu8.log 2>&1
  echo "gpu8 rc=$? t=$SECONDS s"; grep -v '^{' $OUT/gpu8.log | grep -E '^\||machine|joined|failed|push / raw' | cut -c1-400
  grep -iE "Traceback|Error|out of memory" $OUT/gpu8.log | grep -v Warning | tail -10 | cut -c1-400
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader
  ;;
sglang-tests)
  # Issue 23, after sglang-install: the SGLang replica's GPU tests (tests/generator/test_sglang_gpu.py: the OpenAI
  # client, a push's greedy tokens against transformers', a request across a commit, a corrupted bucket, sleep ->
  # push -> wake), then the demo on one GPU with SGLang (deploy/rlhf-gpu1-sglang.yaml, or DEMO_CONFIG: the hybrid
  # one), STEPS_DEMO (300) steps, eta 2. The engine replicas get SGLang's packages first (engine_pythonpath).
  export RAY_ADDRESS=${RAY_ADDRESS:-local} ASYNCRL_SGLANG_PATH=/tmp/site-sglang
  if [ "${SGL_TESTS:-1}" = 1 ]; then
    timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider -m gpu tests/generator/test_sglang_gpu.py \
        > $OUT/sglang_gpu_test.log 2>&1
    echo "sglang pytest rc=$?"; grep -E "passed|failed|Error|assert" $OUT/sglang_gpu_test.log | head -16 | cut -c1-600
  fi
  if [ "${SGL_DEMO:-1}" = 1 ]; then
    # EVAL_EVERY (50): held-out accuracy every that many steps (0: step 0's only, as the twenty-sixth session ran it)
    timeout -s INT -k 20 ${RUN_TIMEOUT:-400} python3 benchmarks/async_speedup.py --config ${DEMO_CONFIG:-deploy/rlhf-gpu1-sglang.yaml} \
        --steps ${STEPS_DEMO:-300} --etas 2 --num-cpus 16 --eval-every ${EVAL_EVERY:-50} --out $OUT/demo_sglang.json > $OUT/demo_sglang.log 2>&1
    echo "demo with SGLang rc=$?"; grep -v '^{' $OUT/demo_sglang.log | grep -E '^\||failed|held-out' | cut -c1-400
    grep -iE "Traceback|Error" $OUT/demo_sglang.log | grep -v Warning | tail -6 | cut -c1-300
  fi
  ;;
gen)
  # Issue 23: benchmarks/generation.py on one GPU for GEN_ENGINE (vllm | sglang): the engine's own server, our
  # HTTP API on the same engine, and the engine driven in-process (direct), same model (the random Qwen2-0.5B),
  # GEN_PROMPTS (512) prompts of GEN_TOKENS (256) tokens each at concurrency 64, plain and with log-probs. Two
  # such jobs on two GPUs of one host give the two engines' rows side by side.
  export RAY_ADDRESS=${RAY_ADDRESS:-local}
  [ -f $MODEL/config.json ] || python3 benchmarks/make_random_qwen2.py --tokenizer-from artifacts/demo-model --out $MODEL > $OUT/make_model.log 2>&1
  e=${GEN_ENGINE:-vllm}
  if [ $e = sglang ]; then
    extra=(--engine sglang --engine-pythonpath /tmp/site-sglang:/tmp/site:$PWD
           --engine-kwargs "${SGL_ENGINE_KWARGS:-{\"attention_backend\": \"triton\", \"sampling_backend\": \"pytorch\"\}}")
  else extra=(); fi
  timeout -s INT -k 30 ${GEN_TIMEOUT:-480} python3 benchmarks/generation.py --model $MODEL --dtype bfloat16 --num-gpus 1 \
      --max-model-len 1024 --num-prompts ${GEN_PROMPTS:-512} --concurrency 64 --max-tokens ${GEN_TOKENS:-256} --warmup 64 \
      --port $(( ${RAY_PORT_BASE:-20000} + 1500 )) \
      --phases plain,logprobs --sides ${GEN_SIDES:-$e,asyncrl,direct} --log-dir $OUT/serve_logs "${extra[@]}" > $OUT/gen_$e.log 2>&1
  echo "generation $e rc=$?"; grep -E '^\| |^\{' $OUT/gen_$e.log | cut -c1-600
  grep -iE "Traceback|Error|out of memory" $OUT/gen_$e.log | grep -v Warning | tail -8 | cut -c1-400
  ;;
demo-nccl)
  # Issue 28: the demo as deploy/rlhf-gpu2.yaml runs it (weights over NCCL every step), STEPS_DEMO (300) steps, eta 2;
  # the row counts failed pushes (push_failed) and keeps every step's push.
  export RAY_ADDRESS=${RAY_ADDRESS:-local}
  timeout -s INT -k 20 ${RUN_TIMEOUT:-330} python3 benchmarks/async_speedup.py --config deploy/rlhf-gpu2.yaml \
      --steps ${STEPS_DEMO:-300} --etas 2 --num-cpus 16 --out $OUT/demo_nccl.json > $OUT/demo_nccl.log 2>&1
  echo "demo over NCCL rc=$?"; grep -v '^{' $OUT/demo_nccl.log | grep -E '^\||failed' | cut -c1-400
  grep -iE "Traceback|Error" $OUT/demo_nccl.log | grep -v Warning | tail -6 | cut -c1-300
  ;;
quad|duo)
  # Jobs side by side on a 4-GPU host, each on its own GPUs and its own Ray head (own_ray), started 20 s apart,
  # their files tarred into $OUT/$1.tgz (the device brings back 8 files):
  #   quad: GPUs 0,1 balanced (issue 28) | GPU 2 peers (issue 32) | GPU 3 the ipc push (issue 22)
  #   duo:  GPUs 0,1 the NCCL push (issues 22, 28) | GPUs 2,3 the demo over NCCL (issue 28)
  mode=$1
  # JOBS overrides the set: "GPUS:STAGE ..." (e.g. JOBS="0,1:balanced 2,3:demo-nccl")
  if [ -n "${JOBS:-}" ]; then jobs_=(); for j in $JOBS; do jobs_+=("${j%%:*} ${j#*:}"); done
  elif [ $mode = quad ]; then jobs_=("0,1 balanced" "2 peers" "3 push"); else jobs_=("0,1 push" "2,3 demo-nccl"); fi
  mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  if [ "${mem:-0}" -gt 100000 ] && [ -z "${PEERS_MODEL:-}" ]; then  # H200: TRL's 0.5B row exists (docs); the 1.5B shape is new
    export PEERS_MODEL=/tmp/qwen2-1.5b-random PEERS_SHAPE="--layers 28 --hidden 1536 --heads 12 --kv-heads 2 --ffn 8960"
  fi
  base=20000
  for j in "${jobs_[@]}"; do
    set -- $j
    base=$((base + 2000))
    ( export CUDA_VISIBLE_DEVICES=$1 NO_CLEANUP=1 RAY_PORT_BASE=$base OUT=$OUT/$2
      if [ -n "${PUSH_TRANSPORT:-}" ]; then export TRANSPORT=$PUSH_TRANSPORT STEPS="${PUSH_STEPS:-bench:random500m}"
      elif [ $mode = quad ]; then export TRANSPORT=ipc STEPS="${PUSH_STEPS:-bench:random500m bench:random1500m bench:random500m:off}"
      else export TRANSPORT=nccl STEPS="${PUSH_STEPS:-bench:random500m bench:random1500m}"; fi
      # each job ends by its own timeouts inside the call's 600 s: balanced ~20 + 200 + 340 (an app's start took
      # 64-80 s on the H200 host: vLLM compiles and captures its graphs), peers 480 from t = 20, push 3 x 160 from t = 40
      export BENCH_TIMEOUT=${BENCH_TIMEOUT:-160} CALIB_TIMEOUT=${CALIB_TIMEOUT:-200} RUN_TIMEOUT=${RUN_TIMEOUT:-340}
      export PEERS_RUNS="${PEERS_RUNS:-trl gpu1}" GPU1_ETAS="${GPU1_ETAS:-0 1 2}" PEERS_BUDGET=${PEERS_BUDGET:-480} TRL_TIMEOUT=${TRL_TIMEOUT:-190}
      mkdir -p $OUT; bash benchmarks/gpu_session.sh $2 > $OUT/stdout.txt 2>&1 ) &
    sleep 20
  done
  # Wait until JOBS_CAP (560) s into this stage at most, then pack what the jobs wrote so far: a call's own
  # timeout firing first would lose every job's files (the device brings back 8 files, so they are tarred).
  cap=${JOBS_CAP:-560}
  while [ -n "$(jobs -r)" ] && [ $SECONDS -lt $cap ]; do sleep 2; done
  [ -n "$(jobs -r)" ] && echo "jobs still running at $SECONDS s (JOBS_CAP $cap): their files are taken as they are"
  for d in $OUT/*/; do echo "== $(basename $d)"; cut -c1-400 $d/stdout.txt; done
  ( cd $OUT && tar czf jobs.tgz */ && rm -rf */ )
  ;;
esac
[ -n "${NO_CLEANUP:-}" ] && exit 0
pkill -9 -f "VLLM::" 2>/dev/null; ray stop --force > /dev/null 2>&1; true
