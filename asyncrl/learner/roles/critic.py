"""The critic role: per-token values from a scalar head on the policy backbone, and its updates.

Owns: `compute_values` (V at the column that predicts each response token, i.e. the value of the
state before that token: see `asyncrl.learner.batching`) and `update_critic` (clipped value loss
from `asyncrl.algorithms.value_loss`, gradient-accumulated exactly like the actor's, guarded step).

Must never: export weights to the engines (a critic is not a policy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from asyncrl.algorithms import value_loss
from asyncrl.learner.batching import MicroBatch, response_tensor, unpad_response
from asyncrl.learner.offload import Offloader
from asyncrl.learner.roles.accumulate import denominator, dp_mean, dp_size, dp_sum
from asyncrl.learner.roles.actor import PerToken, _on_device, _reduce_micro_metrics, _width
from asyncrl.learner.roles.base import ModelRunner, RoleContext
from asyncrl.learner.roles.optim import GuardedOptimizer, warm_up_update
from asyncrl.types import Sample


def scalar_outputs(runner: ModelRunner, samples: Sequence[Sample], pick) -> list[dict[str, Any]]:
    """Forward-only pass of a scalar-head model; `pick(output, mb)` extracts what to keep."""
    mbs = runner.micro_batches(samples, _width(samples))

    def loss_fn(mb: MicroBatch, output: torch.Tensor):
        return output.sum() * 0.0, {"mb": mb, "value": pick(output, mb)}

    with torch.no_grad():
        return runner.run(mbs, loss_fn, forward_only=True)


class CriticRole:
    offload_key = "critic"

    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx
        self.runner = ModelRunner(ctx, head="scalar", trainable=True)
        self.optim = GuardedOptimizer(self.runner.chunks, ctx.learner_cfg, ctx.model_cfg.dtype)
        self.offloader = Offloader(self.runner.chunks, self.optim.optimizer, ctx.learner_cfg.critic)

    def compute_values(self, samples: Sequence[Sample]) -> dict[str, PerToken] | None:
        with self.offloader.onloaded():
            outs = scalar_outputs(self.runner, samples, self.runner.token_scalars)
        if not outs or self.runner.tp_rank != 0:
            return None
        lengths = [len(s.response_ids) for s in samples]
        values: PerToken = [[] for _ in samples]
        for o in outs:
            idx = o["mb"].sample_index
            for i, row in zip(idx, unpad_response(o["value"], [lengths[i] for i in idx])):
                values[i] = row
        return {"values": values}

    def warm_up(self, samples: Sequence[Sample]) -> dict[str, float]:
        """Before the first update: its kernels, activations and optimizer state (`warm_up_update`)."""
        return warm_up_update(self.runner, self.optim, self.offloader, samples,
                              lambda mb, output: self.runner.token_scalars(output, mb).sum() * 0.0)

    def update_critic(self, samples: Sequence[Sample], returns: PerToken, old_values: PerToken) -> dict[str, float]:
        algo, cfg = self.ctx.algorithm_cfg, self.ctx.learner_cfg
        width = _width(samples)
        mbs = self.runner.micro_batches(samples, width)
        d_all = dp_sum([sum(denominator(mb.response_mask, algo.loss_agg) for mb in mbs)])[0]
        scale_back = len(mbs) * dp_size()
        dev = self.runner.device()
        inputs = {
            id(mb): {"old": response_tensor(old_values, mb.sample_index, width),
                     "returns": response_tensor(returns, mb.sample_index, width), "mask": mb.response_mask}
            for mb in mbs
        }

        def loss_fn(mb: MicroBatch, output: torch.Tensor):
            x = _on_device(inputs[id(mb)], dev)
            v = self.runner.token_scalars(output, mb)
            loss, metrics = value_loss(
                v, x["old"], x["returns"], x["mask"], clip=algo.value_clip, agg=algo.loss_agg, lazy_metrics=True,
            )
            share = loss * (denominator(mb.response_mask, algo.loss_agg) / max(d_all, 1.0))
            metrics["critic/vf_loss"] = share.detach()
            return share * scale_back, metrics

        out: dict[str, float] = {}
        with self.offloader.onloaded():
            for epoch in range(cfg.ppo_epochs):
                self.optim.zero_grad()
                metrics = _reduce_micro_metrics(self.runner.run(mbs, loss_fn, forward_only=False))
                if metrics:
                    metrics = dp_mean(metrics)
                    metrics["critic/vf_loss"] *= dp_size()
                vf = metrics.get("critic/vf_loss", 0.0)
                step = self.optim.step(loss_finite=bool(torch.isfinite(torch.tensor(vf))))
                metrics.update({"critic/grad_norm": step["grad_norm"], "critic/lr": step["lr"]})
                out = metrics if epoch == 0 else {k: out.get(k, 0.0) + v for k, v in metrics.items()}
        if cfg.ppo_epochs > 1:
            out = {k: v / cfg.ppo_epochs for k, v in out.items()}
        out["critic/skipped_steps"] = float(self.optim.skipped_steps)
        return out

    def checkpoint_parts(self) -> tuple[list[torch.nn.Module], Any, Any]:
        return self.runner.chunks, self.optim.optimizer, self.optim.schedule

    def state(self) -> dict[str, float]:
        return {"critic/applied_steps": float(self.optim.applied_steps), "critic/skipped_steps": float(self.optim.skipped_steps)}
