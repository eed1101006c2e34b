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


def test_the_grpo_config_and_the_seed_summary(tmp_path):
    """``--train``'s run: the warm-start model, LoRA, the agent, the temperatures, held-out tasks
    written once and the same for every seed; ``summarize`` reads each seed's first and last
    ``eval/reward`` (hand-made metrics) into the mean and the sample standard deviation."""
    import json

    m = _module()
    runs = tmp_path / "runs"
    cfgs = [m.train_config(seed, 5, str(runs), model="/warm/model", group_size=4, prompts_per_step=2,
                           learning_rate=2e-4, eval_size=16, agent="run_rewriting", temperature=0.7,
                           eval_temperature=0.7) for seed in (0, 1)]
    cfg = cfgs[0]
    assert (cfg.sampling.temperature, cfg.sampling.eval_temperature) == (0.7, 0.7)
    assert m.train_config(0, 5, str(tmp_path / "greedy")).sampling.eval_temperature == 0.0
    assert cfg.model.name == "/warm/model" and cfg.model.lora_rank == 16
    assert cfg.environment.function.endswith("openai_calculator.py:run_rewriting")
    assert (cfg.algorithm.group_size, cfg.algorithm.prompts_per_step, cfg.optim.learning_rate) == (4, 2, 2e-4)
    assert [c.train.run_dir for c in cfgs] == [str(runs / "seed0"), str(runs / "seed1")]
    assert cfg.train.eval_every == 5 and cfgs[1].data.eval_path == cfg.data.eval_path
    held_out = [json.loads(line)["prompt"] for line in open(cfg.data.eval_path)]
    assert held_out == [t["prompt"] for t in m.tasks(16, "eval")]
    assert not set(held_out) & {json.loads(line)["prompt"] for line in open(cfg.data.path)}

    def write(seed, before, after, rewards):
        (runs / f"seed{seed}").mkdir(parents=True, exist_ok=True)
        rows = [{"step": 0, "eval/reward": before}] + [
            {"step": i + 1, "reward/total/mean": r, "time/sample_s": 1.0, "time/ref_and_values_s": 0.5,
             "time/update_s": 2.0} for i, r in enumerate(rewards)] + [{"step": len(rewards), "eval/reward": after}]
        (runs / f"seed{seed}" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    write(0, 0.25, 0.5, [0.0, 0.5])
    write(1, 0.75, 1.0, [1.0])
    (runs / "seed2").mkdir()  # a run stopped before its first metrics: left out
    s = m.summarize(str(runs))
    assert s["seeds"]["seed0"] == {"before": 0.25, "after": 0.5, "steps": 2, "train_reward_first5": 0.25,
                                   "train_reward_last5": 0.25, "seconds": 7.0}
    assert s["before"] == {"mean": 0.5, "std": 0.25 * 2 ** 0.5} and s["after"]["mean"] == 0.75
