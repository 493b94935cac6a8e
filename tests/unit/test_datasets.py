"""Prompt datasets as verl, OpenRLHF and TRL keep them: parquet files and local `datasets` datasets,
a column mapping (dotted paths into nested columns), chat-message prompts, and bad rows named by
file and row. Real pyarrow and datasets on files written here (the `data` extra)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets  # the `data` extra; `make test` installs it (the test extra)
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.data import ColumnMap, Prompt, PromptDataError
from asyncrl.trainer.parts import load_prompts

VERL = ColumnMap(prompt="prompt", answer="reward_model.ground_truth", metadata="extra_info")


def _verl_rows(n: int) -> list[dict]:
    """Rows in verl's GSM8K layout: a chat prompt, the answer inside reward_model, extra_info."""
    return [{
        "data_source": "arith",
        "prompt": [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": f"What is {i} + 1?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        "extra_info": {"split": "train", "index": i},
    } for i in range(n)]


def _parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_parquet_in_verls_layout_gives_chat_prompts_answers_and_metadata(tmp_path):
    prompts = load_prompts_from(tmp_path, "parquet", _parquet(tmp_path / "train.parquet", _verl_rows(5)), VERL)
    assert len(prompts) == 5
    p = prompts[3]
    assert p.messages == (("system", "Answer with a number."), ("user", "What is 3 + 1?"))
    assert p.prompt == "What is 3 + 1?" and p.answer == "4"
    assert p.metadata == {"split": "train", "index": "3"}


def load_prompts_from(tmp_path: Path, kind: str, path: Path, columns: ColumnMap, **data) -> list[Prompt]:
    """Through the config and the trainer's loader, as a run loads them."""
    cols = {"prompt": columns.prompt, "answer": columns.answer,
            "metadata": list(columns.metadata) if isinstance(columns.metadata, tuple) else columns.metadata}
    cfg = load_config({"data": {"kind": kind, "path": str(path), "columns": cols, **data}})
    train, _ = load_prompts(cfg.data)
    return train


def test_parquet_plain_columns_folder_and_listed_metadata(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    _parquet(folder / "part-0.parquet", [{"question": "What is 1 + 1?", "solution": 2, "level": "easy", "src": "a"}])
    _parquet(folder / "part-1.parquet", [{"question": "What is 2 + 2?", "solution": 4, "level": "hard", "src": "b"}])
    prompts = load_prompts_from(tmp_path, "parquet", folder, ColumnMap("question", "solution", ("level",)))
    assert [(p.prompt, p.answer, p.metadata, p.messages) for p in prompts] == [
        ("What is 1 + 1?", "2", {"level": "easy"}, ()), ("What is 2 + 2?", "4", {"level": "hard"}, ())]


@pytest.mark.parametrize(
    "bad_row, message",
    [
        ({"reward_model": {"style": "rule", "ground_truth": None}}, "'reward_model.ground_truth' must be a string or number, got None"),
        ({"prompt": []}, "'prompt' is an empty list of messages"),
        ({"prompt": [{"role": "wizard", "content": "hi"}]}, "prompt[0].role must be one of"),
        ({"prompt": [{"role": "system", "content": "only a system turn"}]}, "no non-empty user message"),
    ],
)
def test_parquet_bad_row_names_file_and_row(tmp_path, bad_row, message):
    rows = _verl_rows(4)
    rows[2] = {**rows[2], **bad_row}
    path = _parquet(tmp_path / "train.parquet", rows)
    with pytest.raises(PromptDataError) as err:
        load_prompts_from(tmp_path, "parquet", path, VERL)
    assert f"{path} row 2: " in str(err.value) and message in str(err.value), str(err.value)


def test_parquet_file_problems_are_named(tmp_path):
    path = _parquet(tmp_path / "t.parquet", [{"question": "q", "answer": "1"}])
    with pytest.raises(PromptDataError, match=r"no column 'prompt' \(columns: answer, question\); map yours with data.columns"):
        load_prompts_from(tmp_path, "parquet", path, ColumnMap())
    not_parquet = tmp_path / "x.parquet"
    not_parquet.write_text("prompt,answer\nq,1\n")
    with pytest.raises(PromptDataError, match=r"x.parquet: not a readable parquet file"):
        load_prompts_from(tmp_path, "parquet", not_parquet, ColumnMap())
    with pytest.raises(PromptDataError, match="prompts file not found"):
        load_prompts_from(tmp_path, "parquet", tmp_path / "nope.parquet", ColumnMap())
    (tmp_path / "empty").mkdir()
    with pytest.raises(PromptDataError, match="a folder with no .parquet file"):
        load_prompts_from(tmp_path, "parquet", tmp_path / "empty", ColumnMap())


def test_hf_dataset_saved_to_disk_with_train_and_eval_splits(tmp_path):
    rows = _verl_rows(6)
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:4]), "test": datasets.Dataset.from_list(rows[4:])})
    dd.save_to_disk(str(tmp_path / "ds"))
    cfg = load_config({"data": {"kind": "hf_dataset", "path": str(tmp_path / "ds"), "eval_split": "test",
                                "columns": {"answer": "reward_model.ground_truth", "metadata": "extra_info"}}})
    train, held_out = load_prompts(cfg.data)
    assert [p.answer for p in train] == ["1", "2", "3", "4"] and [p.answer for p in held_out] == ["5", "6"]
    assert held_out[0].messages[1] == ("user", "What is 4 + 1?")
    with pytest.raises(PromptDataError, match=r"no split 'validation' \(splits: train, test\)"):
        load_prompts(load_config({"data": {"kind": "hf_dataset", "path": str(tmp_path / "ds"), "split": "validation"}}).data)


def test_hf_dataset_trl_conversational_jsonl_file_and_folder(tmp_path):
    """TRL's prompt-only conversational layout: `prompt` is a list of messages, other columns ride along."""
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "answer": 2 * i, "id": i} for i in range(3)]
    file = tmp_path / "trl.jsonl"
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = load_prompts_from(tmp_path, "hf_dataset", file, ColumnMap())
    assert [(p.prompt, p.answer) for p in prompts] == [(f"What is {i} + {i}?", str(2 * i)) for i in range(3)]
    folder = tmp_path / "data_files"
    folder.mkdir()
    _parquet(folder / "train-00000.parquet", [{"prompt": "What is 9 + 9?", "answer": "18"}])
    assert [p.answer for p in load_prompts_from(tmp_path, "hf_dataset", folder, ColumnMap())] == ["18"]


def test_hf_dataset_bad_rows_and_paths_are_named(tmp_path):
    rows = [{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": "", "answer": "0"}]
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "one"))
    with pytest.raises(PromptDataError, match=r"one row 1: 'prompt' must be a non-empty string or a list of chat messages"):
        load_prompts_from(tmp_path, "hf_dataset", tmp_path / "one", ColumnMap())
    with pytest.raises(PromptDataError, match="dataset not found: .*reads local datasets only"):
        load_prompts_from(tmp_path, "hf_dataset", tmp_path / "org/name", ColumnMap())
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(PromptDataError, match=r"cannot tell the format from the suffix '.txt'"):
        load_prompts_from(tmp_path, "hf_dataset", tmp_path / "data.txt", ColumnMap())
    with pytest.raises(PromptDataError, match=r"is one file, one split; data.split='test'"):
        load_prompts_from(tmp_path, "hf_dataset", _parquet(tmp_path / "d.parquet", [{"prompt": "q", "answer": 1}]),
                          ColumnMap(), split="test")
    broken = tmp_path / "broken.json"
    broken.write_text('{"prompt": "a", "answer": ')
    with pytest.raises(PromptDataError, match=r"broken.json: datasets could not load it"):
        load_prompts_from(tmp_path, "hf_dataset", broken, ColumnMap())


def test_data_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"data = \{...\}: Value error, kind='parquet' needs `path`"):
        load_config({"data": {"kind": "parquet"}})
    with pytest.raises(ConfigError, match="eval_split='test' is for kind='hf_dataset'"):
        load_config({"data": {"kind": "parquet", "path": "x", "eval_split": "test"}})
    with pytest.raises(ConfigError, match="give eval_path or eval_split, not both"):
        load_config({"data": {"kind": "hf_dataset", "path": "x", "eval_split": "test", "eval_path": "y"}})
    with pytest.raises(ConfigError, match=r"data.columns.answer = ''"):
        load_config({"data": {"kind": "parquet", "path": "x", "columns": {"answer": ""}}})
    with pytest.raises(ConfigError, match=r"data.columns.bogus"):
        load_config({"data": {"kind": "parquet", "path": "x", "columns": {"bogus": "a"}}})
