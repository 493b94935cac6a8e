"""Behaviour log-probs as one array per completion, instead of vLLM's per-token Python objects.

Owns: the vLLM adapter (engine-core side) that carries the sampled token's log-prob of a final-only request from the
workers to the replica as one float32 array, and the replica-side reading of it.
Why: vLLM's per-token log-prob bookkeeping, not the device, sets the pace at small models; a final-only request
needs none of it. How: the replica asks for `logprobs=0` and marks the request (`extra_args[FLAG]`);
`ArrayLogprobsMixin`, in the engine core's scheduler, keeps its values and on the finishing step attaches the array
to the output's `routed_experts` field (passed through untouched; refused when the engine returns routed experts
itself). An output built outside the scheduler (an abort on pause or shutdown) comes back without log-probs.
Must never: change a token, a log-prob or the order of either (the values are the workers' own), or keep state for
a request the scheduler no longer holds.
Details: docs/design/generator.md, "Array log-probs".
"""

from __future__ import annotations

from typing import Any

import numpy as np
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

FLAG = "asyncrl_array_logprobs"
_PRUNE_EVERY = 256  # steps between sweeps for marked requests that ended without a final output


class ArrayLogprobsMixin:
    """Engine-core side: accumulate marked requests' sampled log-probs, send them on finish.

    Mixed in before vLLM's scheduler class (`Scheduler` or `AsyncScheduler`); it only wraps
    `add_request` and `update_from_output`, both part of vLLM's scheduler interface."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Built in the engine core process: it ends with the replica that started it.
        from asyncrl.generator.owner_watch import watch_owner

        watch_owner()
        super().__init__(*args, **kwargs)

    def _asyncrl_state(self) -> tuple[dict[str, list[float]], set[str]]:
        """(marked request id -> its log-probs so far, ids of unmarked requests that want log-probs)."""
        state = self.__dict__.get("_asyncrl_lp")
        if state is None:
            state = self.__dict__["_asyncrl_lp"] = ({}, set())
            self.__dict__["_asyncrl_steps"] = 0
        return state

    def add_request(self, request: Any) -> None:
        params = getattr(request, "sampling_params", None)
        extra = getattr(params, "extra_args", None)
        marked, others = self._asyncrl_state()
        if extra and extra.get(FLAG):
            marked[request.request_id] = []
        elif params is not None and params.num_logprobs is not None:
            others.add(request.request_id)
        super().add_request(request)  # type: ignore[misc]

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict[int, Any]:
        marked, others = self._asyncrl_state()
        column, rows = None, None
        lps = model_runner_output.logprobs
        if marked and lps is not None and lps.cu_num_generated_tokens is None and others.isdisjoint(model_runner_output.req_ids):
            # Every request of this step that wants log-probs is marked: take the sampled column
            # (vLLM's sampler puts the sampled token first) for the whole batch in one call, and
            # spare vLLM's scheduler its per-request slices. Row i is request req_ids[i], as in
            # vLLM's own `slice_request(req_index, ...)`.
            column, rows = lps.logprobs[:, 0].tolist(), model_runner_output.req_id_to_index
            model_runner_output.logprobs = None
        outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        if not marked and not others:
            return outputs
        for batch in outputs.values():
            for out in batch.outputs:
                mine = marked.get(out.request_id)
                if mine is None:
                    if out.finish_reason is not None:
                        others.discard(out.request_id)
                    continue
                if column is not None:
                    at = rows[out.request_id]
                    mine.extend(column[at: at + len(out.new_token_ids)])
                elif out.new_logprobs is not None:  # vLLM sliced it (speculative decoding, or a mixed batch)
                    mine.extend(out.new_logprobs.logprobs[:, 0].tolist())
                    out.new_logprobs = None
                if out.finish_reason is not None:
                    # float32 -> Python float -> float32 is exact: these are the workers' values.
                    out.routed_experts = np.array(mine, dtype=np.float32)
                    del marked[out.request_id]
        self.__dict__["_asyncrl_steps"] += 1
        if self.__dict__["_asyncrl_steps"] % _PRUNE_EVERY == 0:
            # Aborted by the frontend (no final output is sent for those): drop what they held.
            held = self.requests  # type: ignore[attr-defined]
            for rid in [r for r in marked if r not in held]:
                del marked[rid]
            others.intersection_update(held)
        return outputs


def install(vllm_config: Any) -> str | None:
    """Put the mixin into the engine's scheduler. Returns why not (None = installed): a scheduler
    class the user chose, or an engine that returns routed experts itself."""
    sched = vllm_config.scheduler_config
    if sched.scheduler_cls is not None:
        return f"scheduler_cls={sched.scheduler_cls!r} is set"
    if getattr(vllm_config.model_config, "enable_return_routed_experts", False):
        return "the engine returns routed experts (enable_return_routed_experts)"
    mine = {Scheduler: ArrayLogprobsScheduler, AsyncScheduler: ArrayLogprobsAsyncScheduler}.get(sched.get_scheduler_cls())
    if mine is None:
        return f"vLLM's default scheduler is {sched.get_scheduler_cls().__name__}, not one this adapter knows"
    sched.scheduler_cls = mine
    return None


def mark(extra_args: dict[str, Any] | None) -> dict[str, Any]:
    """`extra_args` of a request whose sampled log-probs should come back as one array."""
    return {**(extra_args or {}), FLAG: True}


def completion_logprobs(completion: Any, num_tokens: int) -> list[float] | None:
    """The sampled log-probs of a finished marked completion (replica side). None for one the
    engine core ended from outside its scheduler (an abort on pause or shutdown, an error): such
    an output is built without the scheduler, so its values stay behind."""
    values = getattr(completion, "routed_experts", None)
    if values is None:
        if completion.finish_reason in ("abort", "error"):
            return None
        raise RuntimeError("a completion asked for array log-probs came back without them "
                           "(the engine's scheduler does not carry asyncrl's adapter)")
    values = np.asarray(values).reshape(-1)
    if values.shape[0] != num_tokens:
        raise RuntimeError(f"array log-probs cover {values.shape[0]} tokens, the completion has {num_tokens}")
    return values.tolist()


# Module-level classes, so the engine core process can unpickle the config that names them.
class ArrayLogprobsScheduler(ArrayLogprobsMixin, Scheduler):
    """vLLM's synchronous scheduler with array log-probs."""


class ArrayLogprobsAsyncScheduler(ArrayLogprobsMixin, AsyncScheduler):
    """vLLM's async scheduler with array log-probs."""
