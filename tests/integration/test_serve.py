"""``rljax serve``: the OpenAI-compatible server over the engine, driven with the real ``openai`` client
(uvicorn in a thread on a free port) and FastAPI's TestClient for the error cases."""

from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np
import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient

from rljax.inference import Engine, Output, Request
from rljax.models import load
from rljax.serve import Server, check_bind
from rljax.serve.protocol import ChatRequest, Decoder, chat_prompt, tool_message
from rljax.errors import UserError
from rljax.tools import cli

MAX_SLOTS = 8


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load(tiny_dir)


@pytest.fixture(scope="module")
def served(tiny):
    """A server on a free port. It never stops at EOS (``stop_token_ids=()``), so a random tiny model's
    completions run to ``max_tokens`` and have text to compare."""
    model, tokenizer = tiny
    calls = []
    server = Server(Engine(model, max_slots=MAX_SLOTS, page_size=16), tokenizer, model_id="tiny",
                    stop_token_ids=(), on_call=calls.append)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    http = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not http.started:
        assert time.time() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    yield server, client, calls
    http.should_exit = True
    thread.join(timeout=30)
    server.close()


def _chat_ids(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_chat_greedy_equals_the_engine(served, tiny):
    server, client, calls = served
    model, tokenizer = tiny
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, logprobs=True,
                                       top_logprobs=2)
    prompt = _chat_ids(tokenizer, messages)
    want = Engine(model, max_slots=2, page_size=16).generate(
        [Request(prompt_ids=prompt, max_tokens=12, temperature=0.0, stop_token_ids=())])[0]
    body = r.model_dump()
    choice = body["choices"][0]
    assert body["prompt_token_ids"] == prompt
    assert choice["token_ids"] == want.token_ids and len(want.token_ids) == 12
    assert choice["message"]["content"] == tokenizer.decode(want.token_ids, skip_special_tokens=True)
    assert choice["finish_reason"] == "length"
    got_lps = [e["logprob"] for e in choice["logprobs"]["content"]]
    np.testing.assert_allclose(got_lps, want.logprobs, rtol=0, atol=1e-5)
    # top_logprobs: the two likeliest tokens under the same distribution; greedy, the first is the sampled one
    top_engine = Engine(model, max_slots=2, page_size=16).generate(
        [Request(prompt_ids=prompt, max_tokens=12, temperature=0.0, stop_token_ids=(), top_logprobs=2)])[0]
    for e, tid, want_top in zip(choice["logprobs"]["content"], want.token_ids, top_engine.top_logprobs):
        assert [a["token"] for a in e["top_logprobs"]] == [tokenizer.decode([j]) for j, _ in want_top]
        np.testing.assert_allclose([a["logprob"] for a in e["top_logprobs"]], [lp for _, lp in want_top], atol=1e-5)
        assert e["top_logprobs"][0]["token"] == e["token"] and e["top_logprobs"][0]["logprob"] == e["logprob"]
        assert e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
    assert body["usage"] == {**body["usage"], "prompt_tokens": len(prompt), "completion_tokens": 12}
    # the call was recorded with exactly what was sampled
    rec = calls[-1]
    assert rec.endpoint == "chat.completions" and rec.prompt_token_ids == prompt
    assert rec.choices[0].token_ids == want.token_ids and rec.choices[0].logprobs == got_lps
    assert rec.policy_version == rec.policy_version_end == server.policy_version


def test_n_choices_with_a_seed(served):
    _, client, _ = served
    kw = dict(model="tiny", messages=[{"role": "user", "content": "tell a story"}], max_tokens=6, n=3, seed=11,
              temperature=1.0)
    a, b = client.chat.completions.create(**kw).model_dump(), client.chat.completions.create(**kw).model_dump()
    ids = [c["token_ids"] for c in a["choices"]]
    assert [c["index"] for c in a["choices"]] == [0, 1, 2] and all(len(t) == 6 for t in ids)
    assert len({tuple(t) for t in ids}) > 1  # three samples, not one repeated
    assert ids == [c["token_ids"] for c in b["choices"]]  # the same seed samples the same tokens


def test_streaming_concatenates_to_the_non_streamed_reply(served):
    _, client, calls = served
    kw = dict(model="tiny", messages=[{"role": "user", "content": "count to ten"}], max_tokens=20, temperature=0)
    whole = client.chat.completions.create(**kw).model_dump()["choices"][0]
    chunks = [c.model_dump() for c in client.chat.completions.create(stream=True, logprobs=True, top_logprobs=3, **kw)]
    assert chunks[0]["prompt_token_ids"] == calls[-2].prompt_token_ids
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    lps = [e["logprob"] for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert text == whole["message"]["content"] and ids == whole["token_ids"]
    assert len(lps) == len(ids) == 20
    tops = [e["top_logprobs"] for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert [len(t) for t in tops] == [3] * 20 and [t[0]["logprob"] for t in tops] == lps  # greedy: the first is drawn
    assert len(chunks) > 3  # streamed as produced, not one block
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert calls[-1].choices[0].token_ids == ids  # streamed calls are recorded too


def test_completions_with_token_ids_and_a_stop_string(served, tiny):
    _, client, _ = served
    _, tokenizer = tiny
    prompt = list(tokenizer("The answer is", add_special_tokens=False)["input_ids"])
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0).model_dump()
    text, ids = full["choices"][0]["text"], full["choices"][0]["token_ids"]
    assert full["prompt_token_ids"] == prompt
    at = next(i for i in range(2, len(text)) if text[i].isprintable() and text[i] != "\ufffd")
    stop = text[at]
    cut = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                    logprobs=0).model_dump()["choices"][0]
    assert cut["text"] == text[:text.find(stop)] and cut["finish_reason"] == "stop"
    k = len(cut["token_ids"])
    assert cut["token_ids"] == ids[:k] and k < len(ids)  # the sampled tokens through the one that made the stop
    assert stop in tokenizer.decode(ids[:k]) and stop not in tokenizer.decode(ids[:k - 1])
    assert len(cut["logprobs"]["token_logprobs"]) == k


def test_concurrent_requests_are_batched(served):
    server, client, _ = served
    before = dict(server.engine.stats)
    results, errors = [None] * 8, []

    def ask(i):
        try:
            r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"q{i}" * (i + 1)}],
                                               max_tokens=16, temperature=0.7, seed=i)
            results[i] = r.model_dump()["choices"][0]["token_ids"]
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and all(r is not None and len(r) == 16 for r in results)
    steps = server.engine.stats["decode_steps"] - before["decode_steps"]
    tokens = server.engine.stats["decode_tokens"] - before["decode_tokens"]
    assert tokens >= 8 * 15 and steps < tokens / 2  # sequences decoded together, not one after another


def _error(resp, status, param):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"
    return err


def test_bad_requests_get_400_and_the_server_goes_on(served):
    server, _, _ = served
    msgs = [{"role": "user", "content": "hi"}]
    good = {"model": "tiny", "messages": msgs, "max_tokens": 2}
    with TestClient(server.app) as http:
        cases = [
            ({"content": b"{not json"}, 400, None),
            ({"json": {**good, "max_tokens": 0}}, 400, "max_tokens"),
            ({"json": {**good, "temperature": "hot"}}, 400, "temperature"),
            ({"json": {**good, "n": 0}}, 400, "n"),
            ({"json": {**good, "messages": "hi"}}, 400, "messages"),
            ({"json": {**good, "messages": [{"role": "wizard", "content": "x"}]}}, 400, "messages[0].role"),
            ({"json": {**good, "stop": ["a", "b", "c", "d", "e"]}}, 400, "stop"),
            ({"json": {**good, "max_tokens": 10 ** 6}}, 400, "max_tokens"),  # the engine's UserError
            ({"json": {**good, "frequency_penalty": 0.5}}, 400, "frequency_penalty"),
            ({"json": {**good, "top_logprobs": 2}}, 400, "top_logprobs"),  # without logprobs: true
            ({"json": {**good, "logprobs": True, "top_logprobs": 21}}, 400, "top_logprobs"),
            ({"json": {**good, "model": "gpt-4o"}}, 404, "model"),
        ]
        for kwargs, status, param in cases:
            _error(http.post("/v1/chat/completions", **kwargs), status, param)
            assert http.post("/v1/chat/completions", json=good).status_code == 200
        context = server.engine.max_context
        err = _error(http.post("/v1/completions", json={"model": "tiny", "prompt": [5] * context, "max_tokens": 1}),
                     400, "prompt")
        assert err["code"] == "context_length_exceeded"
        _error(http.post("/v1/completions", json={"model": "tiny", "prompt": [10 ** 6], "max_tokens": 1}), 400, "prompt")
        too_big = http.post("/v1/completions", content=b'{"prompt": "' + b"x" * (5 << 20) + b'"}',
                            headers={"content-type": "application/json"})
        assert too_big.status_code == 413
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "ok", "max_tokens": 2, "logprobs": 2})
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2
        logprobs = r.json()["choices"][0]["logprobs"]
        # {token: log-prob} of the 2 likeliest; two ids with the same text share one key (the likelier's)
        assert all(len(t) in (1, 2) for t in logprobs["top_logprobs"]) and len(logprobs["top_logprobs"]) == 2
        assert all(lp <= max(t.values()) + 1e-6 for lp, t in zip(logprobs["token_logprobs"], logprobs["top_logprobs"]))


def test_api_key_enforced(tiny):
    model, tokenizer = tiny
    server = Server(Engine(model, max_slots=2, page_size=16, num_pages=64), tokenizer, model_id="tiny",
                    api_key="s3cret")
    try:
        with TestClient(server.app) as http:
            assert http.get("/v1/models").status_code == 401
            assert http.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
            r = http.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert http.post("/v1/chat/completions", json=body).status_code == 401
            assert http.post("/v1/chat/completions", json=body,
                             headers={"Authorization": "Bearer s3cret"}).status_code == 200
    finally:
        server.close()


def test_non_local_host_needs_an_api_key(tiny_dir, capsys):
    with pytest.raises(UserError, match="--api-key"):
        check_bind("0.0.0.0", None)
    check_bind("0.0.0.0", "k")
    check_bind("127.0.0.1", None)
    assert cli.main(["serve", "--model", tiny_dir, "--host", "0.0.0.0", "--port", "1"]) == 2
    assert "--api-key" in capsys.readouterr().err


def test_tool_calls_parsed_into_the_response(served, tiny):
    server, _, _ = served
    _, tokenizer = tiny
    tools = [{"type": "function", "function": {"name": "add", "description": "add two numbers",
                                               "parameters": {"type": "object", "properties": {
                                                   "a": {"type": "number"}, "b": {"type": "number"}}}}}]
    req = ChatRequest(model="tiny", messages=[{"role": "user", "content": "2+3?"}], tools=tools)
    text, shown = chat_prompt(tokenizer, req)  # the byte tokenizer's ChatML renders no tools: the system message lists them
    assert shown == tools and '"name": "add"' in text and "<tool_call>" in text
    none = ChatRequest(model="tiny", messages=[{"role": "user", "content": "2+3?"}], tools=tools, tool_choice="none")
    assert chat_prompt(tokenizer, none)[1] == [] and '"add"' not in chat_prompt(tokenizer, none)[0]
    reply = 'Let me add.<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    ids = list(tokenizer(reply, add_special_tokens=False)["input_ids"]) + [2]
    record = server._choice_record(Output(0, [1], ids, [-0.5] * len(ids), "stop"), [], shown)
    assert record.finish_reason == "tool_calls" and record.token_ids == ids
    (call,) = record.tool_calls
    assert call["type"] == "function" and call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
    choice = server._choice("chat", 0, record, req)
    assert choice["message"] == {"role": "assistant", "content": "Let me add.", "tool_calls": [call]}
    assert choice["finish_reason"] == "tool_calls" and choice["token_ids"] == ids
    message, errors = tool_message(reply, shown)
    assert message["content"] == "Let me add." and not errors
    # without tools shown the text stays text; a broken block stays in the content with its error
    assert tool_message(reply, [])[0] == {"role": "assistant", "content": reply}
    broken, errs = tool_message("<tool_call>{oops</tool_call>", shown)
    assert broken["content"] == "<tool_call>{oops</tool_call>" and "invalid JSON" in errs[0]
    # an earlier assistant tool call and its result go back into the prompt in the form the model writes
    history = ChatRequest(model="tiny", tools=tools, messages=[
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"}])
    rendered = chat_prompt(tokenizer, history)[0]
    assert '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>' in rendered
    assert "<|im_start|>tool\n5<|im_end|>" in rendered


def test_decoder_cut_is_the_fewest_tokens_holding_the_stop(tiny):
    _, tokenizer = tiny
    ids = list(tokenizer("abcXYdef", add_special_tokens=False)["input_ids"]) + [2]
    d = Decoder(tokenizer, (2,))
    assert d.text(ids) == "abcXYdef"
    assert d.cut(ids, ["XY", "de"]) == ("abc", 5, True)
    assert d.cut(ids, ["zz"]) == ("abcXYdef", len(ids), False)


def test_new_weights_advance_the_policy_version(served, tiny):
    server, client, calls = served
    version = server.policy_version
    server.set_weights(server.engine.states)  # the same arrays: nothing recompiles
    client.completions.create(model="tiny", prompt="x", max_tokens=1)
    assert server.policy_version == version + 1 and calls[-1].policy_version == version + 1


def test_streaming_with_a_stop_string_and_with_tools(served):
    _, client, _ = served
    kw = dict(model="tiny", messages=[{"role": "user", "content": "spell it"}], max_tokens=24, temperature=0)
    text = client.chat.completions.create(**kw).model_dump()["choices"][0]["message"]["content"]
    stop = next(text[i:i + 2] for i in range(3, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    whole = client.chat.completions.create(stop=stop, **kw).model_dump()["choices"][0]
    chunks = [c.model_dump()["choices"][0] for c in client.chat.completions.create(stop=stop, stream=True, **kw)]
    assert whole["message"]["content"] == text[:text.find(stop)] and whole["finish_reason"] == "stop"
    assert "".join(c["delta"].get("content") or "" for c in chunks) == whole["message"]["content"]
    assert [t for c in chunks for t in c["token_ids"]] == whole["token_ids"]
    assert chunks[-1]["finish_reason"] == "stop"
    # with tools shown, the text of a streamed reply waits for its end (a tool call is known only then)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    plain = client.chat.completions.create(tools=tools, **kw).model_dump()["choices"][0]
    streamed = [c.model_dump()["choices"][0] for c in client.chat.completions.create(tools=tools, stream=True, **kw)]
    contents = [c["delta"].get("content") for c in streamed]
    assert all(not c for c in contents[:-1]) and contents[-1] == plain["message"]["content"]
    assert [t for c in streamed for t in c["token_ids"]] == plain["token_ids"]


def test_driver_cancels_and_refuses_without_stopping(tiny):
    from rljax.serve import EngineDriver

    model, _ = tiny
    driver = EngineDriver(Engine(model, max_slots=2, page_size=16, num_pages=64))
    try:
        seen = []
        (long,) = driver.submit([Request(prompt_ids=[5, 6, 7], max_tokens=200, temperature=0.0)],
                                [lambda ids, lps, top: seen.append(len(ids)) or len(ids) >= 5])
        out = long.result(timeout=120)
        assert out.finish_reason == "cancelled" and len(out.token_ids) == len(out.logprobs) >= 5
        assert seen and seen[-1] == len(out.token_ids)
        with pytest.raises(UserError, match="max_tokens"):
            driver.submit([Request(prompt_ids=[5], max_tokens=3), Request(prompt_ids=[5], max_tokens=0)])
        (ok,) = driver.submit([Request(prompt_ids=[5], max_tokens=3, temperature=0.0)])
        assert ok.result(timeout=120).finish_reason == "length"
        (gone,) = driver.submit([Request(prompt_ids=[8, 9], max_tokens=500, temperature=0.0)])
        driver.cancel([gone])
        assert gone.result(timeout=120).finish_reason == "cancelled"
        assert not driver.engine.has_work()
    finally:
        driver.close()
