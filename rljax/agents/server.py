"""The policy behind an OpenAI-compatible endpoint on 127.0.0.1, each episode's calls recorded apart.

    server = AgentServer(engine, tokenizer, stop_token_ids=(2,))     # uvicorn in a thread, a free port
    episode = server.open_episode(seed=7, temperature=1.0, max_tokens=64)
    client = openai.OpenAI(base_url=server.base_url(episode), api_key="rljax")
    ...                                                              # the agent's calls
    calls = server.close_episode(episode)                            # its CallRecords, in the order they began
    server.set_weights(policy_states(policy), version=step)          # between two engine steps

Episode ``E``'s client talks to ``http://127.0.0.1:PORT/episodes/E/v1``: the router in front of
``rljax.serve.Server`` strips the prefix, tags the request body with the episode (the record then
names it) and fills in the episode's sampling settings: ``temperature`` and ``top_p`` when the call
gives none (a training episode refuses another temperature with HTTP 400: the trainer's log-probs are
taken at the run's), ``max_tokens`` capped at the episode's, a ``seed`` per call (``seed + 1009 × the
call's number``) when the call gives none, so a deterministic agent samples the same tokens again.
The ``model`` a call names is ignored: every call goes to the policy.

Calls of one episode keep their sampled ids: a chat prompt whose text starts with the text of an
earlier call's prompt + completion in the episode (:func:`replayed_sequences`: how a chat template
renders the reply sent back) is encoded as those ids + the rest's (as ``rljax.environments.episodes``
appends an environment's reply), so an agent that sends the model's replies back joins them into one
sequence (``rljax.agents.trajectory``) even where re-encoding the text would not give the sampled ids
(bytes of an unfinished character, special tokens left out of the text, tool calls written back in
another layout, another split of the same text).
"""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
import uuid
from typing import Any

import uvicorn

from rljax.serve import CallRecord, Server
from rljax.serve.protocol import BadRequest

__all__ = ["AgentServer", "EPISODE_FIELD", "encode_with_history", "replayed_sequences"]

EPISODE_FIELD = "rljax_episode"  # the request body's field naming the episode (set by the router)
_MAX_BODY = 4 << 20


@dataclasses.dataclass
class _Episode:
    seed: int
    temperature: float | None  # default temperature; with `strict`, the only one allowed
    top_p: float | None
    max_tokens: int | None
    strict: bool
    calls: list = dataclasses.field(default_factory=list)  # CallRecords, in the order they began
    started: int = 0  # calls begun (numbers the seeds and orders the records)
    in_flight: int = 0
    sequences: list = dataclasses.field(default_factory=list)  # (text, ids) of prompt + completion per choice


class AgentServer:
    """``rljax.serve.Server`` over ``engine`` on 127.0.0.1 (uvicorn in a daemon thread, a free port),
    with per-episode routes (see the module docstring). ``close()`` stops it."""

    def __init__(self, engine, tokenizer, *, stop_token_ids: tuple[int, ...] | None = None, model_id: str = "policy",
                 start_timeout: float = 60.0):
        self.tokenizer = tokenizer
        self.server = Server(engine, tokenizer, model_id=model_id, on_call=self._on_call,
                             stop_token_ids=stop_token_ids, encode_chat=self._encode_chat)
        self._episodes: dict[str, _Episode] = {}
        self._lock = threading.Condition()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        # log_config=None: uvicorn's own logging.config.dictConfig would close every handler the process
        # has (the trainer's, pytest's capture), so the server logs through the process's configuration
        self._http = uvicorn.Server(uvicorn.Config(_Router(self), host="127.0.0.1", port=self.port, log_config=None,
                                                   log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._http.run, kwargs={"sockets": [sock]}, name="rljax-agent-server",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout
        while not self._http.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the agent server (uvicorn on 127.0.0.1) did not start")
            time.sleep(0.01)

    @property
    def policy_version(self) -> int:
        return self.server.policy_version

    def set_weights(self, states, version: int | None = None) -> None:
        """Serve ``states`` from the next engine step on, as policy ``version`` (default: one more)."""
        self.server.set_weights(states, version=version)

    def base_url(self, episode: str) -> str:
        return f"http://127.0.0.1:{self.port}/episodes/{episode}/v1"

    def open_episode(self, *, seed: int, temperature: float | None = None, top_p: float | None = None,
                     max_tokens: int | None = None, strict: bool = False) -> str:
        """A new episode's id. ``strict``: a call with a temperature other than ``temperature`` gets 400."""
        episode = uuid.uuid4().hex[:16]
        with self._lock:
            self._episodes[episode] = _Episode(int(seed), temperature, top_p, max_tokens, strict)
        return episode

    def close_episode(self, episode: str, timeout: float = 60.0) -> list[CallRecord]:
        """End an episode once its calls in flight are done (a call whose client went away still
        finishes on the server); its records in the order the calls began. Later calls get 404."""
        deadline = time.monotonic() + timeout
        with self._lock:
            state = self._episodes[episode]
            while state.in_flight and self._lock.wait(timeout=max(deadline - time.monotonic(), 0)):
                pass
            del self._episodes[episode]
            return [record for _, record in sorted(state.calls, key=lambda c: c[0])]

    def close(self) -> None:
        self._http.should_exit = True
        self._thread.join(timeout=30)
        self.server.close()

    # ------------------------------------------------------------------ on the server's event loop
    def _on_call(self, record: CallRecord) -> None:
        tag = record.request.get(EPISODE_FIELD)
        with self._lock:
            state = self._episodes.get(tag[0]) if isinstance(tag, list) else None
            if state is None:
                return
            state.calls.append((tag[1], record))
            state.sequences += self._sequences(record)

    def _sequences(self, record: CallRecord) -> list[tuple[str, list[int]]]:
        return replayed_sequences(self.tokenizer, self.server.stop_token_ids, record)

    def _encode_chat(self, text: str, request) -> list[int]:
        tag = (request.model_extra or {}).get(EPISODE_FIELD)
        with self._lock:
            state = self._episodes.get(tag[0]) if isinstance(tag, list) else None
            sequences = list(state.sequences) if state is not None else []
        return encode_with_history(self.tokenizer, text, sequences)

    def _begin(self, episode: str, body: Any) -> tuple[Any, str | None]:
        """``(body with the episode's settings, "")``, ``(None, message)`` for a 400 on ``temperature``,
        ``(None, None)`` for an episode that is not open."""
        with self._lock:
            state = self._episodes.get(episode)
            if state is None:
                return None, None
            if not isinstance(body, dict):
                return body, ""  # the server answers a malformed body itself
            number = state.started
            temperature = body.get("temperature")
            if temperature is None:
                temperature = state.temperature
            elif state.strict and state.temperature is not None and temperature != state.temperature:
                return None, (f"temperature: this episode trains the policy at sampling.temperature={state.temperature} "
                        f"(the trainer's log-probs are taken at it), but the call asks for {temperature}; leave "
                        "temperature out or set sampling.temperature")
            state.started += 1
            state.in_flight += 1
        body = dict(body, model=self.server.model_id)
        body[EPISODE_FIELD] = [episode, number]
        if temperature is not None:
            body["temperature"] = temperature
        if body.get("top_p") is None and state.top_p is not None:
            body["top_p"] = state.top_p
        if state.max_tokens is not None:
            for key in ("max_tokens", "max_completion_tokens"):
                if isinstance(body.get(key), int) and body[key] > state.max_tokens:
                    body[key] = state.max_tokens
            if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
                body["max_tokens"] = state.max_tokens
        if body.get("seed") is None:
            body["seed"] = (state.seed + 1009 * number) % 2 ** 32
        return body, ""

    def _end(self, episode: str) -> None:
        with self._lock:
            state = self._episodes.get(episode)
            if state is not None:
                state.in_flight -= 1
                self._lock.notify_all()


def replayed_sequences(tokenizer, stop_token_ids, record) -> list[tuple[str, list[int]]]:
    """``(text, ids)`` of each choice's prompt + completion of ``record``: the ids' own text, and the
    text a chat template renders the reply with when the agent sends it back (its content, the tool
    calls written back as ``<tool_call>`` blocks as ``rljax.serve.protocol.chat_prompt`` writes them
    for a template that does not render tools, then its stop token), unless a stop string cut the
    reply (its ids then hold text the reply does not)."""
    decode = tokenizer.decode
    prompt = list(record.prompt_token_ids)
    prompt_text = decode(prompt, skip_special_tokens=False)
    out = []
    for choice in record.choices:
        ids = prompt + list(choice.token_ids)
        out.append((decode(ids, skip_special_tokens=False), ids))
        stopped = bool(choice.token_ids) and choice.token_ids[-1] in stop_token_ids
        if not (stopped or choice.finish_reason == "length"):
            continue
        stop = decode(choice.token_ids[-1:], skip_special_tokens=False) if stopped else ""
        out.append((prompt_text + choice.text + stop, ids))
        if choice.tool_calls:
            try:
                blocks = "".join("<tool_call>" + json.dumps({"name": c["function"]["name"],
                                                             "arguments": json.loads(c["function"]["arguments"])})
                                 + "</tool_call>" for c in choice.tool_calls)
            except (KeyError, TypeError, ValueError):
                continue
            out.append((prompt_text + (choice.content or "") + blocks + stop, ids))
    return out


def encode_with_history(tokenizer, text: str, sequences: list[tuple[str, list[int]]]) -> list[int]:
    """``text``'s ids: the ids of the longest of ``sequences`` whose text starts it, then the rest
    encoded; all of it encoded when none does."""
    best = max((s for s in sequences if s[0] and text.startswith(s[0])), key=lambda s: len(s[1]), default=None)
    if best is None:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    rest = text[len(best[0]):]
    return list(best[1]) + (list(tokenizer(rest, add_special_tokens=False)["input_ids"]) if rest else [])


class _Router:
    """ASGI: ``/episodes/<id>/v1/...`` to the server's ``/v1/...`` with the episode's settings."""

    def __init__(self, owner: AgentServer):
        self.owner, self.app = owner, owner.server.app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        parts = scope["path"].split("/", 3)  # "", "episodes", id, "v1/..."
        if len(parts) < 4 or parts[1] != "episodes" or not parts[3].startswith("v1"):
            return await _error(send, 404, "not found: agent clients use /episodes/<episode>/v1", "not_found")
        episode, path = parts[2], "/" + parts[3]
        raw = b""
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return
            raw += message.get("body", b"")
            if len(raw) > _MAX_BODY or not message.get("more_body"):
                break
        body: Any = None
        if scope.get("method") == "POST" and raw and len(raw) <= _MAX_BODY:
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
        state_body, problem = self.owner._begin(episode, body)
        if state_body is None and problem is None:
            return await _error(send, 404, f"no open episode {episode!r} (it ended, or never began)", "episode_not_found")
        if problem:
            return await _error(send, 400, problem, "invalid_value", param="temperature")
        counted = isinstance(body, dict)
        if counted:
            raw = json.dumps(state_body).encode()
        headers = [(k, v) for k, v in scope.get("headers", []) if k != b"content-length"]
        headers.append((b"content-length", str(len(raw)).encode()))
        inner = dict(scope, path=path, raw_path=path.encode(), headers=headers)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        try:
            await self.app(inner, replay, send)
        finally:
            if counted:
                self.owner._end(episode)


async def _error(send, status: int, message: str, code: str, param: str | None = None) -> None:
    body = json.dumps(BadRequest(message, param, status=status, code=code).body()).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
