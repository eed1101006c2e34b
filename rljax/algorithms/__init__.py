"""Every algorithm rljax runs, one module each, behind one interface (``rljax.algorithms.base``).

==================  =======  ==========================================================
name                kind     module
==================  =======  ==========================================================
``grpo``            online   GRPO and variants (DAPO, Dr. GRPO, GSPO): KL in the loss
``ppo``             online   PPO with a value head or a separate critic, GAE
``rloo``            online   RLOO: leave-one-out baseline; clip or the paper's REINFORCE loss
``reinforce_pp``    online   REINFORCE++: batch-normalised returns, no critic
``reinforce``       online   REINFORCE with a moving-average baseline carried across steps
``dpo``             offline  DPO, cDPO, robust DPO, IPO, hinge, SimPO, ODPO
``reward_model``    offline  Bradley–Terry / K-wise reward models
``records``         offline  scored records: AWR, RWR, filtered behaviour cloning
``sft``             offline  supervised fine-tuning on chat transcripts (assistant tokens only)
==================  =======  ==========================================================
"""

from __future__ import annotations

from rljax.algorithms import dpo, grpo, ppo, records, reinforce, reinforce_pp, reward_model, rloo, sft
from rljax.algorithms.base import OfflineAlgorithm, OnlineAlgorithm

ALGORITHMS: dict[str, OnlineAlgorithm | OfflineAlgorithm] = {
    m.ALGORITHM.name: m.ALGORITHM for m in (grpo, ppo, rloo, reinforce_pp, reinforce, dpo, reward_model, records, sft)
}


def get(name: str) -> OnlineAlgorithm | OfflineAlgorithm:
    """The algorithm called ``name``; a ``KeyError`` listing the known ones otherwise."""
    if name not in ALGORITHMS:
        raise KeyError(f"unknown algorithm {name!r}; known: {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


__all__ = ["ALGORITHMS", "OfflineAlgorithm", "OnlineAlgorithm", "get"]
