"""The OpenAI wire format of ``rljax serve``: request bodies, chat messages into the chat template,
completions into response bodies (stop strings, Hermes-style tool calls, log-probs).

Pure functions of a tokenizer and the engine's outputs, so they are tested without a server.
"""

from __future__ import annotations

import json
import types
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rljax.environments.base import template_renders_tools
from rljax.environments.tools import parse_tool_calls, tool_system_prompt


class _Body(BaseModel):
    # unknown fields (user, metadata, parallel_tool_calls, ...) are accepted and ignored, as OpenAI-compatible
    # servers do; a known field of the wrong type or out of range is a 400 naming it
    model_config = ConfigDict(extra="allow")


class _Sampling(_Body):
    model: str
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str | dict = "{}"


class ToolCallIn(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class FunctionSpec(_Body):
    name: str
    description: str | None = None
    parameters: dict | None = None


class ToolSpec(_Body):
    type: Literal["function"]
    function: FunctionSpec


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: dict


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None


class BadRequest(Exception):
    """A request the server refuses: HTTP ``status`` with an OpenAI-style error naming ``param``."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def check_unsupported(req: _Sampling) -> None:
    """Refuse settings the engine cannot honour rather than ignore them."""
    for field in ("presence_penalty", "frequency_penalty"):
        if getattr(req, field):
            raise BadRequest(f"{field} is not supported by rljax serve (only 0)", field)
    if req.logit_bias:
        raise BadRequest("logit_bias is not supported by rljax serve", "logit_bias")
    if isinstance(req, ChatRequest) and req.top_logprobs and not req.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise BadRequest("echo is not supported by rljax serve", "echo")
        if req.suffix:
            raise BadRequest("suffix is not supported by rljax serve", "suffix")


def stop_strings(stop: str | list[str] | None) -> list[str]:
    """The request's stop strings (up to 4, as OpenAI allows), none empty."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise BadRequest("stop: up to 4 non-empty strings", "stop")
    return stops


# ---------------------------------------------------------------------------------------------- prompts
def _text(content: str | list[TextPart] | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _arguments(raw: str | dict, where: str) -> dict:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw or "{}")
    except json.JSONDecodeError as e:
        raise BadRequest(f"{where}: arguments must be a JSON object ({e.msg})", where) from None
    if not isinstance(value, dict):
        raise BadRequest(f"{where}: arguments must be a JSON object", where)
    return value


def active_tools(req: ChatRequest) -> list[dict]:
    """The tool schemas shown to the model: none for ``tool_choice: "none"``, only the named one for a
    named choice, all of them otherwise ("required" is not enforced: the sampler is not constrained)."""
    if not req.tools or req.tool_choice == "none":
        return []
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    if isinstance(req.tool_choice, NamedToolChoice):
        name = req.tool_choice.function.get("name")
        tools = [t for t in tools if t["function"]["name"] == name]
        if not tools:
            raise BadRequest(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    return tools


def chat_prompt(tokenizer: Any, req: ChatRequest) -> tuple[str, list[dict]]:
    """The prompt text of ``req.messages`` through the tokenizer's chat template (with the generation
    prompt), and the tools shown. A template that renders tools gets them with ``tools=``; otherwise
    they are listed in the system message (:func:`rljax.environments.tools.tool_system_prompt`) and
    earlier assistant tool calls are written back as ``<tool_call>`` blocks, the form the model emits."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise BadRequest("this model's tokenizer has no chat template: use /v1/completions", "messages")
    tools = active_tools(req)
    native = template_renders_tools(tokenizer)
    messages = []
    for i, m in enumerate(req.messages):
        out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _text(m.content)}
        if m.name:
            out["name"] = m.name
        if m.tool_call_id:
            out["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = [{"name": c.function.name,
                      "arguments": _arguments(c.function.arguments, f"messages[{i}].tool_calls[{j}].function")}
                     for j, c in enumerate(m.tool_calls)]
            if native:
                out["tool_calls"] = [{"type": "function", "function": c} for c in calls]
            else:
                out["content"] += "".join(f"<tool_call>{json.dumps(c)}</tool_call>" for c in calls)
        messages.append(out)
    kwargs: dict[str, Any] = {}
    if tools and native:
        kwargs["tools"] = tools
    elif tools:
        listed = [types.SimpleNamespace(schema=t) for t in tools]
        if messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": tool_system_prompt(listed, messages[0]["content"])}
        else:
            messages.insert(0, {"role": "system", "content": tool_system_prompt(listed)})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return text, tools


# ---------------------------------------------------------------------------------------------- outputs
class Decoder:
    """Token ids to text for one tokenizer: the completion's text leaves out a final stop token and
    special tokens; a stop string cuts the text before it and the ids after the token that completed it."""

    def __init__(self, tokenizer: Any, stop_token_ids: tuple[int, ...]):
        self.tokenizer, self.stop_token_ids = tokenizer, set(stop_token_ids)

    def text(self, ids: list[int]) -> str:
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token(self, i: int) -> str:
        return self.tokenizer.decode([i], skip_special_tokens=False)

    def cut(self, ids: list[int], stops: list[str]) -> tuple[str, int, bool]:
        """``(text, kept tokens, stopped)``: with a stop string in the text, the text before its first
        occurrence and the fewest leading tokens whose text holds it (the sampled tokens, for training)."""
        text = self.text(ids)
        hits = [text.find(s) for s in stops if s in text]
        if not hits:
            return text, len(ids), False
        at = min(hits)
        lo, hi = 1, len(ids)  # the fewest tokens whose text holds a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in self.text(ids[:mid]) for s in stops):
                hi = mid
            else:
                lo = mid + 1
        return text[:at], lo, True

    def holds_stop(self, ids: list[int], stops: list[str]) -> bool:
        text = self.text(ids)
        return any(s in text for s in stops)


def finish_reason(engine_reason: str, stopped_by_string: bool) -> str:
    if stopped_by_string:
        return "stop"
    return {"stop": "stop", "length": "length"}.get(engine_reason, engine_reason)


def tool_message(text: str, tools: list[dict]) -> tuple[dict, list[str]]:
    """The assistant message of a completion: with tools shown and ``<tool_call>`` blocks that parse,
    ``content`` is the text before the first block (None if empty) and ``tool_calls`` the calls in the
    OpenAI format; otherwise the text. Also the parse errors (a block that did not parse stays in the
    content)."""
    if not tools or "<tool_call>" not in text:
        return {"role": "assistant", "content": text}, []
    calls, errors = parse_tool_calls(text)
    if not calls:
        return {"role": "assistant", "content": text}, errors
    before = text[:text.find("<tool_call>")].strip()
    return {"role": "assistant", "content": before or None,
            "tool_calls": [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                            "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                           for c in calls]}, errors


def chat_logprobs(decoder: Decoder, ids: list[int], logprobs: list[float], top: list | None = None) -> dict:
    """``choice.logprobs`` of a chat completion: one entry per sampled token (the stop token too), its
    log-prob under the request's temperature, and its ``top_logprobs`` (the engine's per-token ``(id,
    log-prob)`` pairs, most likely first; an empty list when none were asked for)."""
    content = []
    for n, (i, lp) in enumerate(zip(ids, logprobs)):
        alternatives = [_token_logprob(decoder, j, a) for j, a in (top[n] if top and n < len(top) else [])]
        content.append({**_token_logprob(decoder, i, lp), "top_logprobs": alternatives})
    return {"content": content}


def _token_logprob(decoder: Decoder, token_id: int, logprob: float) -> dict:
    tok = decoder.token(token_id)
    return {"token": tok, "logprob": logprob, "bytes": list(tok.encode("utf-8"))}


def completion_logprobs(decoder: Decoder, ids: list[int], logprobs: list[float], top: list | None = None) -> dict:
    """``choice.logprobs`` of a text completion: tokens, their log-probs and offsets, and per token a
    ``{token: log-prob}`` of the ``logprobs: N`` likeliest (``{}`` when N is 0). Two ids whose text is
    the same (e.g. two byte tokens that each decode to U+FFFD) share one key, which keeps the likelier
    log-prob, so a dict can hold fewer than N entries."""
    tokens = [decoder.token(i) for i in ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    alternatives = []
    for n in range(len(tokens)):
        alternative: dict[str, float] = {}
        for j, a in (top[n] if top and n < len(top) else []):  # likeliest first
            alternative.setdefault(decoder.token(j), a)
        alternatives.append(alternative)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": alternatives,
            "text_offset": offsets}


def usage(prompt_ids: list[int], choices_ids: list[list[int]]) -> dict:
    completion = sum(len(c) for c in choices_ids)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion}
