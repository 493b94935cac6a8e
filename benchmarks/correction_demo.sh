#!/usr/bin/env bash
# Issue 63: the CPU demo trained once per rollout-correction mode (algorithm.correction), the knobs of the
# 2026-11-26 demo race (deploy/rlhf.yaml's warm start, 64 prompts x 4 completions of up to 8 tokens, lr 1e-4, fp32,
# eta 2), held-out accuracy every 25 steps and the mismatch metrics of every step in each row.
#   bash benchmarks/correction_demo.sh OUT.jsonl [STEPS]        (MODES="tis seq ..." for a subset)
# Modes: default (decoupled PPO's token mask, cap 5), tis (token truncate), seq (sequence-level mask), geo (geometric
# mean), icepop (token band [0.5, 2]), reject (a sequence out of that band leaves whole), eta0 (default mode, eta 0:
# the mismatch floor with no version gap).
set -uo pipefail
out=${1:?usage: correction_demo.sh OUT.jsonl [STEPS]}; steps=${2:-100}
for mode in ${MODES:-default tis seq geo icepop reject eta0}; do
  etas=2; sets=()
  case $mode in
  default) ;;
  tis) sets=(--set algorithm.correction.mode=truncate) ;;
  seq) sets=(--set algorithm.correction.level=sequence) ;;
  geo) sets=(--set algorithm.correction.level=geometric) ;;
  icepop) sets=(--set algorithm.correction.lower=0.5 --set algorithm.behavior_weight_cap=2) ;;
  reject) sets=(--set algorithm.correction.lower=0.5 --set algorithm.behavior_weight_cap=2 --set algorithm.correction.reject_sequence=true) ;;
  eta0) etas=0 ;;
  *) echo "correction_demo: unknown mode $mode"; exit 1 ;;
  esac
  echo "== $mode (eta $etas) $(date +%T)"
  timeout 900 python benchmarks/peers/asyncrl_side.py --config deploy/rlhf.yaml --placement separated --etas $etas \
      --model artifacts/demo-model --prompts-per-step 64 --group-size 4 --max-new-tokens 8 --no-fixed-length --lr 1e-4 \
      --warmup-steps 1 --steps $steps --eval-every 25 --num-cpus 2 --set model.dtype=float32 \
      --set generator.engine_kwargs.max_num_seqs=256 --tag "(correction: $mode)" "${sets[@]}" --out $out 2>&1 \
      | grep -E '^\[asyncrl\] (eta|.*buffer)|Traceback|Error' | tail -4
done
python - "$out" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    ev = " -> ".join(f"{e['accuracy']:.3f}@{e['wall_s']:.0f}s" for e in r.get("eval", []))
    m = r["settings"].get("mismatch", {})
    kl = ", ".join(f"{g} k3 {m[g + '/k3']:.2e} ({m.get(g + '/tokens', 0):.0f} tok)" for g in ("gap0", "gap1", "gap2+") if g + "/k3" in m)
    print(f"{r['placement']} eta={r['eta']}: median {r.get('s_per_step_median', 0):.3f} s/step; accuracy {ev}; "
          f"mismatch k3 {m.get('k3', float('nan')):.2e}, |d| max {m.get('abs_diff_max', float('nan')):.2e}; {kl}")
PY
