"""Hypothesis: random admit / chunked extend / decode / preempt / abort / finish against a shadow model.

The shadow tracks, from the slot messages alone and the documented eviction rules, which (request,
logical page) owns each physical page and which slot each live index has; the allocator's usage,
page partition, refusals and the slot tables must agree with it at every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from memory_fixtures import TINY

from dsv4serve.config import EngineConfig
from dsv4serve.memory import (
    KVAllocator,
    PoolSizes,
    Refusal,
    SlotTables,
    keep_start,
    write_cache_locs,
    write_cache_locs_batch,
)
from dsv4serve.memory.paged import ring_size
from dsv4serve.protocol import CacheLocs

R = TINY.hca_ratio  # 16
W = TINY.sliding_window
MAX_LEN = 256
STATE_RATIO = {"c4_state": 4, "c128_state": R}
POOL_NAMES = TINY.kv_layout.names  # full, swa, c4, c128, c4_state, c128_state


def index_range(pool: str, prefix: int, seq: int) -> tuple[int, int]:
    if pool in ("full", "swa"):
        return prefix, seq
    if pool == "c4":
        return prefix // 4, seq // 4
    if pool == "c128":
        return prefix // R, seq // R
    return max(prefix, keep_start(STATE_RATIO[pool], seq)), seq


@dataclass
class Shadow:
    """What the allocator must be doing, rebuilt from its answers and the contract."""

    page: int
    ring: bool
    owner: dict[str, dict[int, tuple[str, int]]] = field(default_factory=dict)  # pool -> page -> (rid, q)
    slots: dict[str, dict[str, dict[int, int]]] = field(default_factory=dict)  # pool -> rid -> idx -> slot
    rows: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.owner = {p: {} for p in POOL_NAMES}
        self.slots = {p: {} for p in POOL_NAMES}

    def paged(self, pool: str) -> bool:
        return not (self.ring and pool in STATE_RATIO)

    def evict(self, pool: str, rid: str, keep: int) -> None:
        """Drop rid's indices in logical pages wholly below `keep` (the whole ring entry in ring mode)."""
        held = self.slots[pool].get(rid, {})
        cut = keep if not self.paged(pool) else keep // self.page * self.page
        for idx in [i for i in held if i < cut]:
            del held[idx]
        if self.paged(pool):
            pages = self.owner[pool]
            for phys in [ph for ph, (r, q) in pages.items() if r == rid and q < keep // self.page]:
                del pages[phys]

    def evict_for(self, rid: str, prefix: int, seq: int, granted: bool) -> None:
        self.evict("swa", rid, max(0, prefix - W + 1))
        for pool, ratio in STATE_RATIO.items():
            self.evict(pool, rid, keep_start(ratio, seq if granted else prefix))

    def grant(self, locs: CacheLocs) -> None:
        rid, prefix, seq = locs.rid, locs.prefix_len, locs.seq_len
        assert self.rows.setdefault(rid, locs.row) == locs.row
        self.evict_for(rid, prefix, seq, granted=True)
        for pool in POOL_NAMES:
            lo, hi = index_range(pool, prefix, seq)
            got = list(locs.slots(pool))
            assert len(got) == max(0, hi - lo), (pool, prefix, seq, len(got))
            held = self.slots[pool].setdefault(rid, {})
            for idx, slot in zip(range(lo, hi), got, strict=True):
                if self.paged(pool):
                    self.claim(pool, rid, idx, slot)
                else:
                    ring = ring_size(STATE_RATIO[pool])
                    assert slot == locs.row * ring + idx % ring
                assert idx not in held
                held[idx] = slot

    def claim(self, pool: str, rid: str, idx: int, slot: int) -> None:
        assert slot % self.page == idx % self.page
        phys = slot // self.page
        assert phys != 0, "sentinel page handed out"
        # one owner (rid, logical page) per physical page + offset = idx % P: no slot is owned twice
        assert self.owner[pool].setdefault(phys, (rid, idx // self.page)) == (rid, idx // self.page)

    def free(self, rid: str) -> None:
        for pool in POOL_NAMES:
            self.slots[pool].pop(rid, None)
            pages = self.owner[pool]
            for phys in [ph for ph, (r, _) in pages.items() if r == rid]:
                del pages[phys]
        del self.rows[rid]


@dataclass
class Harness:
    alloc: KVAllocator
    shadow: Shadow
    tables: SlotTables
    batch_tables: SlotTables
    sizes: PoolSizes
    page: int
    step: int = 0

    def allocate(self, rid: str, prefix: int, seq: int) -> CacheLocs | Refusal:
        expect_room = self.alloc.room_for(prefix, seq, rid)
        before = self.alloc.usage()
        out = self.alloc.allocate(rid, prefix, seq, self.step)
        assert isinstance(out, CacheLocs) == expect_room
        if isinstance(out, Refusal):
            self.check_refusal(out, prefix, seq, before)
        else:
            self.shadow.grant(out)
            write_cache_locs(self.tables, out)
            if seq == prefix + 1:  # decode: a compressed slot only when a window closes
                assert out.count("c4") == (seq % 4 == 0) and out.count("c128") == (seq % R == 0)
        self.check()
        return out

    def check_refusal(self, out: Refusal, prefix: int, seq: int, before: dict) -> None:
        assert self.alloc.length_of(out.rid) == prefix if self.alloc.holds(out.rid) else prefix == 0
        event(f"refusal {out.reason} {out.pool}")
        if out.reason == "too_long":
            assert seq > MAX_LEN
        elif out.reason == "no_row":
            assert not self.alloc.holds(out.rid) and self.alloc.num_free_rows == 0
        else:
            assert out.reason == "no_room" and out.needed_slots > out.free_slots
        if self.alloc.holds(out.rid):
            self.shadow.evict_for(out.rid, prefix, seq, granted=False)
        now = self.alloc.usage()
        assert all(now[p].used <= before[p].used for p in POOL_NAMES), "a refusal allocated"

    def free(self, rid: str) -> None:
        self.alloc.free(rid)
        self.shadow.free(rid)
        self.check()

    def check(self) -> None:
        self.alloc.assert_consistent()
        usage = self.alloc.usage()
        live = len(self.shadow.rows)
        for pool in POOL_NAMES:
            u = usage[pool]
            assert 0 <= u.used <= u.capacity and u.free + u.used == u.capacity
            if self.shadow.paged(pool):
                assert u.used == len(self.shadow.owner[pool]) * self.page, pool
                assert u.capacity == self.sizes.pages(pool) * self.page
            else:
                ring = ring_size(STATE_RATIO[pool])
                assert (u.used, u.capacity) == (live * ring, self.alloc.max_num_seqs * ring)
        assert len(set(self.shadow.rows.values())) == live
        assert self.alloc.num_free_rows == self.alloc.max_num_seqs - live

    def check_tables(self) -> None:
        for rid, row in self.shadow.rows.items():
            for pool in POOL_NAMES:
                held = self.shadow.slots[pool].get(rid, {})
                if not held:
                    continue
                cols = torch.tensor(list(held), dtype=torch.int64)
                want = torch.tensor(list(held.values()), dtype=torch.int32)
                assert torch.equal(self.tables.table(pool)[row, cols], want), (pool, rid)
        for pool in POOL_NAMES:
            assert torch.equal(self.tables.table(pool), self.batch_tables.table(pool)), pool


def pool_sizes(page: int) -> st.SearchStrategy[PoolSizes]:
    small = st.integers(1, 8)
    return st.builds(
        PoolSizes,
        full=st.integers(2, 2 * MAX_LEN // page),
        swa=st.integers(2, 24),
        c4=st.integers(1, 12),
        c128=st.integers(1, 4),
        c4_state=small,
        c128_state=small,
    )


PROMPT_LENS = st.one_of(st.integers(1, 40), st.integers(MAX_LEN - 40, MAX_LEN + 20))


@dataclass
class Request:
    rid: str
    prompt: int


def run_scenario(data: st.DataObject, h: Harness, num_ops: int) -> None:
    live: dict[str, Request] = {}
    waiting: list[Request] = []
    counter = 0
    for _ in range(num_ops):
        h.step += 1
        op = data.draw(st.sampled_from(["admit", "admit", "chunk", "decode", "decode", "preempt", "end"]))
        if op == "admit":
            if bool(waiting) and data.draw(st.booleans()):
                req = waiting.pop(0)  # a preempted request starts again from 0
            else:
                counter += 1
                req = Request(f"r{counter}", data.draw(PROMPT_LENS))
            extend(data, h, req, live, waiting)
        elif op == "chunk" and (
            prefilling := [r for r in live.values() if h.alloc.length_of(r.rid) < r.prompt]
        ):
            extend(data, h, data.draw(st.sampled_from(prefilling)), live, waiting)
        elif op == "decode":
            decode(h, live, waiting)
        elif op in ("preempt", "end") and live:
            req = live.pop(data.draw(st.sampled_from(sorted(live))))
            length = h.alloc.length_of(req.rid)
            h.free(req.rid)
            if op == "preempt":  # recomputed later from 0, prompt and generated tokens alike
                waiting.append(Request(req.rid, max(req.prompt, length)))
    h.check_tables()
    for rid in list(live):
        h.free(rid)
    assert all(u.used == 0 for u in h.alloc.usage().values()), "pools not fully free at the end"
    assert h.alloc.num_free_rows == h.alloc.max_num_seqs


def extend(data: st.DataObject, h: Harness, req: Request, live: dict, waiting: list) -> None:
    prefix = h.alloc.length_of(req.rid) if h.alloc.holds(req.rid) else 0
    seq = min(req.prompt, prefix + data.draw(st.integers(1, 96)))
    out = h.allocate(req.rid, prefix, seq)
    if isinstance(out, CacheLocs):
        write_cache_locs_batch(h.batch_tables, [out])
        live[req.rid] = req
    elif h.alloc.holds(req.rid) and (out.reason == "too_long" or data.draw(st.booleans())):
        live.pop(req.rid)
        h.free(req.rid)
        if out.reason != "too_long":
            waiting.append(req)


def decode(h: Harness, live: dict[str, Request], waiting: list[Request]) -> None:
    batch = []
    for req in [r for r in live.values() if h.alloc.length_of(r.rid) >= r.prompt]:
        prefix = h.alloc.length_of(req.rid)
        out = h.allocate(req.rid, prefix, prefix + 1)
        if isinstance(out, CacheLocs):
            batch.append(out)
            continue
        live.pop(req.rid)
        h.free(req.rid)  # preempt, or finish when too long
        if out.reason != "too_long":
            waiting.append(req)
    write_cache_locs_batch(h.batch_tables, batch)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), mode=st.sampled_from(["paged", "ring"]), page=st.sampled_from([4, 8, 16]))
def test_random_interleavings_keep_every_invariant(data: st.DataObject, mode: str, page: int) -> None:
    engine = EngineConfig(
        page_size=page,
        max_num_seqs=data.draw(st.integers(2, 4)),
        max_total_tokens=MAX_LEN,
        max_num_batched_tokens=64,
        state_mode=mode,
    )
    sizes = data.draw(pool_sizes(page))
    h = Harness(
        alloc=KVAllocator(TINY, engine, sizes),
        shadow=Shadow(page=page, ring=mode == "ring"),
        tables=SlotTables(TINY, engine, "cpu"),
        batch_tables=SlotTables(TINY, engine, "cpu"),
        sizes=sizes,
        page=page,
    )
    run_scenario(data, h, data.draw(st.integers(5, 50)))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), mode=st.sampled_from(["paged", "ring"]), page=st.sampled_from([4, 8, 16]))
def test_default_sizes_fit_max_num_seqs_running_requests(data: st.DataObject, mode: str, page: int) -> None:
    """PoolSizes.for_engine: max_num_seqs requests, each stepped every step within the token budget
    and finished at its target length, are never refused."""
    seqs, budget = 3, 16
    engine = EngineConfig(
        page_size=page,
        max_num_seqs=seqs,
        max_total_tokens=4 * MAX_LEN,
        max_num_batched_tokens=budget,
        max_model_len=MAX_LEN,
        state_mode=mode,
    )
    alloc = KVAllocator(TINY, engine)
    targets = {f"r{i}": data.draw(st.integers(1, MAX_LEN)) for i in range(seqs)}
    lengths = dict.fromkeys(targets, 0)
    while lengths:
        for rid, n in list(lengths.items()):
            seq = min(targets[rid], n + data.draw(st.integers(1, budget // seqs)))
            out = alloc.allocate(rid, n, seq, 0)
            assert isinstance(out, CacheLocs), out
            lengths[rid] = seq
            if seq == targets[rid]:
                alloc.free(rid)
                del lengths[rid]
        alloc.assert_consistent()
    assert all(u.used == 0 for u in alloc.usage().values())
