"""Sample builders shared by the buffer tests."""

from __future__ import annotations

from asyncrl.types import Sample, SampleStatus


def make_group(
    group_id: int,
    rewards: list[float],
    *,
    version: int = 0,
    versions: list[list[int]] | None = None,
    statuses: list[SampleStatus] | None = None,
) -> list[Sample]:
    """One GRPO group; every response has 2 tokens produced by `version` unless `versions` says."""
    out = []
    for i, r in enumerate(rewards):
        vs = versions[i] if versions is not None else [version, version]
        out.append(
            Sample(
                prompt_ids=[1, 2],
                response_ids=[3 + i] * len(vs),
                behavior_logprobs=[-0.5] * len(vs),
                versions=list(vs),
                reward=r,
                group_id=group_id,
                prompt_index=group_id,
                status=statuses[i] if statuses is not None else SampleStatus.VALID,
            )
        )
    return out
