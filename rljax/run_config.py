"""The schema of a training run: what a YAML file in ``configs/`` may say.

    cfg = load_config(RunConfig, "configs/grpo_smollm2_arith.yaml", ["optim.learning_rate=1e-5"])

Every field is documented here and in the algorithm's module; ``rljax train --help`` points here.

``algorithm`` is a tagged union: ``algorithm.name`` picks one algorithm's section
(``rljax.algorithms``: ``grpo``, ``ppo``, ``rloo``, ``reinforce_pp``, ``reinforce`` online; ``dpo``,
``reward_model``, ``records``, ``sft`` offline, or an algorithm outside rljax named
``"path/to/file.py:ALGORITHM"`` / ``"package.module:ALGORITHM"``), and that section holds only the
settings that algorithm uses, so a setting that would do nothing is refused at start with its key named.
The union's members are looked up each time a config is loaded (:class:`AlgorithmSection`). Every run shares
``model``, ``data``, ``optim`` and ``train``; online runs also ``sampling`` and ``rewards``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional

from rljax import algorithms
from rljax.algorithms.grpo import GRPOConfig
from rljax.config import FieldError, OpenUnion, check_range, load_config  # noqa: F401  (load_config re-exported)
from rljax.plugins import is_spec


class AlgorithmSection(OpenUnion):
    """The ``algorithm:`` section: one algorithm's config section, picked by ``name`` among the
    algorithms known when the config is loaded, or loaded from the ``source:ALGORITHM`` it names."""

    @classmethod
    def members(cls) -> dict[str, type]:
        return algorithms.sections()

    @classmethod
    def resolve(cls, tag: str) -> type | None:
        return algorithms.section_class(tag) if is_spec(tag) else None


@dataclasses.dataclass(frozen=True)
class ModelSection:
    name: str = "smollm2-135m-instruct"  # registered name, .gguf file or Hugging Face directory
    # compute dtype (and parameter dtype unless param_dtype); float64 (needs JAX_ENABLE_X64=1) is for
    # checking an algebraic equality (sharded = one device) to ~1e-12, not for training
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    # storage dtype of the weights the passes read (and of LoRA adapters); null = dtype. Mixed
    # precision: dtype bfloat16 (param_dtype null) with optim.master_dtype float32
    param_dtype: Optional[Literal["float32", "bfloat16", "float64"]] = None
    lora_rank: Optional[int] = None  # LoRA adapters of this rank; null = full fine-tuning
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    # true: training and scoring passes loop over the layers (lax.scan) instead of unrolling them;
    # compiles faster for deep models, ran the CPU update ~10% slower (rljax/models/transformer.py)
    scan_layers: bool = False
    # training and scoring passes compute completion log-probs / entropies this many tokens at a time,
    # so [B, N, V] logits are never held at once (rljax/logprobs.py chunked_logprobs); null = all at once
    logits_chunk: Optional[int] = None
    # rematerialisation of the blocks in training and scoring passes (rljax/models/transformer.py
    # REMAT_POLICIES): none | block (keep each block's input only) | dots (also the weight matmuls).
    # Unrolled, XLA schedules the recomputation early and saves little: use it with
    # scan_layers: true (docs/performance.md#remat-and-scan)
    remat: Literal["none", "block", "dots"] = "none"
    # training and scoring passes attend this many query positions at a time (the same numbers;
    # memory O(chunk * T) instead of O(T^2) per layer: rljax/models/transformer.py
    # _chunked_causal_attention); null = all at once. Useful for long sequences (~1000+ tokens)
    attention_chunk: Optional[int] = None
    # A fresh value / reward head (reward_model, PPO's shared head and its critic; a head read from
    # the checkpoint's value_head.safetensors is kept): "normal" draws w ~ normal(0, value_head_std)
    # from the seed, bias 0, as transformers' score head (std 0.02 = initializer_range), TRL, verl
    # and OpenRLHF do; "zeros" starts w = b = 0. A zero head gives the layers below it no gradient,
    # so a full fine-tune learns slowly at first (rljax/models/value_head.py). null = the algorithm's
    # default (RunConfig.value_head_init): reward_model "normal"; ppo "zeros", which measured as good
    # or slightly better (experiments/results/ppo_value_head_init.md).
    value_head_init: Optional[Literal["normal", "zeros"]] = None
    value_head_std: float = 0.02

    @property
    def storage_dtype(self) -> str:
        """The parameters' dtype name: ``param_dtype``, or ``dtype`` when that is null."""
        return self.param_dtype or self.dtype

    def validate(self) -> None:
        check_range(self, "lora_rank", low=1, note="(null = full fine-tuning)")
        check_range(self, "logits_chunk", low=1, note="(null = all positions at once)")
        check_range(self, "attention_chunk", low=1, note="(null = all query positions at once)")
        check_range(self, "value_head_std", low=0, low_open=True, note="(value_head_init: zeros for a zero head)")
        check_range(self, "lora_alpha", low=0, low_open=True)
        import jax

        for name in ("dtype", "param_dtype"):
            if getattr(self, name) == "float64" and not jax.config.jax_enable_x64:
                raise FieldError(name, "float64 needs 64-bit JAX: set JAX_ENABLE_X64=1 in the "
                                                  "environment (without it JAX computes in float32)")


@dataclasses.dataclass(frozen=True)
class FewShotExample:
    """One worked example of ``data.few_shot``: a user turn and the assistant's reply to it."""

    user: str
    reply: str


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
    # Worked examples shown before every prompt, [{user: ..., reply: ...}] (chat: earlier turns after
    # the system prompt), to show the reply's shape; none may be a held-out prompt.
    # (a list: OmegaConf builds dataclass elements of lists, not of tuples)
    few_shot: list[FewShotExample] = dataclasses.field(default_factory=list)
    chat: bool = True  # apply the tokenizer's chat template
    max_prompt_length: int = 128
    too_long: Literal["error", "filter"] = "error"
    # held-out split of `path` (a task has its own eval split of eval_size prompts): a prompt is held
    # out when a hash of (train.seed, the prompt) falls below eval_fraction, so all rows of one prompt
    # land in one split; capped at eval_size rows. Online and offline runs use this one rule.
    eval_fraction: float = 0.1
    eval_path: str = ""  # a separate held-out file instead of eval_fraction

    def validate(self) -> None:
        check_range(self, "eval_fraction", low=0, high=1, high_open=True)
        check_range(self, "train_size", low=0)
        check_range(self, "eval_size", low=0)
        check_range(self, "max_prompt_length", low=1)


@dataclasses.dataclass(frozen=True)
class SamplingSection:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: Optional[int] = None  # sample from the k most likely tokens; null = no truncation
    top_p: float = 1.0
    eval_temperature: float = 0.0  # evaluation decodes greedily by default
    ignore_eos: bool = False  # never stop before max_new_tokens (fixed-length benchmarks)
    # "paged": the rollout engine (rljax.inference: continuous batching over a paged KV cache, one
    # prefill per GRPO group); "static": rljax.sampling.generate (the whole batch until its longest row).
    # Runs over several processes use the static sampler (the engine drives one host's devices).
    engine: Literal["paged", "static"] = "paged"
    max_slots: int = 64  # sequences the engine decodes together
    page_size: int = 16  # tokens per KV page
    # KV pages (null: from the memory the weights leave, at most max_slots sequences of the run's
    # longest: data.max_prompt_length + max_new_tokens, or environment.max_tokens)
    num_pages: Optional[int] = None

    def validate(self) -> None:
        # the sampler (rljax.sampling.SamplingConfig) refuses these too, but only once the model is loaded
        check_range(self, "max_slots", low=1)
        check_range(self, "page_size", low=1)
        check_range(self, "num_pages", low=2, note="(null = sized from free memory)")
        check_range(self, "max_new_tokens", low=1)
        check_range(self, "temperature", low=0, note="(0 = greedy)")
        check_range(self, "eval_temperature", low=0, note="(0 = greedy)")
        check_range(self, "top_k", low=0, note="(null or 0 = off)")
        check_range(self, "top_p", low=0, high=1, low_open=True, note="(1 = off)")


@dataclasses.dataclass(frozen=True)
class OptimSection:
    learning_rate: float = 1e-6
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    grad_clip: Optional[float] = 1.0  # global-norm clipping; null = off
    # float32: AdamW updates a float32 master copy of the parameters with float32 moments, and the
    # (bfloat16) parameters are the master rounded after each update (rljax/update.py
    # with_master_weights): updates smaller than a bfloat16 weight's rounding step add up instead
    # of being lost. Memory: +4 bytes per trained parameter. null = AdamW updates the parameters
    # themselves, its moments in their dtype. Needs bfloat16 parameters (model.param_dtype / dtype).
    master_dtype: Optional[Literal["float32"]] = None

    def validate(self) -> None:
        check_range(self, "learning_rate", low=0)
        check_range(self, "warmup_steps", low=0)
        check_range(self, "weight_decay", low=0)
        check_range(self, "b1", low=0, high=1, high_open=True)
        check_range(self, "b2", low=0, high=1, high_open=True)
        check_range(self, "grad_clip", low=0, low_open=True, note="(null = no clipping)")


@dataclasses.dataclass(frozen=True)
class TrainSection:
    steps: int = 40
    seed: int = 0
    run_dir: str = "runs/default"
    eval_every: Optional[int] = None  # evaluate every this many steps; null = only before and after training
    save_every: Optional[int] = None  # checkpoint every this many steps; null = only at the end
    # and checkpoint at the first step boundary this many minutes after the last save (null = off).
    # On by default, so a preempted or crashed run loses at most about this much work whatever a
    # step costs; a step count has no default because a good one depends on the step's cost (a tiny
    # CPU model's step takes 0.1 s, a large one's minutes). SIGTERM / SIGINT save at the next step anyway.
    save_every_minutes: Optional[float] = 30.0
    samples_every: Optional[int] = 5  # write training samples every this many steps; null = never
    tensorboard: bool = False
    progress: bool = True
    # at the end, write RUN_DIR/model (a Hugging Face directory, LoRA merged) and, for a LoRA run,
    # RUN_DIR/adapter (a PEFT adapter): rljax.training.export
    save_model: bool = True
    # at the end (and on a stop signal), write RUN_DIR/curves.png: rljax.plots.plot_runs
    plot: bool = True
    # a step (or evaluation, or save) that makes no progress for this many seconds is a hang: every
    # thread's Python stack goes to RUN_DIR/hang_stacks.process<i>.txt and the process exits with
    # status 75 so a scheduler restarts it (rljax.training.watchdog); well above the slowest step
    # (the first one compiles). null = never
    hang_timeout_s: Optional[float] = 1800.0
    # after SIGTERM / SIGINT / SIGHUP the run stops at the next step boundary with a checkpoint; if that
    # boundary (and the save) does not come within this many seconds, the process writes its stacks
    # and exits without one (a hung collective never reaches it). null = wait for the boundary
    stop_timeout_s: Optional[float] = 60.0
    # asynchronous RL (rljax.training.asynchronous): the batches of steps t+1 .. t+k are generated
    # while step t updates, each by a policy at most k versions older than the one training on it.
    # 0 = the synchronous loop (sample, then update, in turn)
    max_staleness: int = 0
    # with max_staleness >= 1 and the paged engine: a sequence in flight when new weights arrive goes
    # on under them (its tokens then carry several policy versions); false = it finishes under the
    # version that started it. YAML key train.partial_rollouts ("async" is a Python keyword)
    partial_rollouts: bool = False

    def validate(self) -> None:
        check_range(self, "steps", low=1)
        check_range(self, "max_staleness", low=0, note="(policy versions a sample may lag; 0 = synchronous)")
        check_range(self, "eval_every", low=0, note="(null or 0 = only before and after training)")
        check_range(self, "samples_every", low=0, note="(null or 0 = never)")
        check_range(self, "save_every", low=0, note="(null or 0 = only at the end and on a stop)")
        check_range(self, "save_every_minutes", low=0, low_open=True, note="(null = off)")
        check_range(self, "hang_timeout_s", low=0, low_open=True, note="(null = never)")
        check_range(self, "stop_timeout_s", low=0, low_open=True, note="(null = wait for the step boundary)")


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """The device mesh every part of the run uses (``rljax.sharding``): the batch is split over
    ``data`` × ``fsdp``, parameters over ``fsdp`` (ZeRO-3) and ``tensor`` (heads, MLP width,
    vocabulary). One size may be -1: the devices the others leave. The default puts every device on
    ``fsdp`` (one CPU device: a 1×1×1 mesh, today's single-device run)."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    # overrides of rljax.sharding.DEFAULT_RULES: logical axis name -> mesh axis, list of mesh axes, or
    # null (replicated), e.g. {vocab: null} keeps the embedding whole on every tensor shard
    rules: dict[str, Any] = dataclasses.field(default_factory=dict)
    # disaggregated asynchronous RL (train.max_staleness >= 1): the first N devices generate, the rest
    # form the training mesh above; weights are resharded to them after each update. null = colocated
    rollout_devices: Optional[int] = None

    def validate(self) -> None:
        check_range(self, "rollout_devices", low=1, note="(null = generate on the training mesh)")
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        for name, size in sizes.items():
            if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
                raise FieldError(name, f"must be a whole number >= 1, or -1 (the rest of the devices), got {size!r}")
        if sum(size == -1 for size in sizes.values()) > 1:
            raise FieldError("fsdp", f"at most one mesh axis may be -1 (the rest of the devices), got {sizes}")
        from rljax.sharding import DEFAULT_RULES, MESH_AXES

        known = dict(DEFAULT_RULES)
        for name, target in self.rules.items():
            if name not in known:
                raise FieldError("rules", f"{name!r} is not a logical axis; the rules cover {sorted(known)}")
            axes = [target] if isinstance(target, str) else list(target or [])
            bad = [a for a in axes if a not in MESH_AXES]
            if bad:
                raise FieldError("rules", f"{name}: {target!r} names {bad}, not mesh axes; use {list(MESH_AXES)}, "
                                          "a list of them, or null")

    def rule_table(self) -> tuple:
        """``rljax.sharding.DEFAULT_RULES`` with this section's overrides."""
        from rljax.sharding import DEFAULT_RULES

        table = dict(DEFAULT_RULES)
        table.update({k: (tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in self.rules.items()})
        return tuple(table.items())


@dataclasses.dataclass(frozen=True)
class EnvironmentSection:
    """Multi-turn episodes with an environment (``rljax.environments``) instead of single completions.
    ``name: ""`` (the default) = off. Episodes come from the environment's ``reset(seed, {split})``
    (``data.train_size`` training seeds, ``data.eval_size`` held-out ones); ``data.task`` is unused and
    ``rewards`` must be empty (the environment's rewards are the score).

    ``type: agent`` runs outside agent code instead (``rljax.agents``): ``function`` names
    ``run(task, client) -> float | None``, called on each of the data's rows (``data.task`` or
    ``data.path``) ``group_size`` times, at most ``concurrency`` episodes at once; its calls through
    the ``openai`` client become the trajectories, its return value the reward (``rewards``, e.g. a
    judge, score the episodes where it returns None). ``max_tokens`` bounds each transition,
    ``max_transitions`` how many an episode keeps (each task's group is ``group_size ×
    max_transitions`` rows)."""

    type: Literal["environment", "agent"] = "environment"
    name: str = ""  # a registered environment (calculator, toy) or "module:Class"; "" = single-turn
    function: str = ""  # type agent: "path/to/file.py:run" or "module:run"
    concurrency: int = 16  # type agent: episodes running at once
    max_transitions: int = 1  # type agent: transitions kept per episode (its last ones)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # keyword arguments of its constructor
    max_turns: int = 4  # assistant turns per episode (then truncated)
    max_tokens: int = 1024  # tokens per trajectory, prompt included (no room for another turn: truncated)
    # trajectory: one row per episode, scored by its return; turn: one row per assistant turn
    # (agent-lightning), scored by the episode's return or its discounted reward-to-go
    credit: Literal["trajectory", "turn"] = "trajectory"
    turn_reward: Literal["return", "reward_to_go"] = "return"
    gamma: float = 1.0  # discount of reward_to_go
    workers: int = 8  # threads calling the environments

    @property
    def is_agent(self) -> bool:
        return self.type == "agent"

    def validate(self) -> None:
        check_range(self, "max_turns", low=1)
        check_range(self, "max_tokens", low=1)
        check_range(self, "gamma", low=0, high=1)
        check_range(self, "workers", low=1)
        check_range(self, "concurrency", low=1)
        check_range(self, "max_transitions", low=1)
        if self.type == "agent":
            if self.name:
                raise FieldError("name", f"{self.name!r}: an agent run (type: agent) runs environment.function, "
                                         "not an environment; remove name (or set type: environment)")
            if not is_spec(self.function):
                raise FieldError("function", "type: agent needs the agent as 'path/to/file.py:run' or "
                                             f"'module:run' (a function run(task, client) -> float | None), got "
                                             f"{self.function!r}")
            if self.credit != "trajectory":
                raise FieldError("credit", f"{self.credit!r}: an agent's transitions each carry the episode's "
                                           "reward (credit: trajectory); per-turn credit is for environments")
            return
        if self.function:
            raise FieldError("function", f"{self.function!r} is an agent function: set type: agent")
        for field in ("concurrency", "max_transitions"):
            if getattr(self, field) != getattr(EnvironmentSection, field):
                raise FieldError(field, "is a setting of agent runs (type: agent)")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    sampling: SamplingSection = SamplingSection()
    algorithm: AlgorithmSection = GRPOConfig()  # type: ignore[assignment]
    optim: OptimSection = OptimSection()
    train: TrainSection = TrainSection()
    mesh: MeshSection = MeshSection()
    environment: EnvironmentSection = EnvironmentSection()
    # reward name -> weight (or {weight: w, ...options}); see rljax.rewards.base.build_rewards.
    # No default: a YAML's rewards replace nothing, they are the whole set. Online algorithms need at
    # least one; the preference-pair builder scores samples with them.
    rewards: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def is_online(self) -> bool:
        return algorithms.get(self.algorithm.name).online

    @property
    def value_head_init(self) -> str:
        """How a fresh value head starts: ``model.value_head_init``, or the algorithm's default."""
        return self.model.value_head_init or algorithms.get(self.algorithm.name).value_head_init

    def validate(self) -> None:
        if self.optim.master_dtype is not None and self.optim.master_dtype == self.model.storage_dtype:
            raise FieldError("optim.master_dtype", f"{self.optim.master_dtype} with {self.model.storage_dtype} "
                                                   "parameters would keep a second, identical copy of them; the "
                                                   "master copy is for bfloat16 parameters (model.dtype or "
                                                   "model.param_dtype: bfloat16), else set it to null")
        weights = [w.get("weight", 1.0) if isinstance(w, dict) else w for w in self.rewards.values()]
        if weights and all(isinstance(w, (int, float)) and not isinstance(w, bool) and w == 0 for w in weights):
            raise FieldError("rewards", f"every reward weight is 0 ({', '.join(self.rewards)}): the total reward "
                                        "would be 0 for every sample, so nothing is learned; give one a weight")
        if not self.is_online:
            if not self.data.path and not self.data.task:
                raise ValueError(f"{self.algorithm.name} needs data.path (a file or data set) or data.task")
            # an offline algorithm trains on the data's rows: it never samples nor scores, so a
            # section it would ignore is refused rather than silently unused
            if self.rewards:
                raise FieldError("rewards", f"{self.algorithm.name} is an offline algorithm: it never scores "
                                            "samples, so rewards are unused; remove the section (rljax pairs "
                                            "reads it from a config of an online algorithm)")
            if self.sampling != SamplingSection():
                raise FieldError("sampling", f"{self.algorithm.name} is an offline algorithm: it never samples, "
                                             "so sampling settings are unused; remove the section")
            return
        if self.mesh.rollout_devices and self.train.max_staleness < 1:
            raise FieldError("mesh.rollout_devices", "needs train.max_staleness >= 1 (in the synchronous loop the "
                                                     "rollout devices would idle while the others update)")
        if self.train.partial_rollouts:
            if self.train.max_staleness < 1:
                raise FieldError("train.partial_rollouts", "needs train.max_staleness >= 1 (the synchronous loop "
                                                           "never changes weights while a sequence is in flight)")
            if self.sampling.engine != "paged":
                raise FieldError("train.partial_rollouts", "needs sampling.engine: paged (the static sampler "
                                                           "generates a batch in one call, under one version)")
            if self.environment.name or self.environment.is_agent:
                raise FieldError("train.partial_rollouts", "is not supported with an environment (multi-turn "
                                                           "episodes finish under the version that started them)")
        if self.environment.is_agent and self.train.max_staleness:
            raise FieldError("train.max_staleness", "is not supported with environment type agent yet (the "
                                                    "agents' server serves the trainer's current weights)")
        if self.environment.is_agent:
            return  # scored by the agent's return value; rewards (a judge) only where it returns None
        if self.environment.name:
            if self.rewards:
                raise FieldError("rewards", f"an environment run ({self.environment.name}) is scored by the "
                                            "environment's rewards; leave rewards empty")
            return
        if not self.rewards:
            raise ValueError("rewards is empty: name at least one reward function, e.g. {answer: 1.0}")
