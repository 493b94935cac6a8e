"""Rule rewards run in a pool of killable worker processes, with a timeout per call.

Owns: resolving the reward function ('module:function'), the worker processes (spawned, never forked), dispatching
one call per idle worker, turning every failure into an INVALID_REWARD outcome, and the `reward/*` counters. A call
past `timeout_s` (or whose worker dies) gets its worker killed; the next call starts a fresh one. Replies are
awaited with `add_reader`, never blocking the event loop; use one pool from one event loop.
Why not ProcessPoolExecutor: it cannot cancel a running task, so one endless reward would hold a worker for ever.
Must never: score a failed call as 0, let a stuck reward function wedge the pool, or run a reward function in the
caller's process.
Details: docs/design/rewards.md, "The reward pool".
"""

from __future__ import annotations

import asyncio
import importlib
import math
import multiprocessing
import numbers
import sys
from multiprocessing.connection import Connection
from typing import Any, Callable, NamedTuple

from asyncrl.config import RewardConfig
from asyncrl.types import SampleStatus

_START_TIMEOUT_S = 60.0  # a spawned worker imports the reward module; slow on a loaded machine
_MAX_ERROR_CHARS = 500


TokenIds = list[tuple[list[int], list[int]]]  # (prompt ids, response ids) per completion


class RewardFunctionError(ValueError):
    """The configured reward function path does not resolve to a callable."""


class RewardPoolError(RuntimeError):
    """The pool is closed, or a worker could not start."""


class RewardOutcome(NamedTuple):
    reward: float | None  # None unless status is VALID
    status: SampleStatus  # VALID or INVALID_REWARD
    error: str | None  # why the reward is invalid


def resolve_reward_function(path: str, what: str = "reward function") -> Callable[..., Any]:
    """Import 'module:function' (the function part may be dotted); raise RewardFunctionError naming
    `what` (also rollout.function's loader, asyncrl/trainer/agent.py)."""
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        raise RewardFunctionError(f"{what} {path!r} must look like 'package.module:function'")
    module_name, attr_path = path.split(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or anything the module raises at import
        raise RewardFunctionError(f"{what} {path!r}: cannot import {module_name!r}: {type(err).__name__}: {err}") from None
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise RewardFunctionError(f"{what} {path!r}: {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise RewardFunctionError(f"{what} {path!r} is a {type(obj).__name__}, not callable")
    return obj


def _worker_main(conn: Connection, function_path: str, sys_path: list[str]) -> None:
    """Body of one worker process: load the function, then answer calls until EOF or None."""
    sys.path[:0] = [p for p in sys_path if p not in sys.path]  # forkserver does not forward it
    try:
        fn = resolve_reward_function(function_path)
    except RewardFunctionError as err:
        conn.send(("fatal", str(err)))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        completion, answer, metadata = msg
        try:
            value = fn(completion, answer, metadata)
            if value is None:
                reply: tuple[str, Any] = ("none", None)
            elif isinstance(value, numbers.Real):
                reply = ("ok", float(value))
            else:
                reply = ("error", f"returned {type(value).__name__}, not a number")
        except Exception as err:
            reply = ("error", f"{type(err).__name__}: {err}"[:_MAX_ERROR_CHARS])
        conn.send(reply)


class _Worker:
    def __init__(self, ctx: Any, function_path: str) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self._child = child
        self.proc = ctx.Process(target=_worker_main, args=(child, function_path, list(sys.path)), daemon=True)

    def start(self) -> None:
        self.proc.start()
        self._child.close()  # so the parent sees EOF when the worker dies

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()  # SIGKILL: a stuck reward function may ignore SIGTERM
        self.proc.join(timeout=5)
        self.conn.close()


def _invalid(error: str) -> RewardOutcome:
    return RewardOutcome(reward=None, status=SampleStatus.INVALID_REWARD, error=error)


class RewardPool:
    """`await pool.score(completions, answers, metadata)` -> one RewardOutcome per completion."""

    def __init__(self, config: RewardConfig, *, start_method: str = "spawn") -> None:
        if not isinstance(config, RewardConfig):
            raise TypeError(f"config must be a RewardConfig, got {type(config).__name__}")
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method={start_method!r} must be 'spawn' or 'forkserver' (fork is unsafe here)")
        resolve_reward_function(config.function)  # fail at construction, with the path in the message
        self.config = config
        self._ctx = multiprocessing.get_context(start_method)
        self._slots = asyncio.Semaphore(config.num_workers)
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._closed = False
        self._counts = dict.fromkeys(("calls", "timeouts", "errors", "invalid", "worker_starts"), 0)

    async def score(
        self, completions: list[str], answers: list[str], metadata: list[dict[str, Any]] | None = None,
        token_ids: TokenIds | None = None,
    ) -> list[RewardOutcome]:
        """One outcome per completion. `token_ids` ((prompt ids, response ids) per completion) is for
        scorers that read tokens (reward.kind model); a rule function reads the text."""
        if metadata is None:
            metadata = [{} for _ in completions]
        if not all(isinstance(x, list) for x in (completions, answers, metadata)):
            raise TypeError("completions, answers and metadata must be lists")
        if not len(completions) == len(answers) == len(metadata):
            raise ValueError(
                f"lengths differ: {len(completions)} completions, {len(answers)} answers, {len(metadata)} metadata"
            )
        for i, (c, a, m) in enumerate(zip(completions, answers, metadata)):
            if not isinstance(c, str) or not isinstance(a, str) or not isinstance(m, dict):
                raise TypeError(f"item {i}: expected (str, str, dict), got ({type(c).__name__}, {type(a).__name__}, {type(m).__name__})")
        if self._closed:
            raise RewardPoolError("reward pool is closed")
        return list(await asyncio.gather(*(self._score_one(c, a, m) for c, a, m in zip(completions, answers, metadata))))

    async def _score_one(self, completion: str, answer: str, metadata: dict[str, Any]) -> RewardOutcome:
        worker = await self._checkout()
        healthy = False
        self._counts["calls"] += 1
        try:
            outcome, healthy = await self._call(worker, (completion, answer, metadata))
        finally:
            self._checkin(worker, healthy)
        if outcome.status != SampleStatus.VALID:
            self._counts["invalid"] += 1
        return outcome

    async def _call(self, worker: _Worker, payload: tuple[str, str, dict[str, Any]]) -> tuple[RewardOutcome, bool]:
        try:
            worker.conn.send(payload)
        except Exception as err:  # unpicklable metadata; nothing reached the worker
            self._counts["errors"] += 1
            return _invalid(f"could not send the call to the worker: {type(err).__name__}: {err}"), True
        try:
            kind, value = await self._recv(worker, self.config.timeout_s)
        except TimeoutError:
            self._counts["timeouts"] += 1
            return _invalid(f"reward function timed out after {self.config.timeout_s}s (worker killed)"), False
        except (EOFError, OSError):
            self._counts["errors"] += 1
            why = "reward pool closed" if self._closed else f"worker died (exit code {worker.proc.exitcode})"
            return _invalid(why), False
        if kind == "error":
            self._counts["errors"] += 1
            return _invalid(str(value)), True
        if kind == "none":
            return _invalid("reward function returned None"), True
        if not math.isfinite(value):
            return _invalid(f"reward function returned {value}"), True
        return RewardOutcome(reward=value, status=SampleStatus.VALID, error=None), True

    @staticmethod
    async def _recv(worker: _Worker, timeout: float) -> tuple[str, Any]:
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        fd = worker.conn.fileno()
        loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
        try:
            await asyncio.wait_for(readable, timeout)
        finally:
            loop.remove_reader(fd)
        return worker.conn.recv()  # EOFError when the worker died

    async def _checkout(self) -> _Worker:
        await self._slots.acquire()
        try:
            if self._closed:
                raise RewardPoolError("reward pool is closed")
            if self._idle:
                return self._idle.pop()
            return await self._start_worker()
        except BaseException:
            self._slots.release()
            raise

    def _checkin(self, worker: _Worker, healthy: bool) -> None:
        if healthy and not self._closed:
            self._idle.append(worker)
        else:
            self._all.discard(worker)
            worker.kill()
        self._slots.release()

    async def _start_worker(self) -> _Worker:
        worker = _Worker(self._ctx, self.config.function)
        self._all.add(worker)
        self._counts["worker_starts"] += 1
        try:
            await asyncio.to_thread(worker.start)
            kind, value = await self._recv(worker, _START_TIMEOUT_S)
        except (TimeoutError, EOFError, OSError) as err:
            self._all.discard(worker)
            worker.kill()
            raise RewardPoolError(f"reward worker for {self.config.function!r} failed to start: {type(err).__name__}") from None
        if kind != "ready":
            self._all.discard(worker)
            worker.kill()
            raise RewardPoolError(f"reward worker could not load the function: {value}")
        return worker

    def metrics(self) -> dict[str, float]:
        return {f"reward/{k}": float(v) for k, v in self._counts.items()}

    def close(self) -> None:
        """Kill every worker. In-flight calls end as INVALID ('reward pool closed'); later calls raise."""
        self._closed = True
        for worker in list(self._all):
            if worker in self._idle:
                worker.kill()
            elif worker.proc.is_alive():
                # Busy: only the process. Its pipe then reads EOF, which ends the waiting call;
                # closing the pipe under the selector would leave that call waiting for its timeout.
                worker.proc.kill()
        self._idle.clear()
