"""Learner on one device: HF parity, HF<->Megatron round trip, and the actor's training-step time.

Sections (each one runs even when an earlier one failed; the error is recorded in the output):

  parity  float32, TF32 off: Megatron `GPTModel` built from the HF config and loaded through
          `asyncrl.learner.convert` against `transformers` (eager attention) on the same ids:
          max |logit diff| and max |log-prob diff|; then every exported HF tensor against the
          checkpoint, bit for bit.
  bare    the baseline: the same `GPTModel` (in --dtype), a plain loop of `model(...)` + token
          cross-entropy + `loss.backward()` over the batch's micro-batches; no optimizer.
  role    our `ActorRole` in this process (Megatron DDP + optimizer + GRPO loss): `compute_log_prob`
          and `update_actor` (one optimizer step) on the same batch, plus the optimizer step alone.
  offload the actor with params, grads and optimizer state resident vs offloaded between calls
          (`learner.actor` offload flags): idle device memory, each move's before/after, update
          time, and the log-prob difference after the same two updates (numerics unchanged).
  group   the same through `LearnerGroup` (one Ray rank actor per TP rank), as the trainer calls it.
  hf      the baseline a user would write: `transformers` (sdpa attention) in --dtype, forward with
          `labels=` (its own full-vocab cross-entropy) + backward over the same micro-batches, then
          fused AdamW on float32 master copies of the weights (grads copied up, weights copied back
          down): seconds per step, tokens/s, MFU and peak memory on the same batch as `role`.

With --tp N > 1 (tensor parallel over N GPUs, NCCL): parity, bare and role run in N processes
started here with `torch.multiprocessing` (rank r on GPU r, one process group of N ranks, Megatron
TP = N, no sequence parallelism unless --sequence-parallel); rank 0 gathers the vocab-parallel
logits for parity, compares the exported tensors and records the figures. group starts a
`LearnerGroup` of world_size N with strategy_config {tensor_model_parallel_size: N}. "params" is
then the HF checkpoint's parameter count (tied embedding once, no vocab padding), and MFU's peak
is N x --peak-flops. --cp M (context parallel) multiplies the ranks by M (N x M processes and GPUs,
strategy_config {context_parallel_size: M}); role and group run with it, parity and bare at --cp 1.

The batch is fixed: --batch sequences of --seq-len tokens (--prompt-len prompt + the rest response),
random ids, GRPO groups of --group-size with +-1 advantages. Prints one JSON object and writes it
to --out after every section.

MFU = 6 * parameters * tokens / seconds / (tp * cp * peak) (2 * ... for compute_log_prob, a forward), with peak
989e12 per GPU (H100/H200 SXM dense bf16; pass --peak-flops for another device). Parameters count the tied
embedding once. mfu_with_attention adds causal attention's matmuls: 3 x 2 * layers * heads * head_dim * sum(S^2)
over the batch's sequences (1 x for a forward; `attention_flops_forward`); recomputed passes are not counted. For
an MoE model "params" of bare/role/group are the active parameters (shared weights + num_experts_per_tok of the
routed experts). --recompute / --optimizer set learner.memory for role and group (long sequences: e.g.
--batch 2 --seq-len 32768 --micro-batch-size 1 --recompute full).

    python benchmarks/learner_step.py --model /tmp/qwen2-0.5b-random --out /tmp/learner.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

RESULTS: dict[str, Any] = {"benchmark": "learner_step"}
RANK = 0  # this process's rank in the TP process group (0 without --tp)
HF_CFG: Any = None  # the checkpoint's HF config: attention's FLOPs in `stats`


def _save(path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(RESULTS, indent=1, default=str))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def section(name: str, out: str | None):
    """Decorator: run, time and record one section; a failure is recorded, not raised."""

    def wrap(fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            if RANK == 0:
                print(f"[learner_step] {name} ...", flush=True)
            try:
                RESULTS[name] = fn(*args, **kwargs)
                RESULTS[name]["section_seconds"] = round(time.perf_counter() - t0, 1)
            except BaseException as e:  # noqa: BLE001 - record and go on to the next section
                RESULTS[name] = {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-6000:]}
                print(f"[rank {RANK}] " + traceback.format_exc(), file=sys.stderr, flush=True)
            if RANK == 0:
                print(f"[learner_step] {name}: {json.dumps(RESULTS[name], default=str)[:3000]}", flush=True)
                _save(out)
            _free()

        return run

    return wrap


# ----------------------------------------------------------------------------- data


def make_samples(batch: int, seq_len: int, prompt_len: int, group_size: int, vocab: int, seed: int = 0):
    from asyncrl.types import Sample

    g = torch.Generator().manual_seed(seed)
    resp = seq_len - prompt_len
    return [
        Sample(
            prompt_ids=torch.randint(3, vocab, (prompt_len,), generator=g).tolist(),
            response_ids=torch.randint(3, vocab, (resp,), generator=g).tolist(),
            behavior_logprobs=[], versions=[0] * resp, reward=float(i % 2), group_id=i // group_size,
        )
        for i in range(batch)
    ]


def advantages(samples) -> list[list[float]]:
    return [[1.0 if s.reward > 0 else -1.0] * len(s.response_ids) for s in samples]


def attention_flops_forward(hf: Any, seq_lens: list[int]) -> float:
    """Causal self-attention's matmul FLOPs in one forward over sequences of `seq_lens` tokens: per layer and
    sequence of S tokens, Q K^T and P V each 2 S^2 h_q multiply-adds halved by the causal mask, so 2 S^2 h_q in
    all (h_q = heads x head_dim); summed over the layers and the sequences (each its own block when packed)."""
    heads = int(hf.num_attention_heads)
    h_q = heads * int(getattr(hf, "head_dim", None) or hf.hidden_size // heads)
    return 2.0 * int(hf.num_hidden_layers) * h_q * float(sum(s * s for s in seq_lens))


def stats(times: list[float], tokens: int, params: int, peak_flops: float, forward_only: bool = False) -> dict[str, float]:
    """mfu = 2 x passes x params x tokens / s / peak (passes: 3 for forward + backward = 6N a token, 1 for a
    forward); mfu_with_attention adds passes x attention_flops_forward over the batch (--batch x --seq-len).
    Recomputed forwards are not counted: model FLOPs, not hardware FLOPs."""
    mean = sum(times) / len(times)
    passes = 1 if forward_only else 3
    dense = 2.0 * passes * params * tokens
    attn = passes * attention_flops_forward(HF_CFG, [ARGS.seq_len] * ARGS.batch) if HF_CFG is not None else 0.0
    return {
        "seconds_per_step": round(mean, 4), "seconds_min": round(min(times), 4), "steps_timed": len(times),
        "tokens_per_step": tokens, "tokens_per_s": round(tokens / mean, 1),
        "mfu": round(dense / mean / peak_flops, 4), "mfu_with_attention": round((dense + attn) / mean / peak_flops, 4),
        "tflops_per_s_with_attention": round((dense + attn) / mean / 1e12, 1),
    }


# ----------------------------------------------------------------------------- process setup


def world() -> int:
    """Ranks (GPUs) of the in-process sections and of the group: --tp x --cp (x --dp: the group section alone)."""
    return ARGS.tp * ARGS.cp * ARGS.dp


def strategy() -> dict[str, Any]:
    """The learner's strategy_config: empty on one GPU (as before); TP (+ SP if asked) with --tp,
    context parallel with --cp."""
    out: dict[str, Any] = {}
    if ARGS.tp > 1:
        out.update(tensor_model_parallel_size=ARGS.tp, sequence_parallel=ARGS.sequence_parallel)
        if ARGS.tp_comm_overlap:
            out["tp_comm_overlap"] = True
    if ARGS.cp > 1:
        out["context_parallel_size"] = ARGS.cp
    return out


def init_rank(rank: int = 0, world_size: int = 1, port: int | None = None) -> Any:
    """torch.distributed (nccl on GPU, gloo + CPU compat otherwise) and Megatron's groups."""
    from transformers import AutoConfig

    from asyncrl.config import LearnerConfig
    from asyncrl.learner.compat import install_cpu_compat
    from asyncrl.learner.parallel import init_distributed, init_model_parallel

    handle = install_cpu_compat()
    RESULTS.setdefault("env", {})["cpu_compat_active"] = handle.active
    RESULTS["env"]["cpu_compat_reason"] = handle.reason
    backend = init_distributed(rank, world_size, "127.0.0.1", port or _free_port(),
                               timeout_s=ARGS.collective_timeout_s)
    RESULTS["env"]["backend"] = backend
    hf = AutoConfig.from_pretrained(ARGS.model)
    init_model_parallel(LearnerConfig(world_size=world_size, strategy_config=strategy()), hf)
    return hf


def init_single_rank() -> Any:
    return init_rank(0, 1)


def hf_params(hf: Any) -> int:
    """Parameters of the HF checkpoint (tied embedding once, no vocab padding): the MFU count at TP > 1."""
    import math

    from asyncrl.learner.convert import expected_hf_shapes

    return sum(math.prod(s) for s in expected_hf_shapes(hf).values())


def flop_params(hf: Any, params: int) -> int:
    """The parameter count MFU uses: `params` for a dense model; for MoE, what one token passes
    through (every shared weight, `num_experts_per_tok` of the routed experts), from the HF shapes."""
    import math

    from asyncrl.learner.convert import expected_hf_shapes

    experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None)
    if not experts:
        return params
    routed = sum(math.prod(s) for n, s in expected_hf_shapes(hf).items() if ".mlp.experts." in n)
    return hf_params(hf) - routed + routed * int(hf.num_experts_per_tok) // int(experts)


def peak() -> float:
    return ARGS.peak_flops * world()


def build(hf: Any, dtype: str) -> list:
    from asyncrl.learner.convert import load_hf_weights
    from asyncrl.learner.model import build_model_chunks

    chunks = build_model_chunks(hf, strategy(), dtype, attention=ARGS.attention)
    load_hf_weights(chunks, ARGS.model, hf)
    return chunks


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# ----------------------------------------------------------------------------- sections


def parity(hf: Any) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from asyncrl.learner.convert import SafetensorsDir, export_hf_tensors, hf_tensor_names

    if ARGS.cp > 1:
        return {"skipped": "parity runs at --cp 1 (CP's is tests/learner/test_group.py's, over NCCL: gpu_session.sh learner2)"}
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    dev = device()
    chunks = build(hf, "float32")
    (model,) = chunks
    model.eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, hf.vocab_size, (ARGS.parity_batch, ARGS.parity_tokens), generator=g).to(dev)
    pos = torch.arange(ids.shape[1], device=dev).expand_as(ids)
    with torch.no_grad():
        ours = model(ids, pos, None)
        if ARGS.tp > 1:  # vocab-parallel logits: every TP rank holds V/TP columns
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

            ours = gather_from_tensor_model_parallel_region(ours)
        ours = ours[..., : hf.vocab_size].float()
    local_params = sum(p.numel() for p in model.parameters())
    if RANK != 0:  # the export below is collective: drive it to the end, compare nothing
        del ours
        for _ in export_hf_tensors(chunks, hf):
            pass
        return {"rank": RANK}
    ref = AutoModelForCausalLM.from_pretrained(ARGS.model, dtype=torch.float32, attn_implementation="eager").to(dev).eval()
    with torch.no_grad():
        theirs = ref(ids).logits.float()
    diff = (ours - theirs).abs()
    lp_diff = (ours.log_softmax(-1) - theirs.log_softmax(-1)).abs()
    out: dict[str, Any] = {
        "dtype": "float32", "tf32": False, "hf_attn_implementation": "eager", "tp": ARGS.tp,
        "ids_shape": list(ids.shape), "logits_max_abs_diff": float(diff.max()),
        "logits_mean_abs_diff": float(diff.mean()), "logits_max_abs": float(theirs.abs().max()),
        "logprobs_max_abs_diff": float(lp_diff.max()),
        "argmax_agreement": float((ours.argmax(-1) == theirs.argmax(-1)).float().mean()),
    }
    del ref, ours, theirs, diff, lp_diff
    _free()
    reader = SafetensorsDir(ARGS.model)
    exported, mismatched, dtypes = [], [], set()
    for name, t in export_hf_tensors(chunks, hf):
        exported.append(name)
        want = reader.get(name)
        dtypes.add(str(want.dtype))
        back = t.detach().to("cpu", want.dtype)  # Megatron float32 -> checkpoint dtype: exact when lossless
        if back.shape != want.shape or not torch.equal(_bits(back), _bits(want)):
            mismatched.append(name)
    expected = hf_tensor_names(hf)
    out.update({
        "roundtrip_tensors": len(exported), "roundtrip_expected": len(expected),
        "roundtrip_same_names": sorted(exported) == sorted(expected),
        "roundtrip_bit_exact": not mismatched and sorted(exported) == sorted(expected),
        "roundtrip_mismatched": mismatched[:10], "checkpoint_dtypes": sorted(dtypes),
        "params": local_params if ARGS.tp == 1 else hf_params(hf), "rank0_local_params": local_params,
        "peak_gib": _peak_gib(),
    })
    del chunks, model
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def bare(hf: Any) -> dict[str, Any]:
    """Plain Megatron forward + backward on the batch's micro-batches: the floor the learner adds to."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if ARGS.cp > 1:
        return {"skipped": "bare runs at --cp 1 (its inputs are not split over CP ranks)"}
    dev = device()
    (model,) = build(hf, ARGS.dtype)
    model.train()
    params = flop_params(hf, sum(p.numel() for p in model.parameters()) if world() == 1 else hf_params(hf))
    samples = make_samples(ARGS.batch, ARGS.seq_len, ARGS.prompt_len, ARGS.group_size, hf.vocab_size)
    ids = torch.tensor([s.prompt_ids + s.response_ids for s in samples], device=dev)
    pos = torch.arange(ids.shape[1], device=dev).expand_as(ids)
    labels = torch.roll(ids, -1, dims=1)

    def step() -> None:
        for a in range(0, ids.shape[0], ARGS.micro_batch_size):
            sl = slice(a, a + ARGS.micro_batch_size)
            logits = model(ids[sl], pos[sl], None)  # [b, s, V]
            loss = vocab_parallel_cross_entropy(logits.float(), labels[sl]).mean()  # every token, full vocab
            loss.backward()
        model.zero_grad(set_to_none=False)

    times = timed(step)
    out = {"dtype": ARGS.dtype, "micro_batch_size": ARGS.micro_batch_size, "params": params, "tp": ARGS.tp,
           **stats(times, ids.numel(), params, peak()), "peak_gib": _peak_gib()}
    model = None  # (freed before the next section; the step closure reads it, so no `del`)
    return out


def timed(fn) -> list[float]:
    for _ in range(ARGS.warmup):
        fn()
    _sync()
    times = []
    for _ in range(ARGS.steps):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return times


def hf_baseline(hf_cfg: Any) -> dict[str, Any]:
    """Plain transformers + fused AdamW on fp32 master weights: what our learner is compared with."""
    from transformers import AutoModelForCausalLM

    dev = device()
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[ARGS.dtype]
    model = AutoModelForCausalLM.from_pretrained(ARGS.model, dtype=dtype, attn_implementation="sdpa").to(dev)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    master = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(master, lr=1e-6, fused=dev.type == "cuda")
    samples = make_samples(ARGS.batch, ARGS.seq_len, ARGS.prompt_len, ARGS.group_size, hf_cfg.vocab_size)
    ids = torch.tensor([s.prompt_ids + s.response_ids for s in samples], device=dev)
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())

    def step() -> None:
        for a in range(0, ids.shape[0], ARGS.micro_batch_size):
            mb = ids[a : a + ARGS.micro_batch_size]
            loss = model(input_ids=mb, labels=mb).loss / -(-ids.shape[0] // ARGS.micro_batch_size)
            loss.backward()
        for m, p in zip(master, params):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_(params, master)

    times = timed(step)
    out = {"dtype": ARGS.dtype, "micro_batch_size": ARGS.micro_batch_size, "params": n_params,
           "attn_implementation": "sdpa", "optimizer": "torch.optim.AdamW(fused) on fp32 master copies",
           **stats(times, ids.numel(), flop_params(hf_cfg, n_params), peak()), "peak_gib": _peak_gib()}
    model = master = opt = None  # (freed before the next section; the step closure reads them)
    return out


def _configs():
    from asyncrl.config import AlgorithmConfig, LearnerConfig, ModelConfig
    from asyncrl.config.components import MemoryConfig

    model = ModelConfig(path=ARGS.model, dtype=ARGS.dtype, max_model_len=ARGS.seq_len)
    memory = MemoryConfig(recompute=ARGS.recompute, recompute_method=ARGS.recompute_method,
                          recompute_layers=ARGS.recompute_layers, optimizer=ARGS.optimizer,
                          optimizer_host_fraction=ARGS.optimizer_host_fraction)
    lora = {"rank": ARGS.lora_rank, "alpha": ARGS.lora_alpha, "hold_merged": not ARGS.lora_rebuild_merged}
    learner = LearnerConfig(world_size=world(), strategy_config=strategy(), micro_batch_size=ARGS.micro_batch_size, lr=1e-6,
                            memory=memory, lora=lora if ARGS.lora_rank else None,
                            attention=ARGS.attention, sequence_packing=ARGS.pack, max_tokens_per_micro_batch=ARGS.max_tokens,
                            num_cpus_per_rank=ARGS.num_cpus_per_rank,
                            num_gpus_per_rank=1.0 if torch.cuda.is_available() else 0.0)
    algo = AlgorithmConfig(group_size=ARGS.group_size)
    return model, learner, algo


def role(hf: Any) -> dict[str, Any]:
    from asyncrl.learner.parallel import ParallelLayout
    from asyncrl.learner.roles import ActorRole, RoleContext

    model_cfg, learner_cfg, algo = _configs()
    layout = ParallelLayout.from_learner_config(learner_cfg)
    actor = ActorRole(RoleContext(model_cfg, learner_cfg, algo, hf, layout, RANK))
    params = flop_params(hf, sum(p.numel() for p in actor.runner.parameters()) if world() == 1 else hf_params(hf))
    samples = make_samples(ARGS.batch, ARGS.seq_len, ARGS.prompt_len, ARGS.group_size, hf.vocab_size)
    tokens = ARGS.batch * ARGS.seq_len
    lp = actor.compute_log_prob(samples)
    if world() > 1:  # only rank 0 answers (None elsewhere); the group hands its result to every rank
        box = [lp]
        torch.distributed.broadcast_object_list(box, src=0)
        lp = box[0]
    batch = [_with_behavior(s, row) for s, row in zip(samples, lp["logprobs"])]
    adv = advantages(samples)
    metrics: dict[str, float] = {}

    def update() -> None:
        metrics.update(actor.update_actor(batch, adv, lp["logprobs"]))

    logprob_times = timed(lambda: actor.compute_log_prob(samples))
    update_times = timed(update)
    if ARGS.profile:
        _profile(update, ARGS.profile)
    if ARGS.sync_debug and torch.cuda.is_available():
        _host_syncs(update, "update_actor")
        _host_syncs(lambda: actor.compute_log_prob(samples), "compute_log_prob")
    after = actor.compute_log_prob(samples)  # the updated policy's log-probs: host and device optimizers agree
    actor.optim.zero_grad()
    optim_times = timed(lambda: actor.optim.step(loss_finite=True))
    inner = getattr(actor.optim.optimizer, "optimizer", actor.optim.optimizer)
    return {
        "memory": learner_cfg.memory.model_dump(), "lora": learner_cfg.lora and learner_cfg.lora.model_dump(),
        "optimizer_class": type(inner).__name__,
        "logprob_sum_after_updates": None if after is None else round(float(sum(sum(r) for r in after["logprobs"])), 4),
        "dtype": ARGS.dtype, "micro_batch_size": ARGS.micro_batch_size, "params": params,
        "update_actor": stats(update_times, tokens, params, peak()),
        "compute_log_prob": stats(logprob_times, tokens, params, peak(), forward_only=True),
        "optimizer_step_seconds": round(sum(optim_times) / len(optim_times), 4),
        "last_metrics": {k: metrics[k] for k in sorted(metrics) if k.startswith("actor/")},
        "peak_gib": _peak_gib(),
    }


def _profile(fn, path: str) -> None:
    """One more call of `fn` under torch.profiler: the top device kernels, and how much of the wall
    time the device was busy (host gaps), into `path` (text)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    _sync()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        fn()
        _sync()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    # device-side events only (kernels, copies): a host op's device time repeats its kernels'
    kernels = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU]
    busy = sum(e.self_device_time_total for e in kernels) / 1e6
    table = events.table(sort_by="self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total",
                         row_limit=70, max_name_column_width=110)
    groups: dict[str, float] = {}
    for e in kernels:
        if e.self_device_time_total > 0:
            groups[_kernel_group(e.key)] = groups.get(_kernel_group(e.key), 0.0) + e.self_device_time_total / 1e6
    summary = "\n".join(f"  {k:<12} {v:8.4f} s" for k, v in sorted(groups.items(), key=lambda kv: -kv[1]))
    Path(path).write_text(f"wall {wall:.4f} s, device busy {busy:.4f} s ({busy / wall:.1%})\n{summary}\n{table}\n")
    print(f"[learner_step] device time by kind:\n{summary}", flush=True)
    print(f"[learner_step] profile: wall {wall:.4f} s, device busy {busy:.4f} s", flush=True)


def _host_syncs(fn, name: str) -> None:
    """One more call of `fn` with CUDA's sync debug mode on: every operation that made the host
    wait for the device (`.item()`, pageable copies, ...), printed with the Python frames of
    asyncrl / megatron / benchmarks that led to it, most frequent first."""
    import traceback
    import warnings
    from collections import Counter

    seen: Counter[str] = Counter()

    def record(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        frames = [f for f in traceback.extract_stack()[:-1] if any(k in f.filename for k in ("asyncrl", "megatron", "benchmarks"))]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in reversed(frames[-6:]))
        seen[f"{str(message)[:80]} @ {where}"] += 1

    _sync()
    with warnings.catch_warnings():  # restores the filters and showwarning on the way out
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    print(f"[learner_step] host syncs in one {name}: {sum(seen.values())}", flush=True)
    for k, n in seen.most_common(12):
        print(f"  {n:5d} x {k}", flush=True)


def _kernel_group(name: str) -> str:
    """A device kernel's kind, from its name (cuBLAS / CUTLASS / cuDNN naming)."""
    n = name.lower()
    if any(k in n for k in ("fmha", "flash", "cudnn", "attention")):
        return "attention"
    if any(k in n for k in ("gemm", "nvjet", "xmma", "cutlass", "matmul", "splitk")):
        return "gemm"
    if "adam" in n or "multi_tensor" in n or "foreach" in n:
        return "optimizer"
    if "memcpy" in n or "memset" in n:
        return "copy/memset"
    if "triton" in n:
        return "triton"
    if any(k in n for k in ("nccl", "allreduce", "all_reduce")):
        return "comm"
    return "elementwise"


def offload(hf: Any) -> dict[str, Any]:
    """The actor with params, grads and optimizer state resident vs offloaded between calls (all
    three `learner.actor` flags): device memory while idle, each move's before/after, update
    time, and whether offloading changes numerics (log-probs after the same two updates)."""
    from asyncrl.config import RoleOffload
    from asyncrl.learner.offload import device_memory_bytes
    from asyncrl.learner.parallel import ParallelLayout
    from asyncrl.learner.roles import ActorRole, RoleContext

    if world() > 1:
        return {"skipped": "offload runs with --tp 1"}
    model_cfg, learner_cfg, algo = _configs()
    layout = ParallelLayout.from_learner_config(learner_cfg)
    samples = make_samples(ARGS.batch, ARGS.seq_len, ARGS.prompt_len, ARGS.group_size, hf.vocab_size)
    gib = 2**30
    out: dict[str, Any] = {}
    after: dict[str, list[list[float]]] = {}
    flags = {"resident": (), "resident_again": (), "offloaded": ("param", "grad", "optimizer")}
    if ARGS.offload_each_flag:  # which flag, if any, changes the numerics
        flags.update({f"{f}_only": (f,) for f in ("param", "grad", "optimizer")})
    for mode, which in flags.items():  # resident twice: the kernels' own run-to-run noise
        _free()
        on = bool(which)
        cfg = learner_cfg.model_copy(update={"actor": RoleOffload(**{f"{f}_offload": True for f in which})})
        actor = ActorRole(RoleContext(model_cfg, cfg, algo, hf, layout, RANK))
        if on:
            actor.offloader.offload()  # the role starts resident; a hybrid run puts it away first
        lp = actor.compute_log_prob(samples)
        batch = [_with_behavior(s, row) for s, row in zip(samples, lp["logprobs"])]
        adv = advantages(samples)
        times = []
        for _ in range(2):
            _sync()
            t0 = time.perf_counter()
            actor.update_actor(batch, adv, lp["logprobs"])
            _sync()
            times.append(time.perf_counter() - t0)
        idle = device_memory_bytes()
        after[mode] = actor.compute_log_prob(samples)["logprobs"]
        out[mode] = {
            "idle_device_gib": round(idle / gib, 3), "peak_gib": _peak_gib(),
            "update_seconds": [round(t, 4) for t in times],
            **{k.removeprefix("learner/").replace("_bytes", "_gib"): round(v / gib, 3) if k.endswith("_bytes") else v
               for k, v in actor.offloader.last_report.items()},
        }
        del actor, lp, batch
    def max_diff(x: str, y: str) -> float | None:
        diffs = [abs(a - b) for ra, rb in zip(after[x], after[y]) for a, b in zip(ra, rb)]
        return max(diffs) if diffs else None

    out["logprob_max_abs_diff_after_2_updates"] = {f"resident_vs_{m}": max_diff("resident", m) for m in flags if m != "resident"}
    out["idle_gib_saved"] = round(out["resident"]["idle_device_gib"] - out["offloaded"]["idle_device_gib"], 3)
    return out


def _with_behavior(sample, row):
    import msgspec

    return msgspec.structs.replace(sample, behavior_logprobs=list(row))


def group() -> dict[str, Any]:
    import ray

    from asyncrl.learner.group import LearnerGroup

    model_cfg, learner_cfg, algo = _configs()
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(ARGS.model).vocab_size
    samples = make_samples(ARGS.batch, ARGS.seq_len, ARGS.prompt_len, ARGS.group_size, vocab)
    tokens = ARGS.batch * ARGS.seq_len
    # Integer counts: a float num_cpus reaches the raylet's command line and it never starts.
    ray.init(num_cpus=int(ARGS.num_cpus_per_rank * world() + 2), num_gpus=world() if torch.cuda.is_available() else 0,
             include_dashboard=False, log_to_driver=True)

    async def go() -> dict[str, Any]:
        g = LearnerGroup("actor", model_cfg, learner_cfg, algo)
        t0 = time.perf_counter()
        setup = await g.start()
        start_s = time.perf_counter() - t0
        try:
            lp = await g.compute_log_prob(samples)
            batch = [_with_behavior(s, row) for s, row in zip(samples, lp)]
            adv = advantages(samples)

            async def timed_async(fn) -> list[float]:
                for _ in range(ARGS.warmup):
                    await fn()
                times = []
                for _ in range(ARGS.steps):
                    t = time.perf_counter()
                    await fn()
                    times.append(time.perf_counter() - t)
                return times

            metrics: dict[str, float] = {}

            async def update() -> None:
                metrics.update(await g.update_actor(batch, adv, lp))

            logprob_times = await timed_async(lambda: g.compute_log_prob(samples))
            update_times = await timed_async(update)
            params = RESULTS.get("role", {}).get("params") or RESULTS.get("bare", {}).get("params") or \
                flop_params(HF_CFG, hf_params(HF_CFG))  # (the group section alone: the checkpoint's count)
            return {
                "setup": setup, "start_seconds": round(start_s, 1), "params": params,
                "tp": ARGS.tp, "cp": ARGS.cp, "dp": ARGS.dp, "strategy_config": learner_cfg.strategy_config,
                "update_actor": stats(update_times, tokens, params or 1, peak()),
                "compute_log_prob": stats(logprob_times, tokens, params or 1, peak(), forward_only=True),
                "last_metrics": {k: metrics[k] for k in sorted(metrics) if k.startswith("actor/")},
            }
        finally:
            await g.shutdown()

    try:
        return asyncio.run(go())
    finally:
        ray.shutdown()


# ----------------------------------------------------------------------------- main


def env() -> dict[str, Any]:
    import importlib.metadata as md

    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    for pkg in ("megatron-core", "transformers", "ray"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    if torch.cuda.is_available():
        out["device_name"] = torch.cuda.get_device_name()
    try:
        import transformer_engine  # noqa: F401

        out["transformer_engine"] = True
    except ImportError:
        out["transformer_engine"] = False
    return out


def main() -> None:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="HF checkpoint dir (e.g. from make_random_qwen2.py)")
    ap.add_argument("--sections", default="parity,bare,role,group", help="comma list of: parity, hf, bare, role, offload, group")
    ap.add_argument("--attention", default="auto", choices=["auto", "sdpa", "local", "te"], help="learner.attention of bare / role / group")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="training dtype (parity is always float32)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--parity-batch", type=int, default=2)
    ap.add_argument("--parity-tokens", type=int, default=256)
    ap.add_argument("--num-cpus-per-rank", type=float, default=4.0)
    ap.add_argument("--peak-flops", type=float, default=989e12, help="per GPU")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size (GPUs); > 1 runs the in-process sections in tp processes")
    ap.add_argument("--sequence-parallel", action="store_true", help="with --tp > 1: Megatron sequence parallelism")
    ap.add_argument("--tp-comm-overlap", action="store_true", help="with --sequence-parallel: strategy_config.tp_comm_overlap "
                    "(asyncrl/learner/tp_overlap.py: the all-gathers and reduce-scatters beside the GEMMs)")
    ap.add_argument("--cp", type=int, default=1, help="context parallel size; the sections run on --tp x --cp GPUs (parity, bare: --cp 1)")
    ap.add_argument("--dp", type=int, default=1, help="data parallel size: the group section alone (its batch split over "
                    "DP as a run's is), on --tp x --cp x --dp GPUs")
    ap.add_argument("--collective-timeout-s", type=float, default=600.0, help="torch.distributed timeout of the in-process sections")
    ap.add_argument("--offload-each-flag", action="store_true", help="offload section: also each offload flag alone")
    ap.add_argument("--out", default=None, help="also write the JSON here (rewritten after each section)")
    ap.add_argument("--pack", action="store_true", help="learner.sequence_packing for role / group (one row per micro-batch)")
    ap.add_argument("--max-tokens", type=int, default=None, help="learner.max_tokens_per_micro_batch for role / group")
    ap.add_argument("--profile", default=None, help="role section: profile one more update into this text file")
    ap.add_argument("--recompute", default="none", choices=["none", "selective", "full"], help="learner.memory.recompute of role / group")
    ap.add_argument("--recompute-method", default="uniform", choices=["uniform", "block"], help="learner.memory.recompute_method")
    ap.add_argument("--recompute-layers", type=int, default=1, help="learner.memory.recompute_layers")
    ap.add_argument("--optimizer", default="device", choices=["device", "sharded", "host"],
                    help="learner.memory.optimizer of role / group (sharded: Megatron's distributed optimizer over DP)")
    ap.add_argument("--optimizer-host-fraction", type=float, default=1.0, help="learner.memory.optimizer_host_fraction")
    ap.add_argument("--lora-rank", type=int, default=0, help="learner.lora.rank of role / group (0: every weight trains); "
                    "MFU still counts 6 x params a token (a LoRA step computes no base weight grads: about 4)")
    ap.add_argument("--lora-alpha", type=float, default=16.0, help="learner.lora.alpha")
    ap.add_argument("--lora-rebuild-merged", action="store_true", help="learner.lora.hold_merged: false")
    ap.add_argument("--sync-debug", action="store_true", help="role section: list what made the host wait for the device in one more update")
    ARGS = ap.parse_args()
    wanted = ARGS.sections.split(",")
    if ARGS.dp < 1 or (ARGS.dp > 1 and wanted != ["group"]):
        ap.error(f"--dp {ARGS.dp}: data parallelism runs in the group section alone (--sections group), which splits "
                 "the batch over DP as a run does (the in-process sections would train the whole batch on every rank)")
    ARGS.model = os.path.abspath(ARGS.model)
    global HF_CFG
    HF_CFG = __import__("transformers").AutoConfig.from_pretrained(ARGS.model)
    RESULTS["env"] = env()
    RESULTS["args"] = vars(ARGS)
    _save(ARGS.out)
    in_process = [s for s in ("parity", "bare", "role", "offload") if s in wanted]
    if "hf" in wanted and world() == 1:
        section("hf", ARGS.out)(hf_baseline)(__import__("transformers").AutoConfig.from_pretrained(ARGS.model))
    if in_process and world() == 1:
        hf = init_single_rank()
        run_in_process(hf, wanted)
    elif in_process:
        run_tp_processes()
    if "group" in wanted:
        section("group", ARGS.out)(group)()
    for name in ("bare", "role", "group"):
        if "seconds_per_step" in RESULTS.get("bare", {}) and "update_actor" in RESULTS.get(name, {}):
            RESULTS[name]["update_over_bare_fwd_bwd"] = round(
                RESULTS[name]["update_actor"]["seconds_per_step"] / RESULTS["bare"]["seconds_per_step"], 3)
        if "tokens_per_s" in RESULTS.get("hf", {}) and "update_actor" in RESULTS.get(name, {}):
            RESULTS[name]["update_tokens_per_s_over_hf"] = round(
                RESULTS[name]["update_actor"]["tokens_per_s"] / RESULTS["hf"]["tokens_per_s"], 3)
            RESULTS[name]["peak_gib_over_hf"] = round(RESULTS[name]["peak_gib"] / max(RESULTS["hf"]["peak_gib"], 1e-9), 3)
    _save(ARGS.out)
    print(json.dumps(RESULTS, default=str))


def run_in_process(hf: Any, wanted: list[str]) -> None:
    for name, fn in (("parity", parity), ("bare", bare), ("role", role), ("offload", offload)):
        if name in wanted:
            section(name, ARGS.out)(fn)(hf)
            if world() > 1 and "error" in RESULTS[name]:
                # A rank that failed would leave its peers waiting in a collective: stop them all.
                raise SystemExit(f"rank {RANK}: section {name} failed")
    from asyncrl.learner.parallel import destroy_model_parallel

    destroy_model_parallel()


def _tp_worker(rank: int, args: argparse.Namespace, results: dict[str, Any], port: int) -> None:
    global ARGS, RESULTS, RANK, HF_CFG
    ARGS, RESULTS, RANK = args, results, rank
    HF_CFG = __import__("transformers").AutoConfig.from_pretrained(args.model)
    hf = init_rank(rank, world(), port)
    run_in_process(hf, args.sections.split(","))


def run_tp_processes() -> None:
    """parity / bare / role in --tp x --cp processes (rank r on GPU r); rank 0 writes the results file."""
    import tempfile

    import torch.multiprocessing as mp

    global RESULTS
    if not ARGS.out:
        ARGS.out = tempfile.mkstemp(suffix=".json", prefix="learner_step_")[1]
    _save(ARGS.out)
    try:
        mp.spawn(_tp_worker, args=(ARGS, RESULTS, _free_port()), nprocs=world(), join=True)
    except BaseException as e:  # noqa: BLE001 - a failed rank; keep what rank 0 wrote
        print(f"[learner_step] tp processes: {type(e).__name__}: {e}"[:2000], file=sys.stderr, flush=True)
        failed = f"{type(e).__name__}: {e}"[:2000]
    else:
        failed = None
    RESULTS = json.loads(Path(ARGS.out).read_text())
    if failed:
        RESULTS["tp_processes_error"] = failed


ARGS: argparse.Namespace

if __name__ == "__main__":
    main()
