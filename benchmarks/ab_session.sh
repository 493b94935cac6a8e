#!/usr/bin/env bash
# One stage of benchmarks/gpu_session.sh on two trees in one lease, run by run: another commit's tree (AB_BEFORE, e.g.
# `git archive <commit> asyncrl benchmarks deploy pyproject.toml` into an ignored folder, carried) and this one, so
# that a change's step-level effect is a ratio measured on one machine. For each run of AB_RUNS (default "gpu1
# hybrid", the peers stage's PEERS_RUNS) the before tree's, then this tree's; the stage's other settings come from the
# environment (PEERS_MODEL, PEERS_SHAPE, GPU1_ETAS, ...). Rows: $OUT/before/peers.json and $OUT/after/peers.json;
# each side's log $OUT/ab_<side>.log. Long: start it with `GPU_SESSION=benchmarks/ab_session.sh bash
# benchmarks/gpu_bg.sh start peers` and follow with `gpu_bg.sh wait`.
set -uo pipefail
root=$PWD; before=/tmp/ab-before
# (a copy outside this tree: run from a hidden folder inside it, the hybrid run's learner rank could not import
# asyncrl.weightsync, 43rd session; from /tmp both placements ran)
rm -rf $before && cp -r "${AB_BEFORE:?set AB_BEFORE to the tree of the commit to compare against}" $before || exit 1
ln -sfn "$root/artifacts" "$before/artifacts"  # (the demo model's tokenizer)
for run in ${AB_RUNS:-gpu1 hybrid}; do
  for side in before after; do
    dir=$root; [ $side = before ] && dir=$before
    mkdir -p "$OUT/$side"
    (cd "$dir" && OUT=$OUT/$side PEERS_RUNS=$run PEERS_BUDGET=${AB_BUDGET:-100000} bash benchmarks/gpu_session.sh ${1:-peers}) \
        >> "$OUT/ab_$side.log" 2>&1
    echo "ab: $run $side rc=$? t=$SECONDS s"; grep -E '^\[asyncrl\]|^\| ' "$OUT/$side/peers_$run.log" 2> /dev/null | tail -3 | cut -c1-300
  done
done
