"""Tiny model helpers for tests (the builders live in :mod:`rljax.models.tiny`)."""

import copy
import os

import yaml

from rljax.models.tiny import CHATML, byte_tokenizer, make_tiny_model_dir

tiny_tokenizer = byte_tokenizer

__all__ = ["CHATML", "TINY_RUN", "make_tiny_model_dir", "model_with_value_head", "tiny_run_config", "tiny_tokenizer"]

# The tiny online run most trainer tests share (4 prompts x 4 completions of up to 8 tokens, one
# micro-batch of 8): one set of shapes, so the tests that keep to it compile the same programs.
TINY_RUN = {
    "data": {"task": "addition", "train_size": 64, "eval_size": 8, "max_prompt_length": 64},
    "sampling": {"max_new_tokens": 8},
    "algorithm": {"name": "grpo", "group_size": 4, "prompts_per_step": 4, "micro_batch_size": 8},
    "optim": {"learning_rate": 1.0e-2},
    "train": {"steps": 2, "progress": False, "samples_every": None},
    "rewards": {"lowercase": 1.0},
}


def tiny_run_config(model_dir, run_dir=None, **sections):
    """A ``RunConfig`` of :data:`TINY_RUN` on the model at ``model_dir``, writing to ``run_dir``.

    Each keyword names a config section, given as a dict or as YAML flow text (``"{name: ppo, kl_coef: 0.01}"``),
    and is merged key by key over the default section, except ``rewards``, which replaces the default
    (a reward named there is the whole reward). The result goes through ``from_yaml``, so a wrong key or
    value fails as it would in a user's file.
    """
    from rljax.config import from_yaml
    from rljax.run_config import RunConfig

    doc = copy.deepcopy(TINY_RUN)
    doc["model"] = {"name": os.fspath(model_dir)}
    if run_dir is not None:
        doc["train"]["run_dir"] = os.fspath(run_dir)
    for name, section in sections.items():
        section = yaml.safe_load(section) if isinstance(section, str) else section
        if name == "rewards" or not isinstance(section, dict) or not isinstance(doc.get(name), dict):
            doc[name] = section
        else:
            doc[name].update(section)
    return from_yaml(RunConfig, yaml.safe_dump(doc, sort_keys=False))


def model_with_value_head(config, seed: int = 1, **kwargs):
    """A random ``rljax.models.transformer.Transformer`` whose value head has random weights and bias 0.25
    (a fresh head is zero, so every position would read the same value); kwargs as ``init_model``'s."""
    import jax
    import jax.numpy as jnp

    from rljax.models.transformer import init_model

    model = init_model(config, seed=seed, value_head=True, **kwargs)
    dtype = model.value_head["w"][...].dtype
    model.value_head["w"][...] = jax.random.normal(jax.random.key(2), (config.hidden_size,), dtype)
    model.value_head["b"][...] = jnp.asarray([0.25], dtype)
    return model
