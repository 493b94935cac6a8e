"""The demo task, the JSONL prompt loader and the rule reward."""

import json

import pytest

from asyncrl.data import ArithmeticTask, ColumnMap, PromptDataError, load_jsonl_prompts
from asyncrl.rewards.math import exact_integer_reward, extract_final_integer


def test_arithmetic_splits_are_deterministic_disjoint_and_correct():
    task = ArithmeticTask(digits=2, operators=("+", "-", "*"), seed=3, train_size=500, eval_size=50)
    again = ArithmeticTask(digits=2, operators=("+", "-", "*"), seed=3, train_size=500, eval_size=50)
    train, held_out = task.train_split(), task.eval_split()
    assert train == again.train_split() and held_out == again.eval_split()
    assert len(train) == 500 and len(held_out) == 50
    assert not {p.prompt for p in train} & {p.prompt for p in held_out}
    for p in train[:100] + held_out:
        a, op, b = p.prompt.removeprefix("What is ").removesuffix("?").split(" ")
        assert int(p.answer) == eval(f"{int(a)} {op} {int(b)}")
    other_seed = ArithmeticTask(digits=2, seed=4, train_size=500, eval_size=50)
    assert other_seed.eval_split() != task.eval_split()


def test_arithmetic_rejects_bad_knobs():
    with pytest.raises(ValueError, match="operators"):
        ArithmeticTask(operators=("/",))
    with pytest.raises(ValueError, match="digits"):
        ArithmeticTask(digits=0)
    with pytest.raises(ValueError, match="eval_size"):
        ArithmeticTask(digits=1, operators=("+",), eval_size=100)


def test_jsonl_loader_reads_prompts(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(
        json.dumps({"prompt": "2+2?", "answer": 4}) + "\n\n"
        + json.dumps({"prompt": "name?", "answer": "x", "metadata": {"src": "hand", "k": 1}}) + "\n"
    )
    prompts = load_jsonl_prompts(f)
    assert [p.prompt for p in prompts] == ["2+2?", "name?"]
    assert prompts[0].answer == "4"
    assert prompts[1].metadata == {"src": "hand", "k": "1"}


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "a"', "not valid JSON"),
        ('["a", "b"]', "expected a JSON object"),
        ('{"prompt": "a"}', "missing required key 'answer'"),
        ('{"prompt": "", "answer": 1}', "non-empty string"),
        ('{"prompt": "a", "answer": [1]}', "'answer' must be a string or number"),
        ('{"prompt": "a", "answer": 1, "metadata": 3}', "'metadata' must be an object"),
        ('{"prompt": "a", "answer": 1, "extra": 3}', "unknown keys"),
    ],
)
def test_jsonl_loader_names_the_bad_line(tmp_path, line, message):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "ok", "answer": 1}\n' + line + "\n")
    with pytest.raises(PromptDataError) as info:
        load_jsonl_prompts(f)
    assert message in str(info.value)
    assert "bad.jsonl:2" in str(info.value)


def test_jsonl_loader_missing_and_empty(tmp_path):
    with pytest.raises(PromptDataError, match="not found"):
        load_jsonl_prompts(tmp_path / "nope.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(PromptDataError, match="no prompts"):
        load_jsonl_prompts(empty)


@pytest.mark.parametrize(
    "completion, answer, reward",
    [("432", "432", 1.0), ("The answer is 1,024", "1024", 1.0), ("-7", "-7", 1.0), ("43", "432", 0.0), ("", "1", 0.0), ("12 then 13", "12", 0.0)],
)
def test_exact_integer_reward(completion, answer, reward):
    assert exact_integer_reward(completion, answer) == reward


def test_extract_final_integer():
    assert extract_final_integer("a 1 b 22") == 22
    assert extract_final_integer("none") is None


def test_jsonl_chat_prompts_and_a_column_mapping(tmp_path):
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
                             "answer": 4}) + "\n")
    (p,) = load_jsonl_prompts(f)
    assert p.messages == (("system", "Be brief."), ("user", "2+2?")) and p.prompt == "2+2?"
    mapped = tmp_path / "mapped.jsonl"
    mapped.write_text(json.dumps({"q": "3+3?", "sol": {"value": 6}, "source": "x", "ignored": 1}) + "\n"
                      + json.dumps({"q": "4+4?", "sol": {}, "source": "y"}) + "\n")
    with pytest.raises(PromptDataError, match=r"mapped.jsonl:2: missing required key 'sol.value'"):
        load_jsonl_prompts(mapped, ColumnMap("q", "sol.value", ("source",)))
    mapped.write_text(mapped.read_text().splitlines()[0] + "\n")
    (p,) = load_jsonl_prompts(mapped, ColumnMap("q", "sol.value", ("source",)))  # other keys are ignored with a mapping
    assert (p.prompt, p.answer, p.metadata) == ("3+3?", "6", {"source": "x"})


def test_render_prompt_uses_the_chat_as_given(demo_model_path):
    from transformers import AutoTokenizer

    from asyncrl.data import Prompt, render_chat_prompt, render_prompt

    tok = AutoTokenizer.from_pretrained(str(demo_model_path))
    plain = Prompt(prompt="What is 1 + 2?", answer="3")
    assert render_prompt(tok, plain) == render_chat_prompt(tok, "What is 1 + 2?")
    chat = Prompt(prompt="What is 1 + 2?", answer="3", messages=(("system", "Be brief."), ("user", "What is 1 + 2?")))
    assert render_prompt(tok, chat) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n"
                                        "<|im_start|>assistant\n")
