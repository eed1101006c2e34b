"""``toy``: a multi-turn tool environment a tiny random model can learn, for tests.

Each episode asks for ``turns`` replies ("Reply." then "Again." ...). A reply without a tool call
earns ``(lowercase letters / characters) / turns``; the episode ends after ``turns`` such replies
(success: a return of at least ``success_at``). Replies with tool calls get the tools' results and do
not count as replies: ``echo(text)`` returns its text, ``fail(reason)`` raises ``ToolError``.
``native_tools`` (default True) hands the schemas to the chat template instead of the system message.
``fail_on_seed``: ``step`` raises ``RuntimeError`` in episodes with that seed (an environment bug:
the episode ends as failed).
"""

from __future__ import annotations

from rljax.environments.tools import Tool, ToolEnvironment, ToolError

__all__ = ["ToyEnv"]


def _echo(text: str) -> str:
    """Return the text.

    text: what to return.
    """
    return text


def _fail(reason: str = "") -> str:
    """Always fail.

    reason: the error message.
    """
    raise ToolError(reason or "failed as asked")


class ToyEnv(ToolEnvironment):
    """Reward: the lowercase share of each plain reply, over ``turns`` replies."""

    def __init__(self, *, turns: int = 2, success_at: float = 0.5, fail_on_seed: int | None = None,
                 native_tools: bool = True):
        # native_tools: the schemas go to the chat template (which a test's tiny ChatML one ignores),
        # keeping the byte-level prompt short
        super().__init__([Tool(_echo, name="echo"), Tool(_fail, name="fail")], native_tools=native_tools)
        self.turns, self.success_at, self.fail_on_seed = turns, success_at, fail_on_seed
        self.replies, self.total, self.seed = 0, 0.0, None

    def opening(self, seed, options):
        self.replies, self.total, self.seed = 0, 0.0, seed
        return "Answer in lowercase.", "Reply.", {}

    def step(self, action: str):
        if self.fail_on_seed is not None and self.seed == self.fail_on_seed:
            raise RuntimeError(f"toy environment bug on seed {self.seed}")
        messages, reward, terminated, truncated, info = super().step(action)
        if not terminated:
            return messages, reward, terminated, truncated, info
        self.replies += 1
        reward = sum(c.islower() for c in action) / max(len(action), 1) / self.turns
        self.total += reward
        if self.replies < self.turns:
            return [{"role": "user", "content": "Again."}], reward, False, False, {}
        return [], reward, True, False, {"success": self.total >= self.success_at}

    def score(self, answer):
        return 0.0, False  # (replaced by step's own scoring)
