"""Paged slot spaces: pool sizes, a pool's free pages, and one request's run of pages.

Slot id = page * P + offset. Physical page 0 of every pool is the skip sentinel and is never handed
out. A request's logical index i (raw position, or compressed index) lives in logical page i // P,
which maps to one physical page, so slot(i) = phys[i // P] * P + i % P and slot % P == i % P.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from typing import TYPE_CHECKING, TypeVar

from dsv4serve.config import EngineConfig
from dsv4serve.memory.layout import KVLayout
from dsv4serve.protocol import SLOT_DTYPE

if TYPE_CHECKING:
    import torch

N = TypeVar("N", int, "torch.Tensor")


def coff(ratio: int) -> int:
    """A compressor's rows per token: 2 for the overlapping ratio-4 windows, else 1."""
    return 2 if ratio == 4 else 1


def ring_size(ratio: int) -> int:
    """Rows of a request-scoped compressor-state ring: coff * ratio."""
    return coff(ratio) * ratio


def npu_state_pool_size(ratio: int, page_size: int, max_running: int) -> int:
    """Paged compressor-state pool size in tokens (slots), as Ascend's cache_mode=1 sizes it."""
    pages_per_req = max(2, math.ceil(1.8 * ratio / page_size) + 1)
    return pages_per_req * max_running * page_size


def keep_start(ratio: int, n: N) -> N:
    """First raw position whose compressor-state row must stay live once a request holds n tokens.

    Ratio 4: the last closed window (its half A feeds the next window) plus the open window.
    Other ratios: the open window only. `n` is an int (the allocator) or an int tensor (the model).
    """
    start = (n // ratio - (1 if ratio == 4 else 0)) * ratio
    return start * (start > 0)  # max(start, 0), for ints and tensors alike


class PoolSizes:
    """Pages per pool, by pool name, not counting the sentinel page 0 (a buffer holds pages + 1).

    `PoolSizes(full=64, swa=32)`; `sizes.pages("swa")` or `sizes.swa`. In ring state mode a state
    pool's pages are storage only: enough for (max_num_seqs + 1) rings, the extra one the sentinel bank.
    """

    __slots__ = ("_pages",)
    _pages: dict[str, int]

    def __init__(self, **pages: int) -> None:
        assert all(n >= 0 for n in pages.values()), pages
        object.__setattr__(self, "_pages", dict(pages))

    def pages(self, pool: str) -> int:
        return self._pages[pool]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._pages)

    def as_dict(self) -> dict[str, int]:
        return dict(self._pages)

    def with_(self, **changes: int) -> PoolSizes:
        assert changes.keys() <= self._pages.keys(), (changes, self.names)
        return PoolSizes(**{**self._pages, **changes})

    def __getattr__(self, pool: str) -> int:
        pages = self._pages if pool != "_pages" else {}  # (`_pages` unset: a copy being built)
        if pool not in pages:
            raise AttributeError(f"no pool {pool!r} in PoolSizes{tuple(pages)}")
        return pages[pool]

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("PoolSizes is frozen")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PoolSizes) and self._pages == other._pages

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._pages.items())))

    def __repr__(self) -> str:
        return f"PoolSizes({', '.join(f'{k}={v}' for k, v in self._pages.items())})"


def state_sentinels(layout: KVLayout, sizes: PoolSizes, engine: EngineConfig) -> dict[str, int]:
    """Each state pool's sentinel slot (padding writes and reads land there): 0 when paged; in ring
    mode the bank after the last request's ring, max_num_seqs * ring (checked to fit the pool)."""
    out = {}
    for pool in (p for p in layout.pools if p.index == "state"):
        if engine.state_mode != "ring":
            out[pool.name] = 0
            continue
        ring, seqs = ring_size(pool.ratio), engine.max_num_seqs
        room = sizes.pages(pool.name) * engine.page_size
        assert room >= (seqs + 1) * ring, f"{pool.name}: {room} slots cannot hold {seqs} rings and the bank"
        out[pool.name] = seqs * ring
    return out


class PagePool:
    """The free physical pages 1..num_pages of one pool (page 0 is the sentinel).

    First in, first out: a page freed now is handed out again as late as possible.
    """

    __slots__ = ("_free", "num_pages", "page_size")

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(1, num_pages + 1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def take(self, n: int) -> list[int]:
        assert n <= len(self._free), f"take({n}) with {len(self._free)} free pages"
        pop = self._free.popleft
        return [pop() for _ in range(n)]

    def give(self, pages: list[int]) -> None:
        self._free.extend(pages)

    def free_pages(self) -> list[int]:
        return list(self._free)


class PageRun:
    """One request's logical pages [first, first + len(pages)) in one pool, each -> a physical page.

    Allocation is tail-only and eviction front-only, so the held logical pages stay contiguous.
    """

    __slots__ = ("first", "pages")

    def __init__(self) -> None:
        self.first = 0
        self.pages: list[int] = []

    def plan(self, lo: int, hi: int, keep: int, page_size: int) -> tuple[int, int]:
        """(pages to evict, pages to take) to cover indices [lo, hi) after evicting pages wholly < keep.

        Requires keep <= lo (what is evicted is never needed again this step).
        """
        held = len(self.pages)
        evict = min(max(keep // page_size - self.first, 0), held)
        if hi <= lo:
            return evict, 0
        q0, q1 = lo // page_size, (hi - 1) // page_size
        return evict, max(0, q1 - max(q0, self.first + held) + 1)  # evicted pages all lie below q0

    def evict(self, count: int, pool: PagePool) -> None:
        if count:
            pool.give(self.pages[:count])
            del self.pages[:count]
            self.first += count

    def extend(self, lo: int, hi: int, take: int, pool: PagePool) -> array:
        """Cover indices [lo, hi) with `take` new tail pages (from `plan`); return their slots in order."""
        out = array(SLOT_DTYPE)
        if hi <= lo:
            return out
        size = pool.page_size
        q0, q1 = lo // size, (hi - 1) // size
        if not self.pages:
            self.first = q0
        if take:
            self.pages += pool.take(take)
        pages, first = self.pages, self.first
        assert first <= q0 and q1 < first + len(pages), f"[{lo}, {hi}) is not covered by the pages"
        for q in range(q0, q1 + 1):
            shift = (pages[q - first] - q) * size  # slot = shift + index
            out.extend(range(shift + max(lo, q * size), shift + min(hi, q * size + size)))
        return out

    def release(self, pool: PagePool) -> None:
        pool.give(self.pages)
        self.pages = []
