"""Prompt text from a dataset row: chat-template application and standard system prompts.

    text = format_prompt(tokenizer, "What is 12+35?", system_prompt=R1_SYSTEM_PROMPT)

With `chat=True` the tokenizer's chat template renders the conversation with the generation
prompt (the assistant turn's header) at the end; with `chat=False` the text is used raw, for base
models. The result is a string; tokenise it with `rljax.data.batching.tokenize_prompts`, whose
`add_special_tokens=False` default suits rendered chat templates (they already hold any BOS).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

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
