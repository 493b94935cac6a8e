"""The checkpoint writer's helper processes and the learner rank that starts them (learner/checkpoint.py).

Megatron's torch_dist writer reports through a queue served by a `multiprocessing` Manager process; a rank killed
with SIGKILL whose children nobody reaps (its node's raylet lost with it, tests/e2e/test_multinode.py) left that
process running with parent 1. Here a process standing in for the rank makes the queue as a save would, the queue
carries an item, and after the process is killed the Manager's process ends within seconds. A writer process killed
mid-save (the save would wait for it forever) ends the rank. And a rank (a Ray actor) killed while a writer it forked
is alive: the writer ends, so Ray sees the rank dead and a call waiting on it fails instead of waiting forever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import process_gone, wait_gone

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


@pytest.mark.slow
def test_the_writers_queue_process_ends_when_the_rank_is_killed():
    rank = subprocess.Popen([sys.executable, "-c", RANK], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        manager = int(rank.stdout.readline().strip())  # (the rank's asserts passed to get here)
        assert psutil.Process(manager).ppid() == rank.pid and not process_gone(manager)
        time.sleep(1.5)  # alive while its parent lives
        assert not process_gone(manager)
        rank.send_signal(signal.SIGKILL)
        rank.wait(30)
        assert wait_gone([manager], 20.0) == [], f"the Manager process {manager} outlived its rank"
    finally:
        rank.kill()


SAVE = """
import multiprocessing, os, signal, sys, time
from asyncrl.learner.checkpoint import _writers_and_rank_end_together

def write(seconds):
    time.sleep(seconds)

killed = sys.argv[1] == "kill"
with _writers_and_rank_end_together(poll_s=0.05):
    ctx = multiprocessing.get_context("fork")  # as Megatron's writers
    done = ctx.Process(target=write, args=(0.0,))
    done.start()
    done.join()  # a writer that ended normally is no reason to stop
    writer = ctx.Process(target=write, args=(600.0 if killed else 0.5,))
    writer.start()
    if killed:
        os.kill(writer.pid, signal.SIGKILL)
        time.sleep(30)  # the save waiting for it (Megatron's wait has no deadline)
        print("still waiting", flush=True)
    writer.join()
print("saved", flush=True)
"""


@pytest.mark.parametrize("fault", ["kill", "none"])
def test_a_writer_killed_mid_save_ends_the_rank_instead_of_a_wait_forever(fault):
    t = time.monotonic()
    run = subprocess.run([sys.executable, "-c", SAVE, fault], capture_output=True, text=True, timeout=60, cwd=os.getcwd())
    if fault == "kill":
        assert run.returncode == 1 and time.monotonic() - t < 20 and "still waiting" not in run.stdout
        assert "checkpoint writer process" in run.stderr and "killed by signal 9" in run.stderr, run.stderr
    else:
        assert run.returncode == 0 and run.stdout.strip() == "saved", (run.stdout, run.stderr)


@pytest.mark.slow
def test_a_rank_killed_while_its_writer_runs_is_seen_dead_and_the_writer_ends(ray_session, tmp_path):
    """The chaos soak once killed the learner rank as version 15's checkpoint began: the forked writer kept the rank's
    sockets open, Ray never saw the rank die, and the trainer's save (so its restart) waited until the app was
    stopped. Without the writer ending with its rank, `ray.get` below times out instead of raising."""
    ray = ray_session

    @ray.remote(num_cpus=0)
    class Rank:
        def pid(self) -> int:
            return os.getpid()

        def save(self, note: str) -> None:
            import multiprocessing
            from pathlib import Path

            from asyncrl.learner.checkpoint import _writers_and_rank_end_together

            with _writers_and_rank_end_together(poll_s=0.05):
                writer = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600.0,))
                writer.start()
                Path(note).write_text(str(writer.pid))
                writer.join()  # (Megatron's save waits for its writers)

    rank = Rank.remote()
    pid = ray.get(rank.pid.remote())
    note = tmp_path / "writer.pid"
    saving = rank.save.remote(str(note))
    deadline = time.monotonic() + 30
    while not (note.exists() and note.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    writer = int(note.read_text())
    assert psutil.Process(writer).ppid() == pid
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(saving, timeout=30)
    assert wait_gone([writer], 10.0) == [], f"the writer {writer} outlived its rank"
