"""The math-verify reward: hard cases against hand-checked answers, the worker pool running it (its
timeouts are signals in the worker's main thread), and a clear error at start without the package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import RewardConfig
from asyncrl.rewards import RewardPool
from asyncrl.rewards.verified_math import math_reward, parse_reference

FUNCTION = "asyncrl.rewards.verified_math:math_reward"
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("completion, answer, expected", [
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),                     # a fraction against a decimal
    ("so we get $\\dfrac{3}{4}$.", "3/4", 1.0),                               # \dfrac, plain reference
    ("First I guessed 3, but the answer is \\boxed{4}", "4", 1.0),           # \boxed{} wins over earlier numbers
    ("First I guessed 3, but the answer is \\boxed{4}", "3", 0.0),
    ("48 + 24 = 72 clips. #### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),  # GSM8K's '#### x'
    ("She pays \\boxed{1,234} dollars", "#### 1,234", 1.0),                   # thousands separator
    ("The length is \\boxed{5\\text{ cm}}", "5", 1.0),                        # units
    ("x = \\boxed{-\\sqrt{2}}", "-\\sqrt{2}", 1.0),                           # bare LaTeX reference
    ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}", 1.0),                                # sets are unordered
    ("\\boxed{(1, 2]}", "(1,2]", 1.0),                                        # intervals
    ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}", 1.0),
    ("\\boxed{10\\%}", "0.1", 1.0),                                           # percent
    ("\\boxed{0.3333}", "\\frac13", 0.0),                                     # close is not equal
    ("I don't know", "7", 0.0),                                               # nothing to parse
    ("\\boxed{7}", "not math at all ???", 0.0),                               # an unparsable reference never matches
])
def test_hard_cases(completion, answer, expected):
    assert math_reward(completion, answer) == expected


def test_the_reference_is_read_from_a_gsm8k_tail_and_from_bare_latex():
    assert parse_reference("Some work.\n#### 1,024")[0] == 1024
    assert str(parse_reference("\\frac{2}{4}")[0]) == "1/2"  # bare LaTeX, no $ around it
    assert parse_reference("words only") == []


@pytest.mark.slow
async def test_the_reward_pool_runs_it_in_its_workers():
    pool = RewardPool(RewardConfig(function=FUNCTION, num_workers=1, timeout_s=30))
    try:
        out = await pool.score(["so it is \\boxed{\\frac{6}{8}}", "it is \\boxed{8}"], ["0.75", "7"])
        assert [o.reward for o in out] == [1.0, 0.0]
    finally:
        pool.close()


def test_without_the_package_a_pool_fails_at_start_naming_the_extra():
    # a fresh interpreter in which `import math_verify` fails, as on an install without the extra
    code = ("import sys; sys.modules['math_verify'] = None\n"
            "from asyncrl.config import RewardConfig\nfrom asyncrl.rewards import RewardPool, RewardFunctionError\n"
            f"try:\n    RewardPool(RewardConfig(function={FUNCTION!r}))\n"
            "except RewardFunctionError as err:\n    print(err)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert FUNCTION in done.stdout and "pip install 'asyncrl[math]'" in done.stdout, done.stdout + done.stderr


def test_the_gsm8k_config_reads_verls_parquet_and_scores_with_the_verifier(tmp_path):
    """deploy/rlhf-gsm8k.yaml as a user runs it: its data section reads verl's GSM8K parquet layout (a chat
    prompt, the answer at reward_model.ground_truth) and its reward function is this verifier."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    from asyncrl.config import load_config
    from asyncrl.rewards.pool import resolve_reward_function
    from asyncrl.trainer.parts import load_prompts

    question = "Natalia sold clips to 48 of her friends in April, and half as many in May. How many in all?"
    instruction = 'Let\'s think step by step and output the final answer after "####".'
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{question} {instruction}"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": "72"},
             "extra_info": {"split": split, "index": 0}} for split in ("train", "test")]
    for split, row in zip(("train", "test"), rows):
        pq.write_table(pa.Table.from_pylist([row]), tmp_path / f"{split}.parquet")
    raw = yaml.safe_load((REPO / "deploy" / "rlhf-gsm8k.yaml").read_text())["applications"][0]["args"]
    raw["data"].update(path=str(tmp_path / "train.parquet"), eval_path=str(tmp_path / "test.parquet"))
    cfg = load_config(raw, source="rlhf-gsm8k.yaml")
    train, held_out = load_prompts(cfg.data)
    assert len(train) == len(held_out) == 1 and train[0].answer == "72" and train[0].messages[0][0] == "user"
    score = resolve_reward_function(cfg.reward.function)
    assert score is math_reward
    assert score("48 / 2 = 24 in May, and 48 + 24 = 72 in all. #### 72", train[0].answer, train[0].metadata) == 1.0
    assert score("... #### 70", train[0].answer, train[0].metadata) == 0.0
