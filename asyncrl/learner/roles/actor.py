"""The actor role: the policy's log-probs and its PPO / GRPO / GSPO updates, inside one rank.

Owns: `compute_log_prob` (proximal log-probs + entropy of response tokens) and `update_actor`
(`ppo_epochs` passes, each one guarded optimizer step over gradient-accumulated micro-batches,
with the policy loss from `asyncrl.algorithms`, the decoupled correction against the engine's
behaviour log-probs, and the KL loss term when `kl_mode == "loss"` and `kl_coef > 0`). An update
handed no proximal log-probs takes them from its first pass's forward: before the first optimizer
step the weights are the proximal policy's, so that forward is the pass it saves.

Must never: know about Ray or other ranks' data (the rank actor and group do), or compute
advantages (the trainer does). Per-token inputs and outputs use the response layout of
`asyncrl.learner.batching` (one python list per sample, one float per response token).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from asyncrl.algorithms import gspo_policy_loss, kl_loss_term, ppo_policy_loss
from asyncrl.algorithms.mismatch import MAX_COLUMN, combine_mismatch_sums, mismatch_metrics, mismatch_sums
from asyncrl.learner.batching import MicroBatch, response_tensor, unpad_response
from asyncrl.learner.offload import Offloader
from asyncrl.learner.roles.accumulate import (
    behavior_loss_mask,
    denominator,
    denominator_tensor,
    dp_all_reduce,
    dp_mean,
    dp_size,
    dp_sum,
    from_last_stage,
)
from asyncrl.learner.roles.base import ModelRunner, RoleContext, _to_device
from asyncrl.learner.roles.optim import GuardedOptimizer, warm_up_update
from asyncrl.types import Sample

PerToken = list[list[float]]


def _width(samples: Sequence[Sample]) -> int:
    return max(1, max((len(s.response_ids) for s in samples), default=1))


def compute_token_logprobs(
    runner: ModelRunner, samples: Sequence[Sample], with_entropy: bool = True
) -> dict[str, PerToken] | None:
    """Log-probs (and entropy) of every response token; None on ranks that hold no logits."""
    width = _width(samples)
    mbs = runner.micro_batches(samples, width)

    def loss_fn(mb: MicroBatch, hidden: torch.Tensor):
        lp, ent = runner.token_logprobs(hidden, mb, with_entropy=with_entropy)
        return lp.sum() * 0.0, {"mb": mb, "logprobs": lp, "entropy": ent}

    with torch.no_grad():
        outs = runner.run(mbs, loss_fn, forward_only=True)
    if not outs or runner.tp_rank != 0:
        return None
    lengths = [len(s.response_ids) for s in samples]
    result: dict[str, PerToken] = {"logprobs": [[] for _ in samples]}
    if with_entropy:
        result["entropy"] = [[] for _ in samples]
    for o in outs:
        idx = o["mb"].sample_index
        for key in result:
            rows = unpad_response(o[key], [lengths[i] for i in idx])
            for i, row in zip(idx, rows):
                result[key][i] = row
    return result


class ActorRole:
    """Policy model + optimizer of one rank."""

    offload_key = "actor"

    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx
        self.runner = ModelRunner(ctx, head="lm", trainable=True, lora=True)
        self.optim = GuardedOptimizer(self.runner.chunks, ctx.learner_cfg, ctx.model_cfg.dtype)
        self.offloader = Offloader(self.runner.chunks, self.optim.optimizer, ctx.learner_cfg.actor)

    # ------------------------------------------------------------------ inference

    def compute_log_prob(self, samples: Sequence[Sample]) -> dict[str, PerToken] | None:
        with self.offloader.onloaded():
            return compute_token_logprobs(self.runner, samples)

    def compute_ref_log_prob(self, samples: Sequence[Sample]) -> dict[str, PerToken] | None:
        """A LoRA actor is its own KL reference: its frozen base, the adapters off (no second model copy)."""
        from asyncrl.learner.lora import adapters_off

        if not self.runner.adapter_params:
            raise ValueError("compute_ref_log_prob on the actor needs learner.lora (the reference is its base model)")
        with self.offloader.onloaded(), adapters_off(self.runner.chunks):
            return compute_token_logprobs(self.runner, samples, with_entropy=False)

    # ------------------------------------------------------------------ update

    def warm_up(self, samples: Sequence[Sample]) -> dict[str, float]:
        """Before the first update: its kernels, activations and optimizer state (`warm_up_update`)."""
        def zero_loss(mb: MicroBatch, hidden: torch.Tensor) -> torch.Tensor:
            lp, ent = self.runner.token_logprobs(hidden, mb, with_entropy=True)
            return (lp.sum() + ent.sum()) * 0.0

        return warm_up_update(self.runner, self.optim, self.offloader, samples, zero_loss)

    def update_actor(
        self, samples: Sequence[Sample], advantages: PerToken, old_logprobs: PerToken | None,
        ref_logprobs: PerToken | None = None, version_gaps: list[list[int]] | None = None,
    ) -> dict[str, float]:
        """`ppo_epochs` optimizer steps on `samples`. `old_logprobs` None: the first pass's own forward,
        which runs on the proximal weights, gives the proximal log-probs (no pass of their own; only
        where `AlgorithmConfig.proximal_in_update` says that is exact, else a ValueError). With the
        engine's behaviour log-probs, the metrics also hold their mismatch against the proximal ones
        (`asyncrl.algorithms.mismatch`), split by `version_gaps` (per token: versions behind the learner)."""
        algo, cfg = self.ctx.algorithm_cfg, self.ctx.learner_cfg
        use_kl = ref_logprobs is not None and algo.kl_mode == "loss" and algo.kl_coef > 0
        if old_logprobs is None and not algo.proximal_in_update(with_reference=ref_logprobs is not None):
            raise ValueError("update_actor without proximal log-probs: with this algorithm config they are needed "
                             "before the update (AlgorithmConfig.proximal_in_update); compute them first")
        width = _width(samples)
        mbs = self.runner.micro_batches(samples, width)
        correction = algo.rollout_correction()
        # Without engine log-probs (e.g. a synchronous recompute) there is nothing to correct.
        has_behavior = all(len(s.behavior_logprobs) == len(s.response_ids) for s in samples)
        behavior = [s.behavior_logprobs for s in samples] if has_behavior else None
        gaps = version_gaps if behavior is not None and version_gaps is not None \
            and [len(g) for g in version_gaps] == [len(s.response_ids) for s in samples] else None
        inputs = [self._mb_inputs(mb, width, advantages, old_logprobs, behavior, ref_logprobs if use_kl else None, gaps,
                                  correction) for mb in mbs]
        # Batch-wide denominators (all micro-batches, all DP ranks): see accumulate.py. Without proximal
        # log-probs the policy loss's is first taken before the decoupled-PPO cap masks any token
        # (`pg_denom`); the first pass counts the true one (`pg_denom_true`), and its grads are rescaled.
        denoms = {"pg": dp_sum([sum(x["pg_denom"] for x in inputs)])[0]}
        kl_d = dp_sum([sum(denominator(mb.response_mask, algo.loss_agg) for mb in mbs)])[0]
        scale_back = len(mbs) * dp_size()
        by_mb = {id(mb): x for mb, x in zip(mbs, inputs)}
        dev = self.runner.device()

        def loss_fn(mb: MicroBatch, hidden: torch.Tensor):
            # Everything here stays on the device: metrics are 0-d tensors, read once per step.
            x = _on_device(by_mb[id(mb)], dev)
            mask = x["mask"]
            lp, ent = self.runner.token_logprobs(hidden, mb, with_entropy=True)
            if x["old"] is None:  # before any optimizer step: this forward is the proximal policy
                x["old"] = lp.detach()
                true_mask = behavior_loss_mask(mask, x["old"], x["behavior"], correction)
                x["pg_denom_true"] = denominator_tensor(true_mask, algo.loss_agg)
                pg_denom = x["pg_denom_true"]
            else:
                pg_denom = x["pg_denom"]
            if x["behavior"] is not None and "mismatch" not in x:  # the first pass: engine vs proximal policy
                x["mismatch"] = mismatch_sums(x["old"], x["behavior"], mask, x["gaps"])
            kw = dict(behavior_logprobs=x["behavior"], correction=correction, agg=algo.loss_agg, lazy_metrics=True)
            if algo.policy_loss == "gspo":
                pg, metrics = gspo_policy_loss(lp, x["old"], x["adv"], mask, clip_low=algo.clip_low, clip_high=algo.clip_high, **kw)
            else:
                pg, metrics = ppo_policy_loss(lp, x["old"], x["adv"], mask, clip_low=algo.clip_low, clip_high=algo.clip_high,
                                              dual_clip=algo.dual_clip, **kw)
            share = pg * (pg_denom / max(denoms["pg"], 1.0))
            metrics["actor/pg_loss"] = share.detach()
            loss = share
            if x["ref"] is not None:
                kl, kl_metrics = kl_loss_term(lp, x["ref"], mask, coef=algo.kl_coef, kind=algo.kl_kind, agg=algo.loss_agg, lazy_metrics=True)
                kl_share = kl * (denominator(mb.response_mask, algo.loss_agg) / max(kl_d, 1.0))
                metrics.update(kl_metrics)
                metrics["actor/kl_loss_share"] = kl_share.detach()
                loss = loss + kl_share
            metrics["actor/entropy"] = (ent * mask).sum() / mask.sum().clamp(min=1)
            metrics["actor/loss"] = loss.detach()
            return loss * scale_back, metrics

        def true_denominator() -> float:
            """After the first pass without proximal log-probs: the factor that turns its policy grads'
            denominator into the true one; later passes divide by the true one directly."""
            factor = 1.0
            if self.runner.is_last_stage:
                counted = torch.stack([x["pg_denom_true"] for x in inputs]).tolist() if inputs else []
                true = dp_sum([sum(counted)])[0]
                factor = denoms["pg"] / true if true > 0 else 1.0  # none left: the policy grads are 0 anyway
                for x, d in zip(inputs, counted):
                    x["pg_denom"] = d
                denoms["pg"] = true
            return from_last_stage(factor)

        out: dict[str, float] = {}
        mismatch: dict[str, float] = {}
        on_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if on_cuda:
            torch.cuda.reset_peak_memory_stats()
        with self.offloader.onloaded():
            for epoch in range(cfg.ppo_epochs):
                rescale = true_denominator if old_logprobs is None and epoch == 0 else None
                step = self._one_step(mbs, loss_fn, rescale)
                out = step if epoch == 0 else {k: out.get(k, 0.0) + v for k, v in step.items()}
                if epoch == 0 and self.runner.is_last_stage:
                    mismatch = _batch_mismatch(inputs)
        if cfg.ppo_epochs > 1:
            out = {k: v / cfg.ppo_epochs for k, v in out.items()}
        out |= mismatch
        out["actor/skipped_steps"] = float(self.optim.skipped_steps)
        out["actor/applied_steps"] = float(self.optim.applied_steps)
        out["actor/proximal_from_update"] = float(old_logprobs is None)
        if on_cuda:  # the most any rank held on its device during the update (its state, activations, logits)
            peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
            if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
                torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
            out["actor/device_peak_gib"] = float(peak)
        return out

    def _one_step(self, mbs: list[MicroBatch], loss_fn, rescale: Callable[[], float] | None = None) -> dict[str, float]:
        """One optimizer step over `mbs`; `rescale()` (after the passes) gives a factor for the policy
        loss's grads and its metrics (`proximal_in_update` rules out a KL term beside a factor != 1)."""
        self.optim.zero_grad()
        outs = self.runner.run(mbs, loss_fn, forward_only=False)
        metrics = _reduce_micro_metrics(outs)
        grad_scale = rescale() if rescale is not None else 1.0
        if outs:
            metrics = dp_mean(metrics)
            # Losses are shares of the whole batch: the DP mean times DP is their sum.
            for k in ("actor/pg_loss", "actor/kl_loss_share", "actor/loss"):
                if k in metrics:
                    metrics[k] *= dp_size() * (grad_scale if k != "actor/kl_loss_share" else 1.0)
        loss = metrics.get("actor/loss", 0.0)
        step = self.optim.step(loss_finite=bool(torch.isfinite(torch.tensor(loss))), grad_scale=grad_scale)
        metrics.update({"actor/grad_norm": step["grad_norm"], "actor/lr": step["lr"], "actor/step_skipped": step["skipped"]})
        return metrics

    def _mb_inputs(self, mb, width, advantages, old_logprobs, behavior, ref_logprobs, gaps, correction) -> dict[str, Any]:
        algo, idx = self.ctx.algorithm_cfg, mb.sample_index
        old = response_tensor(old_logprobs, idx, width) if old_logprobs is not None else None
        beh = response_tensor(behavior, idx, width) if behavior is not None else None
        # Without proximal log-probs yet, no token is known to be capped: the first pass counts them.
        loss_mask = behavior_loss_mask(mb.response_mask, old, beh, correction) if old is not None \
            else mb.response_mask != 0
        return {
            "mask": mb.response_mask,
            "adv": response_tensor(advantages, idx, width),
            "old": old,
            "behavior": beh,
            "ref": response_tensor(ref_logprobs, idx, width) if ref_logprobs is not None else None,
            "gaps": response_tensor(gaps, idx, width, dtype=torch.long) if gaps is not None else None,
            "pg_denom": denominator(loss_mask, algo.loss_agg),
        }

    # ------------------------------------------------------------------ export / checkpoint

    def export_hf_tensors(self):
        return self.runner.export_hf_tensors()

    def checkpoint_parts(self) -> tuple[list[torch.nn.Module], Any, Any]:
        return self.runner.chunks, self.optim.optimizer, self.optim.schedule

    def state(self) -> dict[str, float]:
        return {
            "actor/applied_steps": float(self.optim.applied_steps),
            "actor/skipped_steps": float(self.optim.skipped_steps),
            "actor/lr": self.optim.schedule.lr,
        }


def _batch_mismatch(inputs: list[dict[str, Any]]) -> dict[str, float]:
    """The whole batch's mismatch metrics from each micro-batch's sums, over every DP rank (a collective
    of the last stage's DP group: every rank calls it, with zeros where it saw no behaviour log-probs)."""
    total = combine_mismatch_sums([x["mismatch"] for x in inputs if x.get("mismatch") is not None])
    peak = dp_all_reduce(total[:, MAX_COLUMN].clone(), "max")
    total = dp_all_reduce(total, "sum")
    total[:, MAX_COLUMN] = peak.to(total.device)
    return mismatch_metrics(total.cpu())


def _on_device(x: dict[str, Any], dev: torch.device) -> dict[str, Any]:
    """A micro-batch's per-token inputs on the model's device (moved once, reused by every epoch)."""
    if x.get("_device") != dev:
        for k, v in list(x.items()):
            if isinstance(v, torch.Tensor):
                x[k] = _to_device(v, dev)
        x["_device"] = dev
    return x


def _reduce_micro_metrics(outs: list[dict[str, Any]]) -> dict[str, float]:
    """Loss shares are summed over micro-batches; every other metric is averaged.

    Metrics may be 0-d device tensors: they are stacked and read with one transfer."""
    if not outs:
        return {}
    summed = ("actor/pg_loss", "actor/kl_loss_share", "actor/loss", "critic/vf_loss", "critic/loss")
    keys = sorted({k for o in outs for k in o if k != "mb"})
    pairs = [(k, o[k]) for k in keys for o in outs if k in o]
    tensors = [v for _, v in pairs if isinstance(v, torch.Tensor)]
    if tensors:
        read = iter(torch.stack([t.detach().float().reshape(()) for t in tensors]).tolist())
        pairs = [(k, next(read) if isinstance(v, torch.Tensor) else float(v)) for k, v in pairs]
    res = {}
    for k in keys:
        vals = [float(v) for kk, v in pairs if kk == k]
        res[k] = sum(vals) if k in summed else sum(vals) / len(vals)
    return res
