"""Chat transcripts for supervised fine-tuning: loading, and tokens with an assistant-only loss mask.

    rows, counts = load_transcripts("demos.jsonl")                   # a `messages` column, or
    rows, counts = load_transcripts("pairs.parquet", messages_column="")  # prompt / completion columns
    data, dropped = encode_transcripts(rows, tokenizer, max_prompt_length=256, ...)

A transcript row is ``{"messages": [{role, content}, ...], "key": str}``: system / user / assistant /
tool turns in order, at least one assistant turn with text. ``key`` identifies the conversation's
opening (the messages before the first assistant turn; ``rljax.data.preferences.prompt_key``) so a
held-out split never shares an opening with the train split. Sources are those of
``rljax.data.loading.read_rows`` (JSONL, JSON, parquet, a ``datasets`` name or object, rows in memory).
A row without a messages column is built from ``prompt`` (a string or messages) and ``completion``
(a string, or the assistant's message list).

**The loss mask** comes from rendering the chat template turn by turn (:func:`assistant_pieces`):
for assistant message ``i``, the text the template renders for ``messages[:i]`` with the generation
prompt (the assistant header) is a prefix of the text for ``messages[:i + 1]``; what lies between
is that assistant turn (its content and end-of-turn marker, trailing whitespace excluded: the model
stops at the marker and never writes the newline after it). Each piece is tokenised on its own, so
an assistant turn's tokens are exactly those the policy would generate after the rendered context
(as the sampler tokenises a prompt and then generates). A template that is not prefix-stable (one
that rewrites earlier turns) is refused with the turn named.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Mapping, Sequence

import numpy as np

from rljax.data.encoded import EncodedSet
from rljax.data.loading import read_rows
from rljax.data.preferences import _DROP_HINT, InvalidRowError, _Bad, _check_policy, _handle, prompt_key
from rljax.errors import UserError

ROLES = ("system", "user", "assistant", "tool")

__all__ = ["ROLES", "InvalidRowError", "assistant_pieces", "assistant_token_counts", "encode_transcripts", "load_transcripts",
           "transcript_tokens", "transcripts_from_task"]


def _checked_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise _Bad("malformed_messages",
                   f"messages must be a non-empty list of {{role, content}}, got {messages!r:.80}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise _Bad("malformed_messages", f"message {i} is not a {{role: <str>, content: <str>}} mapping: {m!r:.80}")
        if m["role"] not in ROLES:
            raise _Bad("malformed_messages", f"message {i} has role {m['role']!r}; expected one of {ROLES}")
        out.append({"role": m["role"], "content": m["content"]})
    assistant = [i for i, m in enumerate(out) if m["role"] == "assistant"]
    if not assistant:
        raise _Bad("no_assistant_turn", "the transcript has no assistant message: nothing to learn")
    if assistant[0] == 0:
        raise _Bad("malformed_messages", "the transcript starts with an assistant message; it needs a turn before it")
    if any(not out[i]["content"].strip() for i in assistant):
        raise _Bad("empty_response", "an assistant message is empty")
    return out


def _from_prompt_completion(prompt: Any, completion: Any) -> list[dict[str, str]]:
    if prompt is None or completion is None:
        raise _Bad("missing_column", "the prompt or completion is null")
    head = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    tail = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else list(completion)
    return _checked_messages(head + tail)


def _opening_key(messages: Sequence[Mapping[str, str]]) -> str:
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return prompt_key(list(messages[:first]))


def load_transcripts(
    source: Any,
    *,
    messages_column: str = "messages",
    prompt_column: str = "prompt",
    completion_column: str = "completion",
    invalid: str = "error",
    split: str = "train",
    name: str | None = None,
    limit: int | None = None,
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Transcript rows from ``source``; returns ``(rows, counts)`` (``rows``, ``kept``,
    ``dropped/<reason>``: ``missing_column``, ``malformed_messages``, ``no_assistant_turn``,
    ``empty_response``).

    Rows are read from ``messages_column`` when any row has it (set it to ``""`` to use the other
    form), else from ``prompt_column`` + ``completion_column``. A bad row raises ``InvalidRowError``
    naming it (``invalid="error"``) or is dropped and counted (``invalid="drop"``).
    """
    _check_policy(invalid)
    rows = read_rows(source, split=split, name=name)
    if limit is not None:
        rows = rows[:limit]
    use_messages = bool(messages_column) and any(messages_column in r for r in rows)
    if rows and not use_messages and not any(prompt_column in r and completion_column in r for r in rows):
        raise InvalidRowError(
            f"no row of {source!r:.80} has a {messages_column!r} column or both {prompt_column!r} and "
            f"{completion_column!r}; columns: {', '.join(map(repr, sorted(rows[0])))}")
    counts: Counter = Counter(rows=len(rows))
    out = []
    for i, row in enumerate(rows):
        try:
            if use_messages:
                if row.get(messages_column) is None:
                    raise _Bad("missing_column", f"column {messages_column!r} is missing or null")
                messages = _checked_messages(row[messages_column])
            else:
                messages = _from_prompt_completion(row.get(prompt_column), row.get(completion_column))
            out.append({"messages": messages, "key": _opening_key(messages)})
        except _Bad as bad:
            _handle(bad, i, invalid, counts, _DROP_HINT)
    counts["kept"] = len(out)
    return out, dict(counts)


def transcripts_from_task(examples: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One single-turn transcript per task example: the prompt, then the gold answer in
    ``<answer>`` tags (the form the ``answer`` reward reads)."""
    rows = []
    for ex in examples:
        head = [{"role": "user", "content": ex["prompt"]}] if isinstance(ex["prompt"], str) else list(ex["prompt"])
        messages = head + [{"role": "assistant", "content": f"<answer>{ex['answer']}</answer>"}]
        rows.append({"messages": messages, "key": _opening_key(messages), "answer": str(ex["answer"])})
    return rows


def _render(tokenizer, messages, *, generation_prompt: bool, template_kwargs: Mapping[str, Any]) -> str:
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt,
                                         **template_kwargs)
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
    return text


def assistant_pieces(tokenizer, messages: Sequence[Mapping[str, str]], **template_kwargs: Any) -> list[tuple[str, bool]]:
    """The rendered transcript as ``(text, is_assistant)`` pieces, in order, ending with the last
    assistant turn (what follows it carries no loss and is left out).

    Assistant pieces are the spans the template renders for each assistant message (module
    docstring); the pieces joined are a prefix of ``apply_chat_template(messages, tokenize=False)``.
    Raises ``ValueError`` when the template has none, or renders an earlier turn differently once a
    later one is added.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"{type(tokenizer).__name__} has no chat_template; SFT on messages needs one "
                         "(set tokenizer.chat_template, or use prompt/completion strings with data.chat: false)")
    full = _render(tokenizer, messages, generation_prompt=False, template_kwargs=template_kwargs)
    pieces: list[tuple[str, bool]] = []
    pos = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], generation_prompt=True, template_kwargs=template_kwargs)
        through = _render(tokenizer, messages[: i + 1], generation_prompt=False, template_kwargs=template_kwargs)
        if not (through.startswith(before) and full.startswith(through)) or len(before) < pos:
            raise ValueError(f"the chat template is not prefix-stable at assistant message {i}: rendering the "
                             "turns before it (with the generation prompt) is not a prefix of rendering the "
                             "whole transcript, so its tokens cannot be located")
        end = len(through.rstrip())  # the newline after the end-of-turn marker is the template's, not the model's
        if end <= len(before):
            raise ValueError(f"assistant message {i} renders to no text")
        pieces += [(full[pos:len(before)], False), (full[len(before):end], True)]
        pos = end
    return [p for p in pieces if p[0]]


def transcript_tokens(tokenizer, messages: Sequence[Mapping[str, str]], *, chat: bool = True,
                      append_eos: bool = True, **template_kwargs: Any) -> tuple[list[int], list[int]]:
    """Token ids of a transcript and its loss mask (1 on assistant tokens), both ``[L]``.

    ``chat=True``: :func:`assistant_pieces`, each piece tokenised on its own. ``chat=False`` (base
    models, no template): a single ``[system,] user, assistant`` exchange as raw text -- the system
    text and a blank line, the user text, then the assistant text (and EOS with ``append_eos``) masked.
    """
    if chat:
        pieces = assistant_pieces(tokenizer, messages, **template_kwargs)
        eos = []
    else:
        roles = [m["role"] for m in messages]
        if roles not in (["user", "assistant"], ["system", "user", "assistant"]):
            raise ValueError(f"data.chat: false takes one [system,] user, assistant exchange, got roles {roles}")
        *head, reply = messages
        text = "\n\n".join(m["content"] for m in head)
        pieces = [(text, False), (reply["content"], True)]
        eos = [tokenizer.eos_token_id] if append_eos and tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    mask: list[int] = []
    for text, is_assistant in pieces:
        toks = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids += toks
        mask += [int(is_assistant)] * len(toks)
    return ids + eos, mask + [1] * len(eos)


def encode_transcripts(rows: list[dict], tokenizer, *, system_prompt: str = "", chat: bool = True,
                       append_eos: bool = True, max_prompt_length: int, prompt_too_long: str,
                       max_completion_length: int, completion_too_long: str,
                       split: str) -> tuple[EncodedSet, dict[str, int]]:
    """Tokenise transcript rows once into an ``EncodedSet`` (``kind="transcripts"``).

    Row ``i``'s prompt is the tokens before its first assistant token (left-padded in a batch); its
    one completion is every token from there to the end of the last assistant turn, with
    ``loss_masks[i][0]`` marking the assistant tokens. ``system_prompt`` is inserted as the first
    message of transcripts that have none. A prompt over ``max_prompt_length`` raises or is dropped
    (``prompt_too_long``: ``"error"`` / ``"filter"``); a completion over ``max_completion_length``
    raises, is dropped or is cut (``completion_too_long``: ``"error"`` / ``"filter"`` / ``"truncate"``;
    a cut keeps at least the first assistant token). Returns the set and dropped counts by reason.
    """
    kept, prompts, completions, masks = [], [], [], []
    dropped = {"prompt_too_long": 0, "response_too_long": 0}
    for i, row in enumerate(rows):
        messages = list(row["messages"])
        if system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system_prompt})
        ids, mask = transcript_tokens(tokenizer, messages, chat=chat, append_eos=append_eos)
        start = mask.index(1) if 1 in mask else len(mask)
        if start == 0 or start == len(mask):
            raise ValueError(f"{split} row {i}: the transcript has no context before its first assistant token "
                             "or no assistant token")
        prompt, completion, loss_mask = ids[:start], ids[start:], mask[start:]
        if len(prompt) > max_prompt_length:
            if prompt_too_long == "error":
                raise ValueError(f"{split} row {i}: the turns before the first assistant reply are {len(prompt)} "
                                 f"tokens, over data.max_prompt_length={max_prompt_length} (raise it, or set "
                                 "data.too_long=filter to drop such rows)")
            dropped["prompt_too_long"] += 1
            continue
        if len(completion) > max_completion_length:
            if completion_too_long == "error":
                raise UserError(f"{split} row {i}: the transcript from the first assistant reply on is "
                                 f"{len(completion)} tokens, over algorithm.max_completion_length="
                                 f"{max_completion_length} (raise it, or set algorithm.completion_too_long "
                                 "to filter or truncate)")
            if completion_too_long == "filter":
                dropped["response_too_long"] += 1
                continue
            completion, loss_mask = completion[:max_completion_length], loss_mask[:max_completion_length]
        kept.append(row)
        prompts.append(prompt)
        completions.append([completion])
        masks.append([loss_mask])
    data = EncodedSet(kept, prompts, completions, {}, loss_masks=masks)
    return data, {k: v for k, v in dropped.items() if v}


def assistant_token_counts(data: EncodedSet) -> np.ndarray:
    """``[n]`` number of loss (assistant) tokens of each row of an encoded transcript set."""
    return np.asarray([sum(m[0]) for m in data.loss_masks or []], np.float32)
