"""DPO and its variants: model -> summed sequence log-probs -> ``rljax.losses.preference``.

Wiring only; the losses (sigmoid DPO arXiv:2305.18290, cDPO / label smoothing, robust DPO
arXiv:2403.00409, IPO arXiv:2310.12036, hinge / SLiC arXiv:2305.10425, SimPO arXiv:2405.14734,
reference-free) live in ``rljax.losses.preference.preference_loss`` and are picked by
``offline.loss_type`` / ``offline.reference_free``.

With a margin column (``offline.margin_column``) the sigmoid loss becomes ODPO, DPO with an offset
(Amini, Vieira & Cotterell 2024, arXiv:2402.10571): ``−log σ(βΔ − Δ_r)`` with the per-pair offset
``Δ_r = α · margin`` (``α = offline.odpo_alpha``; the paper uses ``margin = log(s⁺ − s⁻)`` of the
two responses' scores). The chosen response must then beat the rejected one by more where the
preference is stronger. Other loss types have no published offset form and refuse a margin column.

A batch holds ``B`` pairs (``K = 2`` responses each, chosen first):

* ``prompt_ids``, ``prompt_mask`` ``[B, P]`` left-padded;
* ``response_ids``, ``response_mask`` ``[B, 2, N]`` right-padded (``[:, 0]`` chosen, ``[:, 1]`` rejected);
* ``ref_logps`` ``[B, 2]``: summed reference log-probs, computed once before training and cached
  (``offline.precompute_ref_logprobs``; the reference model is then not kept) or per batch from a
  live reference;
* ``row_mask`` ``[B]``: 1 for a real pair (evaluation pads its last batch);
* ``margin`` ``[B]`` (with ``offline.margin_column``): the ODPO offset before scaling by ``α``.

Chosen and rejected go through the model in one forward pass of ``2B`` rows.
"""

from __future__ import annotations

import jax.numpy as jnp

from rljax.logprobs import completion_logprobs
from rljax.losses.preference import preference_loss
from rljax.run_config import OfflineSection


def flatten_responses(batch: dict) -> tuple[jnp.ndarray, ...]:
    """``[B, P]`` prompts and ``[B, K, N]`` responses as ``B·K`` rows (row ``b·K + k``)."""
    B, K, N = batch["response_ids"].shape
    prompt_ids = jnp.repeat(batch["prompt_ids"], K, axis=0)
    prompt_mask = jnp.repeat(batch["prompt_mask"], K, axis=0)
    return prompt_ids, prompt_mask, batch["response_ids"].reshape(B * K, N), batch["response_mask"].reshape(B * K, N)


def sequence_logps(model, batch: dict) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Summed log-probs ``[B, K]`` of each response and its token count ``[B, K]``: one forward pass."""
    B, K, _ = batch["response_ids"].shape
    prompt_ids, prompt_mask, ids, mask = flatten_responses(batch)
    logprobs = completion_logprobs(model, prompt_ids, prompt_mask, ids, mask)["logprobs"]  # [B·K, N]
    valid = mask != 0
    summed = jnp.sum(jnp.where(valid, logprobs, jnp.zeros_like(logprobs)), axis=-1)
    return summed.reshape(B, K), jnp.sum(valid, axis=-1).reshape(B, K).astype(jnp.float32)


def needs_reference(cfg: OfflineSection) -> bool:
    """Whether the loss reads reference log-probs (not for SimPO or reference-free DPO)."""
    return not (cfg.reference_free or cfg.loss_type == "simpo")


def batch_totals(batch: dict, cfg: OfflineSection) -> dict:
    """Global denominators of a batch (before it is split into micro-batches)."""
    return {"num_pairs": jnp.maximum(jnp.sum(batch["row_mask"] != 0, dtype=jnp.float32), 1.0)}


def pair_loss(logps, lengths, ref_logps, row_mask, cfg: OfflineSection, *, margin=None, num_pairs=None):
    """``preference_loss`` of ``[B, 2]`` policy and reference log-probs, as the config says.

    ``margin`` ``[B]`` (used when ``cfg.margin_column`` is set) gives ODPO's offset
    ``Δ_r = α · margin`` (module docstring), passed as ``preference_loss(offset=...)``, which also
    logs ``odpo/offset_mean`` and refuses loss types without a published offset form.
    """
    offset = None
    if margin is not None and cfg.margin_column:
        offset = cfg.odpo_alpha * margin.astype(logps.dtype)
    return preference_loss(
        logps[:, 0], logps[:, 1], ref_logps[:, 0], ref_logps[:, 1],
        loss_type=cfg.loss_type, beta=cfg.beta, label_smoothing=cfg.label_smoothing, simpo_gamma=cfg.simpo_gamma,
        chosen_lengths=lengths[:, 0], rejected_lengths=lengths[:, 1], reference_free=cfg.reference_free,
        mask=row_mask, num_pairs=num_pairs, offset=offset)


def loss(model, batch: dict, cfg: OfflineSection, *, num_pairs):
    """``(loss, metrics)`` of one micro-batch; ``num_pairs`` is the whole batch's pair count."""
    logps, lengths = sequence_logps(model, batch)
    return pair_loss(logps, lengths, batch["ref_logps"], batch["row_mask"], cfg, margin=batch.get("margin"),
                     num_pairs=num_pairs)
