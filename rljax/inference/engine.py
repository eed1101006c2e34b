"""The rollout engine: continuous batching of generation requests over a paged KV cache.

    engine = Engine(model, max_slots=64, page_size=16)
    outs = engine.generate([Request(prompt_ids=ids, max_tokens=128, temperature=1.0, seed=7), ...])
    outs[i].token_ids, outs[i].logprobs, outs[i].finish_reason   # "stop" | "length"
    outs[i].top_logprobs   # with Request(top_logprobs=k): each token's k likeliest [(id, log-prob), ...]

``max_slots`` sequences decode together, one token each per step; the others wait in a queue. A
sequence that stops frees its slot and its pages at once, and the next waiting request is prefilled
into the slot (a long prompt over several steps, ``prefill_chunk`` tokens at a time), so no row waits
for the longest of a batch. Keys and values live in fixed-size pages (:mod:`rljax.inference.pages`)
handed out as sequences grow, so KV memory is the tokens in flight, not slots × the longest length.
Requests with the same prompt (the samples of a GRPO group) share the prompt's pages and run one
prefill; a request whose prompt starts with pages already cached (the next turn of a conversation)
prefills only the rest.

When a growing sequence finds no free page, the most recently admitted sequence is preempted: its
pages are freed and it waits at the head of the queue, keeping its tokens; when readmitted, it
prefills its prompt and the tokens it had generated, and goes on. A request that could never fit
(longer than the model's context, or than the whole pool) is refused at submission with a
:class:`~rljax.errors.UserError` naming the field, as is any other bad field; the engine keeps
serving the other requests.

Each request samples with its own settings and its own key (``fold_in(key(seed), token index)``), so
its tokens do not depend on the other requests in flight, and the log-prob of each sampled token is
the trainer's (``rljax.logprobs``; float32 to 1e-5). :meth:`Engine.set_weights` swaps in new
parameters (after an update) without a recompile and empties the prefix cache, whose keys and values
belong to the old weights.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax.buckets import bucket_length
from rljax.errors import UserError
from rljax.inference import model_step
from rljax.inference.pages import NULL_PAGE, PagePool


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request. ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 are off; the
    sequence stops after a token of ``stop_token_ids`` (kept in the output) or ``max_tokens`` tokens.
    ``top_logprobs`` (0 to :data:`MAX_TOP_LOGPROBS`): also return each token's that many likeliest
    tokens and their log-probs, under the same distribution as ``logprobs``."""

    prompt_ids: Sequence[int]
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: Sequence[int] = ()
    seed: int = 0
    top_logprobs: int = 0


# The most alternatives a request may ask for (OpenAI's limit). A step where any request asks for
# some computes this many for every row: one more compiled program, not one per value.
MAX_TOP_LOGPROBS = 20


@dataclasses.dataclass
class Output:
    """What a request produced: the sampled ids, the log-prob of each under ``softmax(logits / T)``
    (T the request's temperature; greedy and T = 1 unscaled) and why it ended ("stop", "length", or
    "cancelled"). ``top_logprobs``: per token, the request's ``top_logprobs`` likeliest ``(id,
    log-prob)`` pairs under the same distribution, most likely first (empty when not asked for)."""

    request_id: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)


_WAITING, _PREFILL, _FOLLOW, _DECODE = "waiting", "prefill", "follow", "decode"


@dataclasses.dataclass(eq=False)
class _Sequence:
    id: int
    request: Request
    prompt: list[int]
    generated: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    kv_len: int = 0  # tokens whose keys and values are in the pages
    slot: int = -1
    state: str = _WAITING
    admitted_at: int = 0
    followers: list = dataclasses.field(default_factory=list)  # same prompt, waiting for this prefill
    leader: "_Sequence | None" = None  # the sequence whose prefill this one waits for

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def prefill_target(self) -> int:
        """Tokens to write before decoding: all of them but the last sampled one (written by the next
        decode step), or the whole prompt before the first token is sampled."""
        return len(self.prompt) + max(len(self.generated) - 1, 0)


class Engine:
    """Continuous batching over a paged KV cache (see the module docstring).

    ``model``: a :class:`~rljax.models.Transformer` or its split ``(graphdef, state, ...)``.
    ``num_pages``: the pool's size including the reserved null page; ``None`` sizes it from the
    memory left (:func:`default_num_pages`). ``prefill_chunk``: the most prompt tokens of one sequence
    prefilled in one step; ``prefill_tokens``: the most tokens of one prefill call (all its rows).
    ``max_context``: the longest sequence (prompt + new tokens) a request may ask for, at most the
    model's context (the default); it also bounds the pool ``num_pages=None`` sizes, so a caller
    that knows its longest sequence (a trainer) holds the pages it can use, not a share of memory.
    """

    def __init__(self, model, max_slots: int = 64, page_size: int = 16, num_pages: int | None = None, *,
                 prefill_chunk: int = 512, prefill_tokens: int = 4096, max_context: int | None = None):
        graphdef, *states = nnx.split(model) if isinstance(model, nnx.Module) else model
        self.graphdef = graphdef
        abstract = nnx.merge(graphdef, *states)  # holds the arrays; only config and dtype are read
        self.config, self.dtype = abstract.config, abstract.dtype
        if max_slots < 1:
            raise UserError(f"max_slots must be >= 1, got {max_slots}")
        self.max_slots, self.page_size = max_slots, page_size
        self.max_context = min(max_context or self.config.max_position_embeddings, self.config.max_position_embeddings)
        self.prefill_chunk, self.prefill_tokens = max(prefill_chunk, 1), max(prefill_tokens, prefill_chunk)
        self.kv_bytes_per_token = (2 * self.config.num_layers * self.config.num_kv_heads * self.config.head_dim
                                   * jnp.dtype(self.dtype).itemsize)
        if num_pages is None:
            num_pages = default_num_pages(self, tuple(states))
        self.pool = PagePool(num_pages, page_size)
        self.max_pages_per_sequence = min(math.ceil(self.max_context / page_size), self.pool.capacity)
        self.kv = model_step.empty_pages(self.config, num_pages, page_size, self.dtype)
        self.set_weights(tuple(states))
        self._slots: list[_Sequence | None] = [None] * max_slots
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._waiting_prompts: collections.Counter = collections.Counter()
        self._sequences: dict[int, _Sequence] = {}
        self._finished: dict[int, Output] = {}
        self._next_id = 0
        self._admissions = 0
        self.stats = {"page_size": page_size, "num_pages": num_pages, "kv_bytes_per_token": self.kv_bytes_per_token,
                      "decode_steps": 0, "decode_seconds": 0.0, "decode_tokens": 0, "live_kv_tokens_read": 0,
                      "prefill_calls": 0, "prefill_tokens": 0, "prefill_seconds": 0.0, "preempted": 0,
                      "prompt_cache_hits": 0, "page_cache_hits": 0}

    # ------------------------------------------------------------------ weights
    def set_weights(self, states) -> None:
        """Run the parameters ``states`` (the model's state(s), as split from it) from now on: the same
        compiled programs, and an empty prefix cache (its keys and values came from the old weights).
        Sequences in flight go on with the new weights. The same arrays again change nothing."""
        states = tuple(states)
        if hasattr(self, "states") and _same_arrays(states, self.states):
            return
        self.states = states
        self.weights = model_step.decode_weights(self.graphdef, self.states)
        if hasattr(self, "pool"):
            self.pool.cache.clear()

    def clear_prefix_cache(self) -> None:
        """Forget the cached prompt pages: what follows runs as on a fresh engine with these weights
        (the asynchronous loop calls it before each batch, so a batch's tokens do not depend on which
        batches, or evaluations, the engine served before it)."""
        self.pool.cache.clear()

    # ------------------------------------------------------------------ requests
    def submit(self, request: Request) -> int:
        """Queue ``request`` and return its id; a bad request raises :class:`UserError` naming the field."""
        prompt = self._validate(request)
        seq = _Sequence(self._next_id, request, prompt)
        self._next_id += 1
        self._sequences[seq.id] = seq
        self._waiting.append(seq)
        self._waiting_prompts[tuple(prompt)] += 1
        return seq.id

    def cancel(self, request_id: int) -> None:
        """Stop a request now (waiting or running): its pages and slot are freed; its output so far
        is returned by the next :meth:`step` (or :meth:`pop_finished`) with ``finish_reason="cancelled"``."""
        seq = self._sequences.get(request_id)
        if seq is None:
            return
        if seq.state == _WAITING:
            self._waiting.remove(seq)
            self._waiting_prompts[tuple(seq.prompt)] -= 1
        self._finish(seq, "cancelled")

    def progress(self, request_id: int) -> tuple[list[int], list[float], list[list[tuple[int, float]]]] | None:
        """The tokens, log-probs and top log-probs (as :class:`Output`'s) a running or waiting request
        has sampled so far (copies, for a caller that streams them); None once it has finished (its
        output comes from :meth:`step`)."""
        seq = self._sequences.get(request_id)
        return None if seq is None else (list(seq.generated), list(seq.logprobs), list(seq.top))

    def has_work(self) -> bool:
        return bool(self._waiting) or any(s is not None for s in self._slots)

    def generate(self, requests: Sequence[Request]) -> list[Output]:
        """Run ``requests`` to completion; outputs in the order of ``requests``. Every request is checked
        before any runs: a bad one raises :class:`UserError` naming its index and field."""
        for i, r in enumerate(requests):
            try:
                self._validate(r)
            except UserError as e:
                raise UserError(f"request {i}: {e}") from None
        ids = [self.submit(r) for r in requests]
        done: dict[int, Output] = {}
        while len(done) < len(ids):
            done.update((o.request_id, o) for o in self.step())
        mine = set(ids)
        self._finished.update((i, o) for i, o in done.items() if i not in mine)  # other callers' outputs stay
        return [done[i] for i in ids]

    def pop_finished(self) -> list[Output]:
        """Outputs finished since the last call (for callers driving :meth:`step` themselves)."""
        out = list(self._finished.values())
        self._finished.clear()
        return out

    def _validate(self, r: Request) -> list[int]:
        prompt = [int(t) for t in r.prompt_ids]
        V = self.config.vocab_size
        if not prompt:
            raise UserError("prompt_ids: empty prompt")
        if any(t < 0 or t >= V for t in prompt):
            raise UserError(f"prompt_ids: token ids must be in [0, {V}), got {min(prompt)}..{max(prompt)}")
        if not isinstance(r.max_tokens, (int, np.integer)) or r.max_tokens < 1:
            raise UserError(f"max_tokens must be an integer >= 1, got {r.max_tokens!r}")
        total = len(prompt) + r.max_tokens
        if total > self.max_context:
            whose = ("the model's context" if self.max_context == self.config.max_position_embeddings
                     else "the engine's max_context")
            raise UserError(f"max_tokens: prompt ({len(prompt)}) + max_tokens ({r.max_tokens}) = {total} "
                            f"exceeds {whose} of {self.max_context} tokens")
        if math.ceil(total / self.page_size) > self.pool.capacity:
            raise UserError(f"max_tokens: prompt + max_tokens = {total} tokens needs more pages than the "
                            f"whole pool holds ({self.pool.capacity} pages of {self.page_size})")
        if not (isinstance(r.temperature, (int, float)) and math.isfinite(r.temperature) and r.temperature >= 0):
            raise UserError(f"temperature must be a finite number >= 0, got {r.temperature!r}")
        if not (isinstance(r.top_p, (int, float)) and 0 < r.top_p <= 1):
            raise UserError(f"top_p must be in (0, 1], got {r.top_p!r}")
        if not isinstance(r.top_k, (int, np.integer)) or r.top_k < 0:
            raise UserError(f"top_k must be an integer >= 0, got {r.top_k!r}")
        if any(not 0 <= int(t) < V for t in r.stop_token_ids):
            raise UserError(f"stop_token_ids: ids must be in [0, {V}), got {list(r.stop_token_ids)}")
        if not isinstance(r.seed, (int, np.integer)) or not 0 <= r.seed < 2 ** 32:
            raise UserError(f"seed must be an integer in [0, 2**32), got {r.seed!r}")
        if not isinstance(r.top_logprobs, (int, np.integer)) or not 0 <= r.top_logprobs <= MAX_TOP_LOGPROBS:
            raise UserError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {r.top_logprobs!r}")
        return prompt

    # ------------------------------------------------------------------ one scheduling step
    def step(self) -> list[Output]:
        """Admit waiting requests into free slots, run one prefill call (if any sequence is being
        prefilled) and one decode step (if any is decoding); return the outputs that finished since
        the last :meth:`step` or :meth:`pop_finished` (cancelled ones included)."""
        self._admit()
        self._prefill()
        self._decode()
        return self.pop_finished()

    def _admit(self) -> None:
        leaders = {tuple(s.prompt): s for s in self._slots
                   if s is not None and s.state == _PREFILL and not s.generated}
        first = []  # (sequence, logits of its prompt's last token) from the prompt cache
        while self._waiting and None in self._slots:
            seq = self._waiting[0]
            key = tuple(seq.prompt)
            leader = leaders.get(key) if not seq.generated else None
            if leader is not None:  # the same prompt is being prefilled: share its pages when it is done
                seq.state, seq.leader = _FOLLOW, leader
                leader.followers.append(seq)
            else:
                entry = self.pool.cache.lookup_prompt(seq.prompt) if not seq.generated else None
                if entry is not None:
                    shared = self._share_prompt(seq, entry.pages)
                    self.pool.release(entry.pages)
                    if not shared:
                        break
                    first.append((seq, entry.logits))
                    self.stats["prompt_cache_hits"] += 1
                elif not self._allocate_prefix(seq):
                    break  # first in, first out: the head of the queue waits for pages
                elif not seq.generated:
                    leaders[key] = seq
            self._waiting.popleft()
            self._waiting_prompts[key] -= 1
            if self._waiting_prompts[key] <= 0:
                del self._waiting_prompts[key]
                self.pool.cache.drop_prompt(seq.prompt)  # no other sample of it waits
            seq.slot = self._slots.index(None)
            self._slots[seq.slot] = seq
            self._admissions += 1
            seq.admitted_at = self._admissions
        self._first_tokens(first)

    def _share_prompt(self, seq: _Sequence, pages: list[int]) -> bool:
        """Give ``seq`` the pages of its prompt, prefilled by another sequence: the full pages shared,
        the partly filled last page copied (copy on write). False (nothing held) if no page is free."""
        full = len(seq.prompt) // self.page_size
        own = []
        if full < len(pages):
            own = self.pool.allocate(1)
            if own is None:
                return False
            self.kv = model_step.copy_page(self.kv, pages[full], own[0])
        self.pool.hold(pages[:full])
        seq.pages, seq.kv_len, seq.state = pages[:full] + own, len(seq.prompt), _DECODE
        return True

    def _allocate_prefix(self, seq: _Sequence) -> bool:
        """Give ``seq`` the pages of its prefill target (cached full pages shared); False if none free."""
        ps, target = self.page_size, seq.prefill_target
        shared = self.pool.cache.lookup_pages(seq.tokens[:target], (target - 1) // ps)  # >= 1 token to prefill
        fresh = self.pool.allocate(math.ceil(target / ps) - len(shared))
        if fresh is None:
            self.pool.release(shared)
            return False
        self.stats["page_cache_hits"] += len(shared)
        seq.pages, seq.kv_len, seq.state = shared + fresh, len(shared) * ps, _PREFILL
        return True

    def _prefill(self) -> None:
        rows = [s for s in self._slots if s is not None and s.state == _PREFILL]
        if not rows:
            return
        chunks, budget = [], self.prefill_tokens
        for seq in rows:
            n = min(seq.prefill_target - seq.kv_len, self.prefill_chunk)
            if chunks and n > budget:
                break
            chunks.append((seq, n))
            budget -= n
        R = bucket_length(len(chunks), 1, 1)
        T = bucket_length(max(n for _, n in chunks), 16, 1)
        width = bucket_length(max(math.ceil((s.kv_len + n) / self.page_size) for s, n in chunks), 1, 1)
        tokens = np.zeros((R, T), np.int32)
        start, length = np.zeros(R, np.int32), np.zeros(R, np.int32)
        table = np.full((R, width), NULL_PAGE, np.int32)
        for r, (seq, n) in enumerate(chunks):
            tokens[r, :n] = seq.tokens[seq.kv_len:seq.kv_len + n]
            start[r], length[r] = seq.kv_len, n
            pages = seq.pages[:width]
            table[r, :len(pages)] = pages
        t0 = time.perf_counter()
        self.kv, logits = model_step.prefill(self.graphdef, self.states, self.weights, self.kv, tokens, start, length,
                                             table)
        self.stats["prefill_calls"] += 1
        self.stats["prefill_tokens"] += int(length.sum())
        first = []
        for r, (seq, n) in enumerate(chunks):
            seq.kv_len += n
            if seq.kv_len < seq.prefill_target:
                continue
            if seq.generated:  # a preempted sequence back in: its last sampled token is decoded next
                seq.state = _DECODE
                continue
            ps = self.page_size
            prompt_pages = seq.pages[:math.ceil(len(seq.prompt) / ps)]
            self.pool.cache.insert_pages(seq.prompt, prompt_pages[:len(seq.prompt) // ps])
            if self._waiting_prompts.get(tuple(seq.prompt)):  # another sample of this prompt waits for a slot
                self.pool.cache.insert_prompt(seq.prompt, prompt_pages, logits[r])
            first.append((seq, logits[r]))
            for follower in list(seq.followers):
                if self._share_prompt(follower, prompt_pages):
                    first.append((follower, logits[r]))
                else:  # no page for its copy: back to the head of the queue
                    self._preempt(follower)
            seq.followers = []
        self._first_tokens(first)
        self.stats["prefill_seconds"] += time.perf_counter() - t0

    def _first_tokens(self, pairs) -> None:
        """Sample the first token of each ``(sequence, logits of its prompt's last token)``, one call."""
        if not pairs:
            return
        n = bucket_length(len(pairs), 1, 1)
        seqs = [s for s, _ in pairs] + [None] * (n - len(pairs))
        logits = jnp.stack([l for _, l in pairs] + [pairs[0][1]] * (n - len(pairs)))
        sampling, filtered, top = self._sampling(seqs)
        drawn = jax.device_get(model_step.sample(logits, sampling, filtered=filtered, top=top))
        for i, (seq, _) in enumerate(pairs):
            seq.state = _DECODE
            self._append(seq, i, *drawn)

    def _sampling(self, seqs: Sequence[_Sequence | None]) -> tuple[dict, bool, int]:
        """The rows' sampling settings, whether any row filters (top-k / top-p), and how many top
        log-probs the step computes (0, or :data:`MAX_TOP_LOGPROBS` when any row asks)."""
        n = len(seqs)
        out = {"seed": np.zeros(n, np.uint32), "counter": np.zeros(n, np.int32),
               "temperature": np.ones(n, np.float32), "top_k": np.zeros(n, np.int32), "top_p": np.ones(n, np.float32)}
        for i, s in enumerate(seqs):
            if s is None:
                continue
            r = s.request
            out["seed"][i], out["counter"][i] = r.seed, len(s.generated)
            out["temperature"][i], out["top_k"][i], out["top_p"][i] = r.temperature, r.top_k, r.top_p
        filtered = bool((out["top_k"] > 0).any() or (out["top_p"] < 1).any())
        top = MAX_TOP_LOGPROBS if any(s is not None and s.request.top_logprobs for s in seqs) else 0
        return out, filtered, top

    def _append(self, seq: _Sequence, row: int, tokens, logps, top_logps, top_ids) -> None:
        """Row ``row`` of a sampling call's (host) outputs becomes ``seq``'s next token."""
        token = int(tokens[row])
        seq.generated.append(token)
        seq.logprobs.append(float(logps[row]))
        r = seq.request
        if r.top_logprobs:
            k = r.top_logprobs
            seq.top.append([(int(i), float(lp)) for i, lp in zip(top_ids[row, :k], top_logps[row, :k])])
        if token in r.stop_token_ids:
            self._finish(seq, "stop")
        elif len(seq.generated) >= r.max_tokens:
            self._finish(seq, "length")

    def _decode(self) -> None:
        for seq in sorted((s for s in self._slots if s is not None and s.state == _DECODE), key=lambda s: s.admitted_at):
            if seq.state != _DECODE:  # preempted by an earlier one in this loop
                continue
            while seq.kv_len // self.page_size >= len(seq.pages):
                page = self.pool.allocate(1)
                if page is not None:
                    seq.pages += page
                    continue
                self._preempt(self._newest())
                if seq.state != _DECODE:
                    break
        rows: list[_Sequence | None] = [s for s in self._slots if s is not None and s.state == _DECODE]
        if not rows:
            return
        # the decoding sequences packed into a power-of-two number of rows (at least 8, at most
        # max_slots): a step costs what is in flight, not max_slots, as the tail of a batch drains.
        # One page-table width for every step; the attention reads only the live pages (ragged: work
        # in proportion to the tokens in flight), bucketed by live_pages_bucket: few compiled programs.
        S = min(bucket_length(len(rows), 8, 1), self.max_slots)
        rows += [None] * (S - len(rows))
        width = self.max_pages_per_sequence
        live = live_pages_bucket(sum(len(s.pages) for s in rows if s is not None))
        tokens, start, active = np.zeros(S, np.int32), np.zeros(S, np.int32), np.zeros(S, np.int32)
        table = np.full((S, width), NULL_PAGE, np.int32)
        for i, s in enumerate(rows):
            if s is not None:
                tokens[i], start[i], active[i] = s.generated[-1], s.kv_len, 1
                table[i, :len(s.pages)] = s.pages
        sampling, filtered, top = self._sampling(rows)
        t0 = time.perf_counter()
        self.kv, *drawn = model_step.decode(self.graphdef, self.states, self.weights, self.kv, tokens, start, active,
                                            table, sampling, live_pages=live, filtered=filtered, top=top)
        drawn = jax.device_get(drawn)
        self.stats["decode_seconds"] += time.perf_counter() - t0
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += int(active.sum())
        self.stats["live_kv_tokens_read"] += int((start + active).sum())
        for i, s in enumerate(rows):
            if s is not None:
                s.kv_len += 1
                self._append(s, i, *drawn)

    def _newest(self) -> _Sequence:
        running = [s for s in self._slots if s is not None]
        return max(running, key=lambda s: s.admitted_at)

    def _detach(self, seq: _Sequence) -> None:
        """Before ``seq`` leaves its slot: its followers go back to the head of the queue, and a
        follower leaves its leader's list."""
        for follower in reversed(seq.followers):
            self._preempt(follower)
        seq.followers = []
        if seq.leader is not None and seq in seq.leader.followers:
            seq.leader.followers.remove(seq)
        seq.leader = None

    def _preempt(self, seq: _Sequence) -> None:
        """Free ``seq``'s slot and pages; it waits at the head of the queue, keeping its tokens."""
        self._detach(seq)
        self.pool.release(seq.pages)
        seq.pages, seq.kv_len, seq.state = [], 0, _WAITING
        self._slots[seq.slot] = None
        seq.slot = -1
        self._waiting.appendleft(seq)
        self._waiting_prompts[tuple(seq.prompt)] += 1
        self.stats["preempted"] += 1

    def _finish(self, seq: _Sequence, reason: str) -> None:
        self._detach(seq)
        if seq.pages:
            written = seq.tokens[:seq.kv_len]
            self.pool.cache.insert_pages(written, seq.pages[:seq.kv_len // self.page_size])
            self.pool.release(seq.pages)
        seq.pages = []
        if seq.slot >= 0:
            self._slots[seq.slot] = None
        seq.state = "finished"
        del self._sequences[seq.id]
        self._finished[seq.id] = Output(seq.id, seq.prompt, seq.generated, seq.logprobs, reason, seq.top)


def live_pages_bucket(pages: int) -> int:
    """The ``live_pages`` a decode step over ``pages`` live pages compiles for: 32, 48, 64, 96, 128, ...
    (two buckets per power of two). The ragged attention's time grows with the bucket, so powers of two
    alone would spend up to half of it on padding pairs; each bucket a run meets is one more compiled
    decode program."""
    return bucket_length(pages, 32, 2)


def _same_arrays(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(x is y for x, y in zip(la, lb))


def default_num_pages(engine: Engine, states) -> int:
    """Pages for the memory left after the weights: 90% of the accelerator memory the weights leave
    free; on a CPU host, a quarter of its memory (at most half of what is available now), rounded
    down to one of four steps per power of two (:func:`_coarse`), so that runs on one host get the
    same pool, hence the same programs, which the persistent compilation cache then serves
    (``rljax.compile_cache``). Never more than ``max_slots`` full-context sequences need."""
    page_bytes = engine.kv_bytes_per_token * engine.page_size
    device = jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        pages = int(0.9 * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)) // page_bytes)
    else:
        total, available = _host_memory_bytes()
        pages = _coarse(int(min(0.25 * total, 0.5 * available) // page_bytes))
    most = engine.max_slots * math.ceil(engine.max_context / engine.page_size) + 1
    return int(max(2, min(pages, most)))


def _coarse(n: int) -> int:
    """``n`` rounded down to a multiple of a quarter of its largest power of two (4, 5, 6, 7, 8, 10,
    12, 14, 16, 20, ...): at most a fifth less, and the same for nearby values."""
    if n < 4:
        return n
    unit = 1 << (n.bit_length() - 3)
    return n // unit * unit


def _host_memory_bytes() -> tuple[int, int]:
    """(MemTotal, MemAvailable) of /proc/meminfo; 16 and 4 GiB where it cannot be read."""
    found = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    found[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return found.get("MemTotal", 16 << 30), found.get("MemAvailable", 4 << 30)
