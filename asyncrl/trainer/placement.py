"""Where the learner and the engines run between learner steps: separated, or co-located (hybrid).

Owns: the phase switch around each learner step. `Separated` switches nothing; `Colocation` is a state machine:
GENERATING -to_learner-> LEARNING (engines asleep) -to_engines(publish)-> SYNCING (engine weights awake, KV still
released) -> GENERATING. Wake order is weights first, then KV cache: the push needs engine weights and learner
params on the device together, never the KV cache as well. With `hybrid.learner_offload: when_short` each rank
keeps its state on its device where the engines' wake fits beside it, decided at the switch to the engines.
Must never: decide the order of a training step (trainer/loop.py), reach into engine or learner internals (it calls
the generator's sleep / wake_up and the learner groups' hold / release only), or leave engines asleep after a failed
push (the wake runs in `finally`).
Details: docs/design/trainer.md, "Placement".
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from asyncrl.config import HybridConfig
from asyncrl.interfaces import EngineAPI

Publish = Callable[[], Awaitable[dict[str, float]]]
GIB = float(2**30)


class HybridError(RuntimeError):
    """Co-located placement cannot work with these engines or was driven out of order."""


class Engines(Protocol):
    """What placement needs of the engine deployment (`asyncrl.generator.control.EngineControl`)."""

    async def call(self, verb: Callable[..., Any], *args: Any, timeout_s: float | None = 120.0) -> dict[str, Any]: ...

    async def wait_ready(self, timeout_s: float = 600.0) -> dict[str, Any]: ...


class Learners(Protocol):
    """What placement needs of a learner group (`asyncrl.learner.group.LearnerGroup`)."""

    async def hold_device(self, parts: Sequence[str] | None = None) -> list[dict[str, Any]]: ...

    async def release_device(self, parts: Sequence[str] | None = None,
                             wake_need: tuple[float, int] | None = None) -> list[dict[str, Any]]: ...


class Separated:
    """Learner and engines on their own devices: nothing to switch."""

    async def start(self) -> None:
        return None

    async def warm_up(self, run: Callable[[], Awaitable[Any]],
                      prepare_push: Callable[[], Awaitable[Any]] | None = None) -> Any:
        return await run()  # (weightsync formed its groups at its start: nothing shares the devices)

    async def to_learner(self) -> dict[str, float]:
        return {}

    async def to_engines(self, publish: Publish) -> dict[str, float]:
        return await publish()


class Phase(enum.Enum):
    GENERATING = "generating"
    LEARNING = "learning"
    SYNCING = "syncing"


class Colocation:
    """Hybrid placement over the engine deployment and the learner groups; `exporter` is the
    group whose params the push reads (the actor), `others` (reference, critic) only compute."""

    def __init__(self, cfg: HybridConfig, engines: Engines, exporter: Learners, others: Sequence[Learners] = (),
                 clock: Callable[[], float] = time.perf_counter, engine_memory_fraction: float = 0.9) -> None:
        self.cfg, self.engines, self.exporter, self.others = cfg, engines, exporter, list(others)
        # when_short: what must stay free beside the learner's state for the engines' wake
        self.wake_need = ((engine_memory_fraction, int(cfg.wake_headroom_gib * GIB))
                          if cfg.learner_offload == "when_short" else None)
        self.clock = clock
        self.phase = Phase.GENERATING
        self.switches = 0

    @property
    def _groups(self) -> list[Learners]:
        return [self.exporter, *self.others]

    async def _engines(self, verb: Callable[..., Any], *args: Any) -> dict[str, Any]:
        return await self.engines.call(verb, *args, timeout_s=self.cfg.timeout_s)

    @staticmethod
    async def _each(op: Callable[[Learners], Awaitable[list[dict[str, Any]]]], groups: Sequence[Learners]) -> list[dict[str, Any]]:
        answers = await asyncio.gather(*(op(g) for g in groups))
        return [a for per_group in answers for a in per_group]

    async def start(self) -> None:
        """Refuse engines that cannot sleep; put the learner's state away (it starts resident)."""
        stats = await self.engines.wait_ready(timeout_s=max(600.0, self.cfg.timeout_s))
        unable = {rid: s.get("sleep_unsupported") for rid, s in stats.items() if s.get("sleep_unsupported")}
        if unable or not stats:
            detail = "; ".join(f"{rid}: {why}" for rid, why in sorted(unable.items())) or "no running engine replica"
            raise HybridError(f"hybrid placement needs engines that can sleep: {detail}")
        await self._each(lambda g: g.hold_device(), self._groups)  # brings nothing back: nothing is away yet
        await self._each(lambda g: g.release_device(), self._groups)  # the last hold gone: flagged state to host

    async def warm_up(self, run: Callable[[], Awaitable[Any]],
                      prepare_push: Callable[[], Awaitable[Any]] | None = None) -> Any:
        """Before the first step: `run` (the learners' warm-up) with the engines asleep at level 1 (their weights
        kept in host memory: version 0 needs no push after it) and the learner's state on its devices; then, if
        given, `prepare_push` (weightsync's groups formed) with the memory as `to_engines` has it when it pushes:
        the exporter's params alone held, the engines' weights awake. Then the state put away as `start` leaves it
        and the engines wholly awake, even when `run` or `prepare_push` fails."""
        self._expect(Phase.GENERATING, "warm_up")
        await self._engines(EngineAPI.sleep, 1)
        awake: list[str] = []
        try:
            await self._each(lambda g: g.hold_device(), self._groups)
            try:
                result = await run()
            except BaseException:
                await self._each(lambda g: g.release_device(), self._groups)
                raise
            if prepare_push is None:
                await self._each(lambda g: g.release_device(), self._groups)
                return result
            need = {} if self.wake_need is None else {"wake_need": self.wake_need}
            try:
                await asyncio.gather(self.exporter.release_device(["grads", "optimizer"], **need),
                                     self._each(lambda g: g.release_device(**need), self.others))
                await self._engines(EngineAPI.wake_up, ["weights"])
                awake.append("weights")
                await prepare_push()
            finally:
                await self.exporter.release_device(["params"])
            return result
        finally:
            await self._engines(EngineAPI.wake_up, [t for t in ("weights", "kv_cache") if t not in awake])

    async def to_learner(self) -> dict[str, float]:
        """Engines sleep (their running requests preempted, kept), then the learner's state comes to its device."""
        self._expect(Phase.GENERATING, "to_learner")
        t0 = self.clock()
        await self._engines(EngineAPI.sleep, self.cfg.engine_sleep_level)
        t1 = self.clock()
        held = await self._each(lambda g: g.hold_device(), self._groups)
        self.phase = Phase.LEARNING
        metrics = {"hybrid/engine_sleep_s": t1 - t0, "hybrid/learner_onload_s": self.clock() - t1}
        if held:  # what the learner has to itself on its devices while it trains
            metrics["hybrid/device_free_gib_learning"] = min(a["device_free_bytes"] for a in held) / GIB
        return metrics

    async def to_engines(self, publish: Publish) -> dict[str, float]:
        """The learner puts away all but the actor's params, engine weights wake, `publish()` pushes
        the new version, the params go to host, the KV cache wakes and the engines run again. Each
        part's seconds are a metric (`hybrid/learner_release_s`, `weights_wake_s`, `params_release_s`,
        `kv_wake_s`); `hybrid/engine_wake_s` is their sum, the switch around the push."""
        self._expect(Phase.LEARNING, "to_engines")
        t0 = self.clock()
        metrics: dict[str, float] = {}
        parts: dict[str, float] = {}
        mine: list[dict] = []
        theirs: list[dict] = []
        try:
            need = {} if self.wake_need is None else {"wake_need": self.wake_need}
            mine, theirs = await asyncio.gather(self.exporter.release_device(["grads", "optimizer"], **need),
                                                self._each(lambda g: g.release_device(**need), self.others))
            released_at = self.clock()
            parts["learner_release_s"] = released_at - t0
            kept = [r["learner/state_kept"] for a in (*mine, *theirs) if "learner/state_kept" in (r := a.get("report") or {})]
            if kept:  # 1: every rank's flagged state stayed on its device (when_short found room)
                metrics["hybrid/learner_state_kept"] = min(kept)
            await self._engines(EngineAPI.wake_up, ["weights"])
            self.phase = Phase.SYNCING
            parts["weights_wake_s"] = self.clock() - released_at
            metrics |= await publish()
        finally:
            t2 = self.clock()
            released = await self.exporter.release_device(["params"])
            t3 = self.clock()
            await self._engines(EngineAPI.wake_up, ["kv_cache"])
            parts |= {"params_release_s": t3 - t2, "kv_wake_s": self.clock() - t3}
            self.phase = Phase.GENERATING
            self.switches += 1
        metrics |= {f"hybrid/{k}": v for k, v in parts.items()}
        metrics |= {"hybrid/engine_wake_s": sum(parts.values()), "hybrid/switches": float(self.switches)}
        if released:
            metrics["hybrid/device_free_gib_learner_away"] = min(a["device_free_bytes"] for a in released) / GIB
        # what left the devices at this switch, all ranks (when_short moves only the bytes short)
        metrics["hybrid/learner_released_gib"] = sum((a.get("report") or {}).get("learner/released_bytes", 0.0)
                                                     for a in (*mine, *theirs, *(released or []))) / GIB
        return metrics

    def _expect(self, phase: Phase, step: str) -> None:
        if self.phase is not phase:
            raise HybridError(f"hybrid placement: {step} in phase {self.phase.value}, expected {phase.value}")


def build_placement(cfg: HybridConfig, engines: Engines, actor: Learners, others: Sequence[Learners | None],
                    engine_memory_fraction: float = 0.9) -> Colocation | Separated:
    """`engine_memory_fraction`: the engines' gpu_memory_utilization (vLLM's default 0.9), their share of a
    device awake, which `learner_offload: when_short` keeps free beside the learner's state."""
    if cfg.enabled == "auto":
        raise ValueError("hybrid.enabled='auto' is decided when the app starts (asyncrl.app.build_app -> "
                         "asyncrl.trainer.placement_choice.resolve_placement); resolve the config first")
    if not cfg.enabled:
        return Separated()
    return Colocation(cfg, engines, actor, [g for g in others if g is not None], engine_memory_fraction=engine_memory_fraction)
