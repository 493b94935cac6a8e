"""The episode ledger (pure logic): token-exact assembly of turns into samples, the limits of one
episode, finished / abandoned / unknown ids, and the counters behind GET /v1/episodes."""

from __future__ import annotations

import pytest

from asyncrl.generator.episodes import EpisodeError, EpisodeLedger, Turn, assemble


def _turn(prompt, sampled, version=0):
    return Turn(tuple(prompt), tuple(sampled), tuple(-0.5 - i for i in range(len(sampled))), tuple([version] * len(sampled)))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_turns_that_extend_the_history_make_one_sample_masked_on_the_sampled_tokens():
    t1 = _turn([1, 2, 3], [10, 11], version=4)
    t2 = _turn([1, 2, 3, 10, 11, 20, 21], [12], version=5)  # user tokens 20 21, then the model's 12
    t3 = _turn([1, 2, 3, 10, 11, 20, 21, 12, 30], [13, 14], version=5)
    (s,), mismatches = assemble([t1, t2, t3])
    assert mismatches == 0 and s.turns == 3
    assert s.prompt_ids == [1, 2, 3]
    assert s.prompt_ids + s.response_ids == list(t3.prompt_ids) + list(t3.token_ids)  # exactly what the engine saw, then sampled
    assert s.response_ids == [10, 11, 20, 21, 12, 30, 13, 14]
    assert s.loss_mask == [1, 1, 0, 0, 1, 0, 1, 1]
    assert s.logprobs == [-0.5, -1.5, 0.0, 0.0, -0.5, 0.0, -0.5, -1.5]
    # a version per token: sampled tokens keep theirs, inserted ones carry the sampled token's before them
    assert s.versions == [4, 4, 4, 4, 5, 5, 5, 5]


def test_a_turn_that_rewrites_the_history_starts_a_new_sample_and_is_counted():
    t1 = _turn([1, 2, 3], [10, 11])
    t2 = _turn([1, 2, 3, 10, 99, 20], [12])  # the answer came back re-tokenised as 10 99: not glued
    t3 = _turn([1, 2, 3, 10, 99, 20, 12, 7], [13])
    samples, mismatches = assemble([t1, t2, t3])
    assert mismatches == 1
    assert [(s.prompt_ids, s.response_ids, s.loss_mask) for s in samples] == [
        ([1, 2, 3], [10, 11], [1, 1]),
        ([1, 2, 3, 10, 99, 20], [12, 7, 13], [1, 0, 1]),
    ]
    # a shorter prompt than the history is a mismatch too
    samples, mismatches = assemble([t1, _turn([1, 2], [5])])
    assert mismatches == 1 and [s.prompt_ids for s in samples] == [[1, 2, 3], [1, 2]]


def test_an_episode_opens_takes_turns_one_at_a_time_and_finishes_once():
    ledger = EpisodeLedger(max_turns=3, max_tokens=100, idle_timeout_s=60, clock=Clock())
    eid = ledger.open({"task": "t1"})["id"]
    with pytest.raises(EpisodeError) as err:
        ledger.finish(eid)
    assert err.value.status == 409 and "no turns" in err.value.message
    ledger.begin_turn(eid, [1, 2], 4)
    with pytest.raises(EpisodeError) as err:  # a second turn while the first is generating
        ledger.begin_turn(eid, [1, 2], 4)
    assert err.value.status == 409 and "in flight" in err.value.message
    ledger.end_turn(eid, _turn([1, 2], [3, 4]))
    ledger.begin_turn(eid, [1, 2, 3], 4)
    ledger.end_turn(eid, None)  # a failed generation records nothing and frees the episode
    assert ledger.describe(eid)["turns"] == 1
    samples, mismatches, meta = ledger.finish(eid)
    assert (len(samples), mismatches, meta) == (1, 0, {"task": "t1"})
    for call in (lambda: ledger.begin_turn(eid, [1], 1), lambda: ledger.finish(eid)):
        with pytest.raises(EpisodeError) as err:
            call()
        assert err.value.status == 409 and "is finished" in err.value.message
    with pytest.raises(EpisodeError) as err:
        ledger.begin_turn("ep-nope", [1], 1)
    assert err.value.status == 404 and "not found" in err.value.message
    assert ledger.stats() | {"refused": 0} == {"opened": 1, "finished": 1, "abandoned": 0, "turns": 1, "mismatches": 0,
                                               "samples": 1, "refused": 0, "open": 0}


def test_limits_on_turns_and_tokens_are_413_before_the_turn_runs():
    ledger = EpisodeLedger(max_turns=2, max_tokens=12, idle_timeout_s=60, clock=Clock())
    eid = ledger.open()["id"]
    with pytest.raises(EpisodeError) as err:  # 3 prompt + 10 new tokens > 12
        ledger.begin_turn(eid, [1, 2, 3], 10)
    assert err.value.status == 413 and "episode_max_tokens=12" in err.value.message
    ledger.begin_turn(eid, [1, 2, 3], 2)
    ledger.end_turn(eid, _turn([1, 2, 3], [4, 5]))
    # the next prompt extends the history: 5 tokens so far + 1 new prompt token + 6 = 12 fits
    ledger.begin_turn(eid, [1, 2, 3, 4, 5, 6], 6)
    ledger.end_turn(eid, _turn([1, 2, 3, 4, 5, 6], [7]))
    with pytest.raises(EpisodeError) as err:
        ledger.begin_turn(eid, [1, 2, 3, 4, 5, 6, 7], 1)
    assert err.value.status == 413 and "episode_max_turns=2" in err.value.message
    assert ledger.stats()["refused"] == 2


def test_an_idle_episode_is_abandoned_counted_and_answers_410():
    clock = Clock()
    ledger = EpisodeLedger(max_turns=4, max_tokens=100, idle_timeout_s=30, clock=clock)
    idle, busy = ledger.open()["id"], ledger.open()["id"]
    ledger.begin_turn(busy, [1], 1)  # generating: never reaped mid-turn
    clock.now += 31
    assert ledger.reap() == [idle]
    assert ledger.stats()["abandoned"] == 1 and ledger.stats()["open"] == 1
    with pytest.raises(EpisodeError) as err:
        ledger.begin_turn(idle, [1], 1)
    assert err.value.status == 410 and "abandoned" in err.value.message
    ledger.end_turn(busy, _turn([1], [2]))
    clock.now += 29
    assert ledger.reap() == [] and ledger.describe(busy)["turns"] == 1


def test_an_episode_opened_with_a_temperature_refuses_turns_at_another():
    """A trainer's episodes pin the temperature its learner recomputes log-probs at."""
    ledger = EpisodeLedger(max_turns=4, max_tokens=100, idle_timeout_s=60, clock=Clock())
    pinned = ledger.open(temperature=0.7)
    assert pinned["temperature"] == 0.7
    with pytest.raises(EpisodeError) as err:
        ledger.begin_turn(pinned["id"], [1], 1, temperature=1.0)
    assert err.value.status == 400 and "temperature 0.7" in err.value.message
    ledger.begin_turn(pinned["id"], [1], 1, temperature=0.7)
    free = ledger.open()["id"]
    ledger.begin_turn(free, [1], 1, temperature=0.0)


def test_each_sample_says_where_its_turns_end_and_finish_bodies_take_one_reward_per_turn():
    from asyncrl.generator.gateway_core import HTTPError
    from asyncrl.generator.openai_api import finish_body

    samples, _ = assemble([_turn([1, 2], [3, 4]), _turn([1, 2, 3, 4, 5], [6]), _turn([9], [7, 8])])
    assert [s.turn_ends for s in samples] == [[1, 3], [1]]  # turn 2's prompt token 5 sits between them; turn 3 split off
    assert samples[0].as_json()["turn_ends"] == [1, 3]
    assert finish_body({"reward": 1}, 3) == (1.0, None)
    assert finish_body({"reward": 1, "turn_rewards": [0, 0.5, -1]}, 3) == (1.0, [0.0, 0.5, -1.0])
    for body, fragment in [({"reward": 1, "turn_rewards": [0.5]}, "1 values for an episode of 3 turns"),
                           ({"reward": 1, "turn_rewards": [0, float("nan"), 1]}, "list of finite numbers"),
                           ({"reward": 1, "turn_rewards": "0,1,2"}, "list of finite numbers"),
                           ({"reward": 1, "extra": 2}, "finish needs"), ({"reward": True}, "finish needs"), ([], "finish needs")]:
        with pytest.raises(HTTPError) as err:
            finish_body(body, 3)
        assert err.value.status == 400 and fragment in err.value.message, body
