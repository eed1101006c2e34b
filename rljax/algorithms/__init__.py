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

An algorithm kept outside rljax is named by where it lives, ``algorithm: {name: "path/to/file.py:ALGORITHM",
...}`` or ``"package.module:ALGORITHM"`` (the loader of ``type: python`` rewards, ``rljax.plugins``):
its ``ALGORITHM`` is an ``OnlineAlgorithm`` or ``OfflineAlgorithm`` whose ``config`` is a frozen
dataclass; the section's other keys are checked against that class.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from rljax.algorithms import dpo, grpo, ppo, records, reinforce, reinforce_pp, reward_model, rloo, sft
from rljax.algorithms.base import OfflineAlgorithm, OnlineAlgorithm
from rljax.errors import UserError
from rljax.plugins import is_spec, load_object

ALGORITHMS: dict[str, OnlineAlgorithm | OfflineAlgorithm] = {
    m.ALGORITHM.name: m.ALGORITHM for m in (grpo, ppo, rloo, reinforce_pp, reinforce, dpo, reward_model, records, sft)
}


def get(name: str) -> OnlineAlgorithm | OfflineAlgorithm:
    """The algorithm called ``name``, or the one a ``source:ALGORITHM`` reference names (loaded once);
    a ``KeyError`` listing the known ones otherwise."""
    if name in ALGORITHMS:
        return ALGORITHMS[name]
    if is_spec(name):
        return _outside(name)
    raise KeyError(f"unknown algorithm {name!r}; known: {', '.join(ALGORITHMS)}")


_OUTSIDE: dict[str, OnlineAlgorithm | OfflineAlgorithm] = {}  # spec -> the algorithm loaded from it
_SECTIONS: dict[str, type] = {}  # spec -> its config section class, tagged by the spec


def _outside(spec: str) -> OnlineAlgorithm | OfflineAlgorithm:
    if spec not in _OUTSIDE:
        algo = load_object(spec, where="algorithm.name", what="algorithm")
        if not isinstance(algo, (OnlineAlgorithm, OfflineAlgorithm)):
            raise UserError(f"algorithm.name: algorithm {spec!r} is a {type(algo).__name__}, not an "
                            "rljax.algorithms.base.OnlineAlgorithm or OfflineAlgorithm")
        config = algo.config
        if not (isinstance(config, type) and dataclasses.is_dataclass(config)
                and config.__dataclass_params__.frozen):  # type: ignore[attr-defined]
            raise UserError(f"algorithm.name: algorithm {spec!r}: its config must be a frozen dataclass "
                            f"(@dataclasses.dataclass(frozen=True)), got {config!r}")
        _OUTSIDE[spec] = algo
    return _OUTSIDE[spec]


def section_class(spec: str) -> type:
    """The ``algorithm:`` section class of the algorithm ``spec`` names: its config class with
    ``name: Literal[spec]``, so a saved config names the same code and loads again."""
    if spec not in _SECTIONS:
        base = _outside(spec).config
        section = dataclasses.make_dataclass(
            base.__name__, [("name", Literal[spec], dataclasses.field(default=spec, kw_only=True))],
            bases=(base,), frozen=True)
        section.__qualname__, section.__module__ = base.__qualname__, base.__module__
        _SECTIONS[spec] = section
    return _SECTIONS[spec]


def sections() -> dict[str, type]:
    """``{name: config section class}`` of every algorithm known now: the registered ones, then
    those loaded from outside rljax (by their ``source:ALGORITHM`` name)."""
    return {**{name: a.config for name, a in ALGORITHMS.items()}, **_SECTIONS}


__all__ = ["ALGORITHMS", "OfflineAlgorithm", "OnlineAlgorithm", "get", "section_class", "sections"]
