"""The schema of a training run: what a YAML file in ``configs/`` may say.

    cfg = load_config(RunConfig, "configs/grpo_smollm2_arith.yaml", ["optim.learning_rate=1e-5"])

Every field is documented here; ``rljax train --help`` points to this file.

``algorithm.name`` picks the loop: ``grpo`` / ``ppo`` / ``rloo`` are online (``rljax.train``: sample,
score with ``rewards``, update); ``dpo`` / ``reward_model`` / ``offline`` learn from a fixed data set
(``rljax.train_offline``) and are configured by the ``offline`` section. They share ``model``,
``data``, ``optim`` and ``train``.
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
    # true: training and scoring passes loop over the layers (lax.scan) instead of unrolling them;
    # compiles faster for deep models, ran the CPU update ~10% slower (rljax/models/transformer.py)
    scan_layers: bool = False


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
    # Text that starts every response (e.g. "<answer>" or "<think>"), appended after the chat
    # template's assistant header; rewards score assistant_prefix + completion.
    assistant_prefix: str = ""
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
    # online: grpo, ppo, rloo (rljax.train); offline: dpo, reward_model, offline (rljax.train_offline,
    # configured by the `offline` section; the fields below are then unused)
    name: Literal["grpo", "ppo", "rloo", "dpo", "reward_model", "offline"] = "grpo"
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
    # PPO value estimate: `shared` = a scalar value head on the policy's own trunk (one model, one
    # optimizer; loss = L_pi + vf_coef * L_V); `separate` = a critic model of its own (a transformer
    # with a value head, its own parameters and AdamW state, always fully fine-tuned) that minimises
    # vf_coef * L_V while the policy (no value head; LoRA works) minimises L_pi alone.
    critic: Literal["shared", "separate"] = "shared"
    critic_model: str = ""  # separate critic: registered name / .gguf / HF directory ("" = model.name).
    #                         A directory with value_head.safetensors (e.g. a trained reward model)
    #                         starts the head from it; otherwise the head starts at zero. Same tokenizer.
    critic_learning_rate: float = 0.0  # separate critic: its AdamW learning rate (0 = optim.learning_rate);
    #                                    the other optim settings (schedule, warm-up, clipping) are shared
    vf_coef: float = 0.1
    value_clip: float = 0.2
    missing_eos_penalty: float = 0.0  # subtracted from the score of completions with no EOS
    # DAPO
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal; sample more
    max_sampling_rounds: int = 3
    mask_truncated: bool = False  # exclude completions that hit max_new_tokens from the loss

    @property
    def is_offline(self) -> bool:
        return self.name in OFFLINE_ALGORITHMS

    def validate(self) -> None:
        if self.is_offline:
            return
        if self.group_size < 1 or self.prompts_per_step < 1:
            raise ValueError("group_size and prompts_per_step must be >= 1")
        if self.critic == "separate" and self.name != "ppo":
            raise ValueError(f"critic: separate is a PPO setting; {self.name} has no value estimate")
        if self.critic_learning_rate < 0:
            raise ValueError(f"critic_learning_rate must be >= 0 (0 = optim.learning_rate), got {self.critic_learning_rate}")
        if self.name in ("grpo", "rloo") and self.group_size < 2:
            raise ValueError(f"{self.name} needs group_size >= 2 (a baseline from the other completions)")
        rows = self.group_size * self.prompts_per_step
        if rows % self.mini_batches:
            raise ValueError(f"mini_batches ({self.mini_batches}) must divide the rows per step ({rows})")
        mb = rows // self.mini_batches
        if self.micro_batch_size and mb % self.micro_batch_size:
            raise ValueError(f"micro_batch_size ({self.micro_batch_size}) must divide the mini-batch ({mb})")


OFFLINE_ALGORITHMS = ("dpo", "reward_model", "offline")


@dataclasses.dataclass(frozen=True)
class OfflineSection:
    """Offline training from a fixed data set: DPO, reward models, scored records.

    Data (``data.path``, a JSONL / parquet file or a datasets name; or ``data.task`` for pairs and
    records generated from a procedural task, see ``rljax.data.preferences.pairs_from_task``):

    * ``dpo`` and ``reward_model`` (pairwise) read preference pairs: ``data.prompt_column``,
      ``chosen_column``, ``rejected_column`` and optionally ``margin_column``; text or chat messages.
    * ``reward_model`` with ``rm_loss: kwise`` reads ranked lists (``ranked_column``, best first).
    * ``offline`` reads scored records: ``data.prompt_column``, ``response_column``, ``score_column``.
    """

    # batches and passes
    batch_size: int = 8  # pairs / ranked lists / records per optimizer step
    micro_batch_size: int = 0  # rows per forward/backward; 0 = the whole batch
    epochs: float = 0.0  # > 0: train this many passes over the train split (train.steps is then ignored)
    # held-out split (data.path only; a task uses its own eval split of data.eval_size prompts)
    eval_fraction: float = 0.1  # share of the prompts held out (by a hash of the prompt, so all responses
    #                             to one prompt land in the same split); capped at data.eval_size rows
    eval_path: str = ""  # a separate held-out file instead (eval_fraction is then unused)
    eval_batch_size: int = 16
    # columns
    chosen_column: str = "chosen"
    rejected_column: str = "rejected"
    # optional preference strength per pair ("" = none): reward_model: the Bradley–Terry margin,
    # -log σ(r+ - r- - margin) (Llama 2, arXiv:2307.09288); dpo (loss_type sigmoid only): ODPO's offset,
    # -log σ(βΔ - odpo_alpha·margin) (arXiv:2402.10571, which uses margin = log(s+ - s-))
    margin_column: str = ""
    ranked_column: str = "responses"  # reward_model kwise: list of responses, best first
    response_column: str = "response"  # offline
    score_column: str = "score"  # offline
    # what to do with a row that lacks a column, has an empty response or chosen == rejected
    invalid_rows: Literal["error", "drop"] = "error"  # drop: counted (data/dropped_*) and skipped
    # completions
    max_completion_length: int = 128  # tokens, EOS included
    completion_too_long: Literal["error", "filter", "truncate"] = "truncate"
    append_eos: bool = True  # end each response with the tokenizer's EOS (the model learns to stop)
    task_responses: int = 4  # data.task: responses per prompt for kwise lists and scored records
    # DPO (rljax.losses.preference)
    loss_type: Literal["sigmoid", "cdpo", "robust", "ipo", "hinge", "simpo"] = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0  # cDPO / robust DPO epsilon
    simpo_gamma: float = 0.5
    reference_free: bool = False  # reference log-probs taken as 0
    odpo_alpha: float = 1.0  # ODPO's alpha: offset = odpo_alpha * margin (with margin_column)
    precompute_ref_logprobs: bool = True  # cache reference log-probs once (no reference copy in memory)
    # reward model (rljax.losses.reward_model)
    rm_loss: Literal["pairwise", "kwise"] = "pairwise"
    centering_coef: float = 0.0  # c * mean((r+ + r-)^2), Eisenstein et al. 2023 (TRL suggests 0.01)
    # scored records (rljax.algorithms.offline)
    records_mode: Literal["awr", "rwr", "filtered_bc"] = "awr"
    temperature: float = 1.0  # awr / rwr: weight = exp(advantage / temperature)
    max_weight: float = 20.0  # awr / rwr: weights clipped here (AWR's w_max); 0 = no clip
    baseline: Literal["prompt_mean", "global_mean"] = "prompt_mean"  # awr: per-prompt mean where a
    #                                     prompt has several responses (else the mean of all scores)
    score_threshold: float = 0.5  # filtered_bc: train on responses scoring >= this
    reduction: Literal["seq_mean_token_mean", "token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"] = (
        "token_mean"
    )
    # output
    save_model: bool = True  # write RUN_DIR/model (a Hugging Face directory, LoRA merged; the reward
    #                          model with value_head.safetensors, loadable by the `reward_model` reward)

    def validate(self) -> None:
        if self.batch_size < 1 or self.eval_batch_size < 1:
            raise ValueError("batch_size and eval_batch_size must be >= 1")
        if self.micro_batch_size < 0 or (self.micro_batch_size and self.batch_size % self.micro_batch_size):
            raise ValueError(f"micro_batch_size ({self.micro_batch_size}) must divide batch_size ({self.batch_size})")
        if self.epochs < 0:
            raise ValueError(f"epochs must be >= 0, got {self.epochs}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.max_completion_length < 1:
            raise ValueError("max_completion_length must be >= 1")
        if self.beta <= 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")
        limit = 0.5 if self.loss_type == "robust" else 1.0
        if not 0.0 <= self.label_smoothing < limit:
            raise ValueError(f"label_smoothing must be in [0, {limit}) for loss_type={self.loss_type}, "
                             f"got {self.label_smoothing}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.max_weight < 0:
            raise ValueError(f"max_weight must be >= 0 (0 = no clip), got {self.max_weight}")
        if self.task_responses < 2:
            raise ValueError("task_responses must be >= 2")
        if self.odpo_alpha < 0:
            raise ValueError(f"odpo_alpha must be >= 0, got {self.odpo_alpha}")


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
    offline: OfflineSection = OfflineSection()
    # reward name -> weight (or {weight: w, ...options}); see rljax.rewards.base.build_rewards.
    # No default: a YAML's rewards replace nothing, they are the whole set.
    # Online algorithms need at least one; offline ones ignore them (the preference-pair builder,
    # `python -m rljax.data.preferences`, scores samples with them).
    rewards: dict[str, Any] = dataclasses.field(default_factory=dict)

    def validate(self) -> None:
        if self.algorithm.is_offline:
            if not self.data.path and not self.data.task:
                raise ValueError("an offline algorithm needs data.path (a file or data set) or data.task")
            o = self.offline
            if self.algorithm.name == "dpo" and o.margin_column and (o.loss_type != "sigmoid" or o.label_smoothing):
                raise ValueError(f"offline.margin_column with DPO is ODPO's offset (arXiv:2402.10571), published for "
                                 f"loss_type=sigmoid without label smoothing; got loss_type={o.loss_type}, "
                                 f"label_smoothing={o.label_smoothing}")
            return
        if not self.rewards:
            raise ValueError("rewards is empty: name at least one reward function, e.g. {answer: 1.0}")
