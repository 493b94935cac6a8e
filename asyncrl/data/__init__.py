"""Prompt sources: the embedded arithmetic task and users' JSONL files.

Owns: the `Prompt` record and the loaders. Must never: tokenize (the chat template lives with
the tokenizer, see `render_chat_prompt`) or call a model.
"""

from asyncrl.data.prompts import Prompt, PromptDataError, load_jsonl_prompts, render_chat_prompt
from asyncrl.data.arithmetic import ArithmeticTask

__all__ = ["Prompt", "PromptDataError", "load_jsonl_prompts", "render_chat_prompt", "ArithmeticTask"]
