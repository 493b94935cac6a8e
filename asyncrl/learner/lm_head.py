"""Token log-probs and entropy straight from hidden states: the LM head inside a token chunk.

Owns: `DeferredLMHead` behaviour for GPTModel (the output layer hands back the final hidden states, TP-replicated,
instead of logits) and `linear_logprobs`, the fused `hidden @ W.T -> / temperature -> log-softmax -> pick the label`
over the vocab-parallel weight, chunk by chunk, so at most one chunk's float32 logits exist at a time, in the forward
and in the backward (which recomputes them, keeping only each token's log-sum-exp).
Why: full [tokens, V] logits, computed for every token though only response tokens are read, were the learner's
largest memory cost and a large share of its time.
Must never: gather the full vocabulary on one rank (TP ranks exchange 3 floats per token), or read device values on
the host (no synchronisation).
Details: docs/design/learner.md, "The chunked LM head".
"""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.learner import lm_head_kernels as kernels

# Padded-vocab columns are pushed this far down so they carry no probability; finite (not -inf)
# so that p * log p stays 0 in the entropy instead of nan.
MASKED_LOGIT = -1e30


def _tp() -> tuple[Any, int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


# The vocab-wide elementwise math of one chunk, each a single pass over the chunk's logits (as
# they come out of the matmul, float32 inside): plain torch ops, for CPU (on CUDA,
# `lm_head_kernels` does the forward in one Triton pass and the backward in place).
# `limit`: columns at or past it are vocab padding (no probability).


def _scaled(x: torch.Tensor, inv_t: float, limit: int) -> torch.Tensor:
    y = x.float() * inv_t
    cols = torch.arange(x.shape[-1], device=x.device)
    return torch.where(cols < limit, y, MASKED_LOGIT)


def _row_max(x: torch.Tensor, inv_t: float, limit: int) -> torch.Tensor:
    return _scaled(x, inv_t, limit).amax(dim=-1)


def _row_stats(x: torch.Tensor, m: torch.Tensor, label: torch.Tensor, in_range: torch.Tensor,
               inv_t: float, limit: int) -> torch.Tensor:
    """[3, c]: sum_v e_v, sum_v e_v (l_v - m), l_label - m (0 where the label is on another TP
    rank), with l = logits / temperature and e = exp(l - m)."""
    y = _scaled(x, inv_t, limit) - m[:, None]
    e = y.exp()
    target = torch.where(in_range, y.gather(1, label[:, None]).squeeze(1), 0.0)
    return torch.stack([e.sum(-1), (e * y).sum(-1), target])


def _grad_logits(x: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor, label: torch.Tensor,
                 in_range: torch.Tensor, inv_t: float, limit: int) -> torch.Tensor:
    """d(sum_i grad_i log p_i(label_i)) / d(raw logits) = grad_i (1[v = label_i] - p_iv) / temperature."""
    p = (_scaled(x, inv_t, limit) - lse[:, None]).exp()
    cols = torch.arange(x.shape[-1], device=x.device)
    onehot = (cols[None, :] == label[:, None]) & in_range[:, None]
    return ((onehot.float() - p) * (grad * inv_t)[:, None]).to(x.dtype)


class _LinearLogProb(torch.autograd.Function):
    """(hidden [n, H], weight [V/TP, H], labels [n]) -> (log p(label) [n], entropy [n]) in float32."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, real_vocab, chunk, with_entropy):  # type: ignore[override]
        group, tp, rank = _tp()
        vocab_local = weight.shape[0]
        start = rank * vocab_local
        limit = max(0, min(vocab_local, real_vocab - start))
        inv_t = 1.0 / temperature
        n = hidden.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(n, dtype=torch.float32, device=hidden.device) if with_entropy else None
        local_label = labels - start
        # the label's local column, -1 where it lies on another TP rank
        here = torch.where((local_label >= 0) & (local_label < vocab_local), local_label, -1)
        in_range, safe_label = here >= 0, here.clamp(min=0)
        for a in range(0, n, chunk):
            sl = slice(a, min(a + chunk, n))
            x = hidden[sl] @ weight.t()
            if kernels.available(x):  # one Triton pass: online softmax statistics + the label's logit
                m, s0, s1, xl = kernels.row_stats(x, here[sl], inv_t, limit)
                if tp > 1:
                    local_m = m.clone()
                    torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
                    s0, s1 = kernels.combine(local_m, s0, s1, m)
                stats = torch.stack([s0, s1, torch.where(in_range[sl], xl - m, 0.0)])
            else:
                m = _row_max(x, inv_t, limit)
                if tp > 1:
                    torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
                stats = _row_stats(x, m, safe_label[sl], in_range[sl], inv_t, limit)
            if tp > 1:
                torch.distributed.all_reduce(stats, group=group)
            log_z = stats[0].log()
            lse[sl] = m + log_z
            lp[sl] = stats[2] - log_z
            if with_entropy:
                ent[sl] = log_z - stats[1] / stats[0]
            del x
        ctx.save_for_backward(hidden, weight, here, lse)
        ctx.cfg = (inv_t, limit, chunk)
        ctx.param = weight  # for its DDP `main_grad` in backward
        if ent is not None:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):  # type: ignore[override]
        hidden, weight, here, lse = ctx.saved_tensors
        inv_t, limit, chunk = ctx.cfg
        n = hidden.shape[0]
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # float32 accumulation over chunks: each chunk's product is rounded once, as a single
        # matmul over all tokens would be. On GPU with Megatron DDP the GEMM writes float32 straight
        # into the weight's `main_grad` (and no `.grad` is returned: a tied embedding's lookup
        # gradient still arrives through `.grad`); elsewhere into a float32 buffer.
        chunks = len(range(0, n, chunk))
        main = _main_grad_sink(ctx.param) if ctx.needs_input_grad[1] else None
        grad_w = None
        if ctx.needs_input_grad[1] and main is None and chunks > 1:
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_lp = grad_lp.float().contiguous()
        for a in range(0, n, chunk):
            sl = slice(a, min(a + chunk, n))
            x = hidden[sl] @ weight.t()  # recomputed: nothing vocab-wide was kept from the forward
            if kernels.available(x):  # in place: the logits become their gradient
                g = kernels.grad_logits_(x, lse[sl], grad_lp[sl], here[sl], inv_t, limit)
            else:
                g = _grad_logits(x, lse[sl], grad_lp[sl], here[sl].clamp(min=0), here[sl] >= 0, inv_t, limit)
            del x
            if grad_h is not None:
                grad_h[sl] = g @ weight
            if main is not None:
                main(hidden[sl], g)
            elif ctx.needs_input_grad[1]:
                if chunks == 1:
                    grad_w = g.t() @ hidden[sl]
                elif g.dtype == torch.float32:
                    grad_w.addmm_(g.t(), hidden[sl])
                else:
                    grad_w += (g.t() @ hidden[sl]).float()
            del g
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None


def _main_grad_sink(param: torch.Tensor):
    """`f(input, grad_output)` adding grad_output^T @ input into `param.main_grad` in float32 with
    one GEMM, when Megatron DDP gave `param` a float32 `main_grad` and the fused accumulation is
    installed (CUDA, low-precision weights); None otherwise. The weight then gets no `.grad` from
    the LM head; the roles' DDP runs with `overlap_grad_reduce=False`, whose hook needs none."""
    main = getattr(param, "main_grad", None)
    if main is None or main.dtype != torch.float32 or param.dtype == torch.float32 or not main.is_cuda:
        return None
    from asyncrl.learner.gpu_fusions import fused_wgrad_accumulation

    accum = fused_wgrad_accumulation()
    return None if accum is None else (lambda inp, grad_out: accum(inp, grad_out, main))


def linear_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, temperature: float,
    real_vocab: int, chunk: int, with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each label and the entropy of each row's distribution, over the whole
    (vocab-parallel) vocabulary; `hidden` must be the same on every TP rank (see `head_input`)."""
    if hidden.shape[0] == 0:
        z = hidden.new_zeros(0, dtype=torch.float32)
        return z + hidden.sum() * 0 + weight.sum() * 0, (z if with_entropy else None)
    return _LinearLogProb.apply(hidden, weight, labels, float(temperature), int(real_vocab), int(chunk), with_entropy)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient. GPTModel transposes the output
    layer's result to [b, s, ...]; the gradient coming back is a transposed view, and Megatron's
    TP mappings hand their gradient to collectives that need contiguous memory (gloo's all-reduce
    of a strided view summed the wrong elements: TP=2 weight grads came out wrong)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad.contiguous()


def head_input(hidden: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """[s(/TP), b, H] final hidden states -> the same full-sequence tensor on every TP rank, with
    Megatron's mappings (their backward sums each TP rank's partial hidden-state gradient)."""
    from megatron.core import tensor_parallel

    _, tp, _ = _tp()
    if tp == 1:
        return hidden
    if sequence_parallel:
        out = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
    else:
        out = tensor_parallel.copy_to_tensor_model_parallel_region(hidden)
    return _ContiguousGrad.apply(out)


def defer_lm_head(output_layer: torch.nn.Module) -> None:
    """Make GPTModel's output layer return the (TP-replicated) final hidden states instead of
    logits; the weight stays registered where it was (checkpoints and weight export unchanged).
    `lm_head_weight(model)` then gives the weight the logits would have used."""
    sp = bool(getattr(output_layer, "sequence_parallel", False))

    def forward(hidden_states: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None, **_: Any):
        return head_input(hidden_states, sp), None

    output_layer.forward = forward  # instance attribute: the module, its weight and sharding stay
    output_layer.deferred = True


def lm_head_weight(model: torch.nn.Module) -> torch.Tensor:
    """The vocab-parallel LM-head weight of a (DDP-wrapped) last-stage GPTModel chunk."""
    inner = model
    while hasattr(inner, "module"):
        inner = inner.module
    if getattr(inner, "share_embeddings_and_output_weights", False):
        return inner.shared_embedding_or_output_weight()
    return inner.output_layer.weight
