"""The typed interfaces of asyncrl's remote components, and the one way to name their verbs.

Owns: `EngineAPI` (every verb of an engine replica), `WorkerAPI` (of one vLLM worker process), `LearnerRankAPI` (of
a learner rank actor), `RoleAPI` (the role verbs a rank runs for its group) and `verb_name`, which turns a verb
given by method reference (`EngineAPI.pause`) into the name a Ray or Serve handle needs.
Why: a verb named by reference fails where it is written when the interface lacks it, and renames with it; names
are strings only where a library requires them, in the adapter to that library (vLLM's `collective_rpc`).
Must never: import a component (this module is imported by all of them), or hold behaviour.
Details: docs/design/interfaces.md, "The typed interfaces".
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from asyncrl.types import (
    ApplyReport,
    CommitReport,
    CompletionDelta,
    GenerationRequest,
    GenerationResult,
    GroupsReport,
    HostCopies,
    LayoutCheck,
    LoadReport,
    PlanAck,
    PlanRequest,
    ReceiveReport,
    SenderAddress,
    SyncReport,
    UpdateAck,
    UpdateBegin,
    WeightExport,
)


def api_verbs(api: type) -> list[str]:
    """Every verb `api` declares, in declaration order."""
    return [n for n, v in vars(api).items() if callable(v) and not n.startswith("_")]


class EngineAPI(Protocol):
    """One engine replica. Every control verb answers with the replica's `replica_id` (a `ReplicaAnswer`, or a
    dict holding it)."""

    # ---- generation (routed to one replica by Serve)
    async def generate(self, request: GenerationRequest) -> GenerationResult: ...

    def generate_stream(self, request: GenerationRequest) -> AsyncIterator[list[CompletionDelta]]: ...

    async def check_health(self) -> None: ...

    # ---- control (fanned out to every replica by EngineControl)
    async def pause(self, mode: str = "keep") -> dict[str, Any]:
        """Stop scheduling: "abort" drops running requests, "wait" lets them finish, "keep" keeps
        them (their KV recomputed on resume); caches are cleared."""

    async def resume(self) -> dict[str, Any]: ...

    async def load_bucket(self, named_tensors: Any, version: int, begin: UpdateBegin) -> LoadReport:
        """Stage the whole of `version` (its buckets, or the senders' broadcast); `begin` starts the update (see
        weightsync/sources.py for the update contract)."""

    async def commit_update(self, version: int, fingerprint: str) -> CommitReport: ...

    async def abort_update(self) -> UpdateAck: ...

    async def set_push_plan(self, request: PlanRequest | None) -> PlanAck:
        """Form the push plan for the learner's export from the workers' layouts and hold it (None: pushes
        reload); answers the plan, which every replica of one engine kind forms alike."""

    async def join_collective(self, specs: list[dict[str, Any]] | None = None, timeout_s: float = 120.0) -> GroupsReport:
        """Join the broadcast groups `specs` (None: none); answers the replica's workers and the groups all hold."""

    async def sync_from_source(self) -> SyncReport: ...

    async def sleep(self, level: int = 1) -> dict[str, Any]: ...

    async def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]: ...

    async def stats(self) -> dict[str, Any]: ...


# Written by hand in the Serve deployment: generation (Serve routes it to one replica) and Serve's
# own health check.
_ENGINE_SERVING_VERBS = ("generate", "generate_stream", "check_health")
# Every other verb is a control verb: EngineControl may fan it out, and the Serve deployment forwards
# it, tagging a failure with the replica id. A verb added to EngineAPI is one of them at once.
ENGINE_CONTROL_VERBS = tuple(getattr(EngineAPI, n) for n in api_verbs(EngineAPI) if n not in _ENGINE_SERVING_VERBS)
# What EngineControl may fan out: the control verbs and Serve's health check.
ENGINE_BROADCAST_VERBS = (*ENGINE_CONTROL_VERBS, EngineAPI.check_health)


class WorkerAPI(Protocol):
    """The asyncrl verbs of one vLLM worker process (generator/worker_ext.py's `WeightUpdateExtension`, mixed into
    the worker: weightsync's worker_verbs.py and the generator's sampled-token counts). The replica reaches every worker
    at once through vLLM's `collective_rpc`, which wants a method name: `WeightUpdates.rpc`
    (generator/engine_update.py) is the one place that turns a verb into it."""

    def asyncrl_layout(self, manifest: bytes | None = None) -> LayoutCheck:
        """The start-time layout check (no `manifest`), or its answer and this worker's layout for `manifest`."""

    def asyncrl_receive(self, version: int, wires: list[tuple] | None, groups: list[str] | None = None,
                        timeout_s: float = 0.0, gate: str = "", begin: list[Any] | None = None) -> ReceiveReport:
        """An update (`begin`: verify, layout, push plan id) staged whole, in one call: the buckets of shared files
        (`wires`), or every bucket from `groups` (gate: gloo / NCCL); the staged digests."""

    def asyncrl_apply(self, version: int, before: str = "") -> ApplyReport:
        """The apply of the staged version; `before` (the name of a verb of this interface without
        arguments) runs first, in the same round trip, and answers in the report's `before`."""

    def asyncrl_abort_update(self, group_ids: list[str] | None = None, why: str = "", gate: str = "") -> None:
        """Drop what is staged and the receive buffers kept from one push to the next (also before the engine
        sleeps); with `group_ids` (a load that failed before its receive), refuse the coming push on those groups
        too, so that its other members stop at once. `gate`: the push's gate token (gloo / NCCL)."""

    def asyncrl_join_collective(self, replica_id: str, specs: list[dict[str, Any]] | None = None) -> list[str]:
        """Join the groups `specs` (None: stay); answers the ids of the groups this worker is ready for."""

    def asyncrl_sampled_token_counts(self) -> dict[str, int] | None:
        """Tokens sampled so far per sequence this worker holds (read while paused)."""


class RoleAPI(Protocol):
    """What a learner rank runs on its role for the group's compute dispatch. A role implements the
    verbs of its kind (actor: log-probs and its update; critic: values and its update; reference:
    reference log-probs; reward model: scores); the others are refused by the rank."""

    def compute_log_prob(self, samples: list[Any]) -> dict[str, Any] | None: ...

    def compute_ref_log_prob(self, samples: list[Any]) -> dict[str, Any] | None: ...

    def compute_values(self, samples: list[Any]) -> dict[str, Any] | None: ...

    def compute_rm_score(self, samples: list[Any]) -> dict[str, Any] | None: ...

    def update_actor(self, samples: list[Any], advantages: Any, old_logprobs: Any, ref_logprobs: Any,
                     version_gaps: Any = None) -> dict[str, Any] | None: ...

    def update_critic(self, samples: list[Any], returns: Any, old_values: Any) -> dict[str, Any] | None: ...

    def warm_up(self, samples: list[Any]) -> dict[str, Any] | None:
        """A trainable role, before its first update: one zero-loss pass over `samples`' first micro-batch
        and its optimizer's state made, changing nothing the update reads."""

    def state(self) -> dict[str, Any]: ...


ROLE_VERBS = tuple(getattr(RoleAPI, n) for n in api_verbs(RoleAPI))
ROLE_TRAINING_VERBS = (RoleAPI.update_actor, RoleAPI.update_critic)  # run inside the profiler's step


class LearnerRankAPI(Protocol):
    """One learner rank actor (`learner/rank.py`'s `LearnerRank`), as its group calls it."""

    def master_address(self, timeout_s: float = 600.0) -> tuple[str, int]: ...

    def setup(self, master_addr: str, master_port: int, timeout_s: float = 600.0) -> dict[str, Any]: ...

    def call(self, verb: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run the role verb `verb` (a member of ROLE_VERBS) on this rank's role."""

    def set_push_plan(self, plan: bytes | None, host_copies: bool = False) -> str | None: ...

    def export_weights(self, bucket_mb: float, transport: str = "object_store", verify: str = "full", layout: str = "hf",
                       timeout_s: float = 600.0, gate: str = "") -> WeightExport | None:
        """One version packed into host buckets (shm, object_store) or broadcast to the engine workers (nccl,
        gloo, ipc) by a sending rank; None from the others."""

    def join_collective(self, specs: list[dict[str, Any]] | None = None) -> SenderAddress | None:
        """A sending rank joins its group of `specs` (None: holds a port for the next); where it stands after."""

    def take_host_copies(self, timeout_s: float) -> HostCopies | None: ...

    def hold_device(self, parts: list[str] | None = None) -> dict[str, Any]: ...

    def release_device(self, parts: list[str] | None = None, wake_need: tuple[float, int] | None = None) -> dict[str, Any]: ...

    def save_checkpoint(self, path: str) -> str: ...

    def load_checkpoint(self, path: str) -> dict[str, Any]: ...

    def state(self) -> dict[str, Any]: ...


def verb_name(api: type, verb: Callable[..., Any], among: tuple[Callable[..., Any], ...] | None = None) -> str:
    """The name under which `verb`, a method of the interface `api` given by reference (e.g.
    `EngineAPI.pause`), is called on a remote handle. Raises TypeError for a string, for a function
    that is not `api`'s own, or for one outside `among` when given."""
    name = getattr(verb, "__name__", None)
    if not callable(verb) or not isinstance(name, str) or getattr(api, name, None) is not verb:
        raise TypeError(f"{verb!r} is not a verb of {api.__name__}: name a remote verb by reference, "
                        f"e.g. {api.__name__}.{next(iter(api_verbs(api)), 'verb')}")
    if among is not None and verb not in among:
        raise TypeError(f"{api.__name__}.{name} may not be called here; allowed: "
                        f"{sorted(v.__name__ for v in among)}")
    return name

