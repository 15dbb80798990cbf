"""The page allocator of `inference.scheduler`: reference-counted KV pages with automatic
prefix caching (vLLM's). A full page is keyed by a hash of its tokens and of every token
before it (a chain of digests, one per page), so equal keys mean equal keys and values in
the page. A cached page whose last user let go stays cached (evictable, least recently
used first) until a new page is needed and no never-cached page is free. Page ids index
the device pools (`gpt_jax.cache`). Host only: no JAX here.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np


def page_hashes(tokens: list[int], page_size: int) -> list[bytes]:
    """The prefix-cache key of each full page of `tokens`: a digest of the page's tokens and
    the previous page's key (BLAKE2b, 16 bytes), so a key names the whole prefix."""
    keys, parent = [], b""
    for lo in range(0, len(tokens) - page_size + 1, page_size):
        page = np.asarray(tokens[lo: lo + page_size], np.int64).tobytes()
        parent = hashlib.blake2b(parent + page, digest_size=16).digest()
        keys.append(parent)
    return keys


class PagePool:
    """Reference-counted pages with a prefix cache. Page ids index the device pools."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.refs = np.zeros(num_pages, np.int64)
        self.free = collections.deque(range(num_pages))  # never cached, unused
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU
        self.page_of: dict[bytes, int] = {}  # prefix key -> cached page
        self.key_of: dict[int, bytes] = {}  # cached page -> its key

    def num_free(self) -> int:
        """Pages that can be handed out now (unused, cached or not)."""
        return len(self.free) + len(self.evictable)

    def allocate(self) -> int:
        """A page for a new user (refs 1). Raises IndexError when none is free."""
        if self.free:
            page = self.free.popleft()
        else:
            page, _ = self.evictable.popitem(last=False)  # least recently used
            del self.page_of[self.key_of.pop(page)]
        self.refs[page] = 1
        return page

    def retain(self, page: int) -> None:
        """One more user of a cached page."""
        self.evictable.pop(page, None)
        self.refs[page] += 1

    def release(self, pages: list[int]) -> None:
        """Users let go: a page nobody uses goes back to the free list, or stays cached."""
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self.key_of:
                    self.evictable[page] = None
                else:
                    self.free.append(page)

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The cached pages of the longest run of `keys` from the start."""
        pages = []
        for key in keys:
            if key not in self.page_of:
                break
            pages.append(self.page_of[key])
        return pages

    def register(self, page: int, key: bytes) -> None:
        """Cache a full, written page under `key` (a page already cached keeps its key)."""
        if key not in self.page_of and page not in self.key_of:
            self.page_of[key], self.key_of[page] = page, key
