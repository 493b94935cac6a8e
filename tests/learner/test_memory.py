"""A learner verb that runs its device out of memory (asyncrl/learner/memory.py): recognised (torch's error, NCCL's
failed allocation), reported as one typed error that says where and what to change, carried across Ray whole,
and not taken for a rank failure that a restart gets past. The rank is the plain class, its role a stub."""

from __future__ import annotations

import pickle

import pytest
import torch

from asyncrl.config import AlgorithmConfig, LearnerConfig, ModelConfig
from asyncrl.interfaces import RoleAPI
from asyncrl.learner.memory import is_out_of_memory, micro_batch_tokens, out_of_memory_error
from asyncrl.learner.rank import LearnerRank
from asyncrl.types import LearnerOutOfMemory, LearnerRankError, Sample, learner_failure

NCCL_OOM = ("NCCL error in: ProcessGroupNCCL.cpp:3356, unhandled cuda error, NCCL version 2.27.7\n"
            "Last error:\nFailed to CUDA calloc async 608 bytes")


def _samples(*lengths: tuple[int, int]) -> list[Sample]:
    return [Sample(prompt_ids=[1] * p, response_ids=[2] * r, behavior_logprobs=[-1.0] * r, versions=[0] * r,
                   reward=0.0, group_id=i) for i, (p, r) in enumerate(lengths)]


def test_only_the_device_running_out_counts():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(torch.distributed.DistBackendError(NCCL_OOM))
    assert not is_out_of_memory(torch.distributed.DistBackendError("NCCL error: remote process exited"))
    assert not is_out_of_memory(RuntimeError("out of memory"))  # not torch's, not NCCL's: not ours to rename


def test_the_largest_micro_batch_as_the_learner_lays_it_out():
    lengths = [100, 3000, 200, 50, 8000]
    assert micro_batch_tokens(lengths[:4], 2, None, packed=False) == 2 * 3000  # [100, 3000] padded, [200, 50]
    assert micro_batch_tokens(lengths[:4], 2, None, packed=True) == 3100
    assert micro_batch_tokens(lengths, 2, None, packed=False) == 8000  # [8000] alone
    assert micro_batch_tokens(lengths, 2, 4000, packed=True) == 8000  # a sequence over the budget goes alone
    assert micro_batch_tokens(lengths[:4], 2, 4000, packed=True) == 3350
    assert micro_batch_tokens([], 2, None, packed=False) == 0


def test_the_report_names_the_verb_the_tokens_the_peak_and_the_settings_that_fit():
    cfg = LearnerConfig(micro_batch_size=2)
    err = out_of_memory_error("update_actor", 3, [2 * 16384, 2 * 16384], cfg, 130.5 * 2**30, 139.8 * 2**30)
    text = str(err)
    assert isinstance(err, LearnerOutOfMemory) and (err.verb, err.rank, err.tokens) == ("update_actor", 3, 65536)
    assert text.startswith("learner rank 3 ran out of device memory in update_actor: 2 sequences (longest 32768 tokens)")
    assert "peak 130.5 GiB of 139.8 GiB" in text and "learner.memory.recompute: full" in text
    assert "learner.max_tokens_per_micro_batch (now None)" in text and "learner.micro_batch_size (now 2)" in text
    assert "learner.memory.optimizer: host" in text
    on_host = LearnerConfig(memory={"optimizer": "host"})
    assert "optimizer: host" not in str(out_of_memory_error("update_actor", 0, [10], on_host, 1e9, 2e9))
    already = LearnerConfig(strategy_config={"recompute_granularity": "full"})
    assert "recompute_granularity" not in str(out_of_memory_error("compute_log_prob", 0, [10], already, None, None))
    by_memory = LearnerConfig(memory={"recompute": "full"})  # the same setting, by learner.memory
    assert "recompute" not in str(out_of_memory_error("compute_log_prob", 0, [10], by_memory, None, None))
    assert "hold_merged" not in text
    lora = LearnerConfig(lora={"rank": 8})
    assert "learner.lora.hold_merged: false" in str(out_of_memory_error("update_actor", 0, [10], lora, None, None))
    held_off = LearnerConfig(lora={"rank": 8, "hold_merged": False})
    assert "hold_merged" not in str(out_of_memory_error("update_actor", 0, [10], held_off, None, None))


def test_a_device_shared_with_another_process_is_said_with_the_settings_that_free_it():
    """The 3B's separated placement on an 80 GB card (69th session): the learner ran out at 52.6 GiB beside an engine's
    26 GiB. The report says how much is held outside the rank and names the hybrid placement and the engines' share."""
    cfg = LearnerConfig()
    shared = str(out_of_memory_error("warm_up", 0, [512], cfg, 49.6 * 2**30, 79.2 * 2**30, 28.2 * 2**30))
    assert "peak 49.6 GiB of 79.2 GiB on its device, 28.2 GiB of it held outside this rank" in shared
    assert "hybrid.enabled: true" in shared and "generator.engine_kwargs.gpu_memory_utilization" in shared
    alone = str(out_of_memory_error("warm_up", 0, [512], cfg, 75.0 * 2**30, 79.2 * 2**30, 1.5 * 2**30))
    assert "held outside" not in alone and "hybrid.enabled" not in alone  # a context and workspaces only


def test_the_memory_section_becomes_megatrons_options_and_must_agree_with_them():
    import pytest

    from asyncrl.config import load_config
    from asyncrl.config.base import ConfigError

    full = LearnerConfig(memory={"recompute": "full", "recompute_method": "block", "recompute_layers": 4})
    assert full.strategy_config == {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 4}
    selective = LearnerConfig(memory={"recompute": "selective"}, strategy_config={"tensor_model_parallel_size": 1})
    assert selective.strategy_config == {"tensor_model_parallel_size": 1, "recompute_granularity": "selective"}
    assert LearnerConfig().strategy_config == {}  # none: Megatron's defaults (or strategy_config's own keys)
    agreeing = LearnerConfig(memory={"recompute": "selective"}, strategy_config={"recompute_granularity": "selective"})
    assert agreeing.strategy_config == {"recompute_granularity": "selective"}
    with pytest.raises(ConfigError, match="learner.memory.recompute"):
        load_config({"learner": {"memory": {"recompute": "fulll"}}})
    with pytest.raises(ConfigError, match="strategy_config sets recompute_granularity='selective'"):
        load_config({"learner": {"memory": {"recompute": "full"}, "strategy_config": {"recompute_granularity": "selective"}}})


def test_the_error_crosses_ray_whole_and_ends_the_run_instead_of_a_restart():
    err = out_of_memory_error("update_actor", 1, [40], LearnerConfig(), None, None)
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) and (back.verb, back.rank, back.tokens) == ("update_actor", 1, err.tokens)
    try:
        try:
            raise back
        except LearnerOutOfMemory as cause:
            raise LearnerRankError(1, "update_actor", str(cause)) from cause
    except LearnerRankError as failed:
        assert learner_failure(failed) is None  # the same batch would run out again
    assert learner_failure(LearnerRankError(1, "update_actor", "killed")) is not None


class _HungryRole:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def compute_log_prob(self, samples):
        raise self.error


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory"), torch.distributed.DistBackendError(NCCL_OOM)])
def test_a_rank_reports_its_verb_running_out(error):
    rank = LearnerRank(2, 4, "actor", ModelConfig(), LearnerConfig(micro_batch_size=2), AlgorithmConfig(),
                       role_classes={"actor": _HungryRole})
    rank.role = _HungryRole(error)
    with pytest.raises(LearnerOutOfMemory, match=r"rank 2 ran out of device memory in compute_log_prob: 3 sequences "
                                                  r"\(longest 30 tokens\), the largest micro-batch 60 tokens") as got:
        rank.call(RoleAPI.compute_log_prob, _samples((4, 6), (10, 20), (5, 5)))
    assert got.value.__cause__ is error
    rank.role = _HungryRole(ValueError("not memory"))
    with pytest.raises(ValueError, match="not memory"):  # anything else passes through untouched
        rank.call(RoleAPI.compute_log_prob, _samples((4, 6)))


def test_a_host_optimizer_that_would_not_fit_the_hosts_memory_is_refused_with_the_fraction_that_does():
    import pytest

    from asyncrl.learner.roles.optim import check_host_memory

    seven_b = 7_615_000_000
    cfg = LearnerConfig(memory={"optimizer": "host"})
    with pytest.raises(ValueError, match=r"need about 113.5 GiB .* 100.0 GiB is available .*optimizer_host_fraction to 0.79 or less"):
        check_host_memory(seven_b, cfg, available=100 * 2**30)
    check_host_memory(seven_b, LearnerConfig(memory={"optimizer": "host", "optimizer_host_fraction": 0.6}),
                      available=100 * 2**30)  # 68 GiB: fits
    # four ranks of DP = 4 on one node: each holds a quarter of the state, together the whole 113.5 GiB
    with pytest.raises(ValueError, match=r"4 learner ranks x 1,903,750,000 parameters x 1 .* need about 113.5 GiB"):
        check_host_memory(seven_b, cfg, available=100 * 2**30, dp=4, ranks_on_node=4)
    check_host_memory(seven_b, cfg, available=100 * 2**30, dp=4, ranks_on_node=2)  # the other two elsewhere: 57 GiB


def test_host_memory_is_trimmed_once_the_resident_set_creeps_past_its_level():
    """After each training step: the first step's resident set is the level; a creep within `slack` is left alone
    (the heaps keep the step's working set on purpose), past it the freed memory goes back, and the level is
    measured again after the next step."""
    from asyncrl.learner.memory import HostMemoryTrim

    readings, trims = iter([1000, 1080, 1100, 1111, 900, 1000, 1090, 1101, 950]), []  # (read again after each trim)
    trim = HostMemoryTrim(slack=0.10, resident=lambda: next(readings), trim=lambda: trims.append(1) or True)
    assert [trim.after_step() for _ in range(7)] == [False, False, False, True, False, False, True]
    assert trim.trims == 2 and trim.level is None
    unreadable = HostMemoryTrim(resident=lambda: None, trim=lambda: pytest.fail("trimmed blind"))
    assert not unreadable.after_step() and not unreadable.after_step()


class _StepRole:
    def update_actor(self, *args, **kwargs):
        return {"ok": 1}

    def compute_log_prob(self, samples):
        return None


def test_a_rank_trims_after_its_training_steps_only():
    from asyncrl.learner.memory import HostMemoryTrim

    rank = LearnerRank(0, 1, "actor", ModelConfig(), LearnerConfig(), AlgorithmConfig(), role_classes={"actor": _StepRole})
    from asyncrl.learner.profiler import StepProfiler

    rank.role, rank.profiler = _StepRole(), StepProfiler(None, 0)  # (what setup makes)
    seen: list[str] = []
    rank.host_trim = HostMemoryTrim(resident=lambda: seen.append("read") or 1, trim=lambda: True)
    rank.call(RoleAPI.compute_log_prob, [])
    assert seen == []  # not a training step
    assert rank.call(RoleAPI.update_actor, [], None, None, None) == {"ok": 1} and seen == ["read"]


def test_malloc_trim_gives_the_heaps_freed_blocks_back():
    """What the trim relies on (glibc, Linux): blocks freed inside a heap stay resident until `malloc_trim`."""
    import ctypes
    import ctypes.util

    from asyncrl.learner.memory import malloc_trim, resident_bytes

    if resident_bytes() is None or not ctypes.util.find_library("c"):
        pytest.skip("no /proc or no C library to load")
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, n = 64 * 1024, 2000  # 125 MiB in blocks under glibc's mmap threshold: from the heap
    blocks = [libc.malloc(size) for _ in range(n)]
    for b in blocks:
        ctypes.memset(b, 1, size)  # resident
    for b in blocks[:-1]:  # the last one pins the heap's top: only a trim returns the rest
        libc.free(b)
    held = resident_bytes()
    assert malloc_trim()
    given_back = held - resident_bytes()  # type: ignore[operator]
    libc.free(blocks[-1])
    assert given_back > 0.5 * size * n, given_back


def test_a_sharded_optimizer_without_gpus_or_with_expert_parallelism_is_refused_naming_the_fields():
    for optimizer in ("sharded", "host"):
        with pytest.raises(ValueError, match=f"learner.memory.optimizer {optimizer} .*expert_model_parallel_size=2"):
            LearnerConfig(world_size=2, memory={"optimizer": optimizer}, num_gpus_per_rank=1,
                          strategy_config={"expert_model_parallel_size": 2})
    with pytest.raises(ValueError, match="optimizer sharded .* needs the learner on GPUs"):
        LearnerConfig(world_size=2, memory={"optimizer": "sharded"})
    assert LearnerConfig(world_size=2, memory={"optimizer": "sharded"}, num_gpus_per_rank=1).memory.optimizer == "sharded"
