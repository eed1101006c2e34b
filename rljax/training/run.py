"""Build a run: everything a trainer holds before its first step, in one place.

    run = build_run(cfg, value_head=False, total_updates=40 * 1 * 1, resume=False)
    run.policy.params, run.policy.opt_state        # the trainable state (LoRA: only the adapters)
    run.reference()                                # the frozen reference's trainable-shaped params

``build_run`` loads the model (registered name, ``.gguf`` or Hugging Face directory), adds LoRA
adapters, splits it into ``(graphdef, trainable, frozen)``, keeps a reference when asked (full
fine-tuning: a copy; LoRA: none, the reference is the base with the adapters' B set to zero),
builds the optimizer (its schedule counts optimizer updates), opens the checkpointer, restores the
latest checkpoint on ``resume`` and writes the resolved ``config.yaml``. The online and offline
trainers (``rljax.training.online`` / ``.offline``) differ only in what they do with it.

The models and optimizers come from :func:`build_state`, which ``rljax plan`` also calls with
``abstract=True``: the same trees as sharded ``jax.ShapeDtypeStruct`` s, from the models' configs
alone, so the plan compiles the state the trainer would build.

The device mesh (``cfg.mesh``, ``rljax.sharding``) is built here first: the model is loaded straight
onto its shardings (each tensor placed slice by slice, never whole on one device), LoRA adapters and
optimizer states follow their parameters, the reference copy keeps them, and ``run.mesh`` /
``run.rules`` are what ``fit`` enters (``rljax.sharding.use_mesh``) so that batches and activations
are split too. One CPU device is a 1×1×1 mesh.

A run that writes its directory (``write_config=True``) owns it (``rljax.training.run_dir``): first
it takes the directory's lock (held until :meth:`Run.close`, which ``fit`` calls at the end), then a
fresh run is refused where a run already is (``overwrite`` deletes that run's files instead), and a
resume refuses a config that changes the run's meaning. ``write_config=False`` (``rljax eval``) only
reads: no lock, no check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from rljax.checkpoint import Checkpointer
from rljax.config import save_config
from rljax.distributed import is_main_process
from rljax.errors import MissingFileError, UserError
from rljax.models import dtype_from_name, load, model_config_for
from rljax.models.lora import add_lora, lora_trainable, zero_adapters
from rljax.config import ConfigError
from rljax.run_config import RunConfig
from rljax.models.transformer import abstract_model
from rljax.sharding import make_mesh, on_mesh, param_shardings, replicated, shard_model
from rljax.training.run_dir import RunDirError, RunDirLock, check_fresh, clear_run, config_dict, config_differences
from rljax.update import optimizer_for

logger = logging.getLogger(__name__)


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
    lock: RunDirLock | None = None  # the run directory's lock; None for a read-only run (eval)
    mesh: Any = None  # the device mesh every array of the run lives on (cfg.mesh)
    rules: Any = None  # its logical-axis rules (cfg.mesh.rule_table())
    rollout_mesh: Any = None  # disaggregated (mesh.rollout_devices): the devices that generate; None = mesh

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

    def restore(self, step: int | None = None) -> dict:
        """Load a checkpoint's state and step; returns its metadata (the data position is
        ``metadata["data"]``). ``FileNotFoundError`` when there is none (``--resume`` on a fresh run).

        ``step=None``: the latest readable step (an unreadable one is skipped, with a log line);
        ``step``: exactly that one (``--resume-step``). A run that owns its directory then checks that
        the config differs from the checkpoint's only in ``run_dir.RESUMABLE_KEYS`` (``RunDirError``
        listing every other difference; a checkpoint from before configs were stored resumes with a
        warning), and sets aside the steps after the restored one (unreadable, or past
        ``--resume-step``) so the steps this run saves are not skipped as already on disk.
        """
        if self.checkpointer.latest_step() is None:
            raise MissingFileError(f"--resume: no checkpoint in {self.checkpointer.directory}")
        state, metadata = self.checkpointer.restore(step, abstract_state=self.state())
        restored_step = int(metadata["step"])
        if self.lock is not None:
            saved = metadata.get("config")
            if saved is None:
                logger.warning("checkpoint step %d in %s stores no config (written by an older rljax): the resumed "
                               "config is not checked against it", restored_step, self.checkpointer.directory)
            else:
                # settings newer than the checkpoint count as their defaults
                defaults = config_dict(RunConfig(algorithm=type(self.cfg.algorithm)()))
                changed = config_differences(saved, config_dict(self.cfg), defaults=defaults)
                if changed:
                    raise RunDirError(
                        f"--resume: the config differs from the one checkpoint step {restored_step} in "
                        f"{self.checkpointer.directory} was trained with, in keys a resume may not change:\n  "
                        + "\n  ".join(changed)
                        + "\nresume with the run's config (RUN_DIR/config.yaml), or start a new run "
                          "(another train.run_dir, or --overwrite)")
            unreadable = dict(self.checkpointer.unreadable_steps)
            for later in [s for s in self.checkpointer.all_steps() if s > restored_step]:
                reason = "unreadable" if later in unreadable else f"after-resume-step-{restored_step}"
                moved = self.checkpointer.set_aside(later, reason)
                logger.warning("checkpoint step %d set aside as %s", later, moved)
        self.load_state(state)
        self.restored_metadata = metadata
        self.step = restored_step
        return metadata

    @contextlib.contextmanager
    def released_on_error(self):
        """``with run.released_on_error(): ...``: a trainer's set-up after ``build_run`` (data checks,
        restore); if it raises, the run directory's lock is released before the error propagates."""
        try:
            yield self
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the run directory's lock (another process may then use it); the state in memory
        stays usable. Idempotent; ``fit`` calls it when the run ends."""
        if self.lock is not None:
            self.lock.release()

    def save_config(self) -> None:
        """Write the resolved config to ``RUN_DIR/config.yaml`` (process 0 of a multi-process run)."""
        if not is_main_process():
            return
        save_config(self.cfg, os.path.join(self.cfg.train.run_dir, "config.yaml"))


def _train_state(model, optimizer, *, trainable, mesh, rules, abstract: bool) -> TrainState:
    graphdef, params, frozen = nnx.split(model, trainable, ...)
    if abstract:
        params, frozen = _placed(params, mesh, rules), _placed(frozen, mesh, rules)
        return TrainState(graphdef, params, frozen, optimizer, _abstract_opt_state(optimizer, params, mesh))
    # moments follow their parameters' shardings; the step count is replicated (on_mesh)
    return TrainState(graphdef, params, frozen, optimizer, on_mesh(optimizer.init(params), mesh))


def _placed(state, mesh, rules):
    """``state``'s leaves as ``ShapeDtypeStruct`` s on the shardings ``shard_model`` / ``load`` give them."""
    shardings = param_shardings(state, mesh, rules)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


def _abstract_opt_state(optimizer, params, mesh):
    """What ``on_mesh(optimizer.init(params), mesh)`` gives, as shapes: a leaf that mirrors a parameter
    (Adam's moments: its path ends with the parameter's path) is sharded like it (``zeros_like`` keeps
    the sharding), the rest (step counts) is replicated. ``jax.eval_shape`` drops shardings on a mesh
    of ``Auto`` axes, hence the matching by path."""
    by_path = {tuple(path): x.sharding for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}

    def place(path, x):
        for i in range(len(path)):
            sharding = by_path.get(tuple(path[i:]))
            if sharding is not None and len(sharding.spec) <= x.ndim:
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated(mesh))

    return jax.tree_util.tree_map_with_path(place, jax.eval_shape(optimizer.init, params))


def _load(name: str, *, abstract: bool, dtype, param_dtype, value_head: bool, scan_layers: bool, tokenizer=None,
          **load_args):
    """``(model, tokenizer)``: ``rljax.models.load``, or (abstract) the model's structure from its
    config alone (no weights read, no tokenizer)."""
    if not abstract:
        return load(name, dtype=dtype, param_dtype=param_dtype, value_head=value_head, scan_layers=scan_layers,
                    tokenizer=tokenizer, **load_args)
    model = abstract_model(model_config_for(name), dtype=dtype, param_dtype=param_dtype, value_head=value_head,
                           scan_layers=scan_layers)
    return model, None


@dataclasses.dataclass
class RunState:
    """What :func:`build_state` returns: a run's models and optimizers before its first step."""

    tokenizer: Any  # None when abstract
    model_config: Any
    policy: TrainState
    ref_params: Any = None
    critic: TrainState | None = None


def build_state(cfg: RunConfig, *, value_head: bool, total_updates: int, keep_reference: bool = False,
                critic: str | None = None, critic_learning_rate: float | None = None, mesh, rules,
                abstract: bool = False) -> RunState:
    """The policy (loaded, LoRA adapters added, split), its optimizer and state, the reference copy and
    the critic, on ``mesh`` with ``rules``; the arguments are :func:`build_run` 's.

    ``abstract=True``: the same structure as ``jax.ShapeDtypeStruct`` s carrying the shardings the real
    arrays get, from the models' configs alone: what ``rljax plan`` compiles, without weights or devices.
    """
    dtype = dtype_from_name(cfg.model.dtype)
    # the weights are stored in model.param_dtype (null: model.dtype); with optim.master_dtype the
    # optimizer keeps its own float32 copy (rljax.update.with_master_weights), sharded like them
    load_args = dict(abstract=abstract, dtype=dtype, param_dtype=dtype_from_name(cfg.model.storage_dtype),
                     scan_layers=cfg.model.scan_layers)
    if not abstract:
        load_args.update(value_head_init=cfg.value_head_init, value_head_std=cfg.model.value_head_std,
                         seed=cfg.train.seed, mesh=mesh, rules=rules)
    model, tokenizer = _load(cfg.model.name, value_head=value_head, **load_args)
    optimizer = optimizer_for(cfg.optim, total_updates)
    if cfg.model.lora_rank:
        lora = dict(rank=cfg.model.lora_rank, alpha=cfg.model.lora_alpha, targets=cfg.model.lora_targets,
                    seed=cfg.train.seed)
        if abstract:
            model = nnx.eval_shape(lambda m: add_lora(m, **lora), model)
        else:
            model = add_lora(model, **lora)
            model = shard_model(model, mesh, rules)  # the fresh adapters; the loaded weights are already placed
    # static execution settings (rljax.logprobs, Transformer.forward), set before the split
    model.logits_chunk, model.remat = cfg.model.logits_chunk, cfg.model.remat
    model.attention_chunk = cfg.model.attention_chunk
    policy = _train_state(model, optimizer, trainable=lora_trainable() if cfg.model.lora_rank else nnx.Param,
                          mesh=mesh, rules=rules, abstract=abstract)
    ref_params = None
    if keep_reference and not cfg.model.lora_rank:
        ref_params = policy.params if abstract else jax.tree.map(jnp.copy, policy.params)
    critic_state = None
    if critic is not None:
        # a critic directory without tokenizer files reads the policy's tokens with the policy's tokenizer
        critic_model, critic_tokenizer = _load(critic, value_head=True, tokenizer=tokenizer, **load_args)
        if not abstract and critic_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise UserError(f"the critic model {critic!r} has another tokenizer than model.name={cfg.model.name!r}; "
                             "the critic reads the policy's tokens, so they must match")
        optim = cfg.optim if critic_learning_rate is None else dataclasses.replace(
            cfg.optim, learning_rate=critic_learning_rate)
        critic_model.remat, critic_model.attention_chunk = cfg.model.remat, cfg.model.attention_chunk
        critic_state = _train_state(critic_model, optimizer_for(optim, total_updates), trainable=nnx.Param,
                                    mesh=mesh, rules=rules, abstract=abstract)
    return RunState(tokenizer, model.config, policy, ref_params, critic_state)


def split_devices(cfg: RunConfig, devices) -> tuple[list, list]:
    """``(rollout devices, training devices)`` of ``devices`` under ``mesh.rollout_devices``: the first
    N generate, the rest train (N null: none set aside); a ``ConfigError`` naming the key when none
    would be left to train. ``run_mesh`` and ``rljax plan`` split the same way."""
    devices, n = list(devices), cfg.mesh.rollout_devices or 0
    if n and n >= len(devices):
        raise ConfigError("mesh.rollout_devices", f"{n} rollout device(s) leave no training device: there are "
                                                  f"{len(devices)} device(s)")
    return devices[:n], devices[n:]


def training_mesh(cfg: RunConfig, devices, *, counted: str = "jax sees"):
    """The ``('data', 'fsdp', 'tensor')`` mesh of ``cfg.mesh`` over the training devices of ``devices``
    (:func:`split_devices`); a size that does not fit is a ``ConfigError`` naming ``mesh``
    (``mesh.rollout_devices`` when devices were set aside for generation), whose message says the
    devices were ``counted`` (the runtime's, or a plan target's)."""
    m = cfg.mesh
    rollout, train = split_devices(cfg, devices)
    try:
        return make_mesh(data=m.data, fsdp=m.fsdp, tensor=m.tensor, devices=train)
    except ValueError as err:
        if rollout:
            raise ConfigError("mesh.rollout_devices", f"{len(rollout)} rollout device(s) leave {len(train)} of "
                                                      f"{len(rollout) + len(train)} for training, which the training "
                                                      f"mesh (data={m.data}, fsdp={m.fsdp}, tensor={m.tensor}) does "
                                                      f"not divide: {err}") from None
        raise ConfigError("mesh", f"{err} ({counted} {len(train)} device(s): {train[0].platform})") from None


def run_mesh(cfg: RunConfig):
    """The run's device mesh (:func:`training_mesh`) over every device of the runtime (all processes),
    less the first ``mesh.rollout_devices`` (:func:`rollout_mesh`)."""
    if cfg.mesh.rollout_devices and jax.process_count() > 1:
        raise ConfigError("mesh.rollout_devices", "disaggregated generation runs in one process; this run has "
                                                  f"{jax.process_count()} processes (set it to null)")
    mesh = training_mesh(cfg, jax.devices())
    if mesh.size > 1 and jax.process_index() == 0:
        sizes = " ".join(f"{name}={size}" for name, size in mesh.shape.items())
        print(f"mesh {sizes} over {mesh.size} {jax.devices()[0].platform} devices"
              f"{f' in {jax.process_count()} processes' if jax.process_count() > 1 else ''}", file=sys.stderr,
              flush=True)
    return mesh


def rollout_mesh(cfg: RunConfig, devices=None):
    """Disaggregated placement: a mesh over the first ``mesh.rollout_devices`` of ``devices`` (default
    ``jax.devices()``), every one on ``fsdp`` (the sampler's batch and parameters split over them), or
    None (colocated)."""
    rollout, _ = split_devices(cfg, jax.devices() if devices is None else devices)
    return make_mesh(fsdp=len(rollout), devices=rollout) if rollout else None


def build_run(cfg: RunConfig, *, value_head: bool, total_updates: int, keep_reference: bool = False,
              critic: str | None = None, critic_learning_rate: float | None = None, resume: bool = False,
              write_config: bool = True, overwrite: bool = False, resume_step: int | None = None,
              defer_restore: bool = False) -> Run:
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
      write_config: write ``RUN_DIR/config.yaml``, owning the directory (lock, no other run in it);
        False: a read-only use (evaluation), nothing checked or locked.
      overwrite: delete the previous run's files in ``train.run_dir`` first (not with ``resume``).
      resume_step: with ``resume``, restore exactly this step (no fall-back to an earlier one).
      defer_restore: leave the restore and ``config.yaml`` to the caller (``run.restore(resume_step)``,
        ``run.save_config()``): the offline trainer caches the reference's log-probs first.
    """
    if resume_step is not None and not resume:
        raise ValueError("resume_step (--resume-step) needs resume (--resume)")
    os.makedirs(cfg.train.run_dir, exist_ok=True)
    lock = None
    # in a multi-process run process 0 owns the directory (lock, checks, config.yaml); the others
    # only write their shards of checkpoints
    if write_config and is_main_process():
        lock = RunDirLock(cfg.train.run_dir)  # first: nothing is checked or deleted while another run writes
        try:
            check_fresh(cfg.train.run_dir, resume=resume, overwrite=overwrite)
            if overwrite:
                clear_run(cfg.train.run_dir)
        except BaseException:
            lock.release()
            raise
    try:
        return _build(cfg, lock, value_head=value_head, total_updates=total_updates, keep_reference=keep_reference,
                      critic=critic, critic_learning_rate=critic_learning_rate, resume=resume and not defer_restore,
                      resume_step=resume_step, write_config=write_config and not defer_restore,
                      read_only=resume and not write_config)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _build(cfg: RunConfig, lock: RunDirLock | None, *, value_head: bool, total_updates: int, keep_reference: bool,
           critic: str | None, critic_learning_rate: float | None, resume: bool, resume_step: int | None,
           write_config: bool, read_only: bool) -> Run:
    mesh, rules = run_mesh(cfg), cfg.mesh.rule_table()
    state = build_state(cfg, value_head=value_head, total_updates=total_updates, keep_reference=keep_reference,
                        critic=critic, critic_learning_rate=critic_learning_rate, mesh=mesh, rules=rules)
    # read-only (rljax eval --checkpoint): it must not delete the temporary directory of a save that
    # a training process still writing the run has in flight
    checkpointer = Checkpointer(os.path.join(cfg.train.run_dir, "checkpoints"), save_every=cfg.train.save_every or 0,
                                max_to_keep=2, read_only=read_only)
    run = Run(cfg, state.tokenizer, state.model_config, state.policy, checkpointer, ref_params=state.ref_params,
              critic=state.critic, lock=lock, mesh=mesh, rules=rules, rollout_mesh=rollout_mesh(cfg))
    if resume:
        run.restore(resume_step)
    if write_config:
        run.save_config()
    return run


__all__ = ["Run", "RunState", "TrainState", "build_run", "build_state", "rollout_mesh", "run_mesh"]
