"""The schema of a training run: what a YAML file in ``configs/`` may say.

    cfg = load_config(RunConfig, "configs/grpo_smollm2_arith.yaml", ["optim.learning_rate=1e-5"])

Every field is documented here; ``rljax train --help`` points to this file.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from rljax.config import load_config  # noqa: F401  (re-exported for callers)


@dataclasses.dataclass(frozen=True)
class ModelSection:
    name: str = "smollm2-135m-instruct"  # registered name, .gguf file or Hugging Face directory
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute and parameter dtype
    lora_rank: int = 0  # 0 = full fine-tuning
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@dataclasses.dataclass(frozen=True)
class DataSection:
    task: str = "addition"  # a procedural task (rljax.data.tasks) ... or "" when `path` is given
    task_options: dict[str, int] = dataclasses.field(default_factory=dict)  # e.g. {digits: 2}
    path: str = ""  # JSONL / parquet / datasets name with a prompt column (instead of `task`)
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    train_size: int = 2000
    eval_size: int = 64
    system_prompt: str = ""
    chat: bool = True  # apply the tokenizer's chat template
    max_prompt_length: int = 128
    too_long: Literal["error", "filter"] = "error"


@dataclasses.dataclass(frozen=True)
class SamplingSection:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eval_temperature: float = 0.0  # evaluation decodes greedily by default


@dataclasses.dataclass(frozen=True)
class AlgorithmSection:
    name: Literal["grpo", "ppo", "rloo"] = "grpo"
    group_size: int = 4  # completions per prompt (G)
    prompts_per_step: int = 4
    num_iterations: int = 1  # mu: passes over each batch of rollouts
    mini_batches: int = 1  # optimizer steps per pass
    micro_batch_size: int = 0  # rows per forward/backward; 0 = the whole mini-batch
    # policy loss
    reduction: Literal["seq_mean_token_mean", "token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"] = (
        "seq_mean_token_mean"
    )
    ratio_level: Literal["token", "sequence"] = "token"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    dual_clip: float = 0.0  # 0 = off; DAPO/dual-clip c (e.g. 3.0)
    entropy_coef: float = 0.0
    # KL to the reference: in the loss (GRPO) or in the reward (PPO, RLOO)
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3", "k3_unbiased"] = "k3"
    # advantages
    advantage_scale: Literal["group", "batch", "none"] = "group"
    bessel: bool = True
    advantage_eps: float = 1e-4
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    # PPO value head
    vf_coef: float = 0.1
    value_clip: float = 0.2
    missing_eos_penalty: float = 0.0  # subtracted from the score of completions with no EOS
    # DAPO
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal; sample more
    max_sampling_rounds: int = 3
    mask_truncated: bool = False  # exclude completions that hit max_new_tokens from the loss

    def validate(self) -> None:
        if self.group_size < 1 or self.prompts_per_step < 1:
            raise ValueError("group_size and prompts_per_step must be >= 1")
        if self.name in ("grpo", "rloo") and self.group_size < 2:
            raise ValueError(f"{self.name} needs group_size >= 2 (a baseline from the other completions)")
        rows = self.group_size * self.prompts_per_step
        if rows % self.mini_batches:
            raise ValueError(f"mini_batches ({self.mini_batches}) must divide the rows per step ({rows})")
        mb = rows // self.mini_batches
        if self.micro_batch_size and mb % self.micro_batch_size:
            raise ValueError(f"micro_batch_size ({self.micro_batch_size}) must divide the mini-batch ({mb})")


@dataclasses.dataclass(frozen=True)
class OptimSection:
    learning_rate: float = 1e-6
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    grad_clip: float = 1.0  # global-norm clipping; 0 = off


@dataclasses.dataclass(frozen=True)
class TrainSection:
    steps: int = 40
    seed: int = 0
    run_dir: str = "runs/default"
    eval_every: int = 0  # 0 = only before and after training
    save_every: int = 0  # 0 = only at the end
    samples_every: int = 5
    tensorboard: bool = False
    progress: bool = True


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    sampling: SamplingSection = SamplingSection()
    algorithm: AlgorithmSection = AlgorithmSection()
    optim: OptimSection = OptimSection()
    train: TrainSection = TrainSection()
    # reward name -> weight (or {weight: w, ...options}); see rljax.rewards.base.build_rewards.
    # No default: a YAML's rewards replace nothing, they are the whole set.
    rewards: dict[str, Any] = dataclasses.field(default_factory=dict)

    def validate(self) -> None:
        if not self.rewards:
            raise ValueError("rewards is empty: name at least one reward function, e.g. {answer: 1.0}")
