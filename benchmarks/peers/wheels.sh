#!/usr/bin/env bash
# The peers' own released wheels for the side-by-side benchmark (issue 32), for a GPU host with no package
# index: what TRL's GRPOTrainer needs that neither the GPU image nor our GPU wheelhouse
# (shared/gpu/wheelhouse.sh) holds, tarred and cut into parts of at most 60 MiB.
#
#   bash benchmarks/peers/wheels.sh OUT_DIR        # -> OUT_DIR/p0/part0 (1.6 MB in all: one part)
#
# On the GPU host (benchmarks/gpu_session.sh peers does this), with the parts in /tmp/peer-parts:
#   cat /tmp/peer-parts/part* | tar xf - -C /tmp    # -> /tmp/peer-wheels/*.whl
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-peers /tmp/peer-wheels/*.whl
#   export PYTHONPATH=/tmp/site-peers:/tmp/site:$PWD  # TRL, then the wheelhouse (vllm, dill), then asyncrl
#
# Why these, and only these (checked 2026-11-26 against the wheels' METADATA and sources):
#   trl 1.16.0         the newest TRL. Its `vllm` extra pins vllm >=0.22.0,<=0.31.0, so the wheelhouse's 0.24.0
#                      is inside its range, and every vLLM call of its colocate path exists in vllm 0.24.0:
#                      LLM(distributed_executor_backend="external_launcher", logprobs_mode="processed_logprobs",
#                      model_impl, max_num_batched_tokens, enable_sleep_mode), llm.llm_engine.model_executor
#                      .driver_worker.model_runner.model.load_weights (the in-process engine of
#                      VLLM_ENABLE_V1_MULTIPROCESSING=0, which external_launcher sets), llm.sleep / wake_up(tags) /
#                      reset_prefix_cache / generate(use_tqdm), SamplingParams(ignore_eos, min_tokens) and
#                      vllm.sampling_params.StructuredOutputsParams. Its server-mode client imports
#                      NCCLWeightTransferEngine for vLLM < 0.28 (present in 0.24) and nccl_common only from 0.28 on.
#   datasets 5.0.1     TRL imports it at module level (>=4.7.0). 5.0.1 is the newest whose own pins the image can
#                      meet: pyarrow >=21 (5.1+ wants >=24), huggingface-hub <2 (image 1.33), httpx <1, dill <0.4.2.
#   multiprocess 0.70.19   datasets' need (<0.70.20), not in the image; it needs dill >=0.4.1: the wheelhouse has
#                      dill 0.4.1.
# Already there, so not carried: accelerate 1.15.0 (TRL wants >=1.10.1), transformers 5.17.0, huggingface-hub,
# pandas, pyarrow, xxhash, fsspec, psutil, jinja2, pyyaml, requests, tqdm (the image); vllm 0.24.0 and dill 0.4.1
# (the wheelhouse).
set -euo pipefail
out=${1:?usage: wheels.sh OUT_DIR}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/peer-wheels" "$out"
python3 -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$work/peer-wheels" trl==1.16.0 datasets==5.0.1 multiprocess==0.70.19 2>&1 | { grep -v "is ignored" || true; }
ls -l "$work/peer-wheels"
tar cf "$work/peers.tar" -C "$work" peer-wheels
(cd "$work" && split -b 60M -d -a 1 peers.tar part)
i=0
for p in "$work"/part*; do mkdir -p "$out/p$i"; mv "$p" "$out/p$i/part$i"; i=$((i + 1)); done
du -sh "$out"/p*
