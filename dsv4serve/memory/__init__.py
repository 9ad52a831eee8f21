"""DeepSeek-V4 KV memory: pools, the allocator (six-tuples), per-request slot tables."""

from dsv4serve.memory.allocator import KVAllocator, PoolUsage, Refusal, ring_slots
from dsv4serve.memory.paged import POOL_NAMES, STATE_POOLS, PagePool, PageRun, PoolSizes, keep_start
from dsv4serve.memory.pools import KVPools, flat
from dsv4serve.memory.tables import SlotTables, block_table, write_cache_locs, write_cache_locs_batch

__all__ = [
    "POOL_NAMES",
    "STATE_POOLS",
    "KVAllocator",
    "KVPools",
    "PagePool",
    "PageRun",
    "PoolSizes",
    "PoolUsage",
    "Refusal",
    "SlotTables",
    "block_table",
    "flat",
    "keep_start",
    "ring_slots",
    "write_cache_locs",
    "write_cache_locs_batch",
]
