"""The host side of the paged KV cache: which pages are free, who holds each page, and which prompts
already have their keys and values in pages.

The device side is one pool of keys and one of values per layer (``rljax.inference.attention.pool_shapes``,
:mod:`rljax.inference.model_step`); this module only hands out page ids. Page 0 is the null page:
never handed out, it fills unused page-table entries (padding tokens write nothing).

A page can have several holders (reference counts): each sequence whose page table lists it, and the
prefix cache. The prefix cache keeps two kinds of entries, both dropped least recently used first
when :meth:`PagePool.allocate` runs short:

- full pages of token ids, keyed by a hash of the page's tokens chained to the previous page's key (a
  prompt's first ``k`` full pages are found whatever follows them: the next turn of a conversation
  reuses the pages of the previous one, as in vLLM's automatic prefix caching);
- whole prompts (the samples of a GRPO group): the prompt's partly filled last page and the logits
  of its last token, so a second sample of the same prompt runs no prefill at all; its copy of the
  last page is made on write (the caller copies it into a fresh page before its first decode step).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Sequence

import numpy as np

NULL_PAGE = 0


class PagePool:
    """Free list and reference counts of ``num_pages`` pages (page 0 reserved)."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = collections.deque(range(1, num_pages))
        self._refs = np.zeros(num_pages, np.int32)
        self.peak_in_use = 0
        self.cache = PrefixCache(self)

    @property
    def capacity(self) -> int:
        """Pages a sequence could ever hold: every page but the null page."""
        return self.num_pages - 1

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.capacity - len(self._free)

    def refs(self, page: int) -> int:
        return int(self._refs[page])

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh pages (reference count 1), evicting prefix-cache entries if needed; ``None``
        when even that is not enough (the cache may then have been emptied, nothing else changed)."""
        if n > len(self._free):
            self.cache.evict(n - len(self._free))
            if n > len(self._free):
                return None
        pages = [self._free.popleft() for _ in range(n)]
        self._refs[pages] = 1
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return pages

    def hold(self, pages: Sequence[int]) -> None:
        """One more holder for each page (a sequence sharing a prefix, or the cache)."""
        for p in pages:
            assert p != NULL_PAGE and self._refs[p] > 0, f"page {p} is not allocated"
            self._refs[p] += 1

    def release(self, pages: Sequence[int]) -> None:
        """One holder fewer for each page; a page nobody holds goes back to the free list."""
        for p in pages:
            assert p != NULL_PAGE and self._refs[p] > 0, f"page {p} released more often than held"
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)


@dataclasses.dataclass
class PromptEntry:
    """A whole prompt in the cache: its pages (full pages and the partly filled last one) and the
    logits of its last token (a device array), so another sample of it needs no prefill."""

    pages: list[int]
    logits: Any


class PrefixCache:
    """Prompts and full pages whose keys and values are already in the pool (see the module docstring).

    Each entry holds one reference on its pages; an entry whose pages have no other holder can be
    evicted. Entries are valid for one set of weights: :meth:`clear` when the weights change.
    """

    def __init__(self, pool: PagePool):
        self.pool = pool
        self._blocks: collections.OrderedDict[int, int] = collections.OrderedDict()  # chained hash -> page
        self._prompts: collections.OrderedDict[tuple, PromptEntry] = collections.OrderedDict()

    @staticmethod
    def block_keys(tokens: Sequence[int], page_size: int) -> list[int]:
        """The chained hash of each full page of ``tokens``."""
        keys, prev = [], 0
        for i in range(len(tokens) // page_size):
            prev = hash((prev, tuple(tokens[i * page_size:(i + 1) * page_size])))
            keys.append(prev)
        return keys

    # ----------------------------------------------------------------- lookups (caller holds the result)
    def lookup_prompt(self, tokens: Sequence[int]) -> PromptEntry | None:
        entry = self._prompts.get(tuple(tokens))
        if entry is not None:
            self._prompts.move_to_end(tuple(tokens))
            self.pool.hold(entry.pages)
        return entry

    def lookup_pages(self, tokens: Sequence[int], max_pages: int) -> list[int]:
        """The longest run of cached full pages that starts ``tokens`` (at most ``max_pages``), held."""
        found = []
        for key in self.block_keys(tokens, self.pool.page_size)[:max_pages]:
            page = self._blocks.get(key)
            if page is None:
                break
            self._blocks.move_to_end(key)
            found.append(page)
        self.pool.hold(found)
        return found

    # ----------------------------------------------------------------- inserts
    def insert_pages(self, tokens: Sequence[int], pages: Sequence[int]) -> None:
        """Remember the full pages of ``tokens`` (whose keys and values ``pages`` hold)."""
        for key, page in zip(self.block_keys(tokens, self.pool.page_size), pages):
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            self.pool.hold([page])
            self._blocks[key] = page

    def insert_prompt(self, tokens: Sequence[int], pages: Sequence[int], logits) -> None:
        key = tuple(tokens)
        if key in self._prompts:
            self._prompts.move_to_end(key)
            return
        self.pool.hold(pages)
        self._prompts[key] = PromptEntry(list(pages), logits)

    def drop_prompt(self, tokens: Sequence[int]) -> None:
        entry = self._prompts.pop(tuple(tokens), None)
        if entry is not None:
            self.pool.release(entry.pages)

    # ----------------------------------------------------------------- eviction
    def evictable(self) -> int:
        """Pages that evicting every entry would free (held by the cache alone)."""
        held: collections.Counter = collections.Counter(self._blocks.values())
        for entry in self._prompts.values():
            held.update(entry.pages)
        return sum(1 for p, n in held.items() if self.pool.refs(p) == n)

    def evict(self, pages_needed: int) -> None:
        """Drop entries, least recently used first (whole prompts before full pages), until
        ``pages_needed`` pages went back to the free list or nothing is left to drop."""
        start = self.pool.free
        while self.pool.free - start < pages_needed and self._prompts:
            _, entry = self._prompts.popitem(last=False)
            self.pool.release(entry.pages)
        while self.pool.free - start < pages_needed and self._blocks:
            _, page = self._blocks.popitem(last=False)
            self.pool.release([page])

    def clear(self) -> None:
        self.evict(self.pool.num_pages)
