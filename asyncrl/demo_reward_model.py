"""Builds the demo reward model: the demo policy's backbone with a score head, trained to tell a
right answer to the arithmetic task from a wrong one.

Owns: the training data (the policy's own sampled completions, as token ids, labelled by the exact
answer, plus written-out right answers and near misses), the training (binary cross-entropy on
the score at each sequence's last token, the position the `reward_model` role reads), its held-out
accuracy and AUC on the policy's completions to problems it never saw, and the HF directory
(`Qwen2ForSequenceClassification`, num_labels 1, the policy's tokenizer) that `reward.kind: model`
loads.

Must never: download anything, see the held-out problems while training, or leave a half-written
directory at `out`.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from asyncrl.data.arithmetic import ArithmeticTask
from asyncrl.data.prompts import Prompt, render_prompt
from asyncrl.demo_model import METADATA_FILE, optimizer_step, save_model_dir
from asyncrl.rewards.math import exact_integer_reward


@dataclass(frozen=True)
class RewardSpec:
    seed: int = 0
    steps: int = 5000  # at most; stops once the held-out accuracy reaches the target
    batch_size: int = 64
    lr: float = 1e-3
    target_accuracy: float = 0.0  # 0 = every step; else stop once the held-out accuracy reaches it
    eval_every: int = 250
    policy_samples: int = 16000  # completions sampled from the policy at temperature 1 for training
    eval_samples: int = 800  # ... for the held-out check (problems of the task's eval split)
    max_new_tokens: int = 8
    temperature: float = 1.0


# prompt ids, response ids, label (1 = right answer), the right answer's ids (digits, then the end token)
Example = tuple[list[int], list[int], float, list[int]]


@torch.no_grad()
def sample_policy(policy, tokenizer, prompts: list[Prompt], n: int, spec: RewardSpec, gen: torch.Generator) -> list[Example]:
    """`n` completions of random problems from `prompts`, sampled from the policy at
    `spec.temperature`, as token ids up to and including the first end token."""
    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    out: list[Example] = []
    tokenizer.padding_side = "left"
    while len(out) < n:
        chunk = [prompts[rng.randrange(len(prompts))] for _ in range(min(200, n - len(out)))]
        texts = [render_prompt(tokenizer, p) for p in chunk]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        torch.manual_seed(rng.randrange(2**31))
        generated = policy.generate(**enc, max_new_tokens=spec.max_new_tokens, do_sample=True, temperature=spec.temperature,
                                    top_p=1.0, top_k=0, pad_token_id=pad, eos_token_id=eos)
        for p, text, row in zip(chunk, texts, generated[:, enc["input_ids"].shape[1]:].tolist()):
            response = row[: row.index(eos) + 1] if eos in row else [t for t in row if t != pad]
            if not response:
                continue
            prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            label = exact_integer_reward(tokenizer.decode(response, skip_special_tokens=True), p.answer)
            out.append((prompt_ids, response, label, _answer_ids(tokenizer, p.answer)))
    return out


def written_answers(tokenizer, prompts: list[Prompt], n: int, rng: random.Random) -> list[Example]:
    """Half right answers, half near misses (off by a unit, a ten, a carry; a digit changed)."""
    out: list[Example] = []
    eos = tokenizer.eos_token
    for _ in range(n):
        p = prompts[rng.randrange(len(prompts))]
        right = int(p.answer)
        if rng.random() < 0.5:
            value, label = right, 1.0
        else:
            digits = list(str(right))
            if rng.random() < 0.3:
                i = rng.randrange(len(digits))
                digits[i] = str((int(digits[i]) + rng.randrange(1, 10)) % 10)
                value = int("".join(digits))
            else:
                value = right + rng.choice([1, -1, 2, -2, 10, -10, 9, -9, 11, -11, 20, -20])
            value = value if value != right and value >= 0 else right + 1
            label = 0.0
        prompt_ids = tokenizer(render_prompt(tokenizer, p), add_special_tokens=False)["input_ids"]
        response = tokenizer(f"{value}{eos}", add_special_tokens=False)["input_ids"]
        out.append((prompt_ids, response, label, _answer_ids(tokenizer, p.answer)))
    return out


def _answer_ids(tokenizer, answer: str) -> list[int]:
    return tokenizer(answer + tokenizer.eos_token, add_special_tokens=False)["input_ids"]


def prefix_labels(response: list[int], right: list[int]) -> list[float]:
    """1 at response position i while response[:i + 1] is a prefix of the right answer's ids, else 0:
    at the last token (the end token) it is the answer's label; before it, which digit went wrong."""
    out, ok = [], True
    for i, t in enumerate(response):
        ok = ok and i < len(right) and t == right[i]
        out.append(1.0 if ok else 0.0)
    return out


def _hidden(model, batch: list[Example], pad: int) -> tuple[torch.Tensor, list[list[int]]]:
    """[B, T, H] the backbone's final hidden states, and each sequence's ids."""
    seqs = [e[0] + e[1] for e in batch]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        attention[i, : len(s)] = 1
    return model.model(input_ids=ids, attention_mask=attention).last_hidden_state, seqs


def _dense_loss(model, batch: list[Example], pad: int) -> torch.Tensor:
    """Binary cross-entropy of the score at every response token against its prefix label: the
    last token's label is the answer's; the earlier ones teach where a digit went wrong (with the
    last token's label alone, 1,500 steps left the loss at the base rate's)."""
    hidden, _ = _hidden(model, batch, pad)
    scores = model.score(hidden).squeeze(-1)
    logits, labels = [], []
    for i, (p, r, _, right) in enumerate(batch):
        logits.append(scores[i, len(p): len(p) + len(r)])
        labels.extend(prefix_labels(r, right))
    return torch.nn.functional.binary_cross_entropy_with_logits(torch.cat(logits), torch.tensor(labels))


def last_token_scores(model, batch: list[Example], pad: int) -> torch.Tensor:
    """[B] score at each sequence's last token (the reward_model role's position)."""
    hidden, seqs = _hidden(model, batch, pad)
    last = torch.tensor([len(s) - 1 for s in seqs])
    return model.score(hidden[torch.arange(len(seqs)), last]).squeeze(-1)


@torch.no_grad()
def evaluate(model, examples: list[Example], pad: int) -> dict[str, float]:
    """Accuracy of (score > 0) against the label, and the AUC of the scores."""
    model.eval()
    scores = torch.cat([last_token_scores(model, examples[i : i + 200], pad) for i in range(0, len(examples), 200)]).tolist()
    model.train()
    labels = [e[2] for e in examples]
    accuracy = sum((s > 0) == (y > 0.5) for s, y in zip(scores, labels)) / len(labels)
    pos = [s for s, y in zip(scores, labels) if y > 0.5]
    neg = [s for s, y in zip(scores, labels) if y <= 0.5]
    auc = (sum((a > b) + 0.5 * (a == b) for a in pos for b in neg) / (len(pos) * len(neg))) if pos and neg else float("nan")
    return {"accuracy": accuracy, "auc": auc, "positives": len(pos) / len(labels)}


def build_demo_reward_model(policy_dir: str | os.PathLike[str], out: str | os.PathLike[str], spec: RewardSpec | None = None,
                            *, log=print) -> dict:
    """Train the reward model from the policy at `policy_dir` into `out` (atomically); returns its metadata."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForSequenceClassification

    spec = spec or RewardSpec()
    policy_dir, out = Path(policy_dir).resolve(), Path(out).resolve()
    started = time.time()
    random.seed(spec.seed)
    torch.manual_seed(spec.seed)
    gen = torch.Generator().manual_seed(spec.seed)
    rng = random.Random(spec.seed)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    demo = json.loads((policy_dir / METADATA_FILE).read_text())["spec"] if (policy_dir / METADATA_FILE).exists() else {}
    task = ArithmeticTask(digits=demo.get("digits", 2), operators=tuple(demo.get("operators", ("+",))),
                          seed=demo.get("seed", 0), eval_size=demo.get("eval_size", 200))
    train, held_out = task.train_split(), task.eval_split()
    assert not {p.prompt for p in train} & {p.prompt for p in held_out}
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    sampled = sample_policy(policy, tokenizer, train, spec.policy_samples, spec, gen)
    held = sample_policy(policy, tokenizer, held_out, spec.eval_samples, spec, gen)
    del policy
    log(f"policy samples: {len(sampled)} for training ({sum(e[2] for e in sampled) / len(sampled):.3f} right), "
        f"{len(held)} held out ({sum(e[2] for e in held) / len(held):.3f} right)")
    model = Qwen2ForSequenceClassification.from_pretrained(policy_dir, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    pad = tokenizer.pad_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0, betas=(0.9, 0.98))
    # Cosine decay: at a constant 1e-3 the held-out AUC swung by 0.07 between checks late in training.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, spec.steps) / spec.steps)))
    curve: list[tuple[int, float, float]] = []
    first = evaluate(model, held, pad)
    curve.append((0, first["accuracy"], first["auc"]))
    model.train()
    losses: list[float] = []
    for step in range(1, spec.steps + 1):
        half = spec.batch_size // 2
        batch = [sampled[rng.randrange(len(sampled))] for _ in range(half)] + written_answers(tokenizer, train, spec.batch_size - half, rng)
        loss = _dense_loss(model, batch, pad)
        optimizer_step(model, opt, sched, loss)
        losses.append(loss.item())
        if step % spec.eval_every == 0 or step == spec.steps:
            m = evaluate(model, held, pad)
            curve.append((step, m["accuracy"], m["auc"]))
            log(f"rm step {step:4d}/{spec.steps} loss {sum(losses[-spec.eval_every:]) / len(losses[-spec.eval_every:]):.4f} "
                f"held-out accuracy {m['accuracy']:.3f} auc {m['auc']:.3f}")
            if spec.target_accuracy > 0 and m["accuracy"] >= spec.target_accuracy:
                break
    final = evaluate(model, held, pad)
    meta = {
        "spec": asdict(spec), "policy": str(policy_dir), "kind": "reward_model",
        "held_out": final, "held_out_curve": curve, "steps_run": len(losses), "final_loss": losses[-1],
        "train_policy_samples": len(sampled), "train_policy_right": sum(e[2] for e in sampled) / len(sampled),
        "build_seconds": round(time.time() - started, 1), "torch": torch.__version__,
    }
    save_model_dir(out, model, tokenizer, meta)
    log(f"wrote {out} in {meta['build_seconds']} s: held-out accuracy {final['accuracy']:.3f}, auc {final['auc']:.3f}")
    return meta
