"""The push's kernels loaded when a group forms (asyncrl/weightsync/collective.py's warm-up): the warm-up's calls are
the push's own and run (on the host here), it is a no-op off CUDA and once per device, and on a GPU a
warmed process launches a push's checksums behind queued work without waiting for it to drain, where a
cold one waits (the first launch of a kernel loads its module, and that load waits for the device)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from asyncrl.weightsync import collective as warmup


def test_the_warm_up_runs_the_push_calls_in_every_mode_and_dtype(monkeypatch):
    ran: list[str] = []
    pack, digests, copy = warmup.pack_bucket, warmup.buckets_digests_lazy, torch._foreach_copy_
    monkeypatch.setattr(warmup, "pack_bucket", lambda *a: ran.append("pack") or pack(*a))
    monkeypatch.setattr(warmup, "buckets_digests_lazy", lambda b, mode: ran.append(f"digests:{mode}") or digests(b, mode))
    monkeypatch.setattr(torch, "_foreach_copy_",
                        lambda dst, src: ran.append(f"copy:{str(src[0].dtype).removeprefix('torch.')}") or copy(dst, src))
    warmup._warm(torch.device("cpu"))
    # each mode: a bucket at both pointer alignments, then a whole version's one pass
    assert ran == ["pack", *["digests:checksum"] * 3, *["digests:full"] * 3, "copy:bfloat16", "copy:float16", "copy:float32"]


def test_nothing_is_warmed_off_cuda(monkeypatch):
    monkeypatch.setattr(warmup, "_warm", lambda dev: pytest.fail(f"warmed {dev}"))
    warmup.warm_push_kernels("cpu")
    warmup.warm_push_kernels(None)
    assert not warmup._WARMED


_PROBE = textwrap.dedent("""
    import sys, time, torch
    from asyncrl.weightsync.bucket import pack_bucket
    from asyncrl.weightsync.fingerprint import buckets_digests_lazy
    from asyncrl.weightsync import collective
    dev = torch.device("cuda", 0)
    if sys.argv[1] == "warm":
        collective.warm_push_kernels(dev)
        collective._warm = None  # once per process: warming the device again runs nothing
        collective.warm_push_kernels(dev)
    bucket = pack_bucket([("w", torch.ones(1000, dtype=torch.bfloat16, device=dev))], dev)
    torch.cuda.synchronize(dev)
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(4e9))  # a few seconds of queued work, as a push's broadcasts are
    t = time.perf_counter()
    pending = buckets_digests_lazy([(bucket, "")], "checksum")  # only enqueues: returns at once unless a module loads
    print(f"enqueue_s={time.perf_counter() - t:.3f}")
    pending()
""")


@pytest.mark.gpu
@pytest.mark.slow
def test_a_warmed_process_launches_checksums_behind_queued_work():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    seconds = {}
    for kind in ("warm", "cold"):  # (the warm one first: the cold one then finds Triton's compiled kernel on disk)
        out = subprocess.run([sys.executable, "-c", _PROBE, kind], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        seconds[kind] = float(out.stdout.split("enqueue_s=")[1].split()[0])
    print(seconds)
    if seconds["cold"] < 1.0:
        pytest.skip(f"the cold launch did not wait for the device here ({seconds}): modules load eagerly")
    assert seconds["warm"] < 0.5, seconds
