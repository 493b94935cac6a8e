"""The reward-model role: one score per sequence, the scalar head's output at its last token.

Owns: `compute_rm_score`. The backbone is loaded from `model.path`; the score head from the
checkpoint's `score.weight` / `score.bias` (an HF *ForSequenceClassification with num_labels 1, as
`asyncrl demo-reward-model` builds), else from a seeded random init (`reward.kind: model` refuses
such a checkpoint before it starts: see RewardModelConfig).

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
