"""The starting weights of a fresh scalar value / reward head ``{w [D], b [1]}``.

    vh = fresh_value_head(hidden_size=576, init="normal", std=0.02, seed=0)  # {"w": [576], "b": [1]}

A head read from a checkpoint (``value_head.safetensors`` in a Hugging Face directory) is kept as
it is; only a model that has no head yet gets one of these (``rljax.models.load``).

What the reference implementations start from:

- transformers: ``*ForSequenceClassification`` (``GenericForSequenceClassification`` in
  ``transformers/modeling_layers.py``) adds ``score = nn.Linear(D, num_labels, bias=False)``, and
  ``PreTrainedModel._init_weights`` (``transformers/modeling_utils.py``) draws a fresh Linear's
  weight from ``normal(0, config.initializer_range)`` (0.02 for Llama / SmolLM2), bias zero.
- TRL: ``RewardTrainer`` (``trl/trainer/reward_trainer.py``) loads the model with
  ``AutoModelForSequenceClassification.from_pretrained(..., num_labels=1)``: the head above. Its PPO
  examples build the value model the same way (``value_model =
  AutoModelForSequenceClassification.from_pretrained(reward_model_path, num_labels=1)``), so
  PPO's critic starts from the trained reward model's head, or from a fresh normal(0.02) one.
- OpenRLHF: ``get_llm_for_sequence_regression`` (``openrlhf/models/model.py``) adds ``value_head =
  nn.Linear(D, 1, bias=False)`` and, for reward-model training and for a critic started from the
  policy's weights (``init_value_head``), draws it from ``normal(0, 1 / (D + 1))``.
- verl: the critic is ``AutoModelForTokenClassification(num_labels=1)``
  (``verl/utils/model.py:load_valuehead_model``): transformers' normal(initializer_range) head.

None of them starts from zero. A zero head has a zero gradient with respect to the hidden state,
so in full fine-tuning nothing below the head learns until the head has grown (see
docs/offline.md#reward-and-value-heads). So a reward model starts from normal(0.02). PPO starts
from zero (a zero head predicts exactly 0 at the start; a shared head's body is trained by the policy
loss anyway): in short PPO runs, shared head and separate critic, it fitted the returns as well or
slightly better than normal(0.02) (experiments/results/ppo_value_head_init.md).
``model.value_head_init`` picks either for any run.
"""

from __future__ import annotations

import jax
import numpy as np

from rljax import rng

VALUE_HEAD_INITS = ("normal", "zeros")
DEFAULT_VALUE_HEAD_STD = 0.02  # transformers' initializer_range default, and SmolLM2's

__all__ = ["DEFAULT_VALUE_HEAD_STD", "VALUE_HEAD_INITS", "fresh_value_head"]


def fresh_value_head(hidden_size: int, *, init: str = "normal", std: float = DEFAULT_VALUE_HEAD_STD,
                     seed: int = 0) -> dict[str, np.ndarray]:
    """A new head ``{"w": [hidden_size], "b": [1]}`` (float32, on the host).

    ``init="normal"``: ``w ~ normal(0, std)`` from the ``"value_head"`` stream of ``seed`` (the same
    seed gives the same head), ``b = 0``. ``init="zeros"``: both zero. Raises ``ValueError`` for
    another ``init`` or a negative ``std``.
    """
    if init not in VALUE_HEAD_INITS:
        raise ValueError(f"value head init must be one of {VALUE_HEAD_INITS}, got {init!r}")
    if not std >= 0:
        raise ValueError(f"value head std must be >= 0, got {std!r}")
    b = np.zeros((1,), np.float32)
    if init == "zeros":
        return {"w": np.zeros((hidden_size,), np.float32), "b": b}
    w = std * jax.random.normal(rng.stream(seed, "value_head"), (hidden_size,), dtype=np.float32)
    return {"w": np.asarray(w, np.float32), "b": b}
