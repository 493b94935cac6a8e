"""The optimizer half of a trainable role: Megatron optimizer, LR schedule, clipping, NaN guard.

Owns: building `get_megatron_optimizer` (Adam; torch's fused CUDA kernel on GPU) for DDP-wrapped
chunks with `clip_grad=0` (Megatron's clip asserts CUDA tensors; `compat.clip_grad_norm_` clips
over TP/PP instead), the LR schedule
(constant / linear / cosine after linear warmup), and one guarded step: a step whose loss or
grad norm is not finite on ANY rank is skipped everywhere (no parameter or optimizer-state
change) and counted.

Must never: run forward/backward (roles do), or advance the schedule on a skipped step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from asyncrl.config import LearnerConfig


def lr_at(step: int, cfg: LearnerConfig) -> float:
    """LR for optimizer step `step` (0-based count of applied steps).

    warmup (step < W): lr * (step + 1) / W; then, with d = min(step - W, D) / D (D = lr_decay_steps):
    constant: lr;  linear: lr - (lr - min_lr) * d;  cosine: min_lr + (lr - min_lr) * (1 + cos(pi d)) / 2.
    """
    if step < cfg.lr_warmup_steps:
        return cfg.lr * (step + 1) / cfg.lr_warmup_steps
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    d = min(step - cfg.lr_warmup_steps, cfg.lr_decay_steps) / cfg.lr_decay_steps
    if cfg.lr_decay_style == "linear":
        return cfg.lr - (cfg.lr - cfg.min_lr) * d
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * d))


def optimizer_on_host(cfg: LearnerConfig) -> bool:
    """learner.memory.optimizer host on a learner with an accelerator (without one, every optimizer is on the host)."""
    return cfg.memory.optimizer == "host" and torch.cuda.is_available()


def optimizer_sharded(cfg: LearnerConfig) -> bool:
    """Megatron's distributed optimizer: learner.memory.optimizer sharded, or host (its CPU offload needs it)."""
    return cfg.memory.optimizer == "sharded" or optimizer_on_host(cfg)


# What Megatron's host optimizer keeps on the host per offloaded parameter: its fp32 copy and grad (pinned), Adam's
# two fp32 moments.
HOST_OPTIMIZER_BYTES_PER_PARAM = 16


def check_host_memory(params: int, cfg: LearnerConfig, available: int | None = None, *, dp: int = 1,
                      ranks_on_node: int = 1) -> None:
    """Refuse, with the setting that fits, a host optimizer whose state would not fit in the host memory available
    now (the kernel would kill the rank part way through instead). `params`: this rank's model parameters, whose
    state the distributed optimizer splits over `dp` ranks; `ranks_on_node` learner ranks share this host."""
    import psutil

    share = cfg.memory.optimizer_host_fraction
    per_fraction = params / dp * ranks_on_node * HOST_OPTIMIZER_BYTES_PER_PARAM  # this node's bytes at fraction 1
    need = int(per_fraction * share)
    free = psutil.virtual_memory().available if available is None else available
    if need > free:
        fits = max(0.0, free / per_fraction) * 0.9
        ranks = f"{ranks_on_node} learner ranks x " if ranks_on_node > 1 else ""
        raise ValueError(
            f"learner.memory.optimizer host: {ranks}{params / dp:,.0f} parameters x {share:g} on the host need about "
            f"{need / 2**30:.1f} GiB of host memory ({HOST_OPTIMIZER_BYTES_PER_PARAM} bytes each: an fp32 copy, its grad "
            f"and Adam's two moments), {free / 2**30:.1f} GiB is available on this node: set "
            f"learner.memory.optimizer_host_fraction to {fits:.2f} or less (the rest stays on the device), or spread "
            "the learner over more nodes")


def ranks_on_this_node() -> int:
    """How many ranks of the default process group run on this host (collective: every rank calls it)."""
    import socket

    if not torch.distributed.is_initialized():
        return 1
    hosts: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(hosts, socket.gethostname())
    return hosts.count(socket.gethostname())


class LRSchedule:
    """Sets the optimizer's LR from `lr_at`; its state (the step count) goes into checkpoints."""

    def __init__(self, optimizer: Any, cfg: LearnerConfig) -> None:
        self.optimizer, self.cfg, self.num_steps = optimizer, cfg, 0
        self._apply()

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.num_steps, self.cfg)

    @property
    def lr(self) -> float:
        return lr_at(self.num_steps, self.cfg)

    def step(self) -> None:
        self.num_steps += 1
        self._apply()

    def state_dict(self) -> dict[str, int]:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.num_steps = int(state["num_steps"])
        self._apply()


class GuardedOptimizer:
    """Megatron optimizer + schedule + global-norm clip + skip on non-finite loss or grads."""

    def __init__(self, chunks: list[torch.nn.Module], cfg: LearnerConfig, dtype: str) -> None:
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.utils import get_model_config

        from asyncrl.learner.gpu_fusions import use_fused_adam

        self.chunks, self.cfg = chunks, cfg
        self.on_host, self.sharded = optimizer_on_host(cfg), optimizer_sharded(cfg)
        if self.on_host and dtype not in ("bfloat16", "float16"):
            raise ValueError(f"learner.memory.optimizer host needs 16-bit weights (model.dtype bfloat16 or float16), got "
                             f"{dtype}: Megatron offloads the fp32 master copies a 16-bit model's optimizer keeps")
        opt_cfg = OptimizerConfig(
            optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, clip_grad=0.0,
            bf16=dtype == "bfloat16", fp16=dtype == "float16", params_dtype=torch.float32,
            # learner.memory.optimizer host: Megatron's CPU offload, which only its distributed optimizer takes
            use_distributed_optimizer=self.sharded, optimizer_cpu_offload=self.on_host,
            optimizer_offload_fraction=cfg.memory.optimizer_host_fraction if self.on_host else 0.0,
        )
        if self.on_host:
            from megatron.core import parallel_state as ps

            check_host_memory(sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad), cfg,
                              dp=ps.get_data_parallel_world_size(with_context_parallel=True),
                              ranks_on_node=ranks_on_this_node())
        self.optimizer = get_megatron_optimizer(opt_cfg, chunks)
        use_fused_adam(self.optimizer)  # torch's fused CUDA Adam (no-op on CPU)
        self.schedule = LRSchedule(self.optimizer, cfg)
        model_cfg = get_model_config(chunks[0])
        # DP grad all-reduce (and tied-embedding sync over PP) after the last micro-batch.
        model_cfg.finalize_model_grads_func = finalize_model_grads
        model_cfg.grad_scale_func = self.optimizer.scale_loss
        self.skipped_steps = 0
        self.applied_steps = 0

    def zero_grad(self) -> None:
        for c in self.chunks:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()

    def warm_up(self) -> bool:
        """Before the first step: the optimizer's state (Adam's moments and step counts) made and its
        kernels run once, on zero grads at lr 0, leaving the params and the state exactly a fresh
        optimizer's (`warm_torch_optimizer`). Only an optimizer without state: a resumed one holds its
        checkpoint's (returns False, nothing done)."""
        opts = [getattr(o, "optimizer", o) for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]
        if any(len(o.state) for o in opts):
            return False
        self.zero_grad()
        self.optimizer.prepare_grads()  # the main params' grads: the zeroed grad buffers
        for o in opts:
            warm_torch_optimizer(o)
        self.zero_grad()
        return True

    def _main_params(self) -> list[torch.nn.Parameter]:
        opts = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return [p for o in opts for p in o.get_parameters()]

    def step(self, loss_finite: bool, grad_scale: float = 1.0) -> dict[str, float]:
        """Clip and apply the accumulated grads unless the loss or the grad norm is not finite anywhere.

        `grad_scale` multiplies the accumulated grads first (a loss whose batch-wide denominator was
        only known after the backward passes), so the norm, the clip and the step see the true grads."""
        from asyncrl.learner.compat import clip_grad_norm_
        from asyncrl.learner.parallel import collective_device

        lr = self.schedule.lr
        found_inf = self.optimizer.prepare_grads()
        if grad_scale != 1.0:
            for p in self._main_params():
                if p.grad is not None:
                    p.grad.mul_(grad_scale)
        # measure first (clipping nan grads is moot); a sharded optimizer's grads are each rank's DP shard
        norm = clip_grad_norm_(self._main_params(), 0.0, dp_sharded=self.sharded)
        bad = torch.tensor([0.0 if (loss_finite and not found_inf and math.isfinite(norm)) else 1.0],
                           device=collective_device())
        if torch.distributed.is_initialized():
            # A nan on one DP shard must skip the step on every rank, or replicas diverge.
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        if bad.item() > 0:
            self.skipped_steps += 1
            self.zero_grad()
            return {"skipped": 1.0, "grad_norm": norm, "lr": lr}
        if self.cfg.grad_clip > 0 and norm > self.cfg.grad_clip:
            clip_grad_norm_(self._main_params(), self.cfg.grad_clip, norm=norm, dp_sharded=self.sharded)
        self.optimizer.step_with_ready_grads()
        self.schedule.step()
        self.applied_steps += 1
        return {"skipped": 0.0, "grad_norm": norm, "lr": lr}


def warm_torch_optimizer(opt: torch.optim.Optimizer) -> None:
    """One step of `opt` (a torch optimizer without state) at lr 0 on zero grads (a param without a
    grad gets a zero one for the step), then every step count back to 0. For Adam/AdamW the moments
    stay 0 (a lerp of 0 and 0), the update is 0 and the decoupled weight decay is 1 - 0 x wd, so the
    params and the state are bit for bit a fresh optimizer's, its state now allocated and its
    kernels (fused or foreach) compiled and loaded: the first real step pays neither."""
    if len(opt.state):
        raise ValueError("warm_torch_optimizer: the optimizer already has state (it would change it)")
    lrs = [g["lr"] for g in opt.param_groups]
    params = [p for g in opt.param_groups for p in g["params"]]
    given = [p for p in params if p.grad is None]
    try:
        for g in opt.param_groups:
            g["lr"] = 0.0
        for p in given:
            p.grad = torch.zeros_like(p)
        opt.step()
    finally:
        for g, lr in zip(opt.param_groups, lrs):
            g["lr"] = lr
        for p in given:
            p.grad = None
    for state in opt.state.values():
        step = state.get("step")
        if torch.is_tensor(step):
            step.zero_()
        elif step is not None:
            state["step"] = 0


def warm_up_update(runner: Any, optim: GuardedOptimizer, offloader: Any, samples: Sequence[Any],
                   zero_loss: Callable[[Any, torch.Tensor], torch.Tensor]) -> dict[str, float]:
    """What a trainable role's first update would pay once, paid before it (`RoleAPI.warm_up`): one
    forward-backward of the first micro-batch `samples` make (the largest the run admits, when the
    caller sizes them so) with a loss of 0 (`zero_loss(mb, output)`), so the kernels are loaded and
    compiled and the allocator holds that pass's activations; the grads zeroed after it; and the
    optimizer's state made (`GuardedOptimizer.warm_up`). The params, the grads and the optimizer's
    state are then what they were: a run with the warm-up trains exactly as one without."""
    t = time.perf_counter()
    with offloader.onloaded():
        mbs = runner.micro_batches(samples)[:1]
        optim.zero_grad()
        runner.run(mbs, lambda mb, out: (zero_loss(mb, out), {}), forward_only=False)
        optim.zero_grad()
        made_state = optim.warm_up()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return {"learner/warm_up_s": time.perf_counter() - t, "learner/warm_up_optimizer": float(made_state),
            "learner/warm_up_tokens": float(sum(int(m.input_ids.numel()) for m in mbs))}
