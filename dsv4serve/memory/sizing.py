"""DeepSeek-V4's memory plan: its weights (FP8 / MXFP4 / BF16 formats) and its pools' named figures.

The pools' figures come from the layout plan (`sizing_layout.plan_device`, for any layout); what this
module adds is DSV4's own: the weights by group in the official or BF16 format, and the named fields
the README and `plan --json` show. DSV4's pools (DESIGN §3), for L layers, L4 of ratio 4, L128 HCA:
  swa         every layer, one K=V row of head_dim per slot; R * (ceil((W-1)/P) + 1) * P slots
  c4          ratio-4 layers: one row of head_dim (kv) + one of index_head_dim (indexer keys)
              per closed 4-token window
  c128        HCA layers, one row of head_dim per closed hca_ratio-token window
  c4_state    fp32 rows [kv ; score] of width 2*2*head_dim (+ 2*2*index_head_dim for the indexer)
  c128_state  fp32 rows of width 2*head_dim; both state pools are paged: npu_state_pool_size(r, P, R)
Every figure is plain integer arithmetic on the config (README, "Memory planning").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from dsv4serve.config import ConfigError, ModelConfig
from dsv4serve.memory.sizing_layout import DTYPE_BYTES, plan_device

WEIGHT_FORMATS = ("official", "bf16")
FP8_BLOCK = 128  # official FP8 linears: one ue8m0 scale byte per 128x128 block
FP4_GROUP = 32  # official MXFP4 experts: one e8m0 scale byte per 32 weights of a row

Tensor = tuple[int, int]  # (parameters, bytes)
POOLS = ("full", "swa", "c4", "c128", "c4_state", "c128_state")  # DSV4's layout, its plan's *_slots


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
    e = DTYPE_BYTES[dtype]
    params, wbytes, groups = count_weights(model, weight_format)
    w_device, kv = plan_device(model, wbytes, dtype, page_size, max_running, hbm_gib, num_devices)
    layout = model.kv_layout
    per_slot, per_request, slots = dict(kv.bytes_per_slot), dict(kv.slots_per_request), dict(kv.slots)
    buffer_per_token = {b.name: b.bytes_per_slot(e) / p.ratio for p in layout.pools for b in p.buffers}
    pool_slots: dict[str, Any] = {f"{name}_slots": slots.get(name, 0) for name in POOLS}
    return SizingPlan(
        dtype=dtype,
        dtype_bytes=e,
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
        swa_bytes_per_token=per_slot["swa"],
        c4_bytes_per_token=buffer_per_token.get("c4", 0.0),
        c4_indexer_bytes_per_token=buffer_per_token.get("c4_index", 0.0),
        c128_bytes_per_token=buffer_per_token.get("c128", 0.0),
        kv_bytes_per_token=kv.kv_bytes_per_token,
        c4_state_bytes_per_slot=per_slot.get("c4_state", 0),
        c128_state_bytes_per_slot=per_slot.get("c128_state", 0),
        swa_slots_per_request=per_request["swa"],
        c4_state_slots_per_request=per_request.get("c4_state", 0),
        c128_state_slots_per_request=per_request.get("c128_state", 0),
        bytes_per_request=kv.bytes_per_request,
        weight_params=params,
        weight_bytes=wbytes,
        weight_bytes_per_device=w_device,
        weight_bytes_by_group=groups,
        budget_bytes=kv.budget_bytes,
        fixed_bytes=kv.fixed_bytes,
        token_budget_bytes=kv.token_budget_bytes,
        **pool_slots,
        kv_bytes=kv.kv_bytes,
        total_bytes=kv.total_bytes,
        fits=kv.fits,
    )


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
