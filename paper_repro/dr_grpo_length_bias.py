"""Dr. GRPO's length bias, in miniature: does GRPO make incorrect completions longer?

Paper: Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective" (Dr. GRPO),
arXiv:2503.20783, Figure 5 (and Figure 1 right): under GRPO the output length keeps growing, the
incorrect responses most; with Dr. GRPO (no 1/|o| per-sequence normaliser, no std scaling of
group advantages) the length of incorrect responses stays lower, at similar reward.

Why it should happen: GRPO averages the per-token loss inside each completion (1/|o_i|), so a
long completion's tokens each get a smaller share of its advantage. A wrong long completion is
penalised less per token than a wrong short one, a right short one rewarded more than a right long
one: among wrong completions the long ones survive. Dr. GRPO divides every completion by the same
constant (max_new_tokens) and drops the std scaling, which removes that pull.

Setup (`paper_repro/_arith_policy.py`): two-digit additions ("47+85="); a tiny byte-level Llama
pretrained inside the reproduction (rljax's offline trainer, plain SFT) on answers that are direct
(4 tokens) or a column-by-column scratchpad whose lines are in symbols or in words (21-60 tokens),
with 20 % deliberate slips. The pretrained policy is right about a quarter of the time at
temperature 1. Then three RL runs per seed from that same policy, with rljax's online engine
(`rljax.training.OnlineTrainer`), differing only in two settings:

    GRPO             algorithm.reduction=seq_mean_token_mean     algorithm.advantage_scale=group
    Dr. GRPO         algorithm.reduction=seq_mean_token_sum_norm algorithm.advantage_scale=none
    DAPO token-mean  algorithm.reduction=token_mean              algorithm.advantage_scale=group

Per step we record the reward and the mean length (tokens, EOS included) of the correct and of the
incorrect completions (from `OnlineTrainer.last_rollouts`; the engine logs only the overall mean).

Command:
    python paper_repro/dr_grpo_length_bias.py            # default preset, seeds 0 1 2
    python paper_repro/dr_grpo_length_bias.py --smoke    # seconds, for tests
    python paper_repro/dr_grpo_length_bias.py --medium   # 3-digit sums, 300 steps x 128 samples: ~1.6 h
    python paper_repro/dr_grpo_length_bias.py --full     # toward the paper's scale: one H100
    python paper_repro/dr_grpo_length_bias.py --full --plan h100-1  # does it fit? (rljax plan, no GPU needed)
Writes runs/paper_repro/dr_grpo_length_bias/<preset>/: results.md, curves.json, length_bias.png,
config.json, environment.json; per-run folders under runs/. The pretrained policy is cached in
runs/paper_repro/_cache/arith_policy/<hash>/ (shared with dapo_clip_higher.py).

The --full preset is sized for one NVIDIA H100 80GB; `--plan h100-1` (rljax plan with the cuda
extra, no GPU needed; 2026-11-24): GRPO (the three methods share shapes) fits, peak 2.21 GiB per GPU
of the 59.33 GiB JAX's allocator takes (75 % of the 79.11 GiB GPU), in the update.

Hardware and run time: a shared 2-core CPU (jax CPU backend); default preset measured at
6.3 min for the 9 RL runs (3 methods x 3 seeds x 200 steps, about 0.2 s a step) on a quiet
machine, plus 1.0 min of pretraining the first time (cached afterwards). The medium preset
(2026-11-25): 98.9 min for its 9 runs of 300 steps (1.0-1.1 s a step alone, up to 3.9 s while the
test suite and two other reproductions shared the CPU), plus 3.6 min of pretraining; peak RSS 3.8 GB.

Result of the medium preset (3-digit sums, a 3-layer policy right 59 % of the time at temperature
1, scratchpads up to 92 tokens; 300 steps of 16 prompts x 8; seeds 0 1 2; last 30 steps): **no**.
Incorrect completions grew by ~20 tokens under every method (GRPO 21.2 ± 1.1, Dr. GRPO 20.0 ± 4.4,
DAPO token-mean 21.2 ± 1.8) and correct ones by 6-8; GRPO's incorrect completions ended 3.1 ± 3.8
tokens longer than Dr. GRPO's (growth gap 1.1 ± 3.5), within the seed spread, and Dr. GRPO's reward
was higher (0.929 vs 0.895, every seed). The growth is a change of style every method makes: the
pretrained policy's worded scratchpads (the long style) were right 77 % of the time against 4 % for
direct answers, and after RL 99.5-99.7 % of completions use them. Here the reward itself favours
length, which swamps the per-token 1/|o| effect the paper isolates; a task where length does not
buy accuracy would be needed to see it at this scale.

Deviations from the paper (numbered):
1. Model and task: a 2-layer, 128-wide byte-level Llama pretrained here on a synthetic addition
   corpus, instead of Qwen2.5-Math-1.5B / 7B on MATH; "long" means 60 tokens, not thousands.
2. Scale: 200 steps of 8 prompts x 8 samples (the paper: hundreds of steps, 128 prompts x 8);
   max_new_tokens 64 (so Dr. GRPO's constant is 64, not 3000+).
3. One update per batch of rollouts (mu = 1, one mini-batch), so the clipped surrogate never clips;
   no KL term (as the paper's Dr. GRPO runs); learning rate 1e-4 with Adam (clip at grad norm 1).
4. The learning rate was chosen in separate 200-step GRPO trials on seed 100 (not a measured
   seed), before the measured runs: at 5e-4 the reward fell (0.19 -> 0.13-0.19 over 200 steps),
   at 1e-4 it rose (0.23 in the first 20 steps -> 0.33). An earlier 60-step default at 5e-4
   (reward fell under every method) was discarded for that reason. Seeds were not chosen.
5. One pretrained policy for all seeds: the seeds vary the RL prompt order and sampling only.
6. Lengths are per step over the 64 sampled completions; the table averages the last 20 steps
   (final window) and the change from the first 20 steps.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paper_repro import _arith_policy as ap  # noqa: E402
from rljax.host_memory import keep_host_memory  # noqa: E402
from rljax.tools.reporting import markdown_table, mean_std  # noqa: E402

NAME = "dr_grpo_length_bias"

METHODS = {
    "GRPO": ["algorithm.reduction=seq_mean_token_mean", "algorithm.advantage_scale=group"],
    "Dr. GRPO": ["algorithm.reduction=seq_mean_token_sum_norm", "algorithm.advantage_scale=none"],
    "DAPO token-mean": ["algorithm.reduction=token_mean", "algorithm.advantage_scale=group"],
}

CLAIMS = {
    "GRPO": "incorrect completions keep growing longer",
    "Dr. GRPO": "incorrect lengths stay lower (no length bias), similar reward",
    "DAPO token-mean": "not in the figure (token-level mean removes 1/|o|, keeps std scaling)",
}

PRESETS = {
    "smoke": dict(spec=ap.PolicySpec.smoke(), steps=2, prompts=2, group=4, seeds=(0,), window=1, lr=1e-4),
    "default": dict(spec=ap.PolicySpec(), steps=200, prompts=8, group=8, seeds=(0, 1, 2), window=20, lr=1e-4),
    # 1.6 h on the 2-core CPU (measured 2026-11-25): three-digit sums (scratchpads up to 92 tokens), a 3-layer
    # policy, 1.5x the steps and twice the prompts of the default (issue 17 §4: the default showed
    # no length bias; the paper's effect builds over hundreds of steps of long completions)
    "medium": dict(spec=ap.PolicySpec(digits=3, layers=3, hidden=128, sft_size=12000, sft_steps=1500),
                   steps=300, prompts=16, group=8, seeds=(0, 1, 2), window=30, lr=1e-4),
    "full": dict(spec=ap.PolicySpec(digits=3, layers=4, hidden=256, heads=8, kv_heads=4, sft_size=20000,
                                    sft_steps=3000, sft_batch=64, sft_lr=1e-3),
                 steps=300, prompts=32, group=8, seeds=(0, 1, 2, 3, 4), window=30, lr=2e-4),
}



def verdict(per_seed: dict[str, list[dict]]) -> str:
    """The plain claim line: GRPO's incorrect length grows more than Dr. GRPO's, at similar reward."""
    g, d = per_seed["GRPO"], per_seed["Dr. GRPO"]
    n = min(len(g), len(d))
    growth = np.asarray([g[i]["d_len_incorrect"] - d[i]["d_len_incorrect"] for i in range(n)])
    final = np.asarray([g[i]["len_incorrect"] - d[i]["len_incorrect"] for i in range(n)])
    reward_gap = np.asarray([g[i]["reward"] - d[i]["reward"] for i in range(n)])
    similar = abs(np.nanmean(reward_gap)) <= 0.1
    facts = (f"GRPO minus Dr. GRPO, paired by seed: growth of incorrect length {mean_std(growth)} tokens, "
             f"final incorrect length {mean_std(final)} tokens, final reward {mean_std(reward_gap)}")
    growth_says, final_says = ap.clearly_positive(growth), ap.clearly_positive(final)
    if growth_says == final_says == "yes" and similar:
        answer = "yes"
    elif "no" not in (growth_says, final_says):
        answer = "partly"
    else:
        answer = "no"
    return f"**claim reproduced: {answer}** — {facts}."


def main(argv=None) -> dict:
    keep_host_memory()  # process-wide malloc settings, before any JAX work (rljax/host_memory.py)
    run = ap.setup(NAME, __doc__.splitlines()[0], argv, PRESETS)
    preset, out, p, seeds, steps, log = run.preset, run.out, run.p, run.seeds, run.steps, run.log
    spec, model_dir, policy_stats = run.spec, run.model_dir, run.policy_stats
    t_rl = time.perf_counter()
    common = run.common("algorithm.mini_batches=1")
    if run.plan:  # the three methods differ in loss settings only: the same shapes
        run.plan_and_exit(METHODS, common, ["GRPO"])
    curves, cfg = ap.run_methods(spec, model_dir, out, METHODS, common, seeds, log=log)
    rl_seconds = time.perf_counter() - t_rl

    w = p["window"]
    per_seed = {m: [{"reward": ap.final_window(rows, "reward", w),
                     "len_correct": ap.final_window(rows, "len_correct", w),
                     "len_incorrect": ap.final_window(rows, "len_incorrect", w),
                     "d_len_correct": ap.final_window(rows, "len_correct", w) - ap.first_window(rows, "len_correct", w),
                     "d_len_incorrect": (ap.final_window(rows, "len_incorrect", w)
                                         - ap.first_window(rows, "len_incorrect", w)),
                     "verbose_frac": ap.final_window(rows, "verbose_frac", w),
                     "entropy": ap.final_window(rows, "policy/entropy", w)}
                    for rows in runs] for m, runs in curves.items()}
    headers = ["method", "reward", "len correct", "len incorrect", "Δ len correct", "Δ len incorrect",
               "worded share", "paper's claim"]
    rows = [[m] + [mean_std([s[k] for s in per_seed[m]])
                   for k in ("reward", "len_correct", "len_incorrect", "d_len_correct", "d_len_incorrect",
                             "verbose_frac")] + [CLAIMS[m]]
            for m in METHODS]
    plot_path = os.path.join(out, "length_bias.png")
    ap.plot_curves(curves, [("reward", "reward (accuracy)"), ("len_correct", "length of correct (tokens)"),
                            ("len_incorrect", "length of incorrect (tokens)"), ("len_all", "mean length (tokens)")],
                   plot_path, smooth=max(1, min(5, steps // 4)),
                   title=f"Dr. GRPO length bias, tiny addition policy (mean ± std over {len(seeds)} seeds)")
    text = run.report(
        title=f"# Dr. GRPO length bias (arXiv:2503.20783, Fig. 5) — preset `{preset}`",
        description=(
            f"Tiny byte-level Llama ({spec.layers} layers, width {spec.hidden}) pretrained here on {spec.digits}-digit "
            f"additions (direct answers or scratchpads in symbols or words); accuracy at temperature 1 before RL "
            f"{policy_stats['accuracy']:.3f}, mean length {policy_stats['mean_length']:.1f} tokens. "
            f"{steps} RL steps of {p['prompts']} prompts x {p['group']} samples, max_new_tokens {spec.max_new_tokens}, "
            f"seeds {list(seeds)}. Values: mean over the last {w} steps, mean ± std over seeds; Δ = last {w} steps "
            f"minus first {w}. Lengths in tokens (EOS included). \"Worded share\": completions with a line in words "
            f"(the long style)."),
        table=markdown_table(headers, rows), verdict=verdict(per_seed), plot_name="length_bias.png",
        rl_seconds=rl_seconds,
        meta={"window": w, "methods": METHODS, "common_overrides": common, "rl_config_example": cfg})
    return {"out": out, "per_seed": per_seed, "results": text}


if __name__ == "__main__":
    main()
