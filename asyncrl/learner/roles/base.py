"""The model half every role shares: build this rank's Megatron chunks, load HF weights, run passes.

Owns: `RoleContext` (what a role is handed inside an initialised rank), `ModelRunner` (model
chunks, the optional scalar head that turns the LM into a critic / reward model, Megatron DDP
wrapping for trainable roles, and one forward(-backward) pass over micro-batches through
`get_forward_backward_func`, so pipeline parallelism works unchanged) and the token math on
vocab-parallel logits (log-probs via `vocab_parallel_cross_entropy`, entropy with TP
all-reduces: the full-vocab logits are never gathered).

Must never: start processes or touch Ray, pick an algorithm (roles do), or hold optimizer state
(see `optim.py`). Runs only after `init_distributed` + `init_model_parallel` on this rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from asyncrl.config import AlgorithmConfig, LearnerConfig, ModelConfig
from asyncrl.learner.batching import MicroBatch, make_micro_batches
from asyncrl.learner.parallel import ParallelLayout
from asyncrl.types import Sample

# Padded-vocab logits are pushed this far down so they carry no probability; a finite value
# (not -inf) keeps p * log p at 0 in the entropy instead of nan.
_MASKED_LOGIT = -1e30

LossFn = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]


@dataclass
class RoleContext:
    """Everything a role needs, handed over by the rank actor after parallel init."""

    model_cfg: ModelConfig
    learner_cfg: LearnerConfig
    algorithm_cfg: AlgorithmConfig
    hf_config: Any
    layout: ParallelLayout
    rank: int


class ScalarHead(torch.nn.Module):
    """Linear(hidden, 1) on the final hidden states, standing in for GPTModel's `output_layer`.

    Replicated over TP (its input is already TP-reduced), so its grads agree on every TP rank.
    Accepts and ignores `weight` / `runtime_gather_output`, which GPTModel passes to the output
    layer it replaces.
    """

    def __init__(self, hidden: int, dtype: torch.dtype, std: float, seed: int) -> None:
        super().__init__()
        self.sequence_parallel = False  # GPTModel reads it on its output layer
        gen = torch.Generator().manual_seed(seed)  # same init on every rank, no RNG side effects
        # `weight` / `bias` directly on the module: GPTModel's sharded_state_dict (checkpoints)
        # looks its output layer up as `output_layer.weight`.
        self.weight = torch.nn.Parameter((torch.randn((1, hidden), generator=gen) * std).to(dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))

    def forward(self, hidden_states: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None):
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class ModelRunner:
    """This rank's model chunks and the passes over them."""

    def __init__(self, ctx: RoleContext, *, head: str = "lm", trainable: bool = False) -> None:
        from megatron.core import parallel_state as ps

        from asyncrl.learner.convert import load_hf_weights
        from asyncrl.learner.model import build_model_chunks

        if head not in ("lm", "scalar"):
            raise ValueError(f"head={head!r} must be 'lm' or 'scalar'")
        self.ctx, self.head = ctx, head
        strategy = ctx.learner_cfg.strategy_config
        dtype = ctx.model_cfg.dtype
        chunks = build_model_chunks(ctx.hf_config, strategy, dtype)
        load_hf_weights(chunks, ctx.model_cfg.path, ctx.hf_config)
        if head == "scalar":
            for c in chunks:
                # Untie on every chunk, not only the last stage's: a tied GPTModel passes the
                # embedding as the output weight of a layer that no longer has one, and under PP
                # the first stage would wait forever in the embedding-grad all-reduce for a last
                # stage that no longer joins it (a PP=2 critic's update hung).
                c.share_embeddings_and_output_weights = False
                if c.post_process:
                    c.output_layer = ScalarHead(
                        c.config.hidden_size, _dtype(dtype), c.config.init_method_std, ctx.learner_cfg.seed
                    ).to(_device_of(c))
        for c in chunks:
            # Micro-batch shapes vary (dynamic batch size, packing): let PP p2p send shapes first.
            c.config.variable_seq_lengths = True
        self.real_vocab = ctx.hf_config.vocab_size
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.is_last_stage = ps.is_pipeline_last_stage()
        self.pp = ps.get_pipeline_model_parallel_world_size()
        # The interleaved schedule's contiguous micro-batch group (Megatron defaults it to PP).
        self.vp_group_min = chunks[0].config.microbatch_group_size_per_vp_stage or self.pp
        self.chunks = [self._wrap_ddp(c) for c in chunks] if trainable else chunks
        for c in self.chunks:
            c.train(trainable)  # dropout is 0 anyway; eval() keeps the reference deterministic

    def _wrap_ddp(self, chunk: torch.nn.Module) -> torch.nn.Module:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        )
        ddp = DistributedDataParallel(config=chunk.config, ddp_config=ddp_cfg, module=chunk)
        ddp.broadcast_params()  # one starting point on every DP replica, whatever was loaded
        return ddp

    # ------------------------------------------------------------------ passes

    def micro_batches(self, samples: Sequence[Sample], response_width: int | None = None) -> list[MicroBatch]:
        cfg = self.ctx.learner_cfg
        return make_micro_batches(
            samples, micro_batch_size=cfg.micro_batch_size, max_tokens=cfg.max_tokens_per_micro_batch,
            pack=cfg.sequence_packing, response_width=response_width,
        )

    def run(self, mbs: list[MicroBatch], loss_fn: LossFn, *, forward_only: bool) -> list[dict[str, Any]]:
        """One pass over `mbs`; returns `loss_fn`'s dicts (last PP stage only, [] elsewhere).

        `loss_fn(mb, output)` gets the model output ([rows, T, V/TP] logits, or [rows, T, 1]
        for a scalar head) and returns (scalar loss, result dict). Megatron divides each loss by
        the number of micro-batches; callers that want another normalisation undo that.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not mbs:
            return []
        real = len(mbs)
        padding: set[int] = set()
        if len(self.chunks) > 1:
            # The interleaved schedule needs at least PP micro-batches: empty ones make up the count
            # (their loss is 0 and their results are dropped), and real losses are scaled so that
            # Megatron's division by the padded count is still a division by `real`.
            pads = [_empty_micro_batch(mbs[0]) for _ in range(self.pp - real)]
            padding = {id(m) for m in pads}
            mbs = list(mbs) + pads
            from megatron.core.utils import get_model_config

            get_model_config(self.chunks[0]).microbatch_group_size_per_vp_stage = vp_group_size(
                len(mbs), self.pp, self.vp_group_min
            )
        scale = len(mbs) / real

        def forward_step(data_iter, model):
            mb = next(data_iter)
            # Batches are laid out on the host; only the model's inputs go to its device. Per-token
            # results come back to the host (token_logprobs), where the roles' losses run.
            dev = _device_of(model)
            mask = mb.attention_mask.to(dev) if mb.attention_mask is not None else None
            out = model(mb.input_ids.to(dev), mb.position_ids.to(dev), mask)
            if id(mb) in padding:
                return out, _padding_loss
            return out, partial(_loss_on_device, loss_fn, mb, dev, scale)

        data = iter(mbs) if len(self.chunks) == 1 else [iter(mbs) for _ in self.chunks]
        with torch.set_grad_enabled(not forward_only):
            out = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=data, model=self.chunks,
                num_microbatches=len(mbs), seq_length=max(m.input_ids.shape[1] for m in mbs),
                micro_batch_size=max(m.input_ids.shape[0] for m in mbs), forward_only=forward_only,
            )
        return [r for r in out if r is not _PADDING] if self.is_last_stage else []

    # ------------------------------------------------------------------ token math

    def token_logprobs(
        self, logits: torch.Tensor, mb: MicroBatch, *, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([n, L] log-probs of the response tokens, [n, L] entropy or None) in the response layout.

        Only the rows that predict a response token are read from the logits, in chunks of
        `logprob_chunk_size` tokens, so the float32 temporaries of the cross-entropy stay bounded
        (with grad, each chunk's softmax is kept for backward as usual). Logits are divided by
        the sampling temperature, the convention that makes them match the engine's sampler.
        """
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        vocab_local = logits.shape[-1]
        flat = logits.reshape(-1, vocab_local)
        dev = logits.device  # the vocab-wide math stays there; only [n, L] results go to the host
        idx = mb.gather_index[mb.response_mask].to(dev)
        labels = mb.labels[mb.response_mask].to(dev)
        start = self.tp_rank * vocab_local
        padded = (torch.arange(start, start + vocab_local, device=dev) >= self.real_vocab)
        temperature = self.ctx.algorithm_cfg.temperature
        chunk = self.ctx.learner_cfg.logprob_chunk_size
        lps, ents = [], []
        for a in range(0, idx.numel(), chunk):
            x = flat.index_select(0, idx[a : a + chunk]).float() / temperature
            x = x.masked_fill(padded, _MASKED_LOGIT)
            if with_entropy:  # before the cross-entropy: it works in place on its input
                ents.append(_vocab_parallel_entropy(x.detach()))
            lps.append(-vocab_parallel_cross_entropy(x, labels[a : a + chunk]))
        n, width = mb.response_mask.shape
        lp = torch.zeros(n, width, dtype=torch.float32)
        if lps:
            lp = lp.index_put((mb.response_mask.nonzero(as_tuple=True)), torch.cat(lps).to(lp.device))
        ent = None
        if with_entropy:
            ent = torch.zeros(n, width, dtype=torch.float32)
            if ents:
                ent[mb.response_mask] = torch.cat(ents).to(ent.device)
        return lp, ent

    @staticmethod
    def token_scalars(output: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """[n, L] head outputs at the columns that predict each response token (the value layout)."""
        flat = output.reshape(-1).float()
        picked = flat[mb.gather_index.to(flat.device)].to(mb.response_mask.device)
        return torch.where(mb.response_mask, picked, 0.0)

    @torch.no_grad()
    def export_hf_tensors(self):
        from asyncrl.learner.convert import export_hf_tensors

        if self.head != "lm":
            raise RuntimeError("only a language-model head exports HF tensors")
        return export_hf_tensors(self.chunks, self.ctx.hf_config)

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for c in self.chunks for p in c.parameters()]


def _device_of(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


def _loss_on_device(loss_fn: LossFn, mb: MicroBatch, device: torch.device, scale: float, output: torch.Tensor):
    """Megatron scales and backpropagates the loss with device tensors: hand it one there."""
    loss, result = loss_fn(mb, output)
    return (loss * scale if scale != 1 else loss).to(device), result


# What a padding micro-batch reports (dropped from `ModelRunner.run`'s results).
_PADDING: dict[str, Any] = {}


def _padding_loss(output: torch.Tensor):
    return output.float().sum() * 0.0, _PADDING


def _empty_micro_batch(like: MicroBatch) -> MicroBatch:
    """One pad token and no sequence: a micro-batch that only fills the interleaved schedule."""
    width = like.response_mask.shape[1]
    return MicroBatch(
        sample_index=[], input_ids=torch.zeros(1, 1, dtype=torch.long),
        position_ids=torch.zeros(1, 1, dtype=torch.long), attention_mask=None, placements=[],
        gather_index=torch.zeros(0, width, dtype=torch.long), response_mask=torch.zeros(0, width, dtype=torch.bool),
        labels=torch.zeros(0, width, dtype=torch.long),
    )


def vp_group_size(num_microbatches: int, pp: int, configured: int) -> int:
    """The interleaved schedule's contiguous micro-batch group for `num_microbatches` (>= pp).

    Megatron requires pp <= group <= M and M % group == 0 or >= pp; the smallest such group
    from the configured one up (M itself always qualifies) keeps activation memory lowest.
    """
    if num_microbatches < pp:
        raise ValueError(f"{num_microbatches} micro-batches, fewer than PP={pp}")
    for g in range(max(configured, pp), num_microbatches + 1):
        if num_microbatches % g == 0 or num_microbatches % g >= pp:
            return g
    return num_microbatches


@torch.no_grad()
def _vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """H = log Z - sum_v p_v l_v over the full vocabulary, from this TP rank's vocab slice."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    m = logits.max(dim=-1).values
    if tp > 1:
        torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = logits - m[:, None]
    e = shifted.exp()
    stats = torch.stack([e.sum(-1), (e * shifted).sum(-1)])
    if tp > 1:
        torch.distributed.all_reduce(stats, group=group)
    z, ez = stats
    return torch.log(z) - ez / z
