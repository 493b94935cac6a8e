"""Every message that crosses a process boundary (Serve handle, Ray actor call, HTTP body).

Owns: the wire shape of generation requests/results, samples, training batches and weight
versions. Hot-path records are `msgspec.Struct`s (cheap to build, encode and pickle).

Must never: hold behaviour beyond tiny derived properties, import a component, or evaluate a
default at import time (mutable and time-based defaults use factories).
"""

from __future__ import annotations

import enum
import math
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec


def new_id() -> str:
    return uuid.uuid4().hex


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Sampling options of one generation request (validated by the gateway, then mapped to the engine's)."""

    n: int = 1  # completions per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = disabled
    max_tokens: int = 16  # completion tokens at most
    stop: list[str] = msgspec.field(default_factory=list)  # stop strings (not included in output)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    seed: int | None = None  # per-request seed for reproducible sampling
    logprobs: bool = True  # return the sampled token's log-prob per token
    ignore_eos: bool = False


class GenerationRequest(msgspec.Struct, kw_only=True):
    """Token-level generation request (the RL client's view)."""

    prompt_ids: list[int]  # already tokenized prompt
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    request_id: str = msgspec.field(default_factory=new_id)


class Completion(msgspec.Struct, kw_only=True):
    """One of the n completions of a request."""

    index: int  # position among the request's n completions
    token_ids: list[int]  # generated tokens (no prompt)
    logprobs: list[float]  # behaviour log-prob of each generated token (empty if not asked, or if the engine aborted it)
    versions: list[int]  # weight version that produced each token; same length as token_ids
    finish_reason: str | None  # "stop" | "length" | "abort" | None while streaming
    text: str = ""  # detokenized token_ids
    routes: bytes | None = None  # MoE: the experts each token was routed to, when asked (Sample.routes)

    @property
    def min_version(self) -> int:
        return min(self.versions) if self.versions else -1


class CompletionDelta(msgspec.Struct, kw_only=True):
    """New tokens of one completion, as streamed by an engine replica (added by the generator)."""

    request_id: str
    index: int  # which of the request's n completions
    token_ids: list[int]  # tokens new since the previous delta of this completion
    logprobs: list[float]  # their behaviour log-probs (empty if not asked)
    versions: list[int]  # weight version that produced each new token
    text: str = ""  # text new since the previous delta
    finish_reason: str | None = None  # set on the completion's last delta


class GenerationResult(msgspec.Struct, kw_only=True):
    """All completions of one request, as returned by an engine replica."""

    request_id: str
    prompt_ids: list[int]
    completions: list[Completion]
    replica_id: str = ""  # which engine replica served it

    @property
    def versions(self) -> list[int]:
        """Distinct weight versions that produced any token of this result, ascending."""
        return sorted({v for c in self.completions for v in c.versions})


class SampleStatus(enum.IntEnum):
    """Where a sample stands in the accounting identity."""

    VALID = 0
    INVALID_REWARD = 1  # reward fn timed out, raised, or returned None/NaN
    ABORTED = 2  # generation aborted (replica died, request cancelled), or an agent episode that failed
    SPLIT = 3  # an agent episode whose turns did not extend each other: never glued, never trained


class Sample(msgspec.Struct, kw_only=True):
    """One trajectory: a prompt, one completion, its reward and the versions that produced it."""

    prompt_ids: list[int]
    response_ids: list[int]
    behavior_logprobs: list[float]  # engine log-probs, len == len(response_ids)
    versions: list[int]  # per response token weight version
    reward: float  # scalar sequence reward (NaN only when status != VALID)
    group_id: int  # samples of one prompt (GRPO group) share it
    prompt_index: int = -1  # position of the prompt in the data stream (for exact resume)
    status: SampleStatus = SampleStatus.VALID
    finish_reason: str | None = None
    answer: str | None = None  # reference answer, for logging
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    # 1 where the loss applies (None: every response token). A multi-turn episode's response holds
    # the later turns' prompt tokens (user, tool) at 0 between the sampled ones at 1.
    loss_mask: list[int] | None = None
    # An episode's per-turn rewards (None: none given) and, per turn, the index in response_ids of its
    # last sampled token. The return is reward + sum(turn_rewards): sequence-level advantages take the
    # sum, token-level ones put each turn's reward on its last token (trainer/step.py).
    turn_rewards: list[float] | None = None
    turn_ends: list[int] | None = None
    # MoE, learner.routing_replay: the experts the engine routed each token to (learner/routing_replay.py's
    # wire form: int16 bytes of [tokens, MoE layers, top-k], prompt then response), or None
    routes: bytes | None = None

    @property
    def oldest_version(self) -> int:
        """The staleness of a sample is decided by its oldest token's version."""
        return min(self.versions) if self.versions else -1

    @property
    def response_mask(self) -> list[int]:
        return [1] * len(self.response_ids) if self.loss_mask is None else self.loss_mask


class TrainBatch(msgspec.Struct, kw_only=True):
    """B samples handed to the learner for one policy version step."""

    samples: list[Sample]
    step: int  # learner step this batch is for (== policy version it will produce minus 1)
    policy_version: int  # learner version v when the batch was drawn

    @property
    def size(self) -> int:
        return len(self.samples)


class PutResult(msgspec.Struct, kw_only=True):
    """What the buffer did with one pushed GRPO group (returned by `put_group`)."""

    kept: int  # samples now waiting in the buffer (0 or the whole group: groups stay whole)
    dropped_invalid: int  # dropped because the group held an invalid sample (whole group)
    dropped_filtered: int  # dropped by the group filter (e.g. all rewards equal)


class WeightUpdateState(enum.Enum):
    """Lifecycle of one weight version, transitions owned by weightsync."""

    IDLE = "idle"
    STAGING = "staging"  # buckets streaming into replicas
    COMMITTING = "committing"  # fingerprints verified, replicas switching
    LIVE = "live"  # every live replica committed it
    FAILED = "failed"  # aborted; replicas stay on the previous live version


class WeightVersion(msgspec.Struct, kw_only=True):
    """Registry record of one pushed policy version."""

    version: int
    state: WeightUpdateState = WeightUpdateState.IDLE
    fingerprint: str = ""  # digest over all tensors in the engine layout
    num_bytes: int = 0
    num_tensors: int = 0
    created_at: float = msgspec.field(default_factory=time.time)
    committed_at: float | None = None
    replicas: list[str] = msgspec.field(default_factory=list)  # replicas that committed it
    error: str | None = None


class ReplicaAnswer(msgspec.Struct, kw_only=True, frozen=True):
    """What an engine replica answers a weight verb: every answer names its replica (EngineControl keys a
    fan-out's answers by it)."""

    replica_id: str


class UpdateBegin(msgspec.Struct, frozen=True):
    """What an update's first `load_bucket` carries to start it: how its buckets are hashed (`verify`: full,
    checksum, off; staged beside the live weights, verified before the commit) and laid out ("engine": packed for
    the push plan `plan_id`, copied into the parameters; "hf": reloaded)."""

    verify: str = "full"
    layout: str = "hf"
    plan_id: str | None = None


class UpdateAck(ReplicaAnswer, frozen=True):
    """`abort_update`: the version the replica serves."""

    version: int


class LoadReport(ReplicaAnswer, frozen=True):
    """`load_bucket` that only staged: the tensors this call staged."""

    staged_tensors: int


class CommitReport(ReplicaAnswer, frozen=True):
    """A replica's commit (`commit_update`): the version now live and how it
    was applied (`path`: "direct" copy into the parameters, "reload" through the engine's loaders); `seconds`:
    where its paused window went (apply, reload, paused, pause_call, apply_rpc, relabel, resume_call)."""

    version: int
    path: str
    seconds: dict[str, float] = msgspec.field(default_factory=dict)


class LayoutCheck(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's start-time layout check (`asyncrl_layout`): whether a push may copy straight into its
    parameters (`direct`), why not (`problem`), the parameters it laid out and the check's seconds; asked with
    the learner's manifest, also the worker's layout for it (`layout`: a pickled `EngineLayout`)."""

    rank: int
    direct: bool
    problem: str | None = None
    seconds: float = 0.0
    params: int = 0
    layout: bytes = b""


class ApplyReport(msgspec.Struct, frozen=True, kw_only=True):
    """An apply of a staged version: its `path` ("direct" copy into the parameters, "reload" through the engine's
    loaders, "none"), seconds and tensors. The replica's report over its workers adds the query each worker answered
    first (`before`)."""

    path: str
    apply_seconds: float = 0.0
    tensors: int = 0
    before: list[Any] = msgspec.field(default_factory=list)


class ReceiveReport(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's receive (`asyncrl_receive`, a version's shared files or a collective push): the digests it staged."""

    digests: dict[str, bytes]


class PlanRequest(msgspec.Struct, frozen=True, kw_only=True):
    """`set_push_plan`: what a replica forms its push plan from: the learner's export manifest (pickled
    `plan.ManifestEntry`s) and the bucket size."""

    manifest: bytes
    bucket_mb: float


class PlanAck(ReplicaAnswer, frozen=True):
    """`set_push_plan`: the push plan the replica's workers now hold (pickled `plan.PushPlan` and its id; None:
    pushes reload, `problem` says why)."""

    plan_id: str | None
    plan: bytes | None = None
    problem: str = ""


class GroupsReport(ReplicaAnswer, frozen=True):
    """`join_collective`: the replica's engine workers (one receiver rank each) and the broadcast groups every
    one of them holds (after joining, where it was given groups to join)."""

    workers: int
    groups: list[str]


class SyncReport(ReplicaAnswer, frozen=True):
    """`sync_from_source`: the version served after catching up with the weight store (`loaded`: whether it
    loaded one, in `layout`), and the push plan held after (`push_plan`, None where it holds none)."""

    version: int
    loaded: bool
    layout: str | None = None
    push_plan: str | None = None


# What a learner rank answers the weight verbs (Ray pickles them: they may hold ObjectRefs).
@dataclass
class WeightExport:
    """One policy version out of the sending learner ranks (`export_weights`), in sender order.

    Packed into host buckets (shm, object store): `buckets[i]` is an ObjectRef to a `weightsync.bucket.Bucket` (a
    shared file's handle for shm), `metas[i]` its tensors (name, dtype, shape, offset, nbytes), `senders[i]` the
    rank that packed it (its PP stage for HF tensors), `digests[i]` as hashed when packed. Broadcast to the engine
    workers (nccl, gloo): no buckets (their host copies follow, `take_host_copies`), `digests` one per sender; ipc:
    `buckets` the `IpcBucket` handles every replica's load opens (host copies as broadcast), `digests` one per sender.
    Sizes, and the slowest sender's seconds per phase, either way."""

    buckets: list[Any] = field(default_factory=list)
    metas: list[list[Any]] = field(default_factory=list)
    senders: list[int] = field(default_factory=list)
    digests: list[dict[str, bytes]] = field(default_factory=list)
    bytes: int = 0
    num_tensors: int = 0
    num_buckets: int = 0
    seconds: dict[str, float] = field(default_factory=dict)

    def tensor_digests(self) -> dict[str, bytes]:
        """Every tensor's digest, whichever bucket or sender it came in."""
        return {k: v for d in self.digests for k, v in d.items()}


@dataclass(frozen=True)
class HostCopies:
    """A sending learner rank's host copies of its last broadcast (ObjectRefs, in bucket order) and its copy
    threads' seconds (`take_host_copies`)."""

    sender: int
    buckets: list[Any]
    seconds: dict[str, float]


@dataclass(frozen=True)
class SenderAddress:
    """Where the broadcast group a sending learner rank will host can rendezvous (`join_collective`), and
    the group it holds now that can still carry a push ("": none)."""

    sender: int
    host: str
    port: int
    group: str = ""


# Errors that cross a boundary: raised by a learner group, caught by the loop and by weightsync.


class LearnerRankError(RuntimeError):
    """A rank failed (or timed out) during a group call."""

    def __init__(self, rank: int | None, method: str, message: str) -> None:
        who = f"rank {rank}" if rank is not None else "learner group"
        super().__init__(f"learner {who} failed in {method}: {message}")
        self.rank, self.method = rank, method


class LearnerOutOfMemory(RuntimeError):
    """A learner verb ran its device out of memory (asyncrl/learner/memory.py): the message names the verb and
    rank, the largest micro-batch's tokens, the device's peak and what to change. The same batch would run out
    again, so the loop ends the run with it instead of restarting the learner."""

    def __init__(self, message: str, verb: str = "", rank: int = -1, tokens: int = 0) -> None:
        super().__init__(message)
        self.verb, self.rank, self.tokens = verb, rank, tokens

    def __reduce__(self):  # crosses Ray whole (RuntimeError's own pickling passes the message alone)
        return type(self), (str(self), self.verb, self.rank, self.tokens)


def finite_number(x: Any) -> bool:
    """A real, finite int or float (not a bool): what a reward, a turn reward or a sampling knob must be."""
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)


def error_chain(err: BaseException) -> Iterator[BaseException]:
    """`err`, then what it was raised from: Ray's `.cause` (a remote error's original), else
    `__cause__`, else `__context__`; each error once."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        yield e
        seen.add(id(e))
        e = getattr(e, "cause", None) or e.__cause__ or e.__context__


def failed_applying(err: BaseException) -> bool:
    """Whether `err`, or an error it was raised from, says `applying`: a replica failed while
    applying weights (possibly part applied, left paused). A typed field, never the message."""
    return any(getattr(e, "applying", False) is True for e in error_chain(err))


def learner_failure(err: BaseException) -> BaseException | None:
    """The `LearnerRankError` behind `err` (its cause / context chain), if a learner rank failed in a way a
    restart can get past: not when it ran out of memory (`LearnerOutOfMemory`: the same batch would again)."""
    chain = list(error_chain(err))
    if any(isinstance(e, LearnerOutOfMemory) for e in chain):
        return None
    return next((e for e in chain if isinstance(e, LearnerRankError)), None)


def lost_object_or_actor(err: BaseException) -> bool:
    """Whether Ray lost an object (its owner died, or it could not be rebuilt) or an actor behind `err`."""
    try:
        import ray.exceptions as rx
    except ImportError:  # pragma: no cover - Ray is a dependency
        return False
    return any(isinstance(e, (rx.ObjectLostError, rx.RayActorError)) for e in error_chain(err))  # OwnerDiedError: lost


class Refusal(enum.Enum):
    """Why an engine replica refused a weight-update step without touching its live weights. Errors
    carry it as `.refusal` across Ray and Serve, so a caller matches the kind, never the message."""

    VERIFY_FAILED = "verify_failed"  # the staged tensors do not hash to the fingerprint: nothing applied
    PLAN_MISSING = "plan_missing"  # an engine-layout push for a push plan this replica does not hold


def refusal_of(err: BaseException) -> Refusal | None:
    """The `Refusal` behind `err`: that of the first error in its chain (itself, then Ray's `.cause`,
    `__cause__` / `__context__`) that has a `.refusal` at all. That error decides, None included: a
    replica error saying "failed while applying" is not a refusal, whatever it was raised from."""
    for e in error_chain(err):
        if hasattr(e, "refusal"):
            return e.refusal if isinstance(e.refusal, Refusal) else None
    return None


class ReplicaControlError(RuntimeError):
    """At least one replica failed a control call; `failures` maps replica id -> message, `refusals`
    replica id -> `Refusal` for those that refused a weight-update step."""

    def __init__(self, method: str, failures: dict[str, str], results: dict[str, Any],
                 refusals: dict[str, Refusal] | None = None, applying: set[str] | None = None) -> None:
        detail = "; ".join(f"{rid}: {msg}" for rid, msg in sorted(failures.items()))
        super().__init__(f"{method} failed on {len(failures)} replica(s): {detail}")
        self.method, self.failures, self.results = method, failures, results
        self.refusals = dict(refusals or {})
        self.failed_applying = set(applying or ())  # replica ids that failed while applying (part applied, paused)

    @property
    def applying(self) -> bool:
        """Some replica failed while applying weights."""
        return bool(self.failed_applying)

    @property
    def refusal(self) -> Refusal | None:
        """The refusal every failed replica gave, if they all gave the same one (else None)."""
        kinds = {self.refusals.get(rid) for rid in self.failures}
        return kinds.pop() if len(kinds) == 1 else None
