"""The reference role: the frozen initial policy's log-probs (for the KL term or KL-in-reward).

Owns: one untrained LM of this rank and `compute_ref_log_prob`. No optimizer, no DDP, no grads.
With `learner.reference.param_offload` its params sit on the host between calls (a no-op on a
CPU-only machine, where the host is the device).

Must never: change its weights after load (the KL anchor must not drift).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncrl.learner.offload import Offloader
from asyncrl.learner.roles.actor import PerToken, compute_token_logprobs
from asyncrl.learner.roles.base import ModelRunner, RoleContext
from asyncrl.types import Sample


class ReferenceRole:
    offload_key = "reference"

    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx
        self.runner = ModelRunner(ctx, head="lm", trainable=False)
        for p in self.runner.parameters():
            p.requires_grad_(False)
        self.offloader = Offloader(self.runner.chunks, None, ctx.learner_cfg.reference)
        if self.offloader.enabled:
            self.offloader.offload()

    def compute_ref_log_prob(self, samples: Sequence[Sample]) -> dict[str, PerToken] | None:
        with self.offloader.onloaded():
            return compute_token_logprobs(self.runner, samples, with_entropy=False)

    def export_hf_tensors(self):
        return self.runner.export_hf_tensors()

    def checkpoint_parts(self) -> tuple[list[torch.nn.Module], None, None]:
        return self.runner.chunks, None, None

    def state(self) -> dict[str, float]:
        return {}
