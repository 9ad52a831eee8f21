"""Memory sizing for DeepSeek-V4: bytes per token and per request of every pool, weights, slot counts.

Every figure is plain integer arithmetic on the config so it can be checked by hand (README, "Memory
planning"). Units: bytes; "per token" means per raw token position of a request. Pools (DESIGN §3):
  swa         every layer, one K=V row of head_dim per slot; R * (ceil((W-1)/P) + 1) * P slots
              (the W raw positions a running request's next query sees span at most that many pages)
  c4 / index  ratio-4 layers, one row of head_dim / index_head_dim per closed 4-token window
  c128        HCA layers, one row of head_dim per closed hca_ratio-token window
  c4_state    fp32 rows [kv ; score] of width 2*2*head_dim (+ 2*2*index_head_dim for the indexer)
  c128_state  fp32 rows of width 2*head_dim; both state pools are paged: npu_state_pool_size(r, P, R)
The compressed pools scale with `full` tokens; SWA and the state pools are a fixed cost per running
request. Not counted: activations, workspaces, graphs, per-request tables, sentinel pages, and the
allocator's slack (e.g. a partly filled page per request in each compressed pool, a prefill chunk's
extra SWA slots); leave a margin in the budget for them.

`engine_pool_sizes` is the engine's own sizing from an EngineConfig (what KVAllocator and KVPools
use): the same per-request figures plus that slack, so no step within the budget is ever refused.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from dsv4serve.config import ConfigError, EngineConfig, ModelConfig, npu_state_pool_size, ring_size
from dsv4serve.layout import ServedModelConfig
from dsv4serve.memory.paged import POOL_NAMES, PoolSizes

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
WEIGHT_FORMATS = ("official", "bf16")
STATE_BYTES = 4  # compressor state rows are fp32 (required on Ascend A3)
FP8_BLOCK = 128  # official FP8 linears: one ue8m0 scale byte per 128x128 block
FP4_GROUP = 32  # official MXFP4 experts: one e8m0 scale byte per 32 weights of a row

Tensor = tuple[int, int]  # (parameters, bytes)


@dataclass(frozen=True, slots=True)
class SizingPlan:
    """The memory plan of one device. Per-token figures are summed over all layers."""

    dtype: str
    dtype_bytes: int  # e: bytes per element of the KV pools
    page_size: int
    max_running: int
    hbm_gib: float
    weight_format: str
    num_devices: int
    num_layers: int
    num_c4_layers: int
    num_c128_layers: int
    hca_ratio: int
    head_dim: int
    index_head_dim: int
    sliding_window: int
    swa_bytes_per_token: int  # L * head_dim * e (per SWA slot)
    c4_bytes_per_token: float  # L4 * head_dim * e / 4
    c4_indexer_bytes_per_token: float  # L4 * index_head_dim * e / 4
    c128_bytes_per_token: float  # L128 * head_dim * e / hca_ratio
    kv_bytes_per_token: float  # c4 + c4_indexer + c128: what scales with `full` tokens
    c4_state_bytes_per_slot: int  # L4 * (2*2*head_dim + 2*2*index_head_dim) * 4
    c128_state_bytes_per_slot: int  # L128 * 2*head_dim * 4
    swa_slots_per_request: int
    c4_state_slots_per_request: int
    c128_state_slots_per_request: int
    bytes_per_request: int
    weight_params: int
    weight_bytes: int
    weight_bytes_per_device: int
    weight_bytes_by_group: tuple[tuple[str, int], ...]
    budget_bytes: int
    fixed_bytes: int  # weights on this device + max_running * bytes_per_request
    token_budget_bytes: int  # what is left for the pools that scale with tokens
    full_slots: int  # = EngineConfig.max_total_tokens
    swa_slots: int
    c4_slots: int
    c128_slots: int
    c4_state_slots: int
    c128_state_slots: int
    kv_bytes: int  # the token-scaled pools at full_slots
    total_bytes: int
    fits: bool

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["weight_bytes_by_group"] = dict(self.weight_bytes_by_group)
        return {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in out.items()}


def swa_pages_per_request(model: ModelConfig, page_size: int) -> int:
    """SWA pages a running request holds between steps: its last W positions span at most this many."""
    return math.ceil((model.sliding_window - 1) / page_size) + 1


def swa_slots_per_request(model: ModelConfig, page_size: int) -> int:
    return swa_pages_per_request(model, page_size) * page_size


def engine_pool_sizes(model: ServedModelConfig, engine: EngineConfig) -> PoolSizes:
    """Pages per pool of the model's KV layout for an engine (sentinel page excluded; 0 if no pool).

    full (raw, every position): max_total_tokens. A windowed raw pool (swa): every running request's
    window, plus the step's token budget and one partly filled page per request for prefill chunks.
    Compressed (c4 / c128): the compressed share of full plus one partly filled page per request.
    State: npu_state_pool_size (paged) or max_num_seqs + 1 rings.
    """
    page, seqs = engine.page_size, engine.max_num_seqs
    full = math.ceil(engine.max_total_tokens / page)
    chunk_pages = math.ceil(engine.max_num_batched_tokens / page) + seqs
    pages = dict.fromkeys(POOL_NAMES, 0)
    for spec in model.kv_layout.pools:
        if spec.index == "raw" and spec.window:
            window_pages = math.ceil((spec.window - 1) / page) + 1
            pages[spec.name] = min(full, seqs * window_pages + chunk_pages)
        elif spec.index == "raw":
            pages[spec.name] = full
        elif spec.index == "compressed":
            pages[spec.name] = math.ceil(engine.max_total_tokens / spec.ratio / page) + seqs
        else:
            pages[spec.name] = _engine_state_pages(spec.ratio, engine)
    return PoolSizes(**pages)


def _engine_state_pages(ratio: int, engine: EngineConfig) -> int:
    page, seqs = engine.page_size, engine.max_num_seqs
    if engine.state_mode == "ring":
        return math.ceil((seqs + 1) * ring_size(ratio) / page)
    return npu_state_pool_size(ratio, page, seqs) // page


def state_slots(model: ModelConfig, ratio: int, page_size: int, max_running: int) -> int:
    """Paged compressor-state slots for `ratio` (0 when no layer uses it)."""
    if not ratio or not model.layers_with_ratio(ratio):
        return 0
    return npu_state_pool_size(ratio, page_size, max_running)


def token_unit(model: ModelConfig, page_size: int) -> int:
    """`full` capacity is a multiple of this, so every compressed pool holds whole pages."""
    return page_size * max((1, *model.compress_ratio_set))


def plan(
    model: ModelConfig,
    *,
    dtype: str = "bfloat16",
    page_size: int = 128,
    max_running: int = 64,
    hbm_gib: float = 64.0,
    weight_format: str = "official",
    num_devices: int = 1,
) -> SizingPlan:
    """Size every pool of one device from an HBM budget.

    The budget holds this device's share of the weights (weights split evenly over `num_devices`),
    the per-request pools for `max_running` requests, and the token-scaled pools filling the rest.
    """
    _check_inputs(dtype, page_size, max_running, hbm_gib, weight_format, num_devices)
    rows = _RowBytes.of(model, DTYPE_BYTES[dtype])
    per_request = _per_request(model, page_size, rows)
    params, wbytes, groups = count_weights(model, weight_format)
    w_device = -(-wbytes // num_devices)  # ceil, in integers
    budget = int(hbm_gib * GIB)
    fixed = w_device + max_running * per_request["bytes_per_request"]
    token_budget = max(0, budget - fixed)
    pools = _pools(model, page_size, max_running, token_budget, rows)
    return SizingPlan(
        dtype=dtype,
        dtype_bytes=DTYPE_BYTES[dtype],
        page_size=page_size,
        max_running=max_running,
        hbm_gib=hbm_gib,
        weight_format=weight_format,
        num_devices=num_devices,
        num_layers=model.num_layers,
        num_c4_layers=len(model.c4_layers),
        num_c128_layers=len(model.c128_layers),
        hca_ratio=model.hca_ratio,
        head_dim=model.head_dim,
        index_head_dim=model.index_head_dim,
        sliding_window=model.sliding_window,
        **rows.per_token(model.hca_ratio),
        **per_request,
        weight_params=params,
        weight_bytes=wbytes,
        weight_bytes_per_device=w_device,
        weight_bytes_by_group=groups,
        budget_bytes=budget,
        fixed_bytes=fixed,
        token_budget_bytes=token_budget,
        **pools,
        total_bytes=fixed + pools["kv_bytes"],
        fits=pools["full_slots"] > 0 and fixed + pools["kv_bytes"] <= budget,
    )


@dataclass(frozen=True, slots=True)
class _RowBytes:
    """Bytes of one slot of each pool, summed over the layers that have the pool."""

    swa: int
    c4: int
    c4_indexer: int
    c128: int
    c4_state: int
    c128_state: int

    @classmethod
    def of(cls, model: ModelConfig, e: int) -> _RowBytes:
        d, di = model.head_dim, model.index_head_dim
        n4, n128 = len(model.c4_layers), len(model.c128_layers)
        return cls(
            swa=model.num_layers * d * e,
            c4=n4 * d * e,
            c4_indexer=n4 * di * e,
            c128=n128 * d * e,
            c4_state=n4 * (2 * 2 * d + 2 * 2 * di) * STATE_BYTES,  # attention + indexer [kv ; score]
            c128_state=n128 * 2 * d * STATE_BYTES,
        )

    def per_token(self, hca_ratio: int) -> dict[str, Any]:
        c128 = self.c128 / hca_ratio if hca_ratio else 0.0
        return {
            "swa_bytes_per_token": self.swa,
            "c4_bytes_per_token": self.c4 / 4,
            "c4_indexer_bytes_per_token": self.c4_indexer / 4,
            "c128_bytes_per_token": c128,
            "kv_bytes_per_token": (self.c4 + self.c4_indexer) / 4 + c128,
            "c4_state_bytes_per_slot": self.c4_state,
            "c128_state_bytes_per_slot": self.c128_state,
        }


def _per_request(model: ModelConfig, page_size: int, rows: _RowBytes) -> dict[str, int]:
    swa = swa_slots_per_request(model, page_size)
    c4_state = state_slots(model, 4, page_size, 1)
    c128_state = state_slots(model, model.hca_ratio, page_size, 1)
    return {
        "swa_slots_per_request": swa,
        "c4_state_slots_per_request": c4_state,
        "c128_state_slots_per_request": c128_state,
        "bytes_per_request": swa * rows.swa + c4_state * rows.c4_state + c128_state * rows.c128_state,
    }


def _pools(
    model: ModelConfig, page_size: int, max_running: int, token_budget: int, rows: _RowBytes
) -> dict[str, int]:
    """Slot counts: `full` fills the token budget in whole units (capped at what R requests can use)."""
    r = model.hca_ratio
    unit = token_unit(model, page_size)
    unit_bytes = unit // 4 * (rows.c4 + rows.c4_indexer) + (unit // r * rows.c128 if r else 0)
    cap = max_running * model.max_position_embeddings // unit * unit  # more is never addressable
    full = min(token_budget // unit_bytes * unit, cap) if unit_bytes else cap
    c4, c128 = (full // 4 if model.c4_layers else 0), (full // r if r else 0)
    return {
        "full_slots": full,
        "swa_slots": max_running * swa_slots_per_request(model, page_size),
        "c4_slots": c4,
        "c128_slots": c128,
        "c4_state_slots": state_slots(model, 4, page_size, max_running),
        "c128_state_slots": state_slots(model, r, page_size, max_running),
        "kv_bytes": c4 * (rows.c4 + rows.c4_indexer) + c128 * rows.c128,
    }


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


# ------------------------------------------------------------------------------------------ weights


def count_weights(
    model: ModelConfig, weight_format: str = "official"
) -> tuple[int, int, tuple[tuple[str, int], ...]]:
    """(parameters, bytes, bytes by group) of the main model's weights; MTP layers are skipped.

    "official": attention / shared-expert / indexer-query linears FP8 e4m3 (1 B per weight plus one
    ue8m0 byte per 128x128 block); routed experts MXFP4 (0.5 B per weight plus one e8m0 byte per 32),
    or FP8 when the config says `expert_dtype: fp8`; embed, head, norms, router, indexer weights_proj
    and compressor projections BF16; hc_*, attn_sink, ape and the router bias FP32; tid2eid int64.
    "bf16": the FP8 / FP4 linears become BF16 (no scales); everything else as above.
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ConfigError(f"weight_format: {weight_format!r} is not one of {WEIGHT_FORMATS}")
    official = weight_format == "official"
    linear = _fp8 if official else _bf16_linear
    expert = (_fp4 if model.expert_dtype in (None, "fp4") else _fp8) if official else _bf16_linear
    groups: dict[str, list[Tensor]] = {}
    for group, tensor in _global_tensors(model):
        groups.setdefault(group, []).append(tensor)
    for layer in range(model.num_layers):
        for group, tensor in _layer_tensors(model, layer, linear, expert):
            groups.setdefault(group, []).append(tensor)
    by_group = tuple((g, sum(b for _, b in ts)) for g, ts in groups.items())
    params = sum(p for ts in groups.values() for p, _ in ts)
    return params, sum(b for _, b in by_group), by_group


def _global_tensors(m: ModelConfig) -> list[tuple[str, Tensor]]:
    h, hc = m.hidden_size, m.hc_mult
    out = [("embed_head", _bf16(m.vocab_size * h)), ("norms", _bf16(h))]
    if not m.tie_word_embeddings:
        out.append(("embed_head", _bf16(m.vocab_size * h)))
    out += [("mhc", _fp32(hc * hc * h)), ("mhc", _fp32(hc)), ("mhc", _fp32(1))]  # hc_head fn/base/scale
    return out


def _layer_tensors(m: ModelConfig, layer: int, linear: Any, expert: Any) -> list[tuple[str, Tensor]]:
    h, d, hc, ratio = m.hidden_size, m.head_dim, m.hc_mult, m.compress_ratios[layer]
    mix = (2 + hc) * hc
    out = [("mhc", _fp32(mix * hc * h)), ("mhc", _fp32(mix)), ("mhc", _fp32(3))] * 2  # hc_attn / hc_ffn
    out += [("norms", _bf16(h)), ("norms", _bf16(h)), ("norms", _bf16(m.q_lora_rank)), ("norms", _bf16(d))]
    out += [
        ("attention", linear(m.q_lora_rank, h)),  # wq_a
        ("attention", linear(m.num_heads * d, m.q_lora_rank)),  # wq_b
        ("attention", linear(d, h)),  # wkv
        ("attention", linear(m.o_groups * m.o_lora_rank, m.num_heads * d // m.o_groups)),  # wo_a
        ("attention", linear(h, m.o_groups * m.o_lora_rank)),  # wo_b
        ("attention", _fp32(m.num_heads)),  # attn_sink
    ]
    if ratio:
        out += [("compressor", t) for t in _compressor(ratio, d, h)]
    if ratio == 4:
        out += [
            ("indexer", linear(m.index_n_heads * m.index_head_dim, m.q_lora_rank)),  # wq_b
            ("indexer", _bf16(m.index_n_heads * h)),  # weights_proj
            *(("indexer", t) for t in _compressor(4, m.index_head_dim, h)),
        ]
    return out + _ffn_tensors(m, layer, linear, expert)


def _ffn_tensors(m: ModelConfig, layer: int, linear: Any, expert: Any) -> list[tuple[str, Tensor]]:
    h, inter, n = m.hidden_size, m.moe_intermediate_size, m.n_routed_experts
    route = _i64(m.vocab_size * m.num_experts_per_tok) if layer < m.num_hash_layers else _fp32(n)
    out = [("router", _bf16(n * h)), ("router", route)]  # gate.weight; tid2eid or gate.bias
    one_expert = [expert(inter, h), expert(inter, h), expert(h, inter)]  # w1, w3, w2
    out += [("routed_experts", (p * n, b * n)) for p, b in one_expert]
    shared = [linear(inter, h), linear(inter, h), linear(h, inter)]
    out += [("shared_experts", (p * m.n_shared_experts, b * m.n_shared_experts)) for p, b in shared]
    return out


def _compressor(ratio: int, d: int, h: int) -> list[Tensor]:
    width = ModelConfig.coff(ratio) * d
    return [_bf16(width * h), _bf16(width * h), _fp32(ratio * width), _bf16(d)]  # wkv, wgate, ape, norm


def _fp8(out_dim: int, in_dim: int) -> Tensor:
    n = out_dim * in_dim
    return n, n + math.ceil(out_dim / FP8_BLOCK) * math.ceil(in_dim / FP8_BLOCK)


def _fp4(out_dim: int, in_dim: int) -> Tensor:
    n = out_dim * in_dim
    return n, (n + 1) // 2 + out_dim * math.ceil(in_dim / FP4_GROUP)


def _bf16_linear(out_dim: int, in_dim: int) -> Tensor:
    return _bf16(out_dim * in_dim)


def _bf16(n: int) -> Tensor:
    return n, 2 * n


def _fp32(n: int) -> Tensor:
    return n, 4 * n


def _i64(n: int) -> Tensor:
    return n, 8 * n
