"""Prompt sources: the embedded arithmetic task, and users' JSONL files, parquet files and local
Hugging Face datasets (asyncrl/data/tables.py; pyarrow / datasets only when used).

Owns: the `Prompt` record and the loaders. Must never: tokenize (the chat template lives with
the tokenizer, see `render_prompt`) or call a model.
"""

from asyncrl.data.arithmetic import ArithmeticTask
from asyncrl.data.prompts import ColumnMap, Prompt, PromptDataError, load_jsonl_prompts, parse_row, render_chat_prompt, render_prompt

__all__ = ["ColumnMap", "Prompt", "PromptDataError", "load_jsonl_prompts", "parse_row", "render_chat_prompt", "render_prompt",
           "ArithmeticTask"]
