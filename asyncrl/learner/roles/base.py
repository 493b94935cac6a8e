"""The model half every role shares: build this rank's Megatron chunks, load HF weights, run passes.

Owns: `RoleContext` (what a role is handed inside an initialised rank), `ModelRunner` (model chunks, the optional
scalar head of a critic / reward model, Megatron DDP wrapping for trainable roles, one forward(-backward) pass over
micro-batches through `get_forward_backward_func`), each rank's share of a row under CP, and the token math:
log-probs and entropy through the chunked vocab-parallel LM head (`lm_head.py`), scalar-head values, and sums over
CP ranks. Results stay on the device; nothing in a pass reads device values on the host.
Must never: start processes or touch Ray, pick an algorithm (roles do), or hold optimizer state (see `optim.py`).
Runs only after `init_distributed` + `init_model_parallel` on this rank.
Details: docs/design/learner.md, "The role model runner".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from asyncrl.config import AlgorithmConfig, LearnerConfig, ModelConfig
from asyncrl.learner.attention import DocLayout, combine_over_cp, local_positions, split_for_cp
from asyncrl.learner.batching import MicroBatch, make_micro_batches
from asyncrl.learner.lm_head import defer_lm_head, head_input, linear_logprobs, lm_head_weight
from asyncrl.learner.lora import hold_merged
from asyncrl.learner.parallel import ParallelLayout
from asyncrl.types import Sample

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

    Replicated over TP (its input is made the same full-sequence tensor on every TP rank first,
    as the LM head's is), so its grads agree on every TP rank. Accepts and ignores `weight` /
    `runtime_gather_output`, which GPTModel passes to the output layer it replaces.
    """

    def __init__(self, hidden: int, dtype: torch.dtype, std: float, seed: int, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.sequence_parallel = False  # GPTModel reads it on its output layer
        self._gather_sequence = sequence_parallel
        gen = torch.Generator().manual_seed(seed)  # same init on every rank, no RNG side effects
        # `weight` / `bias` directly on the module: GPTModel's sharded_state_dict (checkpoints)
        # looks its output layer up as `output_layer.weight`.
        self.weight = torch.nn.Parameter((torch.randn((1, hidden), generator=gen) * std).to(dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))

    def forward(self, hidden_states: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None, **_: Any):
        hidden_states = head_input(hidden_states, self._gather_sequence)
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class ModelRunner:
    """This rank's model chunks and the passes over them."""

    def __init__(self, ctx: RoleContext, *, head: str = "lm", trainable: bool = False, lora: bool = False) -> None:
        """`lora`: the chunks train learner.lora's adapters alone (asyncrl/learner/lora.py), every base weight frozen."""
        from megatron.core import parallel_state as ps

        from asyncrl.learner.convert import load_hf_weights, load_score_head
        from asyncrl.learner.model import build_model_chunks, resolve_attention

        if head not in ("lm", "scalar"):
            raise ValueError(f"head={head!r} must be 'lm' or 'scalar'")
        self.ctx, self.head = ctx, head
        strategy = ctx.learner_cfg.strategy_config
        dtype = ctx.model_cfg.dtype
        self.attention = resolve_attention(ctx.learner_cfg.attention, strategy)
        chunks = build_model_chunks(ctx.hf_config, strategy, dtype, attention=self.attention, trainable=trainable)
        load_hf_weights(chunks, ctx.model_cfg.path, ctx.hf_config, scalar_head=head == "scalar")
        sp = bool(chunks[0].config.sequence_parallel)
        # A scalar head starts from the checkpoint's `score.*` when it has one (a trained reward
        # model, or a critic started from one), else from a seeded random init.
        for c in chunks:
            if not c.post_process:
                continue
            if head == "scalar":
                scalar = ScalarHead(c.config.hidden_size, _dtype(dtype), c.config.init_method_std, ctx.learner_cfg.seed, sp)
                load_score_head(scalar, ctx.model_cfg.path)
                c.output_layer = scalar.to(_device_of(c))
            else:
                # Log-probs come from the hidden states, the LM head applied per token chunk
                # (lm_head.py): GPTModel never builds [tokens, V/TP] logits.
                defer_lm_head(c.output_layer)
        if head == "scalar":
            for c in chunks:
                # Untie on every chunk, not only the last stage's: a tied GPTModel passes the
                # embedding as the output weight of a layer that no longer has one, and under PP
                # the first stage would wait forever in the embedding-grad all-reduce for a last
                # stage that no longer joins it (a PP=2 critic's update hung).
                c.share_embeddings_and_output_weights = False
        for c in chunks:
            # Micro-batch shapes vary (dynamic batch size, packing): let PP p2p send shapes first.
            c.config.variable_seq_lengths = True
        self.adapter_params, self.held_adapters = 0, []
        if lora and ctx.learner_cfg.lora is not None:
            from asyncrl.config.components import resolve_lora_targets
            from asyncrl.learner.lora import adapter_modules, add_adapters

            lc = ctx.learner_cfg.lora
            targets = resolve_lora_targets(lc.target_modules)
            self.adapter_params = add_adapters(chunks, ctx.hf_config, rank=lc.rank, alpha=lc.alpha, dropout=lc.dropout,
                                               targets=targets, seed=ctx.learner_cfg.seed)
            self.held_adapters = adapter_modules(chunks) if lc.hold_merged else []
            if lc.init_from:
                from asyncrl.learner.lora import load_peft_adapter

                load_peft_adapter(chunks, lc.init_from, rank=lc.rank, alpha=lc.alpha, targets=targets)
        self.real_vocab = ctx.hf_config.vocab_size
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.cp_size = ps.get_context_parallel_world_size()
        self.cp_rank = ps.get_context_parallel_rank()
        self.cp_group = ps.get_context_parallel_group() if self.cp_size > 1 else None
        tp = ps.get_tensor_model_parallel_world_size()
        # Rows are padded so CP can cut them into 2 x CP chunks and SP each chunk into TP parts.
        self.width_multiple = (2 * self.cp_size if self.cp_size > 1 else 1) * (tp if sp else 1)
        self.is_last_stage = ps.is_pipeline_last_stage()
        self.pp = ps.get_pipeline_model_parallel_world_size()
        # The interleaved schedule's contiguous micro-batch group (Megatron defaults it to PP).
        self.vp_group_min = chunks[0].config.microbatch_group_size_per_vp_stage or self.pp
        self.chunks = [self._wrap_ddp(c) for c in chunks] if trainable else chunks
        for c in self.chunks:
            c.train(trainable)  # dropout is 0 anyway; eval() keeps the reference deterministic
        self.replayer = None  # learner.routing_replay: the engine's MoE routes, replayed in every pass
        if ctx.learner_cfg.routing_replay:
            from asyncrl.learner.routing_replay import RouteReplayer

            self.replayer = RouteReplayer(self.chunks, chunks[0].config.moe_router_topk)

    def _wrap_ddp(self, chunk: torch.nn.Module) -> torch.nn.Module:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        from asyncrl.learner.roles.optim import optimizer_sharded

        ddp_cfg = DistributedDataParallelConfig(  # (Megatron's host optimizer is its distributed one)
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=optimizer_sharded(self.ctx.learner_cfg),
        )
        ddp = DistributedDataParallel(config=chunk.config, ddp_config=ddp_cfg, module=chunk)
        ddp.broadcast_params()  # one starting point on every DP replica, whatever was loaded
        return ddp

    # ------------------------------------------------------------------ passes

    def micro_batches(self, samples: Sequence[Sample], response_width: int | None = None) -> list[MicroBatch]:
        cfg = self.ctx.learner_cfg
        return make_micro_batches(
            samples, micro_batch_size=cfg.micro_batch_size, max_tokens=cfg.max_tokens_per_micro_batch,
            pack=cfg.sequence_packing, response_width=response_width, width_multiple=self.width_multiple,
            dense_mask=self.attention != "sdpa",
            routes_shape=(self.replayer.layers, self.replayer.topk) if self.replayer is not None else None,
        )

    def device(self) -> torch.device:
        return _device_of(self.chunks[0])

    def run(self, mbs: list[MicroBatch], loss_fn: LossFn, *, forward_only: bool) -> list[dict[str, Any]]:
        """One pass over `mbs`; returns `loss_fn`'s dicts (last PP stage only, [] elsewhere).

        `loss_fn(mb, output)` gets the model output on this rank's positions: [rows, T/CP, H]
        final hidden states for the LM head (see `token_logprobs`), or [rows, T/CP, 1] for a
        scalar head, and returns (scalar loss, result dict). Megatron divides each loss by the
        number of micro-batches; callers that want another normalisation undo that.
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
            pads = [_empty_micro_batch(mbs[0], self.width_multiple) for _ in range(self.pp - real)]
            padding = {id(m) for m in pads}
            mbs = list(mbs) + pads
            from megatron.core.utils import get_model_config

            get_model_config(self.chunks[0]).microbatch_group_size_per_vp_stage = vp_group_size(
                len(mbs), self.pp, self.vp_group_min
            )
        scale = len(mbs) / real

        def forward_step(data_iter, model):
            mb = next(data_iter)
            # Batches are laid out on the host; only the model's inputs go to its device, and
            # per-token results stay there (no host synchronisation inside the pass).
            dev = _device_of(model)
            ids = _to_device(split_for_cp(mb.input_ids, self.cp_size, self.cp_rank), dev)
            pos = _to_device(split_for_cp(mb.position_ids, self.cp_size, self.cp_rank), dev)
            mask, packed = None, None
            if mb.packed and self.attention == "sdpa":
                packed = DocLayout.for_row([p.length for p in mb.placements], mb.input_ids.shape[1], self.cp_group)
            elif mb.attention_mask is not None:
                mask = mb.attention_mask.to(dev)
            if self.replayer is not None and mb.routes is not None:
                self.replayer.set(mb.routes, dev)
            elif self.replayer is not None:
                self.replayer.clear()  # (samples without routes, e.g. the warm-up's: the routers choose)
            out = model(ids, pos, mask, packed_seq_params=packed)
            if id(mb) in padding:
                return out, _padding_loss
            return out, partial(_loss_on_device, loss_fn, mb, dev, scale)

        data = iter(mbs) if len(self.chunks) == 1 else [iter(mbs) for _ in self.chunks]
        with torch.set_grad_enabled(not forward_only), hold_merged(self.held_adapters):
            out = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=data, model=self.chunks,
                num_microbatches=len(mbs), seq_length=max(m.input_ids.shape[1] for m in mbs),
                micro_batch_size=max(m.input_ids.shape[0] for m in mbs), forward_only=forward_only,
            )
        return [r for r in out if r is not _PADDING] if self.is_last_stage else []

    # ------------------------------------------------------------------ token math

    def held_tokens(self, mb: MicroBatch, flat_global: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For flattened global positions (`row * T + column`): (the flattened local position in
        this rank's output of each one this CP rank holds, that entry's index in `flat_global`),
        both on the model's device. Without CP every entry is held."""
        width = mb.input_ids.shape[1]
        if self.cp_size == 1:
            return _to_device(flat_global, self.device()), _to_device(torch.arange(flat_global.numel()), self.device())
        local = torch.full((width,), -1, dtype=torch.long)
        held_cols = torch.tensor(local_positions(width, self.cp_size, self.cp_rank), dtype=torch.long)
        local[held_cols] = torch.arange(held_cols.numel())
        rows, cols = flat_global // width, flat_global % width
        where = local[cols]
        keep = (where >= 0).nonzero(as_tuple=True)[0]
        src = rows[keep] * (width // self.cp_size) + where[keep]
        return _to_device(src, self.device()), _to_device(keep, self.device())

    def token_logprobs(
        self, hidden: torch.Tensor, mb: MicroBatch, *, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([n, L] log-probs of the response tokens, [n, L] entropy or None) in the response
        layout, float32, on the model's device, the same on every TP and CP rank.

        Only the hidden states that predict a response token are read; the LM head is applied
        to them in chunks of `logprob_chunk_size` tokens inside `linear_logprobs` (no [tokens, V]
        logits, in the forward or the backward). Logits are divided by the sampling temperature,
        the convention that makes them match the engine's sampler.
        """
        n, width = mb.response_mask.shape
        flat_dest = mb.response_mask.reshape(-1).nonzero(as_tuple=True)[0]
        src, which = self.held_tokens(mb, mb.gather_index[mb.response_mask])
        dev = hidden.device
        labels = _to_device(mb.labels[mb.response_mask], dev).index_select(0, which)
        dest = _to_device(flat_dest, dev).index_select(0, which)
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, src)
        lp_held, ent_held = linear_logprobs(
            rows, lm_head_weight(self.chunks[-1]), labels, temperature=self.ctx.algorithm_cfg.temperature,
            real_vocab=self.real_vocab, chunk=self.ctx.learner_cfg.logprob_chunk_size, with_entropy=with_entropy,
        )
        lp = self._spread(lp_held, dest, n * width).view(n, width)
        ent = self._spread(ent_held, dest, n * width).view(n, width) if with_entropy else None
        return lp, ent

    def token_scalars(self, output: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """[n, L] head outputs at the columns that predict each response token (the value layout)."""
        n, width = mb.response_mask.shape
        return self._pick(output, mb, mb.gather_index.reshape(-1)).view(n, width) * _to_device(mb.response_mask, output.device)

    def last_token_scalars(self, output: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """[n] head output at each sequence's last token (a reward model's score)."""
        return self._pick(output, mb, mb.last_token_index)

    def _pick(self, output: torch.Tensor, mb: MicroBatch, flat_global: torch.Tensor) -> torch.Tensor:
        src, which = self.held_tokens(mb, flat_global)
        return self._spread(output.reshape(-1).float().index_select(0, src), which, flat_global.numel())

    def _spread(self, held: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
        """[size] float32 with this CP rank's `held` values at `index`, summed over the CP group
        (every entry is held by exactly one CP rank, so the sum is the whole result)."""
        out = torch.zeros(size, dtype=torch.float32, device=held.device).index_put((index,), held)
        return combine_over_cp(out, self.cp_group)

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


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without waiting for the device (pinned staging on CUDA)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _loss_on_device(loss_fn: LossFn, mb: MicroBatch, device: torch.device, scale: float, output: torch.Tensor):
    """Megatron scales and backpropagates the loss with device tensors: hand it one there."""
    loss, result = loss_fn(mb, output)
    return (loss * scale if scale != 1 else loss).to(device), result


# What a padding micro-batch reports (dropped from `ModelRunner.run`'s results).
_PADDING: dict[str, Any] = {}


def _padding_loss(output: torch.Tensor):
    return output.float().sum() * 0.0, _PADDING


def _empty_micro_batch(like: MicroBatch, width_multiple: int = 1) -> MicroBatch:
    """Pad tokens and no sequence: a micro-batch that only fills the interleaved schedule."""
    width = like.response_mask.shape[1]
    return MicroBatch(
        sample_index=[], input_ids=torch.zeros(1, width_multiple, dtype=torch.long),
        position_ids=torch.zeros(1, width_multiple, dtype=torch.long), attention_mask=None, placements=[],
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
