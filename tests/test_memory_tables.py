"""SlotTables / write_cache_locs and the layout's device buffers."""

from __future__ import annotations

import math

import pytest
import torch
from memory_fixtures import TINY, P, tiny_engine

from dsv4serve.memory import (
    KVAllocator,
    LayoutBuffers,
    SlotTables,
    block_table,
    write_cache_locs,
    write_cache_locs_batch,
)
from dsv4serve.memory.sizing import engine_pool_sizes
from dsv4serve.protocol import CacheLocs, pack_slots

ENGINE = tiny_engine(max_num_seqs=3, max_total_tokens=200)
POOL_NAMES = TINY.kv_layout.names  # full, swa, c4, c128, c4_state, c128_state


def test_table_shapes_and_zero_init() -> None:
    tables = SlotTables(TINY, ENGINE, "cpu")
    shapes = {name: tuple(tables.table(name).shape) for name in POOL_NAMES}
    assert shapes == {  # one row per request, plus the pad row
        "full": (4, 200),
        "swa": (4, 200),
        "c4": (4, 51),
        "c128": (4, 13),
        "c4_state": (4, 200),
        "c128_state": (4, 200),
    }
    assert tables.pad_row == 3
    assert all(tables.table(n).dtype == torch.int32 and not tables.table(n).any() for n in POOL_NAMES)
    tables.point_pad_row_at({"c4_state": 7, "c128_state": 9})
    assert (
        (tables.table("c4_state")[3] == 7).all()
        and (tables.table("c128_state")[3] == 9).all()
        and not tables.table("c4_state")[:3].any()
    )


def test_write_cache_locs_puts_each_field_at_its_index_range() -> None:
    tables = SlotTables(TINY, ENGINE, "cpu")
    locs = CacheLocs(
        step=0,
        rid="a",
        row=2,
        prefix_len=30,
        seq_len=34,
        pools=POOL_NAMES,
        packed=(
            pack_slots([5, 6, 7, 8]),  # full
            pack_slots([9, 10, 11, 12]),  # swa
            pack_slots([40]),  # c4: compressed index 33 // 4 - 1 = 7
            b"",  # c128
            pack_slots([70, 71]),  # c4_state: raw positions [32, 34)
            pack_slots([99]),  # c128_state: raw position 33
        ),
    )
    write_cache_locs(tables, locs)
    assert (
        tables.table("full")[2, 30:34].tolist() == [5, 6, 7, 8]
        and tables.table("full")[2].count_nonzero() == 4
    )
    assert tables.table("swa")[2, 30:34].tolist() == [9, 10, 11, 12]
    assert tables.table("c4")[2, 7].item() == 40 and tables.table("c4").count_nonzero() == 1
    assert not tables.table("c128").any()
    assert (
        tables.table("c4_state")[2, 32:34].tolist() == [70, 71]
        and tables.table("c4_state").count_nonzero() == 2
    )
    assert tables.table("c128_state")[2, 33].item() == 99 and tables.table("c128_state").count_nonzero() == 1
    assert not tables.table("full")[:2].any()


@pytest.mark.parametrize("mode", ["paged", "ring"])
def test_tables_from_the_allocator_give_block_tables(mode: str) -> None:
    engine = ENGINE.with_(state_mode=mode)
    alloc = KVAllocator(TINY, engine)
    one, many = SlotTables(TINY, engine, "cpu"), SlotTables(TINY, engine, "cpu")
    steps = [[("a", 0, 23), ("b", 0, 9)], [("a", 23, 24), ("b", 9, 40)], [("a", 24, 25), ("b", 40, 41)]]
    for step, batch in enumerate(steps):
        got = [alloc.allocate(rid, prefix, seq, step) for rid, prefix, seq in batch]
        granted = [locs for locs in got if isinstance(locs, CacheLocs)]
        assert len(granted) == len(got)
        for locs in granted:
            write_cache_locs(one, locs)
        write_cache_locs_batch(many, granted)
    for name in POOL_NAMES:
        assert torch.equal(one.table(name), many.table(name)), name
    row = alloc.row_of("b")
    full = one.table("full")[row, :41]
    assert torch.equal(full % P, torch.arange(41, dtype=torch.int32) % P)
    pages = block_table(one.table("full"), P)[row, : math.ceil(41 / P)]
    assert torch.equal(pages.repeat_interleave(P)[:41] * P + torch.arange(41) % P, full)
    assert pages.unique().numel() == pages.numel() and (pages > 0).all()
    one.clear_row(row)
    assert not any(one.table(name)[row].any() for name in POOL_NAMES)


@pytest.mark.parametrize("mode", ["paged", "ring"])
def test_dsv4_buffers_shapes_and_sentinel(mode: str) -> None:
    engine = ENGINE.with_(state_mode=mode, dtype="bfloat16")
    sizes = engine_pool_sizes(TINY, engine)
    pools = LayoutBuffers(TINY.kv_layout, sizes, engine)
    b = pools.buffers
    assert sorted(b["swa"]) == [0, 1, 2, 3] and b["swa"][0].shape == (sizes.swa + 1, P, 1, 32)
    assert b["swa"][0].dtype == torch.bfloat16
    assert sorted(b["c4"]) == [1, 3] and b["c4"][1].shape == (sizes.c4 + 1, P, 1, 32)
    assert b["c4_index"][3].shape == (sizes.c4 + 1, P, 1, 16)
    assert sorted(b["c128"]) == [2] and b["c128"][2].shape == (sizes.c128 + 1, P, 1, 32)
    c4s, c4i, c128s = b["c4_state"][1], b["c4_index_state"][1], b["c128_state"][2]
    assert c4s.shape == (sizes.c4_state + 1, P, 1, 128) and c4s.dtype == torch.float32
    assert c4i.shape == (sizes.c4_state + 1, P, 1, 64)
    assert c128s.shape == (sizes.c128_state + 1, P, 1, 64)
    ring = mode == "ring"
    assert pools.state_sentinel == {"c4_state": 3 * 8 if ring else 0, "c128_state": 3 * 16 if ring else 0}
    assert pools.flat("c4_state")[1].shape == ((sizes.c4_state + 1) * P, 128)
    assert pools.flat("c4_state")[1].shape[0] > pools.state_sentinel["c4_state"] + 7  # the sentinel bank fits
    nbytes = pools.nbytes()
    assert nbytes["swa"] == 4 * (sizes.swa + 1) * P * 32 * 2
    assert nbytes["c4_state"] == 2 * (sizes.c4_state + 1) * P * 128 * 4
    assert set(nbytes) == {"swa", "c4", "c4_index", "c128", "c4_state", "c4_index_state", "c128_state"}
