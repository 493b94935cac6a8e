"""The replica's adapter to SGLang: `SglangDriver` (driver.py's `EngineDriver` for SGLang), starting it, every call
into it and every read of its state (docs/design/sglang-engine.md).

Owns: SGLang's server arguments from `ModelConfig` + `GeneratorConfig` (`engine_kwargs` win), the engine built in a
thread of its own and driven through its TokenizerManager's coroutines on the replica's event loop, one SGLang
request per sequence (sglang_protocol.py), text decoding, the pause modes, sleep / wake through SGLang's memory
saver, the prefix cache's version salt, and the weight worker in this process (sglang_worker.py).
Differs from vLLM on purpose: each request is admitted with `extra_key=f"w{version}"`, so none admitted after a
commit reuses an older version's KV; per-token versions come from the replica's ledger; sleep aborts the requests
in flight (they finish with "abort").
Must never: import SGLang at module import time, or serve a request (the replica does).
Details: docs/design/generator.md, "The SGLang driver".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import random
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.config import ConfigError, GeneratorConfig, ModelConfig
from asyncrl.generator.sglang_protocol import SequenceOutput, find_stop, read_chunk, refused, sequence_rids, to_sglang

logger = logging.getLogger(__name__)

ABORT_DRAIN_S = 10.0  # how long the driver itself waits for aborted requests to leave SGLang (then SGLang's own wait)
CONTROL_TIMEOUT_S = 120.0  # a control call (pause, continue, memory, state) SGLang has not answered by then: dead
START_TIMEOUT_S = 1800.0


GRPC_OFFSET = 10000  # SGLang 0.5.15 derives its gRPC port as --port + this, and refuses one over 65535


def engine_ports() -> tuple[int, int]:
    """(port, nccl_port) for one engine: free now, with `port + GRPC_OFFSET` free too. An OS-chosen port is
    often above 55535, which SGLang refuses at start ("SGLANG_GRPC_PORT (66149) must be between 1 and 65535");
    candidates come from below that instead."""
    def free(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("", port))
                return True
            except OSError:
                return False

    rng = random.Random()
    picked: list[int] = []
    for _ in range(1000):
        port = rng.randrange(20000, 65535 - GRPC_OFFSET)
        if port not in picked and free(port) and (picked or free(port + GRPC_OFFSET)):
            picked.append(port)
            if len(picked) == 2:
                return picked[0], picked[1]
    raise RuntimeError("no free port pair for an SGLang engine below 55535")


def server_kwargs(model: ModelConfig, gen: GeneratorConfig, *, port: int, nccl_port: int) -> dict[str, Any]:
    """`sglang.Engine`'s keyword arguments (its `ServerArgs`); `engine_kwargs` win over ours."""
    kwargs: dict[str, Any] = {
        "model_path": str(Path(model.path).resolve()),
        "served_model_name": model.served_name,
        "dtype": model.dtype,
        "context_length": model.max_model_len,
        "trust_remote_code": model.trust_remote_code,
        "skip_tokenizer_init": True,  # token ids in and out; the text is decoded here
        "incremental_streaming_output": True,  # each chunk holds only its new tokens
        "port": port,  # replicas that share a host start at once: ports of their own, not SGLang's random picks
        "nccl_port": nccl_port,
        "log_level": "error",
        # Weights and KV: this share of the GPU, leaving room for the replica's own staging of a pushed version.
        "mem_fraction_static": round(0.8 * gen.num_gpus, 3) if 0 < gen.num_gpus < 1 else 0.8,
    }
    kwargs.update(gen.engine_kwargs)
    return kwargs


def start_engine(kwargs: dict[str, Any], factory: Callable[..., Any] | None = None) -> Any:
    """An `sglang.Engine` (or `factory(**kwargs)`), built in a thread of its own that then lives as long as the
    engine: SGLang pins its loop to the thread that first uses it and runs `run_until_complete` in its
    synchronous calls, which must not be the replica's loop; and its scheduler and detokenizer processes ask
    the kernel for SIGKILL when their parent dies (PR_SET_PDEATHSIG), where the parent is the thread that
    started them. A build thread that ended after the build killed them, and SGLang then took the replica
    down with them (every replica died right after it came up). `stop_engine` ends both."""

    def build() -> Any:
        kept = {key: os.environ.get(key) for key in NCCL_SET_BY_SGLANG}
        try:
            if factory is not None:
                return factory(**kwargs)
            import sglang

            return sglang.Engine(**kwargs)
        finally:
            _restore_env(kept)

    built: concurrent.futures.Future = concurrent.futures.Future()
    release = threading.Event()

    def run() -> None:
        try:
            engine = build()
        except TypeError as err:  # an engine_kwargs key that ServerArgs does not have
            built.set_exception(ConfigError(f"generator.engine_kwargs: {err}"))
            return
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            built.set_exception(err)
            return
        built.set_result(engine)
        release.wait()  # (SGLang's processes die with this thread)

    threading.Thread(target=run, name="sglang-engine", daemon=True).start()
    engine = built.result(START_TIMEOUT_S)
    _KEEPERS[id(engine)] = release
    return engine


_KEEPERS: dict[int, threading.Event] = {}  # per engine, the event its starting thread waits on

# SGLang's start sets these for the processes it spawns (NCCL_CUMEM_ENABLE=0, NCCL_NVLS_ENABLE=0: its
# _set_envs_and_config), in the environment of the process that builds the engine: ours, where weightsync's NCCL
# group for this replica is formed later. The members of a communicator should agree on them, and the sender (a
# learner rank) keeps its own process's (NCCL's defaults unless set): the push into SGLang over NCCL failed at
# ncclCommInitRank with "internal error" while SGLang's values stood here. They are put back once SGLang's
# processes have started, which keep SGLang's.
NCCL_SET_BY_SGLANG = ("NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE", "NCCL_GRAPH_MIXING_SUPPORT")


def _restore_env(kept: dict[str, str | None]) -> None:
    for key, value in kept.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def stop_engine(engine: Any) -> None:
    """Shut `engine` down, then let the thread that started it end."""
    try:
        engine.shutdown()
    finally:
        release = _KEEPERS.pop(id(engine), None)
        if release is not None:
            release.set()


class _WatchedStates(dict):
    """SGLang's TokenizerManager.rid_to_state, which notes the final token count of each sequence of a request
    still being read (`live` rids) that it drops, in `finished_unread`, where the driver forgets it once read."""

    def __init__(self, states: dict, live: set[str], finished_unread: dict[str, int]) -> None:
        super().__init__(states)
        self.live, self.finished_unread = live, finished_unread

    def _note(self, rid: Any) -> None:
        state = dict.get(self, rid)
        if state is not None and rid in self.live:
            self.finished_unread[rid] = len(getattr(state, "output_ids", ()) or ())

    def __delitem__(self, rid: Any) -> None:
        self._note(rid)
        super().__delitem__(rid)

    def pop(self, rid: Any, *default: Any) -> Any:
        self._note(rid)
        return super().pop(rid, *default)


def _window_text(decode: Callable[[list[int]], str], ids: list[int], window: int, done: int,
                 upto: int) -> tuple[str, bool]:
    """The text ids[done:upto] add after ids[window:done], as vLLM's incremental detokenizer makes it (the text of
    the ids from the window's start, less that of the window), and whether it ends on a whole character (not one
    cut in two, whose rest comes with the next token)."""
    before = decode(ids[window:done])
    now = decode(ids[window:upto])
    return (now[len(before):] if now.startswith(before) else now), not now.endswith("\ufffd")


class _TextTail:
    """A sequence's text as its tokens come, each chunk decoding only a short window of ids (the text of the ids
    from the window's start, less that of the window; a token that ends mid-character waits for the next), and how
    far stop strings were looked for in it: a stop-string request costs a decode of its whole text only once, where
    a stop string is found, not at every chunk (which made it quadratic in the response's length)."""

    __slots__ = ("ids", "window", "done", "text", "latest", "searched", "searched_ids")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.window = self.done = 0
        self.text = ""  # the text of ids[:done]
        self.latest = ""  # the text of every id so far, less a character still cut in two at its end
        self.searched = self.searched_ids = 0  # the text looked at so far, in characters, and its ids

    def advance(self, decode: Callable[[list[int]], str], new: list[int]) -> str:
        self.ids.extend(new)
        add, whole = _window_text(decode, self.ids, self.window, self.done, len(self.ids))
        if not whole:  # (the window stays: the next chunk decodes the character whole)
            self.latest = self.text + add.rstrip("\ufffd")
        else:
            self.text += add
            self.latest = self.text
            self.window, self.done = self.done, len(self.ids)
        return self.latest


@dataclass
class _Prepared:
    per_sequence: list[dict[str, Any]]  # SGLang sampling_params, one per sequence
    logprobs: bool
    stream: bool
    stop_token_ids: list[int]
    stop: list[str]  # stop strings: matched here, on the decoded text (SGLang runs without its tokenizer)
    # per sequence: [ids so far, decode window start, read up to, text emitted (stop strings)]
    text_state: dict[int, list[Any]] = field(default_factory=dict)
    tails: dict[int, _TextTail] = field(default_factory=dict)  # per sequence with stop strings: its text so far


@dataclass
class _Output:
    outputs: list[SequenceOutput]


class SglangDriver:
    """The replica's SGLang engine (`asyncrl.generator.driver.EngineDriver`)."""

    name = "sglang"
    stamps_versions = False  # the replica keeps a ledger

    def __init__(self, engine: Any, *, tokenizer: Any, vocab_size: int, deterministic: bool, memory_saver: bool,
                 cpu_backup: bool, tp_size: int) -> None:
        from asyncrl.generator.sglang_worker import SglangHooks, SglangWorker, run_on

        self.engine = engine
        self.tm = engine.tokenizer_manager
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.deterministic, self.memory_saver, self.cpu_backup = deterministic, memory_saver, cpu_backup
        self.loop = asyncio.get_running_loop()
        self.salt_version = 0  # the live version: new requests' cache salt
        self._dead: str | None = None
        self._rids: dict[str, list[str]] = {}  # per request in flight, its sequences' rids
        # Sequences of ours that SGLang finished and dropped from its TokenizerManager before our `outputs` read
        # their last chunk, with their final token counts: SGLang deletes a finished rid's state before it hands the
        # output on, and the ledger must still see them at a commit in between (every token of theirs is older).
        self._finished_unread: dict[str, int] = {}
        self._live_rids: set[str] = set()  # the rids of the requests `outputs` is reading
        self.tm.rid_to_state = _WatchedStates(self.tm.rid_to_state, self._live_rids, self._finished_unread)
        call = run_on(self.loop)
        self.worker = SglangWorker(SglangHooks(self.tm, tp_size, call), lambda: call(self._settled_counts(), CONTROL_TIMEOUT_S))

    @classmethod
    def start(cls, model: ModelConfig, gen: GeneratorConfig) -> "SglangDriver":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("generator.engine=sglang: the SGLang engine needs a GPU (it has no CPU backend here); "
                              "use engine: vllm")
        from transformers import AutoTokenizer

        from asyncrl.generator.owner_watch import mark_owner

        mark_owner()  # SGLang's processes inherit it and end with this one (owner_watch.py)
        port, nccl_port = engine_ports()
        kwargs = server_kwargs(model, gen, port=port, nccl_port=nccl_port)
        t = time.perf_counter()
        root = logging.getLogger()
        level, handlers = root.level, list(root.handlers)
        engine = start_engine(kwargs)
        root.setLevel(level)  # SGLang configures the root logger as it starts: the replica's logging stays its own
        root.handlers[:] = handlers
        logger.info("SGLang engine up in %.1f s", time.perf_counter() - t)
        tokenizer = AutoTokenizer.from_pretrained(kwargs["model_path"], trust_remote_code=model.trust_remote_code)
        vocab = int(getattr(engine.tokenizer_manager.model_config, "vocab_size", 0) or len(tokenizer))
        return cls(engine, tokenizer=tokenizer, vocab_size=vocab,
                   deterministic=bool(kwargs.get("enable_deterministic_inference")),
                   memory_saver=bool(kwargs.get("enable_memory_saver")),
                   cpu_backup=bool(kwargs.get("enable_weights_cpu_backup")),
                   tp_size=int(kwargs.get("tp_size", 1)))

    async def _control(self, coro: Any, what: str, timeout: float | None = None) -> Any:
        """A control call under our deadline: SGLang's have none, and cancelling one jams its kind for good,
        so one that does not answer marks the engine dead (the replica is then replaced)."""
        timeout = CONTROL_TIMEOUT_S if timeout is None else timeout
        try:
            return await asyncio.wait_for(coro, timeout)
        except asyncio.TimeoutError:
            self._dead = f"SGLang did not answer {what} within {timeout:g} s"
            raise RuntimeError(self._dead) from None

    # ---- generation ----------------------------------------------------------------------

    def prepare(self, sampling: Any, *, stream: bool) -> _Prepared:
        return _Prepared(to_sglang(sampling, deterministic=self.deterministic), bool(sampling.logprobs), stream,
                         list(sampling.stop_token_ids), [s for s in sampling.stop if s])

    async def outputs(self, engine_id: str, prompt_ids: list[int], prepared: _Prepared,
                      handed_over: Any) -> AsyncIterator[_Output]:
        """One SGLang request per sequence; each engine output holds the chunks that arrived together. A
        streamed request, or one with stop strings (matched here, on the text as it comes), gets SGLang's
        incremental chunks; any other comes whole at its end (SGLang's stream=False: no Python step per token per
        request in its TokenizerManager or here: more tokens/s than per-step chunks in-process, docs/BENCHMARKS.md),
        while its `rid_to_state` entry still grows token by token, which is what the ledger reads at a commit.
        `handed_over` at the first chunk: before it a sequence is either waiting out a pause in the
        TokenizerManager (not yet in the engine) or in its `rid_to_state` (the ledger reads it there).
        Closed early, cancelled or failed, every sequence still running is aborted in SGLang."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        rids = self._rids[engine_id] = sequence_rids(engine_id, len(prepared.per_sequence))
        self._live_rids.update(rids)
        salt = f"w{self.salt_version}"
        chunked = prepared.stream or bool(prepared.stop)
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, rid: str, params: dict[str, Any]) -> None:
            try:
                request = GenerateReqInput(input_ids=list(prompt_ids), sampling_params=params, rid=rid, stream=chunked,
                                           return_logprob=prepared.logprobs, logprob_start_len=-1, extra_key=salt)
                async for chunk in self.tm.generate_request(request, None):
                    queue.put_nowait((index, chunk))
                queue.put_nowait((index, None))
            except BaseException as err:  # noqa: BLE001 - handed to the consumer, which raises it
                out = refused(err)
                queue.put_nowait((index, out))
                if isinstance(out, dict):  # (a server abort, read as a stream's last chunk)
                    queue.put_nowait((index, None))

        tasks = [asyncio.ensure_future(pump(i, rid, p)) for i, (rid, p) in enumerate(zip(rids, prepared.per_sequence))]
        running = set(range(len(rids)))
        first = True
        try:
            while running:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                outs = []
                for index, item in batch:
                    if item is None or (prepared.stop and index not in running and index in prepared.tails):
                        running.discard(index)  # (a sequence cut at a stop string: its later chunks are dropped)
                        continue
                    if isinstance(item, BaseException):
                        raise item
                    if first:
                        handed_over()
                        first = False
                    seq = read_chunk(index, item, logprobs=prepared.logprobs, stop_token_ids=prepared.stop_token_ids)
                    if prepared.stop and seq.finish_reason != "abort":
                        tail = prepared.tails.setdefault(index, _TextTail())
                        if self._cut_at_stop(seq, prepared.stop, tail) and index in running:
                            running.discard(index)
                            self.tm.abort_request(rid=rids[index])  # (its stream ends; what comes after is dropped)
                    if seq.finish_reason is not None:
                        running.discard(index)
                        self._finished_unread.pop(rids[index], None)  # (read: its versions are the ledger's now)
                    outs.append(seq)
                if outs:
                    yield _Output(outs)
        finally:
            self._rids.pop(engine_id, None)
            for rid in rids:
                self._live_rids.discard(rid)
                self._finished_unread.pop(rid, None)
            for index in running:
                self.tm.abort_request(rid=rids[index])
            for task in tasks:
                task.cancel()

    def _decode(self, ids: list[int]) -> str:
        """The text of `ids` as vLLM's detokenizer makes it (special tokens skipped)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _cut_at_stop(self, seq: SequenceOutput, stops: list[str], tail: _TextTail) -> bool:
        """Cut `seq` (the last chunk, added here at the end of `tail.ids`) at the first stop string its tokens
        complete: the tokens up to the one that completed it kept (vLLM's rule; `read` leaves the string out of
        the text), finish "stop" with the string as stop reason. Whether it cut. The text is looked at only where a
        stop string could have been completed since the last look (`tail`); where one is, the whole ids are decoded
        once to cut."""
        text = tail.advance(self._decode, seq.token_ids)
        ids = tail.ids
        start = max(tail.searched - max(len(x) for x in stops) + 1, 0)
        new = len(ids) - tail.searched_ids  # (the ids since the last look: a character cut in two delays a look)
        hit = len(text) != tail.searched and any(x in text[start:] for x in stops)
        if hit or len(text) > tail.searched:
            tail.searched, tail.searched_ids = len(text), len(ids)
        if not hit:
            return False
        found = find_stop(self._decode, ids, new, stops)
        if found is None:
            return False
        keep, stop, _ = found
        drop = len(ids) - keep
        if drop:
            del seq.token_ids[len(seq.token_ids) - drop:]
            del ids[keep:]
            if seq.logprobs is not None:
                del seq.logprobs[len(seq.logprobs) - drop:]
        seq.finish_reason, seq.stop_reason = "stop", stop
        return True

    def routes(self, sequence: SequenceOutput) -> bytes | None:
        return None  # (routing replay reads vLLM's routed experts; the config refuses it with SGLang)

    def read(self, sequence: SequenceOutput, new: list[int], prepared: _Prepared) -> tuple[list[float] | None, str]:
        """The sampled tokens' log-probs, and the text they add: streamed, decoded incrementally as they come
        (the text of the ids after a short window, less that of the window; a token that ends mid-character
        waits for the next); final-only, the whole completion at its end. Either way as vLLM's detokenizer
        gives it: special tokens skipped, a stop token (EOS or one of stop_token_ids) left out."""
        state = prepared.text_state.setdefault(sequence.index, [[], 0, 0, 0])
        ids = state[0]
        ids.extend(new)
        finished = sequence.finish_reason is not None
        if not prepared.stream and not finished:
            return sequence.logprobs, ""
        by_string = isinstance(sequence.stop_reason, str)  # a stop string: its token stays, the string leaves the text
        upto = len(ids) - 1 if sequence.finish_reason == "stop" and ids and not by_string else len(ids)
        if prepared.stop:  # the text held back by the longest stop string less one, until it cannot start one
            tail = prepared.tails.get(sequence.index)
            if not finished and tail is not None and len(tail.ids) == len(ids):
                full = tail.latest  # (the text `outputs` looked for stop strings in, up to this chunk)
            else:
                full = self._decode(ids[:upto])  # (at the end, once; or a chunk read after a later one was looked at)
            if by_string and sequence.stop_reason in full:
                full = full[: full.find(sequence.stop_reason)]
            elif not finished:
                full = full[: max(len(full) - max(len(x) for x in prepared.stop) + 1, 0)].rstrip("\ufffd")
            if not prepared.stream:
                return sequence.logprobs, full
            delta, state[3] = full[state[3]:], max(state[3], len(full))
            return sequence.logprobs, delta
        if not prepared.stream:
            return sequence.logprobs, self._decode(ids[:upto])
        window, done = state[1], min(state[2], upto)
        text, whole = _window_text(self._decode, ids, window, done, upto)
        if not whole and not finished:
            return sequence.logprobs, ""  # a character cut in two: its rest comes with the next token
        state[1], state[2] = done, upto
        return sequence.logprobs, text

    # ---- scheduling ------------------------------------------------------------------------

    async def pause(self, mode: str) -> None:
        """keep: SGLang's retract (running requests go back to the queue and re-prefill after the resume);
        abort: every request in flight aborted; wait: the requests in flight finish first, then a retract.
        The prefix cache is salted by version (`outputs`), and flushed here when nothing is in flight."""
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        if mode == "wait":
            while self.unfinished_requests():
                await asyncio.sleep(0.01)
        if mode == "abort":
            await self._abort_in_flight()
        sglang_mode = {"keep": "retract", "wait": "retract", "abort": "abort"}[mode]
        await self._control(self.tm.pause_generation(PauseGenerationReqInput(mode=sglang_mode)), f"pause({sglang_mode})")
        await self.reset_prefix_cache()

    async def _abort_in_flight(self) -> None:
        """Abort every request in flight and wait, looking every 2 ms, until SGLang holds none (its
        `model_update_lock` free: each request holds it as a reader until its output is handed on). SGLang's own
        pause(abort) does the same but sleeps 1 s between looks: with a request in flight every sleep of the hybrid
        placement would cost a second. Past ABORT_DRAIN_S, or a
        request that came in since, SGLang's pause goes on waiting its own way."""
        lock = getattr(self.tm, "model_update_lock", None)
        if lock is None:
            return
        end, looks = time.monotonic() + ABORT_DRAIN_S, 0
        while await lock.is_locked() and time.monotonic() < end:
            if looks % 25 == 0:  # (again every 50 ms: one that reached SGLang's queue since)
                self.tm.abort_request(abort_all=True)
            looks += 1
            await asyncio.sleep(0.002)

    async def preempt(self) -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        await self._control(self.tm.pause_generation(PauseGenerationReqInput(mode="retract")), "pause(retract)")

    async def hold(self) -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        await self._control(self.tm.pause_generation(PauseGenerationReqInput(mode="in_place")), "pause(in_place)")

    async def run(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        await self._control(self.tm.continue_generation(ContinueGenerationReqInput()), "continue_generation")

    def sleep_unsupported(self) -> str | None:
        if not self.memory_saver:
            return "engine started without enable_memory_saver (set generator.engine_kwargs.enable_memory_saver)"
        return None

    async def sleep(self, level: int) -> None:
        """Release weights and KV memory. SGLang releases only an idle scheduler, so the requests in flight
        are aborted first (not kept, as vLLM keeps them). Level 1 keeps the weights in host memory, which
        needs SGLang's CPU backup of them."""
        from sglang.srt.managers.io_struct import PauseGenerationReqInput, ReleaseMemoryOccupationReqInput

        if level == 1 and not self.cpu_backup:
            raise RuntimeError("sleep level 1 keeps the weights in host memory: start SGLang with "
                               "generator.engine_kwargs.enable_weights_cpu_backup, or sleep at level 2")
        await self._abort_in_flight()
        await self._control(self.tm.pause_generation(PauseGenerationReqInput(mode="abort")), "pause(abort)")
        await self._control(self.tm.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=None), None),
                            "release_memory_occupation")

    async def wake(self, tags: list[str]) -> None:
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        for tag in tags:  # ("weights", "kv_cache") in that order; SGLang's CUDA graphs come back with the KV
            theirs = ["weights"] if tag == "weights" else ["kv_cache", "cuda_graph"]
            await self._control(self.tm.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=theirs), None),
                                f"resume_memory_occupation({theirs})")

    # ---- weights ---------------------------------------------------------------------------

    async def worker_call(self, verb: str, args: tuple, timeout: float | None) -> list[Any]:
        """The verb on this replica's own weight worker, in a thread (it waits on the wire and on SGLang's
        load, which runs on this loop)."""
        method = getattr(self.worker, verb)
        return [await asyncio.wait_for(asyncio.to_thread(method, *args), timeout)]

    async def _settled_counts(self) -> dict[str, int]:
        """Output tokens per rid as the TokenizerManager holds them, after one control round trip behind
        the pause (every output the scheduler sent before it has then arrived)."""
        await self._control(self.tm.get_internal_state(), "get_internal_state")
        return self.frontend_token_counts()

    async def relabel(self, version: int) -> None:
        self.salt_version = version  # requests admitted from now on get this version's cache salt

    async def reset_prefix_cache(self) -> None:
        """Flush SGLang's radix cache when nothing is in flight (it cannot with requests parked); otherwise the
        version salt keeps new requests off the old KV, which ages out."""
        if self.unfinished_requests():
            return
        out = await self._control(self.tm.flush_cache(timeout_s=1.0), "flush_cache")
        if not getattr(out, "success", True):
            logger.info("SGLang did not flush its prefix cache: %s", getattr(out, "message", out))

    # ---- reads -------------------------------------------------------------------------------

    def live_version_starts(self, engine_id: str) -> dict[int, list[tuple[str, int]]]:
        return {}  # (no engine stamps: the ledger)

    def frontend_sequences(self, engine_id: str) -> dict[int, str]:
        """The rid of each sequence of `engine_id` the TokenizerManager still holds, or finished with its output
        not yet read here, by index."""
        held, gone = self.tm.rid_to_state, self._finished_unread
        return {i: rid for i, rid in enumerate(self._rids.get(engine_id, ())) if rid in held or rid in gone}

    def frontend_token_counts(self) -> dict[str, int]:
        return {**self._finished_unread,
                **{rid: len(state.output_ids) for rid, state in list(self.tm.rid_to_state.items())}}

    def unfinished_requests(self) -> int:
        return len(self.tm.rid_to_state)

    def tokens_in_flight(self) -> int:
        return sum(len(state.output_ids) for state in list(self.tm.rid_to_state.values()))

    def dead(self) -> str | None:
        return self._dead

    def shutdown(self) -> None:
        stop_engine(self.engine)
