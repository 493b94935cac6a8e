#!/usr/bin/env bash
# verl's released wheels for the peer benchmark (benchmarks/peers/verl_grpo.py), for a GPU host with no package
# index: what verl 0.9.1's GRPO recipe (v1 trainer, FSDP, vLLM rollout) imports that neither the GPU image, our GPU
# wheelhouse (shared/gpu/offline-requirements.txt: vllm 0.24.0, ray 2.60.0, msgspec, pyzmq, dill) nor TRL's parts
# hold, tarred and cut into parts of at most 50 MiB. transformers goes apart (verl wants < 5.11, the image has 5.17).
#
#   bash benchmarks/peers/verl_wheels.sh OUT_DIR   # -> OUT_DIR/p0/part0 (about 18 MB in all: one part)
#
# On the GPU host (benchmarks/gpu_session.sh peers, run `verl`, does this), with the parts in /tmp/verl-parts:
#   cat /tmp/verl-parts/part* | tar xf - -C /tmp    # -> /tmp/verl-wheels/*.whl, /tmp/verl-wheels/tf/*.whl
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-verl /tmp/verl-wheels/*.whl
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-verl-tf /tmp/verl-wheels/tf/*.whl
#   PYTHONPATH=/tmp/site-verl-tf:/tmp/site-verl:/tmp/site:$PWD python3 benchmarks/peers/verl_grpo.py ...
#
# Why each (read from the wheels' METADATA Requires-Dist and verl's imports):
#   verl 0.9.1            the peer; its vllm extra pins vllm 0.24.0 and torch 2.11.0, the wheelhouse's and the image's
#   transferqueue 0.1.11  verl's default v1 TaskRunner (trainer.use_v1 true) imports transfer_queue (verl-core extra);
#                         its own needs (ray, pyzmq, msgspec, prometheus_client, psutil) are in the image or wheelhouse
#   tensordict 0.10.0     verl pins >=0.8,<=0.10.0 (cp312 wheel); it needs pyvers <0.2 (pyvers 0.1.0) and orjson
#   orjson                tensordict, and verl's "file" metrics logger (utils/tracking.py) that verl_grpo.py reads
#   hydra-core 1.3.8, omegaconf 2.3.0 (hydra wants <2.4), antlr4-python3-runtime 4.9.3 (==4.9.*, source only on
#                         PyPI: a pure-Python wheel built here with `pip wheel --no-deps`)   verl's config
#   codetiming, pylatexenc, torchdata 0.11.0     verl's imports (timers, math reward utils, stateful data loader)
#   datasets 5.0.1, multiprocess 0.70.19         verl's RL dataset imports datasets (TRL's parts carry the same two;
#                         carried again so that verl's run does not need TRL on its path)
#   tf/transformers 5.10.2    verl wants >=5.5.3,<5.11 (not 5.6.0), the newest such; on its own path, first for verl only
#   tf/tokenizers 0.22.2      transformers 5.10.2 checks tokenizers <=0.23.0 at import; the image has 0.23.2
# Already there, so not carried: accelerate, peft, pandas, pyarrow, numpy, pybind11, tensorboard, packaging,
# cloudpickle, prometheus-client, psutil, requests, urllib3, huggingface-hub (the image); ray, vllm, msgspec, pyzmq,
# dill (the wheelhouse). wandb (verl's Requires-Dist) is imported only by its wandb logger, which is not used.
set -euo pipefail
out=${1:?usage: verl_wheels.sh OUT_DIR}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/verl-wheels/tf" "$out"
get() {  # get DIR SPEC...: cp312 manylinux x86_64 wheels, no dependencies
  local dir=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d "$dir" "$@" 2>&1 | { grep -v "is ignored" || true; }
}
get "$work/verl-wheels" verl==0.9.1 transferqueue==0.1.11 tensordict==0.10.0 pyvers==0.1.0 orjson==3.13.0 \
  hydra-core==1.3.8 omegaconf==2.3.0 codetiming==1.4.0 pylatexenc==2.11 torchdata==0.11.0 datasets==5.0.1 \
  multiprocess==0.70.19
get "$work/verl-wheels/tf" transformers==5.10.2 tokenizers==0.22.2
python3 -m pip download -q --no-deps --no-binary=:all: -d "$work/sdist" antlr4-python3-runtime==4.9.3 2>&1 | { grep -v "is ignored" || true; }
python3 -m pip wheel -q --no-deps -w "$work/verl-wheels" "$work"/sdist/antlr4* 2>&1 | { grep -v "is ignored" || true; }
ls -l "$work/verl-wheels" "$work/verl-wheels/tf"
tar cf "$work/verl.tar" -C "$work" verl-wheels
(cd "$work" && split -b 50M -d -a 1 verl.tar part)
i=0
for p in "$work"/part*; do mkdir -p "$out/p$i"; mv "$p" "$out/p$i/part$i"; i=$((i + 1)); done
du -sh "$out"/p*
