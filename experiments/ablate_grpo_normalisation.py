"""Ablation: token- vs sequence-level loss normalisation in GRPO, on the main job.

Question: does averaging the GRPO loss over every token of the batch (``token_mean``, DAPO,
arXiv:2503.14476) rather than over each sequence's tokens and then over sequences
(``seq_mean_token_mean``, the original GRPO, arXiv:2402.03300) change the held-out reward of the
main job (configs/grpo_smollm2_arith.yaml: SmolLM2-135M-Instruct, LoRA rank 16, two-digit additions)?
The two weigh a long completion's tokens differently (token_mean: every token equally; seq_mean:
every sequence equally); with 24-token completions that mostly stop early the difference is small.

Command (writes experiments/results/ablate_grpo_normalisation.md; re-running skips finished runs):

    nice -n 10 python experiments/ablate_grpo_normalisation.py --steps 20 --seeds 0,1
    python experiments/ablate_grpo_normalisation.py            # the config's 40 steps, seeds 0,1,2
    python experiments/ablate_grpo_normalisation.py --smoke    # tiny model, 2 steps (tests)

It is ``rljax sweep configs/grpo_smollm2_arith.yaml --grid
algorithm.reduction=token_mean,seq_mean_token_mean --seeds 0,1,2`` then ``rljax compare``.

Hardware and run time: recorded in the results file's header when it runs. Not run to the end yet:
on the 2-core CPU shared with five other jobs (load average ~20, 2026-11-24) the first run of
``--steps 20 --seeds 0,1`` took 20 min to its first step (the 64-prompt initial evaluation and the
compiles), so the four runs did not fit the session; the sweep is resumable, so the same command
continues from the checkpoints it leaves.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import _ablation  # noqa: E402

NAME = "ablate_grpo_normalisation"
QUESTION = ("Does token-level (token_mean) vs sequence-level (seq_mean_token_mean) normalisation of the GRPO "
            "loss change the main job's held-out reward?")
CONFIG = "configs/grpo_smollm2_arith.yaml"
GRID = {"algorithm.reduction": ["token_mean", "seq_mean_token_mean"]}  # the first is the baseline


def main(argv=None, runner=None) -> int:
    return _ablation.main(NAME, QUESTION, CONFIG, GRID, argv=argv, runner=runner)


if __name__ == "__main__":
    sys.exit(main())
