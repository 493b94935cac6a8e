"""In-process GRPO on the demo model (transformers, no Ray/vLLM/Megatron): a fast way to choose
the demo's RL settings before paying for a real `serve run deploy/rlhf.yaml` (docs/BENCHMARKS.md,
"RL on the demo"). On-policy, one update per batch, no staleness: the real loop adds eta = 2 and
the decoupled PPO correction, so its curve is checked separately.

  python benchmarks/demo_grpo_sim.py --prompts 64 --n 4 --lr 1e-4 --warmup 50 --neg-weight 0.25 --staleness 2 --steps 250  # deploy/rlhf.yaml
  python benchmarks/demo_grpo_sim.py --prompts 64 --n 1 --lr 3e-4 --steps 100 --oracle   # SFT on the answers

Prints the held-out greedy accuracy every --eval-every steps and one RESULT line (JSON).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.algorithms import grpo_advantages, weight_negative_advantages
    from asyncrl.data.arithmetic import ArithmeticTask
    from asyncrl.data.prompts import render_chat_prompt
    from asyncrl.demo_model import greedy_accuracy
    from asyncrl.rewards.math import exact_integer_reward

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "artifacts" / "demo-model"))
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--prompts", type=int, default=64, help="distinct prompts per step")
    ap.add_argument("--n", type=int, default=4, help="completions per prompt (GRPO group)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--neg-weight", type=float, default=1.0, help="algorithm.negative_advantage_weight")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--oracle", action="store_true", help="train on the reference answers (SFT through the same loss)")
    ap.add_argument("--staleness", type=int, default=0,
                    help="train on the batch generated this many updates ago, with the decoupled correction "
                         "(weight pi_prox / pi_behave, tokens above --behavior-cap masked), as eta = K runs it")
    ap.add_argument("--behavior-cap", type=float, default=5.0)
    ap.add_argument("--beta1", type=float, default=0.9, help="Adam beta1 (learner.adam_beta1)")
    a = ap.parse_args()

    torch.manual_seed(a.seed)
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(a.model)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    task = ArithmeticTask(digits=2, operators=("+",))
    train, evals = task.train_split(), task.eval_split()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(a.beta1, 0.999), weight_decay=0.0)
    pad, eos, width = tok.pad_token_id, tok.eos_token_id, a.max_new_tokens

    def evaluate() -> float:
        model.eval()
        return greedy_accuracy(model, tok, evals)

    history = [(0, evaluate())]
    print(json.dumps(vars(a)), "step 0 accuracy", history[0][1], flush=True)
    t0, pos = time.time(), 0

    def token_logprobs(seqs, attn, plen, comp):
        logits = model(input_ids=seqs, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0)).logits[:, plen - 1:-1]
        return torch.log_softmax(logits.float(), -1).gather(2, comp.unsqueeze(2)).squeeze(2)

    queue = []  # generated batches waiting to be trained on (staleness)
    for generated in range(1, a.steps + 1 + a.staleness):
        step = generated - a.staleness  # the update this batch's generation step feeds, `staleness` later
        for g in opt.param_groups:
            g["lr"] = a.lr * min(1.0, max(1, step) / max(1, a.warmup))
        batch = [train[(pos + i) % len(train)] for i in range(a.prompts)]
        pos += a.prompts
        texts = [render_chat_prompt(tok, p.prompt) for p in batch for _ in range(a.n)]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        plen = enc["input_ids"].shape[1]
        if a.oracle:
            rows = []
            for i in range(len(texts)):
                ids = tok(batch[i // a.n].answer, add_special_tokens=False)["input_ids"] + [eos]
                rows.append(ids + [pad] * (width - len(ids)))
            out = torch.cat([enc["input_ids"], torch.tensor(rows)], 1)
        else:
            model.eval()
            with torch.no_grad():
                out = model.generate(**enc, max_new_tokens=width, do_sample=True, temperature=a.temperature, top_p=1.0,
                                     top_k=0, pad_token_id=pad, eos_token_id=eos)
        comp = out[:, plen:]
        is_eos = comp == eos
        before_eos = (torch.cumsum(is_eos.int(), 1) - is_eos.int()) == 0
        mask = before_eos & ((comp != pad) | is_eos)  # up to and including the first eos
        attn = torch.cat([enc["attention_mask"], mask.long()], 1)
        with torch.no_grad():
            behave = token_logprobs(out, attn, plen, comp)  # the generating policy's log-probs
        rewards = torch.tensor([exact_integer_reward(t, batch[i // a.n].answer)
                                for i, t in enumerate(tok.batch_decode(comp, skip_special_tokens=True))], dtype=torch.float64)
        queue.append((out, attn, plen, comp, mask, behave, rewards))
        if len(queue) <= a.staleness:
            continue
        out, attn, plen, comp, mask, behave, rewards = queue.pop(0)
        if a.oracle:
            adv = torch.ones(len(rewards), dtype=torch.float64)
        else:
            groups = torch.arange(a.prompts).repeat_interleave(a.n)
            adv = weight_negative_advantages(grpo_advantages(rewards, groups), a.neg_weight)
        model.train()
        logp = token_logprobs(out, attn, plen, comp)
        m = mask.float()
        if a.staleness:  # decoupled PPO at ratio 1 (one update per batch): weight pi_prox / pi_behave, capped
            weight = torch.exp(logp.detach() - behave)
            m = m * (weight <= a.behavior_cap).float()
            logp = logp * weight
        loss = (-adv.float().unsqueeze(1) * logp * m).sum() / m.sum()  # on-policy PPO = policy gradient, token-mean
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % a.eval_every == 0:
            history.append((step, evaluate()))
            print(f"step {step} accuracy {history[-1][1]:.3f} reward {rewards.mean():.3f} {time.time() - t0:.0f}s", flush=True)
    print("RESULT", json.dumps({**vars(a), "accuracy": history}))


if __name__ == "__main__":
    main()
