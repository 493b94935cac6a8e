#!/usr/bin/env bash
# The learner against a plain transformers + fused AdamW loop, on one GPU, in one run per shape.
#
#   bash benchmarks/learner_speed.sh [SHAPES...]   # default: 1.5b:8x4096:1 1.5b:8x2048:2 0.5b:8x4096:1 1.5b:8x8192:1
#
# A shape is MODEL:BATCHxSEQ:MICRO_BATCH. Each runs `learner_step.py --sections hf,bare,role` (the
# same random model and token batches for all three; `bare` and `role` with learner.attention as
# ATTENTION, default auto = sdpa without Transformer Engine). SECTIONS overrides the sections.
# Needs only megatron-core 0.19.2, pydantic, msgspec as wheels in .whl/ (carried), beside the
# GPU image's torch + transformers; PACK_TOKENS=N packs each role micro-batch into one row of up to N
# tokens (learner.sequence_packing + max_tokens_per_micro_batch); PROFILE=1 profiles one more
# update of the role section into $OUT/<tag>.profile.txt, SYNC_DEBUG=1 lists its host syncs; the random models are built once into /tmp. JSON rows and
# logs go to $OUT. PARALLEL passes learner_step.py's layout flags (several GPUs, one process each), e.g.
# PARALLEL="--tp 2 --sequence-parallel" or PARALLEL="--cp 2" with SECTIONS=role and TAG=tp2sp.
set -uo pipefail
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if [ ! -f /tmp/site/.learner-wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    touch /tmp/site/.learner-wheels
fi
model_dir() {
    case $1 in
    0.5b) echo /tmp/qwen2-0.5b-random ;;
    1.5b) echo /tmp/qwen2-1.5b-random ;;
    3b) echo /tmp/qwen2.5-3b-random ;;
    7b) echo /tmp/qwen2-7b-random ;;
    esac
}
build_model() {
    local dir; dir=$(model_dir "$1")
    [ -f "$dir/config.json" ] && return 0
    case $1 in
    0.5b) args="" ;;
    1.5b) args="--layers 28 --hidden 1536 --heads 12 --kv-heads 2 --ffn 8960" ;;
    3b) args="--layers 36 --hidden 2048 --heads 16 --kv-heads 2 --ffn 11008" ;;
    7b) args="--layers 28 --hidden 3584 --heads 28 --kv-heads 4 --ffn 18944 --untied" ;;
    esac
    timeout 240 python3 benchmarks/make_random_qwen2.py --tokenizer-from artifacts/demo-model --out "$dir" $args 2>&1 | tail -1
}
shapes=${*:-"1.5b:8x4096:1 1.5b:8x2048:2 0.5b:8x4096:1 1.5b:8x8192:1"}
for shape in $shapes; do
    IFS=: read -r m bs mbs <<<"$shape"
    batch=${bs%x*}; seq=${bs#*x}
    build_model "$m"
    tag="learner_${m}_${batch}x${seq}_mb${mbs}${TAG:+_$TAG}"
    sections=${SECTIONS:-hf,bare,role}
    timeout "${STEP_TIMEOUT:-300}" python3 benchmarks/learner_step.py --model "$(model_dir "$m")" --out "$OUT/$tag.json" \
        --sections "$sections" --attention "${ATTENTION:-auto}" ${PARALLEL:-} ${PACK_TOKENS:+--pack --max-tokens $PACK_TOKENS} ${PROFILE:+--profile $OUT/$tag.profile.txt} ${SYNC_DEBUG:+--sync-debug} --batch "$batch" --seq-len "$seq" \
        --prompt-len $((seq / 4)) --micro-batch-size "$mbs" --warmup 2 --steps 5 > "$OUT/$tag.log" 2>&1
    echo "$tag rc=$?"
    python3 - "$OUT/$tag.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
def row(name, d):
    if not d:
        return
    if "error" in d:
        print(f"  {name}: ERROR {d['error'][:300]}")
        return
    u = d.get("update_actor", d)
    extra = {k: d[k] for k in ("update_over_bare_fwd_bwd", "update_tokens_per_s_over_hf", "peak_gib_over_hf") if k in d}
    print(f"  {name}: {u.get('seconds_per_step')} s/step {u.get('tokens_per_s')} tok/s mfu {u.get('mfu')} "
          f"peak {d.get('peak_gib')} GiB {extra}")
for n in ("hf", "bare", "role"):
    row(n, r.get(n))
EOF
done
