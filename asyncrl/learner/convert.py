"""Hugging Face <-> Megatron weight conversion, shard by shard, inside one learner rank.

Owns: the name map between Megatron parameters and HF checkpoint tensors, and the layout transforms: grouped QKV,
fused SwiGLU, row-parallel splits, vocab padding and splitting, PP stage and EP ownership, and the tied embedding
copy on the last stage. Export is collective: every rank of a TP group (and of an EP group, for MoE) drives its
iterator to the end in lockstep, even ranks that drop what they get.
Must never: materialise the whole model. Loading reads only the HF tensors this rank needs; export yields one full
HF tensor at a time (the only full-size tensor alive is the one yielded).
Details: docs/design/learner.md, "Weight conversion".
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncrl.learner.model import ModelArch, model_arch


class WeightMismatchError(ValueError):
    """HF tensors and the model disagree: missing or unexpected keys, or a wrong shape."""


# ----------------------------------------------------------------------------- HF naming


def expected_hf_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this config holds, with its shape, in model order."""
    a = model_arch(hf_config)
    h, hd = a.hidden_size, a.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (a.vocab_size, h)}
    for layer in range(a.num_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (a.num_heads * hd, h)
        shapes[p + "self_attn.k_proj.weight"] = (a.num_kv_heads * hd, h)
        shapes[p + "self_attn.v_proj.weight"] = (a.num_kv_heads * hd, h)
        if a.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (a.num_heads * hd,)
            shapes[p + "self_attn.k_proj.bias"] = (a.num_kv_heads * hd,)
            shapes[p + "self_attn.v_proj.bias"] = (a.num_kv_heads * hd,)
        shapes[p + "self_attn.o_proj.weight"] = (h, a.num_heads * hd)
        if a.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if a.is_moe_layer(layer):
            shapes[p + "mlp.gate.weight"] = (a.num_experts, h)
            for e in range(a.num_experts):
                _mlp_shapes(shapes, f"{p}mlp.experts.{e}.", h, a.moe_ffn_hidden_size)
            if a.shared_expert_size:
                _mlp_shapes(shapes, p + "mlp.shared_expert.", h, a.shared_expert_size)
                shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)
        else:
            _mlp_shapes(shapes, p + "mlp.", h, a.ffn_hidden_size)
    shapes["model.norm.weight"] = (h,)
    if not a.tied_embeddings:
        shapes["lm_head.weight"] = (a.vocab_size, h)
    return shapes


def _mlp_shapes(shapes: dict, prefix: str, hidden: int, ffn: int) -> None:
    shapes[prefix + "gate_proj.weight"] = (ffn, hidden)
    shapes[prefix + "up_proj.weight"] = (ffn, hidden)
    shapes[prefix + "down_proj.weight"] = (hidden, ffn)


def hf_tensor_names(hf_config: Any) -> list[str]:
    return list(expected_hf_shapes(hf_config))


SCORE_HEAD = ("score.weight", "score.bias")  # an HF *ForSequenceClassification's head (num_labels 1)


def check_hf_tensors(shapes: dict[str, tuple[int, ...]], hf_config: Any, *, allow_missing: bool = False,
                     scalar_head: bool = False) -> None:
    """Compare a checkpoint's {name: shape} against the config; raise naming every difference.
    `scalar_head`: the model's output layer is a score head, so the checkpoint may lack `lm_head`
    (a sequence-classification checkpoint) and may hold `score.*`."""
    want = expected_hf_shapes(hf_config)
    arch = model_arch(hf_config)
    ignorable = {"lm_head.weight"} if arch.tied_embeddings else set()
    if scalar_head:
        want.pop("lm_head.weight", None)
        ignorable |= {"lm_head.weight", *SCORE_HEAD}
    unexpected = sorted(k for k in shapes if k not in want and k not in ignorable and "rotary_emb" not in k)
    missing = [] if allow_missing else [k for k in want if k not in shapes]
    wrong = [f"{k}: {tuple(shapes[k])} != {want[k]}" for k in want if k in shapes and tuple(shapes[k]) != want[k]]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} keys, e.g. {missing[:5]}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} keys, e.g. {unexpected[:5]}")
    if wrong:
        problems.append(f"wrong shapes: {wrong[:5]}")
    if problems:
        raise WeightMismatchError(f"HF tensors do not match model_type={arch.model_type!r}: " + "; ".join(problems))


class SafetensorsDir:
    """Lazy reader of an HF model directory's safetensors (single file or sharded with an index)."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors in {self.path}")
        self._handles = {f: safe_open(str(self.path / f), framework="pt") for f in files}
        self.file_of = {k: f for f, h in self._handles.items() for k in h.keys()}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(self._handles[f].get_slice(k).get_shape()) for k, f in self.file_of.items()}

    def get(self, name: str) -> torch.Tensor:
        if name not in self.file_of:
            raise WeightMismatchError(f"HF tensor {name!r} not found in {self.path}")
        return self._handles[self.file_of[name]].get_tensor(name)


# ----------------------------------------------------------------------------- parameter map


@dataclass
class ParamMap:
    """How one Megatron parameter relates to HF tensors.

    `kind`: replicated | column (split dim 0) | row (split dim 1) | vocab (pad + split dim 0) |
    qkv (grouped) | fc1 ([gate; up]). `group` is "tp" or "etp" (expert TP); `expert_gather` is
    set for routed-expert params, whose HF names depend on the EP rank that owns them.
    """

    hf_names: list[str]
    kind: str
    group: str = "tp"
    expert_gather: Callable[[int], list[str]] | None = None  # global expert id -> hf names


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):  # DDP / Float16Module wrappers
        chunk = chunk.module
    return chunk


def param_map(chunk: torch.nn.Module, name: str, arch: ModelArch) -> ParamMap:
    """The HF side of Megatron parameter `name` in (unwrapped) `chunk`."""
    if name == "embedding.word_embeddings.weight":
        return ParamMap(["model.embed_tokens.weight"], "vocab")
    if name == "output_layer.weight":
        return ParamMap(["model.embed_tokens.weight" if arch.tied_embeddings else "lm_head.weight"], "vocab")
    if name == "decoder.final_layernorm.weight":
        return ParamMap(["model.norm.weight"], "replicated")
    m = _LAYER.match(name)
    if not m:
        raise WeightMismatchError(f"no HF mapping for Megatron parameter {name!r}")
    local, rest = int(m.group(1)), m.group(2)
    layer = chunk.decoder.layers[local].layer_number - 1  # global, 0-based
    p = f"model.layers.{layer}."
    attn = p + "self_attn."
    simple = {
        "input_layernorm.weight": ([p + "input_layernorm.weight"], "replicated"),
        "self_attention.linear_qkv.layer_norm_weight": ([p + "input_layernorm.weight"], "replicated"),
        "pre_mlp_layernorm.weight": ([p + "post_attention_layernorm.weight"], "replicated"),
        "mlp.linear_fc1.layer_norm_weight": ([p + "post_attention_layernorm.weight"], "replicated"),
        "self_attention.linear_qkv.weight": ([attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"], "qkv"),
        "self_attention.linear_qkv.bias": ([attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"], "qkv"),
        "self_attention.linear_proj.weight": ([attn + "o_proj.weight"], "row"),
        "self_attention.q_layernorm.weight": ([attn + "q_norm.weight"], "replicated"),
        "self_attention.k_layernorm.weight": ([attn + "k_norm.weight"], "replicated"),
        "mlp.linear_fc1.weight": ([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], "fc1"),
        "mlp.linear_fc2.weight": ([p + "mlp.down_proj.weight"], "row"),
        "mlp.router.weight": ([p + "mlp.gate.weight"], "replicated"),
        "mlp.shared_experts.linear_fc1.weight": (
            [p + "mlp.shared_expert.gate_proj.weight", p + "mlp.shared_expert.up_proj.weight"], "fc1"),
        "mlp.shared_experts.linear_fc2.weight": ([p + "mlp.shared_expert.down_proj.weight"], "row"),
        "mlp.shared_experts.gate_weight": ([p + "mlp.shared_expert_gate.weight"], "replicated"),
    }
    if rest in simple:
        names, kind = simple[rest]
        return ParamMap(list(names), kind)
    em = _LOCAL_EXPERT.match(rest) or _GROUPED_EXPERT.match(rest)
    if em:
        if em.re is _LOCAL_EXPERT:
            local_expert, which = int(em.group(1)), em.group(2)
        else:
            which, local_expert = em.group(1), int(em.group(2))
        global_expert = chunk.decoder.layers[local].mlp.local_expert_indices[local_expert]

        def names_of(expert: int, which: str = which) -> list[str]:
            e = f"{p}mlp.experts.{expert}."
            return [e + "gate_proj.weight", e + "up_proj.weight"] if which == "linear_fc1" else [e + "down_proj.weight"]

        kind = "fc1" if which == "linear_fc1" else "row"
        return ParamMap(names_of(global_expert), kind, group="etp", expert_gather=names_of)
    raise WeightMismatchError(f"no HF mapping for Megatron parameter {name!r} (layer {layer})")


# ----------------------------------------------------------------------------- shard transforms


def _qkv_groups(arch: ModelArch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF q/k/v -> Megatron grouped rows, shape (groups, (q_per_group + 2) * head_dim, ...)."""
    ng, hd = arch.num_kv_heads, arch.head_dim
    tail = q.shape[1:]
    q = q.reshape(ng, (arch.num_heads // ng) * hd, *tail)
    return torch.cat([q, k.reshape(ng, hd, *tail), v.reshape(ng, hd, *tail)], dim=1)


def shard_from_hf(pm: ParamMap, hf: list[torch.Tensor], arch: ModelArch, rank: int, size: int, padded_vocab: int) -> torch.Tensor:
    """This TP rank's shard of a Megatron parameter, from the full HF tensors."""
    if pm.kind == "replicated":
        return hf[0]
    if pm.kind == "column":
        return hf[0].chunk(size, dim=0)[rank]
    if pm.kind == "row":
        return hf[0].chunk(size, dim=1)[rank]
    if pm.kind == "vocab":
        full = hf[0]
        pad = padded_vocab - full.shape[0]
        if pad:
            full = torch.cat([full, full.new_zeros(pad, *full.shape[1:])])
        return full.chunk(size, dim=0)[rank]
    if pm.kind == "qkv":
        grouped = _qkv_groups(arch, *hf)
        return grouped.chunk(size, dim=0)[rank].reshape(-1, *grouped.shape[2:])
    if pm.kind == "fc1":
        gate, up = hf
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])
    raise AssertionError(pm.kind)


def hf_from_gathered(pm: ParamMap, shards: list[torch.Tensor], arch: ModelArch) -> list[torch.Tensor]:
    """Full HF tensors (one per `pm.hf_names`) from every TP rank's shard, in rank order."""
    if pm.kind == "replicated":
        return [shards[0]]
    if pm.kind in ("column", "vocab"):
        full = torch.cat(shards, dim=0)
        return [full[: arch.vocab_size] if pm.kind == "vocab" else full]
    if pm.kind == "row":
        return [torch.cat(shards, dim=1)]
    if pm.kind == "qkv":
        ng, hd = arch.num_kv_heads, arch.head_dim
        qpg = arch.num_heads // ng
        grouped = torch.cat(shards, dim=0).reshape(ng, (qpg + 2) * hd, *shards[0].shape[1:])
        q, k, v = grouped.split([qpg * hd, hd, hd], dim=1)
        return [t.reshape(-1, *shards[0].shape[1:]) for t in (q, k, v)]
    if pm.kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    raise AssertionError(pm.kind)


# ----------------------------------------------------------------------------- load / export


def _tp(group_name: str) -> tuple[int, int, Any]:
    from megatron.core import parallel_state as ps

    if group_name == "etp":
        return (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_group())
    return (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_group())


def _padded_vocab(chunk: torch.nn.Module, arch: ModelArch) -> int:
    return getattr(chunk, "vocab_size", None) or arch.vocab_size


@torch.no_grad()
def load_hf_weights(model_chunks: list[torch.nn.Module], hf_dir: str | Path, hf_config: Any, *,
                    scalar_head: bool = False) -> int:
    """Copy the HF checkpoint in `hf_dir` into this rank's shards; returns parameters filled.

    Checks the checkpoint's key set and shapes against `hf_config` first (WeightMismatchError
    naming missing/unexpected keys), and every Megatron parameter's shard shape. `scalar_head`:
    the output layer is left alone (the caller replaces it by a score head; `load_score_head`).
    """
    arch = model_arch(hf_config)
    reader = SafetensorsDir(hf_dir)
    check_hf_tensors(reader.shapes(), hf_config, scalar_head=scalar_head)
    filled = 0
    for chunk in model_chunks:
        chunk = _unwrap(chunk)
        for name, param in chunk.named_parameters():
            if scalar_head and name == "output_layer.weight":
                continue
            pm = param_map(chunk, name, arch)
            rank, size, _ = _tp(pm.group)
            hf = [reader.get(n).to(param.dtype) for n in pm.hf_names]
            shard = shard_from_hf(pm, hf, arch, rank, size, _padded_vocab(chunk, arch))
            if tuple(shard.shape) != tuple(param.shape):
                raise WeightMismatchError(
                    f"{name}: shard from {pm.hf_names} has shape {tuple(shard.shape)}, "
                    f"parameter has {tuple(param.shape)}"
                )
            param.data.copy_(shard)
            filled += 1
    return filled


def load_score_head(head: torch.nn.Module, hf_dir: str | Path) -> bool:
    """Copy the checkpoint's `score.weight` (and `score.bias`, zero when absent) into a scalar head
    (`weight` [1, hidden], `bias` [1]); False when the checkpoint has no score head."""
    reader = SafetensorsDir(hf_dir)
    if "score.weight" not in reader.file_of:
        return False
    weight = reader.get("score.weight")
    if tuple(weight.shape) != tuple(head.weight.shape):
        raise WeightMismatchError(
            f"score.weight in {hf_dir} has shape {tuple(weight.shape)}; a reward model's score head is "
            f"{tuple(head.weight.shape)} (a sequence-classification checkpoint with num_labels=1)")
    with torch.no_grad():
        head.weight.copy_(weight.to(head.weight.dtype))
        bias = reader.get("score.bias").reshape(-1) if "score.bias" in reader.file_of else torch.zeros(1)
        head.bias.copy_(bias.to(head.bias.dtype))
    return True


def _all_gather(t: torch.Tensor, size: int, group: Any) -> list[torch.Tensor]:
    if size == 1:
        return [t]
    t = t.contiguous()
    out = [torch.empty_like(t) for _ in range(size)]
    torch.distributed.all_gather(out, t, group=group)
    return out


@torch.no_grad()
def export_hf_tensors(model_chunks: list[torch.nn.Module], hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) for every tensor this rank's PP stage owns.

    Gathers TP shards (and expert TP shards, then experts over EP) so each yielded tensor is
    whole; strips vocab padding. The tied output layer copy on the last stage is skipped (the
    first stage yields `model.embed_tokens.weight`). Collective: see the module docstring.
    """
    from megatron.core import parallel_state as ps

    arch = model_arch(hf_config)
    for chunk, name, param, pm in _exported(model_chunks, arch):
        _, size, group = _tp(pm.group)
        shards = _all_gather(param.detach(), size, group) if pm.kind != "replicated" else [param.detach()]
        full = hf_from_gathered(pm, shards, arch)
        if pm.expert_gather is None:
            yield from zip(pm.hf_names, (t.clone() if t.data_ptr() == param.data_ptr() else t for t in full))
            continue
        # Routed expert: every EP rank holds a different expert at this local index.
        ep_size = ps.get_expert_model_parallel_world_size()
        ep_group = ps.get_expert_model_parallel_group()
        # On the parameter's device: NCCL has no CPU backend ("No backend type associated
        # with device type cpu", seen at EP=2 on two GPUs).
        expert_ids = _all_gather(
            torch.tensor([_unwrap_expert_id(chunk, name)], dtype=torch.long, device=param.device), ep_size, ep_group
        )
        per_rank = [_all_gather(t, ep_size, ep_group) for t in full]
        for r, eid in enumerate(expert_ids):
            yield from zip(pm.expert_gather(int(eid.item())), (ts[r] for ts in per_rank))


def _exported(model_chunks: list[torch.nn.Module], arch: ModelArch) -> Iterator[tuple[torch.nn.Module, str, Any, ParamMap]]:
    """(unwrapped chunk, Megatron name, parameter, its HF map) of every parameter an export yields, in order:
    all of them but the tied output layer (the first stage yields `model.embed_tokens.weight`)."""
    from asyncrl.learner.lora import is_adapter, merged_weight

    for chunk in model_chunks:
        chunk = _unwrap(chunk)
        for name, param in chunk.named_parameters():
            if (name == "output_layer.weight" and arch.tied_embeddings) or is_adapter(name):
                continue
            if name.endswith(".weight"):  # a linear with LoRA adapters exports W + (alpha / r) B A
                param = merged_weight(chunk.get_submodule(name.removesuffix(".weight")), param)
            yield chunk, name, param, param_map(chunk, name, arch)


def _unwrap_expert_id(chunk: torch.nn.Module, name: str) -> int:
    local, rest = _LAYER.match(name).groups()
    em = _LOCAL_EXPERT.match(rest)
    idx = int(em.group(1)) if em else int(_GROUPED_EXPERT.match(rest).group(2))
    return chunk.decoder.layers[int(local)].mlp.local_expert_indices[idx]


