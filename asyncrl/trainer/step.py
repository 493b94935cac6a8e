"""Advantages for one batch, from rewards, log-probs and values the learner returned.

Owns: turning per-sample python lists (one float per response token) into padded tensors,
applying the configured advantage estimator and KL-as-reward penalty, and turning the result
back into per-sample lists for the learner. The math itself is `asyncrl.algorithms`.
Must never: call a component, or pad/unpad with a layout other than "response tokens only,
left-aligned, one row per sample" (the learner's per-token inputs use the same layout).
"""

from __future__ import annotations

from typing import Sequence

import torch

from asyncrl.algorithms import (
    gae_advantages,
    grpo_advantages,
    kl_divergence,
    kl_penalty_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
    token_rewards_from_sequence,
    weight_negative_advantages,
)
from asyncrl.config import AlgorithmConfig
from asyncrl.types import Sample, TrainBatch

PerToken = list[list[float]]


def needs_reference(algo: AlgorithmConfig) -> bool:
    return algo.kl_coef > 0


def pad_per_token(rows: Sequence[Sequence[float]], width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] float64 values and bool mask from ragged per-sample lists."""
    width = width if width is not None else max((len(r) for r in rows), default=0)
    values = torch.zeros(len(rows), max(width, 1), dtype=torch.float64)
    mask = torch.zeros_like(values, dtype=torch.bool)
    for i, r in enumerate(rows):
        if r:
            values[i, : len(r)] = torch.tensor(list(r), dtype=torch.float64)
            mask[i, : len(r)] = True
    return values, mask


def unpad_per_token(values: torch.Tensor, lengths: Sequence[int]) -> PerToken:
    return [values[i, :n].tolist() for i, n in enumerate(lengths)]


def turn_reward_rows(samples: Sequence[Sample], width: int) -> torch.Tensor | None:
    """[B, width] float64: each episode's per-turn rewards on its turns' last sampled tokens (None when
    no sample has any)."""
    if all(s.turn_rewards is None for s in samples):
        return None
    out = torch.zeros(len(samples), max(width, 1), dtype=torch.float64)
    for i, s in enumerate(samples):
        if s.turn_rewards is None:
            continue
        ends = s.turn_ends or []
        if len(ends) != len(s.turn_rewards) or any(not 0 <= e < len(s.response_ids) for e in ends):
            raise ValueError(f"sample {i}: turn_ends {ends} do not match its {len(s.turn_rewards)} turn_rewards "
                             f"and {len(s.response_ids)} response tokens")
        for e, r in zip(ends, s.turn_rewards):
            out[i, e] += r
    return out


def compute_advantages(
    batch: TrainBatch,
    algo: AlgorithmConfig,
    logprobs: PerToken | None,
    ref_logprobs: PerToken | None,
    values: PerToken | None,
) -> tuple[PerToken, PerToken | None, dict[str, float]]:
    """(per-token advantages, per-token returns or None, metrics) for the batch's samples.

    `logprobs` are the proximal policy's (the learner's current weights), used for the KL
    penalty when `kl_mode == "reward"` and for the `train/kl_ref` metric; None where the update
    computes them itself (`AlgorithmConfig.proximal_in_update`).
    """
    lengths = [len(s.response_ids) for s in batch.samples]
    for name, rows in (("logprobs", logprobs), ("ref_logprobs", ref_logprobs), ("values", values)):
        if rows is not None and [len(r) for r in rows] != lengths:
            raise ValueError(f"{name} rows do not match the batch's response lengths")
    rewards = torch.tensor([s.reward for s in batch.samples], dtype=torch.float64)
    group_ids = torch.tensor([s.group_id for s in batch.samples])
    lp, mask = pad_per_token(logprobs if logprobs is not None else [[0.0] * n for n in lengths])
    metrics: dict[str, float] = {"train/reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0}
    kl_in_reward = ref_logprobs is not None and algo.kl_mode == "reward" and algo.kl_coef > 0
    if kl_in_reward and logprobs is None:
        raise ValueError("a KL penalty in the reward (kl_mode='reward') needs the proximal log-probs")
    ref = pad_per_token(ref_logprobs)[0] if ref_logprobs is not None else None
    if ref is not None and logprobs is not None:
        kl = kl_divergence(lp, ref, algo.kl_kind)
        metrics["train/kl_ref"] = float(kl[mask].mean()) if mask.any() else 0.0

    returns = None
    # An episode's per-turn rewards add to its return: summed for sequence-level estimators, each on its
    # turn's last sampled token for token-level ones (types.Sample).
    per_turn = turn_reward_rows(batch.samples, lp.shape[1])
    if per_turn is not None:
        metrics["train/turn_reward_sum_mean"] = float(per_turn.sum(-1).mean())
    if algo.advantage in ("grpo", "rloo"):
        seq_rewards = rewards if per_turn is None else rewards + per_turn.sum(-1)
        if kl_in_reward:
            # Sequence-level estimators see the KL penalty as a sum over the response.
            seq_rewards = rewards - algo.kl_coef * torch.where(mask, kl_divergence(lp, ref, algo.kl_kind), 0).sum(-1)
        if algo.advantage == "grpo":
            seq_adv = grpo_advantages(seq_rewards, group_ids, scale_by_std=algo.scale_by_std)
        else:
            seq_adv = rloo_advantages(seq_rewards, group_ids)
        adv = seq_adv[:, None].expand_as(lp) * mask
    else:
        token_rewards = token_rewards_from_sequence(rewards, mask)
        if per_turn is not None:
            token_rewards = token_rewards + torch.where(mask, per_turn, 0)
        if kl_in_reward:
            token_rewards = kl_penalty_rewards(token_rewards, lp, ref, mask, coef=algo.kl_coef, kind=algo.kl_kind)
        if algo.advantage == "reinforce_pp":
            adv = reinforce_pp_advantages(token_rewards, mask, gamma=algo.gamma)
        else:
            if values is None:
                raise ValueError("advantage='gae' needs critic values")
            vals = pad_per_token(values, lp.shape[1])[0]
            adv, ret = gae_advantages(token_rewards, vals, mask, gamma=algo.gamma, lam=algo.lam)
            returns = unpad_per_token(ret, lengths)
    if algo.negative_advantage_weight != 1.0:
        adv = weight_negative_advantages(adv, algo.negative_advantage_weight)
    metrics["train/advantage_abs_mean"] = float(adv[mask].abs().mean()) if mask.any() else 0.0
    metrics["train/response_length"] = sum(lengths) / max(len(lengths), 1)
    return unpad_per_token(adv, lengths), returns, metrics
