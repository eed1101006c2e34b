"""Demonstrations for the calculator agent task: multi-turn transcripts for an SFT warm start.

The task: multiply a 3-digit by a 2-digit number with a calculator tool. Each demonstration is

    system     CALCULATOR_SYSTEM_PROMPT (the tool's schema and the reply formats)
    user       What is 123 * 45?
    assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "123*45"}}</tool_call>
    tool       5535
    assistant  <answer>5535</answer>

    python experiments/make_calculator_sft.py                         # 400 train + 64 held-out
    python experiments/make_calculator_sft.py --n 1000 --out runs/data/calc
    rljax train configs/sft_calculator_smollm2.yaml

Writes ``<out>/train.jsonl`` and ``<out>/eval.jsonl``, one ``{"messages": [...], "a": .., "b": ..,
"answer": ..}`` per line (``rljax.data.transcripts.load_transcripts`` reads the ``messages`` column).

Problems by seed: problem ``i`` of the train split is drawn from seed ``TRAIN_SEEDS[0] + i``, of the
held-out split from ``EVAL_SEEDS[0] + i``; an RL evaluation should draw from seeds below
``TRAIN_SEEDS[0]``. A held-out problem whose ``(a, b)`` also occurs in the train split is skipped,
so the splits never share a problem.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

TRAIN_SEEDS = range(100_000, 200_000)
EVAL_SEEDS = range(200_000, 300_000)

TOOL_SCHEMA = {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression (integers, + - * / and parentheses) and return the result.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}

# The agent environment's system text must be this (the agent helper's environment imports the final one).
CALCULATOR_SYSTEM_PROMPT = (
    "You are a careful assistant with one tool:\n"
    f"{json.dumps(TOOL_SCHEMA)}\n"
    "To call it, reply with only <tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"...\"}}"
    "</tool_call> and wait for the result. When you know the answer, reply with only <answer>NUMBER</answer>."
)


def problem(seed: int) -> tuple[int, int]:
    """``(a, b)``: a 3-digit and a 2-digit number drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    return int(rng.integers(100, 1000)), int(rng.integers(10, 100))


def transcript(a: int, b: int) -> list[dict[str, str]]:
    """The demonstration of ``a * b``: ask, call the calculator, read its result, answer."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}*{b}"}})
    return [
        {"role": "system", "content": CALCULATOR_SYSTEM_PROMPT},
        {"role": "user", "content": f"What is {a} * {b}?"},
        {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": f"<answer>{a * b}</answer>"},
    ]


def make_splits(n: int, eval_n: int) -> tuple[list[dict], list[dict]]:
    """``n`` train and ``eval_n`` held-out rows (no ``(a, b)`` in both)."""
    train = [problem(TRAIN_SEEDS[i]) for i in range(n)]
    seen, held_out, i = set(train), [], 0
    while len(held_out) < eval_n:
        ab = problem(EVAL_SEEDS[i])
        i += 1
        if ab not in seen:
            seen.add(ab)
            held_out.append(ab)
    def rows(pairs):
        return [{"messages": transcript(a, b), "a": a, "b": b, "answer": str(a * b)} for a, b in pairs]

    return rows(train), rows(held_out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=400, help="train transcripts")
    parser.add_argument("--eval-n", type=int, default=64, help="held-out transcripts")
    parser.add_argument("--out", default="runs/data/calculator_sft")
    args = parser.parse_args(argv)
    train, held_out = make_splits(args.n, args.eval_n)
    os.makedirs(args.out, exist_ok=True)
    for name, rows in (("train", train), ("eval", held_out)):
        with open(os.path.join(args.out, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"wrote {len(train)} train and {len(held_out)} held-out transcripts to {args.out}")


if __name__ == "__main__":
    main()
