"""Offline checkpoint conversion (`asyncrl convert ...`): HF directory <-> Megatron dist checkpoint.

Owns: starting local ranks (torch.multiprocessing, gloo on CPU / nccl on GPU) for one conversion,
and the per-rank steps (build -> load -> save / export -> write safetensors).

Must never: be imported by the training path (it starts processes of its own).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from asyncrl.weightsync.collective import free_port

_NON_WEIGHT_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")


def _spawn(fn, world_size: int, *args: Any) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(_rank_entry, args=(world_size, free_port("127.0.0.1"), fn, args), nprocs=world_size,
                       join=True, start_method="spawn")


def _rank_entry(rank: int, world_size: int, port: int, fn, args: tuple) -> None:
    import torch

    from asyncrl.learner.compat import install_cpu_compat
    from asyncrl.learner.parallel import destroy_model_parallel, init_distributed

    if not torch.cuda.is_available():
        install_cpu_compat()
    init_distributed(rank, world_size, "127.0.0.1", port)
    try:
        fn(rank, world_size, *args)
    finally:
        destroy_model_parallel()


def _setup(world_size: int, strategy: dict[str, int], hf_config_dir: str):
    from transformers import AutoConfig

    from asyncrl.config import LearnerConfig
    from asyncrl.learner.model import build_model_chunks
    from asyncrl.learner.parallel import init_model_parallel

    hf = AutoConfig.from_pretrained(hf_config_dir)
    init_model_parallel(LearnerConfig(world_size=world_size, strategy_config=strategy), hf)
    return hf, build_model_chunks(hf, strategy, dtype=_dtype_of(hf))


def _dtype_of(hf) -> str:
    dtype = str(getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or "float32")
    return dtype.replace("torch.", "") if dtype.replace("torch.", "") in ("float32", "bfloat16", "float16") else "float32"


def _strategy(tp: int, pp: int, ep: int) -> dict[str, int]:
    for name, value in (("tp", tp), ("pp", pp), ("ep", ep)):
        if value < 1:
            raise ValueError(f"--{name}={value} must be >= 1")
    return {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "expert_model_parallel_size": ep}


def _hf_to_mcore_rank(rank: int, world: int, hf_dir: str, out: str, strategy: dict[str, int]) -> None:
    from asyncrl.learner.checkpoint import save_checkpoint
    from asyncrl.learner.convert import load_hf_weights

    hf, chunks = _setup(world, strategy, hf_dir)
    load_hf_weights(chunks, hf_dir, hf)
    save_checkpoint(out, chunks, extra={"hf_config": hf.to_dict(), "converted_from": str(hf_dir)}, save_rng=False)


def hf_to_mcore(hf_dir: str, out: str, tp: int = 1, pp: int = 1, ep: int = 1) -> Path:
    """Convert an HF model directory into a dist checkpoint laid out for TP x PP (x EP) ranks."""
    strategy = _strategy(tp, pp, ep)
    from transformers import AutoConfig

    from asyncrl.learner.parallel import ParallelLayout, validate_layout

    # Fail here, naming the bad value, before any process starts.
    world = tp * pp * ep
    validate_layout(ParallelLayout(world_size=world, tp=tp, pp=pp, ep=ep, etp=tp), AutoConfig.from_pretrained(hf_dir))
    _spawn(_hf_to_mcore_rank, world, str(Path(hf_dir).absolute()), str(Path(out).absolute()), strategy)
    return Path(out)


def _mcore_to_hf_rank(rank: int, world: int, mcore: str, out: str, hf_config_dir: str, strategy: dict[str, int],
                      peft_out: str | None = None) -> None:
    import torch
    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    from asyncrl.learner.checkpoint import load_checkpoint, saved_extra
    from asyncrl.learner.convert import export_hf_tensors

    hf, chunks = _setup(world, strategy, hf_config_dir)
    lora = saved_extra(mcore).get("lora")
    if lora:  # a LoRA run's actor: its adapters loaded beside the base, the export merges them
        from asyncrl.config.components import resolve_lora_targets
        from asyncrl.learner.lora import add_adapters

        add_adapters(chunks, hf, rank=lora["rank"], alpha=lora["alpha"], dropout=0.0,
                     targets=resolve_lora_targets(lora["target_modules"]), seed=0)
    load_checkpoint(mcore, chunks, load_rng=False)
    tensors = dict(export_hf_tensors(chunks, hf))  # collective: every rank iterates
    if lora and peft_out:
        from asyncrl.learner.lora import peft_adapter_tensors

        adapter = dict(peft_adapter_tensors(chunks))  # collective: TP shards gathered
        if rank == 0:
            save_file({k: v.contiguous() for k, v in adapter.items()}, str(Path(peft_out) / "adapter_model.safetensors"),
                      metadata={"format": "pt"})
    sender = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    pp, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    fname = "model.safetensors" if pp == 1 else f"model-{stage + 1:05d}-of-{pp:05d}.safetensors"
    if sender:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(Path(out) / fname), metadata={"format": "pt"})
    names = [(k, fname) for k in tensors] if sender else []
    gathered: list[Any] = [None] * world
    torch.distributed.all_gather_object(gathered, names)
    if rank == 0 and pp > 1:
        weight_map = {k: f for part in gathered for k, f in part}
        (Path(out) / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))


def mcore_to_hf(mcore: str, out: str, hf_config_dir: str, tp: int = 1, pp: int = 1, ep: int = 1,
                peft_out: str | None = None) -> Path:
    """Export a dist checkpoint (any saved layout) to an HF directory, config files copied over. A LoRA run's
    actor exports its merged weights, and with `peft_out` its adapters as a PEFT adapter directory there too."""
    strategy = _strategy(tp, pp, ep)
    if not (Path(mcore) / "metadata.json").exists():
        raise FileNotFoundError(f"--mcore {mcore} is not a dist checkpoint (no metadata.json)")
    out_dir = Path(out).absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in Path(hf_config_dir).iterdir():
        if f.is_file() and f.suffix in _NON_WEIGHT_SUFFIXES and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out_dir / f.name)
    if peft_out is not None:
        from asyncrl.learner.checkpoint import saved_extra
        from asyncrl.learner.lora import peft_adapter_config

        lora = saved_extra(mcore).get("lora")
        if not lora:
            raise ValueError(f"--peft-out: checkpoint {mcore} was not trained with learner.lora (no adapters to write)")
        Path(peft_out).mkdir(parents=True, exist_ok=True)
        (Path(peft_out) / "adapter_config.json").write_text(
            json.dumps(peft_adapter_config(lora, str(Path(hf_config_dir).absolute())), indent=2))
        peft_out = str(Path(peft_out).absolute())
    _spawn(_mcore_to_hf_rank, tp * pp * ep, str(Path(mcore).absolute()), str(out_dir),
           str(Path(hf_config_dir).absolute()), strategy, peft_out)
    return out_dir
