"""LoRA adapters on the learner's Megatron linears (`learner.lora`).

Owns: low-rank adapters (PEFT's: y = W x + (alpha / r) B A dropout(x), A Kaiming-uniform, B zero) on the dense
layers' fused linears under PEFT's target names, at any TP degree; freezing every other parameter; and the
merged weight W + (alpha / r) B A that exports (pushes, HF export: convert.py) read in place of W.
How: without dropout each targeted linear multiplies by its merged weight W + (alpha / r) B A (one GEMM, as
the engine that serves the merged push does) and computes only the adapters' gradients in backward (no weight
gradient of the base: `_MergedLinear`); with dropout a forward hook adds the adapters' output to the linear's.
Both work in the linear's local layout (QKV query groups interleaved, fc1 [gate; up], row linears' input
shards): a column linear's A is replicated over TP (gradient summed over TP), a row linear's A split along its
input, B the other way; every A comes whole from one seeded generator, so any TP degree starts alike.
Must never: change a base weight, its name or the layout exports read; leave a non-adapter parameter trainable.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

# Megatron's linear -> the PEFT targets it fuses, in its output order
SLOTS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
         "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
ROW = ("linear_proj", "linear_fc2")  # row-parallel: input split over TP
SUFFIX = "_lora"  # the adapters sit beside their linear: <parent>.<linear>_lora.{A,B}.<part> (own checkpoint shards)
REF = "_asyncrl_lora"  # the linear's (unregistered) reference to its adapters


class LinearAdapters(torch.nn.Module):
    """The adapters of one Megatron linear: an (A, B) pair per targeted part of its output."""

    def __init__(self, slot: str, parts: dict[str, int], in_features: int, *, rank: int, alpha: float,
                 dropout: float, tp_rank: int, tp_size: int, layout: tuple[int, int, int] | None,
                 generator: torch.Generator, dtype: torch.dtype, device: torch.device) -> None:
        """`parts`: each targeted part's global output rows; `layout`: (query groups, heads a group, head dim)
        for QKV. A row linear's `in_features` is global (its A is drawn whole, then this rank's columns kept)."""
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        self.slot, self.row, self.scale, self.layout = slot, slot in ROW, alpha / rank, layout
        self.tp_rank, self.tp_size, self.enabled = tp_rank, tp_size, True
        self.held: dict[int, tuple] | None = None  # `_merge`'s tensors by weight, inside `hold_merged`
        self.parts = [p for p in SLOTS[slot] if p in parts]
        self.sizes = {p: n // (1 if self.row else tp_size) for p, n in parts.items()}  # this rank's rows
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        self.A, self.B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        local_in = in_features // tp_size if self.row else in_features
        for p in self.parts:
            a = torch.empty(rank, in_features)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)  # PEFT's init of lora_A
            if self.row:
                a = a[:, tp_rank * local_in:(tp_rank + 1) * local_in]
            self.A[p] = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
            self.B[p] = torch.nn.Parameter(torch.zeros(self.sizes[p], rank, device=device, dtype=dtype))
            # sharded along the input (row A) or the output (column B); the others replicated over TP
            sharded, dim = (self.A[p], 1) if self.row else (self.B[p], 0)
            set_tensor_model_parallel_attributes(sharded, True, dim, 1)

    def _assemble(self, outs: dict[str, torch.Tensor], lead: tuple[int, ...]) -> torch.Tensor:
        """The parts' outputs (or weight rows, lead = ()) in the linear's local output layout; untargeted
        parts as zeros."""
        ref = next(iter(outs.values()))
        tail = ref.shape[len(lead) + 1:]

        def part(name: str, rows: int) -> torch.Tensor:
            return outs[name] if name in outs else ref.new_zeros(*lead, rows, *tail)

        if self.slot == "linear_qkv":
            groups, per_group, head_dim = self.layout
            g = groups // self.tp_size
            q = part("q_proj", g * per_group * head_dim).unflatten(len(lead), (g, per_group * head_dim))
            k = part("k_proj", g * head_dim).unflatten(len(lead), (g, head_dim))
            v = part("v_proj", g * head_dim).unflatten(len(lead), (g, head_dim))
            return torch.cat([q, k, v], dim=len(lead) + 1).flatten(len(lead), len(lead) + 1)
        if self.slot == "linear_fc1":
            half = next(n for n in self.sizes.values())
            return torch.cat([part("gate_proj", half), part("up_proj", half)], dim=len(lead))
        return outs[self.parts[0]]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Megatron's checkpoint form: the TP-split tensors (row A, column B) as shards of their global shape."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axis = {f"{'A' if self.row else 'B'}.{p}": 1 if self.row else 0 for p in self.parts}
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, axis, sharded_offsets)

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`out` (the linear's output for its input `x`, [..., in] on this rank) plus the adapters' output. One GEMM
        for every part's A (their rows stacked), then one `addmm` of B's (each part's B in its own column block, its
        rows in the linear's layout) into `out`, the scale as its alpha: `x` is read once and the sum written once,
        where a GEMM, a scale, a concatenation and an add per linear each made a pass over the output. One dropout
        mask serves the linear's parts (PEFT draws one per target module: the same in expectation)."""
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region

        x = self.dropout(x)
        a = self.A[self.parts[0]] if len(self.parts) == 1 else torch.cat([self.A[p] for p in self.parts])
        h = x @ a.t()
        # column: every TP rank's B reads the same h, so A's gradient is the sum over TP; row: h is partial
        if self.tp_size > 1:
            h = reduce_from_tensor_model_parallel_region(h) if self.row else copy_to_tensor_model_parallel_region(h)
        y = torch.addmm(out.reshape(-1, out.shape[-1]), h.reshape(-1, h.shape[-1]).to(out.dtype),
                        self._b_blocks().to(out.dtype).t(), alpha=self.scale)
        return y.view(out.shape)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               dgrad_group: Any) -> torch.Tensor:
        """The linear's output for `x` with the adapters merged into `weight` (this rank's shard), in place of
        Megatron's frozen-weight linear: `dgrad_group` all-reduces the input gradient where Megatron's would."""
        from megatron.core import parallel_state as ps

        held = self.held.get(id(weight)) if self.held is not None else None
        if held is None:
            held = self._merge(weight)
            if self.held is not None:
                self.held[id(weight)] = held
        merged, a_s, b_s = held
        params = [self.A[p] for p in self.parts] + [self.B[p] for p in self.parts]
        if not torch.is_grad_enabled() or not any(p.requires_grad for p in params):
            return torch.nn.functional.linear(x, merged, bias)
        tp = ps.get_tensor_model_parallel_group() if self.tp_size > 1 else None
        return _MergedLinear.apply(x, weight, merged, self.held is not None, bias, a_s, b_s, self,
                                   tp if self.row else None, None if self.row else tp, dgrad_group, *params)

    @torch.no_grad()
    def _merge(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(W + s B A, s A with the parts' rows stacked, s B as `_b_blocks`) for this rank's shard `weight`."""
        a = self.A[self.parts[0]] if len(self.parts) == 1 else torch.cat([self.A[p] for p in self.parts])
        b = self._b_blocks()
        return torch.addmm(weight, b, a, alpha=self.scale), a * self.scale, b * self.scale

    def block(self, t: torch.Tensor, i: int) -> torch.Tensor:
        """Part i's block of `t` ([local out, parts x r], `_b_blocks`' layout): its rows, its r columns. A view
        where its rows are contiguous (fc1's halves, a linear of one part), a copy of QKV's (interleaved by query
        group)."""
        groups, per, start, n = self._span(i)
        r = t.shape[1] // len(self.parts)
        return t.view(groups, per, -1)[:, start:start + n, i * r:(i + 1) * r].reshape(groups * n, r)

    def _span(self, i: int) -> tuple[int, int, int, int]:
        """(groups, rows a group, part i's first row in its group, its rows a group) in the local output layout."""
        part = self.parts[i]
        if self.slot == "linear_qkv":
            groups, per_group, head_dim = self.layout
            start = {"q_proj": 0, "k_proj": per_group * head_dim, "v_proj": (per_group + 1) * head_dim}[part]
            n = per_group * head_dim if part == "q_proj" else head_dim
            return groups // self.tp_size, (per_group + 2) * head_dim, start, n
        if self.slot == "linear_fc1":
            half = next(iter(self.sizes.values()))
            return 1, 2 * half, ("gate_proj", "up_proj").index(part) * half, half
        return 1, self.sizes[part], 0, self.sizes[part]

    def _b_blocks(self) -> torch.Tensor:
        """[local out, parts x r]: part i's B in columns i r .. (i + 1) r of its rows (the linear's layout), zeros
        elsewhere, so h (every part's A x, stacked) @ this^T is the sum of the parts' B A x."""
        if len(self.parts) == 1 and self.slot not in ("linear_qkv", "linear_fc1"):
            return self.B[self.parts[0]]
        r, n = self.B[self.parts[0]].shape[1], len(self.parts)
        padded = {p: torch.nn.functional.pad(self.B[p], (i * r, (n - 1 - i) * r)) for i, p in enumerate(self.parts)}
        return self._assemble(padded, ())

    @torch.no_grad()
    def delta(self) -> torch.Tensor:
        """(alpha / r) B A for this rank's shard of the linear's weight, in its layout (float32)."""
        rows = {p: self.B[p].float() @ self.A[p].float() for p in self.parts}
        return self._assemble(rows, ()) * self.scale


class _MergedLinear(torch.autograd.Function):
    """y = x (W + s B A)^T (+ bias) with W frozen: forward one GEMM by the merged weight (kept for backward when
    held over the pass by `hold_merged`; else rebuilt there), backward the input gradient through it and the
    adapters' gradients from u = x (s A)^T (saved, [tokens, P r]): dB = dy^T u, dA = (dy s B)^T x over every
    part at once (B's block matrix: zeros outside each part's rows), each part's block then read out. No pass of
    the base's weight gradient; the adapters' parameters are inputs, so no autograd op assembles them per call.
    A row linear's u is summed over TP in forward (B reads all of x), a column linear's dy B in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, merged: torch.Tensor, keep: bool,
                bias: torch.Tensor | None, a_s: torch.Tensor, b_s: torch.Tensor, adapters: LinearAdapters,
                u_group: Any, du_group: Any, dgrad_group: Any, *params: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x, merged, bias)
        u = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), a_s)
        if u_group is not None:
            torch.distributed.all_reduce(u, group=u_group)
        ctx.save_for_backward(x, merged if keep else weight, a_s, b_s, u)
        ctx.keep, ctx.adapters, ctx.du_group, ctx.dgrad_group = keep, adapters, du_group, dgrad_group
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, w, a_s, b_s, u = ctx.saved_tensors
        adapters = ctx.adapters
        if not ctx.keep and ctx.needs_input_grad[0]:
            w = torch.addmm(w, b_s, a_s, alpha=1.0 / adapters.scale)
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = pending = None
        if ctx.needs_input_grad[0]:  # (not below the first adapted linear: the embeddings and norms are frozen)
            dx = torch.matmul(dy2, w).view(*dy.shape[:-1], w.shape[1])
            if ctx.dgrad_group is not None:
                pending = torch.distributed.all_reduce(dx, group=ctx.dgrad_group, async_op=True)
        du = torch.matmul(dy2, b_s)
        if ctx.du_group is not None:
            torch.distributed.all_reduce(du, group=ctx.du_group)
        da = torch.matmul(du.t(), x.reshape(-1, x.shape[-1]))
        db = torch.matmul(dy2.t(), u)
        n, r = len(adapters.parts), a_s.shape[0] // len(adapters.parts)
        grads = [da[i * r:(i + 1) * r] for i in range(n)] + [adapters.block(db, i) for i in range(n)]
        if pending is not None:
            pending.wait()
        return (dx, None, None, None, None, None, None, None, None, None, None, *grads)


@contextlib.contextmanager
def hold_merged(adapters: list[LinearAdapters]):
    """Each of `adapters`' merged weights built at its first use inside the block and reused by every later pass
    (each micro-batch's forward and backward, a recompute), then freed: one pass over a step's micro-batches, in
    which the adapters do not change (the optimizer steps after it). Costs a copy of the targeted base weights
    on the device (`learner.lora.hold_merged`)."""
    for m in adapters:
        m.held = {}
    try:
        yield
    finally:
        for m in adapters:
            m.held = None


def adapter_modules(chunks: list[torch.nn.Module]) -> list[LinearAdapters]:
    return [m for c in chunks for m in c.modules() if isinstance(m, LinearAdapters)]


def _merged_impl(module: torch.nn.Module, original: Any) -> Any:
    """`module._forward_impl` (Megatron's parallel linears call it with the TP-local input and weight) through
    the adapters' merged weight; with the adapters switched off (`adapters_off`), Megatron's own."""

    def impl(input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        adapters = module.__dict__[REF]
        if not adapters.enabled:
            return original(input, weight, *args, **kwargs)
        if args or kwargs.get("sequence_parallel"):  # (a Megatron whose linears call it otherwise: never drop B A)
            raise RuntimeError(f"learner.lora: {adapters.slot}'s Megatron linear called with positional arguments or "
                               "sequence parallelism, which the merged adapters do not handle")
        group = kwargs.get("tp_group") if kwargs.get("allreduce_dgrad") else None
        if kwargs.get("allreduce_dgrad") and group is None:
            from megatron.core import parallel_state as ps

            group = ps.get_tensor_model_parallel_group()
        return adapters.linear(input, weight, kwargs.get("bias"), group)

    return impl


def _hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    adapters = module.__dict__[REF]
    if not adapters.enabled:
        return output
    out, bias = output if isinstance(output, tuple) else (output, None)
    out = adapters.add_to(out, args[0])
    return (out, bias) if isinstance(output, tuple) else out


@contextlib.contextmanager
def adapters_off(chunks: list[torch.nn.Module]):
    """The base model for the block's passes (the KL reference of a LoRA actor, without a copy of its own)."""
    found = adapter_modules(chunks)
    if not found:
        raise ValueError("adapters_off: the model has no LoRA adapters")
    for m in found:
        m.enabled = False
    try:
        yield
    finally:
        for m in found:
            m.enabled = True


def add_adapters(chunks: list[torch.nn.Module], hf_config: Any, *, rank: int, alpha: float, dropout: float,
                 targets: tuple[str, ...], seed: int) -> int:
    """Adapters on every targeted linear of `chunks` (this rank's, after the base weights loaded), every other
    parameter frozen. Returns the adapters' parameter count on this rank."""
    from megatron.core import parallel_state as ps

    from asyncrl.learner.model import model_arch

    arch = model_arch(hf_config)
    if any(arch.is_moe_layer(i) for i in range(arch.num_layers)):
        raise ValueError("learner.lora: adapters on MoE models are not supported (dense models only)")
    if getattr(chunks[0].config, "sequence_parallel", False):
        raise ValueError("learner.lora with sequence_parallel: true is not supported (its linears see sequence "
                         "shards): leave sequence_parallel off")
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    hd, heads, kv = arch.head_dim, arch.num_heads, arch.num_kv_heads
    rows = {"q_proj": heads * hd, "k_proj": kv * hd, "v_proj": kv * hd, "o_proj": arch.hidden_size,
            "gate_proj": arch.ffn_hidden_size, "up_proj": arch.ffn_hidden_size, "down_proj": arch.hidden_size}
    ins = {"linear_qkv": arch.hidden_size, "linear_proj": heads * hd, "linear_fc1": arch.hidden_size,
           "linear_fc2": arch.ffn_hidden_size}
    for c in chunks:
        for p in c.parameters():
            p.requires_grad_(False)
    count = 0
    for c in chunks:
        for name, module in list(c.named_modules()):  # (adding adapters adds modules)
            slot = name.rsplit(".", 1)[-1]
            if slot not in SLOTS or ".layers." not in f".{name}":
                continue
            parts = {p: rows[p] for p in SLOTS[slot] if p in targets}
            if not parts:
                continue
            gen = torch.Generator().manual_seed(seed * 1_000_003 + _layer_of(name, c) * 16 + list(SLOTS).index(slot))
            weight = module.weight
            adapters = LinearAdapters(slot, parts, ins[slot], rank=rank, alpha=alpha, dropout=dropout, tp_rank=tp_rank,
                                      tp_size=tp_size, layout=(kv, heads // kv, hd), generator=gen,
                                      dtype=weight.dtype, device=weight.device)
            parent = c.get_submodule(name.rsplit(".", 1)[0])
            parent.add_module(slot + SUFFIX, adapters)
            module.__dict__[REF] = adapters  # (not a submodule: its parameters are named once, under the parent)
            if dropout > 0 or not hasattr(module, "_forward_impl"):  # dropout: the adapters see other inputs than W
                module.register_forward_hook(_hook)
            else:
                module._forward_impl = _merged_impl(module, module._forward_impl)
            count += sum(p.numel() for p in adapters.parameters())
    if not count:
        raise ValueError(f"learner.lora.target_modules {list(targets)}: no such linear on this rank's layers")
    return count


def _layer_of(name: str, chunk: torch.nn.Module) -> int:
    """The global layer number of `decoder.layers.<i>...` in `chunk` (its layers know their own)."""
    local = int(name.split("layers.")[1].split(".")[0])
    return int(chunk.decoder.layers[local].layer_number)


def is_adapter(name: str) -> bool:
    """Whether parameter `name` is an adapter's (not a base weight: exports and HF loads skip it)."""
    return any(f".{slot}{SUFFIX}." in name for slot in SLOTS)


def merged_weight(module: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """What an export reads for `weight` of `module`: W + (alpha / r) B A where the module has adapters."""
    adapters = module.__dict__.get(REF)
    if adapters is None:
        return weight
    return (weight.detach().float() + adapters.delta()).to(weight.dtype)


_HF_BLOCK = {"linear_qkv": "self_attn", "linear_proj": "self_attn", "linear_fc1": "mlp", "linear_fc2": "mlp"}


def _named_adapters(chunks: list[torch.nn.Module]):
    """(PEFT's module name, adapters, part) of every adapter pair on this rank, in model order."""
    for c in chunks:
        c = getattr(c, "module", c)
        for name, m in c.named_modules():
            if isinstance(m, LinearAdapters):
                layer = _layer_of(name, c) - 1
                for p in m.parts:
                    yield f"base_model.model.model.layers.{layer}.{_HF_BLOCK[m.slot]}.{p}", m, p


def _tp_gather(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """The whole of a TP-split tensor, concatenated along `dim` (convert.py imports this module: no call back)."""
    from megatron.core import parallel_state as ps

    if size == 1:
        return t.detach()
    parts = [torch.empty_like(t) for _ in range(size)]
    torch.distributed.all_gather(parts, t.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


@torch.no_grad()
def peft_adapter_tensors(chunks: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Every adapter of the model as PEFT's `adapter_model.safetensors` names it (lora_A: [r, in], lora_B: [out, r]),
    whole, on global rank 0 (empty elsewhere). Collective over every rank: TP shards gathered, PP stages collected."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    mine = {}
    for name, m, p in _named_adapters(chunks):
        a = _tp_gather(m.A[p], 1, tp) if m.row else m.A[p].detach()
        b = m.B[p].detach() if m.row else _tp_gather(m.B[p], 0, tp)
        mine[f"{name}.lora_A.weight"], mine[f"{name}.lora_B.weight"] = a.cpu(), b.cpu()
    keep = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine if keep else {})
    return {k: v for part in gathered for k, v in part.items()} if torch.distributed.get_rank() == 0 else {}


def peft_adapter_config(lora: dict[str, Any], base_model: str) -> dict[str, Any]:
    """PEFT's adapter_config.json for `learner.lora`'s settings (a model_dump) on `base_model`."""
    from asyncrl.config.components import resolve_lora_targets

    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": lora["rank"],
            "lora_alpha": lora["alpha"], "lora_dropout": lora["dropout"], "bias": "none", "fan_in_fan_out": False,
            "target_modules": list(resolve_lora_targets(lora["target_modules"])), "inference_mode": True}


@torch.no_grad()
def load_peft_adapter(chunks: list[torch.nn.Module], path: str, *, rank: int, alpha: float,
                      targets: tuple[str, ...]) -> int:
    """This rank's adapters from a PEFT adapter directory (adapter_config.json, adapter_model.safetensors), each
    matrix's TP shard taken; its rank, alpha and targets must be learner.lora's. Returns the pairs loaded."""
    import json
    from pathlib import Path

    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from asyncrl.config.components import resolve_lora_targets

    d = Path(path)
    if not (d / "adapter_config.json").is_file() or not (d / "adapter_model.safetensors").is_file():
        raise ValueError(f"learner.lora.init_from={path!r} is not a PEFT adapter directory (adapter_config.json and "
                         "adapter_model.safetensors)")
    cfg = json.loads((d / "adapter_config.json").read_text())
    theirs = (cfg.get("r"), float(cfg.get("lora_alpha", 0)), resolve_lora_targets(cfg.get("target_modules") or []))
    if theirs != (rank, float(alpha), targets):
        raise ValueError(f"learner.lora.init_from={path!r} holds rank {theirs[0]}, alpha {theirs[1]}, targets "
                         f"{list(theirs[2])}; learner.lora says rank {rank}, alpha {alpha}, targets {list(targets)}")
    tensors = load_file(str(d / "adapter_model.safetensors"))
    tp, tp_rank, n = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(), 0
    for name, m, p in _named_adapters(chunks):
        keys = [f"{name}.lora_A.weight", f"{name}.lora_B.weight"]
        if not all(k in tensors for k in keys):
            raise ValueError(f"learner.lora.init_from={path!r} has no {keys[0]} (another model's adapter?)")
        a, b = (tensors[k] for k in keys)
        if m.row:
            a = a.chunk(tp, dim=1)[tp_rank]
        else:
            b = b.chunk(tp, dim=0)[tp_rank]
        if a.shape != m.A[p].shape or b.shape != m.B[p].shape:
            raise ValueError(f"learner.lora.init_from={path!r}: {name} is {tuple(tensors[keys[0]].shape)} x "
                             f"{tuple(tensors[keys[1]].shape)}, not this model's")
        m.A[p].copy_(a)
        m.B[p].copy_(b)
        n += 1
    return n
