#!/usr/bin/env bash
# A stage of benchmarks/gpu_session.sh that needs more than one device call (10 minutes at most): e.g. verl's step on
# the long-tail workload, which trains every sample padded to 8,320 positions.
#
#   bash benchmarks/gpu_bg.sh start STAGE      # in one call: the stage runs on in a process session of its own
#   bash benchmarks/gpu_bg.sh wait SECONDS     # in that call and the next ones: wait up to SECONDS for it to end
#
# The device machine keeps a process that started a session of its own (setsid) while calls follow each other
# within its idle release (30 s); it ends with the machine. The stage's output goes to /tmp/bg-out (its own $OUT);
# `wait` copies what is there to this call's $OUT (the session log, the rows, ab_session.sh's ab.jsonl, the runs' logs,
# verl's metrics) and prints the session log's end, whether the stage has ended or not. The stage's environment is this call's (set
# PEERS_RUNS, VERL_TIMEOUT, PEERS_BUDGET ... on `start`).
set -uo pipefail
BG=/tmp/bg-out
case ${1:-} in
start)
  stage=${2:?usage: gpu_bg.sh start STAGE}
  rm -rf $BG && mkdir -p $BG
  OUT=$BG setsid nohup bash ${GPU_SESSION:-benchmarks/gpu_session.sh} "$stage" > $BG/session.log 2>&1 < /dev/null &
  echo $! > /tmp/bg.pid
  echo "bg: $stage started at $(date +%T), pid $(cat /tmp/bg.pid)" ;;
wait)
  limit=${2:?usage: gpu_bg.sh wait SECONDS}
  [ -f /tmp/bg.pid ] || { echo "bg: nothing started on this machine"; exit 1; }
  pid=$(cat /tmp/bg.pid); end=$((SECONDS + limit)); last=""
  while kill -0 "$pid" 2> /dev/null && [ $SECONDS -lt $end ]; do
    now=$(grep -hE '^\[(verl|trl|asyncrl)\] step|^peers .*(starts|rc=)' $BG/session.log $BG/peers_*.log 2> /dev/null | tail -1)
    [ "$now" != "$last" ] && { echo "bg t=$SECONDS: ${now:0:200}"; last=$now; }
    sleep 5
  done
  if kill -0 "$pid" 2> /dev/null; then echo "bg: still running after $limit s"; else echo "bg: ended"; touch $BG/.ended; fi
  mkdir -p "$OUT" && cp $BG/session.log $BG/peers*.json $BG/peers_*.log $BG/make_model.log $BG/ab.jsonl "$OUT"/ 2> /dev/null
  [ -f /tmp/verl-work/metrics.jsonl ] && cp /tmp/verl-work/metrics.jsonl "$OUT"/verl_metrics.jsonl
  tail -25 $BG/session.log | cut -c1-300
  [ -f $BG/.ended ] ;;  # the exit status: 0 once the stage has ended
*) echo "usage: gpu_bg.sh start STAGE | wait SECONDS"; exit 2 ;;
esac
