#!/usr/bin/env bash
# One stage of benchmarks/gpu_session.sh on two trees in one lease, run by run: another commit's tree (AB_BEFORE, e.g.
# `git archive <commit> asyncrl benchmarks deploy pyproject.toml` into an ignored folder, carried) and this one, so
# that a change's step-level effect is a ratio measured on one machine. For each run of AB_RUNS (default "gpu1
# hybrid", the peers stage's PEERS_RUNS) the before tree's, then this tree's; the stage's other settings come from the
# environment (PEERS_MODEL, PEERS_SHAPE, GPU1_ETAS, ...). Rows: $OUT/before/peers.json and $OUT/after/peers.json;
# each side's log $OUT/ab_<side>.log. Long: start it with `GPU_SESSION=benchmarks/ab_session.sh bash
# benchmarks/gpu_bg.sh start peers` and follow with `gpu_bg.sh wait`.
set -uo pipefail
root=$PWD
# Each run's row, as soon as it is written (the next run's overwrites it), into $OUT/ab.jsonl (`ab_side` added) and
# a line on stdout: a device call brings back only a few files (and a lost machine none), so the figures also stand
# in the call's output tail.
keep_row() {
python3 - "$OUT" "$1" <<'PY'
import json
import pathlib
import sys

out, side = pathlib.Path(sys.argv[1]), sys.argv[2]
path = out / side / "peers.json"
rows = json.loads(path.read_text()) if path.is_file() else []
with open(out / "ab.jsonl", "a") as f:
    for row in rows if isinstance(rows, list) else [rows]:
        row["ab_side"] = side
        f.write(json.dumps(row) + "\n")
        s, st = row.get("split_s", {}), row.get("settings", {})
        print(f"ab row: {side} {row.get('placement')} eta={row.get('eta')} mean {row.get('s_per_step_mean', 0):.3f} "
              f"median {row.get('s_per_step_median', 0):.3f} train {s.get('training', 0):.3f} sync {s.get('weight_sync', 0):.3f} "
              f"push {st.get('push_s') or 0:.3f} wake {st.get('engine_wake_s_mean') or 0:.3f} "
              f"(release {st.get('learner_release_s_mean') or 0:.3f} weights {st.get('weights_wake_s_mean') or 0:.3f} "
              f"params {st.get('params_release_s_mean') or 0:.3f} kv {st.get('kv_wake_s_mean') or 0:.3f}; "
              f"released {st.get('learner_released_gib_mean') or 0:.1f} GiB) "
              f"tok/s {row.get('tokens_per_s', 0):,.0f}")
PY
}
# (a copy outside this tree: run from a hidden folder inside it, the hybrid run's learner rank could not import
# asyncrl.weightsync, 43rd session; from /tmp both placements ran)
# AB_BEFORE may name several trees (a bisection in one lease): each is a side named after its folder ("before" when
# there is one), run in the order given, then this tree ("after") unless AB_AFTER=0.
sides=(); declare -A dirs
set -- ${1:-peers}
for tree in ${AB_BEFORE:?set AB_BEFORE to the tree of the commit to compare against}; do
  side=before; [ $(wc -w <<< "$AB_BEFORE") -gt 1 ] && side=$(basename "$tree" | sed 's/^\.//')
  rm -rf "/tmp/ab-$side" && cp -r "$tree" "/tmp/ab-$side" || exit 1
  ln -sfn "$root/artifacts" "/tmp/ab-$side/artifacts"  # (the demo model's tokenizer)
  sides+=("$side"); dirs[$side]=/tmp/ab-$side
done
[ "${AB_AFTER:-1}" = 0 ] || { sides+=(after); dirs[after]=$root; }
for run in ${AB_RUNS:-gpu1 hybrid}; do
  for side in "${sides[@]}"; do
    dir=${dirs[$side]}
    mkdir -p "$OUT/$side" && rm -f "$OUT/$side/peers.json"
    (cd "$dir" && OUT=$OUT/$side PEERS_RUNS=$run PEERS_BUDGET=${AB_BUDGET:-100000} bash benchmarks/gpu_session.sh $1) \
        >> "$OUT/ab_$side.log" 2>&1
    echo "ab: $run $side rc=$? t=$SECONDS s"; keep_row $side; grep -E '^\[asyncrl\]|^\| ' "$OUT/$side/peers_$run.log" 2> /dev/null | tail -3 | cut -c1-300
    # A run that wrote no row (the stage's rc can be 0): its errors in the call's output, which comes back when the
    # logs do not (the 68th session's separated 3B runs on an H100 ended so, and nothing said why)
    [ -s "$OUT/$side/peers.json" ] || { echo "ab: $run $side wrote no row; its logs' last errors:"
      grep -hiE "error|Traceback|out of memory|Killed|exceeds" "$OUT/$side/peers_$run.log" "$OUT/ab_$side.log" 2> /dev/null \
          | tail -8 | cut -c1-300; }
  done
done
