"""Random ragged steps for kernel-vs-reference tests: real allocator, tables and pools, tiny dims.

`make_case` allocates each request's cached prefix in earlier steps (in chunks, so SWA and state
pages are evicted and tables hold stale entries) and then this step's tokens, and fills the pools
with random values. With `poison`, every row no reference read needs holds NaN (and +-inf), so a
kernel that lets a masked or padded row reach its output fails.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dsv4serve.attention.metadata import ForwardBatch
from dsv4serve.attention.rope import RopeTables
from dsv4serve.attention.step import StepMeta, StepTables, prepare_step
from dsv4serve.config import EngineConfig
from dsv4serve.executor.inputs import forward_batch
from dsv4serve.memory.allocator import KVAllocator, Refusal
from dsv4serve.memory.buffers import LayoutBuffers
from dsv4serve.memory.sizing import engine_pool_sizes
from dsv4serve.memory.tables import SlotTables, write_cache_locs_batch
from dsv4serve.models.deepseek_v4.config import DeepseekV4Config
from dsv4serve.protocol import SamplingParams, StepItem

DEVICE = os.environ.get("DSV4SERVE_TEST_DEVICE", "cpu")  # where the kernels (and their references) run


def on_device(t: torch.Tensor) -> torch.Tensor:
    """A tensor made on the CPU (seeded generators) moved to the test device."""
    return t.to(DEVICE)


def kernel_model(**changes: Any) -> DeepseekV4Config:
    raw: dict[str, Any] = {
        "num_hidden_layers": 3,
        "compress_ratios": [0, 4, 16],
        "hidden_size": 48,
        "num_attention_heads": 4,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 24,
        "index_n_heads": 4,
        "index_head_dim": 32,
        "index_topk": 5,
        "sliding_window": 12,
        "vocab_size": 100,
        "max_position_embeddings": 1024,
        **changes,
    }
    return DeepseekV4Config.from_dict(raw)


@dataclass
class Case:
    cfg: DeepseekV4Config
    engine: EngineConfig
    tables: SlotTables
    cache: LayoutBuffers
    batch: ForwardBatch
    ref: StepMeta  # with the reference geometry
    fused: StepMeta  # without
    rope: RopeTables

    def buffer(self, name: str, layer: int) -> torch.Tensor:
        """Layer `layer`'s buffer `name` (c4, c4_index, c128, swa, c4_state, ...) as [slots, width]."""
        return self.cache.flat(name)[layer]

    def step_tables(self) -> StepTables:
        ratios = self.cfg.compress_ratio_set
        return StepTables(
            window=self.tables.table("swa"),
            entries={r: self.tables.table(pool_of(r)) for r in ratios},
            states={r: self.tables.table(f"{pool_of(r)}_state") for r in ratios},
            state_sentinels={r: self.cache.state_sentinel[f"{pool_of(r)}_state"] for r in ratios},
            page_size=self.engine.page_size,
        )


def pool_of(ratio: int) -> str:
    """DeepSeek-V4's compressed pool of a ratio (its state pool: + "_state")."""
    return "c4" if ratio == 4 else "c128"


def make_case(
    seed: int,
    requests: Sequence[tuple[int, int]],
    *,
    page_size: int = 4,
    state_mode: str = "paged",
    dtype: str = "float32",
    poison: bool = False,
    cfg: DeepseekV4Config | None = None,
    pad_windows: bool = False,
) -> Case:
    """requests: (cached prefix, new tokens this step) per request."""
    cfg = cfg or kernel_model()
    rng = random.Random(seed)
    longest = max(p + n for p, n in requests)
    engine = EngineConfig(
        device=DEVICE,
        dtype=dtype,
        page_size=page_size,
        max_num_seqs=len(requests) + 1,
        max_num_batched_tokens=max(64, sum(n for _, n in requests)),
        max_total_tokens=(len(requests) + 2) * (longest + 64),
        state_mode=state_mode,
    )
    sizes = engine_pool_sizes(cfg, engine)
    alloc = KVAllocator(cfg, engine, sizes)
    tables = SlotTables(cfg, engine)
    if rng.random() < 0.5:  # an earlier request leaves stale entries behind in the rows
        _filler(alloc, tables, longest)
    items, step = [], 0
    for i, (prefix, _) in enumerate(requests):
        done = 0
        while done < prefix:  # the cached prefix, in random chunks over earlier steps
            n = min(prefix - done, rng.randint(1, 3 * page_size))
            _alloc(alloc, tables, f"r{i}", done, done + n, step)
            done, step = done + n, step + 1
    for i, (prefix, new) in enumerate(requests):
        locs = _alloc(alloc, tables, f"r{i}", prefix, prefix + new, step)
        ids = tuple(rng.randrange(cfg.vocab_size) for _ in range(new))
        items.append(step_item(locs.row, prefix, ids))
    batch = forward_batch(items, cfg.compress_ratio_set, DEVICE)
    if pad_windows:
        batch = _padded_windows(batch, rng)
    cache = LayoutBuffers(cfg.kv_layout, sizes, engine)
    rope = RopeTables.build(cfg, engine.resolved_max_model_len(cfg) + 1, DEVICE)
    case = Case(cfg, engine, tables, cache, batch, None, None, rope)  # type: ignore[arg-type]
    step_tables = case.step_tables()
    case.ref = prepare_step(batch, step_tables, rope, cfg.sliding_window, with_geometry=True)
    case.fused = prepare_step(batch, step_tables, rope, cfg.sliding_window, with_geometry=False)
    _fill(case, torch.Generator().manual_seed(seed), poison)
    return case


def step_item(row: int, prefix: int, ids: Sequence[int], sample: bool = True) -> StepItem:
    """One request's share of a step (greedy)."""
    return StepItem(
        rid=f"row{row}",
        prefix_len=prefix,
        token_ids=tuple(ids),
        sample=sample,
        sampling=SamplingParams(),
        row=row,
    )


def _alloc(alloc: KVAllocator, tables: SlotTables, rid: str, lo: int, hi: int, step: int) -> Any:
    locs = alloc.allocate(rid, lo, hi, step)
    assert not isinstance(locs, Refusal), locs
    write_cache_locs_batch(tables, [locs])
    return locs


def _filler(alloc: KVAllocator, tables: SlotTables, length: int) -> None:
    _alloc(alloc, tables, "old", 0, length, 0)
    alloc.free("old")


def _padded_windows(batch: ForwardBatch, rng: random.Random) -> ForwardBatch:
    """Window lists with padding entries (index -1) mixed in, as a captured decode step has them."""
    from dsv4serve.attention.metadata import WindowMeta

    windows = {}
    for r, win in batch.windows.items():
        n = win.index.numel()
        extra = rng.randint(1, 3)
        order = torch.randperm(n + extra, generator=torch.Generator().manual_seed(rng.randrange(99)))
        order = order.to(win.req.device)
        req = torch.cat([win.req, torch.zeros(extra, dtype=torch.int64, device=win.req.device)])[order]
        index = torch.cat([win.index, torch.full((extra,), -1, dtype=torch.int64, device=win.req.device)])[
            order
        ]
        windows[r] = WindowMeta(req=req, index=index)
    return ForwardBatch(**{**batch.__dict__, "windows": windows})


def _fill(case: Case, gen: torch.Generator, poison: bool) -> None:
    """Random values in every pool; with `poison`, NaN / inf in every row no reference read needs."""
    pools = {b.name: p.name for p in case.cfg.kv_layout.pools for b in p.buffers}
    live = _live_slots(case) if poison else {}
    for name, pool in pools.items():
        for rows in case.cache.flat(name).values():
            rows.copy_(torch.randn(rows.shape, generator=gen).to(rows.dtype))
            if pool.endswith("state"):  # a score half of moderate size
                half = torch.randn(rows.shape[0], rows.shape[1] // 2, generator=gen)
                rows[:, rows.shape[1] // 2 :] = half.to(rows.device)
            if poison:
                keep = live.get(pool, torch.zeros(0, dtype=torch.long, device=rows.device))
                values = rows[keep].clone()
                bad = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=rows.dtype)
                rows.copy_(bad[torch.randint(0, 3, rows.shape, generator=gen)])
                rows[keep] = values


def _live_slots(case: Case) -> dict[str, torch.Tensor]:
    """Slots a correct step reads (visible windows and entries, stored state rows)."""
    geo = case.ref.geometry
    assert geo is not None
    out = {"swa": geo.window_slots[geo.window_visible]}
    for r, cg in geo.compress.items():
        pool = pool_of(r)
        out[pool] = cg.entry_slots[cg.entry_visible]
        win = case.batch.windows[r]
        stored = (~cg.fresh) & (cg.window_pos >= 0) & (win.index >= 0)[:, None]
        out[f"{pool}_state"] = cg.state_read[stored]
    return out
