"""Engine processes end with the replica that started them.

Owns: the owner mark (the replica's pid and start time, in the environment every engine process
inherits) and the watch each engine process runs on it. vLLM starts its EngineCore and workers as
child processes of the replica; when Serve or `ray stop --force` kills the replica with SIGKILL,
nothing tells them, and they would keep their memory (and a GPU) with parent 1. Each engine
process that loads asyncrl code (the workers through the worker extension, the EngineCore through
the array log-prob scheduler; with vLLM's multiprocess executor an EngineCore whose workers died
shuts itself down) runs a daemon thread that ends the process once the owner is gone.

A pid alone is not an identity: the owner is recognised by its pid and its start time
(/proc/<pid>/stat), so a reused pid does not keep an orphan alive, and a zombie owner (killed,
not yet reaped) counts as gone. Linux only; elsewhere the watch is not started.

Must never: end the replica's own process, or signal any process but the one it runs in.
"""

from __future__ import annotations

import logging
import os
import threading
import time

OWNER_ENV = "ASYNCRL_ENGINE_OWNER"
POLL_S = 1.0

log = logging.getLogger(__name__)
_watching = False
_lock = threading.Lock()


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks) of a live process, None when there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError, OSError):
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
    return fields[0], int(fields[19])


def mark_owner() -> str | None:
    """Name this process the owner of the engine processes it starts next (they inherit the mark)."""
    stat = _stat(os.getpid())
    if stat is None:  # not Linux
        return None
    os.environ[OWNER_ENV] = f"{os.getpid()}:{stat[1]}"
    return os.environ[OWNER_ENV]


def owner_alive(mark: str) -> bool:
    pid, start = (int(x) for x in mark.split(":"))
    stat = _stat(pid)
    return stat is not None and stat[1] == start and stat[0] not in ("Z", "X")


def watch_owner(poll_s: float = POLL_S) -> bool:
    """In an engine process: start the thread that ends this process when its owner is gone.
    Idempotent; False where there is nothing to watch (no mark, the owner itself, not Linux)."""
    global _watching
    mark = os.environ.get(OWNER_ENV)
    if not mark or mark.split(":")[0] == str(os.getpid()) or _stat(os.getpid()) is None:
        return False
    with _lock:
        if _watching:
            return True
        _watching = True

    def run() -> None:
        while owner_alive(mark):
            time.sleep(poll_s)
        log.error("the replica that started this engine process (%s) is gone; exiting", mark)
        os._exit(1)

    threading.Thread(target=run, name="asyncrl-owner-watch", daemon=True).start()
    return True
