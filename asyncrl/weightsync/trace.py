"""Timeline marks of a weight push across its processes, to find where its time goes on a GPU host.

With `ASYNCRL_PUSH_TRACE=DIR` set, every process in a push (publisher, sending learner rank, engine replica, its
workers) appends `<wall time> <label>` per mark to `DIR/trace_<pid>.txt`; `benchmarks/push_timeline.py DIR` lines the
files up, push by push (marks compare across the processes of one host, which share its clock). Unset (the default),
`mark` returns at once. `watch()` around a stretch of a push: while traced, a stretch lasting longer than `STALL_S`
writes every thread's Python stack to `DIR/stacks_<pid>.txt` (`faulthandler`, which writes even while a thread holds
the interpreter lock in a CUDA call), and again every `STALL_S`: where a stalled push waits.

Owns: the marks' file and format. Must never: raise (a mark is an observation, never a failure of the push), or be
left on in a timed run that reports figures (each mark costs a few microseconds).
Details: docs/design/weightsync.md, "Push trace marks".
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import threading
import time
from collections.abc import Iterator
from typing import IO

_DIR = os.environ.get("ASYNCRL_PUSH_TRACE") or None
_lock = threading.Lock()
_file: IO[str] | None = None


def _stall_s(raw: str) -> float:
    """`ASYNCRL_PUSH_TRACE_STALL_S`: seconds > 0."""
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"ASYNCRL_PUSH_TRACE_STALL_S must be a number of seconds > 0, got {raw!r}")
    return seconds


STALL_S = _stall_s(os.environ.get("ASYNCRL_PUSH_TRACE_STALL_S", "20"))
_stacks: IO[str] | None = None
_watching = 0  # stretches being watched in this process (faulthandler has one timer per process)


def enabled() -> bool:
    return _DIR is not None


def mark(label: str) -> None:
    """Record that this process passed `label` now (no spaces in it)."""
    if _DIR is None:
        return
    global _file
    line = f"{time.time():.6f} {label}\n"
    try:
        with _lock:
            if _file is None:
                os.makedirs(_DIR, exist_ok=True)
                _file = open(os.path.join(_DIR, f"trace_{os.getpid()}.txt"), "a", buffering=1)
            _file.write(line)
    except OSError:
        pass


@contextlib.contextmanager
def watch() -> Iterator[None]:
    """While traced: dump every thread's stack if the stretch inside lasts over `STALL_S` (module doc)."""
    if _DIR is None:
        yield
        return
    global _stacks, _watching
    armed = False
    with _lock:
        try:
            if _stacks is None:
                os.makedirs(_DIR, exist_ok=True)
                _stacks = open(os.path.join(_DIR, f"stacks_{os.getpid()}.txt"), "a", buffering=1)
            if _watching == 0:
                faulthandler.dump_traceback_later(STALL_S, repeat=True, file=_stacks)
            _watching += 1
            armed = True
        except OSError:
            pass
    try:
        yield
    finally:
        if armed:
            with _lock:
                _watching -= 1
                if _watching == 0:
                    faulthandler.cancel_dump_traceback_later()
