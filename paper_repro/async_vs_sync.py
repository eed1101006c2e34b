"""Asynchronous RL against synchronous, in miniature: reward per sample and per second, with and
without an off-policy correction, at staleness 0, 1 and 4.

Claims (issue-level, from the asynchronous-RL literature: PipelineRL, AReaL arXiv:2505.24298, verl's
fully-async trainer, Marin's JAX write-up; the masked correction from Liu, Li et al. 2025, "When
speed kills stability", verl `rollout_rs: geometric`):
(a) with large staleness and no correction, training degrades (lower reward per sample than the
    synchronous loop);
(b) with a correction (sequence-level masking on the geometric-mean ratio, `seq_mask`) it does not;
(c) overlapping generation with the update buys wall time (reward per second) where generation and
    the update can run at the same time.

Setup (`paper_repro/_arith_policy.py`, shared with the other arithmetic reproductions): two-digit
additions; a tiny byte-level Llama pretrained inside the reproduction (rljax's offline trainer,
plain SFT), right about a quarter of the time at temperature 1; reward 1 when the completion's last
number is the sum. One GRPO run per method and seed from that policy with rljax's online engine
(`rljax.training.OnlineTrainer`), every run with the same prompts, samples, passes and learning rate:

    sync                  train.max_staleness=0
    k=1, k=4              train.max_staleness=k (batch s sampled by policy version max(0, s - k))
    ... + seq_mask        algorithm.off_policy_correction=seq_mask algorithm.correction_bounds=[0.999,1.001]

Per step: the reward of the sampled completions, the staleness the step's tokens actually had
(`async/staleness_mean`), the share of rows the correction rejected (`off_policy/row_masked_frac`),
the step's wall time. At the end: greedy accuracy on the held-out questions.

What two CPU cores can and cannot show: the colocated loop runs generation and the update on the
same two cores, so (c) cannot show a speed-up here beyond host work (prompt encoding, the engine's
scheduling, reward scoring) hidden behind the update; step times are reported, but claim (c) needs
separate devices: the `--full` preset on an accelerator host, with `mesh.rollout_devices` set to the
devices that generate (`--rollout-devices N`). (a) and (b) are about samples, not time, and do show
on a CPU.

Command:
    python paper_repro/async_vs_sync.py            # default preset, seeds 0 1 2
    python paper_repro/async_vs_sync.py --smoke    # seconds, for tests
    python paper_repro/async_vs_sync.py --lr 3e-4 --out runs/paper_repro/async_vs_sync/lr3e-4   # larger steps
    python paper_repro/async_vs_sync.py --full --rollout-devices 4   # disaggregated, an 8-device host
    python paper_repro/async_vs_sync.py --full --plan h100-1         # does it fit? (rljax plan, no GPU)
Writes runs/paper_repro/async_vs_sync/<preset>/: results.md, curves.json, async_vs_sync.png (reward
against samples and against wall time, staleness per step), config.json, environment.json; per-run
folders under runs/. The pretrained policy is cached in runs/paper_repro/_cache/arith_policy/<hash>/.

Hardware and run time: the default preset's 18 runs take about 20 minutes on a 2-core CPU (about 60 s
a run, plus under 2 minutes to pretrain the policy when it is not cached); results and the host in
experiments/results/async_vs_sync.md.

Deviations (numbered):
1. Model and task: a 2-layer, 128-wide byte-level Llama pretrained here on synthetic additions,
   instead of a 1.5B-32B model on math data; completions of at most 64 tokens.
2. Staleness is fixed by rljax's schedule (batch s sampled by version max(0, s - k)): every token of a
   step lags exactly min(s, k) versions, where the systems above have a staleness that varies with timing.
3. Colocated on a CPU: generation and update share the cores (see above).
4. One pretrained policy for all seeds: seeds vary the RL prompt order and sampling only.
5. The correction's bounds are verl's suggested tight geometric bounds, not tuned.
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

NAME = "async_vs_sync"
SEQ_MASK = ["algorithm.off_policy_correction=seq_mask", "algorithm.correction_bounds=[0.999,1.001]"]


def methods(stalenesses=(1, 4)) -> dict[str, list[str]]:
    """The synchronous loop and each staleness, each without and with the ``seq_mask`` correction."""
    out = {"sync": ["train.max_staleness=0"], "sync + seq_mask": ["train.max_staleness=0", *SEQ_MASK]}
    for k in stalenesses:
        out[f"k={k}"] = [f"train.max_staleness={k}"]
        out[f"k={k} + seq_mask"] = [f"train.max_staleness={k}", *SEQ_MASK]
    return out


PRESETS = {
    "smoke": dict(spec=ap.PolicySpec.smoke(), steps=3, prompts=2, group=4, seeds=(0,), window=1, lr=1e-4,
                  stalenesses=(1, 2)),
    "default": dict(spec=ap.PolicySpec(), steps=100, prompts=8, group=8, seeds=(0, 1, 2), window=20, lr=1e-4,
                    stalenesses=(1, 4)),
    "full": dict(spec=ap.PolicySpec(digits=3, layers=4, hidden=256, heads=8, kv_heads=4, sft_size=20000,
                                    sft_steps=3000, sft_batch=64, sft_lr=1e-3),
                 steps=300, prompts=64, group=16, seeds=(0, 1, 2), window=30, lr=2e-4, stalenesses=(1, 4)),
}

KEYS = {"reward": "reward_sampled", "staleness": "async/staleness_mean", "masked": "off_policy/row_masked_frac",
        "step_s": "step_s"}


def async_row(trainer, metrics: dict[str, float]) -> dict[str, float]:
    """The asynchronous loop's and the correction's values of a step (0 / NaN where not logged)."""
    return {"async/staleness_mean": float(metrics.get("async/staleness_mean", 0.0)),
            "async/staleness_max": float(metrics.get("async/staleness_max", 0.0)),
            "off_policy/row_masked_frac": float(metrics.get("off_policy/row_masked_frac", np.nan)),
            "time/generate_overlap_s": float(metrics.get("time/generate_overlap_s", 0.0))}


def held_out_row(trainer) -> dict[str, float]:
    """At the end of a run: greedy accuracy on the held-out questions."""
    return {"eval_correct": float(trainer.evaluate()[f"eval/{ap.CORRECT}"])}


def with_time_axes(curves: dict[str, list[list[dict]]], samples_per_step: int) -> None:
    """Adds ``samples`` and ``wall_s`` (cumulative step time) to every row, for the x axes."""
    for runs in curves.values():
        for rows in runs:
            total = 0.0
            for r in rows:
                total += r["step_s"]
                r["samples"], r["wall_s"] = r["step"] * samples_per_step, total


def verdict(per_seed: dict[str, list[dict]], stalenesses) -> str:
    """Claim lines from the final-window rewards, paired by seed against the synchronous loop."""
    k = max(stalenesses)

    def gap(a, b):
        n = min(len(per_seed[a]), len(per_seed[b]))
        return np.asarray([per_seed[a][i]["reward"] - per_seed[b][i]["reward"] for i in range(n)])

    plain, corrected = gap("sync", f"k={k}"), gap("sync + seq_mask", f"k={k} + seq_mask")
    a = ap.clearly_positive(plain)  # sync above stale: training degraded
    b = "no" if ap.clearly_positive(corrected) == "yes" else "yes" if a != "no" else "not testable"
    return "\n".join([
        f"- (a) large staleness without a correction degrades training: **{a}** — final reward, sync minus "
        f"k={k}, paired by seed: {mean_std(plain)}.",
        f"- (b) with seq_mask it does not: **{b}** — final reward, sync + seq_mask minus k={k} + seq_mask: "
        f"{mean_std(corrected)} (rows rejected by the mask at k={k}: "
        f"{mean_std([s['masked'] for s in per_seed[f'k={k} + seq_mask']])}).",
        "- (c) wall time: not claimed on this host (generation and update share its cores; see the docstring).",
    ])


def main(argv=None) -> dict:
    keep_host_memory()  # process-wide malloc settings, before any JAX work (rljax/host_memory.py)
    rollout_devices = None
    if argv is None:
        argv = sys.argv[1:]
    if "--rollout-devices" in argv:
        i = argv.index("--rollout-devices")
        rollout_devices, argv = int(argv[i + 1]), argv[:i] + argv[i + 2:]
    lr = None
    if "--lr" in argv:  # the RL learning rate instead of the preset's (a larger step per version)
        i = argv.index("--lr")
        lr, argv = float(argv[i + 1]), argv[:i] + argv[i + 2:]
    run = ap.setup(NAME, __doc__.splitlines()[0], argv, PRESETS)
    if lr is not None:
        run.p = dict(run.p, lr=lr)
    preset, out, p, seeds, log = run.preset, run.out, run.p, run.seeds, run.log
    spec, policy_stats = run.spec, run.policy_stats
    table_methods = methods(p["stalenesses"])
    t_rl = time.perf_counter()
    common = run.common()
    if rollout_devices:  # the synchronous loop cannot be disaggregated: it runs colocated
        log(f"mesh.rollout_devices={rollout_devices}: the k >= 1 runs are disaggregated, the sync runs colocated")
        table_methods = {m: o + ([] if m.startswith("sync") else [f"mesh.rollout_devices={rollout_devices}"])
                         for m, o in table_methods.items()}
    if run.plan:  # the methods share shapes; the corrected one scores π_old too (one more forward pass)
        run.plan_and_exit(table_methods, common, [f"k={max(p['stalenesses'])} + seq_mask"])
    curves, cfg = ap.run_methods(spec, run.model_dir, out, table_methods, common, seeds, log=log,
                                 extra_row=async_row, at_end=held_out_row)
    rl_seconds = time.perf_counter() - t_rl
    with_time_axes(curves, p["prompts"] * p["group"])

    w = p["window"]
    per_seed = {m: [{**{name: ap.final_window(rows, key, w) for name, key in KEYS.items()},
                     "eval_correct": rows[-1]["eval_correct"]} for rows in runs] for m, runs in curves.items()}
    headers = ["method", "reward (final)", "held-out accuracy", "staleness (mean)", "rows masked", "step s"]
    rows = [[m] + [mean_std([s[k] for s in per_seed[m]])
                   for k in ("reward", "eval_correct", "staleness", "masked", "step_s")] for m in table_methods]
    plot_path = os.path.join(out, "async_vs_sync.png")
    _plot(curves, plot_path, title=f"async vs sync, tiny addition policy (mean ± std over {len(seeds)} seeds)",
          smooth=max(1, min(5, run.steps // 4)))
    text = run.report(
        title=f"# Asynchronous vs synchronous RL — preset `{preset}`",
        description=(
            f"Tiny byte-level Llama ({spec.layers} layers, width {spec.hidden}) pretrained here on {spec.digits}-digit "
            f"additions; accuracy at temperature 1 before RL {policy_stats.get('accuracy', float('nan')):.3f}. "
            f"{run.steps} GRPO steps of {p['prompts']} prompts x {p['group']} samples, learning rate {run.p['lr']}, "
            f"seeds {list(seeds)}. Values: "
            f"mean over the last {w} steps, mean ± std over seeds. Colocated on this host unless "
            f"--rollout-devices was given ({rollout_devices})."),
        table=markdown_table(headers, rows), verdict=verdict(per_seed, p["stalenesses"]),
        plot_name="async_vs_sync.png", rl_seconds=rl_seconds,
        meta={"window": w, "methods": table_methods, "common_overrides": common, "rl_config_example": cfg,
              "rollout_devices": rollout_devices})
    return {"out": out, "per_seed": per_seed, "results": text, "curves": curves}


def _plot(curves, path: str, *, title: str, smooth: int) -> None:
    """Reward against samples and against wall time, and the staleness per step, per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("samples", "reward_sampled", "reward vs samples"), ("wall_s", "reward_sampled", "reward vs wall s"),
              ("step", "async/staleness_mean", "staleness (versions)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (x_key, y_key, label) in zip(axes[0], panels):
        for method, runs in curves.items():
            if not runs:
                continue
            x = np.mean([[r[x_key] for r in rows] for rows in runs], axis=0)
            y = np.mean([ap.moving_average([r.get(y_key, np.nan) for r in rows], smooth) for rows in runs], axis=0)
            ax.plot(x, y, label=method)
        ax.set_xlabel(x_key)
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
