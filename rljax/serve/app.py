"""The OpenAI-compatible HTTP server over the rollout engine (FastAPI; run it with uvicorn).

    server = Server(engine, tokenizer, model_id="my-model", on_call=record)
    uvicorn.run(server.app, host="127.0.0.1", port=8000)

``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``. Each choice carries the sampled
``token_ids`` and the response the ``prompt_token_ids``, so a client can train on exactly what was
sampled. ``on_call(record)`` is called with a :class:`CallRecord` after every completed call (streamed
ones too): the prompt ids, each choice's ids, log-probs and finish reason, and the policy version
(:meth:`Server.set_weights` advances it) -- what a trainer needs to turn the calls into trajectories.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import secrets
import time
import uuid
from typing import Any, Callable

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from rljax.errors import UserError
from rljax.inference import Engine, Output, Request
from rljax.rollout import stop_token_ids as model_stop_ids
from rljax.serve.driver import EngineDriver
from rljax.serve.protocol import (BadRequest, ChatRequest, CompletionRequest, Decoder, chat_logprobs, chat_prompt,
                                  check_unsupported, completion_logprobs, finish_reason, stop_strings, tool_message,
                                  usage)

log = logging.getLogger(__name__)

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse to serve on a non-local address without an API key (anyone who reaches it could use it)."""
    if host not in LOCAL_HOSTS and not api_key:
        raise UserError(f"--host {host}: serving beyond this machine needs --api-key KEY "
                        f"(only {', '.join(LOCAL_HOSTS)} may go without one)")


@dataclasses.dataclass
class ChoiceRecord:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str  # the whole reply's text (before any stop string)
    content: str | None  # the message content: the text, or what precedes parsed tool calls (None if nothing)
    tool_calls: list[dict]
    tool_call_errors: list[str]
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)  # per token, if asked


@dataclasses.dataclass
class CallRecord:
    """One completed call: what was asked, the exact prompt ids, each choice's sampled ids and their
    log-probs (under the request's temperature), and the policy version when it was submitted and when
    it finished (they differ when new weights arrived mid-call)."""

    endpoint: str
    request: dict
    prompt_token_ids: list[int]
    choices: list[ChoiceRecord]
    policy_version: int
    policy_version_end: int
    seconds: float


class _BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 413 (declared length or bytes read)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await _too_large(self.limit, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge()
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await _too_large(self.limit, send)


class _TooLarge(Exception):
    pass


async def _too_large(limit: int, send) -> None:
    body = json.dumps(BadRequest(f"request body over {limit} bytes", None, status=413,
                                 code="request_too_large").body()).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _param(loc) -> str | None:
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


class Server:
    """The app (``server.app``) and the engine's driver thread. ``model_id``: the name clients send as
    ``model`` (another gets 404); ``api_key``: required as ``Authorization: Bearer KEY`` when set;
    ``on_call``: called on the server's event loop with a :class:`CallRecord` after each call;
    ``encode_chat(text, request)``: the prompt ids of a rendered chat prompt (default: the tokenizer's),
    so a caller can keep earlier sampled ids where the text re-renders them (``rljax.agents``)."""

    def __init__(self, engine: Engine, tokenizer: Any, *, model_id: str, api_key: str | None = None,
                 on_call: Callable[[CallRecord], None] | None = None, max_body_bytes: int = 4 << 20,
                 stop_token_ids: tuple[int, ...] | None = None,
                 encode_chat: Callable[[str, ChatRequest], list[int]] | None = None):
        self.engine, self.tokenizer, self.model_id = engine, tokenizer, model_id
        self.encode_chat = encode_chat
        self.api_key, self.on_call = api_key, on_call
        self.stop_token_ids = tuple(stop_token_ids if stop_token_ids is not None
                                    else model_stop_ids(tokenizer, engine.config))
        self.decoder = Decoder(tokenizer, self.stop_token_ids)
        self.policy_version = 0
        self.driver = EngineDriver(engine)
        self.app = self._build_app(max_body_bytes)

    def set_weights(self, states, version: int | None = None) -> None:
        """Serve ``states`` from the next engine step on; the policy version becomes ``version`` (default:
        one more)."""
        self.driver.set_weights(states)
        self.policy_version = self.policy_version + 1 if version is None else int(version)

    def close(self) -> None:
        self.driver.close()

    # ------------------------------------------------------------------ app
    def _build_app(self, max_body_bytes: int) -> FastAPI:
        app = FastAPI(title="rljax serve", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(BadRequest)
        async def bad_request(_, e: BadRequest):
            return JSONResponse(e.body(), status_code=e.status)

        @app.exception_handler(RequestValidationError)
        async def invalid(_, e: RequestValidationError):
            errors = e.errors()
            first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
            if first.get("type") == "json_invalid":
                return JSONResponse(BadRequest(f"the body is not valid JSON: {first.get('msg')}", None,
                                               code="invalid_json").body(), status_code=400)
            param = _param(first.get("loc", ()))
            message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
            return JSONResponse(BadRequest(message, param, code="invalid_value").body(), status_code=400)

        @app.middleware("http")
        async def auth(request: HTTPRequest, call_next):
            if self.api_key is not None:
                given = request.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                    return JSONResponse(BadRequest("missing or wrong API key (Authorization: Bearer KEY)", None,
                                                   status=401, code="invalid_api_key").body(), status_code=401)
            return await call_next(request)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [self._model_card()]}

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str):
            self._check_model(model_id)
            return self._model_card()

        @app.post("/v1/chat/completions")
        async def chat(body: ChatRequest):
            return await self._complete("chat", body)

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest):
            return await self._complete("text", body)

        app.add_middleware(_BodyLimit, limit=max_body_bytes)
        return app

    def _model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": 0, "owned_by": "rljax",
                "max_model_len": self.engine.max_context}

    def _check_model(self, model_id: str) -> None:
        if model_id != self.model_id:
            raise BadRequest(f"the model {model_id!r} does not exist; this server serves {self.model_id!r}", "model",
                             status=404, code="model_not_found")

    # ------------------------------------------------------------------ a call
    def _prepare(self, kind: str, req) -> tuple[list[int], list[dict], list[Request]]:
        self._check_model(req.model)
        check_unsupported(req)
        tools: list[dict] = []
        if kind == "chat":
            text, tools = chat_prompt(self.tokenizer, req)
            prompt = (list(self.encode_chat(text, req)) if self.encode_chat is not None
                      else list(self.tokenizer(text, add_special_tokens=False)["input_ids"]))
            param, max_tokens = "messages", req.max_completion_tokens or req.max_tokens
        elif isinstance(req.prompt, str):
            prompt = list(self.tokenizer(req.prompt, add_special_tokens=True)["input_ids"])
            param, max_tokens = "prompt", req.max_tokens
        else:
            prompt, param, max_tokens = list(req.prompt), "prompt", req.max_tokens
        context = self.engine.max_context
        if not prompt:
            raise BadRequest(f"{param}: the prompt has no tokens", param)
        if len(prompt) >= context:
            raise BadRequest(f"{param}: the prompt is {len(prompt)} tokens, the model's context is {context} "
                             "(a completion needs at least one more)", param, code="context_length_exceeded")
        if max_tokens is None:  # what is left of the context (and of the page pool)
            fits = self.engine.pool.capacity * self.engine.page_size
            max_tokens = max(1, min(context, fits) - len(prompt))
        seed = req.seed if req.seed is not None else secrets.randbelow(2 ** 32)
        temperature = 1.0 if req.temperature is None else req.temperature
        top_p = 1.0 if req.top_p is None else req.top_p
        top = (req.top_logprobs or 0) if kind == "chat" else (req.logprobs or 0)
        requests = [Request(prompt_ids=prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            stop_token_ids=self.stop_token_ids, seed=(seed + i) % 2 ** 32, top_logprobs=top)
                    for i in range(req.n)]
        return prompt, tools, requests

    async def _submit(self, requests: list[Request], callbacks, param: str):
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(None, self.driver.submit, requests, callbacks)
        except UserError as e:  # the engine names the field: "max_tokens: ...", "prompt_ids: ..."
            message = str(e)
            field = message.split(":")[0].split(" ")[0]
            field = {"prompt_ids": param}.get(field, field)
            if field == "max_tokens" and "context" in message:
                raise BadRequest(message, field, code="context_length_exceeded") from None
            raise BadRequest(message, field) from None

    async def _complete(self, kind: str, req):
        started = time.perf_counter()
        prompt, tools, requests = self._prepare(kind, req)
        stops = stop_strings(req.stop)
        version = self.policy_version
        call_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        decoder = self.decoder
        if req.stream:
            return await self._stream(kind, req, call_id, prompt, tools, requests, stops, version, started)

        def watch(ids, _lps, _top):
            return decoder.holds_stop(ids, stops)

        futures = await self._submit(requests, [watch if stops else None] * len(requests),
                                     "messages" if kind == "chat" else "prompt")
        try:
            outputs = [await asyncio.wrap_future(f) for f in futures]
        except asyncio.CancelledError:  # the client went away
            self.driver.cancel(futures)
            raise
        choices, records = [], []
        for i, out in enumerate(outputs):
            record = self._choice_record(out, stops, tools)
            records.append(record)
            choices.append(self._choice(kind, i, record, req))
        body = {"id": call_id, "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": int(time.time()), "model": self.model_id, "choices": choices,
                "usage": usage(prompt, [r.token_ids for r in records]), "prompt_token_ids": prompt}
        self._record(kind, req, prompt, records, version, started)
        return body

    def _choice_record(self, out: Output, stops: list[str], tools: list[dict]) -> ChoiceRecord:
        text, kept, stopped = self.decoder.cut(list(out.token_ids), stops)
        message, errors = tool_message(text, tools)
        reason = finish_reason(out.finish_reason, stopped)
        if message.get("tool_calls"):
            reason = "tool_calls"
        return ChoiceRecord(list(out.token_ids[:kept]), list(out.logprobs[:kept]), reason,
                            text, message["content"], message.get("tool_calls", []), errors,
                            list(out.top_logprobs[:kept]))

    def _choice(self, kind: str, index: int, r: ChoiceRecord, req) -> dict:
        if kind == "chat":
            message = {"role": "assistant", "content": r.content}
            if r.tool_calls:
                message["tool_calls"] = r.tool_calls
            return {"index": index, "message": message, "finish_reason": r.finish_reason,
                    "logprobs": chat_logprobs(self.decoder, r.token_ids, r.logprobs, r.top_logprobs)
                    if req.logprobs else None,
                    "token_ids": r.token_ids}
        return {"index": index, "text": r.text, "finish_reason": r.finish_reason,
                "logprobs": completion_logprobs(self.decoder, r.token_ids, r.logprobs, r.top_logprobs)
                if req.logprobs is not None else None, "token_ids": r.token_ids}

    def _record(self, kind, req, prompt, records, version, started) -> None:
        if self.on_call is None:
            return
        record = CallRecord("chat.completions" if kind == "chat" else "completions",
                            req.model_dump(exclude_none=True), list(prompt), records, version, self.policy_version,
                            time.perf_counter() - started)
        try:
            self.on_call(record)
        except Exception:  # noqa: BLE001 -- the client still gets its answer
            log.exception("rljax serve: on_call failed")

    # ------------------------------------------------------------------ streaming
    async def _stream(self, kind, req, call_id, prompt, tools, requests, stops, version, started):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        decoder, n = self.decoder, len(requests)

        def watcher(index):
            def watch(ids, lps, top):
                stop = bool(stops) and decoder.holds_stop(ids, stops)
                loop.call_soon_threadsafe(queue.put_nowait, ("tokens", index, ids, lps, top, stop))
                return stop
            return watch

        futures = await self._submit(requests, [watcher(i) for i in range(n)],
                                     "messages" if kind == "chat" else "prompt")
        for i, f in enumerate(futures):
            f.add_done_callback(lambda f, i=i: loop.call_soon_threadsafe(queue.put_nowait, ("done", i, f)))
        created, obj = int(time.time()), "chat.completion.chunk" if kind == "chat" else "text_completion"
        hold = max((len(s) for s in stops), default=1) - 1
        withhold_text = kind == "chat" and bool(tools)  # a tool call is known only at the end

        def chunk(index, delta_text, ids, lps, top, reason=None, first=False, tool_calls=None):
            c: dict[str, Any] = {"index": index, "finish_reason": reason, "token_ids": ids}
            if kind == "chat":
                delta: dict[str, Any] = {"role": "assistant"} if first else {}
                if delta_text is not None:
                    delta["content"] = delta_text
                if tool_calls:
                    delta["tool_calls"] = [dict(tc, index=j) for j, tc in enumerate(tool_calls)]
                c["delta"] = delta
                c["logprobs"] = chat_logprobs(decoder, ids, lps, top) if req.logprobs else None
            else:
                c["text"] = delta_text or ""
                c["logprobs"] = completion_logprobs(decoder, ids, lps, top) if req.logprobs is not None else None
            body = {"id": call_id, "object": obj, "created": created, "model": self.model_id, "choices": [c]}
            if first:
                body["prompt_token_ids"] = prompt
            return f"data: {json.dumps(body)}\n\n"

        async def events():
            sent_text, sent_ids = [""] * n, [0] * n
            records: list[ChoiceRecord | None] = [None] * n
            try:
                for i in range(n):
                    yield chunk(i, "" if kind == "chat" else None, [], [], [], first=True)
                while any(r is None for r in records):
                    item = await queue.get()
                    if item[0] == "tokens":
                        _, i, ids, lps, top, stop = item
                        if records[i] is not None or stop:
                            continue  # the tokens after a stop string wait for the cut
                        text = decoder.text(ids)
                        safe = text.rstrip("\ufffd")  # a character's bytes not all sampled yet
                        safe = safe[:max(len(safe) - hold, 0)] if stops else safe
                        delta = safe[len(sent_text[i]):] if safe.startswith(sent_text[i]) and not withhold_text else ""
                        new_ids, new_lps, new_top = ids[sent_ids[i]:], lps[sent_ids[i]:], top[sent_ids[i]:]
                        if delta or new_ids:
                            sent_text[i] += delta
                            sent_ids[i] = len(ids)
                            yield chunk(i, delta, new_ids, new_lps, new_top)
                        continue
                    _, i, future = item
                    record = self._choice_record(future.result(), stops, tools)
                    records[i] = record
                    rest = sent_ids[i]
                    rest_ids, rest_lps, rest_top = (record.token_ids[rest:], record.logprobs[rest:],
                                                    record.top_logprobs[rest:])
                    if record.tool_calls:
                        yield chunk(i, record.content, rest_ids, rest_lps, rest_top, record.finish_reason,
                                    tool_calls=record.tool_calls)
                    else:
                        yield chunk(i, record.text[len(sent_text[i]):], rest_ids, rest_lps, rest_top,
                                    record.finish_reason)
                if (req.stream_options or {}).get("include_usage"):
                    body = {"id": call_id, "object": obj, "created": created, "model": self.model_id, "choices": [],
                            "usage": usage(prompt, [r.token_ids for r in records])}
                    yield f"data: {json.dumps(body)}\n\n"
                yield "data: [DONE]\n\n"
                self._record(kind, req, prompt, records, version, started)
            finally:
                self.driver.cancel(futures)

        return StreamingResponse(events(), media_type="text/event-stream")
