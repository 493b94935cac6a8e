"""What an engine replica asks of its engine: one interface, one implementation per engine.

Owns: `EngineDriver`, every call the replica (engine.py, engine_update.py) and its version
sources (version_source.py) make into the engine it runs, and `start_driver`, which imports the
driver that `generator.engine` names, lazily. The replica keeps the verbs, the state machine, the
counters and the version bookkeeping; a driver keeps the engine. `vllm_engine.VllmDriver` is the
vLLM one, `sglang_engine.SglangDriver` SGLang's (docs/design/sglang-engine.md).

Must never: import an engine at module import time (a vLLM replica never imports SGLang, and the
reverse: their pins clash), or hold replica state (versions, counters, pause holders).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from asyncrl.config import ConfigError, GeneratorConfig, ModelConfig
from asyncrl.types import SamplingParams


class EngineDriver(Protocol):
    """One running engine. Outputs are objects with `outputs`, a list of sequences, each with
    `index`, `token_ids` (new since the last output), `finish_reason`, `stop_reason`, `text` and
    what `read` takes the log-probs from; a finished sequence may carry `weight_versions` spans."""

    name: str  # "vllm", ...
    vocab_size: int
    stamps_versions: bool  # the engine labels every token with the weight version that made it

    # ---- generation ----------------------------------------------------------------------
    def prepare(self, sampling: SamplingParams, *, stream: bool) -> Any:
        """The engine's request for a validated `sampling` (`stream`: an output per step, else one
        at the end), carrying how its outputs are read."""

    def outputs(self, engine_id: str, prompt_ids: list[int], prepared: Any,
                handed_over: Callable[[], None]) -> AsyncIterator[Any]:
        """The request's outputs until it finishes; `handed_over()` the moment the engine holds it.
        Closed early or cancelled, the request is aborted in the engine."""

    def read(self, sequence: Any, new: list[int], prepared: Any) -> tuple[list[float] | None, str]:
        """The sampled tokens' log-probs (None: not asked) and the text of one sequence's output."""

    def routes(self, sequence: Any) -> bytes | None:
        """A finished MoE sequence's routed experts in Sample.routes' form, where the engine returns them (else None)."""

    # ---- scheduling: pause, sleep ---------------------------------------------------------
    async def pause(self, mode: str) -> None:
        """Stop stepping (`mode`: keep / wait / abort the requests in flight), dropping cached
        prefixes so that none computed on old weights survives a commit."""

    async def preempt(self) -> None:
        """Stop stepping, keeping the requests but dropping their KV (before a sleep)."""

    async def hold(self) -> None:
        """Stop stepping, keeping requests and caches (awake, but held)."""

    async def run(self) -> None:
        """Step again."""

    def sleep_unsupported(self) -> str | None:
        """Why this engine cannot sleep (None: it can)."""

    async def sleep(self, level: int) -> None:
        """Release memory (1: weights offloaded, KV dropped; 2: both dropped), keeping requests."""

    async def wake(self, tags: list[str]) -> None:
        """Take back the memory of `tags` (asyncrl.generator.replica_types.SLEEP_TAGS, in order)."""

    # ---- weights -------------------------------------------------------------------------
    async def worker_call(self, verb: str, args: tuple, timeout: float | None) -> list[Any]:
        """Run the `WorkerAPI` verb named `verb` on every worker that holds weights; one answer each."""

    async def relabel(self, version: int) -> None:
        """Tell the engine the live weight version (a no-op where it does not stamp tokens)."""

    async def reset_prefix_cache(self) -> None: ...

    # ---- reads for the version sources and stats ------------------------------------------
    def live_version_starts(self, engine_id: str) -> dict[int, list[tuple[str, int]]]: ...

    def frontend_sequences(self, engine_id: str) -> dict[int, str]: ...

    def frontend_token_counts(self) -> dict[str, int]: ...

    def unfinished_requests(self) -> int: ...

    def tokens_in_flight(self) -> int: ...

    def dead(self) -> str | None:
        """Why the engine is dead (None: alive)."""

    def shutdown(self) -> None: ...


def start_driver(model: ModelConfig, gen: GeneratorConfig) -> EngineDriver:
    """Start the engine `gen.engine` names and return its driver (blocking: the engine's start)."""
    if gen.engine == "vllm":
        from asyncrl.generator.vllm_engine import VllmDriver

        return VllmDriver.start(model, gen)
    if gen.engine == "sglang":
        from asyncrl.generator.sglang_engine import SglangDriver

        return SglangDriver.start(model, gen)
    raise ConfigError(f"generator.engine={gen.engine!r} has no driver in this build")
