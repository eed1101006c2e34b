"""Ablation: the static sampler against the rollout engine, on the main job.

Question: does sampling the main job (configs/grpo_smollm2_arith.yaml: SmolLM2-135M-Instruct, LoRA
rank 16, two-digit additions, GRPO) with the rollout engine (``sampling.engine: paged``: continuous
batching over a paged KV cache, per-request keys) rather than the static sampler (``static``: one
left-padded batch, one key) change its held-out reward? Both sample the same distribution with
log-probs equal to the trainer's; they draw different tokens for the same seed (different keys), so
single runs differ by training variance, and only seeds can tell a real difference from it.

Command (writes experiments/results/ablate_sampler_engine.md; re-running skips finished runs):

    python experiments/ablate_sampler_engine.py                # the config's 40 steps, seeds 0,1,2
    python experiments/ablate_sampler_engine.py --smoke        # tiny model, 2 steps (tests)

It is ``rljax sweep configs/grpo_smollm2_arith.yaml --grid sampling.engine=static,paged --seeds
0,1,2`` then ``rljax compare``. Hardware and run time: in the results file's header.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import _ablation  # noqa: E402

NAME = "ablate_sampler_engine"
QUESTION = ("Does sampling the main job with the rollout engine (sampling.engine: paged) instead of the static "
            "sampler change its held-out reward?")
CONFIG = "configs/grpo_smollm2_arith.yaml"
GRID = {"sampling.engine": ["static", "paged"]}  # the first is the baseline


def main(argv=None, runner=None) -> int:
    return _ablation.main(NAME, QUESTION, CONFIG, GRID, argv=argv, runner=runner)


if __name__ == "__main__":
    sys.exit(main())
