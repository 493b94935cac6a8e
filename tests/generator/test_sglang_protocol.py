"""SGLang's request and output shapes (asyncrl/generator/sglang_protocol.py), against the shapes SGLang
0.5.15 documents and sends (docs/design/sglang-0.5.15-api.md, section b). Pure logic: no SGLang here."""

from __future__ import annotations

import itertools
import random

import pytest

from asyncrl.generator.sampling import RequestError
from asyncrl.generator.sglang_protocol import find_stop, finish_of, read_chunk, refused, sequence_rids, to_sglang
from asyncrl.types import SamplingParams

# SGLang 0.5.15's SamplingParams fields (a msgspec.Struct: any other key is a TypeError in the engine)
SGLANG_KEYS = {"max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
               "presence_penalty", "repetition_penalty", "n", "stop", "stop_token_ids", "stop_regex", "ignore_eos",
               "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "json_schema", "regex", "ebnf",
               "structural_tag", "custom_params", "stream_interval", "logit_bias", "sampling_seed"}


def test_no_rid_is_a_prefix_of_another_so_an_abort_hits_one_sequence():
    """SGLang aborts every request whose rid starts with the one named: "r-1" must not reach "r-10"."""
    ids = ("r-1", "r-10", "r-1#1", "r-100", "r$", "r", "r%24", "r$#1$", "r%")  # caller ids may hold anything
    rids = [rid for engine_id in ids for rid in sequence_rids(engine_id, 12)]
    assert len(set(rids)) == len(rids) == 12 * len(ids)
    assert [(a, b) for a, b in itertools.permutations(rids, 2) if a.startswith(b)] == []


def test_sampling_maps_onto_sglangs_keys_one_dict_per_sequence():
    sp = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=0, max_tokens=40, stop_token_ids=[7], ignore_eos=True)
    out = to_sglang(sp, deterministic=False)
    assert len(out) == 3 and all(d == out[0] for d in out) and out[0] is not out[1]
    assert out[0] == {"max_new_tokens": 40, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "stop_token_ids": [7],
                      "ignore_eos": True}
    assert to_sglang(SamplingParams(top_k=5), deterministic=False)[0]["top_k"] == 5
    assert set(out[0]) <= SGLANG_KEYS and "n" not in out[0]  # n is expanded here, never SGLang's


def test_a_seed_is_honoured_per_sequence_or_refused_by_name():
    """Under deterministic inference one seed would make the n samples identical: each sequence gets
    its own, from the request's seed (reproducible) or drawn; without that mode a seed is refused."""
    seeded = to_sglang(SamplingParams(n=4, seed=11), deterministic=True)
    assert [d["sampling_seed"] for d in seeded] == [11, 12, 13, 14] and set(seeded[0]) <= SGLANG_KEYS
    assert to_sglang(SamplingParams(n=4, seed=11), deterministic=True) == seeded
    drawn = [d["sampling_seed"] for d in to_sglang(SamplingParams(n=8), deterministic=True, rng=random.Random(0))]
    assert len(set(drawn)) == 8
    with pytest.raises(RequestError, match="enable_deterministic_inference") as info:
        to_sglang(SamplingParams(seed=1), deterministic=False)
    assert info.value.field == "sampling.seed" and info.value.status == 400


def test_stop_strings_stay_out_of_sglang_and_are_found_in_the_decoded_text():
    out = to_sglang(SamplingParams(stop=["\n"], stop_token_ids=[7]), deterministic=False)
    assert "stop" not in out[0] and out[0]["stop_token_ids"] == [7]  # (SGLang runs without its tokenizer)
    decode = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731
    ids = [ord(c) for c in "ab<>cd"]
    assert find_stop(decode, ids[:3], 1, ["<>"]) is None  # half of it: not yet
    assert find_stop(decode, ids[:4], 1, ["<>"]) == (4, "<>", 2)  # completed by the 4th token, which is kept
    assert find_stop(decode, ids, 3, ["<>", "d"]) == (4, "<>", 2)  # the first to occur wins
    assert find_stop(decode, ids, 1, ["<>"]) is None  # before these tokens: cut there already


@pytest.mark.parametrize("finish, expected", [
    (None, (None, None)),
    ({"type": "length", "length": 8}, ("length", None)),
    ({"type": "stop", "matched": 2}, ("stop", None)),  # EOS (not one of the request's stop ids)
    ({"type": "stop", "matched": 7}, ("stop", 7)),
    ({"type": "stop", "matched": "\n"}, ("stop", None)),
    ({"type": "abort", "message": "Abort before prefill", "status_code": None}, ("abort", None)),
])
def test_finish_reasons_read_as_vllms(finish, expected):
    assert finish_of({"finish_reason": finish}, [7]) == expected


def test_an_unknown_finish_type_is_an_error_not_a_silent_none():
    with pytest.raises(ValueError, match="unknown type"):
        finish_of({"finish_reason": {"type": "preempted"}}, [])


def test_an_incremental_chunk_gives_its_new_ids_and_their_logprobs():
    live = [5, 9, 7]
    chunk = {"output_ids": live, "meta_info": {
        "id": "r-1#0$", "prompt_tokens": 4, "weight_version": "3", "finish_reason": {"type": "stop", "matched": 7},
        "output_token_logprobs": [(-0.5, 5, None), (-1.25, 9, None), (-0.0625, 7, None)]}}
    out = read_chunk(2, chunk, logprobs=True, stop_token_ids=[7])
    live.append(11)  # SGLang may keep appending to the list it handed out
    assert (out.index, out.token_ids, out.logprobs) == (2, [5, 9, 7], [-0.5, -1.25, -0.0625])
    assert (out.finish_reason, out.stop_reason, out.weight_version) == ("stop", 7, "3")
    assert read_chunk(0, chunk, logprobs=False, stop_token_ids=[]).logprobs is None
    running = {"output_ids": [4], "meta_info": {"prompt_tokens": 4, "finish_reason": None,
                                                "output_token_logprobs": [(-2.0, 4, None)]}}
    assert read_chunk(0, running, logprobs=True, stop_token_ids=[]).finish_reason is None


def test_logprobs_that_do_not_match_the_ids_are_an_error():
    chunk = {"output_ids": [5, 9], "meta_info": {"prompt_tokens": 4, "output_token_logprobs": [(-0.5, 5, None)]}}
    with pytest.raises(ValueError, match="1 log-probs for 2 output ids"):
        read_chunk(0, chunk, logprobs=True, stop_token_ids=[])
    chunk["meta_info"]["output_token_logprobs"] = [(-0.5, 5, None), (-0.5, 8, None)]
    with pytest.raises(ValueError, match="or for other ids"):
        read_chunk(0, chunk, logprobs=True, stop_token_ids=[])


def test_a_request_aborted_while_it_waited_generated_nothing():
    """Aborted in the scheduler's queue, a streamed request's chunk carries `[last_id]` and no
    prompt_tokens: it produced no token, and none is read from it."""
    chunk = {"output_ids": [42], "meta_info": {"id": "r#0$", "weight_version": "0",
                                                "finish_reason": {"type": "abort", "message": "Abort in waiting queue"}}}
    out = read_chunk(1, chunk, logprobs=True, stop_token_ids=[])
    assert (out.token_ids, out.logprobs, out.finish_reason) == ([], [], "abort")


def test_what_sglang_raises_for_a_whole_request_is_a_refusal_of_the_prompt_or_an_aborted_end():
    """Asked with stream=False, SGLang raises where a stream ends "abort": ValueError for its 400, an HTTPException
    (status_code, detail) for its 503 / 500."""
    err = refused(ValueError("input is longer than the context"))
    assert isinstance(err, RequestError) and err.field == "prompt_ids" and "longer than the context" in err.message

    class HTTPException(Exception):
        def __init__(self, status_code, detail):
            super().__init__(detail)
            self.status_code, self.detail = status_code, detail

    chunk = refused(HTTPException(503, "Request running timeout reached."))
    seq = read_chunk(0, chunk, logprobs=True, stop_token_ids=[])
    assert (seq.token_ids, seq.logprobs, seq.finish_reason) == ([], [], "abort")
    mine = RequestError("seed", "needs deterministic inference")
    other = RuntimeError("scheduler died")
    assert refused(mine) is mine and refused(other) is other and isinstance(refused(HTTPException(404, "x")), Exception)
