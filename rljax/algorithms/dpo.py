"""DPO and its variants: model -> summed sequence log-probs -> ``rljax.losses.preference``.

Wiring only; the losses (sigmoid DPO arXiv:2305.18290, cDPO / label smoothing, robust DPO
arXiv:2403.00409, IPO arXiv:2310.12036, hinge / SLiC arXiv:2305.10425, SimPO arXiv:2405.14734,
reference-free) live in ``rljax.losses.preference.preference_loss`` and are picked by
``loss_type`` / ``reference_free``.

With ``margin_column`` the sigmoid loss becomes ODPO, DPO with an offset (Amini, Vieira &
Cotterell 2024, arXiv:2402.10571): ``−log σ(βΔ − α · margin)`` (``α = odpo_alpha``; the paper uses
``margin = log(s⁺ − s⁻)``): the chosen response must win by more where the preference is stronger.

Batches are ``PairBatch`` es with ``K = 2`` (chosen first) and ``ref_logps [B, 2]``: the summed
reference log-probs, cached once before training (``precompute_ref_logprobs``; no reference copy of
the model is kept) or computed per batch from a live reference. Chosen and rejected go through the
model in one forward pass of ``2B`` rows.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import jax.numpy as jnp

from rljax.algorithms import _offline
from rljax.algorithms.base import OfflineAlgorithm
from rljax.batches import PairBatch
from rljax.config import check_range
from rljax.losses.preference import preference_loss


@dataclasses.dataclass(frozen=True)
class DPOConfig(_offline.OfflineSettings):
    name: Literal["dpo"] = "dpo"
    chosen_column: str = "chosen"
    rejected_column: str = "rejected"
    loss_type: Literal["sigmoid", "cdpo", "robust", "ipo", "hinge", "simpo"] = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0  # sigmoid / cdpo / robust / simpo epsilon
    simpo_gamma: Optional[float] = None  # SimPO's target margin (null: 0.5); simpo only
    reference_free: bool = False  # reference log-probs taken as 0
    margin_column: Optional[str] = None  # ODPO: per-pair preference strength (sigmoid, no smoothing)
    odpo_alpha: Optional[float] = None  # ODPO: offset = odpo_alpha * margin (null: 1.0); with margin_column
    precompute_ref_logprobs: bool = True  # cache reference log-probs once (no reference copy in memory)

    def validate(self) -> None:
        super().validate()
        check_range(self, "beta", low=0, low_open=True)
        check_range(self, "simpo_gamma")
        limit = 0.5 if self.loss_type == "robust" else 1.0
        if not 0.0 <= self.label_smoothing < limit:
            raise ValueError(f"label_smoothing must be in [0, {limit}) for loss_type={self.loss_type}, "
                             f"got {self.label_smoothing}")
        if self.label_smoothing and self.loss_type in ("ipo", "hinge"):
            raise ValueError(f"label_smoothing does nothing with loss_type={self.loss_type}")
        if self.simpo_gamma is not None and self.loss_type != "simpo":
            raise ValueError(f"simpo_gamma is a setting of loss_type=simpo, not {self.loss_type}")
        if self.odpo_alpha is not None and not self.margin_column:
            raise ValueError("odpo_alpha is used only with margin_column (ODPO's offset)")
        check_range(self, "odpo_alpha", low=0)
        if self.margin_column and (self.loss_type != "sigmoid" or self.label_smoothing):
            raise ValueError(f"margin_column with DPO is ODPO's offset (arXiv:2402.10571), published for "
                             f"loss_type=sigmoid without label smoothing; got loss_type={self.loss_type}, "
                             f"label_smoothing={self.label_smoothing}")


def needs_reference(cfg: DPOConfig) -> bool:
    """Whether the loss reads reference log-probs (not for SimPO or reference-free DPO)."""
    return not (cfg.reference_free or cfg.loss_type == "simpo")


def totals(batch: PairBatch, cfg: DPOConfig) -> dict:
    """Global denominators of a batch (before it is split into micro-batches)."""
    return {"num_rows": jnp.maximum(jnp.sum(batch.row_mask != 0, dtype=jnp.float32), 1.0)}


def pair_loss(logps, lengths, ref_logps, row_mask, cfg: DPOConfig, *, margin=None, num_rows=None):
    """``preference_loss`` of ``[B, 2]`` policy and reference log-probs, as ``cfg`` says; ``margin
    [B]`` is ODPO's offset before scaling by ``odpo_alpha`` (used with ``cfg.margin_column``)."""
    offset = None
    if cfg.margin_column and margin is not None:
        offset = (1.0 if cfg.odpo_alpha is None else cfg.odpo_alpha) * margin.astype(logps.dtype)
    if not needs_reference(cfg):
        ref_logps = jnp.zeros_like(logps)
    return preference_loss(
        logps[:, 0], logps[:, 1], ref_logps[:, 0], ref_logps[:, 1],
        loss_type=cfg.loss_type, beta=cfg.beta, label_smoothing=cfg.label_smoothing,
        simpo_gamma=0.5 if cfg.simpo_gamma is None else cfg.simpo_gamma, chosen_lengths=lengths[:, 0],
        rejected_lengths=lengths[:, 1], reference_free=cfg.reference_free, mask=row_mask, num_pairs=num_rows,
        offset=offset)


def loss(model, batch: PairBatch, cfg: DPOConfig, *, num_rows):
    """``(loss, metrics)`` of one micro-batch; ``num_rows`` is the whole batch's pair count."""
    logps, lengths = _offline.sequence_logps(model, batch)
    return pair_loss(logps, lengths, batch.ref_logps, batch.row_mask, cfg, margin=batch.margin, num_rows=num_rows)


def evaluate(scores, lengths, data, cfg: DPOConfig) -> dict:
    """The DPO objective and its metrics (accuracy, margins, log-probs) on a held-out split."""
    margin = data.values.get("margin")
    ref = data.values.get("ref_logps")  # absent when the loss reads no reference
    ref = jnp.zeros(scores.shape, jnp.float32) if ref is None else jnp.asarray(ref)
    loss_value, metrics = pair_loss(jnp.asarray(scores), jnp.asarray(lengths), ref,
                                    jnp.ones((len(data),), jnp.int32), cfg,
                                    margin=None if margin is None else jnp.asarray(margin))
    return {"loss": loss_value, **metrics}


ALGORITHM = OfflineAlgorithm(name="dpo", config=DPOConfig, data_kind=lambda cfg: "pairs", loss=loss, totals=totals,
                             score=_offline.sequence_logps, evaluate=evaluate, needs_reference=needs_reference,
                             caches_reference=lambda cfg: cfg.precompute_ref_logprobs)
