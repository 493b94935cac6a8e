"""SGLang's request and output shapes, translated to and from the replica's.

Owns: the rules by which one replica request becomes SGLang requests and their results the sequence outputs the
replica reads (driver.py), for SGLang's in-process engine with token ids in and incremental streaming out
(docs/design/sglang-0.5.15-api.md): `n > 1` expanded into n requests with rids of our own, none a prefix of another
(SGLang aborts by rid prefix); a per-sequence `sampling_seed` only under deterministic inference, else a seeded
request is refused; stop strings matched on the driver's own decoded text (`find_stop`), not sent to SGLang.
The SGLang driver that starts the engine and calls it is sglang_engine.py.
Must never: import SGLang, or let a request through that SGLang would sample differently from what it asked (an
unhonoured seed).
Details: docs/design/generator.md, "SGLang's request shapes".
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from asyncrl.generator.sampling import RequestError
from asyncrl.types import SamplingParams

RID_END = "$"  # ends every rid: no rid of ours is then a proper prefix of another
FINISH_REASONS = {"length": "length", "stop": "stop", "abort": "abort"}  # SGLang's type -> the replica's


def sequence_rids(engine_id: str, n: int) -> list[str]:
    """The rids of a request's `n` sequences. `engine_id` is unique among requests in flight (it holds
    the caller's request id, any text); the end mark, found nowhere else in a rid (escaped, one-to-one),
    keeps "r-1" from aborting "r-10": SGLang matches `rid.startswith`."""
    safe = engine_id.replace("%", "%25").replace(RID_END, "%24")
    return [f"{safe}#{i}{RID_END}" for i in range(n)]


def to_sglang(sp: SamplingParams, *, deterministic: bool, rng: random.Random | None = None) -> list[dict[str, Any]]:
    """One SGLang `sampling_params` dict per sequence of a validated request. `deterministic`: the
    engine runs with `enable_deterministic_inference` (the only mode in which SGLang reads a seed)."""
    if sp.seed is not None and not deterministic:
        raise RequestError("sampling.seed", "the SGLang engine honours a seed only with generator.engine_kwargs."
                           "enable_deterministic_inference=true; leave seed unset or turn that on")
    base: dict[str, Any] = {
        "max_new_tokens": sp.max_tokens,  # (SGLang's default is 128, not "until the context ends")
        "temperature": sp.temperature,  # below 1e-6 SGLang decodes greedily, as vLLM does at 0
        "top_p": sp.top_p,
        "top_k": sp.top_k if sp.top_k > 0 else -1,
        "stop_token_ids": list(sp.stop_token_ids),
        "ignore_eos": sp.ignore_eos,
    }
    if not deterministic:
        return [dict(base) for _ in range(sp.n)]
    # One seed for all n would make them one sample n times (the sampler keys on seed and position).
    if sp.seed is None:
        rng = rng or random.Random()
        seeds = [rng.randrange(2**31) for _ in range(sp.n)]
    else:
        seeds = [(sp.seed + i) % 2**63 for i in range(sp.n)]
    return [{**base, "sampling_seed": s} for s in seeds]


@dataclass
class SequenceOutput:
    """One SGLang result chunk as the replica reads a sequence's output (vLLM's field names)."""

    index: int
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None
    stop_reason: int | str | None  # the stop token id that matched (not EOS), else None
    weight_version: str | None  # SGLang's label for the chunk (coarser than a token: see the design)
    text: str = ""
    meta: dict[str, Any] = field(default_factory=dict, repr=False)


def finish_of(meta: dict[str, Any], stop_token_ids: list[int]) -> tuple[str | None, int | str | None]:
    """(finish reason, stop reason) from a chunk's `meta_info["finish_reason"]`: None on every chunk
    but the last. As in vLLM, the stop reason is the matched id of `stop_token_ids` (None for EOS)."""
    finish = meta.get("finish_reason")
    if finish is None:
        return None, None
    kind = finish.get("type")
    if kind not in FINISH_REASONS:
        raise ValueError(f"SGLang finish_reason of an unknown type: {finish!r}")
    matched = finish.get("matched") if kind == "stop" else None
    stop_reason = matched if isinstance(matched, int) and matched in stop_token_ids else None
    return FINISH_REASONS[kind], stop_reason


def refused(err: BaseException) -> BaseException | dict[str, Any]:
    """What a sequence's `generate_request` raised, as the driver hands it on. Asked whole (stream=False), SGLang
    raises where a stream would get a chunk finished "abort": a ValueError for a request it refused (its HTTP 400:
    checked at admission, nothing generated) and an HTTPException for one its server aborted (503 / 500: a running
    timeout). A refusal is the caller's: a RequestError naming the prompt with SGLang's message, as our own checks
    give (the rollout layer drops that prompt rather than asking again); a server abort becomes the chunk a stream
    ends with, finished "abort" with no tokens (the rollout layer asks again). Anything else as it was."""
    if isinstance(err, ValueError) and not isinstance(err, RequestError):
        return RequestError("prompt_ids", f"SGLang refused the request: {err}")
    status = getattr(err, "status_code", None)
    if isinstance(status, int) and status >= 500:
        message = getattr(err, "detail", None) or str(err)
        return {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": message,
                                                                  "status_code": status}}}
    return err


def read_chunk(index: int, chunk: dict[str, Any], *, logprobs: bool, stop_token_ids: list[int]) -> SequenceOutput:
    """Sequence `index`'s output from one incremental chunk of its stream: the new ids (a copy: SGLang
    may keep appending to its list), their log-probs (`output_token_logprobs` holds (log-prob, id,
    text) per output id), and its finish."""
    meta = chunk.get("meta_info") or {}
    finish, stop_reason = finish_of(meta, stop_token_ids)
    version = meta.get("weight_version")
    version = None if version is None else str(version)
    if finish == "abort" and "prompt_tokens" not in meta:
        # Aborted while it waited in the scheduler's queue: it never ran, and a streamed one brings
        # `[last_id]` (an id it did not generate) or [] as its output.
        return SequenceOutput(index, [], [] if logprobs else None, finish, None, version, meta=meta)
    ids = [int(t) for t in chunk.get("output_ids") or ()]
    lps = None
    if logprobs:
        entries = meta.get("output_token_logprobs") or []
        if len(entries) != len(ids) or any(int(e[1]) != t for e, t in zip(entries, ids)):
            raise ValueError(f"SGLang chunk of {meta.get('id')!r}: {len(entries)} log-probs for {len(ids)} output ids, "
                             "or for other ids")
        lps = [float(e[0]) for e in entries]
    return SequenceOutput(index, ids, lps, finish, stop_reason, version, meta=meta)


def find_stop(decode: Any, ids: list[int], new: int, stops: list[str]) -> tuple[int, str, int] | None:
    """Where the first of `stops` ends in the text of `ids` (decoded by `decode`), if one does in a token among the
    last `new`: (the tokens to keep: up to the one that completed it, as vLLM keeps them; the stop string; where it
    starts in the text). None if no stop string is there."""
    text = decode(ids)
    found = [(text.find(s), s) for s in stops if s and s in text]
    if not found:
        return None
    at, stop = min(found)
    end = at + len(stop)
    lo, hi = max(len(ids) - new, 0) + 1, len(ids)  # the smallest k whose text reaches the stop string's end
    if len(decode(ids[: lo - 1])) >= end:
        return None  # (matched before these tokens: the sequence was cut there already)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(ids[:mid])) >= end:
            hi = mid
        else:
            lo = mid + 1
    return lo, stop, at
