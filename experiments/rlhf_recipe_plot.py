"""Learned vs gold reward of the RLHF recipe's policy runs (configs/rlhf_sentiment_{ppo,grpo}.yaml), over steps.

    python experiments/rlhf_recipe_plot.py runs/rlhf_sentiment_ppo runs/rlhf_sentiment_grpo \
        --out experiments/results/rlhf_recipe.png

Reads each run directory's ``metrics.jsonl`` and draws, per run, the held-out learned reward (``eval/rm``: the
reward model the policy is trained against) and the held-out gold score (``eval/sentiment``: the VADER scorer the
preference pairs came from, logged at weight 0) against the step, and the training batch's KL to the reference.
A learned reward that keeps rising while the gold score stalls or falls is over-optimisation. Prints a markdown
table of the first and last evaluation of each run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

LEARNED, GOLD = "eval/rm", "eval/sentiment"
_KL_KEYS = ("kl", "kl/mean", "policy/kl")  # whichever the run logs


def read_curves(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """``{"learned", "gold", "kl"}``: ``(step, value)`` lists from ``run_dir/metrics.jsonl``."""
    curves: dict[str, list[tuple[int, float]]] = {"learned": [], "gold": [], "kl": []}
    with open(Path(run_dir) / "metrics.jsonl") as f:
        for line in f:
            row = json.loads(line)
            if row.get(LEARNED) is not None:
                curves["learned"].append((row["step"], row[LEARNED]))
                curves["gold"].append((row["step"], row[GOLD]))
            kl = next((row[k] for k in _KL_KEYS if row.get(k) is not None), None)
            if kl is not None:
                curves["kl"].append((row["step"], kl))
    return curves


def table(runs: dict[str, dict]) -> str:
    """Markdown: held-out learned and gold reward at the first and last evaluation, and the last KL."""
    lines = ["| run | steps | learned reward (held out) | gold VADER (held out) | KL to reference (last step) |",
             "|---|---|---|---|---|"]
    for name, c in runs.items():
        (s0, r0), (s1, r1) = c["learned"][0], c["learned"][-1]
        g0, g1 = c["gold"][0][1], c["gold"][-1][1]
        kl = f"{c['kl'][-1][1]:.4f}" if c["kl"] else "not logged"
        lines.append(f"| {name} | {s0} → {s1} | {r0:.3f} → {r1:.3f} | {g0:.3f} → {g1:.3f} | {kl} |")
    return "\n".join(lines)


def plot(runs: dict[str, dict], out: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for (name, c), colour in zip(runs.items(), ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        for ax, key in zip(axes, ("learned", "gold", "kl")):
            if c[key]:
                steps, values = zip(*c[key])
                ax.plot(steps, values, marker="o" if key != "kl" else None, color=colour, label=name)
    for ax, title in zip(axes, ("learned reward (reward model), held out", "gold score (VADER), held out",
                                "KL to the reference (training batch)")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dirs", nargs="+", help="policy run directories (their metrics.jsonl)")
    parser.add_argument("--out", default="rlhf_recipe.png", help="PNG to write (default: %(default)s)")
    args = parser.parse_args(argv)
    runs = {Path(d).name: read_curves(d) for d in args.run_dirs}
    missing = [n for n, c in runs.items() if not c["learned"]]
    if missing:
        raise SystemExit(f"no {LEARNED} evaluations in {missing}: are these the recipe's PPO/GRPO runs?")
    plot(runs, args.out)
    print(table(runs))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
