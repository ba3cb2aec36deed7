"""Host-side KV page allocator: refcounts, a least-recently-used free queue, the prefix cache.

Pages 1..num_pages-1 are allocatable (page 0 is the dummy page padding writes to).
A page is *in use* while its refcount is positive. A full page can be named by
the hash of its tokens and its prefix (`jaxinfer.engine.prefix_cache`); when its last
user lets go it stays in the free queue with its contents and its name, so a
later request with the same prefix can take it back. Allocation takes the least
recently freed page, evicting its name if it had one.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence


class OutOfPagesError(RuntimeError):
    """Not enough free KV pages for an allocation."""


class PageAllocator:
    def __init__(self, num_pages: int, enable_prefix_cache: bool = True):
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.enable_prefix_cache = enable_prefix_cache
        self.refcount = [0] * num_pages
        self._free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(1, num_pages))
        self._hash_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self.queries = 0  # prefix-cache lookups, in pages
        self.hits = 0  # pages found

    # -- counts --------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Pages that can be allocated now (free, cached-but-unused included)."""
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self._free)

    def usage(self) -> float:
        return self.num_used / self.num_usable

    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    # -- allocation ------------------------------------------------------------

    def allocate(self, n: int) -> list:
        """Take `n` fresh pages (refcount 1), evicting the least recently freed first."""
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} KV pages, {len(self._free)} free of {self.num_usable}")
        pages = []
        for _ in range(n):
            p, _ = self._free.popitem(last=False)
            h = self._hash_of.pop(p, None)
            if h is not None:
                del self._page_of[h]
            self.refcount[p] = 1
            pages.append(p)
        return pages

    def release(self, pages: Iterable[int]) -> None:
        """Drop one reference to each page; unused pages join the free queue's recent end.

        Pass a request's pages last-first, so its tail pages (least likely to be
        shared) are evicted before its head pages.
        """
        for p in pages:
            if self.refcount[p] <= 0:
                raise ValueError(f"page {p} is not allocated")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free[p] = None

    # -- prefix cache ------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes]) -> list:
        """Pages holding the longest cached run of `hashes` (no references taken)."""
        if not self.enable_prefix_cache:
            return []
        found = []
        for h in hashes:
            p = self._page_of.get(h)
            if p is None:
                break
            found.append(p)
        self.queries += len(hashes)
        self.hits += len(found)
        return found

    def lookup_window(self, hashes: Sequence[bytes], window: int, page_size: int) -> tuple[int, list]:
        """`lookup` for a model whose every layer attends at most `window` positions back.

        The next query after a cached prefix of ``m`` pages reads only the pages from
        ``(m * page_size - window + 1) // page_size`` on, so the prefix counts as cached when
        those are, whatever became of the pages behind them. Returns ``(behind, pages)`` for the
        longest such prefix: ``behind`` pages not needed, then the cached pages after them.
        """
        if not self.enable_prefix_cache:
            return 0, []
        self.queries += len(hashes)
        for m in range(len(hashes), 0, -1):
            behind = max(0, m * page_size - window + 1) // page_size
            found = [self._page_of.get(h) for h in hashes[behind:m]]
            if all(p is not None for p in found):
                self.hits += m
                return behind, found
        return 0, []

    def share(self, pages: Iterable[int]) -> None:
        """Take a reference to cached pages found by `lookup`."""
        for p in pages:
            if self.refcount[p] == 0:
                del self._free[p]
            self.refcount[p] += 1

    def register(self, page: int, h: bytes) -> None:
        """Name a full, written page by its hash so later requests can reuse it."""
        if not self.enable_prefix_cache or page in self._hash_of:
            return
        if h in self._page_of:  # the same content already lives in another page
            return
        self._hash_of[page] = h
        self._page_of[h] = page


    def check_all_free(self) -> None:
        """Raise if any page is still referenced (tests and shutdown)."""
        used = [p for p in range(1, self.num_pages) if self.refcount[p]]
        if used or len(self._free) != self.num_usable:
            raise AssertionError(f"{len(used)} KV pages still referenced: {used[:10]}")
