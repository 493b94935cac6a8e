"""Functions that run inside spawned ranks (see _launch.py). Each returns plain data (host tensors).

Several layouts run one after another in the same processes (parallel_state is torn down and
rebuilt between them) so that all of tests/learner needs only two process launches.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch


def setup(world: int, strategy: dict, hf_dir: str, *, load: bool = True):
    from transformers import AutoConfig

    from asyncrl.config import LearnerConfig
    from asyncrl.learner.convert import load_hf_weights
    from asyncrl.learner.model import build_model_chunks
    from asyncrl.learner.parallel import init_model_parallel

    hf = AutoConfig.from_pretrained(hf_dir)
    init_model_parallel(LearnerConfig(world_size=world, strategy_config=strategy), hf)
    chunks = build_model_chunks(hf, strategy)
    if load:
        load_hf_weights(chunks, hf_dir, hf)
    for c in chunks:
        c.eval()
    return hf, chunks


def reset_parallel() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def forward_logits(chunks: list, ids: torch.Tensor, vocab: int) -> torch.Tensor | None:
    """Full-vocab logits through Megatron's own schedule; returned on TP rank 0 of the last stage."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    b, s = ids.shape
    kept: list[torch.Tensor] = []

    def forward_step(data_iter, model):
        dev = next(model.parameters()).device
        tokens = next(data_iter).to(dev)
        out = model(tokens, torch.arange(s, device=dev).expand(b, s), None)

        def loss_func(output):
            kept.append(gather_from_tensor_model_parallel_region(output)[..., :vocab].detach().cpu().clone())
            return output.sum() * 0.0, {}

        return out, loss_func

    # The interleaved (VPP) schedule takes one iterator per chunk and at least PP micro-batches.
    n = ps.get_pipeline_model_parallel_world_size() if len(chunks) > 1 else 1
    data = [iter([ids] * n) for _ in chunks] if len(chunks) > 1 else iter([ids])
    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data, model=chunks,
            num_microbatches=n, seq_length=s, micro_batch_size=b, forward_only=True,
        )
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        return kept[0]
    return None


def export(chunks: list, hf) -> dict[str, torch.Tensor] | None:
    from megatron.core import parallel_state as ps

    from asyncrl.learner.convert import export_hf_tensors

    out = {k: v.cpu() for k, v in export_hf_tensors(chunks, hf)}  # every rank drives the collective iterator
    return out if ps.get_tensor_model_parallel_rank() == 0 else None


def perturb(chunks: list, skip: tuple[str, ...] = ()) -> None:
    """Deterministic, TP-consistent change of every weight (seeded by the parameter name) whose
    name contains none of `skip`. Under PP a tied embedding has a copy on the first and the last
    stage under two names: skip both to keep them one weight."""
    with torch.no_grad():
        for c in chunks:
            for name, p in c.named_parameters():
                if any(s in name for s in skip):
                    continue
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                p.add_(0.05 * torch.randn(p.shape, generator=g).to(p.device))


def grad_norm_check(chunks: list) -> tuple[float, float]:
    """grad := weight, so the global grad norm must equal the full HF model's weight norm."""
    from asyncrl.learner.compat import clip_grad_norm_

    params = [p for c in chunks for p in c.parameters()]
    for p in params:
        p.grad = p.detach().clone()
    before = clip_grad_norm_(params, 0.0)
    clip_grad_norm_(params, before / 2)
    after = clip_grad_norm_(params, 0.0)
    return before, after


def recompute_grads(world: int, strategy: dict, demo: str, ids: torch.Tensor) -> dict[str, Any]:
    """Per learner.memory.recompute setting (none, selective, full): this rank's loss and every parameter's grad
    after one forward-backward (training mode, Megatron's schedule) of `ids` under `strategy`, and how often
    the layers' core attention and MLP ran forward (`<mode>_calls`)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from asyncrl.config import LearnerConfig

    b, s = ids.shape
    out: dict[str, dict[str, torch.Tensor]] = {}
    for mode in ("none", "selective", "full"):
        options = LearnerConfig(world_size=world, strategy_config=dict(strategy), memory={"recompute": mode}).strategy_config
        hf, chunks = setup(world, options, demo)
        losses: list[torch.Tensor] = []

        def forward_step(data_iter, model):
            dev = next(model.parameters()).device
            out_ = model(next(data_iter).to(dev), torch.arange(s, device=dev).expand(b, s), None)

            def loss_func(output):
                loss = output.float().square().mean()  # this rank's vocab shard: the same on every setting
                losses.append(loss.detach().cpu())
                return loss, {}
            return out_, loss_func

        calls = {"core_attention": 0, "mlp": 0}  # forward calls: a recomputed module runs again in the backward
        for c in chunks:
            c.train()
            for name, module in c.named_modules():
                kind = name.rsplit(".", 1)[-1]
                if kind in calls:
                    module.register_forward_hook(lambda *_, k=kind: calls.__setitem__(k, calls[k] + 1))
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([ids]), model=chunks,
                                    num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=False)
        grads = {n: p.grad.detach().cpu().clone() for c in chunks for n, p in c.named_parameters() if p.grad is not None}
        grads["__loss__"] = losses[0]
        out[mode] = grads
        out[f"{mode}_calls"] = dict(calls)
        del chunks
        reset_parallel()
    return out


def sp_overlap_grads(world: int, demo: str, ids: torch.Tensor) -> dict[str, Any]:
    """TP=2 with sequence parallelism, without and with `tp_comm_overlap`: this rank's loss and every parameter's
    grad after one forward-backward of `ids` (training mode, Megatron's schedule), and the classes of the layers'
    linears (`<overlap>_linears`)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    b, s = ids.shape
    out: dict[str, Any] = {}
    for overlap in (False, True):
        _, chunks = setup(world, {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                                  "tp_comm_overlap": overlap}, demo)
        losses: list[torch.Tensor] = []

        def forward_step(data_iter, model):
            dev = next(model.parameters()).device
            out_ = model(next(data_iter).to(dev), torch.arange(s, device=dev).expand(b, s), None)

            def loss_func(output):
                loss = output.float().square().mean()
                losses.append(loss.detach().cpu())
                return loss, {}
            return out_, loss_func

        for c in chunks:
            c.train()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([ids]), model=chunks,
                                    num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=False)
        grads = {n: p.grad.detach().cpu().clone() for c in chunks for n, p in c.named_parameters() if p.grad is not None}
        grads["__loss__"] = losses[0]
        out[overlap] = grads
        out[f"{overlap}_linears"] = sorted({type(m).__name__ for c in chunks for n, m in c.named_modules()
                                            if n.endswith(("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))})
        del chunks
        reset_parallel()
    return out


def where() -> dict[str, str]:
    """The backend and device this rank ran on (a GPU run must not pass on gloo)."""
    from asyncrl.learner.parallel import collective_device

    return {"backend": torch.distributed.get_backend(), "device": str(collective_device())}


def coords_check(world: int, strategy: dict) -> dict[str, Any]:
    """Our pure rank layout against Megatron's parallel_state, on this rank."""
    from megatron.core import parallel_state as ps

    from asyncrl.config import LearnerConfig
    from asyncrl.learner.parallel import ParallelLayout, rank_coords

    layout = ParallelLayout.from_learner_config(LearnerConfig(world_size=world, strategy_config=strategy))
    c = rank_coords(torch.distributed.get_rank(), layout)
    return {
        "ours": (c.tp, c.dp, c.pp),
        "megatron": (ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(),
                     ps.get_pipeline_model_parallel_rank()),
    }


# ----------------------------------------------------------------------------- runs


def run_tp(rank: int, world: int, demo: str, qwen3: str, ids: torch.Tensor, ckpt: str,
           lora_weights: torch.Tensor | None = None) -> dict[str, Any]:
    """TP=2: parity, round trip, grad norm, checkpoint save; Qwen3 at TP=2; then TP=1 (DP=2):
    parity and loading the TP=2 checkpoint."""
    from asyncrl.learner.checkpoint import load_checkpoint, save_checkpoint

    res: dict[str, Any] = {"where": where()}
    tp2 = {"tensor_model_parallel_size": 2}
    hf, chunks = setup(world, tp2, demo)
    res["coords"] = coords_check(world, tp2)
    res["tp2_logits"] = forward_logits(chunks, ids, hf.vocab_size)
    res["tp2_export"] = export(chunks, hf)
    res["tp2_grad_norm"] = grad_norm_check(chunks)
    perturb(chunks)
    res["tp2_perturbed_logits"] = forward_logits(chunks, ids, hf.vocab_size)
    save_checkpoint(ckpt, chunks, extra={"step": 7})

    res["tp2_recompute"] = recompute_grads(world, tp2, demo, ids)
    res["sp_overlap"] = sp_overlap_grads(world, demo, ids)
    hf3, chunks3 = setup(world, tp2, qwen3)
    res["qwen3_logits"] = forward_logits(chunks3, ids, hf3.vocab_size)
    res["qwen3_export"] = export(chunks3, hf3)
    del chunks, chunks3

    reset_parallel()
    tp1 = {"tensor_model_parallel_size": 1}
    hf, chunks = setup(world, tp1, demo)
    res["tp1_logits"] = forward_logits(chunks, ids, hf.vocab_size)
    _, fresh = setup(world, tp1, demo, load=False)
    res["ckpt_extra"] = load_checkpoint(ckpt, fresh)
    res["tp1_from_ckpt_logits"] = forward_logits(fresh, ids, hf.vocab_size)
    del chunks, fresh
    reset_parallel()
    res["tp1_recompute"] = recompute_grads(world, tp1, demo, ids)
    if lora_weights is not None:
        res["lora_tp1"] = lora_check(world, tp1, demo, ids, lora_weights)
        res["lora_tp2"] = lora_check(world, tp2, demo, ids, lora_weights)
    return res


def run_pp_ep(rank: int, world: int, demo: str, moe_dirs: list[str], ids: torch.Tensor, ckpt: str,
              lora_weights: torch.Tensor | None = None) -> dict[str, Any]:
    """PP=2: parity and round trip (and LoRA's check); PP=2 x VPP=2: parity, round trip and a checkpoint that TP=1
    (DP=2) loads; then EP=2 (DP=2) for each MoE model: parity and round trip."""
    from asyncrl.learner.checkpoint import load_checkpoint, save_checkpoint

    res: dict[str, Any] = {"where": where()}
    pp2 = {"pipeline_model_parallel_size": 2}
    hf, chunks = setup(world, pp2, demo)
    res["coords"] = coords_check(world, pp2)
    res["pp2_logits"] = forward_logits(chunks, ids, hf.vocab_size)
    res["pp2_export"] = export(chunks, hf)
    del chunks
    reset_parallel()
    if lora_weights is not None:
        res["lora_pp2"] = lora_check(world, pp2, demo, ids, lora_weights)

    vpp2 = {**pp2, "virtual_pipeline_model_parallel_size": 2}
    hf, chunks = setup(world, vpp2, demo)
    res["vpp2_chunks"] = len(chunks)
    res["vpp2_logits"] = forward_logits(chunks, ids, hf.vocab_size)
    res["vpp2_export"] = export(chunks, hf)
    perturb(chunks, skip=("word_embeddings", "output_layer"))
    res["vpp2_perturbed_logits"] = forward_logits(chunks, ids, hf.vocab_size)
    save_checkpoint(ckpt, chunks, extra={"step": 3})
    del chunks
    reset_parallel()
    _, fresh = setup(world, {}, demo, load=False)
    res["ckpt_extra"] = load_checkpoint(ckpt, fresh)
    res["tp1_from_vpp2_ckpt_logits"] = forward_logits(fresh, ids, hf.vocab_size)
    del fresh
    reset_parallel()
    ep2 = {"expert_model_parallel_size": 2}
    for i, d in enumerate(moe_dirs):
        hfm, chunks = setup(world, ep2, d)
        res[f"moe{i}_logits"] = forward_logits(chunks, ids, hfm.vocab_size)
        res[f"moe{i}_export"] = export(chunks, hfm)
        del chunks
        reset_parallel()
    res["replay"] = routing_replay_check(world, ep2, moe_dirs[-1], ids)
    reset_parallel()
    return res


def routing_replay_check(world: int, strategy: dict, hf_dir: str, ids: torch.Tensor) -> dict[str, Any]:
    """R3 at EP=2: the routes a forward chose, recorded by Megatron's routers and handed back through
    RouteReplayer in the micro-batch layout ([rows, width, layers, top-k]), give the same logits; routes
    moved to other experts give other logits; cleared, the routers choose for themselves again."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction
    from transformers import AutoConfig

    from asyncrl.config import LearnerConfig
    from asyncrl.learner.convert import load_hf_weights
    from asyncrl.learner.model import build_model_chunks
    from asyncrl.learner.parallel import init_model_parallel
    from asyncrl.learner.routing_replay import RouteReplayer

    hf = AutoConfig.from_pretrained(hf_dir)
    init_model_parallel(LearnerConfig(world_size=world, strategy_config=dict(strategy)), hf)
    chunks = build_model_chunks(hf, {**strategy, "moe_enable_routing_replay": True})
    load_hf_weights(chunks, hf_dir, hf)
    for c in chunks:
        c.eval()
    replayer = RouteReplayer(chunks, hf.num_experts_per_tok)
    for r in replayer.routers:
        r.set_router_replay_action(RouterReplayAction.RECORD)
    own = forward_logits(chunks, ids, hf.vocab_size)
    b, s = ids.shape
    # each router saw [s * b, k] (sequence-first): back to the micro-batch's [b, s, layers, k]
    routes = torch.stack([r.get_recorded_indices().detach().cpu().reshape(s, b, -1).transpose(0, 1)
                          for r in replayer.routers], dim=2)
    dev = next(chunks[0].parameters()).device
    replayer.set(routes, dev)
    replayed = forward_logits(chunks, ids, hf.vocab_size)
    replayer.set((routes + 1) % hf.num_experts, dev)
    moved = forward_logits(chunks, ids, hf.vocab_size)
    replayer.clear()
    again = forward_logits(chunks, ids, hf.vocab_size)
    return {"layers": replayer.layers, "routes_shape": tuple(routes.shape), "own": own, "replayed": replayed,
            "moved": moved, "cleared": again}


LORA_R, LORA_ALPHA = 4, 8.0
LORA_HF = {"linear_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")), "linear_proj": ("self_attn", ("o_proj",)),
           "linear_fc1": ("mlp", ("gate_proj", "up_proj")), "linear_fc2": ("mlp", ("down_proj",))}


def lora_values(hf_name: str, rows: int, cols: int) -> torch.Tensor:
    """The test's global value of one adapter matrix (HF module name + 'A' / 'B'), the same for PEFT and us."""
    g = torch.Generator().manual_seed(zlib.crc32(hf_name.encode()))
    return 0.05 * torch.randn(rows, cols, generator=g)


def lora_check(world: int, strategy: dict, demo: str, ids: torch.Tensor, weights: torch.Tensor) -> dict[str, Any]:
    """learner.lora's adapters (asyncrl/learner/lora.py) on the demo model under `strategy`: which parameters train,
    the logits and every adapter's gradient (whole, gathered over TP) of loss = sum(logits * weights) with the test's
    adapter values (`lora_values`), and the merged export. The parent compares them with PEFT's."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from asyncrl.config.components import LORA_TARGETS
    from asyncrl.learner.lora import LinearAdapters, _layer_of, add_adapters

    hf, chunks = setup(world, strategy, demo)
    count = add_adapters(chunks, hf, rank=LORA_R, alpha=LORA_ALPHA, dropout=0.0, targets=LORA_TARGETS, seed=7)
    trainable = sorted(n for c in chunks for n, p in c.named_parameters() if p.requires_grad)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    init_b_zero = all(float(m.B[p].abs().max()) == 0 for c in chunks for m in c.modules()
                      if isinstance(m, LinearAdapters) for p in m.parts)
    init_a = {}
    adapters: dict[str, tuple[Any, str]] = {}  # HF module name -> (adapters, part)
    with torch.no_grad():
        for c in chunks:
            for name, m in c.named_modules():
                if not isinstance(m, LinearAdapters):
                    continue
                layer = _layer_of(name, c) - 1
                block, parts = LORA_HF[m.slot]
                for p in parts:
                    hf_name = f"model.layers.{layer}.{block}.{p}"
                    adapters[hf_name] = (m, p)
                    init_a[hf_name] = _gather(m.A[p], 1, tp) if m.row else m.A[p].detach().clone()
                    a, b = m.A[p], m.B[p]
                    ga = lora_values(hf_name + ".A", LORA_R, a.shape[1] * (tp if m.row else 1))
                    gb = lora_values(hf_name + ".B", b.shape[0] * (1 if m.row else tp), LORA_R)
                    a.copy_(ga[:, tp_rank * a.shape[1]:(tp_rank + 1) * a.shape[1]] if m.row else ga)
                    b.copy_(gb if m.row else gb[tp_rank * b.shape[0]:(tp_rank + 1) * b.shape[0]])
    b_, s = ids.shape
    kept: list[torch.Tensor] = []

    def forward_step(data_iter, model):
        out = model(next(data_iter), torch.arange(s).expand(b_, s), None)

        def loss_func(output):
            full = gather_from_tensor_model_parallel_region(output)[..., :hf.vocab_size]
            kept.append(full.detach().clone())
            return (full.float() * weights).sum(), {}
        return out, loss_func

    for c in chunks:
        c.train()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([ids]), model=chunks,
                                num_microbatches=1, seq_length=s, micro_batch_size=b_, forward_only=False)
    grads = {}
    for hf_name, (m, p) in adapters.items():
        grads[hf_name + ".A"] = _gather(m.A[p].grad, 1, tp) if m.row else m.A[p].grad.clone()
        grads[hf_name + ".B"] = m.B[p].grad.clone() if m.row else _gather(m.B[p].grad, 0, tp)
    res = {"count": count, "trainable": trainable, "init_b_zero": init_b_zero, "init_a": init_a,
           "logits": kept[0] if kept and tp_rank == 0 else None, "grads": grads, "export": export(chunks, hf)}
    del chunks
    reset_parallel()
    return res


def _gather(t: torch.Tensor, dim: int, tp: int) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    if tp == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(tp)]
    torch.distributed.all_gather(parts, t.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)
