"""Tools an agent calls: Python callables with a JSON-schema signature, and the tool-call format.

    @tool
    def calculator(expression: str) -> str:
        '''Evaluate an arithmetic expression.

        expression: digits, + - * / ( ) and spaces, e.g. "123*45".
        '''

    calculator.schema      # {"type": "function", "function": {"name": "calculator", "description": ...,
                           #  "parameters": {"type": "object", "properties": {"expression": {...}}, ...}}}
    calls, errors = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>')

The schema is the one ``tokenizer.apply_chat_template(messages, tools=[...])`` takes (the OpenAI /
Hugging Face "function" form), derived from the signature (annotations -> JSON types, parameters
without a default are required) and the docstring (its first paragraph is the description; lines
``name: text`` describe the parameters), or given explicitly (``Tool(fn, schema=...)``).

The call format is the Hermes one that Qwen2.5's and Hermes' chat templates define (Llama 3.1's
JSON tool calls parse too: ``"parameters"`` is read as ``"arguments"``)::

    <tool_call>{"name": "calculator", "arguments": {"expression": "123*45"}}</tool_call>

A chat template that renders tools gets the schemas through ``apply_chat_template(..., tools=...)``
(``ToolEnvironment(native_tools=True)``, which ``rljax.environments.base.environment_factory`` picks
when the run's tokenizer has such a template). The same form is rljax's documented fallback for chat
templates without tool support (SmolLM2's):
:func:`tool_system_prompt` lists the schemas in the system message and asks for this form, and tool
results come back as messages with role ``"tool"`` (a ChatML template renders any role). A call
that does not parse is not an exception: :func:`parse_tool_calls` returns it as an error text
("could not parse ...") that the environment shows the model.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import typing
from typing import Any, Callable, Mapping

from rljax.environments.base import Environment

__all__ = ["Tool", "ToolCall", "ToolEnvironment", "ToolError", "parse_tool_calls", "run_tool_call", "tool",
           "tool_system_prompt"]

TOOL_CALL_PATTERN = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN_TAG = "<tool_call>"

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


class ToolError(Exception):
    """Raised by a tool for a bad request: its message is the tool result the model sees (counted as a
    tool error, not an environment failure)."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]


def _json_type(annotation: Any) -> dict[str, Any]:
    origin = typing.get_origin(annotation)
    if origin is typing.Union:  # Optional[X] -> X's type
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _json_type(args[0]) if len(args) == 1 else {}
    base = origin or annotation
    return {"type": _JSON_TYPES[base]} if base in _JSON_TYPES else {}


def _docstring_parts(fn: Callable) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) from the docstring: the first paragraph, and lines
    ``name: text`` (Google-style ``Args:`` sections included)."""
    doc = inspect.getdoc(fn) or ""
    paragraphs = doc.split("\n\n")
    description = " ".join(paragraphs[0].split()) if paragraphs else ""
    params = {}
    for line in doc.splitlines()[1:]:
        m = re.match(r"\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.+)", line)
        if m:
            params[m.group(1)] = m.group(2).strip()
    return description, params


def _schema_of(fn: Callable, name: str, description: str | None) -> dict[str, Any]:
    doc_description, doc_params = _docstring_parts(fn)
    properties, required = {}, []
    try:  # resolves string annotations (``from __future__ import annotations``)
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = {}
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        prop = _json_type(hints[p.name]) if p.name in hints else {}
        if p.name in doc_params:
            prop["description"] = doc_params[p.name]
        properties[p.name] = prop
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    return {"type": "function", "function": {
        "name": name, "description": description if description is not None else doc_description,
        "parameters": {"type": "object", "properties": properties, "required": required}}}


class Tool:
    """A callable the model may call by name, with its JSON schema (``schema``).

    ``Tool(fn)`` derives the schema from ``fn``'s signature and docstring; ``schema=`` gives it
    explicitly (either the full ``{"type": "function", "function": {...}}`` or just the inner
    ``{"name", "description", "parameters"}``). ``name`` defaults to ``fn.__name__``. Calling the
    tool with the arguments of a :class:`ToolCall` returns its result as text.
    """

    def __init__(self, fn: Callable[..., Any], *, name: str | None = None, description: str | None = None,
                 schema: Mapping[str, Any] | None = None):
        self.fn = fn
        if schema is not None:
            inner = dict(schema.get("function", schema))
            if "name" not in inner:
                raise ValueError(f"tool schema needs a 'name', got keys {sorted(inner)}")
            self.schema = {"type": "function", "function": inner}
        else:
            self.schema = _schema_of(fn, name or fn.__name__, description)
        self.name = self.schema["function"]["name"]

    @property
    def required(self) -> list[str]:
        return list(self.schema["function"].get("parameters", {}).get("required", []))

    def __call__(self, **arguments: Any) -> str:
        result = self.fn(**arguments)
        return result if isinstance(result, str) else json.dumps(result)

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"


def tool(fn: Callable | None = None, *, name: str | None = None, description: str | None = None):
    """Decorator: ``@tool`` or ``@tool(name=...)`` makes a :class:`Tool` of a function."""
    if fn is None:
        return lambda f: Tool(f, name=name, description=description)
    return Tool(fn, name=name, description=description)


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """The tool calls in an assistant message, and an error text for each one that did not parse.

    Every ``<tool_call>...</tool_call>`` span holds one JSON object ``{"name": str, "arguments":
    object}`` (``"parameters"`` is accepted for ``"arguments"``, as Llama 3.1 writes it; a JSON string
    of an object is decoded, as some models write ``"arguments": "{...}"``). An opening tag without
    its closing one is an error too. Errors read "could not parse tool call ...: <why>".
    """
    calls: list[ToolCall] = []
    errors: list[str] = []
    for m in TOOL_CALL_PATTERN.finditer(text):
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            errors.append(f"could not parse tool call {_excerpt(body)}: invalid JSON ({exc.msg} at position {exc.pos})")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            errors.append(f"could not parse tool call {_excerpt(body)}: expected an object with a string \"name\"")
            continue
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            errors.append(f"could not parse tool call {_excerpt(body)}: \"arguments\" must be an object")
            continue
        calls.append(ToolCall(obj["name"], arguments))
    unclosed = text.count(_OPEN_TAG) - len(TOOL_CALL_PATTERN.findall(text))
    if unclosed > 0:
        tail = text[text.rfind(_OPEN_TAG):]
        errors.append(f"could not parse tool call {_excerpt(tail)}: no closing </tool_call>")
    return calls, errors


def _excerpt(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def tool_system_prompt(tools: list[Tool], instructions: str = "") -> str:
    """The fallback system message (for chat templates without tool support): ``instructions``, the
    tools' JSON schemas, and the call format."""
    listing = "\n".join(json.dumps(t.schema) for t in tools)
    head = f"{instructions}\n\n" if instructions else ""
    return (f"{head}You may call these tools:\n<tools>\n{listing}\n</tools>\n"
            "To call a tool, reply with exactly <tool_call>{\"name\": <tool name>, \"arguments\": "
            "<arguments object>}</tool_call> and end your turn; the result comes back in a message from the tool.")


def run_tool_call(call: ToolCall, tools: Mapping[str, Tool]) -> tuple[str, bool]:
    """``(result text, ok)`` of one call: an unknown tool, bad arguments or an exception raised by
    the tool become an error text for the model (``ok`` False), never an exception here."""
    if call.name not in tools:
        return f"error: unknown tool {call.name!r}; tools: {', '.join(sorted(tools))}", False
    t = tools[call.name]
    missing = [p for p in t.required if p not in call.arguments]
    if missing:
        return f"error: {call.name} needs the arguments {missing}", False
    try:
        return t(**call.arguments), True
    except ToolError as exc:
        return f"error: {exc}", False
    except TypeError as exc:  # unexpected keyword arguments and the like
        return f"error: bad arguments for {call.name}: {exc}", False
    except Exception as exc:  # a tool's own bug is the model's observation, not the run's crash
        return f"error: {call.name} failed: {type(exc).__name__}: {exc}", False


class ToolEnvironment(Environment):
    """An environment whose assistant turns either call tools or give a final answer.

    A message with tool calls (or unparsable ones) gets one ``"tool"`` message per call (or per
    parse error, "could not parse ..."), reward 0, and the episode goes on; a message without any
    ends the episode and is scored by :meth:`score`. Subclasses implement :meth:`opening` and
    :meth:`score`; ``tools`` are the callables offered. ``native_tools=True`` leaves the schemas to
    the chat template (``info["tools"]``) instead of listing them in the system message.
    """

    def __init__(self, tools: list[Tool], *, native_tools: bool = False):
        self.tools = {t.name: t for t in tools}
        self.native_tools = native_tools

    def opening(self, seed: int | None, options: Mapping[str, Any]) -> tuple[str, str, dict]:
        """``(system instructions, user text, info)`` of a new episode."""
        raise NotImplementedError

    def score(self, answer: str) -> tuple[float, bool]:
        """``(reward, success)`` of the final message."""
        raise NotImplementedError

    def reset(self, seed=None, options=None):
        instructions, user, info = self.opening(seed, dict(options or {}))
        tools = list(self.tools.values())
        system = instructions if self.native_tools else tool_system_prompt(tools, instructions)
        info = dict(info)
        if self.native_tools:
            info["tools"] = [t.schema for t in tools]
        return [{"role": "system", "content": system}, {"role": "user", "content": user}], info

    def step(self, action: str):
        calls, errors = parse_tool_calls(action)
        if not calls and not errors:
            reward, success = self.score(action)
            return [], float(reward), True, False, {"success": bool(success)}
        replies, failed = [], 0
        for call in calls:
            text, ok = run_tool_call(call, self.tools)
            failed += not ok
            replies.append({"role": "tool", "content": text})
        replies += [{"role": "tool", "content": f"error: {e}"} for e in errors]
        info = {"tool_calls": [c.name for c in calls], "tool_errors": failed, "parse_failures": len(errors)}
        return replies, 0.0, False, False, info
