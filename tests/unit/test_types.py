"""Boundary types survive the wire (msgspec / pickle) and carry per-token versions."""

import pickle

import msgspec
import pytest

from asyncrl.types import (
    Completion,
    GenerationRequest,
    GenerationResult,
    Sample,
    SampleStatus,
    SamplingParams,
    TrainBatch,
    WeightUpdateState,
    WeightVersion,
)


def _sample(**kw):
    base = dict(prompt_ids=[1, 2], response_ids=[3, 4, 5], behavior_logprobs=[-0.1, -0.2, -0.3], versions=[2, 2, 3], reward=1.0, group_id=7)
    base.update(kw)
    return Sample(**base)


def test_sample_roundtrips_through_msgpack_and_pickle():
    s = _sample(status=SampleStatus.INVALID_REWARD, metadata={"task": "arith"})
    for decoded in (msgspec.msgpack.decode(msgspec.msgpack.encode(s), type=Sample), pickle.loads(pickle.dumps(s))):
        assert decoded == s
        assert decoded.status is SampleStatus.INVALID_REWARD
    assert s.oldest_version == 2
    assert s.response_mask == [1, 1, 1]


def test_generation_result_versions_are_distinct_and_sorted():
    r = GenerationResult(
        request_id="r",
        prompt_ids=[1],
        completions=[
            Completion(index=0, token_ids=[5, 6], logprobs=[-1.0, -2.0], versions=[3, 4], finish_reason="length"),
            Completion(index=1, token_ids=[7], logprobs=[-0.5], versions=[4], finish_reason="stop"),
        ],
    )
    assert r.versions == [3, 4]
    assert r.completions[0].min_version == 3
    back = msgspec.json.decode(msgspec.json.encode(r), type=GenerationResult)
    assert back == r


def test_defaults_are_fresh_per_instance():
    a, b = GenerationRequest(prompt_ids=[1]), GenerationRequest(prompt_ids=[1])
    assert a.request_id != b.request_id
    a.sampling.stop.append("x")
    assert b.sampling.stop == []
    w1, w2 = WeightVersion(version=1), WeightVersion(version=2)
    assert w1.replicas is not w2.replicas
    assert w1.state is WeightUpdateState.IDLE


def test_sampling_params_reject_unknown_fields_on_decode():
    with pytest.raises(msgspec.ValidationError, match="temprature"):
        msgspec.json.decode(b'{"temprature": 1.0}', type=SamplingParams)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"n": "three"}', type=SamplingParams)


def test_train_batch_size():
    batch = TrainBatch(samples=[_sample(), _sample(group_id=8)], step=0, policy_version=0)
    assert batch.size == 2
