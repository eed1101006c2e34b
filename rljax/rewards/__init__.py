"""Reward functions: `fn(completions, examples) -> float64 [N]` (NaN = missing), their weighted
sum (`RewardSet`, `combine`) and the config registry (`build_rewards`, `register_reward`)."""

from rljax.rewards.base import (
    RewardFn,
    RewardOutput,
    RewardSet,
    build_reward,
    build_rewards,
    call_reward,
    combine,
    per_sample,
    register_reward,
    registered_rewards,
    reward_metrics,
)
from rljax.rewards.judge import judge_metrics, make_judge_reward
from rljax.rewards.learned import make_reward_model_reward
from rljax.rewards.python_fn import load_function, make_python_reward, trl_reward_kwargs
from rljax.rewards.sentiment import make_sentiment_reward, sentiment_scores
from rljax.rewards.shaping import (
    make_length_reward,
    make_overlong_reward,
    soft_overlong_punishment,
)
from rljax.rewards.answers import answer_score, answers_match, extract_answer, extract_tag, make_answer_reward
from rljax.rewards.countdown import countdown_score, make_countdown_reward
from rljax.rewards.formats import (
    has_answer_tag,
    make_answer_tag_format_reward,
    make_format_reward,
    think_answer_format,
)
from rljax.rewards.reasoning_gym import make_reasoning_gym_reward

__all__ = [
    "judge_metrics",
    "make_judge_reward",
    "RewardFn", "RewardOutput", "RewardSet", "build_reward", "build_rewards", "call_reward",
    "combine", "per_sample", "register_reward", "registered_rewards", "reward_metrics",
    "make_reward_model_reward", "load_function", "make_python_reward", "trl_reward_kwargs",
    "make_sentiment_reward", "sentiment_scores", "make_length_reward", "make_overlong_reward",
    "soft_overlong_punishment", "answer_score", "answers_match", "countdown_score",
    "extract_answer", "extract_tag", "has_answer_tag", "make_answer_reward",
    "make_answer_tag_format_reward", "make_countdown_reward", "make_format_reward",
    "make_reasoning_gym_reward", "think_answer_format",
]
