#!/usr/bin/env bash
# The whole loop on GPUs as a smoke run: serve run $CONFIG (default deploy/rlhf-gpu1.yaml: engine
# replica and learner rank share ONE device; deploy/rlhf-gpu2.yaml: one GPU each, weights over
# NCCL), poll /train/status until step $STEPS (default 300; or ~7 minutes), hit the HTTP API, copy the run's
# jsonl files, the Serve log and nvidia-smi to $OUT.
# Needs the GPU wheels installed in /tmp/site (benchmarks/run_gpu.sh does that) and the demo model.
OUT=${OUT:-/tmp/loop-out}
CONFIG=${CONFIG:-deploy/rlhf-gpu1.yaml}
RUN=$(python3 -c "import yaml,sys;print(yaml.safe_load(open('$CONFIG'))['applications'][0]['args']['logging']['dir'])")
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
rm -rf $RUN
t0=$SECONDS
timeout ${SERVE_TIMEOUT:-470} serve run $CONFIG > $OUT/serve.log 2>&1 &
for i in $(seq 1 $(( (${SERVE_TIMEOUT:-470} - 20) / 5 ))); do
  sleep 5
  if curl -sf localhost:8000/train/status > $OUT/status.json 2>/dev/null; then
    step=$(python3 -c "import json;print(json.load(open('$OUT/status.json')).get('step',0))" 2>/dev/null)
    echo "t=$((SECONDS-t0)) step=$step"
    [ "${step:-0}" -ge ${STEPS:-300} ] && break
  fi
done
curl -s localhost:8000/generate -d '{"prompt": "What is 12 + 34?", "max_tokens": 8, "temperature": 0}' > $OUT/generate.json
curl -si localhost:8000/v1/completions -H 'content-type: application/json' -d '{"model": "asyncrl-policy", "prompt": "1+1=", "max_tokens": 4}' > $OUT/completions.txt
curl -s localhost:8000/metrics > $OUT/metrics.txt
nvidia-smi > $OUT/nvidia-smi.txt
cp $RUN/*.jsonl $OUT/ 2>/dev/null; ls $RUN
pkill -INT -f "serve run" ; sleep 8; ray stop --force > /dev/null 2>&1
grep -E "Error|error" $OUT/serve.log | head -5
