"""What every ``experiments/ablate_*.py`` file shares: a sweep of one config over a grid and seeds
(``rljax.tools.sweep``), its comparison table (``rljax.tools.compare``) and the results file.

    python experiments/ablate_X.py [--steps N] [--seeds 0,1,2] [--out DIR] [KEY=VALUE ...]
                                                                             # writes experiments/results/X.md
    python experiments/ablate_X.py --smoke                                   # tiny model, 2 steps: seconds of
                                                                             # work (minutes on a loaded CPU)

The real preset runs the config as committed (its model, task and steps) with the file's grid and
shared overrides. ``--smoke`` swaps in a tiny random model and small data so the whole path (plan,
subprocess runs, compare, results file) runs in a test; its results go under ``--out``, never over
the committed ``experiments/results``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from typing import Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "experiments", "results")

SMOKE_OVERRIDES = ("train.steps=2", "data.train_size=32", "data.eval_size=4", "sampling.max_new_tokens=4",
                   "data.max_prompt_length=512")  # the byte-level tiny tokenizer makes long prompts


def main(name: str, question: str, config: str, grid: dict[str, list[str]], overrides: Sequence[str] = (),
         argv: Sequence[str] | None = None, runner=None) -> int:
    """Parse ``argv``, run the sweep (skipping finished runs), compare, write the results file; returns
    0, or 1 when a run failed (the table then holds the runs that finished)."""
    from rljax.tools.compare import compare, write_compare
    from rljax.tools.sweep import plan_sweep, read_manifest, run_sweep, sweep_failures

    parser = argparse.ArgumentParser(prog=f"experiments/{name}.py", description=question)
    parser.add_argument("--smoke", action="store_true", help="tiny random model, 2 steps, seeds 0,1 (for tests)")
    parser.add_argument("--steps", type=int, default=None, help="train.steps (default: the config's)")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds (default: 0,1,2; smoke: 0,1)")
    parser.add_argument("--out", default=None, help="the sweep directory (default: runs/experiments/NAME[-smoke])")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="more config overrides for every run (e.g. data.eval_size=32)")
    args = parser.parse_args(argv)
    from rljax.tools.sweep import parse_seeds

    seeds = parse_seeds(args.seeds or ("0,1" if args.smoke else "0,1,2"))
    out = args.out or os.path.join("runs", "experiments", name + ("-smoke" if args.smoke else ""))
    shared = list(overrides)
    if args.smoke:
        from rljax.models.tiny import make_tiny_model_dir

        tiny = os.path.join(out, "tiny_model")
        if not os.path.isdir(tiny):
            make_tiny_model_dir(tiny)
        shared += [f"model.name={os.path.abspath(tiny)}", *SMOKE_OVERRIDES]
    if args.steps is not None:
        shared.append(f"train.steps={args.steps}")
    shared += args.overrides
    plan = plan_sweep(os.path.join(REPO, config), grid=grid, seeds=seeds, overrides=shared, out=out)
    start = time.monotonic()
    records = run_sweep(plan, runner=runner, echo=lambda line: print(line, flush=True))
    wall = time.monotonic() - start
    failed = sweep_failures(records)
    result = compare([out])
    write_compare(result, out)
    seconds = sum(r.get("seconds", 0.0) for r in read_manifest(out)["runs"])
    command = shlex.join(["python", f"experiments/{name}.py", *(argv if argv is not None else sys.argv[1:])])
    header = [f"# {name}", "", f"**Question.** {question}", "",
              f"**Command.** `{command}` (the sweep: `{config}`, grid {grid}, seeds {seeds}, overrides {shared})", "",
              f"**Hardware.** {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, load average "
              f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} at the end (a shared machine: times are indicative).",
              "",
              f"**Run time.** {seconds / 60:.1f} min of training summed over the runs this and earlier invocations "
              f"ran; this invocation {wall / 60:.1f} min.", ""]
    if failed:
        header += [f"**Not finished:** {', '.join(r['run_dir'] + ' (' + r['status'] + ')' for r in failed)}", ""]
    target = os.path.join(out, "results.md") if args.smoke else os.path.join(RESULTS, f"{name}.md")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "w") as f:
        f.write("\n".join(header) + "\n" + result["markdown"] + "\n")
    print(f"# wrote {target}")
    return 1 if failed else 0
