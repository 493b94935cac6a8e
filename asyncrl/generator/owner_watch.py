"""Engine processes end with the replica that started them.

Owns: the owner mark (the replica's pid and start time, in the environment every engine process inherits) and the
watch each engine process that loads asyncrl code runs on it: a daemon thread that ends the process once the owner
is gone. Why: vLLM's EngineCore and workers are child processes of the replica; when the replica is killed with
SIGKILL nothing tells them, and they would keep their memory (and a GPU) with parent 1. The owner is known by pid
and start time, so a reused pid keeps no orphan alive and a zombie owner counts as gone. Linux only.
Must never: end the replica's own process, or signal any process but the one it runs in.
Details: docs/design/generator.md, "Owner watch".
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
