"""How well does the embedded SmolLM2-135M-Instruct judge? Agreement with a verifier on additions.

Question: used as the ``judge`` reward (rljax/rewards/judge.py) on a task whose answers are known,
does the small judge tell right answers from wrong ones?

    python experiments/judge_smollm2.py                 # 100 pointwise samples, 12 groups of 4
    python experiments/judge_smollm2.py --smoke         # a few samples (seconds on a tiny model: tests)

Samples: two-digit additions "What is a + b?" (seeded), each answered ``<answer>N</answer>`` with
the right sum (half of them) or the sum ± 1..10. The verifier's correctness is the truth.

* **pointwise**: P(yes) to "Is the response correct?" per sample; reported: AUC of P(yes) against
  correctness (0.5 = chance), accuracy of ``P(yes) > 0.5`` and of ``P(yes) >`` the median, the mean
  P(yes) of right and of wrong answers.
* **group** (RULER-style): groups of four responses to one question (two right, two wrong); reported:
  how many replies parsed (first attempt / after one retry), how many groups fell back, and the
  pairwise accuracy (a right answer scored above a wrong one, ties half) over the parsed groups.

Writes experiments/results/judge_smollm2.md (or ``--out``). CPU, float32; a few minutes.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np

from rljax.rewards.judge import JudgeModel, judge_groups, pointwise_messages


def samples(n: int, seed: int) -> list[dict]:
    """``n`` additions, alternately right and wrong answers."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        a, b = (int(x) for x in rng.integers(10, 100, size=2))
        shown = a + b if i % 2 == 0 else a + b + int(rng.choice([-1, 1])) * int(rng.integers(1, 11))
        out.append({"prompt": f"What is {a} + {b}?", "response": f"<answer>{shown}</answer>", "correct": shown == a + b})
    return out


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """P(score of a random positive > score of a random negative), ties half."""
    pos, neg = scores[labels], scores[~labels]
    greater = (pos[:, None] > neg[None, :]).mean()
    ties = (pos[:, None] == neg[None, :]).mean()
    return float(greater + 0.5 * ties)


def pointwise(judge: JudgeModel, rows: list[dict], **words) -> dict:
    conversations = [pointwise_messages(r["prompt"], r["response"], question="Is the response correct?") for r in rows]
    t0 = time.perf_counter()
    p = judge.yes_probability(conversations, **words)
    labels = np.asarray([r["correct"] for r in rows])
    return {"n": len(rows), "seconds": time.perf_counter() - t0, "auc": auc(p, labels),
            "acc_half": float(np.mean((p > 0.5) == labels)), "acc_median": float(np.mean((p > np.median(p)) == labels)),
            "p_right": float(p[labels].mean()), "p_wrong": float(p[~labels].mean()),
            "p_min": float(p.min()), "p_max": float(p.max())}


def grouped(judge: JudgeModel, groups: int, seed: int, max_new_tokens: int) -> dict:
    rng = np.random.default_rng([seed, 1])
    batch, labels = [], []
    for row in samples(groups, seed + 1):
        a, b = (int(x) for x in row["prompt"][len("What is "):-1].split(" + "))
        wrong = [a + b + int(s) * int(rng.integers(1, 11)) for s in rng.choice([-1, 1], size=2)]
        answers = [a + b, a + b, *wrong]
        order = rng.permutation(4)
        batch.append((row["prompt"], [f"<answer>{answers[j]}</answer>" for j in order]))
        labels.append(order < 2)
    t0 = time.perf_counter()
    scores, replies, counts = judge_groups(judge, batch, retries=1, fallback=None, seed=seed,
                                           max_new_tokens=max_new_tokens)
    right = total = 0.0
    parsed = 0
    for s, lab in zip(scores, labels):
        if not np.isfinite(s).all():
            continue
        parsed += 1
        for i in np.flatnonzero(lab):
            for j in np.flatnonzero(~lab):
                total += 1
                right += 1.0 if s[i] > s[j] else 0.5 if s[i] == s[j] else 0.0
    return {"groups": groups, "seconds": time.perf_counter() - t0, "counts": dict(counts), "fully_parsed": parsed,
            "pair_accuracy": right / total if total else float("nan"), "example_reply": replies[0] if replies else ""}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--groups", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="4 samples, 1 group, 8 new tokens")
    parser.add_argument("--out", default="experiments/results/judge_smollm2.md")
    args = parser.parse_args(argv)
    if args.smoke:
        args.n, args.groups, args.max_new_tokens = 4, 1, 8
    from rljax.models import load

    t0 = time.perf_counter()
    model, tokenizer = load(args.model)
    judge = JudgeModel(model, tokenizer, batch_size=8, max_prompt_length=1024)
    words = {}
    if len(tokenizer("Yes", add_special_tokens=False)["input_ids"]) != 1:  # the byte-level tiny test tokenizer
        words = {"yes_words": ("Y", "y"), "no_words": ("N", "n")}
    pw = pointwise(judge, samples(args.n, args.seed), **words)
    gr = grouped(judge, args.groups, args.seed, args.max_new_tokens)
    c = gr["counts"]
    verdict = ("no better than chance" if abs(pw["auc"] - 0.5) < 0.1 else
               "better than chance" if pw["auc"] > 0.5 else "worse than chance")
    reply = gr["example_reply"].replace("\n", " ")[:300]
    text = f"""# How well the embedded SmolLM2-135M-Instruct judges (experiments/judge_smollm2.py)

Model `{args.model}`, float32, CPU ({platform.processor() or platform.machine()}); seed {args.seed};
{time.perf_counter() - t0:.0f} s in all. Task: two-digit additions answered `<answer>N</answer>`, right
or off by 1..10; the verifier's correctness is the truth.

## Pointwise: P(yes) to "Is the response correct?" ({pw['n']} samples, half right)

| AUC (0.5 = chance) | acc. P(yes) > 0.5 | acc. P(yes) > median | mean P(yes) right | mean P(yes) wrong | P(yes) range |
|---|---|---|---|---|---|
| {pw['auc']:.3f} | {pw['acc_half']:.2f} | {pw['acc_median']:.2f} | {pw['p_right']:.3f} | {pw['p_wrong']:.3f} | {pw['p_min']:.3f}-{pw['p_max']:.3f} |

({pw['seconds']:.1f} s.)

## Group (RULER-style): {gr['groups']} groups of 4 (2 right, 2 wrong), 1 retry, no fallback

| groups | parse failures (attempts) | retries | groups with no score (fallback) | scores missing | fully parsed groups | pairwise accuracy (parsed) |
|---|---|---|---|---|---|---|
| {c.get('groups', 0)} | {c.get('parse_failures', 0)} | {c.get('retries', 0)} | {c.get('fallback_groups', 0)} | {c.get('fallback_scores', 0)} | {gr['fully_parsed']} | {gr['pair_accuracy']:.2f} |

({gr['seconds']:.1f} s, at most {args.max_new_tokens} new tokens.) First group's reply: `{reply}`

## Reading

Pointwise AUC {pw['auc']:.2f}: {verdict}. The group judge gave every response a score in
{gr['fully_parsed']} of {gr['groups']} groups.
"""
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
