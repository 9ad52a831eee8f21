"""Memory plan of any model family from its KV layout and weight schema (DSV4 has its own, sizing.py).

Per pool: bytes per slot = sum over its buffers of layers * width * e (fp32 buffers: 4). Pools whose
slots grow with tokens (raw without a window, compressed) cost bytes_per_slot / ratio per token;
windowed raw pools and state pools cost a fixed number of slots per running request (as in
sizing.py). Weights are the schema's tensors at the engine's storage dtype (fp32 where the family
keeps fp32), MTP excluded. Capacity: `full` tokens = (budget - weights / N - R * per request) /
bytes per token, rounded down to whole pages of every pool and capped at R * max_position_embeddings.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from dsv4serve.config import npu_state_pool_size
from dsv4serve.layout import ServedModelConfig
from dsv4serve.memory.sizing import DTYPE_BYTES, GIB

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LayoutPlan:
    model_type: str
    dtype: str
    dtype_bytes: int
    page_size: int
    max_running: int
    hbm_gib: float
    num_devices: int
    num_layers: int
    bytes_per_slot: tuple[tuple[str, int], ...]  # pool -> bytes of one slot, summed over layers
    kv_bytes_per_token: float  # the pools that grow with tokens
    slots_per_request: tuple[tuple[str, int], ...]  # windowed / state pools
    bytes_per_request: int
    weight_params: int
    weight_bytes: int
    weight_bytes_per_device: int
    budget_bytes: int
    fixed_bytes: int
    token_budget_bytes: int
    full_slots: int  # = EngineConfig.max_total_tokens
    kv_bytes: int
    total_bytes: int
    fits: bool

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["bytes_per_slot"] = dict(self.bytes_per_slot)
        out["slots_per_request"] = dict(self.slots_per_request)
        return {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in out.items()}


def plan_layout(
    model: ServedModelConfig,
    schema: Mapping[str, Shape],
    fp32: Callable[[str], bool],
    *,
    dtype: str = "bfloat16",
    page_size: int = 128,
    max_running: int = 64,
    hbm_gib: float = 64.0,
    num_devices: int = 1,
) -> LayoutPlan:
    e = DTYPE_BYTES[dtype]
    pools = model.kv_layout.pools
    per_slot = {p.name: p.bytes_per_slot(e) for p in pools}
    growing = [p for p in pools if p.index == "compressed" or (p.index == "raw" and not p.window)]
    per_token = sum(per_slot[p.name] / (p.ratio if p.index == "compressed" else 1) for p in growing)
    fixed_slots = {}
    for p in pools:
        if p.index == "raw" and p.window:
            fixed_slots[p.name] = (math.ceil((p.window - 1) / page_size) + 1) * page_size
        elif p.index == "state":
            fixed_slots[p.name] = npu_state_pool_size(p.ratio, page_size, 1)
    per_request = sum(per_slot[n] * s for n, s in fixed_slots.items())
    params = sum(math.prod(s) for s in schema.values())
    wbytes = sum(math.prod(s) * (4 if fp32(n) else e) for n, s in schema.items())
    w_device = -(-wbytes // num_devices)
    budget = int(hbm_gib * GIB)
    fixed = w_device + max_running * per_request
    token_budget = max(0, budget - fixed)
    unit = page_size * max((1, *(p.ratio for p in growing)))
    full = int(token_budget // per_token) // unit * unit if per_token else 0
    full = min(full, max_running * model.max_position_embeddings)
    kv = math.ceil(full * per_token)
    return LayoutPlan(
        model_type=model.model_type,
        dtype=dtype,
        dtype_bytes=e,
        page_size=page_size,
        max_running=max_running,
        hbm_gib=hbm_gib,
        num_devices=num_devices,
        num_layers=model.num_layers,
        bytes_per_slot=tuple(per_slot.items()),
        kv_bytes_per_token=per_token,
        slots_per_request=tuple(fixed_slots.items()),
        bytes_per_request=per_request,
        weight_params=params,
        weight_bytes=wbytes,
        weight_bytes_per_device=w_device,
        budget_bytes=budget,
        fixed_bytes=fixed,
        token_budget_bytes=token_budget,
        full_slots=full,
        kv_bytes=kv,
        total_bytes=fixed + kv,
        fits=full > 0 and fixed + kv <= budget,
    )


def render_layout_plan(p: LayoutPlan) -> str:
    lines = [
        f"{p.model_type}: {p.num_layers} layers, KV {p.dtype} ({p.dtype_bytes} B), page {p.page_size}, "
        f"{p.max_running} running, {p.hbm_gib} GiB x {p.num_devices} device(s)",
        *(f"  pool {name}: {b:,} B per slot" for name, b in p.bytes_per_slot),
        f"  KV bytes per token: {p.kv_bytes_per_token:,.0f}",
        f"  per request: {p.bytes_per_request:,} B",
        f"  weights: {p.weight_params:,} params, {p.weight_bytes:,} B ({p.weight_bytes / GIB:.2f} GiB), "
        f"{p.weight_bytes_per_device:,} B per device",
        f"  full tokens (max_total_tokens): {p.full_slots:,}; KV {p.kv_bytes:,} B; total {p.total_bytes:,} B",
        "  fits" if p.fits else "  does NOT fit",
    ]
    return "\n".join(lines)
