"""The buffer component's logic: admission control and the replay buffer, kept consistent.

Owns: the glue between StalenessManager and ReplayBuffer: a pushed group consumes the running
slots its rollout reserved (kept samples become accepted, dropped ones are released), stale
drops credit their slots back, and one checkpoint holds both halves.
Must never: wait, block, or know about Ray or asyncio. The actor (actor.py) adds the waiting.

Protocol of one rollout (the controller's side):
    try_acquire(n)  ->  generate n completions  ->  put_group(all n samples)
                                                    (or release(n): cancelled, never counted;
                                                     or abandon(n): given up on, counted dropped_failed)
A group is pushed with every sample it reserved; a completion that failed is pushed with status
ABORTED (the group is then dropped as invalid and all n slots released). Pushing fewer samples
than reserved is not possible: put_group consumes exactly len(samples) running slots, and the
caller releases any others itself.
"""

from __future__ import annotations

from typing import Any, Sequence

from asyncrl.buffer.replay import ReplayBuffer
from asyncrl.buffer.staleness import StalenessManager
from asyncrl.config import BufferConfig
from asyncrl.types import PutResult, Sample, TrainBatch


class BufferCore:
    """StalenessManager + ReplayBuffer behind one interface. Not thread-safe: one owner calls it."""

    def __init__(self, config: BufferConfig) -> None:
        if not isinstance(config, BufferConfig):
            raise TypeError(f"config must be a BufferConfig, got {type(config).__name__}")
        self.config = config
        self.staleness = StalenessManager(config.batch_size, config.max_staleness)
        self.replay = ReplayBuffer(config)

    @property
    def version(self) -> int:
        return self.staleness.version

    # -- producers ------------------------------------------------------------------------------
    def try_acquire(self, n: int) -> bool:
        return self.staleness.try_acquire(n)

    def release(self, n: int) -> None:
        """A reserved rollout of n samples ended without pushing them (failed, aborted, cancelled)."""
        self.staleness.on_rejected(n)

    def abandon(self, n: int) -> None:
        """A reserved rollout of n samples was given up on (its generation failed or timed out on
        every attempt): its slots are released and its samples counted as dropped_failed."""
        self.staleness.on_rejected(n)  # validates n against the reserved slots first
        self.replay.abandon(n)

    def check_put(self, samples: Sequence[Sample]) -> None:
        """Raise for malformed input or a push without a reservation; changes nothing."""
        self.replay.validate_group(samples)
        if len(samples) > self.staleness.running:
            raise ValueError(
                f"put_group of {len(samples)} samples but only {self.staleness.running} slots are "
                f"reserved: acquire(n) before generating"
            )

    def can_put(self, samples: Sequence[Sample]) -> bool:
        """Whether put_group would succeed now (validates first)."""
        self.check_put(samples)
        return self.replay.has_room(samples)

    def put_group(self, samples: Sequence[Sample]) -> PutResult:
        """Push a whole group; raises BufferFullError (changing nothing) when there is no room."""
        self.check_put(samples)
        result = self.replay.put_group(samples)
        self.staleness.on_accepted(result.kept)
        self.staleness.on_rejected(len(samples) - result.kept)
        return result

    # -- learner --------------------------------------------------------------------------------
    def set_version(self, version: int) -> None:
        """The learner reached `version`: widen admission and drop what just became stale."""
        self.staleness.set_version(version)
        self._credit(self.replay.drop_stale(version, self.config.max_staleness))

    def get_batch(self) -> TrainBatch | None:
        """One batch of whole groups for the current version, or None while none is ready."""
        before = self.replay.counts.dropped_stale
        batch = self.replay.get_batch(self.config.batch_size, self.version, self.config.max_staleness)
        self._credit(self.replay.counts.dropped_stale - before)
        return batch

    def _credit(self, dropped: int) -> None:
        if dropped:
            self.staleness.on_dropped(dropped)

    # -- accounting and checkpoints -------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        return {**self.replay.metrics(), **self.staleness.metrics()}

    def state_dict(self) -> dict[str, Any]:
        return {"staleness": self.staleness.state(), "replay": self.replay.state_dict()}

    def load_state_dict(self, state: dict[str, Any], *, drop_running: bool = False) -> None:
        """Restore both halves. `drop_running` releases the slots of rollouts that were in flight
        when the state was saved: after a restart nobody will ever push or release them."""
        if not isinstance(state, dict) or set(state) != {"staleness", "replay"}:
            raise ValueError("buffer state must be a dict with keys 'staleness' and 'replay'")
        stale_state = dict(state["staleness"]) if isinstance(state["staleness"], dict) else state["staleness"]
        if drop_running and isinstance(stale_state, dict) and isinstance(stale_state.get("running"), int):
            stale_state["rejected"] = stale_state.get("rejected", 0) + stale_state["running"]
            stale_state["running"] = 0
        # Load into fresh objects first so a corrupt half leaves the live buffer untouched.
        staleness = StalenessManager(self.config.batch_size, self.config.max_staleness)
        staleness.load_state(stale_state)
        replay = ReplayBuffer(self.config)
        replay.load_state_dict(state["replay"])
        self.staleness, self.replay = staleness, replay
