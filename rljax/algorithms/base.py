"""The one algorithm interface: what an algorithm declares so that a trainer can run it without
branching on its name.

An algorithm is one module under ``rljax/algorithms/`` exporting ``ALGORITHM``, an
:class:`OnlineAlgorithm` or an :class:`OfflineAlgorithm`, and its config section (a frozen
dataclass with ``name: Literal["<name>"]``: the ``algorithm:`` section of a run config holds only
the settings that algorithm uses). ``rljax.algorithms.ALGORITHMS`` maps names to them.

An online step (``rljax.training.online``)::

    rollouts (sampler + rewards) -> RolloutBatch
      -> reference log-probs        if needs_reference(cfg)
      -> old values                 if value_head(cfg) is "shared" (policy's head) or "separate" (critic)
      -> advantages(batch, cfg)     fills batch.advantages (and batch.returns); an algorithm with
                                    initial_state: advantages(batch, cfg, state) -> (batch, state')
      -> num_iterations × mini_batches updates of loss(model, batch, cfg, temperature=, **totals(batch, cfg))
         (+ critic_loss on the critic's own parameters when value_head(cfg) == "separate",
            with critic(cfg): its model and learning rate)
      -> kl/mean logged with reward_kl_estimator(cfg) when the KL is in the reward

An offline step (``rljax.training.offline``)::

    rows of kind data_kind(cfg) (a kind registered in ``rljax.data.kinds``: "pairs", "ranked",
    "records", "transcripts") -> prepare(set, cfg) -> batches
      -> reference log-probs cached once  if needs_reference(cfg)
      -> one update of loss(model, batch, cfg, **totals(batch, cfg))
    evaluation: score(...) of every held-out completion (no gradient), then evaluate(scores, ...)

Adding an algorithm: one module with its config section and ``ALGORITHM``, one line in
``rljax/algorithms/__init__.py``, a config in ``configs/`` and its tests. No trainer changes. An
algorithm kept outside rljax is named from YAML instead (``algorithm: {name: "path/to/file.py:ALGORITHM",
...}`` or ``"package.module:ALGORITHM"``): ``rljax.algorithms.get`` loads it; the online helpers it
builds on are ``rljax.algorithms.policy_gradient``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal, Optional

from rljax.algorithms.policy_gradient import totals as pg_totals

ValueHead = Optional[Literal["shared", "separate"]]


@dataclasses.dataclass(frozen=True)
class CriticSettings:
    """A separate critic's model and learning rate (``value_head(cfg) == "separate"``).

    Attributes:
      model: registered name / ``.gguf`` / Hugging Face directory; None = ``model.name``.
      learning_rate: its AdamW rate; None = ``optim.learning_rate``.
    """

    model: Optional[str] = None
    learning_rate: Optional[float] = None


def _no_critic(cfg) -> CriticSettings:
    return CriticSettings()


def _no_reward_kl(cfg) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class OnlineAlgorithm:
    """An online RL algorithm: rollouts -> advantages -> loss.

    Attributes:
      name: the ``algorithm.name`` that selects it.
      config: its config section class.
      advantages: ``(RolloutBatch, cfg) -> RolloutBatch`` with ``advantages`` (and ``returns``) set.
      loss: ``(model, RolloutBatch, cfg, *, temperature, num_rows, num_tokens, max_length) ->
        (loss, metrics)`` of one micro-batch; totals are the mini-batch's (global denominators).
      needs_reference: ``cfg -> bool``: the batch needs ``ref_logprobs`` (a KL term is on).
      value_head: ``cfg -> None | "shared" | "separate"``: where value estimates come from.
      critic_loss: with a separate critic, ``(critic_model, batch, cfg, **totals) -> (loss, metrics)``.
      value_head_init: how a fresh value head starts when ``model.value_head_init`` is null
        (``"normal"`` | ``"zeros"``, ``rljax.models.value_head``).
      initial_state: ``cfg -> dict[str, float]`` for an algorithm that carries state across steps
        (a moving-average baseline, ``rljax.algorithms.reinforce``); its ``advantages`` then takes
        the state and returns ``(batch, state')``. The trainer keeps the state of the last completed
        step and saves it with every checkpoint, so a resume continues bitwise.
      totals: ``(RolloutBatch, cfg) -> dict`` of a mini-batch's global denominators (``num_rows``,
        ``num_tokens``, ``max_length``), the keywords ``loss`` and ``critic_loss`` take; default
        ``rljax.algorithms.policy_gradient.totals``.
      critic: ``cfg -> CriticSettings``: the separate critic's model and learning rate (read only
        when ``value_head(cfg) == "separate"``).
      reward_kl_estimator: ``cfg -> "k1" | "k2" | "k3" | None``: the KL estimator the reward
        used, logged as ``kl/mean`` when the loss logs no KL itself; None = not logged.
    """

    name: str
    config: type
    advantages: Callable[..., Any]
    loss: Callable[..., Any]
    needs_reference: Callable[[Any], bool]
    value_head: Callable[[Any], ValueHead] = lambda cfg: None
    critic_loss: Callable[..., Any] | None = None
    value_head_init: str = "normal"
    initial_state: Callable[[Any], dict] | None = None
    totals: Callable[..., dict] = pg_totals
    critic: Callable[[Any], CriticSettings] = _no_critic
    reward_kl_estimator: Callable[[Any], Optional[str]] = _no_reward_kl
    online: bool = dataclasses.field(default=True, init=False)

    def start_state(self, cfg) -> dict | None:
        """The state before the first step: ``initial_state(cfg)``, None for a stateless algorithm."""
        return None if self.initial_state is None else self.initial_state(cfg)

    def advantages_and_state(self, batch, cfg, state: dict | None):
        """``(batch with advantages, state')``: one call for stateless and stateful algorithms
        (``state'`` is ``None`` for a stateless one)."""
        if self.initial_state is None:
            return self.advantages(batch, cfg), None
        return self.advantages(batch, cfg, state)


@dataclasses.dataclass(frozen=True)
class OfflineAlgorithm:
    """An offline algorithm: a fixed data set -> batches -> loss.

    Attributes:
      name, config: as :class:`OnlineAlgorithm`.
      data_kind: ``cfg -> str``: the rows it reads, a kind registered in ``rljax.data.kinds``
        (``"pairs"``, ``"ranked"``, ``"records"``, ``"transcripts"``).
      loss: ``(model, batch, cfg, **totals) -> (loss, metrics)`` of one micro-batch.
      totals: ``(batch, cfg) -> dict`` of the whole batch's denominators.
      score: ``(model, batch) -> (scores [B, K], lengths [B, K])``, no gradient: summed log-probs
        (``"logps"``) or rewards, what ``evaluate`` and the reference cache read.
      evaluate: ``(scores [n, K], lengths [n, K], data: EncodedSet, cfg) -> metrics`` on a held-out
        split (the training objective and its metrics, from the same loss functions).
      needs_reference: ``cfg -> bool``: ``batch.ref_logps`` (summed reference log-probs) is read.
      value_head: the model carries a scalar head (reward models).
      value_head_init: as :class:`OnlineAlgorithm`.
      prepare: ``(EncodedSet, cfg, split) -> (EncodedSet, counts)``: per-row constants computed
        once (record weights); ``None`` = nothing to prepare.
      caches_reference: ``cfg -> bool``: the reference log-probs are computed once before training
        (no reference copy kept); False = a live reference scores every batch.
    """

    name: str
    config: type
    data_kind: Callable[[Any], str]
    loss: Callable[..., Any]
    totals: Callable[..., dict]
    score: Callable[..., Any]
    evaluate: Callable[..., dict]
    needs_reference: Callable[[Any], bool] = lambda cfg: False
    value_head: bool = False
    prepare: Callable[..., Any] | None = None
    value_head_init: str = "normal"
    caches_reference: Callable[[Any], bool] = lambda cfg: True
    online: bool = dataclasses.field(default=False, init=False)


__all__ = ["CriticSettings", "OfflineAlgorithm", "OnlineAlgorithm", "ValueHead"]
