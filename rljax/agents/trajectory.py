"""An agent episode's recorded calls as trajectories: the rule that joins calls into one sequence.

    segments = assemble(calls, example=task)          # rljax.environments.episodes.Episode, one per transition

A call (``rljax.serve.CallRecord``) whose prompt ids start with an earlier call's prompt + completion
ids continues that sequence: the new prompt tokens after it are context (``policy_mask`` 0, log-prob
0), the call's completion is appended as sampled tokens (``policy_mask`` 1, the engine's log-probs):
the multi-turn trajectory ``rljax.environments.episodes`` builds for an environment, so the same
``episodes_rollout`` turns it into training rows and the loss counts the completions alone. A call
whose prompt continues no earlier sequence (the agent rewrote, summarised or dropped its history)
starts a new one, a separate transition; every transition of an episode shares its reward
(agent-lightning, arXiv:2508.03680). Of several choices (``n > 1``) the first continues the sequence
and each other one starts its own, with the whole prompt as context, so no sampled token is trained
twice.
"""

from __future__ import annotations

from typing import Sequence

from rljax.environments.episodes import Episode

__all__ = ["assemble"]


def _starts_with(ids: list[int], prefix: list[int]) -> bool:
    return len(prefix) <= len(ids) and ids[: len(prefix)] == prefix


def assemble(calls: Sequence, *, example: dict | None = None, max_tokens: int | None = None) -> list[Episode]:
    """The transitions of one episode's ``calls`` (``CallRecord``-like: ``prompt_token_ids`` and
    ``choices`` with ``token_ids``, ``logprobs``, ``finish_reason``), in the order each began.

    Each is an :class:`~rljax.environments.episodes.Episode`: ``prompt_length`` is its first call's
    prompt, ``turn_spans`` its completions, ``status`` ``"terminated"`` when its last completion
    stopped (``"truncated"`` when it ran out of ``max_tokens``). A call joins the longest earlier
    sequence its prompt starts with. ``max_tokens``: a sequence is cut to that many tokens (its last
    completion then counts as not stopped), so one long conversation cannot outgrow the update.
    """
    segments: list[Episode] = []
    for call in calls:
        prompt = [int(t) for t in call.prompt_token_ids]
        for j, choice in enumerate(call.choices):
            base = None
            if j == 0:
                for seg in segments:
                    if _starts_with(prompt, seg.token_ids) and (base is None or len(seg.token_ids) > len(base.token_ids)):
                        base = seg
            if base is None:
                base = Episode(example=dict(example or {}), token_ids=list(prompt), policy_mask=[0] * len(prompt),
                               logprobs=[0.0] * len(prompt), prompt_length=len(prompt))
                segments.append(base)
            else:
                context = prompt[len(base.token_ids):]
                base.token_ids += context
                base.policy_mask += [0] * len(context)
                base.logprobs += [0.0] * len(context)
            ids = [int(t) for t in choice.token_ids]
            if len(choice.logprobs) != len(ids):
                raise ValueError(f"a recorded choice has {len(ids)} token ids but {len(choice.logprobs)} log-probs")
            start = len(base.token_ids)
            base.token_ids += ids
            base.policy_mask += [1] * len(ids)
            base.logprobs += [float(x) for x in choice.logprobs]
            base.turn_spans.append((start, start + len(ids)))
            base.turn_finished.append(choice.finish_reason in ("stop", "tool_calls"))
    for seg in segments:
        seg.status = "terminated" if seg.turn_finished and seg.turn_finished[-1] else "truncated"
        if max_tokens is not None and len(seg.token_ids) > max_tokens:
            _cut(seg, max_tokens)
    return segments


def _cut(seg: Episode, max_tokens: int) -> None:
    """Keep the first ``max_tokens`` tokens of a sequence (its prompt alone may not exceed them)."""
    if seg.prompt_length >= max_tokens:
        raise ValueError(f"an agent call's prompt is {seg.prompt_length} tokens, not below "
                         f"environment.max_tokens={max_tokens}; raise it or shorten the agent's prompts")
    del seg.token_ids[max_tokens:], seg.policy_mask[max_tokens:], seg.logprobs[max_tokens:]
    kept = [(s, min(e, max_tokens)) for s, e in seg.turn_spans if s < max_tokens]
    seg.turn_finished = seg.turn_finished[: len(kept)]
    if kept and kept[-1][1] != seg.turn_spans[len(kept) - 1][1]:
        seg.turn_finished[-1] = False
    seg.turn_spans = kept
    seg.status, seg.truncation = "truncated", "tokens"
