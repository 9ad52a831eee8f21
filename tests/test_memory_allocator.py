"""KVAllocator unit tests: slot-message formulas, eviction, refusals, rows, ring mode, pool sizes."""

from __future__ import annotations

import pytest
from memory_fixtures import TINY, P, tiny_engine, tiny_model_dict

from dsv4serve.config import EngineConfig
from dsv4serve.memory import KVAllocator, PoolSizes, PoolUsage, Refusal, keep_start, ring_slots
from dsv4serve.memory.sizing import engine_pool_sizes
from dsv4serve.models.deepseek_v4.config import DeepseekV4Config
from dsv4serve.models.registry import config_from_json_file
from dsv4serve.protocol import CacheLocs

ENGINE = tiny_engine(max_num_seqs=4, max_total_tokens=256)


def granted(out: CacheLocs | Refusal) -> CacheLocs:
    assert isinstance(out, CacheLocs), out
    return out


def used(alloc: KVAllocator) -> dict[str, int]:
    return {name: u.used for name, u in alloc.usage().items()}


def test_keep_start() -> None:
    assert [keep_start(4, n) for n in (0, 3, 4, 7, 8, 9, 12)] == [0, 0, 0, 0, 4, 4, 8]
    assert [keep_start(16, n) for n in (0, 15, 16, 17, 40)] == [0, 0, 16, 16, 32]


def test_fresh_extend_gets_the_formula_ranges() -> None:
    alloc = KVAllocator(TINY, ENGINE)
    locs = granted(alloc.allocate("a", 0, 37, step=3))
    assert (locs.step, locs.rid, locs.row, locs.prefix_len, locs.seq_len) == (3, "a", 0, 0, 37)
    assert list(locs.slots("full")) == list(range(4, 41))  # pages 1.. in order; slot % P == pos % P
    assert locs.count("swa") == 37
    assert locs.count("c4") == 37 // 4 and locs.count("c128") == 37 // 16
    # state: raw positions [keep_start(r, 37), 37) = [32, 37) for both ratios
    assert [s % P for s in locs.slots("c4_state")] == [p % P for p in range(32, 37)]
    assert locs.count("c4_state") == 5 and locs.count("c128_state") == 5
    assert used(alloc) == {"full": 40, "swa": 40, "c4": 12, "c128": 4, "c4_state": 8, "c128_state": 8}


def test_decode_gets_compressed_slots_only_when_a_window_closes() -> None:
    alloc = KVAllocator(TINY, ENGINE)
    granted(alloc.allocate("a", 0, 5, 0))
    for seq in range(6, 70):
        locs = granted(alloc.allocate("a", seq - 1, seq, seq))
        assert locs.count("full") == locs.count("swa") == 1
        assert locs.count("c4") == (seq % 4 == 0) and locs.count("c128") == (seq % 16 == 0)
        assert locs.count("c4_state") == 1
        assert locs.count("c128_state") == (seq % 16 != 0)  # a closing token's row is never stored
        assert alloc.length_of("a") == seq


def test_swa_and_state_eviction_keep_only_the_windows() -> None:
    alloc = KVAllocator(TINY, ENGINE)
    granted(alloc.allocate("a", 0, 37, 0))
    granted(alloc.allocate("a", 37, 38, 1))
    u = used(alloc)
    assert u["swa"] == 3 * P  # positions >= 37 - 8 + 1 = 30 live: pages [28, 40)
    assert u["c4_state"] == 2 * P  # keep_start(4, 38) = 32: pages [32, 40)
    assert u["full"] == 40 and u["c4"] == 12  # never evicted before free
    granted(alloc.allocate("a", 38, 41, 2))  # keep_start(4, 41) = 36, keep_start(16, 41) = 32
    u = used(alloc)
    assert u["c4_state"] == 2 * P and u["c128_state"] == 3 * P


def test_refusal_is_atomic_and_names_the_pool() -> None:
    sizes = PoolSizes(full=64, swa=64, c4=2, c128=8, c4_state=8, c128_state=8)
    alloc = KVAllocator(TINY, ENGINE, sizes)
    granted(alloc.allocate("a", 0, 20, 0))  # c4 indices [0, 5): 2 pages
    before, rows = used(alloc), alloc.num_free_rows
    assert not alloc.room_for(0, 4, "b")
    out = alloc.allocate("b", 0, 4, 1)
    assert out == Refusal("b", "c4", needed_slots=P, free_slots=0, reason="no_room")
    assert used(alloc) == before and alloc.num_free_rows == rows and not alloc.holds("b")
    assert alloc.room_for(0, 3, "b") and isinstance(alloc.allocate("b", 0, 3, 1), CacheLocs)
    alloc.assert_consistent()


def test_refusal_of_a_held_request_frees_only_dead_slots() -> None:
    sizes = PoolSizes(full=64, swa=64, c4=64, c128=1, c4_state=8, c128_state=8)
    alloc = KVAllocator(TINY, ENGINE, sizes)
    granted(alloc.allocate("a", 0, 10, 0))
    granted(alloc.allocate("a", 10, 14, 1))
    granted(alloc.allocate("a", 14, 40, 2))  # c128 indices [0, 2): the only c128 page
    out = alloc.allocate("a", 40, 80, 3)  # c128 indices [2, 5) need a second page
    assert out == Refusal("a", "c128", needed_slots=P, free_slots=0, reason="no_room")
    assert alloc.length_of("a") == 40
    u = used(alloc)
    assert u["swa"] == 2 * P  # positions < 40 - 8 + 1 = 33 are dead: pages [32, 40) stay
    # state below keep_start(r, 40) is dead; keep_start(r, 80) would have freed the rest
    assert u["c4_state"] == 1 * P  # [36, 40)
    assert u["c128_state"] == 2 * P  # [32, 40)
    alloc.assert_consistent()


def test_too_long_and_no_row() -> None:
    alloc = KVAllocator(TINY, ENGINE.with_(max_num_seqs=2, max_total_tokens=512, max_model_len=256))
    assert alloc.max_model_len == 256
    out = alloc.allocate("a", 0, 257, 0)
    assert isinstance(out, Refusal) and out.reason == "too_long" and not alloc.holds("a")
    for start in range(0, 256, 64):  # chunks of the step budget
        granted(alloc.allocate("a", start, start + 64, 0))
    assert alloc.allocate("a", 256, 257, 1) == Refusal("a", "full", 257, 256, "too_long")
    granted(alloc.allocate("b", 0, 1, 0))
    assert not alloc.room_for(0, 1)
    assert alloc.allocate("c", 0, 1, 0) == Refusal("c", "row", 1, 0, "no_row")


def test_rows_are_lowest_free_and_free_returns_everything_once() -> None:
    alloc = KVAllocator(TINY, ENGINE)
    for rid in "abc":
        granted(alloc.allocate(rid, 0, 9, 0))
    assert [alloc.row_of(rid) for rid in "abc"] == [0, 1, 2]
    alloc.free("b")
    assert granted(alloc.allocate("d", 0, 1, 1)).row == 1
    for rid in "acd":
        alloc.free(rid)
    assert all(u.used == 0 for u in alloc.usage().values()) and alloc.num_free_rows == 4
    with pytest.raises(KeyError):
        alloc.free("a")
    with pytest.raises(KeyError):
        alloc.free("never")
    alloc.assert_consistent()


def test_prefix_must_match_what_the_request_holds() -> None:
    alloc = KVAllocator(TINY, ENGINE)
    with pytest.raises(AssertionError):
        alloc.allocate("a", 3, 5, 0)
    granted(alloc.allocate("a", 0, 5, 0))
    with pytest.raises(AssertionError):
        alloc.allocate("a", 4, 6, 1)


def test_ring_mode_slot_formula_and_usage() -> None:
    engine = ENGINE.with_(state_mode="ring")
    alloc = KVAllocator(TINY, engine)
    granted(alloc.allocate("a", 0, 3, 0))
    locs = granted(alloc.allocate("b", 0, 21, 0))  # row 1
    assert list(locs.slots("c4_state")) == [8 + p % 8 for p in range(16, 21)]
    assert list(locs.slots("c128_state")) == [16 + p % 16 for p in range(16, 21)]
    locs = granted(alloc.allocate("b", 21, 30, 1))  # c4: [max(21, 24), 30) wraps the ring
    assert list(locs.slots("c4_state")) == [8 + p % 8 for p in range(24, 30)]
    assert alloc.usage()["c4_state"] == PoolUsage(used=2 * 8, capacity=4 * 8)
    assert alloc.usage()["c128_state"] == PoolUsage(used=2 * 16, capacity=4 * 16)
    assert list(ring_slots(3, 8, 6, 10)) == [30, 31, 24, 25]
    alloc.free("a")
    alloc.free("b")
    assert all(u.used == 0 for u in alloc.usage().values())


def test_pool_sizes_for_the_tiny_engine() -> None:
    # W = 8, P = 4: swa = min(64, 4 * (ceil(7/4) + 2) + ceil(64/4)) = 32
    assert engine_pool_sizes(TINY, ENGINE) == PoolSizes(
        full=64, swa=32, c4=16 + 4, c128=4 + 4, c4_state=3 * 4, c128_state=9 * 4
    )
    ring = engine_pool_sizes(TINY, ENGINE.with_(state_mode="ring"))
    assert (ring.c4_state, ring.c128_state) == (5 * 8 // P, 5 * 16 // P)


def test_pools_for_missing_ratios_stay_empty() -> None:
    model = DeepseekV4Config.from_dict({**tiny_model_dict(), "compress_ratios": [0, 0, 16, 16]})
    for mode in ("paged", "ring"):
        alloc = KVAllocator(model, ENGINE.with_(state_mode=mode))
        locs = granted(alloc.allocate("a", 0, 40, 0))
        assert locs.pools == ("full", "swa", "c128", "c128_state") and locs.count("c128") == 2
        assert set(alloc.usage()) == set(locs.pools)


def test_flash_state_pool_sizes() -> None:
    flash = config_from_json_file("deepseek-v4-flash")  # the official config, shipped in the package
    engine = EngineConfig(page_size=128, max_num_seqs=64, max_total_tokens=1 << 20)
    sizes = engine_pool_sizes(flash, engine)
    assert (sizes.c4_state * 128, sizes.c128_state * 128) == (16384, 24576)
    usage = KVAllocator(flash, engine, sizes).usage()
    assert (usage["c4_state"].capacity, usage["c128_state"].capacity) == (16384, 24576)
    assert usage["swa"].capacity == (64 * 3 + 16) * 128  # ceil(127/128) + 2 per seq, 2048/128 a step
    assert usage["c128"].capacity == ((1 << 20) // 128 // 128 + 64) * 128
