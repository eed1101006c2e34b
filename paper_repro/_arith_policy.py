"""The task and the tiny policy shared by the GRPO-family reproductions (Dr. GRPO, DAPO).

Task: two-operand addition, prompt ``"47+85="``. The policy may answer directly (``"132"``, 4 tokens
with EOS) or through a scratchpad, column by column from the units, each line terse or verbose::

    7+5=12;4+8+1=13;=132                                       (terse, 21 tokens with EOS)
    7 plus 5 is 12; 4 plus 8 plus 1 is 13; so the answer is 132 (verbose, 60 tokens)

each line (and the closing one) in symbols or in words independently, so completion length varies
about 15-fold; the words carry exactly the information of the symbols, so among scratchpads length
is not tied to correctness (direct answers are much less accurate for a tiny model). The reward is 1 when the
last number of the completion is the sum (``rljax.rewards`` ``answer`` with ``require_tag: false``).

The policy is a tiny byte-level Llama (``rljax.models.tiny``) pretrained inside the reproduction by
rljax's own offline trainer (``algorithm.name: records``, ``mode: filtered_bc`` on records
all scored 1, which is plain supervised fine-tuning). The SFT corpus mixes the three styles and holds
deliberate slips (one wrong column sum, or a direct answer off by one digit, carried through to a
consistent final answer), so the pretrained policy is right only part of the time at temperature 1
and RL has something to learn. The pretrained model directory is cached by a hash of its settings.

    spec = PolicySpec()                                   # or PolicySpec.smoke()
    model_dir, stats = pretrain_policy(spec, cache_root)  # cached; stats: accuracy, lengths by style
    cfg = rl_config(spec, model_dir, os.path.dirname(model_dir), run_dir, ["algorithm.reduction=token_mean", ...])
    curves = run_rl(cfg)                                  # per-step rows (reward, lengths, entropy, ...)

``run_rl`` drives ``rljax.training.OnlineTrainer.step_once`` itself to read per-sample data the engine does
not log (mean length of correct / of incorrect completions, the style mix) from ``last_rollouts``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
import warnings
from typing import Any, Callable, Sequence

import numpy as np

from rljax.config import load_config
from rljax.tools.reporting import write_json
from rljax.run_config import RunConfig

CORRECT = "correct"  # the name of the reward function (and of its per-sample values)


# ---------------------------------------------------------------------------------------------
# settings


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """What the pretrained policy and its corpus are; the cache key is a hash of all of it."""

    # task
    digits: int = 2  # operands in [10^(d-1), 10^d)
    p_direct: float = 0.2  # share of direct answers in the SFT corpus (the rest use a scratchpad)
    p_verbose_line: float = 0.5  # each scratchpad line is verbose with this probability
    p_slip: float = 0.2  # share of SFT responses with one deliberate slip
    sft_size: int = 6000  # SFT responses (one per question, from the train questions)
    eval_size: int = 128  # held-out questions (RL runs train on the rest)
    # model (rljax.models.tiny.make_tiny_model_dir)
    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    # SFT (rljax offline trainer)
    sft_steps: int = 700
    sft_batch: int = 32
    sft_lr: float = 3e-3
    seed: int = 0

    @classmethod
    def smoke(cls) -> "PolicySpec":
        """Seconds, not minutes: one small layer, a few dozen SFT steps (the policy is mostly wrong)."""
        return cls(sft_size=256, eval_size=32, layers=1, hidden=32, heads=2, kv_heads=1, sft_steps=30,
                   sft_batch=16)

    @property
    def max_new_tokens(self) -> int:
        """Room for the longest scratchpad (all lines verbose, final carry) plus EOS."""
        return 8 + 28 * self.digits

    def key(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


# ---------------------------------------------------------------------------------------------
# the task


def response(a: int, b: int, *, style: str, verbose_lines: Sequence[bool] = (), slip: int | None = None,
             slip_delta: int = 1) -> tuple[str, int]:
    """The response text for ``a+b`` and the answer it states.

    ``style``: ``"direct"`` or ``"scratch"``. ``verbose_lines[i]``: scratchpad line ``i`` (from the
    units; index ``n`` is the closing line) is written in words (``"4 plus 8 plus 1 is 13"``) rather
    than symbols (``"4+8+1=13"``): the same content, about twice the tokens. ``slip``: the column
    whose sum is off by ``slip_delta`` (the error propagates through the carries into a consistent
    wrong answer); for ``direct`` a slip moves the answer by ``slip_delta`` tens (units if < 10).
    """
    if style == "direct":
        answer = a + b
        if slip is not None:
            answer = max(answer + slip_delta * (10 if answer >= 10 else 1), 0)
        return str(answer), answer
    if style != "scratch":
        raise ValueError(f"style must be 'direct' or 'scratch', got {style!r}")
    da, db = str(a)[::-1], str(b)[::-1]
    n = max(len(da), len(db))
    verbose = lambda i: i < len(verbose_lines) and bool(verbose_lines[i])  # noqa: E731
    carry, digits, lines = 0, [], []
    for i in range(n):
        terms = [int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0] + ([carry] if carry else [])
        s = sum(terms)
        if slip == i:
            s = min(max(s + slip_delta, 0), 19)
        digit, carry = s % 10, s // 10
        digits.append(str(digit))
        if verbose(i):
            lines.append(" plus ".join(map(str, terms)) + f" is {s}")
        else:
            lines.append("+".join(map(str, terms)) + f"={s}")
    if carry:
        digits.append(str(carry))
    answer = int("".join(reversed(digits)))
    closing = f"so the answer is {answer}" if verbose(n) else f"={answer}"
    sep = "; " if any(verbose(i) for i in range(n + 1)) else ";"
    return sep.join(lines + [closing]), answer


def style_of(text: str) -> str:
    """``direct`` / ``terse`` / ``verbose`` for a completion (by its shape; for diagnostics):
    ``verbose`` when any line is in words."""
    if "plus" in text or " is " in text:
        return "verbose"
    return "terse" if "+" in text or ";" in text else "direct"


def questions(spec: PolicySpec) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(train, eval)`` operand pairs: one seeded shuffle of the whole question space, eval first."""
    low, high = 10 ** (spec.digits - 1) if spec.digits > 1 else 0, 10**spec.digits
    span = high - low
    order = np.random.default_rng([spec.seed, 101]).permutation(span * span)
    pairs = [(low + int(f) // span, low + int(f) % span) for f in order]
    return pairs[spec.eval_size:], pairs[: spec.eval_size]


def sft_records(spec: PolicySpec) -> list[dict[str, Any]]:
    """One scored record (score 1) per train question, up to ``sft_size``; styles and slips drawn."""
    rng = np.random.default_rng([spec.seed, 202])
    train, _ = questions(spec)
    records = []
    for i in range(spec.sft_size):
        a, b = train[i % len(train)]
        style = "direct" if rng.random() < spec.p_direct else "scratch"
        verbose = tuple(bool(v) for v in rng.random(spec.digits + 1) < spec.p_verbose_line)
        slip = int(rng.integers(0, spec.digits)) if rng.random() < spec.p_slip else None
        text, _ = response(a, b, style=style, verbose_lines=verbose, slip=slip,
                           slip_delta=int(rng.choice([-1, 1])))
        records.append({"prompt": f"{a}+{b}=", "response": text, "score": 1.0})
    return records


def prompt_rows(spec: PolicySpec) -> list[dict[str, Any]]:
    """RL prompts ``{prompt, answer}``: the ``eval_size`` held-out questions first, then the train
    questions."""
    train, evals = questions(spec)
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in evals + train]


TRAIN_PROMPTS, EVAL_PROMPTS = "train_prompts.jsonl", "eval_prompts.jsonl"


def write_prompt_files(spec: PolicySpec, directory: str) -> str:
    """Write ``prompt_rows`` as ``directory/train_prompts.jsonl`` (the train questions) and
    ``directory/eval_prompts.jsonl`` (the held-out ones): the online run's ``data.path`` and
    ``data.eval_path``, so the held-out questions are exactly ``questions(spec)``'s. Returns ``directory``."""
    from rljax.data.preferences import write_jsonl

    rows = prompt_rows(spec)
    write_jsonl(rows[spec.eval_size:], os.path.join(directory, TRAIN_PROMPTS))
    write_jsonl(rows[: spec.eval_size], os.path.join(directory, EVAL_PROMPTS))
    return directory


# ---------------------------------------------------------------------------------------------
# configs


# the last number of the completion is the sum; plain numbers only, so math-verify is never needed
REWARDS = f"rewards={{{CORRECT}: {{type: answer, weight: 1.0, require_tag: false, use_math_verify: false}}}}"


def sft_config(spec: PolicySpec, model_dir: str, records_path: str, run_dir: str) -> RunConfig:
    """The offline-trainer config that pretrains the policy (plain SFT via ``filtered_bc``)."""
    return load_config(RunConfig, None, [
        f"model.name={model_dir}",
        "algorithm.name=records",
        f"data.path={records_path}", 'data.task=""', "data.chat=false", "data.max_prompt_length=16",
        f"data.eval_size={min(64, spec.eval_size)}", f"data.train_size={spec.sft_size}", "data.eval_fraction=0.02",
        "algorithm.mode=filtered_bc", "algorithm.score_threshold=0.5",
        f"algorithm.batch_size={spec.sft_batch}", f"algorithm.max_completion_length={spec.max_new_tokens}",
        "algorithm.reduction=token_mean",
        f"optim.learning_rate={spec.sft_lr}", "optim.schedule=cosine", f"optim.warmup_steps={max(spec.sft_steps // 20, 1)}",
        "optim.weight_decay=0.01",
        f"train.steps={spec.sft_steps}", f"train.seed={spec.seed}", f"train.run_dir={run_dir}",
        "train.progress=false",
    ])


def rl_config(spec: PolicySpec, model_dir: str, prompts_dir: str, run_dir: str,
              overrides: Sequence[str] = ()) -> RunConfig:
    """The online GRPO-family config for this task; ``overrides`` (dotted keys) pick the variant.
    ``prompts_dir`` holds the files of ``write_prompt_files``."""
    base = [
        f"model.name={model_dir}",
        "algorithm.name=grpo",
        f"data.path={os.path.join(prompts_dir, TRAIN_PROMPTS)}",
        f"data.eval_path={os.path.join(prompts_dir, EVAL_PROMPTS)}",
        'data.task=""', "data.answer_column=answer", "data.chat=false",
        "data.max_prompt_length=16", f"data.eval_size={spec.eval_size}", "data.train_size=100000",
        f"sampling.max_new_tokens={spec.max_new_tokens}", "sampling.temperature=1.0",
        "train.progress=false", "train.samples_every=null", f"train.run_dir={run_dir}",
        "optim.warmup_steps=0", "optim.grad_clip=1.0", REWARDS,
    ]
    return load_config(RunConfig, None, base + list(overrides))


# ---------------------------------------------------------------------------------------------
# pretraining (cached)


def pretrain_policy(spec: PolicySpec, cache_root: str, *, log: Callable[[str], None] = print) -> tuple[str, dict]:
    """The pretrained model directory for ``spec`` and its stats; trains it unless cached.

    Cached under ``cache_root/arith_policy/<spec hash>/``: ``model/`` (a Hugging Face directory),
    ``spec.json``, ``stats.json`` (accuracy and style mix at temperature 1 on held-out questions,
    SFT time), ``sft_records.jsonl``, ``train_prompts.jsonl`` and ``eval_prompts.jsonl`` (the RL prompts,
    ``write_prompt_files``; written again on every call, so a cache from before they existed gets them).
    """
    from rljax.data.preferences import write_jsonl
    from rljax.models.tiny import make_tiny_model_dir
    from rljax.training import OfflineTrainer

    root = os.path.join(cache_root, "arith_policy", spec.key())
    model_dir, stats_path = os.path.join(root, "model"), os.path.join(root, "stats.json")
    write_prompt_files(spec, root)
    if os.path.exists(stats_path) and os.path.isdir(model_dir):
        with open(stats_path) as f:
            stats = json.load(f)
        log(f"pretrained policy: cached at {root} (accuracy {stats['accuracy']:.3f})")
        return model_dir, stats
    work = os.path.join(root, "work")
    shutil.rmtree(work, ignore_errors=True)
    write_json(os.path.join(root, "spec.json"), dataclasses.asdict(spec))
    write_jsonl(sft_records(spec), os.path.join(root, "sft_records.jsonl"))
    init_dir = make_tiny_model_dir(os.path.join(work, "init"), seed=spec.seed, layers=spec.layers,
                                   hidden=spec.hidden, heads=spec.heads, kv_heads=spec.kv_heads)
    cfg = sft_config(spec, init_dir, os.path.join(root, "sft_records.jsonl"), os.path.join(work, "sft"))
    t0 = time.perf_counter()
    log(f"pretraining the policy ({spec.sft_steps} SFT steps) into {root}")
    summary = OfflineTrainer(cfg).fit()
    sft_seconds = time.perf_counter() - t0
    shutil.rmtree(model_dir, ignore_errors=True)
    shutil.move(summary["model_dir"], model_dir)
    stats = measure_policy(spec, model_dir, root, os.path.join(work, "measure"))
    stats.update(sft_seconds=round(sft_seconds, 1), sft_eval_nll=summary.get("after", {}).get("eval/nll"))
    write_json(stats_path, stats)
    shutil.rmtree(work, ignore_errors=True)
    log(f"pretrained policy: accuracy {stats['accuracy']:.3f} at temperature 1, styles {stats['styles']}, "
        f"SFT {sft_seconds:.0f} s")
    return model_dir, stats


def measure_policy(spec: PolicySpec, model_dir: str, prompts_dir: str, run_dir: str, *,
                   samples: int = 4) -> dict[str, Any]:
    """Accuracy, mean length and style mix of ``samples`` completions (temperature 1) per held-out question."""
    import jax

    from rljax.training import OnlineTrainer

    trainer = OnlineTrainer(rl_config(spec, model_dir, prompts_dir, run_dir), write_config=False)
    roll = trainer.sample(trainer.eval_examples, jax.random.key(spec.seed), repeats=samples)
    correct = roll.per_function[CORRECT]
    lengths = roll.completion_mask.sum(-1)
    styles = [style_of(t) for t in roll.texts]
    by_style = {s: {"share": float(np.mean([x == s for x in styles])),
                    "accuracy": float(np.mean([c for c, x in zip(correct, styles) if x == s]))
                    if s in styles else float("nan")}
                for s in ("direct", "terse", "verbose")}
    return {"accuracy": float(correct.mean()), "mean_length": float(lengths.mean()),
            "stopped_frac": float(roll.finished.mean()), "styles": by_style,
            "samples": [{"prompt": ex["prompt"], "completion": t, "correct": float(c)}
                        for ex, t, c in list(zip(roll.examples, roll.texts, correct))[:12]]}


# ---------------------------------------------------------------------------------------------
# RL runs


def step_row(trainer, metrics: dict[str, float]) -> dict[str, float]:
    """One step's curve values: the engine's metrics plus what only ``last_rollouts`` holds."""
    roll = trainer.last_rollouts
    group_size = trainer.cfg.algorithm.group_size
    correct = roll.per_function[CORRECT] > 0.5  # [R]
    lengths = roll.completion_mask.sum(-1).astype(np.float64)  # [R] tokens, EOS included
    styles = [style_of(t) for t in roll.texts]
    nan = float("nan")
    row = {
        # over the trained batch (with dynamic sampling: the kept groups, so biased upwards) ...
        "reward": float(np.mean(roll.per_function[CORRECT])),
        # ... and over everything sampled this step, all rounds (the engine's metric)
        "reward_sampled": float(metrics.get(f"reward/{CORRECT}/mean", np.nan)),
        "len_all": float(lengths.mean()),
        "len_correct": float(lengths[correct].mean()) if correct.any() else nan,
        "len_incorrect": float(lengths[~correct].mean()) if (~correct).any() else nan,
        "truncated_frac": float(1.0 - roll.finished.mean()),
        "direct_frac": float(np.mean([s == "direct" for s in styles])),
        "verbose_frac": float(np.mean([s == "verbose" for s in styles])),
        # the groups the update actually trained on (after dynamic sampling's refills) with equal rewards
        "zero_variance_trained": float(np.mean(np.ptp(roll.scores.reshape(-1, group_size), axis=1) == 0)),
    }
    for key in ("policy/entropy", "sampling/zero_variance_groups", "sampling/rounds", "policy/clip_frac_low",
                "policy/clip_frac_high", "grad_norm", "time/sample_s", "time/update_s"):
        if key in metrics:
            row[key] = float(metrics[key])
    return row


def run_rl(cfg: RunConfig, *, log: Callable[[str], None] = print, label: str = "",
           extra_row: Callable[[Any, dict], dict] | None = None,
           at_end: Callable[[Any], dict] | None = None) -> list[dict[str, float]]:
    """``cfg.train.steps`` online steps; returns one row per step (see ``step_row``; ``step_s`` is the
    step's wall time). ``extra_row(trainer, metrics)`` adds a reproduction's own values to each row
    (outside ``step_s``); ``at_end(trainer)``'s values go into the last row (e.g. a held-out evaluation)."""
    from rljax.training import OnlineTrainer

    trainer = OnlineTrainer(cfg, overwrite=True)  # a rerun of the script replaces its run
    rows = []
    t0 = time.perf_counter()
    for step in range(cfg.train.steps):
        t_step = time.perf_counter()
        metrics = trainer.step_once()  # advances trainer.step
        row = {"step": step + 1, "step_s": time.perf_counter() - t_step, **step_row(trainer, metrics)}
        if extra_row is not None:
            row.update(extra_row(trainer, metrics))
        rows.append(row)
        if step == 0 or (step + 1) % 10 == 0 or step + 1 == cfg.train.steps:
            log(f"  {label} step {step + 1}/{cfg.train.steps}: reward {row['reward']:.3f}, "
                f"len correct {row['len_correct']:.1f} / incorrect {row['len_incorrect']:.1f}, "
                f"entropy {row.get('policy/entropy', float('nan')):.3f} ({time.perf_counter() - t0:.0f} s)")
    if at_end is not None and rows:
        rows[-1].update(at_end(trainer))
    write_json(os.path.join(cfg.train.run_dir, "curve.json"), rows)
    return rows


def final_window(rows: list[dict], key: str, window: int) -> float:
    """Mean of ``key`` over the last ``window`` steps (NaNs skipped; NaN if none)."""
    values = np.asarray([r.get(key, np.nan) for r in rows[-window:]], dtype=np.float64)
    return float(np.nanmean(values)) if np.isfinite(values).any() else float("nan")


def first_window(rows: list[dict], key: str, window: int) -> float:
    """Mean of ``key`` over the first ``window`` steps (NaNs skipped; NaN if none)."""
    values = np.asarray([r.get(key, np.nan) for r in rows[:window]], dtype=np.float64)
    return float(np.nanmean(values)) if np.isfinite(values).any() else float("nan")


def moving_average(x: np.ndarray, k: int) -> np.ndarray:
    """Trailing mean over up to ``k`` steps (NaNs skipped), same length as ``x``."""
    x = np.asarray(x, dtype=np.float64)
    out = np.full_like(x, np.nan)
    for i in range(len(x)):
        window = x[max(0, i - k + 1): i + 1]
        if np.isfinite(window).any():
            out[i] = np.nanmean(window)
    return out


def plot_curves(curves: dict[str, list[list[dict]]], panels: Sequence[tuple[str, str]], path: str, *,
                smooth: int = 5, title: str = "") -> None:
    """One panel per ``(key, label)``; per method the mean over seeds (``smooth``-step trailing
    average) with a ±1 std band. ``curves[method][seed]`` is a list of step rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        for method, runs in curves.items():
            if not runs:
                continue
            steps = np.asarray([r["step"] for r in runs[0]])
            values = np.stack([moving_average([r.get(key, np.nan) for r in rows], smooth) for rows in runs])
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # a step where no seed has a value: NaN
                mean = np.nanmean(values, axis=0)
                std = np.nanstd(values, axis=0) if len(runs) > 1 else np.zeros_like(mean)
            (line,) = ax.plot(steps, mean, label=method)
            ax.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.15)
        ax.set_xlabel("step")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def slug(name: str) -> str:
    """A folder name for a method label."""
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")


def repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------------
# the driver both reproductions share


def parse_args(name: str, description: str, argv: Sequence[str] | None, presets: Sequence[str] = ()):
    """The common command line: ``--smoke`` / ``--medium`` (where the reproduction has one) / ``--full``
    / default preset, seeds, steps, folders."""
    import argparse

    p = argparse.ArgumentParser(description=description)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--smoke", action="store_true", help="tiny sizes, seconds (for tests)")
    if "medium" in presets:
        g.add_argument("--medium", action="store_true", help="longer runs for this CPU (about two hours)")
    g.add_argument("--full", action="store_true", help="toward the paper's scale (GPU/TPU)")
    p.add_argument("--seeds", type=int, nargs="+", help="RL seeds (default: the preset's)")
    p.add_argument("--steps", type=int, help="RL steps per run (default: the preset's)")
    p.add_argument("--out", help=f"output folder (default runs/paper_repro/{name}/<preset>)")
    p.add_argument("--cache", help="pretrained-policy cache (default runs/paper_repro/_cache)")
    p.add_argument("--plan", metavar="TARGET", help="no training: `rljax plan` the preset's largest run for TARGET "
                   "(h100-1, v5e-4, cpu-N, ...; paper_repro/_plan.py) and exit with its status")
    args = p.parse_args(argv)
    args.preset = ("smoke" if args.smoke else "full" if args.full else "medium" if getattr(args, "medium", False)
                   else "default")
    args.out = os.path.abspath(args.out or os.path.join(repo_root(), "runs", "paper_repro", name, args.preset))
    args.cache = os.path.abspath(args.cache or os.path.join(repo_root(), "runs", "paper_repro", "_cache"))
    os.makedirs(args.out, exist_ok=True)
    return args


def file_logger(out: str) -> Callable[[str], None]:
    """``log(msg)``: print and append to ``out/log.txt``."""
    path = os.path.join(out, "log.txt")

    def log(msg: str) -> None:
        print(msg, flush=True)
        with open(path, "a") as f:
            f.write(msg + "\n")

    return log


def run_methods(spec: PolicySpec, model_dir: str, out: str, methods: dict[str, Sequence[str]],
                common: Sequence[str], seeds: Sequence[int], *, log: Callable[[str], None] = print,
                **run_kwargs) -> tuple[dict[str, list[list[dict]]], RunConfig]:
    """Every method for every seed from the pretrained policy; ``curves[method][seed_index]`` rows.

    Seed-major, and ``out/curves.json`` is rewritten after each run, so an interrupted run still
    has every method for its first seeds. Returns the curves and the last run's config.
    ``run_kwargs`` (``extra_row``, ``at_end``) go to ``run_rl``.
    """
    prompts_dir = os.path.dirname(model_dir)  # pretrain_policy wrote the prompt files there
    curves: dict[str, list[list[dict]]] = {m: [] for m in methods}
    cfg = None
    for seed in seeds:
        for method, overrides in methods.items():
            run_dir = os.path.join(out, "runs", f"{slug(method)}_s{seed}")
            cfg = rl_config(spec, model_dir, prompts_dir, run_dir, [*common, *overrides, f"train.seed={seed}"])
            log(f"{method}, seed {seed}:")
            curves[method].append(run_rl(cfg, log=log, label=method, **run_kwargs))
            write_json(os.path.join(out, "curves.json"), {"seeds": list(seeds), "curves": curves})
    return curves, cfg


def write_report(out: str, *, title: str, description: str, table: str, verdict: str, plot_name: str,
                 total_seconds: float, rl_seconds: float, policy_stats: dict, meta: dict,
                 log: Callable[[str], None] = print) -> str:
    """``out/results.md`` (title, setup, table, verdict, run time) plus ``config.json`` /
    ``environment.json`` (``meta`` and the run times); logs and returns the markdown."""
    from rljax.tools.reporting import save_run_metadata

    text = "\n".join([
        title, "", description, "", table, "", verdict, "",
        f"Run time: {total_seconds / 60:.1f} min in all ({rl_seconds / 60:.1f} min of RL; pretraining "
        f"{policy_stats.get('sft_seconds', 0) / 60:.1f} min when not cached). Plot: `{plot_name}`.", "",
    ])
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text)
    save_run_metadata(out, {**meta, "policy_stats": {k: v for k, v in policy_stats.items() if k != "samples"},
                            "run_seconds": round(total_seconds, 1), "rl_seconds": round(rl_seconds, 1)})
    log(text)
    return text


@dataclasses.dataclass
class Setup:
    """What a reproduction's ``main`` starts from: the command line's preset and folders, a logger,
    the pretrained policy, and the RL overrides every method shares."""

    preset: str
    out: str
    p: dict  # the preset's settings
    seeds: tuple[int, ...]
    steps: int
    log: Callable[[str], None]
    t_start: float
    spec: PolicySpec
    model_dir: str
    policy_stats: dict
    plan: str | None = None  # --plan TARGET: model_dir holds only config.json; see plan_and_exit

    def report(self, *, title: str, description: str, table: str, verdict: str, plot_name: str,
               rl_seconds: float, meta: dict) -> str:
        """``write_report`` with this run's preset, seeds, steps, policy and total time."""
        return write_report(self.out, title=title, description=description, table=table, verdict=verdict,
                            plot_name=plot_name, total_seconds=time.perf_counter() - self.t_start,
                            rl_seconds=rl_seconds, policy_stats=self.policy_stats, log=self.log,
                            meta={"preset": self.preset, "seeds": list(self.seeds), "steps": self.steps,
                                  "policy_spec": self.spec, **meta})

    def common(self, *extra: str) -> list[str]:
        """Steps, group, prompts per step, passes (``iterations``, default 1), no KL, the learning
        rate, then ``extra``."""
        p = self.p
        return [f"train.steps={self.steps}", f"algorithm.group_size={p['group']}",
                f"algorithm.prompts_per_step={p['prompts']}", f"algorithm.num_iterations={p.get('iterations', 1)}",
                "algorithm.kl_coef=0.0", f"optim.learning_rate={p['lr']}", *extra]

    def plan_and_exit(self, methods: dict[str, Sequence[str]], common: Sequence[str], labels: Sequence[str]):
        """With ``--plan TARGET``: ``rljax plan`` the runs of the methods ``labels`` (the preset's
        largest) on the untrained policy's shapes, and exit with its status (0: all fit)."""
        from paper_repro._plan import plan_runs

        prompts_dir = os.path.dirname(self.model_dir)
        runs = [(f"{label} ({self.preset} preset)",
                 rl_config(self.spec, self.model_dir, prompts_dir, os.path.join(self.out, "plan", slug(label)),
                           [*common, *methods[label]]))
                for label in labels]
        raise SystemExit(plan_runs(runs, self.plan, log=self.log))


def setup(name: str, description: str, argv: Sequence[str] | None, presets: dict[str, dict]) -> Setup:
    """Parse the command line, open the log, pretrain (or load) the preset's policy."""
    args = parse_args(name, description, argv, presets=tuple(presets))
    p = dict(presets[args.preset])
    log = file_logger(args.out)
    t_start = time.perf_counter()
    if args.plan:  # shapes only: the preset's untrained policy, no pretraining
        from paper_repro._plan import config_only_model_dir
        from rljax.models.tiny import BYTE_VOCAB_SIZE, tiny_config

        spec = p["spec"]
        model_dir, stats = config_only_model_dir(os.path.join(args.out, "plan"), tiny_config(
            BYTE_VOCAB_SIZE, layers=spec.layers, hidden=spec.hidden, heads=spec.heads, kv_heads=spec.kv_heads)), {}
    else:
        model_dir, stats = pretrain_policy(p["spec"], args.cache, log=log)
    return Setup(preset=args.preset, out=args.out, p=p, seeds=tuple(args.seeds) if args.seeds else p["seeds"],
                 steps=args.steps or p["steps"], log=log, t_start=t_start, spec=p["spec"], model_dir=model_dir,
                 policy_stats=stats, plan=args.plan)


def clearly_positive(values: Sequence[float]) -> str:
    """``yes`` when every paired difference is > 0, ``partly`` when their mean exceeds one
    standard error, else ``no`` (a mean above zero by less than its noise is not a finding)."""
    x = np.asarray([v for v in values if np.isfinite(v)], dtype=np.float64)
    if not len(x):
        return "no"
    if np.all(x > 0):
        return "yes"
    sem = x.std(ddof=1) / np.sqrt(len(x)) if len(x) > 1 else np.inf
    return "partly" if x.mean() > sem else "no"
