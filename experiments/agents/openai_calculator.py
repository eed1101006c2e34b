"""Agents written only against the ``openai`` package, with function tools, on the embedded SmolLM2.

Question: an agent that must chain two dependent tool calls (``multiply``,
then ``add`` on its result) to answer ``a × b + c``, written as an outside user would write it; what
does the policy do with it before any training, and do its calls join into one trajectory?

    python experiments/agents/openai_calculator.py --measure          # base model, held-out tasks
    python experiments/agents/openai_calculator.py --smoke            # a tiny random model (seconds)
    python experiments/agents/openai_calculator.py --make-sft --n 64  # warm-start demonstrations
    rljax train configs/sft_openai_calculator_smollm2.yaml            # SFT (LoRA) on them
    python experiments/agents/openai_calculator.py --train --model runs/sft_openai_calculator_smollm2/model \
        --seeds 0 1 2                                                 # GRPO from the warm start

Two agents (the module's ``run`` and ``run_rewriting``): ``run`` appends every reply and tool result
to its conversation (its calls join into one sequence); ``run_rewriting`` keeps its own notes and
sends a fresh two-message conversation each call (its calls are separate transitions sharing the
reward). Reward: 1.0 when the final reply's ``<answer>N</answer>`` (or last number) is ``a × b + c``.

``--measure`` serves the model with ``rljax.agents.AgentServer`` (greedy) and writes
experiments/results/agents_openai_calculator.md: success, calls, tool calls parsed / failed, and
transitions per episode for each agent. ``--train`` trains ``run`` with GRPO (LoRA); its measured
results, if any, are recorded in that file by hand.

The base model never calls a tool, so GRPO needs a warm start: ``--make-sft`` writes demonstrations of
the chain (``demonstration``) as SFT transcripts (``sft_messages``), each checked
(``check_demonstration``) to render, before every assistant turn, to the same text and tokens as the
server's prompt for that conversation, and to parse back with the server's tool-call parser into the
demonstrated calls and answer: a warm start on any other prompt format teaches the model nothing the
agent will see.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time

import numpy as np

TOOLS = [
    {"type": "function", "function": {
        "name": "multiply", "description": "Multiply two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}},
]
SYSTEM = ("Use the tools for every arithmetic step: call multiply first, then add with its result. "
          "When you have the result, reply <answer>N</answer>.")
MAX_CALLS = 4


def _tool(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments)
        a, b = int(args["a"]), int(args["b"])
    except Exception as exc:  # noqa: BLE001 -- the model sees what was wrong
        return f"error: {type(exc).__name__}: {exc}"
    if name == "multiply":
        return str(a * b)
    if name == "add":
        return str(a + b)
    return f"error: no tool {name!r}"


def _score(text: str | None, task: dict) -> float:
    text = text or ""
    tagged = re.findall(r"<answer>\s*(-?\d+)\s*</answer>", text)
    numbers = tagged or re.findall(r"-?\d+", text)
    return float(bool(numbers) and int(numbers[-1]) == int(task["answer"]))


def run(task, client):
    """Appends every reply and tool result: one growing conversation."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["prompt"]}]
    for _ in range(MAX_CALLS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return _score(reply.content, task)
        for call in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": _tool(call.function.name, call.function.arguments)})
    return 0.0


def run_rewriting(task, client):
    """Keeps its own notes: every call sees the system message and one user message with the task and
    the results so far (its history is rewritten, so each call is a transition of its own)."""
    notes: list[str] = []
    for _ in range(MAX_CALLS):
        user = task["prompt"] + ("\nResults so far: " + "; ".join(notes) if notes else "")
        reply = client.chat.completions.create(model="policy", tools=TOOLS, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]).choices[0].message
        if not reply.tool_calls:
            return _score(reply.content, task)
        for call in reply.tool_calls:
            notes.append(f"{call.function.name}({call.function.arguments}) = {_tool(call.function.name, call.function.arguments)}")
    return 0.0


def tasks(n: int, split: str) -> list[dict]:
    """``a × b + c`` with two-digit ``a``, ``b`` and three-digit ``c``; the splits use disjoint seeds."""
    rng = np.random.default_rng({"train": 0, "eval": 1}[split])
    out = []
    for _ in range(n):
        a, b, c = int(rng.integers(11, 100)), int(rng.integers(11, 100)), int(rng.integers(100, 1000))
        out.append({"prompt": f"What is {a} * {b} + {c}?", "answer": a * b + c})
    return out


_TASK = re.compile(r"What is (\d+) \* (\d+) \+ (\d+)\?")


def demonstration(task: dict) -> list[dict]:
    """The two-tool chain for ``task`` as the OpenAI messages ``run`` sends and receives (its replies
    as the server returns them: no content, one tool call each), ending with ``<answer>N</answer>``."""
    a, b, c = map(int, _TASK.fullmatch(task["prompt"]).groups())

    def call(i, name, x, y):
        return {"role": "assistant", "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {
            "name": name, "arguments": json.dumps({"a": x, "b": y})}}]}

    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["prompt"]},
            call(0, "multiply", a, b), {"role": "tool", "tool_call_id": "call_0", "content": str(a * b)},
            call(1, "add", a * b, c), {"role": "tool", "tool_call_id": "call_1", "content": str(a * b + c)},
            {"role": "assistant", "content": f"<answer>{a * b + c}</answer>"}]


def sft_messages(tokenizer, demo: list[dict]) -> list[dict]:
    """``demo`` as a ``messages`` transcript for ``rljax.data.transcripts`` whose every turn renders as
    the server renders the agent's conversation (``rljax.serve.protocol.chat_prompt``): for a template
    that does not render tools, the tool listing in the system message and each call as a
    ``<tool_call>`` block, the form the model must emit; a template that renders tools is refused
    (its transcripts would need the template's own ``tools=``, which the SFT loader does not pass)."""
    import types

    from rljax.environments.base import template_renders_tools
    from rljax.environments.tools import tool_system_prompt

    if template_renders_tools(tokenizer):
        raise ValueError("this tokenizer's chat template renders tools itself: the SFT transcripts here are "
                         "written for templates that do not (SmolLM2's)")
    out = []
    for m in demo:
        if m["role"] == "system":
            listed = [types.SimpleNamespace(schema=t) for t in TOOLS]
            out.append({"role": "system", "content": tool_system_prompt(listed, m["content"])})
        elif m.get("tool_calls"):
            out.append({"role": "assistant", "content": (m.get("content") or "") + "".join(
                "<tool_call>" + json.dumps({"name": c["function"]["name"],
                                            "arguments": json.loads(c["function"]["arguments"])}) + "</tool_call>"
                for c in m["tool_calls"])})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "tool_call_id")})
    return out


def check_demonstration(tokenizer, demo: list[dict]) -> dict:
    """Raises ``AssertionError`` unless the SFT transcript of ``demo`` is what the agent sees and
    emits: before each assistant turn the transcript's text and tokens equal the server's prompt for
    the same conversation, and each assistant turn parses back (the server's tool-call parser) into
    the demonstrated calls, the last into a reply scoring 1.0. Returns the token counts."""
    from rljax.data.transcripts import assistant_pieces, transcript_tokens
    from rljax.serve.protocol import ChatRequest, chat_prompt, tool_message

    messages = sft_messages(tokenizer, demo)
    pieces = assistant_pieces(tokenizer, messages)
    ids, mask = transcript_tokens(tokenizer, messages)
    turns = [i for i, m in enumerate(demo) if m["role"] == "assistant"]
    replies = [text for text, is_assistant in pieces if is_assistant]
    assert len(replies) == len(turns), (len(replies), len(turns))
    context, at, n_prompt = "", 0, []
    k = 0
    for text, is_assistant in pieces:
        n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if is_assistant:
            server, _ = chat_prompt(tokenizer, ChatRequest(model="policy", messages=demo[:turns[k]], tools=TOOLS))
            assert context == server, f"turn {k}: the SFT context differs from the server's prompt"
            server_ids = list(tokenizer(server, add_special_tokens=False)["input_ids"])
            assert ids[:at] == server_ids, f"turn {k}: the SFT context's tokens differ from the server's prompt's"
            n_prompt.append(len(server_ids))
            want = demo[turns[k]]
            eot = text.rstrip()
            for stop in (tokenizer.eos_token or "", "<|im_end|>"):
                if stop and eot.endswith(stop):
                    eot = eot[:-len(stop)]
            reply, errors = tool_message(eot, TOOLS)
            assert not errors, errors
            if want.get("tool_calls"):
                got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply["tool_calls"]]
                assert got == [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                               for c in want["tool_calls"]], got
            else:
                assert "tool_calls" not in reply and reply["content"] == want["content"], reply
            k += 1
        context += text
        at += n
    return {"prompt_tokens": n_prompt, "assistant_tokens": int(sum(mask)), "tokens": len(ids)}


def make_sft(tokenizer, n: int, out: str) -> str:
    """Writes ``n`` checked demonstrations of train tasks to ``out/train.jsonl`` (a ``messages``
    column, the SFT loader's) and the held-out tasks' to ``out/eval.jsonl``; returns ``out``."""
    os.makedirs(out, exist_ok=True)
    for split, rows in (("train", tasks(n, "train")), ("eval", tasks(64, "eval"))):
        with open(os.path.join(out, f"{split}.jsonl"), "w") as f:
            for t in rows:
                demo = demonstration(t)
                check_demonstration(tokenizer, demo)
                f.write(json.dumps({"messages": sft_messages(tokenizer, demo), **t}) + "\n")
    return out


def measure(model_name: str, n: int, max_new_tokens: int, concurrency: int) -> dict:
    from rljax.agents import AgentServer, agent_metrics, run_agent_episodes
    from rljax.inference import Engine
    from rljax.models import load
    from rljax.rollout import stop_token_ids

    t0 = time.perf_counter()
    model, tokenizer = load(model_name)[:2]
    server = AgentServer(Engine(model, max_slots=max(concurrency, 1), page_size=16), tokenizer,
                         stop_token_ids=tuple(stop_token_ids(tokenizer, model.config)))
    results = {}
    try:
        for name, agent in (("run (appends)", run), ("run_rewriting (own notes)", run_rewriting)):
            t1 = time.perf_counter()
            episodes = run_agent_episodes(agent, tasks(n, "eval"), server=server, concurrency=concurrency,
                                          temperature=0.0, max_tokens=max_new_tokens, max_transitions=None)
            m = agent_metrics(episodes)
            m["success"] = float(np.mean([e.reward == 1.0 for e in episodes]))
            m["seconds_total"] = time.perf_counter() - t1
            m["example"] = episodes[0].calls[-1].choices[0].text if episodes and episodes[0].calls else ""
            results[name] = m
    finally:
        server.close()
    results["_load_and_serve_s"] = time.perf_counter() - t0
    return results


def write_results(results: dict, path: str, *, model_name: str, n: int, max_new_tokens: int) -> None:
    lines = [f"# Agents on the openai client: `a × b + c` with two tools ({time.strftime('%Y-%m-%d')})", "",
             f"`python experiments/agents/openai_calculator.py --measure --n {n}`: {model_name}, greedy, "
             f"max_tokens {max_new_tokens}, {n} held-out tasks, {platform.processor() or platform.machine()} "
             f"({os.cpu_count()} cores), {results['_load_and_serve_s']:.0f} s in all.", "",
             "| agent | success | calls / episode | tool calls parsed / episode | failed to parse / episode | "
             "transitions / episode | tokens / episode |", "|---|---|---|---|---|---|---|"]
    for name, m in results.items():
        if name.startswith("_"):
            continue
        lines.append(f"| {name} | {m['success']:.2f} | {m['agent/calls_per_episode']:.2f} | "
                     f"{m['agent/tool_calls_parsed']:.2f} | {m['agent/tool_calls_failed']:.2f} | "
                     f"{m['agent/transitions_per_episode']:.2f} | {m['agent/tokens_per_episode']:.1f} |")
    lines += ["", "A last reply of the first episode of each agent:", ""]
    for name, m in results.items():
        if not name.startswith("_"):
            lines.append(f"- {name}: `{m['example'][:300]!r}`")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def train(seed: int, steps: int, run_dir: str, **settings) -> str:
    """Trains :func:`train_config`'s run; returns its directory (``run_dir/seed<seed>``)."""
    from rljax.training import OnlineTrainer

    cfg = train_config(seed, steps, run_dir, **settings)
    OnlineTrainer(cfg).fit()
    return cfg.train.run_dir


def train_config(seed: int, steps: int, run_dir: str, *, model: str = "smollm2-135m-instruct", lora: bool = True,
                 group_size: int = 8, prompts_per_step: int = 4, learning_rate: float = 1e-4, eval_size: int = 64,
                 agent: str = "run", temperature: float = 1.0, eval_temperature: float = 0.0):
    """GRPO on ``agent`` (``run`` or ``run_rewriting``) from ``model`` (a name or a warm-start directory,
    e.g. the SFT run's ``RUN_DIR/model``), LoRA rank 16 when ``lora``, sampling at ``temperature``;
    held-out success at ``eval_temperature`` (0 = greedy; the ``eval_size`` eval tasks, written to
    ``run_dir`` with the train tasks) is ``eval/reward`` before step 1 and after the last step. A
    transition holds at most 640 tokens (the tool listing and question alone are ~261) and the update
    runs 2 rows at a time: a whole batch of joined trajectories in one pass does not fit a 24 GiB host
    (experiments/results/agents_openai_calculator.md)."""
    from rljax.config import from_yaml
    from rljax.run_config import RunConfig

    os.makedirs(run_dir, exist_ok=True)
    paths = {}
    for split, n in (("train", 512), ("eval", eval_size)):  # the same held-out tasks for every seed
        paths[split] = os.path.join(run_dir, f"{split}_tasks.jsonl")
        with open(paths[split], "w") as f:
            f.writelines(json.dumps(t) + "\n" for t in tasks(n, split))
    here = os.path.abspath(__file__)
    out = os.path.join(run_dir, f"seed{seed}")
    lora_yaml = ", lora_rank: 16, lora_alpha: 32" if lora else ""
    return from_yaml(RunConfig, f"""
model: {{name: {model}{lora_yaml}}}
data: {{task: "", path: {paths["train"]}, eval_path: {paths["eval"]}, answer_column: answer, eval_size: {eval_size}}}
sampling: {{max_new_tokens: 96, temperature: {temperature}, eval_temperature: {eval_temperature}, \
max_slots: {max(group_size * prompts_per_step, eval_size)}}}
environment: {{type: agent, function: "{here}:{agent}", concurrency: {max(group_size * prompts_per_step, eval_size)}, max_tokens: 640}}
algorithm: {{name: grpo, group_size: {group_size}, prompts_per_step: {prompts_per_step}, micro_batch_size: 2}}
optim: {{learning_rate: {learning_rate}}}
train: {{steps: {steps}, seed: {seed}, run_dir: {out}, eval_every: {steps}, save_model: false, plot: false}}
""")


def summarize(run_dir: str) -> dict:
    """Per seed (``run_dir/seed*``): held-out success (``eval/reward``, at the run's
    ``sampling.eval_temperature``) before the first step and after the last, the steps and the
    training time; then the mean and standard deviation."""
    import glob

    seeds = {}
    for d in sorted(glob.glob(os.path.join(run_dir, "seed*"))):
        if not os.path.exists(os.path.join(d, "metrics.jsonl")):  # a run stopped before its first metrics
            continue
        with open(os.path.join(d, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        evals = [r for r in rows if "eval/reward" in r]
        steps = [r for r in rows if "time/update_s" in r]
        rewards = [r["reward/total/mean"] for r in steps if "reward/total/mean" in r]
        if len(evals) < 2:
            continue
        seeds[os.path.basename(d)] = {
            "before": evals[0]["eval/reward"], "after": evals[-1]["eval/reward"], "steps": evals[-1].get("step"),
            "train_reward_first5": float(np.mean(rewards[:5])) if rewards else None,
            "train_reward_last5": float(np.mean(rewards[-5:])) if rewards else None,
            "seconds": sum(r["time/sample_s"] + r["time/ref_and_values_s"] + r["time/update_s"] for r in steps)}
    out = {"seeds": seeds}
    for k in ("before", "after"):
        v = np.array([s[k] for s in seeds.values()], dtype=float)
        if len(v):
            out[k] = {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--measure", action="store_true")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--train", action="store_true")
    p.add_argument("--make-sft", action="store_true",
                   help="write --n checked demonstrations of train tasks (and the 64 held-out) to --sft-dir")
    p.add_argument("--sft-dir", default="runs/data/openai_calculator_sft")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, nargs="*", help="--train: one run per seed, one after another")
    p.add_argument("--agent", choices=("run", "run_rewriting"), default="run", help="--train: the agent trained")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--temperature", type=float, default=1.0, help="--train: the sampling temperature")
    p.add_argument("--eval-temperature", type=float, default=0.0,
                   help="--train: the held-out evaluation's temperature (0 = greedy)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--run-dir", default="runs/agents_openai_calculator")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results",
                                                 "agents_openai_calculator.md"))
    args = p.parse_args(argv)
    if args.train:
        for seed in args.seeds or [args.seed]:
            train(seed, args.steps, args.run_dir, model=args.model, group_size=args.group_size,
                  prompts_per_step=args.prompts_per_step, learning_rate=args.lr, agent=args.agent,
                  temperature=args.temperature, eval_temperature=args.eval_temperature)
        print(json.dumps(summarize(args.run_dir), indent=1))
        return
    if args.make_sft:
        from rljax.models import load
        out = make_sft(load(args.model)[1], args.n, args.sft_dir)
        print(f"wrote {args.n} train and 64 held-out demonstrations to {out}")
        return
    if args.smoke:
        from tests._tiny import make_tiny_model_dir
        import tempfile
        args.model = make_tiny_model_dir(os.path.join(tempfile.mkdtemp(), "tiny"))
        args.n, args.max_tokens, args.out = 4, 8, os.path.join(tempfile.mkdtemp(), "smoke.md")
    results = measure(args.model, args.n, args.max_tokens, args.concurrency)
    write_results(results, args.out, model_name=args.model, n=args.n, max_new_tokens=args.max_tokens)
    print(open(args.out).read())


if __name__ == "__main__":
    sys.exit(main())
