"""A model out of every run: the end of ``fit`` and ``rljax export`` write the same directories.

    export_run(run, run.cfg.train.run_dir)            # what a run writes at its end (train.save_model)
    export_run(restore_run(RUN_DIR, step=1), OUT)     # rljax export RUN_DIR --step 1 OUT

``OUT/model`` is a Hugging Face directory (``config.json``, ``model.safetensors``, tokenizer files;
LoRA merged into the weights) that ``transformers.AutoModelForCausalLM.from_pretrained`` loads with
rljax's logits. A model with a value head (PPO's shared head, a reward model) adds
``value_head.safetensors`` there, and a reward model ``rljax_reward_model.json`` (the prompt format
it was trained with, which the ``reward_model`` reward reads). A LoRA run also writes
``OUT/adapter``: a PEFT adapter (``adapter_config.json``, ``adapter_model.safetensors``) for
``peft.PeftModel.from_pretrained(base, OUT/adapter)`` (``rljax.models.peft_io``). PPO's separate
critic is not exported.
"""

from __future__ import annotations

import json
import os

import jax
from flax import nnx

from rljax.algorithms import get as get_algorithm
from rljax.config import load_config
from rljax.distributed import is_main_process, to_host
from rljax.errors import MissingFileError
from rljax.models.hf_io import save_hf_dir
from rljax.models.peft_io import save_peft_adapter
from rljax.run_config import RunConfig
from rljax.training.run import Run, build_run
from rljax.training.spec import run_spec

REWARD_MODEL_META = "rljax_reward_model.json"


def _is_reward_model(cfg: RunConfig) -> bool:
    algo = get_algorithm(cfg.algorithm.name)
    return not algo.online and bool(algo.value_head)


def export_model(run: Run, directory: str, *, model=None) -> str:
    """Write the run's policy (or ``model``, the same gathered to the host) as a Hugging Face directory
    (LoRA merged; value head and, for a reward model, its prompt format included); returns ``directory``."""
    cfg = run.cfg
    save_hf_dir(directory, run.policy.model() if model is None else model, run.tokenizer)
    if _is_reward_model(cfg):
        d, a = cfg.data, cfg.algorithm
        meta = {"chat": d.chat, "system_prompt": d.system_prompt, "assistant_prefix": d.assistant_prefix,
                "max_prompt_length": d.max_prompt_length, "max_completion_length": a.max_completion_length,
                "append_eos": a.append_eos, "trained_steps": run.step, "base_model": cfg.model.name}
        with open(os.path.join(directory, REWARD_MODEL_META), "w") as f:
            json.dump(meta, f, indent=2)
    return directory


def export_run(run: Run, out: str) -> dict[str, str]:
    """Write ``out/model`` (:func:`export_model`) and, for a LoRA run, ``out/adapter`` (a PEFT
    adapter); returns ``{"model_dir": ..., "adapter_dir": ...}`` (the latter only for LoRA).

    In a multi-process run every process must call it: the parameters are gathered to the host
    (each process contributes its shards), and process 0 writes."""
    model = run.policy.model()
    if jax.process_count() > 1:
        graphdef, state = nnx.split(model)
        model = nnx.merge(graphdef, jax.tree.map(to_host, state))
    written = {"model_dir": os.path.join(out, "model")}
    if run.cfg.model.lora_rank:
        written["adapter_dir"] = os.path.join(out, "adapter")
    if not is_main_process():
        return written
    export_model(run, written["model_dir"], model=model)
    if run.cfg.model.lora_rank:
        save_peft_adapter(written["adapter_dir"], model, lora_alpha=run.cfg.model.lora_alpha,
                          base_model=run.cfg.model.name)
    return written


def restore_run(run_dir: str, step: int | None = None) -> Run:
    """The run in ``run_dir`` (its ``config.yaml``) at checkpoint ``step`` (default: the latest),
    read-only: no lock is taken and the checkpoints are opened read-only, so a run still training
    there is not disturbed."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        raise MissingFileError(f"{run_dir} is not a run directory: it has no config.yaml")
    cfg = load_config(RunConfig, path, [f"train.run_dir={run_dir}"])  # the directory may have moved
    spec = run_spec(cfg)  # the checkpoints hold the critic too; no reference copy is needed to read them
    try:
        return build_run(cfg, **dict(spec.build_args(), keep_reference=False), resume=True, resume_step=step,
                         write_config=False)
    except FileNotFoundError as err:  # no checkpoint at step N: a user's mistake, named in one line
        raise MissingFileError(str(err)) from None


__all__ = ["REWARD_MODEL_META", "export_model", "export_run", "restore_run"]
