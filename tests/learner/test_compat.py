"""The CPU compat layer, in-process: redirections work, undo is exact, and nothing leaks when absent."""

from __future__ import annotations

import threading

import pytest
import torch

from asyncrl.learner import compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")

_WATCHED = [
    (torch.cuda, "current_device"), (torch.cuda, "manual_seed"), (torch.cuda, "get_rng_state"),
    (torch.cuda, "_lazy_call"), (torch.cuda, "Stream"), (torch.Tensor, "cuda"), (torch.Tensor, "pin_memory"),
]


def _snapshot():
    return [getattr(owner, name, None) for owner, name in _WATCHED]


def test_not_installed_means_nothing_is_patched():
    assert not compat.is_installed()
    assert torch._C._len_torch_function_stack() == 0
    with pytest.raises((RuntimeError, AssertionError)):
        torch.empty(2, device="cuda")
    assert torch.cuda.current_device.__module__.startswith("torch.cuda")
    assert torch.Tensor.cuda is torch._C.TensorBase.cuda


def test_redirections_and_exact_undo():
    before = _snapshot()
    with compat.cpu_compat() as handle:
        assert handle.active and "cuda.current_device" in " ".join(handle.patched)
        assert torch.empty(2, device="cuda").device.type == "cpu"
        assert torch.zeros(3, device=torch.cuda.current_device()).device.type == "cpu"
        assert torch.ones(2).to("cuda:0").device.type == "cpu"
        t = torch.ones(2)
        assert t.cuda() is t and t.pin_memory() is t
        called = []
        torch.cuda._lazy_call(lambda: called.append(1))
        assert called == [1]  # CPU torch would queue it forever
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda.current_stream().wait_stream(torch.cuda.default_stream())
        torch.cuda.Event().record()
        torch.cuda.manual_seed(7)
        a = torch.rand(4)
        torch.cuda.set_rng_state(torch.cuda.get_rng_state())
        torch.cuda.manual_seed(7)
        assert torch.equal(a, torch.rand(4))
    assert _snapshot() == before
    assert not compat.is_installed()
    assert torch._C._len_torch_function_stack() == 0


def test_install_is_idempotent_and_reference_counted():
    first = compat.install_cpu_compat()
    second = compat.install_cpu_compat()
    try:
        assert compat.is_installed()
        second.uninstall()
        assert compat.is_installed()  # still held by the first install
        assert torch.empty(1, device="cuda").device.type == "cpu"
    finally:
        first.uninstall()
    assert not compat.is_installed()


def test_does_nothing_when_cuda_is_available(monkeypatch):
    before = _snapshot()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    handle = compat.install_cpu_compat()
    assert not handle.active and "cuda available" in handle.reason
    assert _snapshot() == before and not compat.is_installed()


def test_other_threads_enter_the_device_mode_explicitly():
    seen = {}

    def worker():
        with compat.cpu_compat_thread():
            seen["device"] = torch.empty(1, device="cuda").device.type

    with compat.cpu_compat():
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert seen["device"] == "cpu"


def test_megatron_rng_tracker_forks_on_cpu():
    """model_parallel_cuda_manual_seed + tracker.fork: distinct, reproducible streams, state restored."""
    from megatron.core import tensor_parallel

    with compat.cpu_compat():
        tensor_parallel.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
        tracker = tensor_parallel.get_cuda_rng_tracker()
        default_state = torch.get_rng_state()
        with tracker.fork():
            in_fork = torch.rand(3)
        assert torch.equal(torch.get_rng_state(), default_state)  # fork restored the default stream
        outside = torch.rand(3)
        assert not torch.equal(in_fork, outside)
        tensor_parallel.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            assert torch.equal(torch.rand(3), in_fork)


def test_clip_grad_norm_single_process():
    with compat.cpu_compat():
        params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))]
        params[0].grad = torch.tensor([3.0, 0.0, 0.0])
        params[1].grad = torch.tensor([0.0, 4.0, 0.0, 0.0])
        assert compat.clip_grad_norm_(params, 1.0) == pytest.approx(5.0)
        assert compat.clip_grad_norm_(params, 0.0) == pytest.approx(1.0, rel=1e-5)
        with pytest.raises(ValueError, match="max_norm=-1"):
            compat.clip_grad_norm_(params, -1)


def test_clip_grad_norm_mixed_dtypes_main_grad_and_known_norm():
    """float32 main_grads and a bf16 .grad in one norm (float32 accumulation); a given norm only scales."""
    with compat.cpu_compat():
        a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
        a.main_grad = torch.tensor([6.0, 0.0])
        a.grad = torch.tensor([100.0, 100.0])  # ignored: main_grad is where DDP accumulates
        b.grad = torch.tensor([0.0, 8.0], dtype=torch.bfloat16)
        assert compat.clip_grad_norm_([a, b], 0.0) == pytest.approx(10.0)
        assert torch.equal(a.main_grad, torch.tensor([6.0, 0.0]))  # max_norm 0: measured, not clipped
        # the caller's norm is trusted: scale = 5 / 20, whatever the grads' own norm is
        assert compat.clip_grad_norm_([a, b], 5.0, norm=20.0) == 20.0
        assert a.main_grad.tolist() == pytest.approx([1.5, 0.0], rel=1e-5)
        assert b.grad.float().tolist() == pytest.approx([0.0, 2.0], rel=1e-2)
