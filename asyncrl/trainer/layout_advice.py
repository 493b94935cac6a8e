"""The learner's layout advisor: the data / tensor / context / pipeline parallel sizes and the activation recompute a
learner group would train fastest with, among those estimated to fit its ranks' devices; said at start (and by
`asyncrl layout CONFIG`), with a warning where the configured layout does not fit, or is estimated slower than one that
does.

Owns: a layout's memory on each rank (`rank_bytes`: placement_choice.py's model of the actor's state and activations,
divided as Megatron divides them), its speed against one GPU (`relative_speed`: the measured cost of each kind of
parallelism, below), the search over a group's layouts (`advise`), and the report (`log_layout_advice`).
Must never: change the configured layout unless `learner.layout: advised` asks it to (`advised_config`; else the
advice names what to set and why), or fail a start (an advice that cannot be made is not given).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from asyncrl.trainer.placement_choice import (
    ACTIVATION_ELEMENT_BYTES,
    FIT_SHARE,
    GIB,
    VLLM_DEFAULT_UTILIZATION,
    bytes_per_param,
    layer_activation_bytes,
    micro_batch_tokens,
    model_params,
)

log = logging.getLogger(__name__)

# Each parallelism's efficiency a GPU, against one GPU training the same tokens. Measured on two GPUs of one host (a random 1.5B,
# 8 x 8192 tokens, micro-batch 1; issue 67): TP=2 with sequence parallelism trained 0.81x one GPU's tokens/s (0.405 a
# GPU: its all-gathers and reduce-scatters do not overlap compute without Transformer Engine), CP=2 0.40x (0.20 a GPU).
# Each further doubling is taken to cost the same share again. DP's gradient reduce runs once after the backward (one
# all-reduce or reduce-scatter of the grads a step, not per micro-batch): 0.95 a GPU (issue 67's goal, not yet
# measured). A pipeline sends activations between its stages (taken as DP's cost, not yet measured) and idles for its
# bubble: m / (m + p - 1) with m micro-batches a step.
TP2_EFFICIENCY = 0.405
CP2_EFFICIENCY = 0.20
DP_EFFICIENCY = PP_EFFICIENCY = 0.95
# Recompute reruns in the backward: full, each layer's forward (a third more FLOPs); selective, core attention only.
RECOMPUTE_SPEED = {"none": 1.0, "selective": 0.97, "full": 0.75}
RECOMPUTES = ("none", "selective", "full")
# learner.memory.optimizer sharded (Megatron's distributed optimizer) splits the fp32 main params (4 bytes) and Adam's
# moments (8) of BYTES_PER_PARAM over the DP x CP ranks; its reduce-scatter and all-gather carry an all-reduce's
# bytes, so its speed is taken as the device optimizer's (not yet measured: issue 67).
SHARDED_STATE_BYTES = 12
SLOWER_WARNS = 0.9  # the configured layout is warned about below this share of the best estimate


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    optimizer: str = "device"  # or "sharded": learner.memory.optimizer

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def describe(self) -> str:
        sp = " + SP" if self.sequence_parallel else ""
        sharded = ", optimizer sharded" if self.optimizer == "sharded" else ""
        return f"DP {self.dp} x TP {self.tp}{sp} x CP {self.cp} x PP {self.pp}, recompute {self.recompute}{sharded}"

    def strategy(self) -> dict[str, Any]:
        """Its learner.strategy_config keys (the sizes above 1, sequence parallelism where on)."""
        s: dict[str, Any] = {k: v for k, v in (("tensor_model_parallel_size", self.tp), ("context_parallel_size", self.cp),
                                               ("pipeline_model_parallel_size", self.pp)) if v > 1}
        return {**s, "sequence_parallel": True} if self.sequence_parallel else s

    def settings(self) -> str:
        """What to write in the config for it."""
        parts = [f"{k}: {str(v).lower()}" for k, v in self.strategy().items()]
        strategy = f"learner.strategy_config {{{', '.join(parts)}}}" if parts else "learner.strategy_config without TP, CP or PP"
        sharded = ", learner.memory.optimizer: sharded" if self.optimizer == "sharded" else ""
        return f"{strategy}, learner.memory.recompute: {self.recompute}{sharded}"


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    bytes: float  # on each rank's device
    speed: float  # the group's tokens/s against one GPU's, no recompute

    def fits(self, room: float) -> bool:
        return self.bytes <= room


@dataclass(frozen=True)
class Advice:
    configured: Estimate
    best: Estimate | None  # None: no layout of this group is estimated to fit
    room: float  # bytes a rank may take on its device
    level: int  # logging.INFO, or WARNING where the configured layout does not fit or is slower than the best
    message: str


def rank_bytes(hf_config: Any, layout: Layout, tokens: int, logprob_chunk: int, learner: Any = None) -> float:
    """What the actor needs on each rank's device while it trains with `layout`: its state split over TP x PP; one
    micro-batch of `tokens` tokens' activations split over CP and TP (the norms' inputs too with sequence
    parallelism), the first pipeline stage holding PP micro-batches of its layers (every layer's worth); and the LM
    head's chunk of logits, vocab split over TP."""
    c = hf_config
    per_param = bytes_per_param(learner)
    if layout.optimizer == "sharded":  # (offered only where the learner's optimizer is the device's)
        per_param -= SHARDED_STATE_BYTES * (1 - 1 / (layout.dp * layout.cp))
    state = per_param * model_params(c) / (layout.tp * layout.pp)
    layer = layer_activation_bytes(c)
    norms = ACTIVATION_ELEMENT_BYTES * 4 * c.hidden_size  # replicated over TP without sequence parallelism
    per_token = ((layer - norms) / layout.tp + norms / (layout.tp if layout.sequence_parallel else 1)) / layout.cp
    local = tokens * per_token
    if layout.recompute == "full":  # each layer's input kept (split as the norms are), one layer's whole at a time
        activations = tokens * norms / 4 / (layout.tp if layout.sequence_parallel else 1) / layout.cp \
            * c.num_hidden_layers + local
    else:  # (selective: its core attention keeps nothing beyond its inputs on the fused kernels: counted as none)
        activations = local * c.num_hidden_layers
    logits = 2 * 4 * min(logprob_chunk, max(1, tokens // layout.cp)) * c.vocab_size / layout.tp
    return float(state + activations + logits)


def relative_speed(layout: Layout, micro_batches: int) -> float:
    """The group's training throughput against one GPU without recompute (the measured efficiencies above)."""
    eff = (DP_EFFICIENCY if layout.dp > 1 else 1.0) * (PP_EFFICIENCY if layout.pp > 1 else 1.0) \
        * TP2_EFFICIENCY ** math.log2(layout.tp) \
        * CP2_EFFICIENCY ** math.log2(layout.cp) * RECOMPUTE_SPEED[layout.recompute]
    bubble = micro_batches / (micro_batches + layout.pp - 1)
    return layout.gpus * eff * bubble


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(hf_config: Any, gpus: int, shard: bool = True) -> list[Layout]:
    """Every layout of `gpus` ranks the learner takes for this model (`validate_layout`: heads and KV heads divide by
    TP, layers by PP), each recompute setting; TP with sequence parallelism; with more than one DP x CP rank, each also
    with the sharded optimizer (`shard`: on GPU ranks with the device optimizer, where the learner takes it)."""
    from asyncrl.config import ConfigError
    from asyncrl.learner.parallel import ParallelLayout, validate_layout

    out = []
    for tp in _divisors(gpus):
        for cp in _divisors(gpus // tp):
            for pp in _divisors(gpus // (tp * cp)):
                try:
                    validate_layout(ParallelLayout(gpus, tp=tp, pp=pp, cp=cp, sequence_parallel=tp > 1), hf_config)
                except ConfigError:
                    continue
                dp = gpus // (tp * cp * pp)
                optimizers = ("device", "sharded") if shard and dp * cp > 1 else ("device",)
                out += [Layout(tp, cp, pp, dp, r, tp > 1, o) for o in optimizers for r in RECOMPUTES]
    return out


def configured_layout(learner: Any) -> Layout:
    from asyncrl.learner.parallel import ParallelLayout

    p = ParallelLayout.from_learner_config(learner)
    return Layout(p.tp, p.cp, p.pp, max(1, p.dp), learner.memory.recompute, p.sequence_parallel,
                  "sharded" if learner.memory.optimizer == "sharded" else "device")


def check_dense(hf_config: Any, path: str) -> None:
    """ValueError for a mixture-of-experts model: the advisor does not search expert parallelism."""
    if getattr(hf_config, "num_experts", 0) or getattr(hf_config, "num_local_experts", 0):
        raise ValueError(f"{path} is a mixture-of-experts model: the advisor does not search expert parallelism")


def learner_room(cfg: Any, device_bytes: float) -> float:
    """What a learner rank may take of its device: the fit share, less the engine's where the engine shares the
    device with it awake (separated on a fraction of one GPU)."""
    room = FIT_SHARE * device_bytes
    if not cfg.hybrid.enabled and cfg.learner.num_gpus_per_rank < 1 and cfg.generator.num_gpus < 1:
        room -= float(cfg.generator.engine_kwargs.get("gpu_memory_utilization", VLLM_DEFAULT_UTILIZATION)) * device_bytes
    return room


def advise(cfg: Any, hf_config: Any, device_bytes: float) -> Advice:
    """The advice for `cfg` (a RootConfig, `hybrid.enabled` resolved) on ranks' devices of `device_bytes` each."""
    learner = cfg.learner
    tokens = micro_batch_tokens(cfg)
    room = learner_room(cfg, device_bytes)

    def estimate(layout: Layout) -> Estimate:
        micro_batches = max(1, math.ceil(cfg.buffer.batch_size / layout.dp / learner.micro_batch_size))
        return Estimate(layout, rank_bytes(hf_config, layout, tokens, learner.logprob_chunk_size, learner),
                        relative_speed(layout, micro_batches))

    mine = estimate(configured_layout(learner))
    shard = learner.memory.optimizer in ("device", "sharded") and learner.lora is None and learner.num_gpus_per_rank > 0
    fitting = [e for e in map(estimate, candidate_layouts(hf_config, learner.world_size, shard)) if e.fits(room)]
    # the fastest; of equal estimates, the one with the fewest model-parallel ranks, the least recompute, unsharded
    best = max(fitting, key=lambda e: (round(e.speed, 6), -e.layout.tp * e.layout.cp * e.layout.pp,
                                       -RECOMPUTES.index(e.layout.recompute), e.layout.optimizer == "device"),
               default=None)
    gib = lambda b: f"{b / GIB:.1f} GiB" if b >= GIB else f"{b / 2**20:.0f} MiB"  # noqa: E731
    sizes = f"{tokens} tokens a micro-batch, {learner.world_size} rank(s) of {gib(room)} for the learner"
    if best is None:
        return Advice(mine, None, room, logging.WARNING,
                      f"no layout of {learner.world_size} learner rank(s) is estimated to fit ({sizes}; the configured "
                      f"{mine.layout.describe()} needs ~{gib(mine.bytes)} a rank): more GPUs, a smaller "
                      "learner.max_tokens_per_micro_batch / micro_batch_size, or learner.memory.optimizer: host")
    if not mine.fits(room):
        return Advice(mine, best, room, logging.WARNING,
                      f"the configured {mine.layout.describe()} is estimated to need ~{gib(mine.bytes)} a rank, more "
                      f"than fits ({sizes}): {best.layout.describe()} fits (~{gib(best.bytes)}); set {best.layout.settings()}")
    if mine.speed < SLOWER_WARNS * best.speed:
        return Advice(mine, best, room, logging.WARNING,
                      f"the configured {mine.layout.describe()} fits (~{gib(mine.bytes)} a rank; {sizes}) but is estimated "
                      f"at {mine.speed / best.speed:.2f}x the training throughput of {best.layout.describe()} "
                      f"(~{gib(best.bytes)}): set {best.layout.settings()}")
    return Advice(mine, best, room, logging.INFO,
                  f"the configured {mine.layout.describe()} is estimated to fit (~{gib(mine.bytes)} a rank; {sizes}) "
                  f"and to train within {1 - SLOWER_WARNS:.0%} of the fastest layout that fits")


def advise_file(cfg: Any, gpus: int | None, gpu_gib: float) -> Advice:
    """`asyncrl layout`: the advice for `cfg`'s learner on `gpus` ranks (its world_size by default) of `gpu_gib` GiB
    each, a GPU apiece."""
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(cfg.model.path)
    except (OSError, ValueError) as err:
        raise ValueError(f"model.path={cfg.model.path!r} holds no readable Hugging Face config ({err})") from None
    check_dense(hf_config, cfg.model.path)
    learner = cfg.learner.model_copy(update={"world_size": gpus or cfg.learner.world_size,
                                             "num_gpus_per_rank": max(1.0, cfg.learner.num_gpus_per_rank)})
    try:
        return advise(cfg.model_copy(update={"learner": learner}), hf_config, gpu_gib * GIB)
    except AttributeError as err:  # a config without a decoder's sizes (hidden_size, intermediate_size, ...)
        raise ValueError(f"{cfg.model.path}'s config is not a decoder the advisor can size: {err}") from None


def log_layout_advice(cfg: Any, probe: Any = None) -> Advice | None:
    """Log the advice for a learner on GPUs (`probe()`: one GPU's bytes, placement_choice's by default); None where none
    is given: a learner without GPUs, a mixture-of-experts model (its expert parallelism is not searched), or a model
    whose config or device cannot be read."""
    if cfg.learner.num_gpus_per_rank <= 0:
        return None
    try:
        from transformers import AutoConfig

        from asyncrl.trainer.placement_choice import device_memory_bytes

        hf_config = AutoConfig.from_pretrained(cfg.model.path)
        check_dense(hf_config, cfg.model.path)  # (before the device probe's task)
        device_bytes = (probe or device_memory_bytes)()
        if device_bytes is None:
            return None
        advice = advise(cfg, hf_config, device_bytes)
    except Exception as err:  # noqa: BLE001 - advice only: the start goes on without it
        log.info("learner layout advice not given: %s: %s", type(err).__name__, err)
        return None
    log.log(advice.level, "learner layout: %s", advice.message)
    return advice


# strategy_config keys a layout sets or that depend on its sizes (a virtual pipeline on the configured PP), and those
# learner.memory writes there (its validator writes them again from the advised memory)
LAYOUT_KEYS = ("tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size", "sequence_parallel",
               "virtual_pipeline_model_parallel_size", "recompute_granularity", "recompute_method", "recompute_num_layers")


def advised_config(cfg: Any, advice: Advice | None) -> Any:
    """`cfg` with its learner in the advised layout where `learner.layout: advised` asks for it and an advice that
    fits was made (else `cfg` as it is): the layout's sizes and sequence parallelism into strategy_config, its
    recompute and optimizer into learner.memory, validated as a config written so would be."""
    if cfg.learner.layout != "advised" or advice is None or advice.best is None:
        return cfg
    best = advice.best.layout
    if best == advice.configured.layout:
        return cfg
    learner = cfg.learner.model_dump()
    learner["strategy_config"] = {**{k: v for k, v in learner["strategy_config"].items() if k not in LAYOUT_KEYS},
                                  **best.strategy()}
    learner["memory"]["recompute"] = best.recompute
    if learner["memory"]["optimizer"] != "host":  # (a host optimizer stays: the advice was made with it)
        learner["memory"]["optimizer"] = best.optimizer
    data = cfg.model_dump()
    data["learner"] = learner
    advised = type(cfg).model_validate(data)
    log.warning("learner layout advised (learner.layout: advised): training with %s instead of the configured %s",
                best.describe(), advice.configured.layout.describe())
    return advised
