"""Per-request slot tables (request row x logical index -> slot) that the attention kernels read.

The kv_writer turns each step's six-tuples into table entries with `write_cache_locs`. Tables are
int32, zero-initialised (0 = the skip sentinel) and never cleared on slot reuse: consumers read only
the live part of a row. For a paged pool, `block_table(table, P)` gives the PA_ND page ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dsv4serve.config import EngineConfig
from dsv4serve.devices import to_device
from dsv4serve.layout import PoolSpec, ServedModelConfig
from dsv4serve.memory.paged import POOL_NAMES
from dsv4serve.protocol import CacheLocs


class SlotTables:
    """Rows = max_num_seqs + 1; L = the resolved max model length; R = the HCA ratio.

    full, swa, c4_state, c128_state: [rows, L] indexed by raw position;
    c4: [rows, L // 4 + 1] and c128: [rows, L // R + 1] indexed by compressed index.
    The last row (`pad_row`) is never a request's: padding tokens of a fixed-shape (graph) step use it,
    so every slot they address is a sentinel (`point_pad_row_at` sets its state entries).
    """

    def __init__(
        self, model: ServedModelConfig, engine: EngineConfig, device: str | torch.device | None = None
    ):
        rows, length = engine.max_num_seqs + 1, engine.resolved_max_model_len(model)
        self.pad_row = engine.max_num_seqs
        layout = model.kv_layout
        self.hca_ratio = layout.ratio("c128")
        self.ratios = {p.name: p.ratio for p in layout.pools if p.index == "compressed"}
        dev = torch.device(device if device is not None else engine.device)
        widths = {name: _width(layout.get(name), length) for name in POOL_NAMES}
        # one buffer, each table a view of it: a step's writes to every table are one indexed store
        self.flat = torch.zeros(rows * sum(widths.values()), dtype=torch.int32, device=dev)
        self.base, self.width, offset = {}, widths, 0
        make = {}
        for name, w in widths.items():
            self.base[name] = offset
            make[name] = self.flat[offset : offset + rows * w].view(rows, w)
            offset += rows * w
        self.full, self.swa, self.c4 = make["full"], make["swa"], make["c4"]
        self.c128, self.c4_state, self.c128_state = make["c128"], make["c4_state"], make["c128_state"]

    def point_pad_row_at(self, state_sentinels: dict[str, int]) -> None:
        """The pad row's state entries address the state pools' sentinels (0 is a real slot in ring mode)."""
        for pool, slot in state_sentinels.items():
            self.table(pool)[self.pad_row].fill_(slot)

    def table(self, pool: str) -> torch.Tensor:
        assert pool in POOL_NAMES, pool
        return getattr(self, pool)

    def first_index(self, pool: str, locs: CacheLocs) -> int:
        """The logical index of the first slot of `pool` in `locs`."""
        if pool in ("full", "swa"):
            return locs.prefix_len
        if pool in ("c4", "c128"):
            ratio = self.ratios.get(pool, 0)
            return locs.prefix_len // ratio if ratio else 0
        return locs.seq_len - locs.count(pool)

    def clear_row(self, row: int) -> None:
        for pool in POOL_NAMES:
            self.table(pool)[row].zero_()


def _width(spec: PoolSpec | None, length: int) -> int:
    """A table's columns: one per logical index a request of `length` tokens can have (1 if no pool)."""
    if spec is None:
        return 1
    return length // spec.ratio + 1 if spec.index == "compressed" else length


def _slots_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.int32)  # copy: bytes are immutable


def write_cache_locs(tables: SlotTables, locs: CacheLocs) -> None:
    """Write one request's six-tuple into its row: one slice assignment per non-empty field."""
    for pool in POOL_NAMES:
        data = getattr(locs, pool)
        if data:
            start = tables.first_index(pool, locs)
            tables.table(pool)[locs.row, start : start + len(data) // 4] = _slots_tensor(data)


def write_cache_locs_batch(tables: SlotTables, batch: Sequence[CacheLocs]) -> None:
    """Write many six-tuples at once: host-side index arithmetic (numpy), then one host->device copy
    and one indexed store into the tables' buffer, queued without waiting for the device."""
    index, values = [], []
    for pool in POOL_NAMES:
        parts = [locs for locs in batch if getattr(locs, pool)]
        if not parts:
            continue
        counts = np.array([locs.count(pool) for locs in parts], dtype=np.int64)
        first = np.array(
            [locs.row * tables.width[pool] + tables.first_index(pool, locs) for locs in parts], dtype=np.int64
        )
        before = np.cumsum(counts) - counts  # slots of the earlier parts
        index.append(tables.base[pool] + np.arange(int(counts.sum())) + np.repeat(first - before, counts))
        values.append(np.frombuffer(b"".join(getattr(locs, pool) for locs in parts), dtype=np.int32))
    if index:
        packed = torch.from_numpy(np.stack([np.concatenate(index), np.concatenate(values).astype(np.int64)]))
        on_device = to_device(packed, tables.flat.device)
        tables.flat[on_device[0]] = on_device[1].int()


def block_table(table: torch.Tensor, page_size: int) -> torch.Tensor:
    """Physical page ids of a paged pool's table: [rows, L] -> [rows, ceil(L / P)]."""
    return table[:, ::page_size] // page_size
