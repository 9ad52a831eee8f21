"""`plan`: the memory of one device serving a model family, every figure integer arithmetic on its config.

Weights come from the family's schema, in the official checkpoint's storage formats (`official`: FP8
linears 1 B per weight plus one ue8m0 byte per 128x128 block, MXFP4 experts 0.5 B per weight plus one
e8m0 byte per 32 of a row, bf16 2 B, fp32 4 B, int64 8 B) or with the FP8 / MXFP4 ones widened to bf16
(`bf16`), split evenly over `num_devices`. The KV pools come from the family's layout
(memory/sizing.py `plan_kv`). `render` prints a table whose every figure shows its formula.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dsv4serve.config import ConfigError, EngineConfig
from dsv4serve.memory.layout import PoolSpec, ServedModelConfig
from dsv4serve.memory.sizing import (
    DTYPE_BYTES,
    GIB,
    KVPlan,
    grows,
    kv_budget,
    kv_tokens_for,
    plan_kv,
    window_pages,
)
from dsv4serve.models.spec import ModelSpec, Schema, TensorSpec

WEIGHT_FORMATS = ("official", "bf16")
LAYOUTS = ("even", "tp", "dp")  # how the weights spread over num_devices (see `device_share`)
FP8_BLOCK = 128  # official FP8 linears: one ue8m0 scale byte per 128x128 block
FP4_GROUP = 32  # official MXFP4 experts: one e8m0 scale byte per 32 weights of a row
DISK_BYTES = {"bf16": 2, "fp32": 4, "int64": 8}


@dataclass(frozen=True, slots=True)
class DevicePlan:
    model_type: str
    dtype: str  # of the KV pools
    dtype_bytes: int
    page_size: int
    max_running: int
    hbm_gib: float
    weight_format: str
    num_devices: int
    num_layers: int
    pools: tuple[PoolSpec, ...]
    kv: KVPlan
    weight_params: int
    weight_bytes: int
    weight_bytes_per_device: int
    weight_bytes_by_group: tuple[tuple[str, int], ...]
    # with gpu_memory_utilization: the engine's own sizing (its pools' slack counted) on such a device
    gpu_memory_utilization: float | None = None
    engine_max_total_tokens: int | None = None

    def to_dict(self) -> dict[str, Any]:
        per_slot, per_request, slots = (
            dict(t) for t in (self.kv.bytes_per_slot, self.kv.slots_per_request, self.kv.slots)
        )
        pools = {
            p.name: {
                "index": p.index,
                "ratio": p.ratio,
                "window": p.window,
                "buffers": {
                    b.name: {"layers": len(b.layers), "width": b.width, "dtype": b.dtype or self.dtype}
                    for b in p.buffers
                },
                "bytes_per_slot": per_slot[p.name],
                "slots_per_request": per_request.get(p.name, 0),
                "slots": slots[p.name],
            }
            for p in self.pools
        }
        head = {name: getattr(self, name) for name in _SCALARS}
        kv = {name: _number(value) for name, value in self.kv.figures().items() if name not in _BY_POOL}
        return head | {"weight_bytes_by_group": dict(self.weight_bytes_by_group), "pools": pools} | kv


_SCALARS = (
    "model_type", "dtype", "dtype_bytes", "page_size", "max_running", "hbm_gib", "weight_format",
    "num_devices", "num_layers", "weight_params", "weight_bytes", "weight_bytes_per_device",
    "gpu_memory_utilization", "engine_max_total_tokens",
)  # fmt: skip
_BY_POOL = ("bytes_per_slot", "slots_per_request")


def _number(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def plan(
    spec: ModelSpec[Any],
    model: ServedModelConfig,
    *,
    dtype: str = "bfloat16",
    page_size: int = 128,
    max_running: int = 64,
    hbm_gib: float = 64.0,
    weight_format: str = "official",
    num_devices: int = 1,
    gpu_memory_utilization: float | None = None,
    max_num_batched_tokens: int = 2048,
    layout: str = "even",
) -> DevicePlan:
    """Size every pool of one device from an HBM budget that holds this device's share of the weights,
    the per-request pools of `max_running` requests and, in what is left, the pools that grow with
    tokens. With `gpu_memory_utilization`, the budget is the engine's (that share of the HBM less the
    activation reserve of a `max_num_batched_tokens` step) and `engine_max_total_tokens` is the KV
    capacity the engine sizes itself on such a device holding these weights."""
    _check_inputs(dtype, page_size, max_running, hbm_gib, weight_format, num_devices)
    if layout not in LAYOUTS:
        raise ConfigError(f"layout: {layout!r} is not one of {LAYOUTS}")
    params, wbytes, groups = count_weights(spec.schema(model), weight_format)
    w_device = -(-wbytes // num_devices)  # ceil, in integers
    if layout != "even":
        w_device = device_share(spec, model, weight_format, layout, num_devices)[1]
    budget, engine_tokens = int(hbm_gib * GIB), None
    if gpu_memory_utilization is not None:
        engine = EngineConfig(
            device="cuda", dtype=dtype, page_size=page_size, max_num_seqs=max_running,
            max_num_batched_tokens=max_num_batched_tokens, gpu_memory_utilization=gpu_memory_utilization,
        )  # fmt: skip
        total = int(hbm_gib * GIB)
        budget = kv_budget(model, engine, free=total, total=total)  # + the weights, as plan_kv counts them
        budget -= prefill_workspace(spec, model, weight_format, num_devices)
        engine_tokens = kv_tokens_for(model, engine, budget - w_device)
    kv = plan_kv(
        model.kv_layout,
        kv_bytes=DTYPE_BYTES[dtype],
        page_size=page_size,
        max_running=max_running,
        budget_bytes=budget,
        weight_bytes=w_device,
        max_position=model.max_position_embeddings,
    )
    return DevicePlan(
        model.model_type, dtype, DTYPE_BYTES[dtype], page_size, max_running, hbm_gib, weight_format,
        num_devices, model.num_layers, model.kv_layout.pools, kv, params, wbytes, w_device, groups,
        gpu_memory_utilization, engine_tokens,
    )  # fmt: skip


def _check_inputs(
    dtype: str, page_size: int, max_running: int, hbm_gib: float, weight_format: str, num_devices: int
) -> None:
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype: {dtype!r} is not one of {tuple(DTYPE_BYTES)}")
    if weight_format not in WEIGHT_FORMATS:
        raise ConfigError(f"weight_format: {weight_format!r} is not one of {WEIGHT_FORMATS}")
    for name, value in (("page_size", page_size), ("max_running", max_running), ("num_devices", num_devices)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}: expected a positive int, got {value!r}")
    if page_size & (page_size - 1):
        raise ConfigError(f"page_size: {page_size} must be a power of two")
    if not hbm_gib > 0 or math.isinf(hbm_gib):
        raise ConfigError(f"hbm_gib: expected a positive finite number, got {hbm_gib!r}")


def count_weights(
    schema: Schema, weight_format: str = "official"
) -> tuple[int, int, tuple[tuple[str, int], ...]]:
    """(parameters, bytes, bytes by group) of the schema's tensors in `weight_format`."""
    if weight_format not in WEIGHT_FORMATS:
        raise ConfigError(f"weight_format: {weight_format!r} is not one of {WEIGHT_FORMATS}")
    groups: dict[str, int] = {}
    for spec in schema.values():
        groups[spec.group] = groups.get(spec.group, 0) + tensor_bytes(spec, weight_format)
    params = sum(math.prod(spec.shape) for spec in schema.values())
    return params, sum(groups.values()), tuple(groups.items())


def device_share(
    spec: ModelSpec[Any], model: ServedModelConfig, weight_format: str, layout: str, num_devices: int
) -> tuple[int, int]:
    """(parameters, bytes) of the weights one device holds, as the engine's ranks load them: `tp`
    (tensor parallelism with expert parallelism) splits each tensor the schema splits and the routed
    experts; `dp` (data parallelism with expert parallelism) splits the routed experts only; the rest
    is whole on every device."""
    naming = spec.names(model)
    params = total = 0
    for name, held in spec.schema(model).items():
        split = naming.expert(name) is not None or (layout == "tp" and held.split is not None)
        parts = num_devices if split else 1
        params += math.prod(held.shape) // parts
        total += -(-tensor_bytes(held, weight_format) // parts)
    return params, total


def prefill_workspace(
    spec: ModelSpec[Any], model: ServedModelConfig, weight_format: str, num_devices: int
) -> int:
    """What the CUDA engine keeps beside the KV for a prefill's decoded MXFP4 experts (the backend's
    `workspace`): one layer's routed experts in bf16, the device's share of them."""
    if weight_format == "bf16":
        return 0
    naming, layers = spec.names(model), dict[str, int]()
    for name, held in spec.schema(model).items():
        stacked = naming.expert(name)
        if held.disk == "mxfp4" and stacked is not None:
            layer = stacked[0].rsplit(".", 1)[0]  # the layer's experts, whatever the part
            layers[layer] = layers.get(layer, 0) + math.prod(held.shape)
    return 2 * max(layers.values(), default=0) // num_devices


def tensor_bytes(spec: TensorSpec, weight_format: str) -> int:
    n = math.prod(spec.shape)
    if spec.disk in DISK_BYTES or weight_format == "bf16":
        return n * DISK_BYTES.get(spec.disk, 2)
    rows, cols = spec.shape
    if spec.disk == "fp8":
        return n + math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK)
    return (n + 1) // 2 + rows * math.ceil(cols / FP4_GROUP)  # mxfp4


# ----------------------------------------------------------------------------------------- the table


def render(p: DevicePlan) -> str:
    """The plan as a table whose every figure can be checked by hand (README, "Memory planning")."""
    kv, e = p.kv, p.dtype_bytes
    per_slot, per_request = dict(kv.bytes_per_slot), dict(kv.slots_per_request)
    growing = [q for q in p.pools if grows(q) and q.buffers]
    fixed = [q for q in p.pools if not grows(q)]
    lines = [
        f"{p.model_type}: {p.num_layers} layers, {p.weight_params / 1e9:.1f} B params; KV {p.dtype} ({e} B), "
        f"page {p.page_size}, max running {p.max_running}; budget {p.hbm_gib:g} GiB, weights "
        f"{p.weight_format} over {p.num_devices} device(s)",
        "",
        _line("bytes per slot, all layers", "layers x width x bytes, per buffer", "bytes"),
        *(_line(_pool_label(q), _slot_formula(q, e), per_slot[q.name]) for q in p.pools if q.buffers),
        _line("per raw token (growing pools)", " + ".join(f"{q.name} / {q.ratio}" for q in growing) or "-",
              kv.kv_bytes_per_token),
        "",
        _line("per running request", "slots (formula)", "slots"),
        *(_line(q.name, _request_formula(q, p.page_size), per_request[q.name]) for q in fixed),
        _line("bytes", "slots x bytes per slot, summed", kv.bytes_per_request),
        "",
        _line("memory of one device", "GiB", "bytes"),
        *(_gib(f"weights: {group}", b) for group, b in p.weight_bytes_by_group),
        _gib(f"weights ({p.weight_format}), all", p.weight_bytes),
        _gib(f"weights on this device (/{p.num_devices})", p.weight_bytes_per_device),
        _gib(f"per-request pools (x {p.max_running})", p.max_running * kv.bytes_per_request),
        _gib("token-scaled pools at full slots", kv.kv_bytes),
        _gib("total", kv.total_bytes),
        _gib("budget", kv.budget_bytes),
        "",
        _line("pool", "", "slots"),
        *(_line(name, "", n) for name, n in kv.slots),
        "",
        _verdict(p),
    ]  # fmt: skip
    return "\n".join(lines)


def _pool_label(q: PoolSpec) -> str:
    kind = {"raw": f"raw, window {q.window}" if q.window else "raw", "compressed": f"ratio {q.ratio}"}
    return f"{q.name} ({kind.get(q.index, f'state, ratio {q.ratio}')})"


def _slot_formula(q: PoolSpec, e: int) -> str:
    return " + ".join(f"{len(b.layers)} x {b.width} x {b.element_bytes(e)}" for b in q.buffers)


def _request_formula(q: PoolSpec, page: int) -> str:
    if q.index == "raw":
        return f"(ceil(({q.window}-1)/{page}) + 1) x {page} = {window_pages(q.window, page)} pages"
    return f"max(2, ceil(1.8x{q.ratio}/{page}) + 1) x {page}"


def _line(label: str, formula: str, value: float | str) -> str:
    shown = f"{value:,.0f}" if isinstance(value, int | float) else value
    return f"  {label:<34}{formula:<44}{shown:>16}"


def _gib(label: str, value: int) -> str:
    return _line(label, f"{value / GIB:.2f}", value)


def _verdict(p: DevicePlan) -> str:
    if p.engine_max_total_tokens is not None:
        if not p.engine_max_total_tokens:
            return f"does NOT fit: no KV left at --gpu-memory-utilization {p.gpu_memory_utilization:g}"
        return (
            f"max_total_tokens = {p.engine_max_total_tokens:,} (what `serve` sizes at "
            f"--gpu-memory-utilization {p.gpu_memory_utilization:g}: these pools and the engine's slack)"
        )
    if p.kv.fits:
        return f"max_total_tokens = {p.kv.full_slots:,} (the {p.pools[0].name} pool)"
    need = p.kv.fixed_bytes / GIB
    return (
        f"does NOT fit: weights and per-request pools alone need {need:.2f} GiB of {p.hbm_gib:g} GiB; "
        "raise --hbm-gib or --devices, or lower --max-running"
    )
