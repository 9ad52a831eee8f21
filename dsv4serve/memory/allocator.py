"""The KV allocator: answers each request's step with its slots in every pool (`CacheLocs`), or a refusal.

Pure sync Python; the allocator actor is a thin loop around it.
"""

from __future__ import annotations

import heapq
from array import array
from dataclasses import dataclass

from dsv4serve.config import EngineConfig
from dsv4serve.memory.layout import ServedModelConfig
from dsv4serve.memory.paged import PagePool, PageRun, PoolSizes, keep_start, ring_size
from dsv4serve.memory.sizing import engine_pool_sizes
from dsv4serve.protocol import SLOT_DTYPE, CacheLocs


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a step could not be allocated: nothing was allocated, but a held request's dead pages
    (see KVAllocator) were freed all the same.

    reason "no_room": `pool` needs `needed_slots` and can give `free_slots` (its free slots plus
    what the request itself would release this step). "no_row": pool "row", 1 needed, 0 free.
    "too_long": the first pool (the address space), needed_slots = seq_len, free_slots = the max
    model length.
    """

    rid: str
    pool: str
    needed_slots: int
    free_slots: int
    reason: str


@dataclass(frozen=True, slots=True)
class PoolUsage:
    """Slots of one pool in use and in total (whole pages, the sentinel page excluded)."""

    used: int
    capacity: int

    @property
    def free(self) -> int:
        return self.capacity - self.used


@dataclass(slots=True)
class _Request:
    row: int
    length: int
    runs: tuple[PageRun, ...]


# (pool, lo, hi, dead_keep, step_keep): the pool's logical indices [lo, hi) new this step; pages wholly
# below dead_keep are dead whatever happens, pages wholly below step_keep are freed if the step goes on.
_Window = tuple[int, int, int, int, int]


class KVAllocator:
    """Owns every pool's free pages and every request's pages and table row.

    The pools are those of the model's `kv_layout` (layout.py), in layout order, by kind; a step
    takes a request from prefix_len to seq_len cached tokens and gets, in index order:
      raw         raw positions [prefix, seq)
      compressed  compressed indices [prefix // r, seq // r)            (r = the pool's ratio)
      state       raw positions [max(prefix, keep_start(r, seq)), seq)
    (DeepSeek-V4: full and swa raw, c4 and c128 compressed, c4_state and c128_state state; GLM: full.)
    Allocation is tail-only per (request, pool): a new logical page takes a fresh physical page.

    Eviction runs inside `allocate`, before the room check:
      raw, window W  pages all of whose positions are < prefix - W + 1 (no query of this step sees
                them);
      state (paged)  pages all of whose positions are < keep_start(r, seq). Those below
                keep_start(r, prefix) are dead and go even when the step is refused; the rest only
                when it is granted. This step's forward still reads the state rows of positions
                [keep_start(r, prefix), prefix), whose slots may be handed out again in this same
                step: the executor must read every old state row of a layer before writing any new
                row of that layer.
      raw pools without a window and compressed pools are only freed by `free`.
    Ring state mode has no state allocator: slot = row * ring + pos % ring (ring = ring_size(r)); the
    sentinel bank is row max_num_seqs.
    """

    def __init__(
        self, model: ServedModelConfig, engine: EngineConfig, sizes: PoolSizes | None = None
    ) -> None:
        self.sizes = sizes or engine_pool_sizes(model, engine)
        self.page_size = engine.page_size
        self.max_num_seqs = engine.max_num_seqs
        self.max_model_len = engine.resolved_max_model_len(model)
        self.ring = engine.state_mode == "ring"
        self._specs = model.kv_layout.pools  # pool p: self._specs[p], self._pools[p], a request's runs[p]
        self._names = model.kv_layout.names  # one tuple, shared by every CacheLocs
        self._pools = tuple(PagePool(self.sizes.pages(s.name), self.page_size) for s in self._specs)
        rings = {p: ring_size(s.ratio) for p, s in enumerate(self._specs) if self.ring and s.index == "state"}
        self._rings = rings  # ring-mode state pools: their ring
        self._paged = tuple(p for p in range(len(self._specs)) if p not in rings)
        self._free_rows = list(range(engine.max_num_seqs))
        self._reqs: dict[str, _Request] = {}

    # ------------------------------------------------------------------ queries

    def holds(self, rid: str) -> bool:
        return rid in self._reqs

    def row_of(self, rid: str) -> int:
        return self._reqs[rid].row

    def length_of(self, rid: str) -> int:
        return self._reqs[rid].length

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    @property
    def num_requests(self) -> int:
        return len(self._reqs)

    def usage(self) -> dict[str, PoolUsage]:
        """Every pool of the model's layout, in layout order."""
        out = {}
        for p, name in enumerate(self._names):
            if p in self._rings:
                ring = self._rings[p]
                out[name] = PoolUsage(len(self._reqs) * ring, self.max_num_seqs * ring)
            else:
                pool = self._pools[p]
                out[name] = PoolUsage(pool.num_used * self.page_size, pool.num_pages * self.page_size)
        return out

    def room_for(self, prefix_len: int, seq_len: int, rid: str | None = None) -> bool:
        """Whether `allocate(rid, prefix_len, seq_len, ...)` would succeed now (changes nothing).

        rid None (or not held): a new request holding nothing.
        """
        req = self._reqs.get(rid) if rid is not None else None
        if req is not None:
            assert prefix_len == req.length, f"{rid}: prefix {prefix_len} != held length {req.length}"
        windows = self._windows(prefix_len, seq_len)
        found = self._precheck("", req, seq_len) or self._plan("", req or self._empty_request(), windows)
        return not isinstance(found, Refusal)

    # ------------------------------------------------------------------ transitions

    def allocate(self, rid: str, prefix_len: int, seq_len: int, step: int) -> CacheLocs | Refusal:
        """Grow `rid` from prefix_len (what it holds now) to seq_len tokens; atomic."""
        assert 0 <= prefix_len < seq_len, f"{rid}: bad step {prefix_len} -> {seq_len}"
        req = self._reqs.get(rid)
        assert prefix_len == (req.length if req else 0), f"{rid}: prefix {prefix_len} != held length"
        windows = self._windows(prefix_len, seq_len)
        plan = self._precheck(rid, req, seq_len) or self._plan(rid, req or self._empty_request(), windows)
        if isinstance(plan, Refusal):
            if req is not None:
                self._evict_dead(req, windows)
            return plan
        if req is None:
            req = self._empty_request()
            req.row = heapq.heappop(self._free_rows)
            self._reqs[rid] = req
        req.length = seq_len
        return self._grant(rid, req, windows, plan, prefix_len, step)

    def free(self, rid: str) -> None:
        """Finish, abort or preempt: give back every page of every pool and the row."""
        req = self._reqs.pop(rid, None)
        if req is None:
            raise KeyError(f"{rid!r} holds no cache")
        for p in self._paged:
            req.runs[p].release(self._pools[p])
        heapq.heappush(self._free_rows, req.row)

    # ------------------------------------------------------------------ internals

    def _empty_request(self) -> _Request:
        return _Request(row=-1, length=0, runs=tuple(PageRun() for _ in self._specs))

    def _precheck(self, rid: str, req: _Request | None, seq_len: int) -> Refusal | None:
        if seq_len > self.max_model_len:
            return Refusal(rid, self._names[0], seq_len, self.max_model_len, "too_long")
        if req is None and not self._free_rows:
            return Refusal(rid, "row", 1, 0, "no_row")
        return None

    def _windows(self, prefix: int, seq: int) -> list[_Window]:
        out: list[_Window] = []
        for p in self._paged:
            spec = self._specs[p]
            ratio = spec.ratio
            if spec.index == "raw":
                keep = max(0, prefix - spec.window + 1) if spec.window else 0
                out.append((p, prefix, seq, keep, keep))
            elif spec.index == "compressed":
                out.append((p, prefix // ratio, seq // ratio, 0, 0))
            else:
                step_keep = keep_start(ratio, seq)
                out.append((p, max(prefix, step_keep), seq, keep_start(ratio, prefix), step_keep))
        return out

    def _plan(self, rid: str, req: _Request, windows: list[_Window]) -> list[tuple[int, int]] | Refusal:
        """Per window (pages to evict, pages to take), or a refusal naming the first pool short of pages."""
        size, out = self.page_size, []
        for p, lo, hi, _, keep in windows:
            evict, take = req.runs[p].plan(lo, hi, keep, size)
            have = self._pools[p].num_free + evict
            if take > have:
                return Refusal(rid, self._names[p], take * size, have * size, "no_room")
            out.append((evict, take))
        return out

    def _evict_dead(self, req: _Request, windows: list[_Window]) -> None:
        """Free pages no later step can read, whatever happens to this one."""
        for p, lo, hi, dead, _ in windows:
            evict, _ = req.runs[p].plan(lo, hi, dead, self.page_size)
            req.runs[p].evict(evict, self._pools[p])

    def _grant(
        self,
        rid: str,
        req: _Request,
        windows: list[_Window],
        plan: list[tuple[int, int]],
        prefix: int,
        step: int,
    ) -> CacheLocs:
        packed = [b""] * len(self._specs)
        seq = req.length
        for (p, lo, hi, _, _), (evict, take) in zip(windows, plan, strict=True):
            run, pool = req.runs[p], self._pools[p]
            run.evict(evict, pool)
            packed[p] = run.extend(lo, hi, take, pool).tobytes()
        for p, ring in self._rings.items():
            lo = max(prefix, keep_start(self._specs[p].ratio, seq))
            packed[p] = ring_slots(req.row, ring, lo, seq).tobytes()
        return CacheLocs(
            step=step,
            rid=rid,
            row=req.row,
            prefix_len=prefix,
            seq_len=seq,
            pools=self._names,
            packed=tuple(packed),
        )

    def assert_consistent(self) -> None:
        """Check that held and free pages partition every pool (for tests; O(pages))."""
        for p in self._paged:
            pool = self._pools[p]
            held = [page for req in self._reqs.values() for page in req.runs[p].pages]
            every = held + pool.free_pages()
            assert sorted(every) == list(range(1, pool.num_pages + 1)), f"{self._names[p]} pages leak"
        rows = sorted([req.row for req in self._reqs.values()] + self._free_rows)
        assert rows == list(range(self.max_num_seqs)), "rows leak"


def ring_slots(row: int, ring: int, lo: int, hi: int) -> array:
    """Ring-mode state slots of raw positions [lo, hi): row * ring + pos % ring (hi - lo <= ring)."""
    assert hi - lo <= ring, f"{hi - lo} positions do not fit a ring of {ring}"
    out = array(SLOT_DTYPE)
    bank = row * ring
    while lo < hi:
        offset = lo % ring
        end = min(hi, lo + ring - offset)
        out.extend(range(bank + offset, bank + offset + end - lo))
        lo = end
    return out
