"""Back to Basics, in miniature: PPO's clipping, GAE's λ, and RLOO against PPO at equal samples.

Paper: Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
Human Feedback in LLMs", arXiv:2402.14740: section 3 / Figure 1 (PPO's clipping is rarely active
from a good SFT policy), Figure 2 (GAE: λ = 1, no bias, does best), Table 1 and Figure 3 (RLOO with
k = 4 matches or beats PPO, vanilla policy gradient and RAFT in reward, at the same number of
generated samples and a comparable KL to the reference).

Claims tested: starting from an SFT policy,
(a) PPO's clipping rarely fires (the share of clipped tokens stays small);
(b) GAE λ = 1 does best among λ ∈ {0, 0.5, 0.95, 1};
(c) RLOO (k = 4, the REINFORCE loss over whole sequences, KL-penalised sequence reward) matches or
    beats PPO at the same number of generated samples, at no larger KL;
(d) REINFORCE with a moving-average baseline (the paper's "REINFORCE w/ baseline", b_MA: the mean
    of the rewards seen so far) also matches or beats PPO (Table 1 ranks it above PPO, below RLOO).

Setup (`paper_repro/_arith_policy.py`, shared with dr_grpo_length_bias.py and dapo_clip_higher.py):
two-digit additions; a tiny byte-level Llama pretrained inside the reproduction (rljax's offline
trainer, plain SFT) on direct answers and scratchpads with 20 % deliberate slips, right about a
quarter of the time at temperature 1; reward 1 when the completion's last number is the sum. Then
one RL run per method and seed from that policy with rljax's online engine
(`rljax.training.OnlineTrainer`), every method drawing the same number S of completions per step
(S prompts x 1 for PPO and REINFORCE++, S/k prompts x k for the group methods), with the same KL
coefficient β to the SFT reference and the same learning rate:

    PPO λ=0 / 0.5 / 0.95 / 1   algorithm.name=ppo lam=λ gamma=1 critic=separate kl_coef=β (k1 per-token KL in the
                               reward, GAE, whitened advantages, clipped surrogate ε=0.2, clipped value loss)
    RLOO k=2, k=4              algorithm.name=rloo loss=reinforce group_size=k kl_coef=β (the paper's form)
    GRPO                       algorithm.name=grpo group_size=4 kl_coef=β (k3 KL in the loss)
    REINFORCE++                algorithm.name=reinforce_pp kl_coef=β (k1 KL in the reward, batch-whitened returns)
    REINFORCE, moving avg.     algorithm.name=reinforce kl_coef=β (REINFORCE loss; baseline = mean of every earlier
                               KL-penalised reward, carried across steps and checkpointed)

The clipped-surrogate methods (PPO, GRPO, REINFORCE++) make 2 passes over 2 mini-batches per step
(4 updates; the first update of a step has ratio 1, so at most 3 of 4 can clip); the REINFORCE
losses (RLOO, moving-average REINFORCE) have no ratio and make one update per step, as in the paper.

Per step: the reward of the sampled completions, their KL to the reference measured the same way
for every method (the sequence sum of ``log π_old − log π_ref`` over the sampled tokens, k1: an
unbiased estimate of KL(π_old ‖ π_ref) per completion), the clip fraction (``policy/clip_frac_low``
+ ``policy/clip_frac_high``: the share of tokens whose ratio was clipped, mean over the step's
updates) and the step's wall time. At the end of each run: greedy accuracy on the 128 held-out
questions (`OnlineTrainer.evaluate`) and the size of the training state (policy, optimizer state,
reference copy, critic and its optimizer state) in MB.

Command:
    python paper_repro/rloo_vs_ppo.py            # default preset, seeds 0 1 2
    python paper_repro/rloo_vs_ppo.py --smoke    # seconds, for tests
    python paper_repro/rloo_vs_ppo.py --full     # toward the paper's scale: one H100
    python paper_repro/rloo_vs_ppo.py --full --plan h100-1  # does it fit? (rljax plan, no GPU needed)
Writes runs/paper_repro/rloo_vs_ppo/<preset>/: results.md, curves.json, rloo_vs_ppo.png (reward, KL,
clip fraction and step time per step), reward_vs_kl.png, config.json, environment.json; per-run
folders under runs/. The pretrained policy is cached in runs/paper_repro/_cache/arith_policy/<hash>/
(shared with the other arithmetic reproductions).

The --full preset is sized for one NVIDIA H100 80GB; `--plan h100-1` (rljax plan with the cuda
extra, no GPU needed; 2026-11-24): PPO with its separate critic (the largest method) fits, peak 1.15
GiB per GPU of the 59.33 GiB JAX's allocator takes (75 % of the 79.11 GiB GPU), in the update.

Hardware and run time: a shared 2-core CPU (jax CPU backend). The default preset (27 RL runs: 9
methods x 3 seeds x 120 steps) took 37.4 min on 2026-11-25 while another reproduction shared the CPU,
plus 2.4 min of pretraining the first time (cached afterwards); peak RSS 4.9 GB. Step times in
results.md are from that shared machine: compare them with each other only.
`--report-only` rebuilds results.md and the plots from the runs in curves.json without training
(pass the same preset, --seeds and --steps).

Result of the default preset (2026-11-25, seeds 0 1 2; mean ± std over seeds, last 20 steps):
(a) yes: PPO clipped 0.20 % ± 0.03 % of its tokens (largest run 0.24 %);
(b) partly: final reward rises with λ, 0.283 / 0.287 / 0.308 / 0.327 for λ = 0 / 0.5 / 0.95 / 1,
    but λ = 1 is not above λ = 0.95 in every seed (gap 0.019 ± 0.021);
(c) yes: RLOO k=4 0.326 ± 0.031 matches PPO λ=1 0.327 ± 0.019 (gap −0.002 ± 0.043) at 0.29 nats of
    KL against PPO's 0.99, with held-out greedy accuracy 0.812 vs 0.659; at PPO's reward when its
    KL reached RLOO's, RLOO is ahead by 0.046 ± 0.029;
(d) yes: REINFORCE with the moving-average baseline 0.324 ± 0.005 matches PPO λ=1 (gap −0.003 ±
    0.018) at 0.37 nats (accuracy 0.810), level with RLOO k=4 (−0.001 ± 0.028), not below it as
    in the paper's Table 1. RLOO's and REINFORCE's steps are ~3.5x faster than PPO's (one update,
    no critic) and their state 5.0 MB vs PPO's 8.8 MB (the separate critic).
The first measured run of this preset (2026-11-24: 8 methods, before REINFORCE existed, another
pretraining of the same policy spec, on a heavily loaded machine) had (b) yes and (c) no (RLOO k=4
0.282 vs PPO λ=1 0.320, gap −0.038 ± 0.016): with 3 seeds and 120 steps the RLOO-vs-PPO gap is
within its run-to-run spread, and the two runs disagree on it; the verdicts are reported as
measured, not chosen.

Deviations from the paper (numbered):
1. Model and task: a 2-layer, 128-wide byte-level Llama pretrained here on synthetic additions,
   with an exact verifier as the reward, instead of Pythia-6.9B / Llama-7B on TL;DR summarisation
   and Anthropic-HH with a learned reward model; completions of at most 64 tokens.
2. Scale: short runs of S = 32 completions per step (the paper: 512 samples per batch, thousands of
   steps); the same number of samples per step for every method, so "per step" is "per sample".
3. Methods: REINFORCE with the moving-average baseline (added 2026-11-24, `algorithm.name=reinforce`)
   uses the mean of all earlier rewards (the first step: its own batch's mean); vanilla PG without
   a baseline and RAFT are not run. REINFORCE++ (whitened returns over the batch) stands for the
   batch-baseline REINFORCE family, GRPO for the group-normalised one.
4. PPO's critic is a separate copy of the SFT policy with a fresh zero-initialised value head (the
   paper starts it from the reward model, which a verifier does not have).
5. KL coefficient β = 0.05 for every method (TRL RLOOTrainer's default), learning rate 1e-4 (Adam,
   gradient clip 1, from the separate 200-step GRPO trials on seed 100 made for
   dr_grpo_length_bias.py); nothing was tuned on these runs, seeds were not chosen.
6. "At the same KL" is checked, not enforced: the verdict of (c) compares reward paired by seed
   and requires RLOO's final KL to be no more than 10 % above PPO's; PPO here is the λ with the
   best mean final reward (favouring PPO).
7. One pretrained policy for all seeds: seeds vary the RL prompt order and sampling only. The
   table averages the last `window` steps of each curve (the final window).
8. RLOO makes one optimizer update per step against the clipped methods' four, at the same learning
   rate (the paper's forms); the equal-samples comparison does not equalise optimizer steps.
9. Before the measured runs, one 30-step run of every method on seed 100 checked the timing and that
   each method runs; nothing was changed after it. The equal-KL line of (c) was added after the
   first two measured seeds had been read; it is descriptive and does not enter the verdict.
10. The smoke preset runs four methods (PPO λ = 0 and 1, RLOO k=4, moving-average REINFORCE), one step:
   each method compiles its own update, and those four reach every verdict.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paper_repro import _arith_policy as ap  # noqa: E402
from rljax.host_memory import keep_host_memory  # noqa: E402
from rljax.tools.reporting import markdown_table, mean_std  # noqa: E402

NAME = "rloo_vs_ppo"
LAMBDAS = (0.0, 0.5, 0.95, 1.0)
PPO = {lam: f"PPO λ={lam:g}" for lam in LAMBDAS}
RLOO2, RLOO4, GRPO, RPP = "RLOO k=2", "RLOO k=4", "GRPO k=4", "REINFORCE++"
MA = "REINFORCE, moving avg."

CLAIMS = {
    **{PPO[lam]: "clipping rarely fires" + ("; λ=1 best" if lam == 1.0 else "") for lam in LAMBDAS},
    RLOO2: "(Table 1) beats PPO at equal samples",
    RLOO4: "matches or beats PPO at equal samples and KL",
    MA: "(Table 1) beats PPO, below RLOO",
    GRPO: "not in the paper",
    RPP: "not in the paper",
}

PRESETS = {
    # smoke: the fewest methods that reach every verdict (each method compiles its own update, seconds each)
    "smoke": dict(spec=ap.PolicySpec.smoke(), steps=1, samples=8, mini_batches=2, iterations=2, seeds=(0,),
                  window=1, lr=1e-4, kl_coef=0.05, methods=(PPO[0.0], PPO[1.0], RLOO4, MA)),
    "default": dict(spec=ap.PolicySpec(), steps=120, samples=32, mini_batches=2, iterations=2, seeds=(0, 1, 2),
                    window=20, lr=1e-4, kl_coef=0.05),
    "full": dict(spec=ap.PolicySpec(digits=3, layers=4, hidden=256, heads=8, kv_heads=4, sft_size=20000,
                                    sft_steps=3000, sft_batch=64, sft_lr=1e-3),
                 steps=400, samples=256, mini_batches=4, iterations=2, seeds=(0, 1, 2), window=40, lr=1e-4,
                 kl_coef=0.05),
}


def methods(p: dict) -> dict[str, list[str]]:
    """Each method's overrides for the preset ``p`` (only ``p["methods"]`` when given): the algorithm
    first (naming it resets the section), then ``p["samples"]`` completions per step, the KL
    coefficient and the update schedule."""
    s, beta = p["samples"], p["kl_coef"]
    clipped = [f"algorithm.num_iterations={p['iterations']}", f"algorithm.mini_batches={p['mini_batches']}"]

    def per_step(group: int) -> list[str]:
        if s % group:
            raise ValueError(f"samples per step ({s}) must be a multiple of the group size {group}")
        return [f"algorithm.group_size={group}", f"algorithm.prompts_per_step={s // group}",
                f"algorithm.kl_coef={beta}"]

    out = {PPO[lam]: ["algorithm.name=ppo", *per_step(1), f"algorithm.lam={lam}", "algorithm.gamma=1.0",
                      "algorithm.critic=separate", *clipped] for lam in LAMBDAS}
    for label, k in ((RLOO2, 2), (RLOO4, 4)):
        out[label] = ["algorithm.name=rloo", *per_step(k), "algorithm.loss=reinforce"]
    out[GRPO] = ["algorithm.name=grpo", *per_step(4), *clipped]
    out[RPP] = ["algorithm.name=reinforce_pp", *per_step(1), *clipped]
    # the paper's b_MA: the mean of every earlier reward (baseline_decay null), one update per step
    out[MA] = ["algorithm.name=reinforce", *per_step(1)]
    return {m: o for m, o in out.items() if m in p.get("methods", out)}


def kl_and_clip_row(trainer, metrics: dict) -> dict[str, float]:
    """Per step, the same for every method: the mean sequence KL of the sampled completions to the
    reference (k1 summed over each completion's tokens) and the clip fraction (NaN without a ratio)."""
    from rljax.training.online import rollout_batch, score_logprobs

    run = trainer.run
    batch = rollout_batch(trainer.last_rollouts, mask_truncated=False)
    # every preset has kl_coef > 0, so run.reference() is the kept SFT copy, not the current policy
    ref = np.asarray(score_logprobs(run.policy.graphdef, run.reference(), run.policy.frozen, batch,
                                    temperature=trainer.cfg.sampling.temperature))
    mask = np.asarray(batch.loss_mask, dtype=np.float64)
    kl_seq = ((np.asarray(batch.old_logprobs, dtype=np.float64) - ref) * mask).sum(-1)  # [R]
    clip = metrics.get("policy/clip_frac_low", np.nan) + metrics.get("policy/clip_frac_high", np.nan)
    return {"kl": float(kl_seq.mean()), "clip_frac": float(clip),
            "value/explained_variance": float(metrics.get("value/explained_variance", np.nan))}


def _state_mb(run) -> float:
    """Megabytes of the arrays a run holds: policy, optimizer state, reference copy, critic (+ its state)."""
    import jax

    trees = [run.state(), run.ref_params]
    return sum(x.nbytes for tree in trees for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "nbytes")) / 2**20


def held_out_row(trainer) -> dict[str, float]:
    """At the end of a run: greedy accuracy on the held-out questions and the training state's size."""
    results = trainer.evaluate()
    return {"eval_correct": float(results[f"eval/{ap.CORRECT}"]), "state_mb": _state_mb(trainer.run)}


KEYS = {"reward": "reward", "kl": "kl", "clip_frac": "clip_frac", "step_s": "step_s", "len": "len_all"}


def summarise(curves: dict[str, list[list[dict]]], window: int) -> dict[str, list[dict]]:
    """Per method and seed: final-window means of ``KEYS``, the whole-run clip fraction and the
    end-of-run values (held-out accuracy, state size)."""
    per_seed = {}
    for m, runs in curves.items():
        per_seed[m] = [{**{name: ap.final_window(rows, key, window) for name, key in KEYS.items()},
                        "clip_frac_all": ap.final_window(rows, "clip_frac", len(rows)),
                        "eval_correct": rows[-1].get("eval_correct", np.nan),
                        "state_mb": rows[-1].get("state_mb", np.nan)} for rows in runs]
    return per_seed


def _mean(per_seed, m, key) -> float:
    values = [s[key] for s in per_seed.get(m, [])]
    return float(np.nanmean(values)) if np.isfinite(values).any() else float("nan")


def _paired(per_seed, a, b, key) -> np.ndarray:
    n = min(len(per_seed[a]), len(per_seed[b]))
    return np.asarray([per_seed[a][i][key] - per_seed[b][i][key] for i in range(n)], dtype=np.float64)


def _lambdas(per_seed) -> list[float]:
    """The λ of the PPO runs present (the smoke preset runs two)."""
    return [lam for lam in LAMBDAS if PPO[lam] in per_seed]


def verdict_clipping(per_seed) -> tuple[str, str]:
    """(a): every PPO run clips under 5 % of tokens over the whole run -> yes; their mean under 5 % -> partly."""
    fracs = np.asarray([s["clip_frac_all"] for lam in _lambdas(per_seed) for s in per_seed[PPO[lam]]],
                       dtype=np.float64)
    if np.all(fracs < 0.05):
        answer = "yes"
    elif np.mean(fracs) < 0.05:
        answer = "partly"
    else:
        answer = "no"
    return answer, (f"clipped share of PPO's tokens over whole runs (all λ, all seeds): {mean_std(fracs, 4)}, "
                    f"largest {np.max(fracs):.4f} (threshold 0.05)")


def verdict_lambda(per_seed) -> tuple[str, str]:
    """(b): λ = 1 beats every other λ in final reward (``clearly_positive`` of the paired gaps): yes when
    every gap says yes, no when λ = 1 is not the best mean or any gap says no, else partly."""
    lambdas = _lambdas(per_seed)
    means = {lam: _mean(per_seed, PPO[lam], "reward") for lam in lambdas}
    best = max(means, key=lambda lam: means[lam])
    gaps = {lam: _paired(per_seed, PPO[1.0], PPO[lam], "reward") for lam in lambdas if lam != 1.0}
    says = {lam: ap.clearly_positive(g) for lam, g in gaps.items()}
    if best != 1.0 or "no" in says.values():
        answer = "no"
    elif all(v == "yes" for v in says.values()):
        answer = "yes"
    else:
        answer = "partly"
    facts = "; ".join(f"λ=1 minus λ={lam:g}: {mean_std(g)}" for lam, g in gaps.items())
    return answer, "final reward by λ: " + ", ".join(f"{lam:g}: {means[lam]:.3f}" for lam in lambdas) + f"; {facts}"


def best_ppo(per_seed) -> str:
    """The PPO variant with the highest mean final reward (the strongest PPO of the sweep)."""
    return max((PPO[lam] for lam in _lambdas(per_seed)), key=lambda m: _mean(per_seed, m, "reward"))


def reward_at_kl(rows: list[dict], kl: float, window: int) -> float:
    """The ``window``-step trailing mean of the reward at the first step where the same mean of the
    KL reaches ``kl`` (NaN if it never does): a run's reward at a given KL to the reference."""
    kl_ma = ap.moving_average([r["kl"] for r in rows], window)
    reward_ma = ap.moving_average([r["reward"] for r in rows], window)
    reached = np.flatnonzero(kl_ma >= kl)
    return float(reward_ma[reached[0]]) if len(reached) else float("nan")


def equal_kl_gaps(curves: dict[str, list[list[dict]]], method: str, ppo: str, window: int) -> np.ndarray:
    """Per seed: ``method``'s final reward minus ``ppo``'s reward when its KL first reached ``method``'s
    final KL (``reward_at_kl``; both over ``window`` steps)."""
    n = min(len(curves[method]), len(curves[ppo]))
    out = []
    for i in range(n):
        rows = curves[method][i]
        final_kl = ap.final_window(rows, "kl", window)
        out.append(ap.final_window(rows, "reward", window) - reward_at_kl(curves[ppo][i], final_kl, window))
    return np.asarray(out, dtype=np.float64)


def verdict_vs_ppo(per_seed, method: str, curves=None, window: int = 20) -> tuple[str, str]:
    """``method`` (RLOO k=4 for (c), the moving-average REINFORCE for (d)) minus the best PPO in final
    reward, paired by seed. Beats: ``clearly_positive`` of the gaps is yes/partly; loses: that of the
    negated gaps is; otherwise it matches. Yes when it matches or beats at a final KL no more than
    10 % above PPO's; partly when it does so only with more KL; no when it loses."""
    ppo = best_ppo(per_seed)
    gap = _paired(per_seed, method, ppo, "reward")
    kl_r, kl_p = _mean(per_seed, method, "kl"), _mean(per_seed, ppo, "kl")
    beats, loses = ap.clearly_positive(gap) != "no", ap.clearly_positive(-gap) != "no"
    kl_ok = kl_r <= 1.1 * kl_p
    if loses:
        answer = "no"
    else:
        answer = "yes" if kl_ok else "partly"
    relation = "loses to" if loses else "beats" if beats else "matches"
    facts = (f"{method} {relation} {ppo}: final reward gap {mean_std(gap)} (paired by seed); final KL "
             f"{kl_r:.3f} vs {kl_p:.3f} nats per completion; held-out greedy accuracy "
             f"{_mean(per_seed, method, 'eval_correct'):.3f} vs {_mean(per_seed, ppo, 'eval_correct'):.3f}")
    if curves is not None:  # descriptive only: the verdict above is the final-reward rule
        at_kl = equal_kl_gaps(curves, method, ppo, window)
        facts += (f"; at equal KL ({method}'s final reward minus {ppo}'s when its KL first reached {method}'s "
                  f"final KL, {window}-step means, not part of the verdict): {mean_std(at_kl)}")
    return answer, facts


def verdict_rloo(per_seed, curves=None, window: int = 20) -> tuple[str, str]:
    """(c): RLOO k=4 against the best PPO (``verdict_vs_ppo``)."""
    return verdict_vs_ppo(per_seed, RLOO4, curves, window)


def verdict_moving_average(per_seed, curves=None, window: int = 20) -> tuple[str, str]:
    """(d): REINFORCE with the moving-average baseline against the best PPO (``verdict_vs_ppo``), and
    below RLOO k=4 as the paper's Table 1 orders them (the RLOO gap is reported, not judged)."""
    answer, facts = verdict_vs_ppo(per_seed, MA, curves, window)
    if RLOO4 in per_seed:
        facts += f"; minus RLOO k=4: {mean_std(_paired(per_seed, MA, RLOO4, 'reward'))}"
    return answer, facts


def verdict(per_seed, curves=None, window: int = 20) -> str:
    """One bold overall line and one line per claim (``curves`` adds the equal-KL comparison to (c))."""
    (a, fa), (b, fb) = verdict_clipping(per_seed), verdict_lambda(per_seed)
    c, fc = verdict_rloo(per_seed, curves, window)
    answers = [a, b, c]
    lines = [f"- (a) PPO's clipping rarely fires: **{a}** — {fa}.",
             f"- (b) GAE λ = 1 is best: **{b}** — {fb}.",
             f"- (c) RLOO k=4 matches or beats PPO at equal samples and KL: **{c}** — {fc}."]
    if MA in per_seed:
        d, fd = verdict_moving_average(per_seed, curves, window)
        answers.append(d)
        lines.append(f"- (d) REINFORCE with a moving-average baseline matches or beats PPO at equal samples and "
                     f"KL: **{d}** — {fd}.")
    overall = answers[0] if len(set(answers)) == 1 else "partly" if {"yes", "partly"} & set(answers) else "no"
    return "\n".join([f"**claim reproduced: {overall}**", *lines])


def plot_reward_vs_kl(curves: dict[str, list[list[dict]]], path: str, *, smooth: int, title: str) -> None:
    """Reward against KL (each method's seed-mean trajectory, smoothed) and both against samples drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 4.2))
    for method, runs in curves.items():
        if not runs:
            continue
        kl = np.nanmean(np.stack([ap.moving_average([r["kl"] for r in rows], smooth) for rows in runs]), axis=0)
        reward = np.nanmean(np.stack([ap.moving_average([r["reward"] for r in rows], smooth) for rows in runs]), axis=0)
        style = "--" if method.startswith("PPO") else "-"
        (line,) = ax.plot(kl, reward, style, label=method)
        ax.plot(kl[-1:], reward[-1:], "o", color=line.get_color())
    ax.set_xlabel("KL to the SFT reference (nats per completion)")
    ax.set_ylabel("reward (accuracy of sampled completions)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    """Run the preset (or, with ``--report-only``, rebuild the report from the runs already in
    ``out/curves.json``: an interrupted run's finished seeds) and write the report."""
    import argparse

    keep_host_memory()  # process-wide malloc settings, before any JAX work (rljax/host_memory.py)
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--report-only", action="store_true",
                       help="no training: the report of the runs in <out>/curves.json (the step times only)")
    known, argv = extra.parse_known_args(sys.argv[1:] if argv is None else argv)
    run = ap.setup(NAME, __doc__.splitlines()[0], argv, PRESETS)
    preset, out, p, seeds, steps, log = run.preset, run.out, run.p, run.seeds, run.steps, run.log
    spec, model_dir, policy_stats = run.spec, run.model_dir, run.policy_stats
    if not p["kl_coef"] > 0:
        raise ValueError("the KL is measured against the kept reference, which needs kl_coef > 0")
    method_overrides = methods(p)
    # algorithm keys live in each method's list (naming the algorithm resets its section)
    common = [f"train.steps={steps}", f"optim.learning_rate={p['lr']}"]
    if run.plan:  # PPO holds the most (a separate critic and its optimizer state, mu = 2 passes)
        run.plan_and_exit(method_overrides, common, [next(m for m in method_overrides if m.startswith("PPO"))])
    note = ""
    if known.report_only:
        with open(os.path.join(out, "curves.json")) as f:
            saved = json.load(f)
        curves, cfg = {m: saved["curves"].get(m, []) for m in method_overrides}, None
        done = {m: len(runs) for m, runs in curves.items()}
        note = f" Rebuilt with `--report-only` from curves.json (seeds run per method: {done} of {saved['seeds']})"
        config_path = os.path.join(out, "config.json")
        saved_cfg = json.load(open(config_path)) if os.path.exists(config_path) else {}
        if "rl_seconds" in saved_cfg and "run_seconds" in saved_cfg:  # the finished run's own times
            rl_seconds = saved_cfg["rl_seconds"]
            run.t_start = time.perf_counter() - saved_cfg["run_seconds"]
            note += "; run time: the original run's."
        else:
            rl_seconds = sum(r["step_s"] for runs in curves.values() for rows in runs for r in rows)
            note += "; the run time below counts the steps' wall time only."
    else:
        t_rl = time.perf_counter()
        curves, cfg = ap.run_methods(spec, model_dir, out, method_overrides, common, seeds, log=log,
                                     extra_row=kl_and_clip_row, at_end=held_out_row)
        rl_seconds = time.perf_counter() - t_rl

    w = p["window"]
    per_seed = summarise(curves, w)
    headers = ["method", "reward", "KL (nats/compl.)", "held-out acc. (greedy)", "clip frac (whole run)",
               "s / step", "state MB", "paper's claim"]
    rows = [[m] + [mean_std([s[k] for s in per_seed[m]])
                   for k in ("reward", "kl", "eval_correct", "clip_frac_all", "step_s")]
            + [f"{_mean(per_seed, m, 'state_mb'):.1f}", CLAIMS[m]] for m in method_overrides]
    smooth = max(1, min(5, steps // 4))
    title = f"tiny addition policy, {p['samples']} samples/step (mean ± std over {len(seeds)} seeds)"
    ap.plot_curves(curves, [("reward", "reward (accuracy, sampled)"), ("kl", "KL to reference (nats/completion)"),
                            ("clip_frac", "clipped share of tokens"), ("step_s", "seconds per step")],
                   os.path.join(out, "rloo_vs_ppo.png"), smooth=smooth,
                   title=f"RLOO vs PPO (x: step = {p['samples']} samples), " + title)
    plot_reward_vs_kl(curves, os.path.join(out, "reward_vs_kl.png"), smooth=smooth, title="reward vs KL, " + title)
    text = run.report(
        title=f"# RLOO vs PPO (Ahmadian et al., arXiv:2402.14740) — preset `{preset}`",
        description=(
            f"Tiny byte-level Llama ({spec.layers} layers, width {spec.hidden}) pretrained here on {spec.digits}-digit "
            f"additions; accuracy at temperature 1 before RL {policy_stats['accuracy']:.3f}. {steps} RL steps of "
            f"{p['samples']} completions each for every method (equal samples), KL coefficient {p['kl_coef']}, "
            f"learning rate {p['lr']}, seeds {list(seeds)}. PPO, GRPO and REINFORCE++: {p['iterations']} passes over "
            f"{p['mini_batches']} mini-batches per step; RLOO and moving-average REINFORCE: one REINFORCE update per "
            f"step. Reward, KL and seconds "
            f"per step: mean over the last {w} steps; KL: sum over a completion's tokens of log π_old − log π_ref "
            f"(same estimate for every method); clip fraction: over the whole run; held-out accuracy: greedy, "
            f"{spec.eval_size} questions, after the last step; state MB: policy + optimizer + reference + critic "
            f"arrays. Mean ± std over seeds.{note}"),
        table=markdown_table(headers, rows), verdict=verdict(per_seed, curves, w), plot_name="rloo_vs_ppo.png, reward_vs_kl.png",
        rl_seconds=rl_seconds,
        meta={"window": w, "methods": method_overrides, "common_overrides": common, "rl_config_example": cfg})
    return {"out": out, "per_seed": per_seed, "results": text}


if __name__ == "__main__":
    main()
