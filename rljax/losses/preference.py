"""Offline preference losses on sequence log-probabilities: DPO and its variants.

Inputs are per-pair ``[B]`` **sums** of completion-token log-probs under the policy and the frozen
reference. With ``c = logπ(y⁺) − logπ_ref(y⁺)``, ``r = logπ(y⁻) − logπ_ref(y⁻)``, ``Δ = c − r``
and ``ε = label_smoothing``, the per-pair losses are:

============ ====================================================== ==================================
loss_type    per-pair loss                                          paper / reference code
============ ====================================================== ==================================
``sigmoid``  ``−(1−ε) log σ(βΔ) − ε log σ(−βΔ)`` (ε = 0: DPO)       DPO arXiv:2305.18290
``cdpo``     same as ``sigmoid`` (name for ε > 0)                   cDPO (Mitchell 2023, "A note on
                                                                    DPO with noisy preferences")
``robust``   ``[−(1−ε) log σ(βΔ) + ε log σ(−βΔ)] / (1 − 2ε)``       rDPO arXiv:2403.00409
``ipo``      ``(c/|y⁺| − r/|y⁻| − 1/(2β))²``                        IPO arXiv:2310.12036 (TRL: log-
                                                                    ratios averaged per token)
``hinge``    ``relu(1 − βΔ)``                                       SLiC arXiv:2305.10425
``simpo``    ``−(1−ε) log σ(βΔ̄ − γ) − ε log σ(−(βΔ̄ − γ))``,        SimPO arXiv:2405.14734 (TRL
             ``Δ̄ = logπ(y⁺)/|y⁺| − logπ(y⁻)/|y⁻|``, no reference    ``CPOTrainer`` ``simpo``)
============ ====================================================== ==================================

With a per-pair ``offset`` ``o`` ``[B]`` (``sigmoid`` with ε = 0 only) the loss is ODPO, DPO with an
offset (Amini, Vieira & Cotterell 2024, arXiv:2402.10571): ``−log σ(βΔ − o)``; the chosen
response must beat the rejected one by a larger implicit-reward margin where the preference is
stronger. The paper's offset is ``o = α · log(s⁺ − s⁻)`` from the two responses' scores; the caller
computes it (e.g. ``α · margin``). Other loss types have no published offset form and refuse one.

``reference_free=True`` sets the reference log-probs to 0 (``c = logπ(y⁺)``, ...); ``simpo`` never
uses them. Reference code: TRL ``DPOTrainer`` (``sigmoid``, ``robust``, ``ipo``, ``hinge``).
"""

from __future__ import annotations

import numbers

import chex
import jax
import jax.numpy as jnp

from rljax.losses.reduce import masked_mean

LOSS_TYPES = ("sigmoid", "cdpo", "robust", "ipo", "hinge", "simpo")


def _check_offset_setting(loss_type, label_smoothing):
    # ODPO (arXiv:2402.10571) is published for the plain logistic loss only; a label-smoothed or
    # other offset form would be an invention, so refuse it instead of guessing.
    if loss_type != "sigmoid":
        raise ValueError(f"preference_loss: offset (ODPO, arXiv:2402.10571) needs loss_type='sigmoid', "
                         f"got loss_type={loss_type!r}")
    if not (isinstance(label_smoothing, numbers.Real) and label_smoothing == 0):  # a traced ε cannot be checked
        raise ValueError("preference_loss: offset (ODPO, arXiv:2402.10571) needs label_smoothing=0 (a Python "
                         f"number), got label_smoothing={label_smoothing}")


def _smoothed_logistic(z, label_smoothing):
    return -(1.0 - label_smoothing) * jax.nn.log_sigmoid(z) - label_smoothing * jax.nn.log_sigmoid(-z)


def preference_loss(
    policy_chosen_logps: chex.Array,
    policy_rejected_logps: chex.Array,
    ref_chosen_logps: chex.Array,
    ref_rejected_logps: chex.Array,
    *,
    loss_type: str = "sigmoid",
    beta=0.1,
    label_smoothing=0.0,
    simpo_gamma=0.5,
    chosen_lengths: chex.Array | None = None,
    rejected_lengths: chex.Array | None = None,
    reference_free: bool = False,
    mask: chex.Array | None = None,
    num_pairs=None,
    offset: chex.Array | None = None,
) -> tuple[chex.Array, dict[str, chex.Array]]:
    """Mean over pairs of a DPO-family loss (formulas in the module docstring).

    Args:
      policy_chosen_logps, policy_rejected_logps: ``[B]`` summed log π_θ of y⁺ / y⁻.
      ref_chosen_logps, ref_rejected_logps: ``[B]`` summed log π_ref (stop-gradient; ignored by
        ``simpo`` and when ``reference_free``).
      loss_type: one of ``LOSS_TYPES``.
      beta: ``β`` (DPO temperature; for IPO the regulariser ``τ``; SimPO's ``β``, often 2–2.5).
      label_smoothing: ``ε`` for ``sigmoid``/``cdpo``/``robust``/``simpo`` (``robust``: ε < 0.5).
      simpo_gamma: SimPO's target margin ``γ`` (TRL ``CPOConfig.simpo_gamma`` default 0.5).
      chosen_lengths, rejected_lengths: ``[B]`` completion token counts ``|y⁺|``, ``|y⁻|``;
        required by ``ipo`` and ``simpo``.
      reference_free: treat ``log π_ref`` as 0.
      mask: optional ``[B]`` (nonzero = the pair counts; padding rows change nothing).
      num_pairs: global pair count for micro-batching (default: local valid pairs). Per-part
        losses with the global count sum to the whole-batch loss.
      offset: optional ``[B]`` ODPO offset ``o`` (stop-gradient): the loss becomes
        ``−log σ(βΔ − o)`` (arXiv:2402.10571). Only with ``loss_type="sigmoid"`` and
        ``label_smoothing=0`` (a Python number); anything else raises ``ValueError``.
    Returns:
      ``(loss, metrics)``; metrics are local means over valid pairs: ``rewards/chosen``
      (``β c``; SimPO: ``β logπ(y⁺)/|y⁺|``), ``rewards/rejected``, ``rewards/margin``
      (chosen − rejected), ``rewards/accuracy`` (fraction with chosen > rejected),
      ``preference/loss``, ``logps/chosen``, ``logps/rejected``. The implicit rewards and
      log-probs never see the offset (``preference/loss`` is the ODPO loss); with ``offset``
      also ``odpo/offset_mean`` (mean ``o``).
    """
    logps = [policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps]
    chex.assert_rank(logps, 1)
    chex.assert_equal_shape(logps)
    chex.assert_type(logps, float)
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"preference_loss: loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    needs_lengths = loss_type in ("ipo", "simpo")
    if needs_lengths and (chosen_lengths is None or rejected_lengths is None):
        raise ValueError(f"loss_type={loss_type!r} needs chosen_lengths and rejected_lengths")
    if loss_type == "robust" and isinstance(label_smoothing, (int, float)) and not 0 <= label_smoothing < 0.5:
        raise ValueError(f"robust DPO needs 0 <= label_smoothing < 0.5, got {label_smoothing}")
    if offset is not None:
        _check_offset_setting(loss_type, label_smoothing)
    if mask is None:
        mask = jnp.ones_like(policy_chosen_logps)
    chex.assert_equal_shape([policy_chosen_logps, mask])
    valid = mask != 0
    dtype = policy_chosen_logps.dtype

    def clean(x):  # padded pairs may hold anything
        return jnp.where(valid, x, jnp.zeros_like(x))

    pol_c, pol_r = clean(policy_chosen_logps), clean(policy_rejected_logps)
    if reference_free or loss_type == "simpo":
        ref_c = ref_r = jnp.zeros_like(pol_c)
    else:
        ref_c = jax.lax.stop_gradient(clean(ref_chosen_logps))
        ref_r = jax.lax.stop_gradient(clean(ref_rejected_logps))
    if offset is not None:
        chex.assert_equal_shape([policy_chosen_logps, offset])
        offset = jax.lax.stop_gradient(clean(offset.astype(dtype)))
    if needs_lengths:
        chex.assert_equal_shape([policy_chosen_logps, chosen_lengths, rejected_lengths])
        len_c = jnp.maximum(jnp.where(valid, chosen_lengths, 1).astype(dtype), 1.0)
        len_r = jnp.maximum(jnp.where(valid, rejected_lengths, 1).astype(dtype), 1.0)

    chosen_logratio = pol_c - ref_c  # c
    rejected_logratio = pol_r - ref_r  # r
    delta = chosen_logratio - rejected_logratio

    if loss_type in ("sigmoid", "cdpo"):
        logit = beta * delta if offset is None else beta * delta - offset  # ODPO: βΔ − o
        per_pair = _smoothed_logistic(logit, label_smoothing)
    elif loss_type == "robust":
        clean_term = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(beta * delta)
        flipped_term = -label_smoothing * jax.nn.log_sigmoid(-beta * delta)
        per_pair = (clean_term - flipped_term) / (1.0 - 2.0 * label_smoothing)
    elif loss_type == "ipo":
        ipo_delta = chosen_logratio / len_c - rejected_logratio / len_r
        per_pair = jnp.square(ipo_delta - 1.0 / (2.0 * beta))
    elif loss_type == "hinge":
        per_pair = jax.nn.relu(1.0 - beta * delta)
    else:  # simpo
        avg_delta = pol_c / len_c - pol_r / len_r
        per_pair = _smoothed_logistic(beta * avg_delta - simpo_gamma, label_smoothing)

    loss = masked_mean(per_pair, valid, denominator=num_pairs)

    if loss_type == "simpo":
        chosen_rewards, rejected_rewards = beta * pol_c / len_c, beta * pol_r / len_r
    else:
        chosen_rewards, rejected_rewards = beta * chosen_logratio, beta * rejected_logratio
    metrics = {
        "preference/loss": loss,
        "rewards/chosen": masked_mean(chosen_rewards, valid),
        "rewards/rejected": masked_mean(rejected_rewards, valid),
        "rewards/margin": masked_mean(chosen_rewards - rejected_rewards, valid),
        "rewards/accuracy": masked_mean((chosen_rewards > rejected_rewards).astype(dtype), valid),
        "logps/chosen": masked_mean(pol_c, valid),
        "logps/rejected": masked_mean(pol_r, valid),
    }
    if offset is not None:
        metrics["odpo/offset_mean"] = masked_mean(offset, valid)
    return loss, jax.lax.stop_gradient(metrics)
