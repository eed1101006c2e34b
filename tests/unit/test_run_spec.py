"""What a run holds, from its config alone (rljax.training.spec): the values the trainers, export
and ``rljax plan`` all read."""

from rljax.config import from_yaml
from rljax.run_config import RunConfig
from rljax.training.spec import run_spec


def _online(section: str, extra: str = "") -> RunConfig:
    return from_yaml(RunConfig, f"model: {{name: policy-dir}}\nalgorithm: {{{section}}}\nrewards: {{answer: 1.0}}\n"
                                f"train: {{steps: 10}}\nsampling: {{max_new_tokens: 24}}\n{extra}")


def _offline(section: str) -> RunConfig:
    return from_yaml(RunConfig, f"algorithm: {{{section}}}\ntrain: {{steps: 7}}")


def test_ppo_with_a_separate_critic():
    spec = run_spec(_online("name: ppo, critic: separate, critic_learning_rate: 3.0e-6, kl_coef: 0.1, "
                            "num_iterations: 2, mini_batches: 4, group_size: 4, prompts_per_step: 8"))
    assert (spec.value_head, spec.critic, spec.critic_learning_rate) == (False, "policy-dir", 3.0e-6)
    assert spec.needs_reference and spec.keep_reference
    assert spec.total_updates == 10 * 2 * 4 and spec.rows == 32 and spec.completion_length == 24
    assert spec.batch_kind == "rollouts"
    assert spec.build_args() == dict(value_head=False, keep_reference=True, total_updates=80, critic="policy-dir",
                                     critic_learning_rate=3.0e-6)


def test_ppo_shared_head_and_grpo_without_kl():
    shared = run_spec(_online("name: ppo, critic_model: null"))
    assert shared.value_head and shared.critic is None and shared.critic_learning_rate is None
    grpo = run_spec(_online("name: grpo, kl_coef: 0.0"))
    assert not grpo.value_head and grpo.critic is None and not grpo.needs_reference and not grpo.keep_reference


def test_offline_reference_kept_only_for_live_log_probs_and_the_schedule_follows_epochs():
    cached = run_spec(_offline("name: dpo"))
    assert cached.needs_reference and not cached.keep_reference and cached.batch_kind == "pairs"
    live = run_spec(_offline("name: dpo, precompute_ref_logprobs: false"))
    assert live.needs_reference and live.keep_reference
    assert run_spec(_offline("name: dpo")).total_updates == 7  # train.steps
    assert run_spec(_offline("name: dpo, epochs: 1.5, batch_size: 4"), train_rows=42).total_updates == 15  # 1.5 × 10
    sft = run_spec(_offline("name: sft, batch_size: 3"))
    assert (sft.batch_kind, sft.rows, sft.completion_length, sft.value_head) == ("transcripts", 3, 256, False)
    rm = run_spec(_offline("name: reward_model, rm_loss: kwise"))
    assert rm.value_head and rm.batch_kind == "ranked" and not rm.needs_reference
