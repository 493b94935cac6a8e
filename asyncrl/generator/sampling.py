"""Validation of generation requests and their mapping onto vLLM's SamplingParams.

Owns: the rules a request must satisfy before it reaches an engine (ranges of every sampling
knob, `n <= max_n`, prompt + max_tokens within the context, token ids inside the vocabulary),
and the translation to `vllm.SamplingParams`.

Must never: import an engine at module import time beyond the SamplingParams class, or let a
bad request through to the engine (the engine must never see input it could crash on).
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.types import GenerationRequest, SamplingParams, finite_number


class RequestError(ValueError):
    """The request is invalid; the message names the field and the bad value (HTTP 400)."""

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.status = status

    def __reduce__(self):  # (pickled across Ray as itself: its args are not the constructor's)
        return (type(self), (self.field, self.message, self.status))


@dataclass(frozen=True)
class Limits:
    """What a replica can accept; built from GeneratorConfig + ModelConfig + the tokenizer."""

    max_n: int
    max_model_len: int
    vocab_size: int


def validate_sampling(sp: SamplingParams, limits: Limits) -> None:
    def finite(name: str, value: float) -> None:
        if not finite_number(value):
            raise RequestError(name, f"must be a finite number, got {value!r}")

    def integer(name: str, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RequestError(name, f"must be an integer, got {value!r}")

    integer("n", sp.n)
    if not 1 <= sp.n <= limits.max_n:
        raise RequestError("n", f"must lie in [1, {limits.max_n}] (generator.max_n), got {sp.n}")
    finite("temperature", sp.temperature)
    if sp.temperature < 0:
        raise RequestError("temperature", f"must be >= 0, got {sp.temperature}")
    if sp.n > 1 and sp.temperature == 0:
        raise RequestError("n", f"n={sp.n} needs temperature > 0 (greedy decoding gives n identical completions)")
    finite("top_p", sp.top_p)
    if not 0 < sp.top_p <= 1:
        raise RequestError("top_p", f"must lie in (0, 1], got {sp.top_p}")
    integer("top_k", sp.top_k)
    if sp.top_k < -1:
        raise RequestError("top_k", f"must be -1 or 0 (disabled) or >= 1, got {sp.top_k}")
    integer("max_tokens", sp.max_tokens)
    if sp.max_tokens < 1:
        raise RequestError("max_tokens", f"must be >= 1, got {sp.max_tokens}")
    if sp.seed is not None:
        integer("seed", sp.seed)
        if not 0 <= sp.seed < 2**63:
            raise RequestError("seed", f"must lie in [0, 2**63), got {sp.seed}")
    for s in sp.stop:
        if not isinstance(s, str) or not s:
            raise RequestError("stop", f"stop strings must be non-empty strings, got {s!r}")
    for t in sp.stop_token_ids:
        integer("stop_token_ids", t)
        if not 0 <= t < limits.vocab_size:
            raise RequestError("stop_token_ids", f"token id {t} outside the vocabulary [0, {limits.vocab_size})")


def validate_request(request: GenerationRequest, limits: Limits) -> None:
    """Raise RequestError if the engine could not serve `request` exactly as asked."""
    validate_sampling(request.sampling, limits)
    ids = request.prompt_ids
    if not isinstance(ids, list) or not ids:
        raise RequestError("prompt_ids", "must be a non-empty list of token ids")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < limits.vocab_size:
            raise RequestError("prompt_ids", f"element {i} = {t!r} is not a token id in [0, {limits.vocab_size})")
    total = len(ids) + request.sampling.max_tokens
    if total > limits.max_model_len:
        raise RequestError(
            "max_tokens",
            f"prompt ({len(ids)} tokens) + max_tokens ({request.sampling.max_tokens}) = {total} "
            f"exceeds the context length {limits.max_model_len} (model.max_model_len)",
        )


def to_vllm(sp: SamplingParams, *, final_only: bool = False, detokenize: bool = True, array_logprobs: bool = False):
    """The vLLM SamplingParams of a validated request.

    Outputs are DELTA (each carries only new tokens: the replica accumulates itself), or with
    `final_only` one output per request when it ends: a caller that wants only the result spares
    the engine's frontend and the replica a Python round per step and sequence. `detokenize=False`
    leaves the text to the caller (no stop strings then). `array_logprobs` marks the request for
    the engine core's array log-prob path (array_logprobs.py: final-only requests); otherwise
    log-probs come in vLLM's flat containers where it has them, not as a dict per token.
    """
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import RequestOutputKind

    if sp.stop and not detokenize:
        raise ValueError("stop strings need the engine to detokenize")
    if array_logprobs and not final_only:
        raise ValueError("array log-probs come with the final output only")
    try:
        return _build(VllmSamplingParams, RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.DELTA, sp,
                      detokenize=detokenize, array_logprobs=array_logprobs)
    except (VLLMValidationError, ValueError) as err:
        # Our rules should have caught it; never let vLLM's own check become a 500.
        raise RequestError("sampling", str(err)) from None


def _build(VllmSamplingParams, output_kind, sp: SamplingParams, *, detokenize: bool = True, array_logprobs: bool = False):
    extra, flat = None, {}
    if sp.logprobs and array_logprobs:
        from asyncrl.generator.array_logprobs import mark

        extra = mark(None)
    elif sp.logprobs and hasattr(VllmSamplingParams, "flat_logprobs"):
        flat = {"flat_logprobs": True}  # flat lists, not a dict of Logprob objects per token
    return VllmSamplingParams(
        n=sp.n,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k if sp.top_k > 0 else 0,
        max_tokens=sp.max_tokens,
        stop=list(sp.stop) or None,
        stop_token_ids=list(sp.stop_token_ids) or None,
        seed=sp.seed,
        # 0 = only the sampled token's log-prob, which is what RL needs as the behaviour log-prob.
        logprobs=0 if sp.logprobs else None,
        ignore_eos=sp.ignore_eos,
        output_kind=output_kind,
        detokenize=detokenize,
        extra_args=extra,
        **flat,
    )
