"""The checkpoint writer's helper process ends with the learner rank that started it (learner/checkpoint.py).

Megatron's torch_dist writer reports through a queue served by a `multiprocessing` Manager process; a rank killed
with SIGKILL whose children nobody reaps (its node's raylet lost with it, tests/e2e/test_multinode.py) left that
process running with parent 1. Here a process standing in for the rank makes the queue as a save would, the queue
carries an item, and after the process is killed the Manager's process ends within seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.slow

RANK = """
import time
from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
from asyncrl.learner.checkpoint import _writer_queue_ends_with_this_process
_writer_queue_ends_with_this_process()
first = fa._results_queue
_writer_queue_ends_with_this_process()  # idempotent: the same queue
assert fa._results_queue is first
first.put("written")
assert first.get(timeout=30) == "written"
print(first._manager._process.pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_the_writers_queue_process_ends_when_the_rank_is_killed():
    rank = subprocess.Popen([sys.executable, "-c", RANK], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        manager = int(rank.stdout.readline().strip())  # (the rank's asserts passed to get here)
        assert psutil.Process(manager).ppid() == rank.pid and not _gone(manager)
        time.sleep(1.5)  # alive while its parent lives
        assert not _gone(manager)
        rank.send_signal(signal.SIGKILL)
        rank.wait(30)
        deadline = time.monotonic() + 20
        while not _gone(manager) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _gone(manager), f"the Manager process {manager} outlived its rank"
    finally:
        rank.kill()
