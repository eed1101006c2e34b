"""Pure loss functions over arrays: ``(loss, metrics) = f(arrays..., *, hyperparameters)``.

Modules: ``reduce`` (token/sequence reductions, implemented once), ``policy`` (clipped surrogate,
REINFORCE), ``kl`` (KL estimators), ``value`` (PPO value loss), ``preference`` (DPO family),
``reward_model`` (Bradley–Terry, K-wise ranking), ``off_policy`` (truncated / masked importance
weights for a sampler that is not the trained policy), ``records`` (AWR / RWR / filtered-BC weights and
the weighted NLL of scored records), ``sft`` (NLL of a transcript's assistant tokens).
"""

from rljax.losses.kl import KL_ESTIMATORS, kl_loss, kl_penalty
from rljax.losses.off_policy import OFF_POLICY_MODES, off_policy_weights
from rljax.losses.policy import policy_gradient_loss, reinforce_loss
from rljax.losses.preference import preference_loss
from rljax.losses.records import (RECORD_BASELINES, RECORD_MODES, prompt_baselines, record_weights,
                                 weighted_nll_loss)
from rljax.losses.reduce import REDUCTIONS, masked_mean, reduce_tokens
from rljax.losses.reward_model import bradley_terry_loss, kwise_ranking_loss
from rljax.losses.sft import sft_loss
from rljax.losses.value import explained_variance, value_loss

__all__ = [
    "KL_ESTIMATORS",
    "OFF_POLICY_MODES",
    "RECORD_BASELINES",
    "RECORD_MODES",
    "REDUCTIONS",
    "bradley_terry_loss",
    "explained_variance",
    "kl_loss",
    "kl_penalty",
    "kwise_ranking_loss",
    "masked_mean",
    "off_policy_weights",
    "policy_gradient_loss",
    "preference_loss",
    "prompt_baselines",
    "record_weights",
    "reduce_tokens",
    "reinforce_loss",
    "sft_loss",
    "value_loss",
    "weighted_nll_loss",
]
