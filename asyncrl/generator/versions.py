"""Per-token weight-version bookkeeping for one request (pure logic, no engine).

Owns: turning the engine's version spans `(label, first output-token index)` into one version per token, and
accumulating DELTA outputs into completions. Versions are exact because the engine core stamps each output batch
with the label it holds when the batch is produced, and the replica changes that label only while generation is
paused; engines without stamps get the same spans from `VersionLedger`, which the replica fills at each commit.
Must never: guess a version from the replica's current state when the engine gave one.
Details: docs/design/generator.md, "Per-token weight versions".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from asyncrl.types import Completion, CompletionDelta


class VersionLabelError(ValueError):
    """A span label that is not one of ours (we only ever set decimal integers)."""


def parse_label(label: str | int) -> int:
    if isinstance(label, int):
        return label
    try:
        return int(label)
    except (TypeError, ValueError):
        raise VersionLabelError(f"weight version label {label!r} is not an integer") from None


def versions_from_starts(starts: Sequence[tuple[str | int, int]], begin: int, end: int) -> list[int]:
    """Versions of output tokens [begin, end) given span starts [(label, first index), ...].

    Starts are ascending by index and the first one starts at or before `begin`
    (a span opens when the first token under a new label arrives).
    """
    if end < begin:
        raise ValueError(f"end={end} < begin={begin}")
    if end == begin:
        return []
    if not starts or starts[0][1] > begin:
        raise ValueError(f"no version span covers token {begin} (starts={list(starts)})")
    out: list[int] = []
    k = 0
    for pos in range(begin, end):
        while k + 1 < len(starts) and starts[k + 1][1] <= pos:
            k += 1
        out.append(parse_label(starts[k][0]))
    return out


def versions_from_spans(spans: Sequence[tuple[str | int, int, int]], num_tokens: int) -> list[int]:
    """Versions of all `num_tokens` tokens from finished spans [(label, start, end), ...]."""
    out: list[int] = []
    for label, start, end in spans:
        if start != len(out) or end < start:
            raise ValueError(f"spans are not contiguous: {list(spans)}")
        out.extend([parse_label(label)] * (end - start))
    if len(out) != num_tokens:
        raise ValueError(f"spans cover {len(out)} tokens, the completion has {num_tokens}")
    return out


@dataclass
class CompletionAccumulator:
    """One completion built from successive deltas; every token gets exactly one version."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    routes: bytes | None = None  # MoE, when the engine returns them: set once the completion finished

    def add(
        self,
        request_id: str,
        token_ids: Sequence[int],
        logprobs: Sequence[float] | None,
        versions: Sequence[int],
        text: str,
        finish_reason: str | None,
    ) -> CompletionDelta:
        if self.finish_reason is not None:
            raise RuntimeError(f"completion {self.index} of {request_id} got tokens after it finished")
        if len(versions) != len(token_ids):
            raise ValueError(f"{len(versions)} versions for {len(token_ids)} tokens")
        if logprobs is not None and len(logprobs) != len(token_ids):
            raise ValueError(f"{len(logprobs)} logprobs for {len(token_ids)} tokens")
        self.token_ids.extend(token_ids)
        self.versions.extend(versions)
        if logprobs is not None:
            self.logprobs.extend(logprobs)
        self.text += text
        self.finish_reason = finish_reason
        return CompletionDelta(
            request_id=request_id,
            index=self.index,
            token_ids=list(token_ids),
            logprobs=list(logprobs or []),
            versions=list(versions),
            text=text,
            finish_reason=finish_reason,
        )

    def reconcile(self, final_versions: Sequence[int]) -> None:
        """Check the running tags against the engine's final spans; the spans win on disagreement."""
        if len(final_versions) != len(self.token_ids):
            raise ValueError(f"final spans cover {len(final_versions)} tokens, accumulated {len(self.token_ids)}")
        self.versions = list(final_versions)

    def to_completion(self) -> Completion:
        return Completion(
            index=self.index,
            token_ids=list(self.token_ids),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            finish_reason=self.finish_reason,
            text=self.text,
            routes=self.routes,
        )


@dataclass
class _LedgerEntry:
    starts: dict[int, list[tuple[int, int]]]
    handed_over: bool = False  # the engine's frontend has taken the request


class VersionLedger:
    """Per-token versions kept by the replica, for engines that do not stamp their outputs.

    vLLM before 0.32 has no `update_weight_version`, so no output carries a label. The replica
    then records, at every commit (generation paused, no step running), how many tokens each
    open sequence had sampled under the old weights; later tokens belong to the new version.
    A request opens under the version the replica serves when it arrives; one that the engine
    has not scheduled by the next commit gets a boundary at 0 (all of its tokens are newer).
    """

    def __init__(self) -> None:
        self._entries: dict[str, _LedgerEntry] = {}

    def open(self, request_id: str, n: int, version: int) -> None:
        if request_id in self._entries:
            raise ValueError(f"request {request_id!r} is already open")
        self._entries[request_id] = _LedgerEntry({i: [(version, 0)] for i in range(n)})

    def close(self, request_id: str) -> None:
        self._entries.pop(request_id, None)

    def handed_over(self, request_id: str) -> None:
        self._entries[request_id].handed_over = True

    def open_requests(self) -> list[tuple[str, int, bool]]:
        """(request id, number of sequences, whether the engine has taken the request)."""
        return [(rid, len(e.starts), e.handed_over) for rid, e in self._entries.items()]

    def mark(self, request_id: str, index: int, version: int, tokens_before: int) -> None:
        """Tokens from `tokens_before` on (of sequence `index`) were sampled under `version`."""
        starts = self._entries[request_id].starts[index]
        if tokens_before < starts[-1][1]:
            raise ValueError(
                f"{request_id}[{index}]: boundary at token {tokens_before} before the last one at {starts[-1][1]}"
            )
        if tokens_before == starts[-1][1]:
            starts[-1] = (version, tokens_before)  # nothing was sampled under the previous label
        else:
            starts.append((version, tokens_before))

    def versions(self, request_id: str, index: int, begin: int, count: int) -> list[int]:
        return versions_from_starts(self._entries[request_id].starts[index], begin, begin + count)
