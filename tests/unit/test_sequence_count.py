"""``algorithm.sequence_count``: the S a sequence-level reduction divides by. "nonempty" (default)
counts the rows that still have a loss token; "all" counts every row of the mini-batch, as TRL's
GRPOTrainer divides by B. Hand-computed on a batch with one fully masked (e.g. truncated) row."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.algorithms.policy_gradient import totals
from rljax.config import ConfigError, from_yaml
from rljax.losses.reduce import reduce_tokens
from rljax.run_config import RunConfig

PER_TOKEN = np.array([[1.0, 2.0, 9.0, 9.0], [3.0, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
MASK = np.array([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # row 2 masked out: B = 3, S = 2, T = 4


def _algorithm(extra=""):
    return from_yaml(RunConfig, f"algorithm: {{name: grpo {extra}}}\nrewards: {{answer: 1.0}}\n").algorithm


@pytest.mark.parametrize("count, dr_grpo, grpo", [
    ("nonempty", 6.0 / (2 * 4), (1.5 + 3.0) / 2),  # Σ m ℓ / (S · L_max); (1/S) Σ_i row means
    ("all", 6.0 / (3 * 4), (1.5 + 3.0) / 3),  # TRL: B = 3 rows, the masked one included
])
def test_sequence_count_sets_the_rows_a_sequence_reduction_divides_by(count, dr_grpo, grpo):
    cfg = _algorithm(f", sequence_count: {count}")
    assert cfg.sequence_count == count
    with jax.enable_x64(True):
        t = totals(SimpleNamespace(loss_mask=jnp.asarray(MASK)), cfg)
        assert int(t["num_rows"]) == (3 if count == "all" else 2) and int(t["num_tokens"]) == 3
        assert t["max_length"] == 4
        per_token = jnp.asarray(PER_TOKEN, jnp.float64)
        for mode, want in (("seq_mean_token_sum_norm", dr_grpo), ("seq_mean_token_mean", grpo)):
            got = reduce_tokens(per_token, jnp.asarray(MASK), mode=mode, num_sequences=t["num_rows"],
                                max_length=t["max_length"])
            assert got.dtype == jnp.float64 and float(got) == want


def test_sequence_count_default_and_bad_value():
    assert _algorithm().sequence_count == "nonempty"
    assert int(totals(SimpleNamespace(loss_mask=jnp.asarray(MASK)))["num_rows"]) == 2  # no cfg: the default
    with pytest.raises(ConfigError, match="algorithm.sequence_count"):
        _algorithm(", sequence_count: every")
