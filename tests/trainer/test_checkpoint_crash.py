"""A run killed (SIGKILL) while it writes a checkpoint never leaves one that resume would load.

The trainer's checkpoint writer (`TrainerParts.save_checkpoint`: learner, buffer, prompt
position, renamed into place) runs in a child process over small stand-ins for the learner
group (it writes its own directory, as Megatron's atomic writer does) and a real buffer and
prompt stream. The child saves version 1, then version 2 (or version 1 again), and kills itself
at one point of the second write. `restore_latest` in a fresh process must then load the newest
checkpoint that was complete, with the buffer and prompt position it was saved with."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from asyncrl.buffer.actor import BufferService
from asyncrl.config import RootConfig
from asyncrl.data.prompts import Prompt
from asyncrl.trainer.data_stream import PromptStream
from asyncrl.trainer.parts import TrainerParts, complete_checkpoints
from tests.trainer._helpers import Remote

CHILD = textwrap.dedent("""
    import asyncio, json, os, signal, sys, types
    from pathlib import Path
    import torch
    from tests.trainer.test_checkpoint_crash import parts

    root, kill_at, second = sys.argv[1], sys.argv[2], int(sys.argv[3])

    armed = []  # the first save runs whole; the second is killed at `kill_at`

    def die(point):
        if armed and point == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    real_save, real_replace, real_write = torch.save, os.replace, Path.write_text
    def save(obj, f, *a, **k):
        die("buffer-before"); real_save(obj, f, *a, **k); die("buffer-after")
    def replace(src, dst):
        die("rename-" + Path(dst).name.split(".")[-1] if "." in Path(dst).name else "rename-final")
        real_replace(src, dst)
    def write_text(self, text, *a, **k):
        die("state-before"); real_write(self, text, *a, **k)
    torch.save, os.replace, Path.write_text = save, replace, write_text

    async def main():
        p = parts(root)
        p.stream.next()
        await p.save_checkpoint(1)
        p.stream.next(); p.stream.next()
        p.actor.kill_at = kill_at
        armed.append(True)
        await p.save_checkpoint(second)
    asyncio.run(main())
    print("DONE", flush=True)
""")

KILL_POINTS = ["actor-partial", "buffer-before", "buffer-after", "state-before", "rename-old", "rename-final"]


class Learner:
    """Writes its checkpoint directory the way the learner group does (into the path it is given)."""

    kill_at = ""
    loaded: list[str] = []

    async def save_checkpoint(self, path: str) -> str:
        Path(path).mkdir(parents=True)
        (Path(path) / "shard_0.bin").write_bytes(b"x" * 1000)
        if self.kill_at == "actor-partial":
            os.kill(os.getpid(), 9)
        (Path(path) / "metadata.json").write_bytes(b"{}")
        return path

    async def load_checkpoint(self, path: str) -> dict:
        assert (Path(path) / "metadata.json").exists(), f"loaded an incomplete learner checkpoint: {path}"
        self.loaded.append(path)
        return {}


class Weights:
    published: list[int] = []

    async def publish(self, version: int) -> dict:
        self.published.append(version)
        return {}


def parts(root: str) -> TrainerParts:
    cfg = RootConfig.model_validate({"checkpoint": {"dir": root, "interval_steps": 1, "keep": 3},
                                     "buffer": {"batch_size": 4, "max_staleness": 1}, "algorithm": {"group_size": 2}})
    prompts = [Prompt(prompt=f"q{i}", answer=str(i)) for i in range(10)]
    return TrainerParts(cfg=cfg, engine=None, tokenizer=None, buffer=Remote(BufferService(cfg.buffer)), rewards=None,
                        actor=Learner(), reference=None, critic=None, weights=Weights(), placement=None, tracker=None,
                        stream=PromptStream(prompts, seed=0), eval_prompts=[])


@pytest.mark.parametrize("second", [2, 1], ids=["new-version", "same-version"])
@pytest.mark.parametrize("kill_at", KILL_POINTS + ["none"])
async def test_a_kill_during_a_checkpoint_write_leaves_the_last_complete_one(tmp_path, kill_at, second):
    if second == 2 and kill_at == "rename-old":
        pytest.skip("nothing is moved aside when the version is new")
    root = tmp_path / "ckpt"
    out = subprocess.run([sys.executable, "-c", CHILD, str(root), kill_at, str(second)], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[2])
    killed = out.returncode == -9
    assert killed == (kill_at != "none"), (out.returncode, out.stderr[-2000:])
    expected = 1 if killed else second
    p = parts(str(root))
    version = await p.restore_latest()
    assert version == expected, sorted(x.name for x in root.iterdir())
    assert p.actor.loaded[-1].endswith("/actor") and Weights.published[-1] == expected
    # The prompt position and buffer come from that same checkpoint: 1 prompt taken at version 1, 3 at the second.
    assert p.stream.consumed == (1 if expected == 1 and (killed or second == 2) else 3)
    assert [c.name for c in complete_checkpoints(root)][-1].startswith(f"step_{expected:06d}")
    await p.save_checkpoint(expected + 5)  # the next save leaves no half-written checkpoint of the killed run behind
    assert not [x.name for x in root.iterdir() if x.name.endswith(".tmp")]


async def test_a_save_that_fails_in_the_learner_leaves_nothing_half_written(tmp_path):
    class Lost(Learner):
        async def save_checkpoint(self, path: str) -> str:
            Path(path).mkdir(parents=True)
            raise RuntimeError("learner rank 1 died while saving")

    p = parts(str(tmp_path / "ckpt"))
    await p.save_checkpoint(1)
    p.actor = Lost()
    with pytest.raises(RuntimeError, match="died while saving"):
        await p.save_checkpoint(2)
    assert sorted(x.name for x in (tmp_path / "ckpt").iterdir()) == ["step_000001"]
