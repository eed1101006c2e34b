"""Prompt tokenisation with left padding and shape buckets, and a resumable prompt iterator.

Prompts are left-padded so every row's last prompt token sits in the last column and generation
continues at the same position for the whole batch. The padded width is the smallest bucket that
fits the longest prompt (the sampler rounds the batch size up, `rljax.buckets`), so a jitted sampler
compiles only `len(buckets) × (batch sizes)` programs over a run.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, NamedTuple, Sequence

import numpy as np

from rljax.batches import pad_sequences
from rljax.buckets import bucket_sizes


def default_buckets(max_prompt_length: int, per_octave: int = 4) -> tuple[int, ...]:
    """Prompt-width buckets: 16, 20, 24, 28, 32, 40, ... below `max_prompt_length`, then it; with
    `per_octave=2`: 16, 24, 32, 48, 64, ... (`rljax.buckets`)."""
    if max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be positive, got {max_prompt_length}")
    return bucket_sizes(max_prompt_length, 16, per_octave)


def _check_buckets(buckets: Sequence[int] | None, max_prompt_length: int) -> tuple[int, ...]:
    if buckets is None:
        return default_buckets(max_prompt_length)
    out = sorted({int(b) for b in buckets})
    if not out or out[0] < 1:
        raise ValueError(f"buckets must be positive integers, got {tuple(buckets)}")
    if out[-1] > max_prompt_length:
        raise ValueError(f"bucket {out[-1]} exceeds max_prompt_length {max_prompt_length}")
    if out[-1] != max_prompt_length:
        out.append(max_prompt_length)  # so every prompt that is allowed fits some bucket
    return tuple(out)


def pad_token_id(tokenizer: Any) -> int:
    """`tokenizer.pad_token_id`, else its `eos_token_id`; an error if it has neither."""
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    if pad is None:
        raise ValueError("tokenizer has neither pad_token_id nor eos_token_id; set one")
    if isinstance(pad, (list, tuple)):  # some configs list several EOS ids
        pad = pad[0]
    return int(pad)


class TokenizedPrompts(NamedTuple):
    """Unpacks as `input_ids, attention_mask, kept, dropped = tokenize_prompts(...)`."""

    input_ids: np.ndarray  # [B, P] int32, left-padded
    attention_mask: np.ndarray  # [B, P] int32, 1 = real token
    kept: np.ndarray  # [B] int64: index into `texts` of each row
    dropped: int  # prompts removed by too_long="filter"


def tokenize_prompts(
    tokenizer: Any,
    texts: Sequence[str],
    *,
    max_prompt_length: int,
    too_long: str = "error",
    buckets: Sequence[int] | None = None,
    add_special_tokens: bool = False,
) -> TokenizedPrompts:
    """Tokenise `texts` and left-pad them to the smallest bucket that fits the longest.

    `buckets` default to `default_buckets(max_prompt_length)`; `max_prompt_length` is always the
    last bucket. A prompt longer than `max_prompt_length` raises (`too_long="error"`, naming its
    index, length and the limit) or is dropped (`"filter"`, counted in `dropped`). Padding uses
    `pad_token_id(tokenizer)`. `add_special_tokens` is passed to the tokenizer; leave it False
    for chat-templated text, which already holds any BOS.
    """
    if too_long not in ("error", "filter"):
        raise ValueError(f"too_long must be 'error' or 'filter', got {too_long!r}")
    if isinstance(texts, str):
        raise TypeError("texts must be a sequence of strings, got one str")
    bucket_sizes = _check_buckets(buckets, max_prompt_length)
    pad = pad_token_id(tokenizer)
    token_lists = tokenizer(list(texts), add_special_tokens=add_special_tokens)["input_ids"] if texts else []
    kept: list[int] = []
    for i, ids in enumerate(token_lists):
        if len(ids) == 0:
            raise ValueError(f"prompt {i} tokenises to zero tokens; the sampler needs at least one")
        if len(ids) > max_prompt_length:
            if too_long == "error":
                raise ValueError(
                    f"prompt {i} is {len(ids)} tokens long, over max_prompt_length={max_prompt_length} "
                    "(raise the limit, or set too_long='filter' to drop such prompts)"
                )
            continue
        kept.append(i)
    input_ids, attention_mask = pad_sequences([token_lists[i] for i in kept], side="left", pad_id=pad,
                                              buckets=bucket_sizes)
    return TokenizedPrompts(input_ids, attention_mask, np.asarray(kept, dtype=np.int64),
                            len(token_lists) - len(kept))


class PromptIterator:
    """Batches of examples in a seeded order, reshuffled every epoch, with an exact resume point.

    The order of epoch `e` is a permutation drawn from `(seed, e)` alone, so the position
    `(epoch, index)` in `state_dict()` is all a checkpoint needs: after `load_state_dict`, the
    iterator yields exactly the batches an uninterrupted one would have.

    `drop_last=True` (default) skips an epoch's final partial batch, so every batch has
    `batch_size` examples; with False the short batch is yielded. Iteration is endless unless
    `num_epochs` is given.
    """

    def __init__(
        self,
        examples: Sequence[Mapping[str, Any]],
        batch_size: int,
        *,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
        num_epochs: int | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if not examples:
            raise ValueError("PromptIterator needs at least one example")
        if drop_last and batch_size > len(examples):
            raise ValueError(f"batch_size {batch_size} exceeds the {len(examples)} examples "
                             "(with drop_last=True no batch could be formed)")
        self.examples = examples
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.num_epochs = num_epochs
        self.epoch = 0
        self.index = 0  # position inside the epoch's order
        self._order_epoch: int | None = None
        self._order: np.ndarray | None = None

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.examples)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Indices of the examples in epoch `epoch`'s order."""
        if self._order_epoch != epoch:
            n = len(self.examples)
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(n)
            else:
                self._order = np.arange(n)
            self._order_epoch = epoch
        assert self._order is not None
        return self._order

    def next_indices(self) -> np.ndarray:
        """Indices of the next batch (advances the position)."""
        n = len(self.examples)
        if self.index >= n or (self.drop_last and self.index + self.batch_size > n):
            self.epoch, self.index = self.epoch + 1, 0
        if self.num_epochs is not None and self.epoch >= self.num_epochs:
            raise StopIteration
        indices = self.epoch_order(self.epoch)[self.index:self.index + self.batch_size]
        self.index += len(indices)
        return indices

    def __next__(self) -> list[Mapping[str, Any]]:
        return [self.examples[int(i)] for i in self.next_indices()]

    def __iter__(self) -> Iterator[list[Mapping[str, Any]]]:
        return self

    def state_dict(self) -> dict[str, int]:
        """The resume point, as plain ints (fits any checkpoint format)."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed,
                "num_examples": len(self.examples), "batch_size": self.batch_size}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from `state`; refuses a state saved for a different seed or dataset size."""
        for key, mine in (("seed", self.seed), ("num_examples", len(self.examples))):
            if key in state and int(state[key]) != mine:
                raise ValueError(f"PromptIterator state has {key}={state[key]}, this iterator {mine}; "
                                 "it was saved for other data")
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index <= len(self.examples):
            raise ValueError(f"invalid PromptIterator position epoch={epoch}, index={index}")
        self.epoch, self.index = epoch, index
