"""Memory sizing of any KV layout (`layout.py`): the engine's pool sizes and the KV part of `plan`.

Units: bytes; "per token" means per raw token position of a request. Per pool: bytes per slot = the
sum over its buffers of layers * width * e (fp32 buffers: 4), where e is the KV dtype's bytes.
  growing pools (raw without a window, compressed of ratio r): full // r slots, so
              bytes_per_slot / r per token;
  fixed pools (raw with a window W, state of ratio r): a fixed number of slots per running request,
              whatever its length: (ceil((W-1)/P) + 1) * P (the W positions a request's next query
              sees span at most that many pages), or npu_state_pool_size(r, P, 1).
Capacity (`plan_kv`): fixed = weights on the device + R * bytes per request; the rest of the budget
goes to the address space (the first pool, `full_slots` = EngineConfig.max_total_tokens), in whole
units of P * (the largest compressed ratio) so every growing pool holds whole pages, capped at
R * max_position_embeddings. Every figure is integer arithmetic on the config. Not counted:
activations, workspaces, graphs, per-request tables, sentinel pages and the allocator's slack (a
partly filled page per request in each growing pool, a prefill chunk's extra window slots).

`models/plan.py` adds the weights, counted from the family's schema in its storage formats.
`engine_pool_sizes` is the engine's sizing from an EngineConfig (what KVAllocator and the buffers
use): the same per-request figures plus that slack, so no step within the budget is ever refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from dsv4serve.config import EngineConfig
from dsv4serve.memory.layout import KVLayout, PoolSpec, ServedModelConfig
from dsv4serve.memory.paged import PoolSizes, npu_state_pool_size, ring_size

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

Shape = tuple[int, ...]


def grows(pool: PoolSpec) -> bool:
    """Whether a pool's slots grow with the tokens cached (else a fixed number per running request)."""
    return pool.index == "compressed" or (pool.index == "raw" and not pool.window)


def window_pages(window: int, page_size: int) -> int:
    """Pages a running request's last `window` positions span at most (between steps)."""
    return math.ceil((window - 1) / page_size) + 1


def slots_per_request(pool: PoolSpec, page_size: int) -> int:
    """A fixed pool's slots per running request (0 for a growing pool)."""
    if grows(pool):
        return 0
    if pool.index == "raw":
        return window_pages(pool.window, page_size) * page_size
    return npu_state_pool_size(pool.ratio, page_size, 1)


def token_unit(layout: KVLayout, page_size: int) -> int:
    """`full` capacity is a multiple of this, so every growing pool holds whole pages."""
    return page_size * max((1, *(p.ratio for p in layout.pools if p.index == "compressed")))


# ------------------------------------------------------------------------------ engine pool sizes


def engine_pool_sizes(model: ServedModelConfig, engine: EngineConfig) -> PoolSizes:
    """Pages of every pool of the model's KV layout for an engine (sentinel page excluded).

    Raw without a window: max_total_tokens. Raw with a window: every running request's window, plus
    the step's token budget and one partly filled page per request for prefill chunks. Compressed:
    the compressed share of max_total_tokens plus one partly filled page per request. State:
    npu_state_pool_size (paged) or max_num_seqs + 1 rings.
    """
    page, seqs, tokens = engine.page_size, engine.max_num_seqs, engine.kv_tokens
    full = math.ceil(tokens / page)
    chunk_pages = math.ceil(engine.max_num_batched_tokens / page) + seqs
    pages = {}
    for spec in model.kv_layout.pools:
        if spec.index == "raw" and spec.window:
            pages[spec.name] = min(full, seqs * window_pages(spec.window, page) + chunk_pages)
        elif spec.index == "raw":
            pages[spec.name] = full
        elif spec.index == "compressed":
            pages[spec.name] = math.ceil(tokens / spec.ratio / page) + seqs
        elif engine.state_mode == "ring":
            pages[spec.name] = math.ceil((seqs + 1) * ring_size(spec.ratio) / page)
        else:
            pages[spec.name] = npu_state_pool_size(spec.ratio, page, seqs) // page
    return PoolSizes(**pages)


# ------------------------------------------------------------------------------ sized by device memory

# What `kv_budget` keeps back from the device for one step besides the weights and the KV: activations
# of a full step (bytes per hidden unit of each token of its budget), the sampled rows' vocabulary-wide
# tensors (fp32 logits, their processed copy, softmax, the processing rows' state) and the captured
# graphs' pools and library workspaces, times MEASURED_FACTOR: on one H100 (run 80, benchmarks/RESULTS.md:
# DeepSeek-V4 dimensions, 4 layers, 8,192-token chunks, 256 rows, a 1M context) the peak took 2.03x the
# formula's bytes (0.952 of the device at 0.9 asked). One configuration measured: a profiled step should
# replace the formula.
ACTIVATION_BYTES_PER_HIDDEN = 64
ROW_BYTES_PER_LOGIT = 32
GRAPHS_AND_WORKSPACES = 1 << 30
MEASURED_FACTOR = 2.25


def activation_reserve(model: ServedModelConfig, engine: EngineConfig) -> int:
    """Device bytes kept for a step's activations, the sampled rows and the graphs (see above)."""
    tokens = engine.max_num_batched_tokens * model.hidden_size * ACTIVATION_BYTES_PER_HIDDEN
    rows = (engine.max_num_seqs + 1) * model.vocab_size * ROW_BYTES_PER_LOGIT
    return int((tokens + rows + GRAPHS_AND_WORKSPACES) * MEASURED_FACTOR)


def kv_budget(model: ServedModelConfig, engine: EngineConfig, free: int, total: int) -> int:
    """The KV's bytes on a device of `total` bytes with `free` left now (the weights loaded):
    gpu_memory_utilization of it, less what is in use (weights, runtime, other processes) and the
    activation reserve."""
    return int(engine.gpu_memory_utilization * total) - (total - free) - activation_reserve(model, engine)


def pool_bytes(model: ServedModelConfig, engine: EngineConfig) -> int:
    """Device bytes of the engine's pools (`engine_pool_sizes`, sentinel pages included)."""
    sizes, kv = engine_pool_sizes(model, engine), DTYPE_BYTES[engine.torch_dtype_name]
    return sum(
        (sizes.pages(p.name) + 1) * engine.page_size * p.bytes_per_slot(kv) for p in model.kv_layout.pools
    )


def kv_tokens_for(model: ServedModelConfig, engine: EngineConfig, budget_bytes: int) -> int:
    """The most raw tokens (a whole number of `token_unit`s, at most max_num_seqs requests of
    max_position_embeddings) whose pools fit in `budget_bytes`; 0 if not even one unit does."""
    unit = token_unit(model.kv_layout, engine.page_size)
    lo, hi = 0, engine.max_num_seqs * model.max_position_embeddings // unit
    while lo < hi:  # pool bytes grow with the tokens: the largest count of units that fits
        mid = (lo + hi + 1) // 2
        if pool_bytes(model, engine.with_(max_total_tokens=mid * unit)) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo * unit


# ------------------------------------------------------------------------------ the device plan


@dataclass(frozen=True, slots=True)
class KVPlan:
    """The KV pools of one device under a memory budget (the part of `plan` every family shares)."""

    bytes_per_slot: tuple[tuple[str, int], ...]  # pool -> bytes of one slot, summed over layers
    kv_bytes_per_token: float  # the growing pools
    slots_per_request: tuple[tuple[str, int], ...]  # the fixed pools
    bytes_per_request: int
    budget_bytes: int
    fixed_bytes: int  # weights on this device + max_running * bytes_per_request
    token_budget_bytes: int  # what is left for the growing pools
    full_slots: int  # the address space (first pool) = EngineConfig.max_total_tokens
    slots: tuple[tuple[str, int], ...]  # pool -> its slots on the device
    kv_bytes: int  # the growing pools at full_slots
    total_bytes: int
    fits: bool

    def figures(self) -> dict[str, Any]:
        """Every figure except `slots`, by name, as the plans' flat fields (dicts of pools as tuples)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "slots"}


def plan_kv(
    layout: KVLayout,
    *,
    kv_bytes: int,
    page_size: int,
    max_running: int,
    budget_bytes: int,
    weight_bytes: int,
    max_position: int,
) -> KVPlan:
    """Size every pool of `layout` on a device whose budget also holds `weight_bytes` of weights."""
    pools = layout.pools
    per_slot = {p.name: p.bytes_per_slot(kv_bytes) for p in pools}
    growing = [p for p in pools if grows(p)]
    per_request = {p.name: slots_per_request(p, page_size) for p in pools if not grows(p)}
    request_bytes = sum(per_slot[name] * n for name, n in per_request.items())
    fixed = weight_bytes + max_running * request_bytes
    token_budget = max(0, budget_bytes - fixed)
    unit = token_unit(layout, page_size)
    unit_bytes = sum(unit // p.ratio * per_slot[p.name] for p in growing)
    cap = max_running * max_position // unit * unit  # more is never addressable
    full = min(token_budget // unit_bytes * unit, cap) if unit_bytes else cap
    slots = {p.name: full // p.ratio if grows(p) else max_running * per_request[p.name] for p in pools}
    kv = sum(slots[p.name] * per_slot[p.name] for p in growing)
    return KVPlan(
        bytes_per_slot=tuple(per_slot.items()),
        kv_bytes_per_token=sum(per_slot[p.name] / p.ratio for p in growing),
        slots_per_request=tuple(per_request.items()),
        bytes_per_request=request_bytes,
        budget_bytes=budget_bytes,
        fixed_bytes=fixed,
        token_budget_bytes=token_budget,
        full_slots=full,
        slots=tuple(slots.items()),
        kv_bytes=kv,
        total_bytes=fixed + kv,
        fits=full > 0 and fixed + kv <= budget_bytes,
    )
