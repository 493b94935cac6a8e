"""The buffer component's logic: admission control and the replay buffer, kept consistent.

Owns: the glue between StalenessManager and ReplayBuffer: a pushed group consumes the running slots its rollout
reserved (kept samples become accepted, dropped ones are released), stale drops credit their slots back, and one
checkpoint holds both halves. A rollout: try_acquire(n, key) -> generate -> put_group(all n samples, key), or
release (cancelled, never counted) or abandon (given up on, counted dropped_failed); the key names the reservation.
With `overdue: wait` batches are drawn oldest first and a draw waits rather than leave a still-generating overdue
group to go stale (`_must_wait`); a reservation without a key is never waited for. A failed completion is pushed as
ABORTED (its group dropped invalid, all n slots released); put_group consumes exactly len(samples) running slots.
Must never: wait, block, or know about Ray or asyncio. The actor (actor.py) adds the waiting.
Details: docs/design/buffer.md, "The buffer core".
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
        self._tickets: dict[str, tuple[int, int]] = {}  # key -> (version admitted at, samples reserved)

    @property
    def version(self) -> int:
        return self.staleness.version

    # -- producers ------------------------------------------------------------------------------
    def try_acquire(self, n: int, key: str | None = None) -> bool:
        """Reserve n slots if the admission rule allows; `key` names the reservation (see the module doc)."""
        if key is not None:
            if not isinstance(key, str) or not key:
                raise TypeError(f"a reservation key is a non-empty str, got {type(key).__name__} {key!r:.40}")
            if key in self._tickets:
                raise ValueError(f"reservation key {key!r} is already held by a running rollout")
        if not self.staleness.try_acquire(n):
            return False
        if key is not None:
            self._tickets[key] = (self.version, n)
        return True

    def _ticket(self, key: str | None, n: int) -> None:
        """Check that `key` (if any) holds a reservation of n samples; changes nothing."""
        if key is None:
            return
        held = self._tickets.get(key)
        if held is None:
            raise ValueError(f"no running reservation has key {key!r}")
        if held[1] != n:
            raise ValueError(f"reservation {key!r} holds {held[1]} samples, not {n}")

    def release(self, n: int, key: str | None = None) -> None:
        """A reserved rollout of n samples ended without pushing them (failed, aborted, cancelled)."""
        self._ticket(key, n)
        self.staleness.on_rejected(n)
        self._tickets.pop(key, None)

    def abandon(self, n: int, key: str | None = None) -> None:
        """A reserved rollout of n samples was given up on (its generation failed or timed out on
        every attempt): its slots are released and its samples counted as dropped_failed."""
        self._ticket(key, n)
        self.staleness.on_rejected(n)  # validates n against the reserved slots first
        self.replay.abandon(n)
        self._tickets.pop(key, None)

    def check_put(self, samples: Sequence[Sample], key: str | None = None) -> None:
        """Raise for malformed input or a push without a reservation; changes nothing."""
        self.replay.validate_group(samples)
        if len(samples) > self.staleness.running:
            raise ValueError(
                f"put_group of {len(samples)} samples but only {self.staleness.running} slots are "
                f"reserved: acquire(n) before generating"
            )
        self._ticket(key, len(samples))

    def _may_be_waited_for(self, key: str | None) -> bool:
        """A keyed rollout a draw may wait for (`_must_wait`: admitted at <= v + (eta - 1) - eta, or at v when
        eta = 0)."""
        held = self._tickets.get(key) if key is not None else None
        eta = self.config.max_staleness
        return held is not None and held[0] <= self.version + max(eta - 1, 0) - eta

    def can_put(self, samples: Sequence[Sample], key: str | None = None) -> bool:
        """Whether put_group would succeed now (validates first). A group a draw may be waiting for always
        fits: back-pressure on it could otherwise never end (a capacity under (eta + 1) * B)."""
        self.check_put(samples, key)
        return (self.config.overdue == "wait" and self._may_be_waited_for(key)) or self.replay.has_room(samples)

    def put_group(self, samples: Sequence[Sample], key: str | None = None) -> PutResult:
        """Push a whole group; raises BufferFullError (changing nothing) when there is no room."""
        self.check_put(samples, key)
        force = self.config.overdue == "wait" and self._may_be_waited_for(key)
        held = self._tickets.get(key) if key is not None else None
        result = self.replay.put_group(samples, force=force, admitted=None if held is None else held[0], version=self.version)
        self.staleness.on_accepted(result.kept)
        self.staleness.on_rejected(len(samples) - result.kept)
        self._tickets.pop(key, None)
        return result

    def overdue(self) -> int:
        """Samples of running rollouts admitted at versions <= v - eta (keyed ones): what the next batch
        waits for at least, under `overdue: wait`."""
        floor = self.version - self.config.max_staleness
        return sum(n for version, n in self._tickets.values() if version <= floor)

    # -- learner --------------------------------------------------------------------------------
    def set_version(self, version: int) -> None:
        """The learner reached `version`: widen admission and drop what just became stale."""
        self.staleness.set_version(version)
        self._credit(self.replay.drop_stale(version, self.config.max_staleness))

    def get_batch(self) -> TrainBatch | None:
        """One batch of whole groups for the current version, oldest first, or None while none is ready
        (with `overdue: wait`, also while the batch would leave a slow group to go stale: `_must_wait`)."""
        before = self.replay.counts.dropped_stale
        n_groups = self.replay.plan_batch(self.config.batch_size, self.version, self.config.max_staleness)
        self._credit(self.replay.counts.dropped_stale - before)
        if n_groups is None or (self.config.overdue == "wait" and self._must_wait(n_groups)):
            return None
        return self.replay.take(n_groups, self.version)

    def _must_wait(self, n_groups: int) -> bool:
        """Whether drawing the planned batch now would leave some group unable to be trained in time, where
        waiting for keyed rollouts still generating would not. A sample admitted at version a must be trained
        by the draw at a + eta (its oldest token is >= a). For k = 0 .. eta - 1, the samples due by the draw at
        v + k (admitted at <= v + k - eta: running ones by their admission, waiting ones by their oldest token)
        and left after this batch must fit the k batches before it; where they do not and some of them are
        still running, the batch waits for those, which then go first (oldest first). Drawn this way from a
        state that admission keeps feasible, no group whose engine sampled it on its admission version or
        later is ever dropped stale (the property tests check it)."""
        v, eta, b = self.version, self.config.max_staleness, self.config.batch_size
        for k in range(eta):
            floor = v + k - eta
            running = sum(n for version, n in self._tickets.values() if version <= floor)
            if running and running + self.replay.waiting_at_most(floor, skip=n_groups) > k * b:
                return True
        return False

    def _credit(self, dropped: int) -> None:
        if dropped:
            self.staleness.on_dropped(dropped)

    # -- accounting and checkpoints -------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        return {**self.replay.metrics(), **self.staleness.metrics(), "buffer/overdue": float(self.overdue())}

    def state_dict(self) -> dict[str, Any]:
        return {"staleness": self.staleness.state(), "replay": self.replay.state_dict(),
                "tickets": [[k, v, n] for k, (v, n) in self._tickets.items()]}

    def load_state_dict(self, state: dict[str, Any], *, drop_running: bool = False) -> None:
        """Restore both halves. `drop_running` releases the slots of rollouts that were in flight
        when the state was saved: after a restart nobody will ever push or release them."""
        # "tickets" (the keyed reservations in flight) is absent from checkpoints made before it existed
        if not isinstance(state, dict) or not {"staleness", "replay"} <= set(state) <= {"staleness", "replay", "tickets"}:
            raise ValueError("buffer state must be a dict with keys 'staleness', 'replay' (and 'tickets')")
        stale_state = dict(state["staleness"]) if isinstance(state["staleness"], dict) else state["staleness"]
        if drop_running and isinstance(stale_state, dict) and isinstance(stale_state.get("running"), int):
            stale_state["rejected"] = stale_state.get("rejected", 0) + stale_state["running"]
            stale_state["running"] = 0
        # Load into fresh objects first so a corrupt half leaves the live buffer untouched.
        staleness = StalenessManager(self.config.batch_size, self.config.max_staleness)
        staleness.load_state(stale_state)
        replay = ReplayBuffer(self.config)
        replay.load_state_dict(state["replay"])
        tickets: dict[str, tuple[int, int]] = {}
        if not drop_running:
            try:
                for key, version, n in state.get("tickets", []):
                    if not isinstance(key, str) or not all(isinstance(x, int) and x >= 0 for x in (version, n)):
                        raise ValueError
                    tickets[key] = (version, n)
            except (TypeError, ValueError):
                raise ValueError(f"corrupt buffer state: tickets {str(state.get('tickets'))[:80]}") from None
            if sum(n for _, n in tickets.values()) > staleness.running:
                raise ValueError("corrupt buffer state: keyed reservations exceed the running slots")
        self.staleness, self.replay, self._tickets = staleness, replay, tickets
