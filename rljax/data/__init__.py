"""Prompt data: procedural tasks, record loading, chat templates, tokenisation and iteration."""

from rljax.data.batching import (
    PromptIterator,
    TokenizedPrompts,
    default_buckets,
    pad_token_id,
    tokenize_prompts,
)
from rljax.data.loading import MissingColumnError, load_records, read_rows
from rljax.data.prompts import ANSWER_TAG_INSTRUCTION, R1_SYSTEM_PROMPT, format_prompt, format_prompts
from rljax.data.tasks import available_tasks, make_task, question_split, register_task

__all__ = [
    "PromptIterator", "TokenizedPrompts", "default_buckets", "pad_token_id",
    "tokenize_prompts", "MissingColumnError", "load_records", "read_rows", "ANSWER_TAG_INSTRUCTION",
    "R1_SYSTEM_PROMPT", "format_prompt", "format_prompts", "available_tasks", "make_task",
    "question_split", "register_task",
]
