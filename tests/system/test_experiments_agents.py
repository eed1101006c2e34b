"""experiments/agents/openai_calculator.py: its --smoke preset serves a tiny random model, runs both
openai-client agents on it and writes the table."""

import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _module():
    spec = importlib.util.spec_from_file_location(
        "openai_calculator", os.path.join(REPO, "experiments", "agents", "openai_calculator.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tools_and_the_score_of_the_calculator_agents():
    m = _module()
    assert m._tool("multiply", '{"a": 12, "b": 34}') == "408" and m._tool("add", '{"a": 408, "b": 5}') == "413"
    assert m._tool("add", '{"a": 1}').startswith("error: KeyError") and "no tool" in m._tool("pow", '{"a": 1, "b": 2}')
    task = {"answer": 413}
    assert m._score("so <answer>413</answer>", task) == 1.0 and m._score("it is 413", task) == 1.0
    assert m._score("<answer>413</answer> not 5", task) == 1.0 and m._score("<answer>412</answer> 413", task) == 0.0
    assert m._score(None, task) == 0.0
    train, held_out = m.tasks(64, "train"), m.tasks(64, "eval")
    assert not {t["prompt"] for t in train} & {t["prompt"] for t in held_out}


def test_smoke_preset_writes_its_table(capsys):
    _module().main(["--smoke"])
    out = capsys.readouterr().out
    assert "| run (appends) |" in out and "| run_rewriting (own notes) |" in out


def test_warm_start_demonstrations_render_as_the_server_renders_and_parse_back(tmp_path, monkeypatch):
    import json

    import pytest

    from rljax.serve.protocol import tool_message
    from tests._tiny import tiny_tokenizer

    m = _module()
    tok = tiny_tokenizer()
    task = {"prompt": "What is 12 * 34 + 500?", "answer": 908}
    demo = m.demonstration(task)
    counts = m.check_demonstration(tok, demo)
    assert len(counts["prompt_tokens"]) == 3 and counts["prompt_tokens"] == sorted(counts["prompt_tokens"])
    replies = [x["content"] for x in m.sft_messages(tok, demo) if x["role"] == "assistant"]
    calls = [[(c["function"]["name"], json.loads(c["function"]["arguments"]))
              for c in tool_message(r, m.TOOLS)[0]["tool_calls"]] for r in replies[:2]]
    assert calls == [[("multiply", {"a": 12, "b": 34})], [("add", {"a": 408, "b": 500})]]
    assert tool_message(replies[2], m.TOOLS)[0] == {"role": "assistant", "content": "<answer>908</answer>"}
    assert m._score(replies[2], task) == 1.0
    # a transcript whose system message lacks the server's tool listing is refused
    plain = m.sft_messages
    monkeypatch.setattr(m, "sft_messages", lambda t, d: [{**x, "content": m.SYSTEM} if x["role"] == "system" else x
                                                       for x in plain(t, d)])
    with pytest.raises(AssertionError, match="differs from the server's prompt"):
        m.check_demonstration(tok, demo)
    monkeypatch.setattr(m, "sft_messages", plain)
    out = m.make_sft(tok, 3, str(tmp_path))
    rows = [json.loads(line) for line in open(f"{out}/train.jsonl")]
    assert len(rows) == 3 and rows[0]["messages"][0]["content"].startswith(m.SYSTEM)
    assert sum(1 for _ in open(f"{out}/eval.jsonl")) == 64
