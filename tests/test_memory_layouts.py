"""A third, made-up KV layout through the memory layer as it is: sizes, allocator, KV writer, tables.

Pool names nobody else uses, two raw pools (one windowed), a compressed pool and a state pool. The
shadow keeps, from the slot messages and the layout's contract alone, every (request, index) whose slot
must still be live; a slot granted again while its owner is live, a leak, or a table entry that
differs from the slot the message gave fails the test.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import torch
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4serve.actors.kv_writer import run_kv_writer
from dsv4serve.config import EngineConfig
from dsv4serve.memory import KVAllocator, PoolSizes, Refusal, SlotTables, keep_start, write_cache_locs
from dsv4serve.memory.buffers import LayoutBuffers
from dsv4serve.memory.layout import BufferSpec, KVLayout, PoolSpec
from dsv4serve.memory.paged import ring_size
from dsv4serve.memory.sizing import GIB, engine_pool_sizes, plan_kv
from dsv4serve.memory.tables import write_cache_locs_batch
from dsv4serve.protocol import CacheLocs, Drain, ExecutorMsg, KVWriterMsg, StepPlan, TablesReady, WriteLocs

WINDOW, RATIO, STATE_RATIO, MAX_LEN = 6, 3, 8, 160


@dataclass(frozen=True)
class ToyConfig:
    """A model family the memory layer has never heard of (what `ServedModelConfig` asks, no more)."""

    model_type: str = "toy"
    vocab_size: int = 50
    num_layers: int = 3
    max_position_embeddings: int = 512
    eos_token_ids: tuple[int, ...] = (0,)
    torch_dtype: str = "float32"

    @property
    def kv_layout(self) -> KVLayout:
        every = tuple(range(self.num_layers))
        carry = BufferSpec("carry_rows", 6, (2,), dtype="float32")
        return KVLayout(
            (
                PoolSpec("tok", "raw", buffers=(BufferSpec("tok_kv", 8, every),)),
                PoolSpec("recent", "raw", window=WINDOW, buffers=(BufferSpec("recent_kv", 4, every),)),
                PoolSpec("gist", "compressed", RATIO, buffers=(BufferSpec("gist_kv", 4, (1, 2)),)),
                PoolSpec("carry", "state", STATE_RATIO, buffers=(carry,)),
            )
        )


TOY = ToyConfig()
LAYOUT = TOY.kv_layout
SPECS = {p.name: p for p in LAYOUT.pools}


def new_indices(pool: PoolSpec, prefix: int, seq: int) -> range:
    """The logical indices a step prefix -> seq adds to `pool` (the allocator's contract)."""
    if pool.index == "raw":
        return range(prefix, seq)
    if pool.index == "compressed":
        return range(prefix // pool.ratio, seq // pool.ratio)
    return range(max(prefix, keep_start(pool.ratio, seq)), seq)


def must_keep(pool: PoolSpec, prefix: int, seq: int) -> int:
    """Indices below this may have been freed once a step prefix -> seq is decided (seq = prefix if
    it was refused): a window's positions no query of the step sees, a state pool's closed windows."""
    if pool.index == "raw" and pool.window:
        return max(0, prefix - pool.window + 1)
    if pool.index == "state":
        return keep_start(pool.ratio, seq)
    return 0


@dataclass
class Shadow:
    page: int
    ring: bool
    live: dict[str, dict[tuple[str, int], int]] = field(default_factory=dict)  # pool -> (rid, idx) -> slot
    rows: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.live = {name: {} for name in LAYOUT.names}

    def forget_below(self, rid: str, prefix: int, seq: int) -> None:
        for name, held in self.live.items():
            keep = must_keep(SPECS[name], prefix, seq)
            for key in [k for k in held if k[0] == rid and k[1] < keep]:
                del held[key]

    def grant(self, locs: CacheLocs) -> None:
        assert locs.pools == LAYOUT.names  # every pool, in layout order, on every step
        assert self.rows.setdefault(locs.rid, locs.row) == locs.row
        self.forget_below(locs.rid, locs.prefix_len, locs.seq_len)
        for name, held in self.live.items():
            indices, got = new_indices(SPECS[name], locs.prefix_len, locs.seq_len), locs.slots(name)
            assert len(got) == len(indices), (name, locs)
            owners = {slot: key for key, slot in held.items()}
            for idx, slot in zip(indices, got, strict=True):
                assert slot not in owners, f"{name}: slot {slot} granted to {locs.rid} is {owners[slot]}'s"
                if self.ring and SPECS[name].index == "state":
                    ring = ring_size(STATE_RATIO)
                    assert slot == locs.row * ring + idx % ring
                else:
                    assert slot // self.page != 0 and slot % self.page == idx % self.page, (name, slot, idx)
                owners[slot] = (locs.rid, idx)
                held[(locs.rid, idx)] = slot

    def free(self, rid: str) -> None:
        for held in self.live.values():
            for key in [k for k in held if k[0] == rid]:
                del held[key]
        del self.rows[rid]


def write_through_the_kv_writer(tables: SlotTables, steps: Sequence[tuple[CacheLocs, ...]]) -> None:
    """Each step's slot messages through the kv_writer actor, whose write is the system's."""

    async def main() -> None:
        to_writer, writer_inbox = trio.open_memory_channel[KVWriterMsg](len(steps) + 1)
        to_executor, executor_inbox = trio.open_memory_channel[ExecutorMsg](len(steps) + 1)

        async def write(locs: Sequence[CacheLocs]) -> None:
            write_cache_locs_batch(tables, locs)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_kv_writer, writer_inbox, to_executor, write)
            for step, locs in enumerate(steps):
                # the msgpack round trip: the slot message is plain data whatever the layout
                wire = msgspec.msgpack.decode(msgspec.msgpack.encode(locs), type=tuple[CacheLocs, ...])
                await to_writer.send(WriteLocs(step=step, plan=StepPlan(step=step, items=()), locs=wire))
            await to_writer.send(Drain())
            for step in range(len(steps)):
                ready = await executor_inbox.receive()
                assert isinstance(ready, TablesReady) and ready.step == step and ready.error is None
            assert isinstance(await executor_inbox.receive(), Drain)

    trio.run(main)


@dataclass
class Run:
    alloc: KVAllocator
    shadow: Shadow
    tables: SlotTables  # written one message at a time
    steps: list[tuple[CacheLocs, ...]] = field(default_factory=list)
    lengths: dict[str, int] = field(default_factory=dict)

    def step(self, batch: list[tuple[str, int]]) -> None:
        granted = []
        for rid, seq in batch:
            prefix = self.lengths.get(rid, 0)
            out = self.alloc.allocate(rid, prefix, seq, len(self.steps))
            if isinstance(out, Refusal):
                assert out.reason in ("no_room", "no_row", "too_long"), out
                if out.reason == "no_room":
                    assert out.pool in LAYOUT.names and out.needed_slots > out.free_slots
                if self.alloc.holds(rid):
                    self.shadow.forget_below(rid, prefix, prefix)
                continue
            self.shadow.grant(out)
            write_cache_locs(self.tables, out)
            self.lengths[rid] = seq
            granted.append(out)
        self.steps.append(tuple(granted))
        self.check()

    def free(self, rid: str) -> None:
        self.alloc.free(rid)
        self.shadow.free(rid)
        del self.lengths[rid]
        self.check()

    def check(self) -> None:
        self.alloc.assert_consistent()
        usage = self.alloc.usage()
        assert tuple(usage) == LAYOUT.names
        for name, u in usage.items():
            assert 0 <= u.used <= u.capacity and u.free + u.used == u.capacity
            live = self.shadow.live[name]
            assert u.used >= len(live), name  # every live slot is in use
            if SPECS[name].index in ("raw", "compressed") and not SPECS[name].window:
                pages = {(rid, idx // self.shadow.page) for rid, idx in live}
                assert u.used == len(pages) * self.shadow.page, name  # nothing beyond the live pages

    def check_tables(self, tables: SlotTables) -> None:
        for name, held in self.shadow.live.items():
            for (rid, idx), slot in held.items():
                assert tables.table(name)[self.shadow.rows[rid], idx].item() == slot, (name, rid, idx)


def random_sizes(page: int) -> st.SearchStrategy[PoolSizes]:
    return st.builds(
        PoolSizes,
        tok=st.integers(2, 2 * MAX_LEN // page),
        recent=st.integers(2, 12),
        gist=st.integers(1, 8),
        carry=st.integers(1, 8),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), mode=st.sampled_from(["paged", "ring"]), page=st.sampled_from([4, 8]))
def test_a_third_layout_keeps_every_invariant(data: st.DataObject, mode: str, page: int) -> None:
    engine = EngineConfig(
        page_size=page,
        max_num_seqs=data.draw(st.integers(1, 4)),
        max_total_tokens=MAX_LEN,
        max_num_batched_tokens=64,
        state_mode=mode,
    )
    sizes = engine_pool_sizes(TOY, engine) if data.draw(st.booleans()) else data.draw(random_sizes(page))
    if mode == "ring":  # storage for every ring and the sentinel bank
        sizes = sizes.with_(carry=-(-(engine.max_num_seqs + 1) * ring_size(STATE_RATIO) // page))
    run = Run(KVAllocator(TOY, engine, sizes), Shadow(page, mode == "ring"), SlotTables(TOY, engine, "cpu"))
    counter = 0
    for _ in range(data.draw(st.integers(3, 40))):
        op = data.draw(st.sampled_from(["admit", "extend", "decode", "decode", "free"]))
        held = sorted(run.lengths)
        if op == "admit":
            counter += 1
            run.step([(f"q{counter}", data.draw(st.integers(1, 70)))])
        elif op == "extend" and held:
            rid = data.draw(st.sampled_from(held))
            run.step([(rid, run.lengths[rid] + data.draw(st.integers(1, 40)))])
        elif op == "decode" and held:
            run.step([(rid, run.lengths[rid] + 1) for rid in held])
        elif op == "free" and held:
            run.free(data.draw(st.sampled_from(held)))
    run.check_tables(run.tables)
    through_writer = SlotTables(TOY, engine, "cpu")
    write_through_the_kv_writer(through_writer, run.steps)
    run.check_tables(through_writer)
    assert torch.equal(through_writer.flat, run.tables.flat)
    for rid in sorted(run.lengths):
        run.free(rid)
    assert all(u.used == 0 for u in run.alloc.usage().values()), "pools not fully free at the end"
    assert run.alloc.num_free_rows == engine.max_num_seqs


def test_the_third_layout_is_sized_and_buffered_from_its_specs() -> None:
    engine = EngineConfig(page_size=4, max_num_seqs=2, max_total_tokens=96, max_num_batched_tokens=16)
    sizes = engine_pool_sizes(TOY, engine)
    # tok: 96 / 4; recent: 2 windows of ceil(5/4) + 1 pages + the step's 16 / 4 + 2; gist: 96 / 3 / 4 + 2;
    # carry: npu_state_pool_size(8, 4, 2) / 4 = max(2, ceil(14.4 / 4) + 1) * 2
    assert sizes == PoolSizes(tok=24, recent=2 * 3 + 4 + 2, gist=8 + 2, carry=5 * 2)
    tables = SlotTables(TOY, engine, "cpu")
    assert {n: tuple(tables.table(n).shape) for n in LAYOUT.names} == {
        "tok": (3, 96),
        "recent": (3, 96),
        "gist": (3, 96 // 3 + 1),
        "carry": (3, 96),
    }
    ring = engine.with_(state_mode="ring")
    for eng, sentinel in ((engine, 0), (ring, 2 * ring_size(STATE_RATIO))):
        buffers = LayoutBuffers(LAYOUT, engine_pool_sizes(TOY, eng), eng)
        assert buffers.state_sentinel == {"carry": sentinel}
        assert sorted(buffers.buffers["gist_kv"]) == [1, 2] and sorted(buffers.buffers["carry_rows"]) == [2]
        assert buffers.buffers["carry_rows"][2].dtype == torch.float32
    plan = plan_kv(
        LAYOUT, kv_bytes=4, page_size=4, max_running=2, budget_bytes=GIB, weight_bytes=400, max_position=512
    )
    per_slot = dict(plan.bytes_per_slot)
    assert per_slot == {"tok": 3 * 8 * 4, "recent": 3 * 4 * 4, "gist": 2 * 4 * 4, "carry": 6 * 4}
    assert plan.kv_bytes_per_token == 96 + 32 / 3
    assert dict(plan.slots_per_request) == {"recent": 3 * 4, "carry": 5 * 4}
    assert plan.bytes_per_request == 12 * 48 + 20 * 24
    # capped at R * max positions, in whole units of P * 3 (every pool holds whole pages)
    assert plan.full_slots == 2 * 512 // 12 * 12 and plan.fixed_bytes == 400 + 2 * plan.bytes_per_request
