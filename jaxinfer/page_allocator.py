"""Host-side KV page allocator: a free list over pages 1..num_pages-1 (page 0 is the dummy)."""

from __future__ import annotations

from collections import deque


class OutOfPagesError(RuntimeError):
    """Not enough free KV pages for an allocation."""


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(1, num_pages))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def usage(self) -> float:
        return len(self._used) / self.num_usable

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} KV pages, {len(self._free)} free of {self.num_usable}")
        pages = [self._free.popleft() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages) -> None:
        for p in pages:
            if p not in self._used:
                raise ValueError(f"page {p} is not allocated")
            self._used.remove(p)
            self._free.append(p)
