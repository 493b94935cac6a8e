"""Timeline marks of a weight push across its processes, to find where its time goes on a GPU host.

With `ASYNCRL_PUSH_TRACE=DIR` in the environment every process that takes part in a push (the
publisher, the sending learner rank, the engine replica, its workers) appends one line per mark,
`<wall time> <label>`, to `DIR/trace_<pid>.txt`; `benchmarks/push_timeline.py DIR` lines the files
up, push by push. The processes share a host's clock, which is what makes their marks comparable:
on several hosts only each host's own marks are. Unset (the default), `mark` returns at once.

Owns: the marks' file and format. Must never: raise (a mark is an observation, never a failure of
the push), or be left on in a timed run that reports figures (each mark costs a few microseconds).
"""

from __future__ import annotations

import os
import threading
import time
from typing import IO

_DIR = os.environ.get("ASYNCRL_PUSH_TRACE") or None
_lock = threading.Lock()
_file: IO[str] | None = None


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
