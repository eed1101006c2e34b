"""Online vs offline preference data, in miniature: at an equal budget of labelled samples, do the
policy's own fresh samples and "negative gradient" methods win?

Paper: Tajwar, Singh, Sharma, Rafailov, Schneider, Xie, Ermon, Finn, Kumar, "Preference Fine-Tuning of
LLMs Should Leverage Suboptimal, On-Policy Data", arXiv:2404.14367: sections 5.1-5.2 and Figures 5-7
(on-policy sampling and a negative gradient each help; on-policy + negative gradient does best),
measured there on bandits, synthetic LLM tasks and AlpacaFarm / UltraFeedback.

Claims tested, at an EQUAL BUDGET OF LABELLED SAMPLES (completions scored by the reward; every
method spends exactly ``budget`` labels per seed, counted from the completions it scored):
(a) on-policy sampling helps: learning from the policy's own fresh samples (GRPO; iterated DPO
    whose pairs are re-sampled from the current policy every round) beats DPO on a fixed offline
    set of pairs (sampled once from the initial policy π0; or from another policy's samples);
(b) "negative gradient" methods (GRPO, DPO: they push down the bad samples) beat filtered
    imitation (RAFT / filtered BC: supervised fine-tuning on the samples the reward accepts),
    each with the same on-policy rounds.

Setup (``paper_repro/_arith_policy.py``, shared with the other arithmetic reproductions): two-digit
additions; a tiny byte-level Llama pretrained inside the reproduction (rljax's offline trainer, plain
SFT) on direct answers and scratchpads with 20 % deliberate slips, right about a quarter of the time at
temperature 1; the reward is 1 when the completion's last number is the sum (rljax's ``answer``
verifier). From that policy π0, per seed, five methods, each spending ``budget = rounds × P × N``
labels (P prompts × N samples per round or step, the same prompts in the same order for the
round-based methods):

    GRPO (online)           rljax's online engine, ``rounds`` steps of P prompts × N (group N), one update a step
    DPO, on-policy rounds   each round: N samples of P fresh prompts from the CURRENT policy, scored; best vs
                            worst of each prompt (``rljax.data.preferences.best_vs_worst_pairs``, ties dropped)
                            -> ``k`` DPO updates from the current policy, reference fixed at π0
                            (``OfflineTrainer.replace_train_split``, ``precompute_ref_logprobs=false``)
    RAFT (on-policy rounds) each round: the same sampling; the accepted samples (reward 1) -> ``k`` SFT updates
                            (``algorithm.name=records``, ``mode=filtered_bc``): filtered imitation, no negative
    DPO, offline from π0    all ``budget`` labels up front: N samples of each of the rounds × P prompts from π0,
                            best vs worst -> ``rounds × k`` DPO updates on that fixed set
    DPO, offline, scripted  the same from another policy: a scripted writer of the task's reference answers
                            in the corpus's styles with a slip (a corrupted answer) half of the time

Every DPO / RAFT update takes a batch of ``batch`` pairs or records; a round with fewer usable ones
(all N samples equally scored, or fewer than ``batch`` accepted samples) spends its labels and skips
its updates (counted as "updates" in the table). Gold reward: accuracy at temperature 1 on the 128
held-out questions (2 samples each during training, 4 at the end; held-out samples are not labels),
against labelled samples spent; for the offline methods, which spend the whole budget before their
first update, the x axis is the budget times the share of their updates done.

Command:
    python paper_repro/online_vs_offline.py            # default preset, seeds 0 1 2
    python paper_repro/online_vs_offline.py --smoke    # seconds, for tests
    python paper_repro/online_vs_offline.py --full     # toward the paper's scale (GPU/TPU; not run)
Writes runs/paper_repro/online_vs_offline/<preset>/: results.md, curves.json, online_vs_offline.png (held-out
accuracy against labelled samples), config.json, environment.json; per-run folders under runs/. The
pretrained policy is cached in runs/paper_repro/_cache/arith_policy/<hash>/ (shared with the other
arithmetic reproductions).

Hardware and run time: a shared 2-core CPU (jax CPU backend). The default preset (15 runs: 5 methods x
3 seeds, 6,400 labels each) took 19.4 min, almost all of it seed 0 on a heavily loaded machine (GRPO
alone 12.5 min there); seeds 1 and 2 ran on a quiet machine in about 1.5 min each (GRPO ~21 s, each
other method 10-25 s), so a quiet run takes ~5 min. Pretraining the policy took 37.8 min on the loaded
machine (about 1 min quiet; cached afterwards, shared with the other arithmetic reproductions).
`--report-only` rebuilds results.md and the plot from curves.json (an interrupted run's finished seeds).

Result of the default preset (seeds 0 1 2; final held-out accuracy at temperature 1, π0 0.234-0.270):
GRPO 0.324 ± 0.031, DPO on-policy rounds 0.283 ± 0.044, RAFT 0.368 ± 0.005, DPO offline from π0
0.219 ± 0.022, DPO offline from the scripted policy 0.147 ± 0.026.
(a) partly: GRPO beats both offline DPOs in every seed (+0.105 ± 0.052 over π0's pairs, +0.177 ± 0.058
    over the scripted pairs), on-policy DPO beats the scripted pairs in every seed (+0.136 ± 0.071) but
    π0's pairs only on average (+0.064 ± 0.065, 2 of 3 seeds); both offline DPOs end below π0 on
    average (−0.032, −0.104).
(b) no: RAFT (filtered imitation) ends above GRPO (by 0.044 ± 0.027) and above on-policy DPO (by
    0.085 ± 0.041) in every seed. At this learning rate DPO moves the policy little (on-policy DPO
    +0.032 over π0); a negative gradient did not help here, where the verifier is exact and the
    accepted samples are all right answers.

Deviations from the paper (numbered):
1. Model and task: a 2-layer, 128-wide byte-level Llama pretrained here on synthetic additions with an
   exact verifier as the reward (the paper: Pythia / Mistral-7B on AlpacaFarm, UltraFeedback and
   synthetic tasks with learned or gold reward models).
2. Scale: a budget of 6,400 labels per seed (100 rounds of 16 prompts × 4 samples); the paper's runs
   label tens of thousands of samples. The preset was sized before a quiet run was timed; it takes ~5 min
   quiet. `--steps 300` triples the budget (19,200 labels); it was not part of the measured result.
3. Methods: GRPO stands in for the paper's PPO / REINFORCE on-policy RL; iterated DPO with best vs worst
   of N from the current policy for its on-policy DPO; RAFT / filtered BC (SFT on the samples the
   verifier accepts) for its "Pref-FT without negative gradient" (the paper's RWR / filtered BC); the
   "other model" is a scripted writer (the task's reference answers and corrupted ones) rather than
   a second LLM.
4. Equal learning rate (1e-4, Adam, gradient norm clipped at 1, no warm-up) and equal update budgets for
   the DPO-style methods (k per round; the offline sets get rounds × k; on-policy DPO skips the rounds
   with fewer than a batch of pairs, ~10 % of them, so it made 181 ± 4 updates, not 200); GRPO makes one update per step
   (its rounds) on all N × P samples; DPO β = 0.1 (the DPO paper's common value); no KL term in GRPO.
   Nothing was tuned for this file: the learning rate is the one dr_grpo_length_bias.py chose for this
   policy in its seed-100 trials, and no seed was chosen.
5. One pretrained policy for all seeds: the seeds vary the prompt order, sampling and the scripted
   writer's draws.
6. Gold = held-out sampled accuracy under the training reward itself (no separate gold model is needed:
   the verifier is exact, so there is no proxy to over-optimise).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paper_repro import _arith_policy as ap  # noqa: E402
from rljax.host_memory import keep_host_memory  # noqa: E402
from rljax.tools.reporting import markdown_table, mean_std, write_json  # noqa: E402

NAME = "online_vs_offline"

GRPO = "GRPO (online)"
DPO_ONLINE = "DPO, on-policy rounds"
RAFT = "RAFT / filtered BC, on-policy rounds"
DPO_INIT = "DPO, offline pairs from π0"
DPO_SCRIPTED = "DPO, offline pairs from a scripted policy"
METHODS = (GRPO, DPO_ONLINE, RAFT, DPO_INIT, DPO_SCRIPTED)
ON_POLICY, OFFLINE = (GRPO, DPO_ONLINE), (DPO_INIT, DPO_SCRIPTED)
NEGATIVE, IMITATION = (GRPO, DPO_ONLINE), (RAFT,)

CLAIMS = {
    GRPO: "on-policy + negative gradient: best (a, b)",
    DPO_ONLINE: "on-policy + negative gradient: beats offline DPO (a) and RAFT (b)",
    RAFT: "on-policy, no negative gradient: below GRPO / on-policy DPO (b)",
    DPO_INIT: "off-policy data (π0's, fixed): below the on-policy methods (a)",
    DPO_SCRIPTED: "another policy's data: below the on-policy methods (a)",
}

PRESETS = {
    "smoke": dict(spec=ap.PolicySpec.smoke(), seeds=(0,), steps=3, prompts=4, samples=4, updates_per_round=1,
                  batch=2, lr=1e-4, beta=0.1, eval_every=2, eval_samples=1, final_eval_samples=1, p_slip_scripted=0.5),
    "default": dict(spec=ap.PolicySpec(), seeds=(0, 1, 2), steps=100, prompts=16, samples=4, updates_per_round=2,
                    batch=8, lr=1e-4, beta=0.1, eval_every=25, eval_samples=2, final_eval_samples=4,
                    p_slip_scripted=0.5),
    "full": dict(spec=ap.PolicySpec(digits=3, layers=4, hidden=256, heads=8, kv_heads=4, sft_size=20000,
                                    sft_steps=3000, sft_batch=64, sft_lr=1e-3),
                 seeds=(0, 1, 2, 3, 4), steps=300, prompts=64, samples=8, updates_per_round=4, batch=32, lr=1e-4,
                 beta=0.1, eval_every=25, eval_samples=4, final_eval_samples=8, p_slip_scripted=0.5),
}


# ---------------------------------------------------------------------------------------------
# pure helpers: the verdict rules


def combine(answers: Sequence[str]) -> str:
    """One answer from several comparisons: ``yes`` when all are yes, ``no`` when all are no, else
    ``partly``; comparisons ``not run`` (no seed of one side finished) are left out, and when every
    one is, the answer is ``not run``."""
    answers = [a for a in answers if a != "not run"]
    if not answers:
        return "not run"
    if all(a == "yes" for a in answers):
        return "yes"
    if all(a == "no" for a in answers):
        return "no"
    return "partly"


def paired_gaps(final: dict[str, Sequence[float]], better: str, worse: str) -> np.ndarray:
    """Per seed, ``final[better] − final[worse]`` (the first ``min`` seeds both have)."""
    n = min(len(final[better]), len(final[worse]))
    return np.asarray([final[better][i] - final[worse][i] for i in range(n)], dtype=np.float64)


def claim_verdict(final: dict[str, Sequence[float]], winners: Sequence[str],
                  losers: Sequence[str]) -> tuple[str, dict[str, tuple[str, np.ndarray]]]:
    """Every winner against every loser in final gold, paired by seed: each gap judged by
    ``_arith_policy.clearly_positive`` (every seed > 0: yes; mean above one standard error: partly;
    else no), the claim by :func:`combine` of those answers. Returns the answer and, per comparison
    ``"A − B"``, its answer and gaps."""
    parts = {}
    for w in winners:
        for lo in losers:
            gaps = paired_gaps(final, w, lo)
            parts[f"{w} − {lo}"] = (ap.clearly_positive(gaps) if len(gaps) else "not run", gaps)
    return combine([a for a, _ in parts.values()]), parts


# ---------------------------------------------------------------------------------------------
# the scripted "other policy"


def scripted_samples(spec: ap.PolicySpec, prompts: Sequence[dict], samples: int, *, p_slip: float,
                     seed: int) -> list[str]:
    """``samples`` responses per prompt (prompt-major) from a scripted writer: the corpus's styles
    (``spec.p_direct``, ``spec.p_verbose_line``), a one-column slip (a wrong, consistent answer) with
    probability ``p_slip``."""
    rng = np.random.default_rng([seed, 303])
    texts = []
    for ex in prompts:
        a, b = (int(x) for x in ex["prompt"].rstrip("=").split("+"))
        for _ in range(samples):
            style = "direct" if rng.random() < spec.p_direct else "scratch"
            verbose = tuple(bool(v) for v in rng.random(spec.digits + 1) < spec.p_verbose_line)
            slip = int(rng.integers(0, spec.digits)) if rng.random() < p_slip else None
            texts.append(ap.response(a, b, style=style, verbose_lines=verbose, slip=slip,
                                     slip_delta=int(rng.choice([-1, 1])))[0])
    return texts


# ---------------------------------------------------------------------------------------------
# sampling, labelling, evaluating


class Lab:
    """Per seed: the task's prompts, sampler settings and reward (an ``OnlineTrainer`` built on π0,
    used only for them and for π0's parameters), the round prompts, and the held-out evaluation."""

    def __init__(self, spec: ap.PolicySpec, model_dir: str, out: str, seed: int, p: dict):
        from rljax import rng
        from rljax.training import OnlineTrainer

        self.spec, self.model_dir, self.seed, self.p = spec, model_dir, seed, p
        self.prompts_dir = os.path.dirname(model_dir)
        cfg = ap.rl_config(spec, model_dir, self.prompts_dir, os.path.join(out, "runs", f"sampler_s{seed}"),
                           [f"train.seed={seed}"])
        self.trainer = OnlineTrainer(cfg, write_config=False, overwrite=True)
        train = self.trainer.train_examples
        order = np.random.default_rng([seed, 404]).permutation(len(train))
        need = p["rounds"] * p["prompts"]
        self.round_prompts = [dict(train[order[i % len(train)]]) for i in range(need)]  # the same for every method
        self.pairs_key, self.eval_key = rng.stream(seed, "round_samples"), rng.stream(seed, "heldout")
        self.labels: dict[str, int] = {}

    @property
    def initial_policy(self):
        return self.trainer.run.policy.split

    def prompts_of(self, r: int) -> list[dict]:
        P = self.p["prompts"]
        return self.round_prompts[r * P:(r + 1) * P]

    def label_round(self, method: str, policy, r: int):
        """Round ``r``'s prompts, N samples each from ``policy``, scored; counts the labels."""
        import jax

        from rljax.rollout import rollout

        t = self.trainer
        roll = rollout(policy, t.run.tokenizer, self.prompts_of(r), jax.random.fold_in(self.pairs_key, r),
                       sampling=t.sampling, fmt=t.prompt_format, repeats=self.p["samples"], rewards=t.rewards)
        self.labels[method] = self.labels.get(method, 0) + len(roll.texts)
        return roll

    def label_texts(self, method: str, examples: list[dict], texts: list[str]) -> np.ndarray:
        """Score given completions (one per example) with the task's reward; counts the labels."""
        self.labels[method] = self.labels.get(method, 0) + len(texts)
        return self.trainer.rewards(texts, examples).per_function[ap.CORRECT]

    def heldout(self, policy, index: int, *, final: bool = False) -> dict[str, float]:
        """Accuracy and mean length at temperature 1 on the held-out questions (not labels)."""
        import jax

        from rljax.rollout import rollout

        t = self.trainer
        repeats = self.p["final_eval_samples" if final else "eval_samples"]
        roll = rollout(policy, t.run.tokenizer, t.eval_examples, jax.random.fold_in(self.eval_key, index),
                       sampling=t.sampling, fmt=t.prompt_format, repeats=repeats, rewards=t.rewards)
        return {"gold": float(np.mean(roll.per_function[ap.CORRECT])),
                "gold_len": float(roll.completion_mask.sum(-1).mean())}


def _point(labels: int, updates: int, values: dict) -> dict[str, float]:
    return {"labels": int(labels), "updates": int(updates), **values}


# ---------------------------------------------------------------------------------------------
# the methods


def run_grpo(lab: Lab, out: str, log) -> dict[str, Any]:
    """GRPO for ``rounds`` steps of P prompts × N; held-out points every ``eval_every`` steps."""
    p, seed = lab.p, lab.seed
    points = [_point(0, 0, lab.heldout(lab.initial_policy, 0))]

    def extra_row(trainer, metrics):
        lab.labels[GRPO] = lab.labels.get(GRPO, 0) + len(trainer.last_rollouts.texts)
        step = trainer.step
        if step % p["eval_every"] == 0 and step < p["rounds"]:
            points.append(_point(lab.labels[GRPO], step, lab.heldout(trainer.run.policy.split, step)))
        return {}

    def at_end(trainer):
        points.append(_point(lab.labels[GRPO], trainer.step, lab.heldout(trainer.run.policy.split, p["rounds"],
                                                                           final=True)))
        return {}

    cfg = ap.rl_config(lab.spec, lab.model_dir, lab.prompts_dir, os.path.join(out, "runs", f"grpo_s{seed}"),
                       _grpo_overrides(p, seed=seed))
    rows = ap.run_rl(cfg, log=log, label=GRPO, extra_row=extra_row, at_end=at_end)
    return {"points": points, "rounds": [{"round": r["step"], "train_reward": r["reward"]} for r in rows]}


def _grpo_overrides(p: dict, *, seed: int) -> list[str]:
    """The GRPO run's settings: ``rounds`` steps of P prompts x N samples, one update a step, no KL."""
    return [f"train.steps={p['rounds']}", f"algorithm.group_size={p['samples']}",
            f"algorithm.prompts_per_step={p['prompts']}", "algorithm.num_iterations=1", "algorithm.mini_batches=1",
            "algorithm.kl_coef=0.0", f"optim.learning_rate={p['lr']}", f"train.seed={seed}"]


def _offline_config(lab: Lab, run_dir: str, path: str, algorithm: list[str], steps: int):
    from rljax.config import load_config
    from rljax.run_config import RunConfig

    p, spec = lab.p, lab.spec
    return load_config(RunConfig, None, [
        f"model.name={lab.model_dir}", f"data.path={path}", 'data.task=""', "data.chat=false",
        "data.max_prompt_length=16", "data.eval_size=0", "data.eval_fraction=0.0", "data.train_size=1000000",
        *algorithm, f"algorithm.batch_size={p['batch']}", f"algorithm.max_completion_length={spec.max_new_tokens}",
        "algorithm.invalid_rows=drop", "algorithm.epochs=null",
        f"optim.learning_rate={p['lr']}", "optim.schedule=constant", "optim.warmup_steps=0", "optim.grad_clip=1.0",
        f"train.steps={steps}", f"train.seed={lab.seed}", f"train.run_dir={run_dir}", "train.progress=false",
        "train.save_model=false"])


def _dpo_algorithm(p: dict, *, live_reference: bool) -> list[str]:
    return ["algorithm.name=dpo", f"algorithm.beta={p['beta']}",
            f"algorithm.precompute_ref_logprobs={str(not live_reference).lower()}"]


RAFT_ALGORITHM = ["algorithm.name=records", "algorithm.mode=filtered_bc", "algorithm.score_threshold=0.5",
                  "algorithm.reduction=token_mean"]


def _round_rows(method: str, roll, samples: int) -> list[dict]:
    """A round's training rows: best vs worst pairs (DPO) or the accepted samples as records (RAFT)."""
    from rljax.data.preferences import best_vs_worst_pairs

    scores = roll.per_function[ap.CORRECT]
    if method == RAFT:
        return [{"prompt": ex["prompt"], "response": text, "score": float(s)}
                for ex, text, s in zip(roll.examples, roll.texts, scores) if s >= 0.5 and text.strip()]
    examples = [{"prompt": ex["prompt"], "answer": ex["answer"]} for ex in roll.examples[::samples]]
    return best_vs_worst_pairs(examples, roll.texts, scores, num_samples=samples)[0]


def run_rounds(lab: Lab, method: str, out: str, log) -> dict[str, Any]:
    """On-policy rounds (DPO or RAFT): sample and label from the current policy, swap the rows in,
    ``updates_per_round`` updates; the trainer is built at the first round with enough rows."""
    from rljax.data.preferences import write_jsonl
    from rljax.training import OfflineTrainer

    p, seed = lab.p, lab.seed
    work = os.path.join(out, "runs", f"{ap.slug(method)}_s{seed}")
    os.makedirs(work, exist_ok=True)
    algorithm = RAFT_ALGORITHM if method == RAFT else _dpo_algorithm(p, live_reference=True)
    trainer, updates, points, rounds = None, 0, [_point(0, 0, lab.heldout(lab.initial_policy, 0))], []
    t0 = time.perf_counter()
    for r in range(p["rounds"]):
        policy = lab.initial_policy if trainer is None else trainer.run.policy.split
        roll = lab.label_round(method, policy, r)
        rows = _round_rows(method, roll, p["samples"])
        path = os.path.join(work, "round.jsonl")
        write_jsonl(rows, path)
        trained = 0
        if len(rows) >= p["batch"]:
            if trainer is None:
                cfg = _offline_config(lab, os.path.join(work, "trainer"), path, algorithm,
                                      p["rounds"] * p["updates_per_round"])
                trainer = OfflineTrainer(cfg, write_config=False, overwrite=True)
            else:
                trainer.replace_train_split(path)
            for _ in range(p["updates_per_round"]):
                trainer.step_once()
            trained = p["updates_per_round"]
            updates += trained
        rounds.append({"round": r + 1, "train_reward": float(np.mean(roll.per_function[ap.CORRECT])),
                       "rows": len(rows), "updates": trained})
        last = r + 1 == p["rounds"]
        if (r + 1) % p["eval_every"] == 0 or last:
            policy = lab.initial_policy if trainer is None else trainer.run.policy.split
            points.append(_point(lab.labels[method], updates, lab.heldout(policy, r + 1, final=last)))
            log(f"  {method} round {r + 1}/{p['rounds']}: {lab.labels[method]} labels, {updates} updates, "
                f"sampled reward {rounds[-1]['train_reward']:.3f}, held-out {points[-1]['gold']:.3f} "
                f"({time.perf_counter() - t0:.0f} s)")
    return {"points": points, "rounds": rounds}


def run_offline(lab: Lab, method: str, out: str, log) -> dict[str, Any]:
    """The whole budget labelled up front (π0's samples or the scripted writer's), best vs worst
    pairs, then ``rounds × updates_per_round`` DPO updates on that fixed set."""
    from rljax.data.preferences import best_vs_worst_pairs, write_jsonl
    from rljax.training import OfflineTrainer

    p, seed, N = lab.p, lab.seed, lab.p["samples"]
    work = os.path.join(out, "runs", f"{ap.slug(method)}_s{seed}")
    t0 = time.perf_counter()
    pairs, counts = [], {}
    for r in range(p["rounds"]):  # the round-based methods' prompts, in the same chunks
        examples = [{"prompt": ex["prompt"], "answer": ex["answer"]} for ex in lab.prompts_of(r)]
        if method == DPO_INIT:
            roll = lab.label_round(method, lab.initial_policy, r)  # round 0 = on-policy DPO's round 0
            texts, scores = roll.texts, roll.per_function[ap.CORRECT]
        else:
            texts = scripted_samples(lab.spec, examples, N, p_slip=p["p_slip_scripted"], seed=seed * 1000 + r)
            scores = lab.label_texts(method, [ex for ex in examples for _ in range(N)], texts)
        got, c = best_vs_worst_pairs(examples, texts, scores, num_samples=N)
        pairs += got
        counts = {k: counts.get(k, 0) + v for k, v in c.items()}
    path = os.path.join(work, "pairs.jsonl")
    write_jsonl(pairs, path)
    total = p["rounds"] * p["updates_per_round"]
    log(f"  {method}: {lab.labels[method]} labels -> {len(pairs)} pairs ({counts}) in {time.perf_counter() - t0:.0f} s")
    points = [_point(0, 0, lab.heldout(lab.initial_policy, 0))]
    if len(pairs) < p["batch"]:
        log(f"  {method}: fewer pairs than a batch: no update")
        points.append(_point(lab.labels[method], 0, lab.heldout(lab.initial_policy, p["rounds"], final=True)))
        return {"points": points, "pairs": len(pairs), "pair_counts": counts}
    cfg = _offline_config(lab, os.path.join(work, "trainer"), path, _dpo_algorithm(p, live_reference=False), total)
    trainer = OfflineTrainer(cfg, write_config=False, overwrite=True)
    every = p["eval_every"] * p["updates_per_round"]  # the same budget shares as the rounds' points
    while trainer.step < total:
        trainer.step_once()
        last = trainer.step == total
        if trainer.step % every == 0 or last:
            index = trainer.step // p["updates_per_round"]
            share_labels = round(lab.labels[method] * trainer.step / total)
            points.append(_point(share_labels, trainer.step, lab.heldout(trainer.run.policy.split, index, final=last)))
    log(f"  {method}: {total} updates on {len(trainer.train_set)} pairs, held-out {points[-1]['gold']:.3f} "
        f"({time.perf_counter() - t0:.0f} s)")
    return {"points": points, "pairs": len(pairs), "pair_counts": counts}


# ---------------------------------------------------------------------------------------------
# report


def plot(curves: dict[str, list[dict]], path: str, *, title: str) -> None:
    """Held-out accuracy against labelled samples: per method the mean over seeds ±1 std."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for method, runs in curves.items():
        if not runs:
            continue
        x = np.asarray([q["labels"] for q in runs[0]["points"]], dtype=np.float64)
        y = np.stack([[q["gold"] for q in run["points"]] for run in runs])
        mean, std = y.mean(0), (y.std(0, ddof=1) if len(runs) > 1 else np.zeros(len(x)))
        style = "--" if method in OFFLINE else "-"
        (line,) = ax.plot(x, mean, style, marker="o", ms=3, label=method)
        ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.12)
    ax.set_xlabel("labelled samples (offline, dashed: budget × share of updates done)")
    ax.set_ylabel("held-out accuracy (temperature 1)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def verdict(final: dict[str, list[float]]) -> str:
    """The bold overall line and one line per claim, from the final held-out accuracies."""
    lines = []
    answers = []
    for tag, text, winners, losers in (
            ("a", "on-policy sampling beats a fixed offline set", ON_POLICY, OFFLINE),
            ("b", "negative-gradient methods beat filtered imitation (RAFT)", NEGATIVE, IMITATION)):
        answer, parts = claim_verdict(final, winners, losers)
        answers.append(answer)
        facts = "; ".join(f"{k}: {mean_std(g)} ({a})" for k, (a, g) in parts.items())
        lines.append(f"- ({tag}) {text}: **{answer}** — final held-out accuracy gaps, paired by seed: {facts}.")
    overall = combine(answers)
    return "\n".join([f"**claim reproduced: {overall}**", *lines])


def report(run: "ap.Setup", curves: dict[str, list[dict]], budget: int, rl_seconds: float, note: str = "") -> dict:
    """Table, verdicts, plot and ``results.md`` from ``curves[method][seed_index]``. An interrupted
    run's methods may have different numbers of seeds (each row says its n); comparisons pair the
    seeds both sides have (runs are seed-major, so they are the same seeds)."""
    p, spec, policy_stats = run.p, run.spec, run.policy_stats
    seeds = [r["seed"] for r in max(curves.values(), key=len)]
    labels = {m: [r["labels"] for r in runs] for m, runs in curves.items()}
    bad = {m: n for m, n in labels.items() if any(x != budget for x in n)}
    if bad:
        raise RuntimeError(f"unequal label budgets (expected {budget} per seed): {bad}")
    final = {m: [r["points"][-1]["gold"] for r in runs] for m, runs in curves.items()}
    # the evaluation point nearest half the budget (the same share of the budget for every method)
    mid = {m: [min(r["points"], key=lambda q: abs(q["labels"] - budget / 2))["gold"] for r in runs]
           for m, runs in curves.items()}
    start = {m: [r["points"][0]["gold"] for r in runs] for m, runs in curves.items()}
    headers = ["method", "labels / seed", "updates", "held-out acc. at half budget", "held-out acc. (final)",
               "Δ vs π0", "final length (tokens)", "paper's claim"]
    rows = [[m, mean_std(labels[m], 6), mean_std([r["points"][-1]["updates"] for r in curves[m]], 4),
             mean_std(mid[m]), mean_std(final[m]), mean_std(np.subtract(final[m], start[m])),
             mean_std([r["points"][-1]["gold_len"] for r in curves[m]]), CLAIMS[m]] for m in METHODS]
    plot(curves, os.path.join(run.out, "online_vs_offline.png"),
         title=f"tiny addition policy, {budget} labels per seed (mean ± std over {len(seeds)} seeds)")
    text = run.report(
        title=f"# Online vs offline preference data (Tajwar et al., arXiv:2404.14367) — preset `{run.preset}`",
        description=(
            f"Tiny byte-level Llama ({spec.layers} layers, width {spec.hidden}) pretrained here on {spec.digits}-digit "
            f"additions; accuracy at temperature 1 before RL {policy_stats['accuracy']:.3f}. Every method spends "
            f"{budget} labelled samples per seed ({p['rounds']} rounds of {p['prompts']} prompts × {p['samples']} "
            f"samples; offline methods label them all up front); DPO / RAFT: {p['updates_per_round']} updates of "
            f"batch {p['batch']} per round (offline: {p['rounds'] * p['updates_per_round']} on the fixed set), "
            f"DPO β {p['beta']}, reference π0; learning rate {p['lr']} for every method; seeds {seeds}. "
            f"Held-out accuracy: temperature 1 on {spec.eval_size} held-out questions × {p['final_eval_samples']} "
            f"samples (final) or × {p['eval_samples']} (half budget); mean ± std over seeds.{note}"),
        table=markdown_table(headers, rows), verdict=verdict(final), plot_name="online_vs_offline.png",
        rl_seconds=rl_seconds,
        meta={"budget": budget, "methods": list(METHODS), "seeds_reported": seeds,
              "preset_settings": {k: v for k, v in p.items() if k != "spec"}})
    return {"out": run.out, "final": final, "labels": labels, "budget": budget, "results": text}


def main(argv=None) -> dict:
    """Run the preset (or, with ``--report-only``, rebuild the report from ``out/curves.json``: an
    interrupted run's finished seeds) and write the report."""
    import argparse
    import json

    keep_host_memory()  # process-wide malloc settings, before any JAX work (rljax/host_memory.py)
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--report-only", action="store_true",
                       help="no training: the report of the runs in <out>/curves.json")
    known, argv = extra.parse_known_args(sys.argv[1:] if argv is None else argv)
    run = ap.setup(NAME, __doc__.splitlines()[0], argv, PRESETS)
    out, p, seeds, log = run.out, run.p, run.seeds, run.log
    p["rounds"] = run.steps  # --steps sets the rounds (GRPO's steps)
    budget = p["rounds"] * p["prompts"] * p["samples"]
    if known.report_only:
        with open(os.path.join(out, "curves.json")) as f:
            saved = json.load(f)
        curves = {m: saved["curves"].get(m, []) for m in METHODS}
        rl_seconds = sum(r["seconds"] for runs in curves.values() for r in runs)
        run.t_start = time.perf_counter() - rl_seconds
        note = (f" Rebuilt with `--report-only` from curves.json (runs per method: "
                f"{ {m: len(r) for m, r in curves.items()} } of seeds {saved['seeds']}); run time: the runs' own.")
        return report(run, curves, saved["budget"], rl_seconds, note)
    if run.plan:  # GRPO holds the most: the sampler and the update of P prompts x N samples
        run.plan_and_exit({GRPO: _grpo_overrides(p, seed=seeds[0])}, [], [GRPO])
    curves: dict[str, list[dict]] = {m: [] for m in METHODS}
    t_rl = time.perf_counter()
    for seed in seeds:
        lab = Lab(run.spec, run.model_dir, out, seed, p)
        for method in METHODS:
            log(f"{method}, seed {seed}:")
            t0 = time.perf_counter()
            if method == GRPO:
                result = run_grpo(lab, out, log)
            elif method in (DPO_ONLINE, RAFT):
                result = run_rounds(lab, method, out, log)
            else:
                result = run_offline(lab, method, out, log)
            result.update(seed=seed, labels=lab.labels[method], seconds=round(time.perf_counter() - t0, 1))
            curves[method].append(result)
            write_json(os.path.join(out, "curves.json"), {"seeds": list(seeds), "budget": budget, "curves": curves})
    return report(run, curves, budget, time.perf_counter() - t_rl)


if __name__ == "__main__":
    main()
