"""The SGLang driver's own logic against a small fake TokenizerManager (SGLang needs a GPU: the real engine is
exercised by tests/generator/test_sglang_gpu.py). What is pinned here: one SGLang request per sequence, their
chunks merged into engine outputs, the cache salt of the live version, aborts of what is left when a caller
goes, the ledger's reads, the text decoded as vLLM's detokenizer gives it, the pause modes, sleep's limits,
and a control call that never answers marking the engine dead."""

from __future__ import annotations

import asyncio
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest

from asyncrl.generator.sampling import RequestError
from asyncrl.generator.sglang_engine import SglangDriver, server_kwargs
from asyncrl.generator.sglang_protocol import sequence_rids
from asyncrl.types import ApplyReport, SamplingParams


class _Req:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


@pytest.fixture(autouse=True)
def fake_io_struct(monkeypatch):
    """SGLang's request classes, as plain records (their fields are what the driver sets)."""
    io = types.ModuleType("sglang.srt.managers.io_struct")
    for name in ("GenerateReqInput", "PauseGenerationReqInput", "ContinueGenerationReqInput",
                 "ReleaseMemoryOccupationReqInput", "ResumeMemoryOccupationReqInput", "UpdateWeightsFromTensorReqInput"):
        setattr(io, name, type(name, (_Req,), {}))
    for mod in ("sglang", "sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, mod, types.ModuleType(mod))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", io)
    utils = types.ModuleType("sglang.srt.utils")
    utils.MultiprocessingSerializer = types.SimpleNamespace(serialize=lambda named: ("ipc", [(n, t.clone()) for n, t in named]))
    patch = types.ModuleType("sglang.srt.utils.patch_torch")
    patch.monkey_patch_torch_reductions = lambda: None
    monkeypatch.setitem(sys.modules, "sglang.srt.utils", utils)
    monkeypatch.setitem(sys.modules, "sglang.srt.utils.patch_torch", patch)


@dataclass
class _State:
    output_ids: list[int] = field(default_factory=list)


class _Readers:
    """SGLang's model_update_lock as the pause reads it: held while any request is in the TokenizerManager."""

    def __init__(self) -> None:
        self.readers = 0

    async def is_locked(self) -> bool:
        return self.readers > 0


class FakeTM:
    """Streams `script[i]` (lists of new ids per chunk) for the i-th sequence of a request, or, asked with
    stream=False, grows its state by them and yields once at the end with every id and log-prob (as SGLang's
    TokenizerManager does); records calls."""

    def __init__(self, script: list[list[list[int]]], finish: str = "length", hang: str = "") -> None:
        self.script, self.finish, self.hang = script, finish, hang
        self.rid_to_state: dict[str, _State] = {}
        self.requests: list[Any] = []
        self.aborted: list[str] = []
        self.calls: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.model_update_lock = _Readers()
        self.all_aborted = False
        self.chunk_s = 0.0  # a decode step's time, between chunks
        self.hold_after: int | None = None
        self.updates: list[Any] = []
        self.update_answer = (True, "Success")

    async def generate_request(self, obj, request):
        self.requests.append(obj)
        index = int(obj.rid.split("#")[-1].rstrip("$"))
        state = self.rid_to_state[obj.rid] = _State()
        chunks = self.script[index]
        self.model_update_lock.readers += 1
        try:
            async for out in self._chunks(obj, state, chunks):
                yield out
        finally:
            self.model_update_lock.readers -= 1
        self.rid_to_state.pop(obj.rid, None)

    async def _chunks(self, obj, state, chunks):
        for k, ids in enumerate(chunks):
            if k == self.hold_after:
                self.gate.clear()  # (every sequence stops at its chunk `hold_after`)
            await self.gate.wait()
            await asyncio.sleep(self.chunk_s)
            if obj.rid in self.aborted or self.all_aborted:
                return
            state.output_ids += ids
            last = k == len(chunks) - 1
            out = ids if obj.stream else state.output_ids
            meta = {"finish_reason": {"type": self.finish} if last else None, "prompt_tokens": len(obj.input_ids),
                    "output_token_logprobs": [(-0.5, t, None) for t in out]}
            if obj.stream or last:
                yield {"output_ids": list(out), "meta_info": meta}
            await asyncio.sleep(0)

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.aborted.append(rid)
        self.all_aborted = self.all_aborted or abort_all

    async def _call(self, what: str) -> Any:
        self.calls.append(what)
        if what == self.hang:
            await asyncio.Event().wait()
        return types.SimpleNamespace(success=True)

    async def pause_generation(self, obj):
        if obj.mode == "abort" and await self.model_update_lock.is_locked():
            self.calls.append("pause:abort found requests")  # (SGLang's: abort all, look again in 1 s)
        return await self._call(f"pause:{obj.mode}")

    async def continue_generation(self, obj):
        return await self._call("continue")

    async def release_memory_occupation(self, obj, request):
        return await self._call(f"release:{obj.tags}")

    async def resume_memory_occupation(self, obj, request):
        return await self._call(f"resume:{obj.tags}")

    async def flush_cache(self, timeout_s=None):
        return await self._call("flush")

    async def get_internal_state(self):
        return await self._call("state")

    async def update_weights_from_tensor(self, obj, request):
        self.calls.append("update")
        self.updates.append(obj)
        return self.update_answer


class FakeTokenizer:
    """Ids are characters' code points; 0 is a special token (skipped); 1-2 a two-part character."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        out, i = "", 0
        while i < len(ids):
            t = ids[i]
            if t == 1:  # the first half of "é": alone it is the replacement character
                out += "é" if i + 1 < len(ids) and ids[i + 1] == 2 else "\ufffd"
                i += 2 if i + 1 < len(ids) and ids[i + 1] == 2 else 1
                continue
            if t != 0:
                out += chr(t)
            i += 1
        return out


def make(tm: FakeTM, **kw: Any) -> SglangDriver:
    engine = types.SimpleNamespace(tokenizer_manager=tm, shutdown=lambda: None)
    return SglangDriver(engine, tokenizer=FakeTokenizer(), vocab_size=128, **{
        "deterministic": False, "memory_saver": True, "cpu_backup": False, "tp_size": 1, **kw})


async def collect(driver: SglangDriver, sampling: SamplingParams, *, stream: bool, engine_id: str = "req-1"):
    prepared = driver.prepare(sampling, stream=stream)
    handed: list[int] = []
    seen: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    finishes: dict[int, str | None] = {}
    async for out in driver.outputs(engine_id, [5, 6, 7], prepared, lambda: handed.append(1)):
        for seq in out.outputs:
            seen.setdefault(seq.index, []).extend(seq.token_ids)
            lps, text = driver.read(seq, list(seq.token_ids), prepared)
            assert lps == [-0.5] * len(seq.token_ids)
            texts[seq.index] = texts.get(seq.index, "") + text
            finishes[seq.index] = seq.finish_reason
    return seen, texts, finishes, handed


def test_n_sequences_are_one_sglang_request_each_salted_with_the_live_version():
    async def main():
        tm = FakeTM([[[72], [105]], [[79], [75], [33]]])
        driver = make(tm)
        await driver.relabel(7)
        seen, texts, finishes, handed = await collect(driver, SamplingParams(n=2, max_tokens=3, logprobs=True), stream=True)
        assert seen == {0: [72, 105], 1: [79, 75, 33]}
        assert texts == {0: "Hi", 1: "OK!"} and finishes == {0: "length", 1: "length"}
        assert handed == [1]  # once, at the first chunk
        assert [r.rid for r in tm.requests] == sequence_rids("req-1", 2)
        assert {r.extra_key for r in tm.requests} == {"w7"}  # the cache salt of the version live at admission
        assert all(r.stream and r.return_logprob and r.input_ids == [5, 6, 7] for r in tm.requests)
        assert tm.aborted == []  # every sequence finished: nothing to abort
        assert driver._rids == {}

    asyncio.run(main())


def test_final_only_text_is_decoded_once_at_the_end_without_the_stop_token():
    async def main():
        tm = FakeTM([[[72], [1], [2], [10]]], finish="stop")  # "H", then "é" in two tokens, then a stop id
        driver = make(tm)
        seen, texts, _, _ = await collect(driver, SamplingParams(max_tokens=8, logprobs=True, stop_token_ids=[10]),
                                          stream=False)
        assert seen == {0: [72, 1, 2, 10]} and texts == {0: "Hé"}

    asyncio.run(main())


def test_a_request_not_streamed_comes_whole_from_sglang_and_the_ledger_still_counts_its_tokens_as_they_come():
    async def main():
        tm = FakeTM([[[72], [105], [33]], [[79], [75]]])
        tm.hold_after = 1  # one token each in SGLang's state, then held
        driver = make(tm)
        prepared = driver.prepare(SamplingParams(n=2, max_tokens=3, logprobs=True), stream=False)
        handed: list[int] = []
        gen = driver.outputs("whole", [5], prepared, lambda: handed.append(1))
        reading = asyncio.ensure_future(gen.__anext__())
        for _ in range(10):
            await asyncio.sleep(0)
        rids = sequence_rids("whole", 2)
        assert not reading.done() and handed == []
        assert [r.stream for r in tm.requests] == [False, False]  # SGLang sends nothing until the end
        assert driver.frontend_sequences("whole") == {0: rids[0], 1: rids[1]}
        counts = await driver._settled_counts()
        assert counts == {rids[0]: 1, rids[1]: 1}  # the tokens so far, though none was handed on
        tm.gate.set()
        seen: dict[int, list[int]] = {}
        out = await reading
        async def rest():
            return [o async for o in gen]
        for o in [out, *await rest()]:
            for seq in o.outputs:
                assert seq.finish_reason == "length"  # one output per sequence, at its end
                assert driver.read(seq, list(seq.token_ids), prepared)[0] == [-0.5] * len(seq.token_ids)
                seen[seq.index] = list(seq.token_ids)
        assert seen == {0: [72, 105, 33], 1: [79, 75]} and handed == [1]
        # a request with stop strings is still streamed: the string is matched as the text comes
        tm = FakeTM([[[97], [60], [62], [98]]])
        driver = make(tm)
        seen2, texts, _, _ = await collect(driver, SamplingParams(max_tokens=8, logprobs=True, stop=["<>"]),
                                           stream=False)
        assert tm.requests[0].stream and seen2 == {0: [97, 60, 62]} and texts == {0: "a"}

    asyncio.run(main())


def test_a_request_sglang_refuses_whole_is_a_request_error_and_its_other_sequences_are_aborted():
    class Refuses(FakeTM):
        async def generate_request(self, obj, request):
            if obj.rid.endswith("#1$"):
                await asyncio.sleep(0)
                raise ValueError("max_new_tokens is too large")  # SGLang's 400 on a request not streamed
            async for chunk in super().generate_request(obj, request):
                yield chunk

    async def main():
        tm = Refuses([[[65], [66], [67]], []])
        tm.hold_after = 1
        driver = make(tm)
        with pytest.raises(RequestError) as err:
            await collect(driver, SamplingParams(n=2, max_tokens=3, logprobs=True), stream=False, engine_id="bad")
        assert err.value.field == "prompt_ids" and "max_new_tokens is too large" in err.value.message
        assert sequence_rids("bad", 2)[0] in tm.aborted and driver._rids == {}  # (the one still running)

    asyncio.run(main())


def test_streamed_text_waits_for_the_second_half_of_a_character():
    async def main():
        tm = FakeTM([[[72], [1], [2], [33]]])
        driver = make(tm)
        prepared = driver.prepare(SamplingParams(max_tokens=4, logprobs=True), stream=True)
        deltas = []
        async for out in driver.outputs("s", [1], prepared, lambda: None):
            for seq in out.outputs:
                deltas.append(driver.read(seq, list(seq.token_ids), prepared)[1])
        assert deltas == ["H", "", "é", "!"]

    asyncio.run(main())


def test_stop_strings_cut_tokens_and_text_as_vllm_does_and_abort_the_rest():
    async def main():
        script = [[[97], [98], [60], [62], [99], [100]]]  # "ab<>cd", stop "<>"
        tm = FakeTM(script)
        driver = make(tm)
        seen, texts, finishes, _ = await collect(driver, SamplingParams(max_tokens=8, logprobs=True, stop=["<>"]),
                                                 stream=False)
        assert seen == {0: [97, 98, 60, 62]} and texts == {0: "ab"} and finishes == {0: "stop"}
        assert tm.aborted == sequence_rids("req-1", 1)  # SGLang does not go on past the stop string
        tm = FakeTM(script)
        driver = make(tm)
        prepared = driver.prepare(SamplingParams(max_tokens=8, logprobs=True, stop=["<>"]), stream=True)
        deltas, reasons = [], []
        async for out in driver.outputs("s", [1], prepared, lambda: None):
            for seq in out.outputs:
                deltas.append(driver.read(seq, list(seq.token_ids), prepared)[1])
                reasons.append(seq.stop_reason)
        assert deltas == ["", "a", "b", ""] and reasons[-1] == "<>"  # "<" held back until it is not a stop string

    asyncio.run(main())


def test_stop_strings_are_looked_for_in_the_new_text_only_and_found_across_a_character_cut_in_two():
    class Counting(FakeTokenizer):
        decoded = 0

        def decode(self, ids, **kw):
            Counting.decoded += len(ids)
            return super().decode(ids, **kw)

    async def main():
        n = 400
        tm = FakeTM([[[97]] * n])  # "aaaa...": the stop string never comes
        driver = make(tm)
        driver.tokenizer = Counting()
        seen, texts, finishes, _ = await collect(driver, SamplingParams(max_tokens=n, logprobs=True, stop=["<>"]),
                                                 stream=True)
        assert texts == {0: "a" * n} and finishes == {0: "length"}
        assert Counting.decoded < 12 * n  # linear in the length (a whole decode per chunk was n * n = 160,000 ids)
        # "<>" completed, then half of a character in the same chunk: found in that chunk, cut after ">"
        tm = FakeTM([[[97], [60, 62, 1], [2], [99]]])
        driver = make(tm)
        seen, texts, finishes, _ = await collect(driver, SamplingParams(max_tokens=8, logprobs=True, stop=["<>"]),
                                                 stream=True)
        assert seen == {0: [97, 60, 62]} and texts == {0: "a"} and finishes == {0: "stop"}
        # a stop string split across chunks, and text with a character cut in two before it
        tm = FakeTM([[[97], [1], [2, 60], [62], [99]]])
        driver = make(tm)
        seen, texts, finishes, _ = await collect(driver, SamplingParams(max_tokens=8, logprobs=True, stop=["<>"]),
                                                 stream=True)
        assert seen == {0: [97, 1, 2, 60, 62]} and texts == {0: "aé"} and finishes == {0: "stop"}

    asyncio.run(main())


def test_a_caller_that_goes_aborts_every_sequence_still_running():
    async def main():
        tm = FakeTM([[[65], [66], [67]], [[68], [69], [70]]])
        driver = make(tm)
        prepared = driver.prepare(SamplingParams(n=2, max_tokens=3, logprobs=True), stream=True)
        gen = driver.outputs("gone", [1], prepared, lambda: None)
        await gen.__anext__()
        await gen.aclose()
        assert sorted(tm.aborted) == sequence_rids("gone", 2)
        assert "gone" not in driver._rids

    asyncio.run(main())


def test_the_ledger_reads_rids_and_counts_the_tokenizer_manager_holds_after_a_round_trip():
    async def main():
        tm = FakeTM([[[65], [66], [67]], [[68]]])
        driver = make(tm)
        prepared = driver.prepare(SamplingParams(n=2, max_tokens=3, logprobs=True), stream=True)
        gen = driver.outputs("led", [1], prepared, lambda: None)
        await gen.__anext__()
        tm.gate.clear()  # hold the streams where they are
        for _ in range(5):
            await asyncio.sleep(0)
        rids = sequence_rids("led", 2)
        held = driver.frontend_sequences("led")
        # sequence 1 finished (its one chunk) and SGLang dropped it, its chunk not read yet: still the ledger's
        assert held == {0: rids[0], 1: rids[1]} and rids[1] not in tm.rid_to_state
        counts = await asyncio.to_thread(driver.worker.asyncrl_sampled_token_counts)
        assert "state" in tm.calls  # the round trip behind the pause came first
        assert counts == {**{rid: len(s.output_ids) for rid, s in tm.rid_to_state.items()}, rids[1]: 1}
        assert driver.unfinished_requests() == len(tm.rid_to_state)
        assert driver.tokens_in_flight() == len(tm.rid_to_state[rids[0]].output_ids)
        tm.gate.set()
        await gen.aclose()
        assert driver.frontend_sequences("led") == {} and driver._finished_unread == {} and driver._live_rids == set()

    asyncio.run(main())


def test_a_sequence_sglang_finished_and_dropped_before_its_output_was_read_stays_in_the_ledger_until_read():
    """SGLang deletes a finished rid's state from its TokenizerManager before it hands the output on. A commit in
    between must still count that sequence (every token of it is older) rather than take it for one the engine
    never saw; once its last chunk is read it leaves the ledger's view, and a rid of no request being read (one
    aborted after its request ended) is not kept."""

    class DropsFirst(FakeTM):
        async def generate_request(self, obj, request):
            self.requests.append(obj)
            state = self.rid_to_state[obj.rid] = _State()
            state.output_ids += [65, 66]
            del self.rid_to_state[obj.rid]  # as SGLang's _handle_batch_output does at the finish
            await self.gate.wait()  # the output still on its way to the driver
            meta = {"finish_reason": {"type": "length"}, "prompt_tokens": len(obj.input_ids),
                    "output_token_logprobs": [(-0.5, t, None) for t in (65, 66)]}
            yield {"output_ids": [65, 66], "meta_info": meta}

    async def main():
        tm = DropsFirst([])
        driver = make(tm)
        tm.gate.clear()
        prepared = driver.prepare(SamplingParams(n=1, max_tokens=2, logprobs=True), stream=False)
        gen = driver.outputs("fin", [1], prepared, lambda: None)
        reading = asyncio.ensure_future(gen.__anext__())
        for _ in range(5):
            await asyncio.sleep(0)
        (rid,) = sequence_rids("fin", 1)
        assert rid not in tm.rid_to_state and driver.frontend_sequences("fin") == {0: rid}
        assert await driver._settled_counts() == {rid: 2}
        tm.gate.set()
        out = await reading
        assert out.outputs[0].token_ids == [65, 66] and driver.frontend_sequences("fin") == {}
        with pytest.raises(StopAsyncIteration):
            await gen.__anext__()
        tm.rid_to_state["other#0$"] = _State()
        del tm.rid_to_state["other#0$"]
        assert driver._finished_unread == {} and driver.frontend_token_counts() == {}

    asyncio.run(main())


def test_pause_modes_and_the_flush_only_when_idle():
    async def main():
        tm = FakeTM([])
        driver = make(tm)
        await driver.pause("keep")
        await driver.pause("abort")
        await driver.preempt()
        await driver.hold()
        await driver.run()
        assert tm.calls == ["pause:retract", "flush", "pause:abort", "flush", "pause:retract", "pause:in_place", "continue"]
        tm.rid_to_state["x"] = _State([1])
        tm.calls.clear()
        await driver.reset_prefix_cache()
        assert tm.calls == []  # requests parked: SGLang cannot flush; the salt covers new requests

    asyncio.run(main())


def test_sleep_aborts_then_releases_and_wake_takes_weights_then_kv():
    async def main():
        tm = FakeTM([])
        driver = make(tm)
        with pytest.raises(RuntimeError, match="level 1 keeps the weights.*enable_weights_cpu_backup"):
            await driver.sleep(1)
        await driver.sleep(2)
        await driver.wake(["weights"])
        await driver.wake(["kv_cache"])
        assert tm.calls == ["pause:abort", "release:None", "resume:['weights']", "resume:['kv_cache', 'cuda_graph']"]
        assert make(FakeTM([]), memory_saver=False).sleep_unsupported() and driver.sleep_unsupported() is None

    asyncio.run(main())


def test_sleep_and_an_abort_pause_wait_out_the_aborted_requests_themselves_before_sglang_s_pause():
    """SGLang's pause(abort) looks for requests in flight once a second; the driver aborts them and waits for
    them to leave first, so that SGLang's pause finds none (what cost the hybrid placement 1 s a step)."""
    async def main():
        for act in ("sleep", "pause"):
            tm = FakeTM([[[65]] * 1000])
            tm.chunk_s = 0.001
            driver = make(tm)
            prepared = driver.prepare(SamplingParams(max_tokens=1000, logprobs=True), stream=True)
            gen = driver.outputs("busy", [1], prepared, lambda: None)
            await gen.__anext__()
            reading = asyncio.ensure_future(_drain(gen))
            await (driver.sleep(2) if act == "sleep" else driver.pause("abort"))
            assert "" in tm.aborted and tm.model_update_lock.readers == 0
            assert "pause:abort found requests" not in tm.calls and "pause:abort" in tm.calls
            assert len(await reading) < 999  # the request ended early, aborted

    asyncio.run(main())


async def _drain(gen) -> list:
    return [out async for out in gen]


def test_a_control_call_that_never_answers_marks_the_engine_dead(monkeypatch):
    import asyncrl.generator.sglang_engine as mod

    monkeypatch.setattr(mod, "CONTROL_TIMEOUT_S", 0.05)

    async def main():
        driver = make(FakeTM([], hang="continue"))
        assert driver.dead() is None
        with pytest.raises(RuntimeError, match="did not answer continue_generation"):
            await driver.run()
        assert "continue_generation" in driver.dead()

    asyncio.run(main())


def test_server_kwargs_take_ours_then_engine_kwargs():
    from asyncrl.config import GeneratorConfig, ModelConfig

    gen = GeneratorConfig(engine="sglang", num_gpus=0.5, engine_kwargs={"attention_backend": "triton", "log_level": "info"})
    kw = server_kwargs(ModelConfig(), gen, port=1234, nccl_port=1235)
    assert kw["skip_tokenizer_init"] and kw["incremental_streaming_output"]
    assert (kw["port"], kw["nccl_port"], kw["mem_fraction_static"]) == (1234, 1235, 0.4)
    assert kw["attention_backend"] == "triton" and kw["log_level"] == "info"  # engine_kwargs win


def test_a_verified_push_is_handed_to_sglang_whole_with_its_version_and_no_cache_flush():
    """The replica's staging (shared files, staged in this process, the fingerprint check) through the driver's
    worker: the apply hands every tensor to `update_weights_from_tensor` (one payload per TP rank, flush_cache
    False, SGLang's label the version), after the ledger's count query; a corrupted tensor fails the check and
    never reaches SGLang; a refusal by SGLang is a failed apply."""
    import torch

    from asyncrl.generator.engine_update import FingerprintMismatch, WeightUpdates
    from asyncrl.interfaces import WorkerAPI
    from asyncrl.types import UpdateBegin
    from asyncrl.weightsync.fingerprint import tensor_fingerprint

    async def main():
        tm = FakeTM([])
        driver = make(tm, tp_size=2)
        weights = {"model.embed_tokens.weight": torch.randn(8, 4), "model.norm.weight": torch.ones(4)}
        fp = tensor_fingerprint(weights)
        staging = WeightUpdates("sg0", driver.worker_call)  # the replica's weight-update state alone, on SGLang's driver
        assert (await staging.check_layout())[0].direct is False

        async def push(version: int, tensors: dict) -> ApplyReport:
            await staging.load(dict(tensors), version, UpdateBegin(), 0)
            staging.check(version, fp)
            return await staging.apply(version, before=WorkerAPI.asyncrl_sampled_token_counts)

        applied = await push(5, weights)
        assert applied.path == "reload" and applied.before == [{}]
        (update,) = tm.updates
        kind, named = update.serialized_named_tensors[0]
        assert len(update.serialized_named_tensors) == 2 and update.flush_cache is False
        assert update.weight_version == "5" and kind == "ipc"
        assert tensor_fingerprint(dict(named)) == fp
        assert tm.calls.index("state") < tm.calls.index("update")  # the ledger's counts are read before the apply
        bad = dict(weights, **{"model.norm.weight": weights["model.norm.weight"] + 1e-3})
        with pytest.raises(FingerprintMismatch):
            await push(6, bad)
        await staging.drop()
        assert len(tm.updates) == 1  # the corrupted version never reached SGLang
        tm.update_answer = (False, "shape mismatch")
        with pytest.raises(RuntimeError, match="SGLang refused the weights: shape mismatch"):
            await push(7, weights)

    asyncio.run(main())


def test_tensors_on_a_received_storage_are_handed_on_from_one_copy_of_it_per_storage():
    """An ipc push's staged views map the sender's ring, which torch will not share again (SGLang's serializer
    raised "Attempted to send CUDA tensor received from another process" on the H200s): those storages are
    copied once each, their views rebuilt over the copy with the same values, dtypes, shapes and strides;
    tensors on this process's own storages go as they are."""
    import torch

    from asyncrl.generator.sglang_worker import own_storages, received_from_another_process

    ring = torch.arange(4096, dtype=torch.uint8)  # one bucket buffer: views of several dtypes at offsets
    a = torch.empty(0, dtype=torch.float32).set_(ring.untyped_storage(), 16, (8, 4), (4, 1))
    b = torch.empty(0, dtype=torch.bfloat16).set_(ring.untyped_storage(), 512, (6, 3), (1, 6))  # strided
    local = torch.randn(5)
    foreign = ring.untyped_storage().data_ptr()
    out = dict(own_storages([("a", a), ("b", b), ("c", local)], lambda st: st.data_ptr() == foreign))
    assert out["c"] is local and not received_from_another_process(local.untyped_storage())
    for name, t in (("a", a), ("b", b)):
        got = out[name]
        assert got.dtype == t.dtype and got.shape == t.shape and got.stride() == t.stride()
        assert got.storage_offset() == t.storage_offset() and torch.equal(got, t)
        assert got.untyped_storage().data_ptr() != foreign
    assert out["a"].untyped_storage().data_ptr() == out["b"].untyped_storage().data_ptr()  # one copy for both
    before = out["a"].clone()
    ring.zero_()  # the sender reuses its ring for the next push: the handed-on copy stays as it was
    assert torch.equal(out["a"], before)


def test_the_nccl_settings_sglang_sets_for_its_processes_are_put_back_in_the_replica_s(monkeypatch):
    """SGLang's start sets NCCL_CUMEM_ENABLE / NCCL_NVLS_ENABLE in the environment of the process building it (for
    the processes it spawns); weightsync's NCCL group is formed later in that process, with a sender that keeps its
    own: the values from before the start come back (unset ones unset), and the engine saw SGLang's."""
    import os

    from asyncrl.generator.sglang_engine import start_engine, stop_engine

    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    seen = {}

    class _SetsEnv:
        def __init__(self, **kwargs):
            os.environ["NCCL_CUMEM_ENABLE"], os.environ["NCCL_NVLS_ENABLE"] = "0", "0"  # as _set_envs_and_config
            seen.update(cumem=os.environ["NCCL_CUMEM_ENABLE"], nvls=os.environ["NCCL_NVLS_ENABLE"])

        def shutdown(self):
            pass

    engine = start_engine({}, factory=_SetsEnv)
    try:
        assert seen == {"cumem": "0", "nvls": "0"}
        assert os.environ["NCCL_CUMEM_ENABLE"] == "1" and "NCCL_NVLS_ENABLE" not in os.environ
    finally:
        stop_engine(engine)


def _child_that_dies_with_its_parent_thread(ready) -> None:
    """What SGLang's scheduler and detokenizer do first: SIGKILL me when my parent (thread) dies."""
    import ctypes
    import signal
    import time

    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    ready.set()
    time.sleep(120)


class _EngineWithAChild:
    """An engine whose constructor starts a child process as SGLang's does (fork here: spawn would re-import
    this test module in the child)."""

    def __init__(self, **kwargs: Any) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        ready = ctx.Event()
        self.proc = ctx.Process(target=_child_that_dies_with_its_parent_thread, args=(ready,), daemon=True)
        self.proc.start()
        assert ready.wait(30)
        self.kwargs = kwargs

    def shutdown(self) -> None:
        self.proc.terminate()
        self.proc.join(10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_engine_s_processes_outlive_its_start_until_it_is_stopped():
    # SGLang's children get SIGKILL when the thread that started them ends: a build thread that ended after the
    # build killed every replica's engine right after it came up (H200s, 2026-11-28)
    import threading
    import time

    from asyncrl.generator.sglang_engine import start_engine, stop_engine

    before = set(threading.enumerate())  # (threads, not names: an earlier test's may still be ending)
    engine = start_engine({"model_path": "m"}, factory=_EngineWithAChild)
    assert engine.kwargs == {"model_path": "m"}
    time.sleep(0.5)
    assert engine.proc.is_alive() and engine.proc.exitcode is None
    (starter,) = [t for t in threading.enumerate() if t not in before and t.name == "sglang-engine"]
    stop_engine(engine)
    assert not engine.proc.is_alive()
    starter.join(5)
    assert not starter.is_alive()


def test_an_unknown_engine_kwarg_is_a_config_error_from_the_start_thread():
    from asyncrl.config import ConfigError
    from asyncrl.generator.sglang_engine import start_engine

    def engine(*, model_path: str) -> None:  # (ServerArgs refuses a key it does not have with a TypeError)
        raise AssertionError("not reached")

    with pytest.raises(ConfigError, match="generator.engine_kwargs: .*no_such_key"):
        start_engine({"model_path": "m", "no_such_key": 1}, factory=engine)
