"""Prompt text from a dataset row, and prompt text to prompt tokens: chat-template application,
standard system prompts, and :class:`PromptFormat` with :func:`encode_prompts` (no sampling here).

    text = format_prompt(tokenizer, "What is 12+35?", system_prompt=R1_SYSTEM_PROMPT)

With `chat=True` the tokenizer's chat template renders the conversation with the generation
prompt (the assistant turn's header) at the end; with `chat=False` the text is used raw, for base
models. The result is a string; tokenise it with `rljax.data.batching.tokenize_prompts`, whose
`add_special_tokens=False` default suits rendered chat templates (they already hold any BOS).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from rljax.data.batching import TokenizedPrompts, tokenize_prompts

# DeepSeek-R1-Zero's template (arXiv:2501.12948, table 1), used as a system prompt as in Open-R1.
R1_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves "
    "it. The assistant first thinks about the reasoning process in the mind and then provides the "
    "user with the answer. The reasoning process and answer are enclosed within <think> </think> "
    "and <answer> </answer> tags, respectively, i.e., <think> reasoning process here </think> "
    "<answer> answer here </answer>."
)

# A short instruction for the `answer` reward's tag, for tasks without a system prompt.
ANSWER_TAG_INSTRUCTION = "Give the final answer inside <answer> </answer> tags."

Messages = Sequence[Mapping[str, Any]]


FewShot = Sequence[Sequence[str]]  # (user text, assistant reply) pairs, oldest first


def _as_messages(prompt: str | Messages, system_prompt: str | None, few_shot: FewShot = ()) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = [dict(m) for m in prompt]
        for i, m in enumerate(messages):
            if "role" not in m or "content" not in m:
                raise ValueError(f"chat message {i} needs 'role' and 'content' keys, has {sorted(m)}")
        if not messages:
            raise ValueError("prompt is an empty list of messages")
    if system_prompt is not None:
        if messages[0]["role"] == "system":
            raise ValueError("the prompt already starts with a system message; "
                             "drop system_prompt or the message")
        messages.insert(0, {"role": "system", "content": system_prompt})
    # the worked examples come after any system message and before the conversation itself
    start = 1 if messages[0]["role"] == "system" else 0
    shots = [{"role": role, "content": text}
             for user, reply in _checked_few_shot(few_shot) for role, text in (("user", user), ("assistant", reply))]
    messages[start:start] = shots
    return messages


def _checked_few_shot(few_shot: FewShot) -> list[tuple[str, str]]:
    pairs = []
    for i, pair in enumerate(few_shot):
        if isinstance(pair, str) or len(pair) != 2 or not all(isinstance(t, str) for t in pair):
            raise ValueError(f"few_shot[{i}] must be a (user text, assistant reply) pair of strings, got {pair!r:.80}")
        pairs.append((pair[0], pair[1]))
    return pairs


def format_prompt(
    tokenizer: Any,
    prompt: str | Messages,
    *,
    system_prompt: str | None = None,
    chat: bool = True,
    assistant_prefix: str = "",
    few_shot: FewShot = (),
    **template_kwargs: Any,
) -> str:
    """The prompt text the policy continues.

    `prompt` is the user text or a list of chat messages (a dataset column already in message
    form). With `chat=True`: `tokenizer.apply_chat_template(messages, add_generation_prompt=True,
    tokenize=False, **template_kwargs)`, the system prompt (if any) first. With `chat=False`:
    the raw user text, after the system prompt and a blank line if one is given (messages are
    refused: they need a template). `assistant_prefix` is appended to the result, e.g. "<think>\\n"
    to start the reply inside the think block, or TinyZero's "Let me solve this step by step.\\n<think>".
    `few_shot`: worked examples shown before the prompt, `(user text, assistant reply)` pairs: with
    `chat=True` earlier user/assistant turns after the system prompt; with `chat=False` each pair as
    "user\\nreply" followed by a blank line. They teach a reply's shape (e.g. the answer tag) in context.
    """
    shots = _checked_few_shot(few_shot)
    if not chat:
        if not isinstance(prompt, str):
            raise ValueError("chat=False needs a string prompt; a list of messages needs chat=True")
        text = "".join(f"{user}\n{reply}\n\n" for user, reply in shots) + prompt
        text = text if system_prompt is None else f"{system_prompt}\n\n{text}"
        return text + assistant_prefix
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"{type(tokenizer).__name__} has no chat_template; use chat=False for raw prompts "
            "(base models) or set tokenizer.chat_template"
        )
    text = tokenizer.apply_chat_template(
        _as_messages(prompt, system_prompt, shots), add_generation_prompt=True, tokenize=False, **template_kwargs
    )
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
    return text + assistant_prefix


def format_prompts(
    tokenizer: Any,
    examples: Sequence[Mapping[str, Any]],
    *,
    prompt_key: str = "prompt",
    system_prompt: str | None = None,
    chat: bool = True,
    assistant_prefix: str = "",
    few_shot: FewShot = (),
    **template_kwargs: Any,
) -> list[str]:
    """`format_prompt` of `example[prompt_key]` for each example."""
    return [
        format_prompt(tokenizer, ex[prompt_key], system_prompt=system_prompt, chat=chat,
                      assistant_prefix=assistant_prefix, few_shot=few_shot, **template_kwargs)
        for ex in examples
    ]


@dataclasses.dataclass(frozen=True)
class PromptFormat:
    """How prompt text becomes prompt tokens.

    ``chat``: render with the tokenizer's chat template (``rljax.data.prompts.format_prompt``), else
    the raw text (the system prompt, if any, then a blank line). ``system_prompt``: "" = none.
    ``assistant_prefix``: text that starts every response (the prompt ends with it; rewards score
    prefix + completion). ``max_prompt_length``: tokens; a longer prompt raises (``too_long="error"``,
    naming it) or is dropped and counted (``"filter"``). ``add_special_tokens``: let the tokenizer add
    its special tokens (BOS) -- for raw prompts to base models (``rljax generate`` without ``--chat``);
    leave False for chat-templated text, which holds any BOS already. ``buckets``: the widths prompts
    are padded to (None: ``rljax.data.batching.default_buckets(max_prompt_length)``; one width pins
    every batch to it). ``few_shot``: ``(user text, assistant reply)`` pairs shown before every prompt
    (``rljax.data.prompts.format_prompt``).
    """

    chat: bool = True
    system_prompt: str = ""
    assistant_prefix: str = ""
    max_prompt_length: int = 128
    too_long: str = "error"
    add_special_tokens: bool = False
    buckets: tuple[int, ...] | None = None
    few_shot: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        if self.too_long not in ("error", "filter"):
            raise ValueError(f"PromptFormat.too_long must be 'error' or 'filter', got {self.too_long!r}")
        if self.max_prompt_length < 1:
            raise ValueError(f"PromptFormat.max_prompt_length must be positive, got {self.max_prompt_length}")

    @classmethod
    def from_data(cls, data: Any) -> "PromptFormat":
        """The format of a run's ``data`` section (``chat``, ``system_prompt``, ``assistant_prefix``,
        ``max_prompt_length``, ``too_long``, ``few_shot``)."""
        return cls(chat=data.chat, system_prompt=data.system_prompt or "", assistant_prefix=data.assistant_prefix,
                   max_prompt_length=data.max_prompt_length, too_long=data.too_long,
                   few_shot=tuple((shot.user, shot.reply) for shot in data.few_shot))


def render_prompt(tokenizer: Any, prompt: str | list[dict], fmt: PromptFormat) -> str:
    """The text ``prompt`` becomes under ``fmt`` (chat template, system prompt, assistant prefix):
    what :func:`encode_prompts` tokenises (with ``add_special_tokens=fmt.add_special_tokens``)."""
    return format_prompt(tokenizer, prompt, system_prompt=fmt.system_prompt or None, chat=fmt.chat,
                         assistant_prefix=fmt.assistant_prefix, few_shot=fmt.few_shot)


def encode_prompts(tokenizer: Any, prompts: Sequence[str | list[dict]], fmt: PromptFormat) -> TokenizedPrompts:
    """Format (``format_prompt``) and tokenise ``prompts``, left-padded to a bucket width
    (``rljax.data.batching.tokenize_prompts``): ``(input_ids, attention_mask, kept, dropped)``.

    A prompt over ``fmt.max_prompt_length`` tokens raises with ``too_long="error"`` (naming its
    index, its start and its length) and is dropped with ``"filter"`` (``kept`` indexes the rows
    into ``prompts``; ``dropped`` counts the others).
    """
    if isinstance(prompts, str):
        raise TypeError("prompts must be a sequence of prompts, got one str")
    texts = [render_prompt(tokenizer, p, fmt) for p in prompts]
    # filter first, then raise with the prompt itself (the formatted text starts with the template)
    tok = tokenize_prompts(tokenizer, texts, max_prompt_length=fmt.max_prompt_length, too_long="filter",
                           buckets=fmt.buckets, add_special_tokens=fmt.add_special_tokens)
    if tok.dropped and fmt.too_long == "error":
        i = sorted(set(range(len(texts))) - set(tok.kept.tolist()))[0]
        n = len(tokenizer(texts[i], add_special_tokens=fmt.add_special_tokens)["input_ids"])
        raise ValueError(f"prompt {i} ({_excerpt(prompts[i])}) is {n} tokens long once formatted, over "
                         f"max_prompt_length={fmt.max_prompt_length} (raise the limit, e.g. "
                         "data.max_prompt_length, or set too_long='filter' to drop such prompts)")
    return tok


def _excerpt(prompt: Any, limit: int = 60) -> str:
    text = prompt if isinstance(prompt, str) else " / ".join(str(m.get("content", "")) for m in prompt)
    return repr(text if len(text) <= limit else text[:limit] + "...")
