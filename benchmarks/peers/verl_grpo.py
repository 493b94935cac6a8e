"""verl's GRPO recipe (FSDP actor, vLLM rollout co-located on the one GPU) on asyncrl's arithmetic prompts and reward.

The third side of benchmarks/peers/: verl 0.9.1's released wheel (benchmarks/peers/verl_wheels.sh), run through its
public entry point `python -m verl.trainer.main_ppo` with hydra overrides built from the knobs trl_grpo.py and
asyncrl_side.py take, one JSON row printed (common.py). Prompts: trl_grpo.py's own `build_prompts` (ArithmeticTask's
train split in PromptStream order, each one user message), written to a parquet in verl's RL dataset layout; the
reward is asyncrl's `exact_integer_reward`, this file's `compute_score` (reward.custom_reward_function).

Matched to trl_grpo.py: algorithm.adv_estimator grpo (group-std scaled advantages), one optimizer step per batch
(ppo_mini_batch_size = prompts per step, ppo_epochs 1), no KL loss and no reference model, loss_agg_mode
token-mean, clip 0.2 both sides, AdamW (0.9, 0.999) with weight decay 0, grad clip 1.0, constant lr with no warm-up,
temperature 1, top-p 1, top-k off, ignore_eos for fixed lengths, bf16 compute over fp32 master weights (verl's
fsdp_config model_dtype fp32), no gradient checkpointing, use_remove_padding off and sdpa attention (no flash-attn
on the GPU host). verl's rollout importance-sampling correction stays at its default (off).

Modes (--mode, trainer.v1.trainer_mode): `sync`, verl's default (generate, sleep the engine, train, wake it and
push the weights); `colocate_async`, verl's partial-rollout trainer on the same GPU (one batch generated ahead:
eta 1). verl's one-step-off-policy and fully-async recipes (verl.experimental) and v1's separate_async need a
rollout GPU pool apart from the trainer's (hybrid_engine False, rollout.n_gpus_per_node > 0): not one GPU.

Time per step, from verl's own metrics (its "file" logger, one JSON line per step; timing_s/* are marked_timer sums):
  generation    timing_s/gen (waiting for the batch's rollouts, rewards included, and the engine's sleep)
  training      timing_s/old_log_prob + timing_s/ref + timing_s/update_actor
  weight_sync   timing_s/update_weights (the engine's wake and the push)
  wall          timing_s/step; idle is what the three leave (advantages, batch balancing, metrics)

    python benchmarks/peers/verl_grpo.py --model /tmp/qwen2-0.5b-random --prompts-per-step 8 --group-size 8 \\
        --max-new-tokens 256 --lr 1e-6 --warmup-steps 3 --steps 8 --out /tmp/peers.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
if str(HERE.parents[2]) not in sys.path:  # asyncrl, for verl's reward workers that load this file by its path
    sys.path.append(str(HERE.parents[2]))
from common import StepTime, add_knob_arguments, check_knobs, emit, gpu_name, knobs, max_model_len, package_version, summarize
from trl_grpo import build_prompts  # the same prompts, in the same order, as TRL's side

MODES = {"sync": ("colocate", 0), "colocate_async": ("colocate-async", 1)}  # trainer_mode: (placement, eta)
VERSIONS = ("verl", "vllm", "transformers", "torch", "ray", "tensordict")
DATA_SOURCE = "arithmetic"
TRAINING_TIMERS = ("old_log_prob", "ref", "update_actor")  # verl 0.9.1 v1 trainer_base._step_once's marked_timers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_knob_arguments(ap)
    ap.add_argument("--mode", choices=sorted(MODES), default="sync", help="verl's v1 trainer_mode on the one GPU")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                    help="rollout.gpu_memory_utilization (TRL's and asyncrl's engines: 0.3)")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                    help="bf16 compute (fsdp_config.dtype, rollout.dtype); master weights stay fp32")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="verl's default; off here like the others")
    ap.add_argument("--work-dir", type=Path, default=None, help="parquets, metrics, checkpoints (default: a temporary folder)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a further hydra override for verl, after the knobs; repeatable")
    a = ap.parse_args(argv)
    check_knobs(ap, a)
    if not 0 < a.gpu_memory_utilization < 1:
        ap.error(f"--gpu-memory-utilization={a.gpu_memory_utilization}: a fraction in (0, 1)")
    return a


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **_: Any) -> float:
    """verl's custom reward function: asyncrl's `exact_integer_reward` on the decoded completion."""
    from asyncrl.rewards.math import exact_integer_reward

    return float(exact_integer_reward(solution_str, ground_truth))


def dataset_rows(prompts: list[Any], split: str) -> list[dict[str, Any]]:
    """verl's RL dataset rows (verl.utils.dataset.rl_dataset): chat messages under `prompt`, the answer under
    reward_model.ground_truth (what compute_score receives)."""
    return [{"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": p.prompt}], "ability": "arithmetic",
             "reward_model": {"style": "rule", "ground_truth": p.answer}, "extra_info": {"split": split, "index": i}}
            for i, p in enumerate(prompts)]


def write_datasets(a: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    """The train parquet (enough prompts for every step, and the batch colocate_async generates ahead) and the
    held-out one (verl's validation, --eval-every)."""
    import pandas as pd

    train, held_out = build_prompts(a, (a.warmup_steps + a.steps + 2) * a.prompts_per_step)
    paths = work / "train.parquet", work / "val.parquet"
    for path, prompts, split in zip(paths, (train, held_out), ("train", "test"), strict=True):
        pd.DataFrame(dataset_rows(prompts, split)).to_parquet(path)
    return paths


def verl_overrides(a: argparse.Namespace, train: Path, val: Path, work: Path) -> list[str]:
    """The knobs as hydra overrides of verl 0.9.1's ppo_trainer.yaml (every key exists there but the `+` ones)."""
    batch = a.prompts_per_step * a.group_size
    micro = a.micro_batch_size or batch
    context = max_model_len(a)
    dtype = "bfloat16" if a.bf16 else "float32"
    actor, rollout = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    return [
        "algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=true", "algorithm.use_kl_in_reward=false",
        f"data.train_files={train}", f"data.val_files={val}", "data.prompt_key=prompt", "data.shuffle=false",
        f"data.seed={a.seed}", f"data.train_batch_size={a.prompts_per_step}",
        f"data.max_prompt_length={context - a.max_new_tokens}", f"data.max_response_length={a.max_new_tokens}",
        "data.filter_overlong_prompts=false", "data.truncation=error",
        f"actor_rollout_ref.model.path={Path(a.model).resolve()}", "actor_rollout_ref.model.use_remove_padding=false",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={str(a.gradient_checkpointing).lower()}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"{actor}.strategy=fsdp", f"{actor}.ppo_mini_batch_size={a.prompts_per_step}",
        f"{actor}.ppo_micro_batch_size_per_gpu={micro}", f"{actor}.use_dynamic_bsz=false", f"{actor}.ppo_epochs=1",
        f"{actor}.use_kl_loss=false", f"{actor}.entropy_coeff=0", f"{actor}.loss_agg_mode=token-mean",
        f"{actor}.clip_ratio=0.2", f"{actor}.clip_ratio_low=0.2", f"{actor}.clip_ratio_high=0.2", f"{actor}.grad_clip=1.0",
        f"{actor}.optim.lr={a.lr}", f"{actor}.optim.weight_decay=0.0", f"{actor}.optim.lr_warmup_steps=0",
        f"{actor}.optim.lr_scheduler_type=constant", f"{actor}.optim.clip_grad=1.0",
        f"{actor}.fsdp_config.dtype={dtype}", f"{actor}.fsdp_config.model_dtype=fp32",
        f"{rollout}.name=vllm", f"{rollout}.n={a.group_size}", f"{rollout}.tensor_model_parallel_size=1",
        f"{rollout}.temperature=1.0", f"{rollout}.top_p=1.0", f"{rollout}.top_k=-1",
        f"{rollout}.ignore_eos={str(a.fixed_length).lower()}", f"{rollout}.max_model_len={context}",
        f"{rollout}.gpu_memory_utilization={a.gpu_memory_utilization}", f"{rollout}.dtype={dtype}",
        f"{rollout}.log_prob_micro_batch_size_per_gpu={micro}", f"{rollout}.seed={a.seed}",
        f"reward.custom_reward_function.path={HERE}", "reward.custom_reward_function.name=compute_score",
        "trainer.use_v1=true", f"trainer.v1.trainer_mode={a.mode}", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        "trainer.logger=[console,file]", "trainer.project_name=asyncrl_peers", "trainer.experiment_name=verl_grpo",
        "trainer.total_epochs=1", f"trainer.total_training_steps={a.warmup_steps + a.steps}",
        f"trainer.val_before_train={str(bool(a.eval_every)).lower()}", f"trainer.test_freq={a.eval_every or -1}",
        "trainer.save_freq=-1", "trainer.resume_mode=disable", f"trainer.default_local_dir={work / 'checkpoints'}",
        # verl's workers (Ray actors) get the metrics file's path from the runtime env too (a given RAY_ADDRESS)
        f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={work / 'metrics.jsonl'}",
        *a.overrides,
    ]


class FirstStepWatch:
    """When verl's first training step's metrics line appears in `path` (unix time `at`; None until then),
    polled every `every` s from a thread: its FileLogger writes no time of its own."""

    def __init__(self, path: Path, every: float = 0.25) -> None:
        self.path, self.every, self.at = path, every, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set() and self.at is None:
            try:
                if "timing_s/step" in self.path.read_text():
                    self.at = time.time()
            except OSError:
                pass
            self._stop.wait(self.every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """verl's FileLogger lines ({"step", "data"}), merged per step (validation may log apart), by step."""
    per_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            per_step.setdefault(int(rec["step"]), {}).update(rec["data"])
    return [per_step[s] | {"_step": s} for s in sorted(per_step)]


def step_times(records: list[dict[str, Any]], a: argparse.Namespace) -> list[StepTime]:
    """One StepTime per training step (the records with timing_s/step; step 0's validation has none)."""
    samples = a.prompts_per_step * a.group_size
    steps = []
    for r in records:
        if "timing_s/step" not in r:
            continue
        steps.append(StepTime(
            step=r["_step"], wall_s=float(r["timing_s/step"]), generation_s=float(r.get("timing_s/gen", 0.0)),
            training_s=sum(float(r.get(f"timing_s/{k}", 0.0)) for k in TRAINING_TIMERS),
            weight_sync_s=float(r.get("timing_s/update_weights", 0.0)),
            completion_tokens=round(float(r["response_length/mean"]) * samples), warmup=r["_step"] <= a.warmup_steps))
    return steps


def evaluations(records: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Held-out greedy accuracy (val-core/<source>/acc/mean@1) against seconds of the run: the steps' and the
    evaluations' own time (timing_s/step + timing_s/testing) up to it; step 0's before the first step."""
    out, wall = [], 0.0
    for r in records:
        wall += float(r.get("timing_s/step", 0.0)) + float(r.get("timing_s/testing", 0.0))
        acc = next((v for k, v in r.items() if k.startswith(f"val-core/{DATA_SOURCE}/acc/mean@")), None)
        if acc is not None:
            out.append({"step": r["_step"], "wall_s": wall, "accuracy": float(acc)})
    return out


def run(a: argparse.Namespace) -> dict[str, Any]:
    work = (a.work_dir or Path(tempfile.mkdtemp(prefix="verl-grpo-"))).resolve()  # main_ppo runs in it
    work.mkdir(parents=True, exist_ok=True)
    train, val = write_datasets(a, work)
    metrics = work / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    env = os.environ | {"VERL_FILE_LOGGER_PATH": str(metrics), "HYDRA_FULL_ERROR": "1"}
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", f"hydra.run.dir={work / 'hydra'}", *verl_overrides(a, train, val, work)]
    print("[verl] " + " ".join(cmd), flush=True)
    finished = True
    first_seen = FirstStepWatch(metrics)
    launched = time.time()
    try:
        done = subprocess.run(cmd, env=env, cwd=work, check=False)
        returncode = done.returncode
    except KeyboardInterrupt:  # the caller's limit (timeout -s INT): report the steps verl finished, if any timed
        finished, returncode = False, "interrupted"
    finally:
        first_seen.stop()
    records = read_metrics(metrics) if metrics.is_file() else []
    steps = step_times(records, a)
    if (returncode != 0 and finished) or not any(not s.warmup for s in steps):
        raise SystemExit(f"[verl] main_ppo {'exited ' + str(returncode) if finished else 'was interrupted'} after "
                         f"{len(steps)} steps ({sum(not s.warmup for s in steps)} timed); metrics at {metrics}")
    if not finished:
        print(f"[verl] cut short by its limit after {len(steps)} steps: the row covers them", flush=True)
    total = a.warmup_steps + a.steps
    for s, r in zip(steps, [r for r in records if "timing_s/step" in r], strict=True):
        print(f"[verl] step {s.step}/{total}{' (warm-up)' if s.warmup else ''}: {s.wall_s:.2f} s = generation "
              f"{s.generation_s:.2f} + training {s.training_s:.2f} + weight sync {s.weight_sync_s:.2f} + idle "
              f"{s.idle_s:.2f}; {s.completion_tokens} tokens, reward mean {r.get('critic/score/mean', float('nan')):.3f}",
              flush=True)
    sys.path.insert(1, str(HERE.parents[1]))  # benchmarks/: a dense HF config's parameter count (tied embedding once)
    from async_speedup import model_params

    placement, eta = MODES[a.mode]
    rewards = [float(r["critic/score/mean"]) for r in records if "critic/score/mean" in r]
    return {
        "system": "verl", "placement": placement, "eta": eta, "finished": finished,
        "version": ", ".join(f"{n} {package_version(n)}" for n in VERSIONS),
        "model": a.model, "params": model_params(a.model), **knobs(a, "bf16" if a.bf16 else "fp32"),
        "warmup_steps": a.warmup_steps, **summarize(steps), "gpu": gpu_name(),
        "reward_mean": statistics.fmean(rewards) if rewards else None, "eval": evaluations(records),
        # from main_ppo's launch to its first step's start: when step 1's metrics line appeared, less its timing_s/step
        "start_s": None if first_seen.at is None else first_seen.at - launched - steps[0].wall_s,
        "first_step_s": steps[0].wall_s,
        "settings": {"trainer_mode": a.mode, "rollout_gpu_memory_utilization": a.gpu_memory_utilization,
                     "gradient_checkpointing": a.gradient_checkpointing, "max_model_len": max_model_len(a),
                     "master_weights": "float32", "loss_agg_mode": "token-mean", "importance_sampling": "off",
                     "attn_implementation": "sdpa", "extra_overrides": a.overrides},
    }


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    print("[verl] " + ", ".join(f"{n} {package_version(n)}" for n in VERSIONS), flush=True)
    emit(run(a), a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
