"""Bad input ends in one line, ``rljax <command>: error: …``, and status 2, never a traceback: a
response over ``max_completion_length`` with ``completion_too_long: error``, a checkpoint with NaN
weights, a pointwise judge whose tokenizer cannot spell yes / no in one token, an infinite reward."""

import jax.numpy as jnp
import pytest

import rljax.tools.cli
from rljax.checkpoint import Checkpointer, CheckpointReadError
from rljax.data.transcripts import encode_transcripts
from rljax.errors import UserError
from rljax.rewards.judge import make_judge_reward
from tests._tiny import make_tiny_model_dir, tiny_tokenizer


def test_a_response_over_max_completion_length_is_a_user_error():
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "a long reply " * 8}]}]
    with pytest.raises(UserError, match=r"train row 0: the transcript .* over algorithm.max_completion_length=4 "
                                        r"\(raise it, or set algorithm.completion_too_long"):
        encode_transcripts(rows, tiny_tokenizer(), max_prompt_length=64, prompt_too_long="error",
                           max_completion_length=4, completion_too_long="error", split="train")


def test_a_checkpoint_with_nan_weights_is_a_user_error(tmp_path):
    ckpt = Checkpointer(tmp_path / "checkpoints", save_every=1, async_save=False)
    state = {"w": jnp.array([1.0, jnp.nan])}
    ckpt.save(1, state, {}, force=True, check_finite=False)  # as a damaged disk would leave it
    with pytest.raises(CheckpointReadError, match="non-finite values") as err:
        ckpt.restore(abstract_state=state)
    assert isinstance(err.value, UserError)  # rljax prints it as its error line (status 2)
    ckpt.close()


class _NoSingleTokenYes:
    """A tokenizer in which every spelling of yes is two tokens."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1, 2] if "es" in text else [3]}


class _Judge:
    tokenizer = _NoSingleTokenYes()

    def yes_probability(self, *args, **kwargs):  # never reached: the check is at start
        raise AssertionError("scored")


def test_a_pointwise_judge_without_a_one_token_yes_is_refused_at_start():
    with pytest.raises(UserError, match="the judge's tokenizer has no single-token spelling of"):
        make_judge_reward(mode="pointwise", judge=_Judge())
    make_judge_reward(mode="group", judge=_Judge())  # the group judge reads no yes / no token


def test_an_infinite_reward_ends_rljax_train_with_one_error_line(tmp_path, capsys):
    model = make_tiny_model_dir(tmp_path / "model")
    (tmp_path / "inf_reward.py").write_text("def reward(completions, **kwargs):\n"
                                            "    return [float('inf')] * len(completions)\n")
    config = tmp_path / "run.yaml"
    config.write_text(f"""
model: {{name: {model}}}
data: {{task: addition, train_size: 8, eval_size: 2, max_prompt_length: 64}}
sampling: {{max_new_tokens: 2}}
algorithm: {{name: grpo, group_size: 2, prompts_per_step: 2, micro_batch_size: 4}}
train: {{steps: 1, run_dir: {tmp_path / 'run'}, progress: false, plot: false}}
rewards: {{infinite: {{type: python, function: "{tmp_path / 'inf_reward.py'}:reward"}}}}
""")
    assert rljax.tools.cli.main(["train", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("rljax train: error: reward function 'infinite' returned inf for sample 0 of 2"), err
    assert not any("Traceback" in line for line in err)


def test_no_orbax_thread_outlives_opening_a_checkpointer(tmp_path):
    """An early error after the run's checkpointer opened must stay the last line printed: orbax's
    clean-up of leftover temporary directories (its own thread) is over when the constructor returns."""
    leftover = tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp-123"
    leftover.mkdir(parents=True)
    ckpt = Checkpointer(tmp_path / "checkpoints", save_every=1)
    assert not leftover.exists()  # deleted already, not in a thread still running
    ckpt.close()
