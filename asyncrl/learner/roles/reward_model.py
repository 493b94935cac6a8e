"""The reward-model role: one score per sequence, the scalar head's output at its last token.

Owns: `compute_rm_score`. The backbone is loaded from `model.path`; the score head starts from a
seeded random init because the HF checkpoints handled by `convert.py` carry no score head (a
trained reward model's `score.weight` would be loaded here once convert.py maps it).

Must never: train (scores are targets) or export weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncrl.learner.roles.base import ModelRunner, RoleContext
from asyncrl.learner.roles.critic import scalar_outputs
from asyncrl.types import Sample


class RewardModelRole:
    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx
        self.runner = ModelRunner(ctx, head="scalar", trainable=False)
        for p in self.runner.parameters():
            p.requires_grad_(False)

    def compute_rm_score(self, samples: Sequence[Sample]) -> dict[str, list[float]] | None:
        outs = scalar_outputs(self.runner, samples, self.runner.last_token_scalars)
        if not outs or self.runner.tp_rank != 0:
            return None
        scores = [0.0] * len(samples)
        for o in outs:
            for i, v in zip(o["mb"].sample_index, o["value"].tolist()):
                scores[i] = float(v)
        return {"scores": scores}

    def checkpoint_parts(self) -> tuple[list[torch.nn.Module], None, None]:
        return self.runner.chunks, None, None

    def state(self) -> dict[str, float]:
        return {}
