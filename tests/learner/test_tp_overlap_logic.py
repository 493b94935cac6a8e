"""The overlapped sequence-parallel linears' ring schedules (asyncrl/learner/tp_overlap.py) against the plain math, on
rings of 2, 3 and 4 ranks run as threads over an in-process ring (the model-level check on real gloo ranks is in
test_megatron_layouts.py): outputs, input grads and weight grads, blocks in the right places."""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from asyncrl.learner.tp_overlap import _ColumnOverlap, _RowOverlap


class _Done:
    def __init__(self, fn=None) -> None:
        self.fn = fn

    def wait(self) -> None:
        if self.fn is not None:
            self.fn()
            self.fn = None


class _ThreadRing:
    """One rank of a ring of threads: `shift` sends to the next rank's mailbox and receives from its own."""

    def __init__(self, rank: int, size: int, boxes: list[queue.Queue], shared: dict) -> None:
        self.rank, self.size, self.boxes, self.shared = rank, size, boxes, shared

    def shift(self, send, recv):
        self.boxes[(self.rank + 1) % self.size].put(send.clone())
        return [_Done(lambda: recv.copy_(self.boxes[self.rank].get(timeout=10)))]

    def _collect(self, key: str, x: torch.Tensor) -> list[torch.Tensor]:
        self.shared.setdefault(key, [None] * self.size)[self.rank] = x.clone()
        self.shared["barrier"].wait(timeout=10)
        parts = list(self.shared[key])
        self.shared["barrier"].wait(timeout=10)
        return parts

    def all_gather(self, out, x):
        out.copy_(torch.cat(self._collect("ag", x)))
        return _Done()

    def reduce_scatter(self, out, x):
        rows = out.shape[0]
        out.copy_(sum(self._collect("rs", x))[self.rank * rows:(self.rank + 1) * rows])
        return _Done()


def _on_ring(size: int, fn) -> list:
    boxes = [queue.Queue() for _ in range(size)]
    shared = {"barrier": threading.Barrier(size)}
    results, errors = [None] * size, []

    def body(r: int) -> None:
        try:
            results[r] = fn(r, _ThreadRing(r, size, boxes, shared))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            shared["barrier"].abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("size", [2, 3, 4])
def test_column_is_allgather_then_matmul_forward_and_backward(size: int) -> None:
    g = torch.Generator().manual_seed(size)
    rows, batch, hidden, out_per_rank = 3, 2, 8, 5
    x = torch.randn(rows * size, batch, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(out_per_rank * size, hidden, generator=g, dtype=torch.float64)
    b = torch.randn(out_per_rank * size, generator=g, dtype=torch.float64)
    dy = torch.randn(rows * size, batch, out_per_rank * size, generator=g, dtype=torch.float64)

    def rank(r: int, ring):
        cols = slice(r * out_per_rank, (r + 1) * out_per_rank)
        xs = x[r * rows:(r + 1) * rows].clone().requires_grad_()
        ws, bs = w[cols].clone().requires_grad_(), b[cols].clone().requires_grad_()
        y = _ColumnOverlap.apply(xs, ws, bs, False, ring)
        y.backward(dy[..., cols])
        return y.detach(), xs.grad, ws.grad, bs.grad

    ref_x = x.clone().requires_grad_()
    ref_w, ref_b = w.clone().requires_grad_(), b.clone().requires_grad_()
    ref_y = ref_x @ ref_w.t() + ref_b
    ref_y.backward(dy)
    for r, (y, gx, gw, gb) in enumerate(_on_ring(size, rank)):
        cols = slice(r * out_per_rank, (r + 1) * out_per_rank)
        torch.testing.assert_close(y, ref_y.detach()[..., cols])
        torch.testing.assert_close(gx, ref_x.grad[r * rows:(r + 1) * rows])  # its share of the summed input grad
        torch.testing.assert_close(gw, ref_w.grad[cols])
        torch.testing.assert_close(gb, ref_b.grad[cols])


@pytest.mark.parametrize("size", [2, 3, 4])
def test_row_is_matmul_then_reduce_scatter_forward_and_backward(size: int) -> None:
    g = torch.Generator().manual_seed(10 + size)
    rows, batch, in_per_rank, hidden = 3, 2, 4, 6
    x = torch.randn(rows * size, batch, in_per_rank * size, generator=g, dtype=torch.float64)
    w = torch.randn(hidden, in_per_rank * size, generator=g, dtype=torch.float64)
    dy = torch.randn(rows * size, batch, hidden, generator=g, dtype=torch.float64)

    def rank(r: int, ring):
        feats = slice(r * in_per_rank, (r + 1) * in_per_rank)
        xs, ws = x[..., feats].clone().requires_grad_(), w[:, feats].clone().requires_grad_()
        y = _RowOverlap.apply(xs, ws, False, ring)
        y.backward(dy[r * rows:(r + 1) * rows])
        return y.detach(), xs.grad, ws.grad

    ref_x, ref_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref_y = ref_x @ ref_w.t()
    ref_y.backward(dy)
    for r, (y, gx, gw) in enumerate(_on_ring(size, rank)):
        feats = slice(r * in_per_rank, (r + 1) * in_per_rank)
        torch.testing.assert_close(y, ref_y.detach()[r * rows:(r + 1) * rows])  # its rows of the summed output
        torch.testing.assert_close(gx, ref_x.grad[..., feats])
        torch.testing.assert_close(gw, ref_w.grad[:, feats])



@pytest.mark.gpu
def test_weight_grad_goes_into_main_grad_with_the_fused_accumulation_on_cuda() -> None:
    """With Megatron's gradient-accumulation fusion (bf16 weights, DDP's float32 main_grad) the weight's grad is added
    into main_grad by the fused GEMM and autograd gets a placeholder marked as already added (what DDP's hook reads);
    without the fusion it is the plain grad. (The rings run on CUDA only in separate processes: autograd runs every
    CUDA backward on one device thread, where two thread-ranks would wait for each other.)"""
    from asyncrl.learner.gpu_fusions import install_wgrad_fusion
    from asyncrl.learner.tp_overlap import _wgrad

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert install_wgrad_fusion()
    g = torch.Generator(device="cuda").manual_seed(3)
    grad_out = torch.randn(64, 24, device="cuda", generator=g).bfloat16()
    total_in = torch.randn(64, 40, device="cuda", generator=g).bfloat16()
    weight = torch.zeros(24, 40, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    start = torch.randn(24, 40, device="cuda", generator=g)
    weight.main_grad, weight.grad_added_to_main_grad = start.clone(), False
    want = start + grad_out.float().t() @ total_in.float()
    placeholder = _wgrad(weight, grad_out, total_in, fusion=True)
    torch.testing.assert_close(weight.main_grad, want, rtol=1e-2, atol=1e-2)
    assert weight.grad_added_to_main_grad and placeholder.shape == weight.shape
    plain = _wgrad(weight, grad_out, total_in, fusion=False)
    torch.testing.assert_close(plain.float(), want - start, rtol=2e-2, atol=5e-2)
