"""``build_state(..., abstract=True)`` (what ``rljax plan`` compiles) is the state ``build_run`` builds:
the same trees, shapes, dtypes and shardings, from a model directory holding only ``config.json``
(no weights read) and without touching the run directory."""

import dataclasses
import os
import shutil

import jax
import pytest

from rljax.training import build_run
from rljax.training.run import build_state
from rljax.training.spec import run_spec
from tests._tiny import make_tiny_model_dir, tiny_run_config


def _same(abstract, real, what, *, empty=False):
    """Every leaf of ``abstract`` a ``ShapeDtypeStruct`` with the shape, dtype and sharding of ``real``'s."""
    assert jax.tree.structure(abstract) == jax.tree.structure(real), what
    pairs = list(zip(jax.tree.leaves(abstract), jax.tree.leaves(real)))
    assert empty or pairs, what
    for got, want in pairs:
        assert isinstance(got, jax.ShapeDtypeStruct), (what, type(got))
        assert (got.shape, got.dtype) == (want.shape, want.dtype), what
        assert got.sharding == want.sharding, (what, got.sharding, want.sharding)


@pytest.mark.parametrize("name,sections", [
    ("lora", dict(model="{lora_rank: 2, lora_alpha: 4.0}")),
    ("full fine-tune with a reference, bfloat16 storage, float32 master",
     dict(model="{param_dtype: bfloat16}", optim="{master_dtype: float32}", algorithm="{kl_coef: 0.05}")),
    ("ppo with a separate critic", dict(algorithm="{name: ppo, critic: separate, kl_coef: 0.05}")),
])
def test_abstract_state_is_the_real_runs_state(tmp_path, name, sections):
    model_dir = make_tiny_model_dir(tmp_path / "model")
    cfg = tiny_run_config(model_dir, tmp_path / "run", **sections)
    spec = run_spec(cfg)
    run = build_run(cfg, **spec.build_args(), write_config=False)
    try:
        # a directory with the config alone: the abstract state reads no weights and no tokenizer
        config_only = tmp_path / "config-only"
        config_only.mkdir()
        shutil.copy(os.path.join(model_dir, "config.json"), config_only / "config.json")
        unread = tmp_path / "never-written"
        abstract_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name=str(config_only)),
                                           train=dataclasses.replace(cfg.train, run_dir=str(unread)))
        if spec.critic is not None:
            spec = dataclasses.replace(spec, critic=str(config_only))
        state = build_state(abstract_cfg, **spec.build_args(), mesh=run.mesh, rules=run.rules, abstract=True)
        assert not os.path.exists(unread)
        assert state.tokenizer is None and state.model_config == run.model_config
        p, q = state.policy, run.policy
        _same(p.params, q.params, "params")
        _same(p.frozen, q.frozen, "frozen", empty=not cfg.model.lora_rank)  # a full fine-tune freezes nothing
        _same(p.opt_state, q.opt_state, "opt_state")
        assert p.graphdef == q.graphdef
        if cfg.model.lora_rank:
            assert state.ref_params is None and run.ref_params is None
            # only the adapters train; the base is frozen
            assert all("_lora_" in jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(p.params))
        else:
            assert run.ref_params is not None
            _same(state.ref_params, run.ref_params, "ref_params")
        if spec.critic is not None:
            _same(state.critic.params, run.critic.params, "critic params")
            _same(state.critic.frozen, run.critic.frozen, "critic frozen", empty=True)
            _same(state.critic.opt_state, run.critic.opt_state, "critic opt_state")
            assert state.critic.graphdef == run.critic.graphdef
        else:
            assert state.critic is None and run.critic is None
    finally:
        run.close()
