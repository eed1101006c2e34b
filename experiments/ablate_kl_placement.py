"""Ablation: the KL-to-reference penalty in the loss vs in the reward, in GRPO, on the main job.

Question: with the same coefficient (β = 0.04, DeepSeekMath's) and estimator (k3), does putting the
KL term in the loss (``algorithm.kl_placement=loss``: ``+ β k3`` per token inside the reduced loss,
DeepSeekMath arXiv:2402.03300) rather than in the reward (``kl_placement=reward``: each score less
``β Σ_t k3_t`` before GRPO's group normalisation, as RLOO and PPO place it) change the main job's
held-out reward and how far the policy moves (logged ``kl/mean``)? In the loss the term has its own
gradient toward the reference; in the reward it only reweights completions through the advantage.

Command (writes experiments/results/ablate_kl_placement.md; re-running skips finished runs):

    nice -n 10 python experiments/ablate_kl_placement.py --steps 20 --seeds 0,1
    python experiments/ablate_kl_placement.py            # the config's 40 steps, seeds 0,1,2
    python experiments/ablate_kl_placement.py --smoke    # tiny model, 2 steps (tests)

It is ``rljax sweep configs/grpo_smollm2_arith.yaml --grid algorithm.kl_placement=loss,reward
--seeds 0,1,2 algorithm.kl_coef=0.04`` then ``rljax compare``.

Hardware and run time: recorded in the results file's header when it is run (the results so far: see
docs/experiments.md, Ablations).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import _ablation  # noqa: E402

NAME = "ablate_kl_placement"
QUESTION = ("With the same coefficient and estimator, does the KL-to-reference term in the loss vs in the reward "
            "change GRPO's held-out reward on the main job?")
CONFIG = "configs/grpo_smollm2_arith.yaml"
GRID = {"algorithm.kl_placement": ["loss", "reward"]}  # the first is the baseline
OVERRIDES = ["algorithm.kl_coef=0.04", "algorithm.kl_estimator=k3"]


def main(argv=None, runner=None) -> int:
    return _ablation.main(NAME, QUESTION, CONFIG, GRID, OVERRIDES, argv=argv, runner=runner)


if __name__ == "__main__":
    sys.exit(main())
