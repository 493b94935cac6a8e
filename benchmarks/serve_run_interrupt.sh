#!/usr/bin/env bash
# Bare `serve run deploy/rlhf.yaml` (Ray's CLI, not `asyncrl serve`), interrupted once training runs:
#   bash benchmarks/serve_run_interrupt.sh [INT|TERM]      (default INT, as Ctrl-C in a terminal sends)
# Prints the exit code, the seconds from the signal to the exit, how many of our processes (vLLM
# engine cores / workers, Ray workers, raylet, GCS) are left 5 s later, the tracebacks in the log and
# the drain's log lines. SIGINT is reset to its default first: a shell's background job ignores it.
set -uo pipefail
sig=${1:-INT}
cd "$(dirname "$0")/.."
export PATH=$PWD/.venv/bin:$PATH
log=${LOG:-/tmp/serve_run_interrupt.log}
python3 -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp("serve", ["serve", "run", "deploy/rlhf.yaml"])' > "$log" 2>&1 &
pid=$!
state=""
for _ in $(seq 1 400); do
  state=$(curl -s -m 5 localhost:8000/train/status 2>/dev/null | python3 -c "import sys, json; d = json.load(sys.stdin); print(d['state'], d['step'])" 2>/dev/null)
  case "$state" in training\ [1-9]*) break ;; esac
  sleep 2
done
echo "status before the signal: $state"
t0=$(date +%s.%N)
kill -"$sig" "$pid"
for _ in $(seq 1 240); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
wait "$pid"; rc=$?
t1=$(date +%s.%N)
echo "rc=$rc seconds=$(python3 -c "print(round($t1 - $t0, 1))")"
sleep 5
echo "left: $(ps -eo args | grep -E 'VLLM::|ray::|raylet|gcs_server' | grep -vc grep)"
echo "tracebacks: $(grep -c Traceback "$log")"
grep -E "stopping: the step|stopped at policy version|KeyboardInterrupt" "$log" | cut -c1-300
