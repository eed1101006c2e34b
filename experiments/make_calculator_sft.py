"""Demonstrations for the calculator agent task: multi-turn transcripts for an SFT warm start.

The task (``rljax.environments.calculator``): multiply a 3-digit by a 2-digit number with a
calculator tool. Each demonstration is a successful episode of the environment itself
(``rljax.environments.calculator.demonstration``), so the SFT stage trains on exactly the messages
the RL stage shows the model:

    system     the environment's instructions and tool schemas (``<tools>...</tools>``, the call format)
    user       What is 313*90?
    assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "313*90"}}</tool_call>
    tool       28170
    assistant  <answer>28170</answer>

    python experiments/make_calculator_sft.py                         # 400 train + 64 held-out
    python experiments/make_calculator_sft.py --n 1000 --out runs/data/calc
    rljax train configs/sft_calculator_smollm2.yaml

Writes ``<out>/train.jsonl`` and ``<out>/eval.jsonl``, one ``{"messages": [...], "question": "313*90",
"answer": "28170"}`` per line (``rljax.data.transcripts.load_transcripts`` reads the ``messages`` column).

Problems: train row ``i`` is episode ``TRAIN_SEEDS[0] + i`` of the environment's train split,
held-out row ``i`` episode ``EVAL_SEEDS[0] + i`` of its eval split. The environment splits by the
question, so no held-out question is ever a train question, for this SFT stage and for the RL
stage's training episodes alike (a first version wrote its own system prompt and "What is 123 *
45?": the SFT model then reached 0.0007 held-out NLL on its own transcripts and solved 0 of 64
episodes of the environment, whose prompt it had never seen).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rljax.environments.calculator import CalculatorEnv, demonstration  # noqa: E402

TRAIN_SEEDS = range(100_000, 200_000)
EVAL_SEEDS = range(200_000, 300_000)


def transcript(seed: int, split: str = "train", env: CalculatorEnv | None = None) -> list[dict[str, str]]:
    """The demonstration of episode ``seed`` of the environment's ``split``: its opening, the
    calculator call, the tool's result, the answer."""
    return demonstration(env or CalculatorEnv(), seed, split)


def make_splits(n: int, eval_n: int) -> tuple[list[dict], list[dict]]:
    """``n`` train and ``eval_n`` held-out rows (the environment's splits: no question in both)."""
    env = CalculatorEnv()

    def rows(seeds, split):
        out = []
        for seed in seeds:
            messages = transcript(seed, split, env)
            out.append({"messages": messages, "question": messages[1]["content"][len("What is "):-1],
                        "answer": messages[3]["content"]})
        return out

    return rows(TRAIN_SEEDS[:n], "train"), rows(EVAL_SEEDS[:eval_n], "eval")


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
