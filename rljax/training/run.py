"""Build a run: everything a trainer holds before its first step, in one place.

    run = build_run(cfg, value_head=False, total_updates=40 * 1 * 1, resume=False)
    run.policy.params, run.policy.opt_state        # the trainable state (LoRA: only the adapters)
    run.reference()                                # the frozen reference's trainable-shaped params

``build_run`` loads the model (registered name, ``.gguf`` or Hugging Face directory), adds LoRA
adapters, splits it into ``(graphdef, trainable, frozen)``, keeps a reference when asked (full
fine-tuning: a copy; LoRA: none, the reference is the base with the adapters' B set to zero),
builds the optimizer (its schedule counts optimizer updates), opens the checkpointer, restores the
latest checkpoint on ``resume`` and writes the resolved ``config.yaml``. The online and offline
trainers (``rljax.training.online`` / ``.offline``) differ only in what they do with it. (The mesh
joins here: issue "scale".)
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from rljax.checkpoint import Checkpointer
from rljax.config import save_config
from rljax.errors import MissingFileError, UserError
from rljax.models import dtype_from_name, load
from rljax.models.lora import add_lora, lora_trainable, zero_adapters
from rljax.run_config import RunConfig
from rljax.update import optimizer_for


@dataclasses.dataclass
class TrainState:
    """One trained model: its split (``graphdef``, trainable ``params``, ``frozen`` rest), optimizer
    and optimizer state."""

    graphdef: Any
    params: Any
    frozen: Any
    optimizer: optax.GradientTransformation
    opt_state: Any

    @property
    def split(self) -> tuple:
        """``(graphdef, params, frozen)``: what ``rljax.sampling.generate`` and ``nnx.merge`` take."""
        return self.graphdef, self.params, self.frozen

    def model(self):
        return nnx.merge(self.graphdef, self.params, self.frozen)


@dataclasses.dataclass
class Run:
    """What ``build_run`` returns; a trainer owns one."""

    cfg: RunConfig
    tokenizer: Any
    model_config: Any
    policy: TrainState
    checkpointer: Checkpointer
    ref_params: Any = None  # a full fine-tuning reference copy, when one is kept
    critic: TrainState | None = None  # PPO's separate critic
    step: int = 0
    restored_metadata: dict | None = None

    def reference(self):
        """The reference policy's parameters, shaped like ``policy.params``: the kept copy, or for
        LoRA the adapters with B zeroed (the base model), or (nothing kept, full fine-tuning) the
        current parameters — right only before the first update, where callers use it."""
        if self.ref_params is not None:
            return self.ref_params
        return zero_adapters(self.policy.params) if self.cfg.model.lora_rank else self.policy.params

    def state(self) -> dict:
        """The checkpointed arrays."""
        state = {"params": self.policy.params, "opt_state": self.policy.opt_state}
        if self.critic is not None:
            state.update(critic_params=self.critic.params, critic_opt_state=self.critic.opt_state)
        return state

    def load_state(self, state: dict) -> None:
        self.policy.params, self.policy.opt_state = state["params"], state["opt_state"]
        if self.critic is not None:
            self.critic.params, self.critic.opt_state = state["critic_params"], state["critic_opt_state"]

    def restore(self) -> dict:
        """Load the latest checkpoint's state and step; returns its metadata (the data position is
        ``metadata["data"]``). ``FileNotFoundError`` when there is none (``--resume`` on a fresh run)."""
        if self.checkpointer.latest_step() is None:
            raise MissingFileError(f"--resume: no checkpoint in {self.checkpointer.directory}")
        state, self.restored_metadata = self.checkpointer.restore(abstract_state=self.state())
        self.load_state(state)
        self.step = int(self.restored_metadata["step"])
        return self.restored_metadata

    def save_config(self) -> None:
        """Write the resolved config to ``RUN_DIR/config.yaml``."""
        save_config(self.cfg, os.path.join(self.cfg.train.run_dir, "config.yaml"))


def _train_state(model, optimizer, *, trainable) -> TrainState:
    graphdef, params, frozen = nnx.split(model, trainable, ...)
    return TrainState(graphdef, params, frozen, optimizer, optimizer.init(params))


def build_run(cfg: RunConfig, *, value_head: bool, total_updates: int, keep_reference: bool = False,
              critic: str | None = None, critic_learning_rate: float | None = None, resume: bool = False,
              write_config: bool = True) -> Run:
    """Load, adapt and split the model, build optimizer(s) and checkpointer, restore, save the config.

    Args:
      cfg: the run's config.
      value_head: the policy carries a scalar value head (PPO's shared head, reward models).
      total_updates: optimizer updates over the run (the learning-rate schedule's length).
      keep_reference: keep a frozen copy of the initial parameters (full fine-tuning only; with
        LoRA the base model is the reference and nothing is copied).
      critic: a model name for PPO's separate critic (its own transformer with a value head, fully
        fine-tuned, own AdamW state), or None.
      critic_learning_rate: the critic's learning rate (None: ``optim.learning_rate``).
      resume: continue from the latest checkpoint in ``train.run_dir`` (``FileNotFoundError`` if none).
      write_config: write ``RUN_DIR/config.yaml``.
    """
    os.makedirs(cfg.train.run_dir, exist_ok=True)
    dtype = dtype_from_name(cfg.model.dtype)
    model, tokenizer = load(cfg.model.name, dtype=dtype, value_head=value_head, scan_layers=cfg.model.scan_layers)
    optimizer = optimizer_for(cfg.optim, total_updates)
    if cfg.model.lora_rank:
        model = add_lora(model, rank=cfg.model.lora_rank, alpha=cfg.model.lora_alpha,
                         targets=cfg.model.lora_targets, seed=cfg.train.seed)
        policy = _train_state(model, optimizer, trainable=lora_trainable())
    else:
        policy = _train_state(model, optimizer, trainable=nnx.Param)
    ref_params = jax.tree.map(jnp.copy, policy.params) if keep_reference and not cfg.model.lora_rank else None
    critic_state = None
    if critic is not None:
        # a critic directory without tokenizer files reads the policy's tokens with the policy's tokenizer
        critic_model, critic_tokenizer = load(critic, dtype=dtype, value_head=True, scan_layers=cfg.model.scan_layers,
                                              tokenizer=tokenizer)
        if critic_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise UserError(f"the critic model {critic!r} has another tokenizer than model.name={cfg.model.name!r}; "
                             "the critic reads the policy's tokens, so they must match")
        optim = cfg.optim if critic_learning_rate is None else dataclasses.replace(
            cfg.optim, learning_rate=critic_learning_rate)
        critic_state = _train_state(critic_model, optimizer_for(optim, total_updates), trainable=nnx.Param)
    checkpointer = Checkpointer(os.path.join(cfg.train.run_dir, "checkpoints"), save_every=cfg.train.save_every or 0,
                                max_to_keep=2)
    run = Run(cfg, tokenizer, model.config, policy, checkpointer, ref_params=ref_params, critic=critic_state)
    if resume:
        run.restore()
    if write_config:
        run.save_config()
    return run


__all__ = ["Run", "TrainState", "build_run"]
