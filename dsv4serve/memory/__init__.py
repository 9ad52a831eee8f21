"""KV memory of any layout (`layout.py`): pool sizes, the allocator (one slot message per request and
step), per-request slot tables, buffers, sizing. Nothing here names a pool: every pool comes from the
model's layout.

Names load lazily so that `plan` (sizing only) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsv4serve.memory.allocator import KVAllocator, PoolUsage, Refusal, ring_slots
    from dsv4serve.memory.buffers import LayoutBuffers
    from dsv4serve.memory.paged import PagePool, PageRun, PoolSizes, keep_start, state_sentinels
    from dsv4serve.memory.tables import SlotTables, block_table, write_cache_locs, write_cache_locs_batch

_HOMES = {
    "allocator": ("KVAllocator", "PoolUsage", "Refusal", "ring_slots"),
    "paged": ("PagePool", "PageRun", "PoolSizes", "keep_start", "state_sentinels"),
    "buffers": ("LayoutBuffers",),
    "tables": ("SlotTables", "block_table", "write_cache_locs", "write_cache_locs_batch"),
}
_MODULE_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = [
    "KVAllocator",
    "LayoutBuffers",
    "PagePool",
    "PageRun",
    "PoolSizes",
    "PoolUsage",
    "Refusal",
    "SlotTables",
    "block_table",
    "keep_start",
    "ring_slots",
    "state_sentinels",
    "write_cache_locs",
    "write_cache_locs_batch",
]


def __getattr__(name: str) -> object:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'dsv4serve.memory' has no attribute {name!r}")
    return getattr(importlib.import_module(f"dsv4serve.memory.{_MODULE_OF[name]}"), name)
