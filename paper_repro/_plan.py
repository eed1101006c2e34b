"""``--plan TARGET``: check that a reproduction's run fits an accelerator before renting it.

Every reproduction takes ``--plan TARGET`` beside its preset (``--smoke`` / default / ``--full``):
instead of pretraining and training, it builds the RunConfig of its largest run (the method whose
state and batches are biggest) through the same config builders its runs use, with a model directory
that holds only the preset's ``config.json`` (random-init shapes: the plan needs no weights, no
tokenizer, no pretraining), and runs ``rljax plan`` on it (``rljax.tools.cli``, so the report, the
``cpu-N`` re-run in a fresh process and the exit status are those of ``rljax plan CONFIG --target``):
0 when every program fits the target's memory per device, 1 when one does not, 2 on bad input.

    python paper_repro/dr_grpo_length_bias.py --full --plan h100-1
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Callable, Sequence


def config_only_model_dir(root: str, config) -> str:
    """``root/model/config.json`` of ``config`` (a ``rljax.models.config.ModelConfig``) and nothing
    else: what ``rljax plan`` reads for the shapes."""
    path = os.path.join(root, "model")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config.to_hf_dict(), f, indent=1)
    return path


def plan_runs(runs: Sequence[tuple[str, object]], target: str, *, log: Callable[[str], None] = print,
              json_dir: str | None = None) -> int:
    """``rljax plan --target TARGET`` on each ``(label, RunConfig)``; the worst exit status (0: all fit).
    ``json_dir``: also write each report as ``<json_dir>/plan_<n>.json``."""
    from rljax.tools.cli import main as cli_main
    from rljax.config import save_config

    status = 0
    with tempfile.TemporaryDirectory(prefix="rljax_plan_") as tmp:
        for n, (label, cfg) in enumerate(runs):
            path = os.path.join(tmp, f"run_{n}.yaml")
            save_config(cfg, path)
            log(f"## --plan {target}: {label}")
            extra = [] if json_dir is None else ["--json", os.path.join(json_dir, f"plan_{n}.json")]
            status = max(status, cli_main(["plan", path, "--target", target, *extra]))
    return status
