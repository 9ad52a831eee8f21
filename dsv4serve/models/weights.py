"""DeepSeek-V4 checkpoint tensors: official names and shapes, storage dtypes, and the format step.

Names are the official ones (`embed.weight`, `layers.L.attn.wq_a.weight`, ...) without a `model.`
prefix. `expected_tensors` lists what a checkpoint must hold (routed experts one by one, as on disk);
`loaded_tensors` lists what `load_checkpoint` returns (routed experts stacked per layer).

The format step (`dequantize_or_keep`) turns one on-disk tensor and its optional `.scale` companion
into its logical value. FP8 e4m3 with 128x128 block scales (ue8m0 or fp32) is dequantized here;
packed MXFP4 experts are `formats.py`'s. msModelSlim W8A8_DYNAMIC projections (`int8_weight`) stay
int8: `X.weight` with its `X.weight_scale` / `X.weight_offset` companions becomes an `Int8Weight`,
which the model math takes only for the projections `takes_int8` names.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping

import torch

from dsv4serve.config import ModelConfig
from dsv4serve.quant import INT8_SUFFIXES as INT8_PROJECTIONS
from dsv4serve.quant import Int8Weight

Shape = tuple[int, ...]

EXPERT_RE = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")
SCALE_SUFFIX = ".scale"
# msModelSlim / compressed-tensors int8 companions (W8A8); recognised so that they are refused by name.
INT8_SUFFIXES = (
    ".weight_scale",
    ".weight_offset",
    ".input_scale",
    ".input_offset",
    ".deq_scale",
    ".quant_bias",
)
WEIGHT_SCALE = ".weight_scale"
WEIGHT_OFFSET = ".weight_offset"
# msModelSlim quant types (quant_model_description.json) this loader reads
QUANT_FLOAT = "FLOAT"
QUANT_W8A8_DYNAMIC = "W8A8_DYNAMIC"
FP8_DTYPES = (torch.float8_e4m3fn,)
PACKED_FP4_DTYPES = (torch.int8, torch.uint8)
DEFAULT_BLOCK = (128, 128)
MAX_NAMES = 10  # names an error message lists before `... and N more`


class CheckpointError(ValueError):
    """A checkpoint is unreadable or does not match the config; the message names the file or tensors."""


def expected_tensors(model: ModelConfig) -> dict[str, Shape]:
    """Every tensor of an official checkpoint (MTP excluded), by official name, with its logical shape."""
    h, hc = model.hidden_size, model.hc_mult
    mix = (2 + hc) * hc
    out: dict[str, Shape] = {
        "embed.weight": (model.vocab_size, h),
        "head.weight": (model.vocab_size, h),
        "norm.weight": (h,),
        "hc_head_fn": (hc, hc * h),
        "hc_head_base": (hc,),
        "hc_head_scale": (1,),
    }
    for layer in range(model.num_layers):
        p = f"layers.{layer}."
        out |= {p + "attn_norm.weight": (h,), p + "ffn_norm.weight": (h,)}
        for site in ("attn", "ffn"):
            out |= {
                p + f"hc_{site}_fn": (mix, hc * h),
                p + f"hc_{site}_base": (mix,),
                p + f"hc_{site}_scale": (3,),
            }
        out |= _attention_tensors(model, layer, p + "attn.")
        out |= _ffn_tensors(model, layer, p + "ffn.")
    return out


def _attention_tensors(model: ModelConfig, layer: int, p: str) -> dict[str, Shape]:
    h, d, heads = model.hidden_size, model.head_dim, model.num_heads
    out: dict[str, Shape] = {
        p + "wq_a.weight": (model.q_lora_rank, h),
        p + "q_norm.weight": (model.q_lora_rank,),
        p + "wq_b.weight": (heads * d, model.q_lora_rank),
        p + "wkv.weight": (d, h),
        p + "kv_norm.weight": (d,),
        p + "wo_a.weight": (model.o_groups * model.o_lora_rank, heads * d // model.o_groups),
        p + "wo_b.weight": (h, model.o_groups * model.o_lora_rank),
        p + "attn_sink": (heads,),
    }
    ratio = model.compress_ratios[layer]
    if ratio:
        out |= _compressor_tensors(p + "compressor.", ratio, d, h)
    if ratio == 4:
        n, di = model.index_n_heads, model.index_head_dim
        out |= {
            p + "indexer.wq_b.weight": (n * di, model.q_lora_rank),
            p + "indexer.weights_proj.weight": (n, h),
        }
        out |= _compressor_tensors(p + "indexer.compressor.", ratio, di, h)
    return out


def _compressor_tensors(p: str, ratio: int, head_dim: int, hidden: int) -> dict[str, Shape]:
    width = ModelConfig.coff(ratio) * head_dim  # ratio 4 carries two overlapping halves per token
    return {
        p + "wkv.weight": (width, hidden),
        p + "wgate.weight": (width, hidden),
        p + "ape": (ratio, width),
        p + "norm.weight": (head_dim,),
    }


def _ffn_tensors(model: ModelConfig, layer: int, p: str) -> dict[str, Shape]:
    h, inter, num_experts = model.hidden_size, model.moe_intermediate_size, model.n_routed_experts
    shared = model.n_shared_experts * inter
    out: dict[str, Shape] = {p + "gate.weight": (num_experts, h)}
    if layer < model.num_hash_layers:
        out[p + "gate.tid2eid"] = (model.vocab_size, model.num_experts_per_tok)
    else:
        out[p + "gate.bias"] = (num_experts,)
    for e in range(num_experts):
        q = f"{p}experts.{e}."
        out |= {q + "w1.weight": (inter, h), q + "w2.weight": (h, inter), q + "w3.weight": (inter, h)}
    if shared:
        q = p + "shared_experts."
        out |= {q + "w1.weight": (shared, h), q + "w2.weight": (h, shared), q + "w3.weight": (shared, h)}
    return out


def expert_slot(name: str) -> tuple[str, int] | None:
    """`layers.L.ffn.experts.E.wN.weight` -> (`layers.L.ffn.experts.wN`, E); None for other names."""
    m = EXPERT_RE.match(name)
    return (f"{m[1]}.{m[3]}", int(m[2])) if m else None


def takes_int8(name: str) -> bool:
    """Whether the model math takes checkpoint tensor `name` (experts one by one) as an `Int8Weight`."""
    slot = expert_slot(name)
    return (slot[0] if slot else name).endswith(INT8_PROJECTIONS)


def loaded_tensors(model: ModelConfig) -> dict[str, Shape]:
    """Names and shapes `load_checkpoint` returns: experts stacked to [E, I, H] (w1, w3), [E, H, I] (w2)."""
    out: dict[str, Shape] = {}
    for name, shape in expected_tensors(model).items():
        slot = expert_slot(name)
        if slot is None:
            out[name] = shape
        elif slot[1] == 0:
            out[slot[0]] = (model.n_routed_experts, *shape)
    return out


def storage_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """fp32 for mHC, sinks, ape, gate bias and norm weights (as the reference keeps them); int64 tid2eid."""
    if name.endswith("tid2eid"):
        return torch.int64
    if name.startswith("hc_") or ".hc_" in name or name.endswith(("attn_sink", ".ape", "gate.bias")):
        return torch.float32
    if name.endswith("norm.weight"):  # attn_norm, ffn_norm, q_norm, kv_norm, compressor norms, final norm
        return torch.float32
    return dtype


def decode_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 exponent bytes (float8_e8m0fnu or uint8) -> fp32 2^(e-127); 0xFF -> NaN."""
    raw = scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale
    assert raw.dtype == torch.uint8, raw.dtype
    out = torch.ldexp(torch.ones(raw.shape, dtype=torch.float32), raw.to(torch.int32) - 127)
    return out.masked_fill(raw == 0xFF, math.nan)


def dequantize_fp8_block(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: tuple[int, int] = DEFAULT_BLOCK
) -> torch.Tensor:
    """W[n, k] = float(Wq[n, k]) * S[n // bn, k // bk]; S is ue8m0 or fp32, one entry per block."""
    n, k = weight.shape
    bn, bk = block
    grid = (math.ceil(n / bn), math.ceil(k / bk))
    if tuple(scale.shape) != grid:
        raise CheckpointError(f"scale shape {tuple(scale.shape)} does not match {grid} blocks of {block}")
    s = decode_e8m0(scale) if scale.dtype in (torch.float8_e8m0fnu, torch.uint8) else scale.float()
    s = s.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]  # (N, K)
    return (weight.float() * s).to(dtype)


def dequantize_or_keep(
    name: str,
    tensor: torch.Tensor,
    scale: torch.Tensor | None,
    dtype: torch.dtype,
    block: tuple[int, int] = DEFAULT_BLOCK,
) -> torch.Tensor:
    """The logical value of one checkpoint tensor (consuming its `.scale` companion), cast to `dtype`."""
    if scale is None:
        if tensor.dtype in FP8_DTYPES:
            raise CheckpointError(f"{name}: float8 tensor without a {SCALE_SUFFIX} companion")
        return tensor.to(dtype)
    if tensor.dtype in FP8_DTYPES:
        try:
            return dequantize_fp8_block(tensor, scale, dtype, block)
        except CheckpointError as exc:
            raise CheckpointError(f"{name}{SCALE_SUFFIX}: {exc}") from None
    if tensor.dtype in PACKED_FP4_DTYPES:
        raise CheckpointError(f"{name}: packed MXFP4 is read by formats.dequantize_mxfp4, not here")
    raise CheckpointError(f"{name}: dtype {tensor.dtype} cannot carry a {SCALE_SUFFIX} companion")


def int8_companions(
    names: Collection[str], quant_types: Mapping[str, str], expected: Mapping[str, Shape]
) -> dict[str, tuple[str, str]]:
    """Each W8A8_DYNAMIC weight among `names` (msModelSlim types; absent = FLOAT) -> its
    (`.weight_scale`, `.weight_offset`) names. Refuses other quant types, int8 on tensors the model
    takes only in floating point, missing companions, and experts of one layer mixing formats."""
    typed = {n: quant_types.get(n, QUANT_FLOAT) for n in names}
    other = [f"{n} ({t})" for n, t in typed.items() if t not in (QUANT_FLOAT, QUANT_W8A8_DYNAMIC)]
    if other:
        raise CheckpointError(
            f"quant types other than {QUANT_W8A8_DYNAMIC} and {QUANT_FLOAT} are not supported: "
            f"{listed(sorted(other))}"
        )
    quantized = [
        n
        for n, t in typed.items()
        if t == QUANT_W8A8_DYNAMIC and not n.endswith((WEIGHT_SCALE, WEIGHT_OFFSET))
    ]
    refused = [f"{n} ({QUANT_W8A8_DYNAMIC})" for n in quantized if n in expected and not takes_int8(n)]
    if refused:
        raise CheckpointError(
            f"quantized tensors the model takes only in floating point: {listed(sorted(refused))}"
        )
    out: dict[str, tuple[str, str]] = {}
    for name in quantized:
        base = name.removesuffix(".weight")
        pair = (base + WEIGHT_SCALE, base + WEIGHT_OFFSET)
        absent = [c for c in pair if c not in typed]
        if absent:
            raise CheckpointError(f"{name}: {QUANT_W8A8_DYNAMIC} weight without {' and '.join(absent)}")
        out[name] = pair
    check_uniform_experts(out, expected)
    return out


def check_uniform_experts(int8: Mapping[str, object], expected: Mapping[str, Shape]) -> None:
    """Each layer's experts are all int8 or all float per projection, gate and up alike (they load into
    one buffer)."""
    kinds: dict[str, set[bool]] = {}
    for name in expected:
        slot = expert_slot(name)
        if slot is not None:
            stem, _, leaf = slot[0].rpartition(".")
            kinds.setdefault(f"{stem}.w1/w3" if leaf in ("w1", "w3") else slot[0], set()).add(name in int8)
    mixed = sorted(stacked for stacked, seen in kinds.items() if len(seen) > 1)
    if mixed:
        raise CheckpointError(f"experts mix {QUANT_W8A8_DYNAMIC} and {QUANT_FLOAT}: {listed(mixed)}")


def listed(names: list[str]) -> str:
    """The first MAX_NAMES names, comma-separated, then how many more."""
    more = len(names) - MAX_NAMES
    return ", ".join(names[:MAX_NAMES]) + (f" ... and {more} more" if more > 0 else "")


def int8_weight(
    name: str, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None = None
) -> Int8Weight:
    """W8A8 `X.weight` int8 (out, in) with `X.weight_scale` (and msModelSlim's `X.weight_offset`;
    [out] or [out, 1]) -> `Int8Weight` with an fp32 (out,) scale. Offsets must be zero (symmetric)."""
    base = name.removesuffix(".weight")
    if qweight.dtype != torch.int8:
        raise CheckpointError(f"{name}: W8A8_DYNAMIC weight of dtype {qweight.dtype}, expected int8")
    if offset is not None and bool(offset.ne(0).any()):
        raise CheckpointError(
            f"{base}{WEIGHT_OFFSET}: non-zero offsets (asymmetric int8) are not supported, "
            "W8A8_DYNAMIC weights must be symmetric"
        )
    flat = scale.float().reshape(-1)  # (out,)
    if not bool(torch.isfinite(flat).all()):
        raise CheckpointError(f"{base}{WEIGHT_SCALE}: non-finite scales")
    return Int8Weight(qweight, flat)
